// A token borrows its device (through its binding): the device cannot be dropped while it lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    // Leaked, so that only the token keeps the device borrowed.
    let binding: &_ = Box::leak(Box::new(device.bind(Budget::unlimited()).unwrap()));
    let token = binding.reserve(4096).unwrap().commit().unwrap();
    drop(device);
    drop(token);
}
