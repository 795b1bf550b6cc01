// A Reserved token has VA only, nothing mapped: it lends no memory.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(4096).unwrap();
    let _bytes = reserved.as_slice();
}
