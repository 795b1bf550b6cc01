// A token borrows its binding: the binding cannot be dropped while the token lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let token = binding.reserve(4096).unwrap().commit().unwrap();
    drop(binding);
    drop(token);
}
