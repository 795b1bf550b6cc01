// An engine moves to another thread with what it keeps, but a prefix cache does not move: its
// hook may hold anything (an `Rc`, the KV cache itself). The compiler's message names the KV
// cache's public mark, `memtoken::kv::OneThread`, not a private type.
use memtoken::backend::HostBackend;
use memtoken::kv::{Layout, PrefixCache};
use memtoken::{Budget, Engine, Keeps};

struct Serving;
impl Keeps<HostBackend> for Serving {
    type Of<'e> = PrefixCache<'e, 'e, 'e, 'e, HostBackend, u64>;
}

fn main() {
    let engine = Engine::<HostBackend, Serving>::new(
        HostBackend::with_defaults().unwrap(),
        Budget::unlimited(),
        &Layout::new(64, 16).plane(4096),
        |parts| Ok(PrefixCache::new(parts.cache)?),
    )
    .unwrap();
    std::thread::spawn(move || drop(engine));
}
