// A sharer's mapping is read-only: it lends `&[u8]`, never `&mut [u8]`.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(4096).unwrap().commit_prefix().unwrap();
    let mut shared = binding.reserve(4096).unwrap().map_prefix(&prefix).unwrap();
    shared.as_mut_slice()[0] = 1;
}
