// A transfer engine's registration borrows the token: it cannot be released while registered.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(4096).unwrap().commit().unwrap();
    let registration = a.register();
    let releasing = a.release();
    println!("{:?}", registration.descriptor());
    drop(releasing);
}
