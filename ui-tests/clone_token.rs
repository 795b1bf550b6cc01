// A token is the only owner of its range: it cannot be cloned.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(4096).unwrap().commit().unwrap();
    let _twin = committed.clone();
}
