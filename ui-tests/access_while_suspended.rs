// A suspended allocation maps nothing: it has no access methods.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let asleep = binding.reserve(4096).unwrap().commit().unwrap().suspend().unwrap();
    println!("{}", asleep.as_slice()[0]);
}
