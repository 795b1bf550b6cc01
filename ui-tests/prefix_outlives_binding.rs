// A sharer's prefix mapping borrows the binding (the context pin) it was made through: the
// binding cannot be dropped while the mapping lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let prefix = owner.reserve(1).unwrap().commit_prefix().unwrap();
    let sharer = device.bind(Budget::unlimited()).unwrap();
    let shared = sharer.reserve(1).unwrap().map_prefix(&prefix).unwrap();
    drop(sharer);
    drop(shared);
}
