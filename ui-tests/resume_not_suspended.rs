// Only a suspended token resumes: a committed allocation has no `resume`.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let awake = binding.reserve(4096).unwrap().commit().unwrap();
    let _ = awake.resume();
}
