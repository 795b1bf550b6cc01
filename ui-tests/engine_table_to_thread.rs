// A block table moves to another thread only with its engine: inside `Engine::with` it carries
// a brand of the call's own, at which it is not `Send`, so a closure cannot hand it to a thread
// while the cache it borrows (not `Sync`) stays on this one.
use memtoken::backend::HostBackend;
use memtoken::kv::{BlockTable, Layout};
use memtoken::{Budget, Engine, Keeps};

struct Tables;
impl Keeps<HostBackend> for Tables {
    type Of<'e> = Vec<BlockTable<'e, 'e, 'e, 'e, HostBackend>>;
}

fn main() {
    let mut engine = Engine::<HostBackend, Tables>::new(
        HostBackend::with_defaults().unwrap(),
        Budget::unlimited(),
        &Layout::new(64, 16).plane(4096),
        |parts| Ok(vec![parts.cache.table()]),
    )
    .unwrap();
    engine.with(|_, tables| {
        let table = tables.pop().unwrap();
        std::thread::scope(|s| {
            s.spawn(move || drop(table));
        });
    });
}
