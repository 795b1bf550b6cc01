// The same with two real devices: each `make_guard!` brands its device uniquely.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard_a);
    make_guard!(guard_b);
    let device_a = Device::new(guard_a, SimBackend::default());
    let device_b = Device::new(guard_b, SimBackend::default());
    let binding_a = device_a.bind(Budget::unlimited()).unwrap();
    let binding_b = device_b.bind(Budget::unlimited()).unwrap();
    let prefix = binding_a.reserve(1).unwrap().commit_prefix().unwrap();
    let _ = binding_b.reserve(1).unwrap().map_prefix(&prefix);
}
