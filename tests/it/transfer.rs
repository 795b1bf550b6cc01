//! Descriptors for transfer engines: a registration borrows its token (so the memory stays
//! mapped while it lives), and its generation lets a registration cache refuse an address
//! that another allocation recycled.

use memtoken::backend::{Location, PosixFd, doubles::SimBackend};
use memtoken::backend::{cuda::CudaBackend, doubles::DriverModel};
use memtoken::{
    Budget, Device, make_guard, sharing::Offer, transfer::Descriptor, transfer::Registration,
};
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
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn a_descriptor_says_where_how_long_which_device_and_which_allocation() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
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

/// The segments of `registration`, checked: in address order, contiguous, together exactly
/// its descriptor's range, each with its location, generation and writability. Their lengths.
fn segment_lens(registration: &Registration<'_>) -> Vec<usize> {
    let whole = registration.descriptor();
    let segments: Vec<Descriptor> = registration.segments().collect();
    let mut at = whole.addr;
    for s in &segments {
        assert_eq!(s.addr, at, "contiguous, in address order: {segments:?}");
        assert_eq!(
            (s.location, s.generation, s.writable),
            (whole.location, whole.generation, whole.writable)
        );
        at += s.len;
    }
    assert_eq!(at, whole.addr + whole.len, "the whole range: {segments:?}");
    segments.iter().map(|s| s.len).collect()
}

/// Fact 24: on VMM memory `cuMemGetAddressRange` resolves an address to one mapped segment, the
/// mapping of one physical allocation (the model's `address_range`). Each segment of
/// `registration` is exactly what it resolves every address inside to.
fn assert_each_segment_is_one_allocation(model: &DriverModel, registration: &Registration<'_>) {
    for s in registration.segments() {
        let (first, last) = (s.addr as u64, (s.addr + s.len - 1) as u64);
        for addr in [first, last] {
            assert_eq!(
                model.address_range(addr),
                Some((first, s.len)),
                "{addr:#x} of {s:?}"
            );
        }
    }
}

/// A prefix longer than one granule is two physical allocations, body and boundary, under one
/// contiguous range: its registration (owner's, sharer's, diverged, exportable) has one segment
/// per allocation, each exactly the range an engine resolving with `cuMemGetAddressRange` sees,
/// where the one descriptor covers both; a one-granule prefix and a committed allocation have
/// one segment, the descriptor itself.
#[test]
fn a_registration_has_one_segment_per_physical_allocation() {
    let model = DriverModel::default();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();

    let mut committed = binding.reserve(3 * g).unwrap().commit().unwrap();
    let registration = committed.register();
    assert_eq!(segment_lens(&registration), [3 * g]);
    assert_eq!(
        registration.segments().next(),
        Some(registration.descriptor())
    );
    assert_each_segment_is_one_allocation(&model, &registration);
    let registration = committed.register_mut();
    assert_eq!(segment_lens(&registration), [3 * g], "writable too");

    let one = binding.reserve(g).unwrap().commit_prefix().unwrap();
    assert_eq!(segment_lens(&one.register()), [g]);
    assert_each_segment_is_one_allocation(&model, &one.register());

    let prefix = binding.reserve(3 * g).unwrap().commit_prefix().unwrap();
    let whole = prefix.register().descriptor();
    assert_eq!(
        model.address_range(whole.addr as u64),
        Some((whole.addr as u64, 2 * g)),
        "an engine resolving the descriptor's start sees the body only"
    );
    let shared = binding.reserve(3 * g).unwrap().map_prefix(&prefix).unwrap();
    let diverging = binding.reserve(3 * g).unwrap().map_prefix(&prefix).unwrap();
    let diverged = diverging.diverge().unwrap();
    let exportable = binding
        .reserve(3 * g)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    for registration in [
        prefix.register(),
        shared.register(),
        diverged.register(),
        exportable.register(),
    ] {
        assert_eq!(segment_lens(&registration), [2 * g, g], "body, boundary");
        assert_each_segment_is_one_allocation(&model, &registration);
    }
    drop((shared, diverged, exportable, prefix, one, committed));
    drop(binding);
    assert!(device.close().is_clean());
}

/// An imported prefix is this process's handles on the exporter's allocations, body and
/// boundary, each mapped on its own: one segment each.
#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn an_imported_prefix_has_one_segment_per_imported_allocation() {
    use std::os::unix::net::UnixStream;
    let model = DriverModel::default();
    make_guard!(ga);
    make_guard!(gb);
    let exporter = Device::new(ga, CudaBackend::new(model.clone(), 0).unwrap());
    let importer = Device::new(gb, CudaBackend::new(model.clone(), 0).unwrap());
    let (owner, reader) = (
        exporter.bind(Budget::unlimited()).unwrap(),
        importer.bind(Budget::unlimited()).unwrap(),
    );
    let g = exporter.granularity();
    for granules in [1, 3] {
        let prefix = owner
            .reserve(granules * g)
            .unwrap()
            .commit_prefix_exportable::<PosixFd>()
            .unwrap();
        let export = prefix.export().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        export.send(&a).unwrap();
        let imported = reader.import(Offer::recv(&b).unwrap()).unwrap();
        let registration = imported.register();
        let want = if granules == 1 {
            vec![g]
        } else {
            vec![2 * g, g]
        };
        assert_eq!(segment_lens(&registration), want);
        assert_each_segment_is_one_allocation(&model, &registration);
        imported.release().complete().unwrap();
        export.end();
        prefix.release().complete().unwrap();
    }
    drop((owner, reader));
    assert!(exporter.close().is_clean());
    assert!(importer.close().is_clean());
}

/// The host backend lays a prefix out the same way: body and boundary, two segments.
#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn a_host_prefix_has_a_segment_for_its_body_and_one_for_its_boundary() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let a = binding.reserve(3 * g).unwrap().commit().unwrap();
    assert_eq!(segment_lens(&a.register()), [3 * g]);
    let one = binding.reserve(g).unwrap().commit_prefix().unwrap();
    assert_eq!(segment_lens(&one.register()), [g]);
    let prefix = binding.reserve(3 * g).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(3 * g).unwrap().map_prefix(&prefix).unwrap();
    assert_eq!(segment_lens(&prefix.register()), [2 * g, g]);
    assert_eq!(segment_lens(&shared.register()), [2 * g, g]);
}

/// Two devices in one process never describe different memory with equal descriptors: two
/// simulators place their first allocations at the same address (each has an address space of
/// its own), and two host devices recycle each other's addresses — yet every descriptor names
/// its own allocation, since generations are unique in the process, not per device.
#[test]
fn two_devices_never_make_equal_descriptors_for_different_memory() {
    two_simulators_at_one_address();
    two_host_devices_recycling_addresses();
}

fn two_simulators_at_one_address() {
    use memtoken::backend::doubles::SimConfig;
    make_guard!(ga);
    make_guard!(gb);
    let a = Device::new(ga, SimBackend::new(SimConfig::strict()).unwrap());
    let b = Device::new(gb, SimBackend::new(SimConfig::strict()).unwrap());
    let (ba, bb) = (
        a.bind(Budget::unlimited()).unwrap(),
        b.bind(Budget::unlimited()).unwrap(),
    );
    let g = a.granularity();
    let x = ba.reserve(g).unwrap().commit().unwrap();
    let y = bb.reserve(g).unwrap().commit().unwrap();
    let (dx, dy) = (x.register().descriptor(), y.register().descriptor());
    assert_eq!(dx.addr, dy.addr, "the same address in both simulators");
    assert_ne!(dx, dy, "different memory, different descriptors");
    drop((x, y));
}

/// Host devices share one address space: what one frees the other gets next.
fn two_host_devices_recycling_addresses() {
    make_guard!(gc);
    make_guard!(gd);
    let c = Device::new(gc, crate::common::host());
    let d = Device::new(gd, crate::common::host());
    let (bc, bd) = (
        c.bind(Budget::unlimited()).unwrap(),
        d.bind(Budget::unlimited()).unwrap(),
    );
    let mut seen: Vec<Descriptor> = Vec::new();
    for _ in 0..32 {
        let t = bc.reserve(4096).unwrap().commit().unwrap();
        seen.push(t.register().descriptor());
        t.release().complete().unwrap();
        let t = bd.reserve(4096).unwrap().commit().unwrap();
        seen.push(t.register().descriptor());
        t.release().complete().unwrap();
    }
    let addrs: std::collections::HashSet<_> = seen.iter().map(|d| d.addr).collect();
    assert!(addrs.len() < seen.len(), "some address was recycled");
    for (i, d) in seen.iter().enumerate() {
        assert!(
            !seen[..i].contains(d),
            "descriptor {i} repeats an earlier one: {d:?}"
        );
    }
}
