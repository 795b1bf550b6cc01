// Starting a release hands back the Releasing token, to complete: the result must be used.
#![deny(unused_must_use)]
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(4096).unwrap();
    reserved.release();
}
