// A token can be released only once: the first `release()` consumes it.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(4096).unwrap().commit().unwrap();
    let _first = committed.release();
    let _second = committed.release();
}
