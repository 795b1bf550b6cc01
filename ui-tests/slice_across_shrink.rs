// A region's slice borrows the region: it cannot shrink while the slice is still used.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * 4096).unwrap().into_region();
    region.grow(2).unwrap();
    let s = region.as_slice();
    region.shrink(1).unwrap();
    println!("{}", s[4096]);
}
