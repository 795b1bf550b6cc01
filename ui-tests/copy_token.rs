// A token is not Copy: binding it to another name moves it, and the old name is dead.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(4096).unwrap().commit().unwrap();
    let b = a;
    drop(a);
    drop(b);
}
