// A slice borrows the token: the token cannot be released while the slice is still used.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(4096).unwrap().commit().unwrap();
    let s = a.as_slice();
    let _releasing = a.release();
    println!("{}", s[0]);
}
