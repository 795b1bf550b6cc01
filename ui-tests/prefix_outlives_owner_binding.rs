// The owner's prefix handle borrows the owner's binding: the owner cannot drop its binding
// (its context pin) while its prefix lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let prefix = owner.reserve(1).unwrap().commit_prefix().unwrap();
    drop(owner);
    drop(prefix);
}
