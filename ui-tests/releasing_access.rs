// A Releasing token has been retired from use: it lends no memory.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let releasing = binding.reserve(4096).unwrap().commit().unwrap().release();
    let _bytes = releasing.as_slice();
}
