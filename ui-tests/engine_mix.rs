// One engine's tokens never meet another's: each call lends its parts for a lifetime of its
// own, so a token made with one engine's binding cannot be kept by another engine.
use memtoken::backend::HostBackend;
use memtoken::{Allocation, Budget, Engine, Keeps, Reserved};

struct Tokens;
impl Keeps<HostBackend> for Tokens {
    type Of<'e> = Vec<Allocation<'e, 'e, HostBackend, Reserved>>;
}

fn main() {
    let new = || {
        Engine::<HostBackend, Tokens>::new(
            HostBackend::with_defaults().unwrap(),
            Budget::unlimited(),
            &memtoken::kv::Layout::new(64, 16).plane(4096),
            |_| Ok(Vec::new()),
        )
        .unwrap()
    };
    let (mut a, mut b) = (new(), new());
    a.with(|pa, _| b.with(|_, kept| kept.push(pa.binding.reserve(4096).unwrap())));
}
