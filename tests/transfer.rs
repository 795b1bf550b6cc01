//! Descriptors for transfer engines: a registration borrows its token (so the memory stays
//! mapped while it lives), and its generation lets a registration cache refuse an address
//! that another allocation recycled.

use memtoken::backend::cuda::{CudaBackend, DriverModel};
use memtoken::backend::{HostBackend, Location, SimBackend};
use memtoken::{Budget, Descriptor, Device, make_guard};
use std::collections::HashMap;

/// A transfer engine's registration cache, keyed by address as engines key it; an entry is
/// reused only when the generation matches too.
#[derive(Default)]
struct RegistrationCache {
    by_addr: HashMap<usize, Descriptor>,
}

impl RegistrationCache {
    /// Whether `d` may reuse a cached registration (else the engine registers it anew).
    fn hit(&mut self, d: Descriptor) -> bool {
        match self.by_addr.insert(d.addr, d) {
            Some(old) => old.len == d.len && old.generation == d.generation,
            None => false,
        }
    }
}

#[test]
#[cfg_attr(miri, ignore = "host backend: Miri has no memfd or MAP_FIXED mmap")]
fn a_descriptor_says_where_how_long_which_device_and_which_allocation() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(3 * 4096).unwrap().commit().unwrap();
    let d = a.register().descriptor();
    assert_eq!((d.addr, d.len), (a.addr(), 3 * 4096));
    assert_eq!(
        (d.location, d.generation, d.writable),
        (Location::Host, a.generation(), false)
    );
    assert!(a.register_mut().descriptor().writable);
    let prefix = binding.reserve(4096).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(4096).unwrap().map_prefix(&prefix).unwrap();
    let d = shared.register().descriptor();
    assert!(!d.writable && d.generation == shared.generation());

    let model = DriverModel::default();
    make_guard!(cuda_guard);
    let gpu = Device::new(cuda_guard, CudaBackend::new(model, 0).unwrap());
    let gpu_binding = gpu.bind(Budget::unlimited()).unwrap();
    let b = gpu_binding.reserve(1).unwrap().commit().unwrap();
    assert!(matches!(
        b.register().descriptor().location,
        Location::Cuda { .. }
    ));
}

#[test]
fn a_registration_cache_keyed_with_the_generation_refuses_a_recycled_address() {
    make_guard!(guard);
    // The simulator hands the lowest free range out again at once: the address is recycled.
    let device = Device::new(guard, SimBackend::strict());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut cache = RegistrationCache::default();
    let a = binding.reserve(1).unwrap().commit().unwrap();
    let first = a.register().descriptor();
    assert!(!cache.hit(first), "registered anew");
    assert!(
        cache.hit(a.register().descriptor()),
        "the same allocation: reused"
    );
    a.release().complete().unwrap();

    let b = binding.reserve(1).unwrap().commit().unwrap();
    let second = b.register().descriptor();
    assert_eq!(second.addr, first.addr, "the address was recycled");
    assert_ne!(second.generation, first.generation);
    assert!(
        !cache.hit(second),
        "a stale registration is not reused for new memory"
    );
}
