// Nothing borrowed from an engine outlives the call that lent it.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Engine, Keeps};

struct Nothing;
impl Keeps<HostBackend> for Nothing {
    type Of<'e> = ();
}

fn main() {
    let mut engine = Engine::<HostBackend, Nothing>::new(
        HostBackend::with_defaults().unwrap(),
        Budget::unlimited(),
        &memtoken::kv::Layout::new(64, 16).plane(4096),
        |_| Ok(()),
    )
    .unwrap();
    let token = engine.with(|parts, _| parts.binding.reserve(4096).unwrap());
    drop(engine);
    drop(token);
}
