// A suspended token cannot be suspended again.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let asleep = binding.reserve(4096).unwrap().commit().unwrap().suspend().unwrap();
    let _ = asleep.suspend();
}
