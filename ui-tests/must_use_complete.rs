// A pending or failed completion hands a token back inside the error: the result must be used.
#![deny(unused_must_use)]
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let releasing = binding.reserve(4096).unwrap().commit().unwrap().release();
    releasing.complete();
}
