// `release()` consumes the region: it cannot grow (or lend memory) afterwards.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * 4096).unwrap().into_region();
    region.grow(2).unwrap();
    let _releasing = region.release();
    let _grown = region.grow(1);
}
