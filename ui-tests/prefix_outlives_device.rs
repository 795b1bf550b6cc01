// A prefix mapping cannot outlive the device whose memory it maps.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    // Leaked, so that only the mapping keeps the device borrowed.
    let binding: &_ = Box::leak(Box::new(device.bind(Budget::unlimited()).unwrap()));
    let prefix = binding.reserve(1).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(1).unwrap().map_prefix(&prefix).unwrap();
    drop(prefix);
    drop(device);
    drop(shared);
}
