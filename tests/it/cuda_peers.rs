//! Peer access in the token. A CUDA backend given peers grants them access
//! in the same `cuMemSetAccess` call as its own device at every map, so no remap — a region's
//! regrown granule, a copy-on-write boundary, memory woken at the same address — leaves a peer
//! out (NCCL deadlocked for 56 minutes on such a remap: openxla/xla#40852).
//!
//! The driver model has three devices here (1 and 2 may access device 0's memory) and records
//! the access each device has at each address (`access_of`). It also panics on its own when a
//! new mapping's first access leaves out a device that had access in its reservation, so a
//! backend that forgot a peer fails these tests twice over.

use crate::common;
use crate::common::Grown;

use common::pattern;
use memtoken::backend::{Access, Addr, Backend};
use memtoken::backend::{
    cuda::{CuError, CudaBackend, CudaError, Driver, DriverCall},
    doubles::{DriverModel, ModelConfig},
};
use memtoken::{Budget, Device, make_guard};

const G: usize = common::MODEL_GRANULARITY;

/// Three devices; 1 and 2 can access memory on device 0 (not the other way round).
fn config() -> ModelConfig {
    ModelConfig {
        devices: 3,
        peer_access: vec![(1, 0), (2, 0)],
        ..common::model_config()
    }
}

fn model() -> DriverModel {
    DriverModel::new(config()).unwrap()
}

/// Device 0, with devices 1 and 2 as its peers.
fn backend(model: &DriverModel) -> CudaBackend<DriverModel> {
    CudaBackend::new(model.clone(), 0)
        .unwrap()
        .with_peers(&[1, 2])
        .expect("1 and 2 may access device 0's memory")
}

/// Asserts that devices 0, 1 and 2 each have `access` to every granule of `[addr, addr + len)`.
#[track_caller]
fn all_have(model: &DriverModel, addr: Addr, len: usize, access: Option<Access>, what: &str) {
    for granule in 0..len / G {
        for device in 0..3 {
            assert_eq!(
                model.access_of((addr + granule * G) as u64, device),
                access,
                "{what}: device {device}, granule {granule}"
            );
        }
    }
}

// ---- Opening: each peer is checked, none is dropped silently. ----

#[test]
fn each_peer_is_asked_about_when_the_backend_is_opened() {
    let m = model();
    let b = backend(&m);
    assert_eq!(b.peers(), &[1, 2]);
    assert_eq!(m.count(DriverCall::DeviceCanAccessPeer), 2);
    assert_eq!(
        CudaBackend::new(m.clone(), 0).unwrap().peers(),
        &[] as &[i32],
        "no peers unless given"
    );
}

#[test]
fn a_peer_that_cannot_access_the_device_is_an_error_not_dropped() {
    let m = DriverModel::new(ModelConfig {
        peer_access: vec![(1, 0)],
        ..config()
    })
    .unwrap();
    let e = CudaBackend::new(m.clone(), 0)
        .unwrap()
        .with_peers(&[1, 2])
        .unwrap_err();
    assert_eq!(e, CudaError::NoPeerAccess { device: 0, peer: 2 });
    assert!(
        e.to_string().contains("cuDeviceCanAccessPeer(2, 0) said 0"),
        "{e}"
    );
    assert_eq!(m.outstanding().retains, 0, "the backend was dropped");
}

#[test]
fn a_bad_peer_list_is_an_error() {
    let m = model();
    let open = || CudaBackend::new(m.clone(), 0).unwrap();
    let bad = |peers: &[i32]| match open().with_peers(peers) {
        Err(CudaError::BadPeers(why)) => why,
        other => panic!("{peers:?}: {other:?}"),
    };
    assert!(bad(&[0]).contains("own device"));
    assert!(bad(&[1, 1]).contains("named twice"));
    assert_eq!(
        open().with_peers(&[3]).unwrap_err(),
        CudaError::Driver {
            call: DriverCall::DeviceGet,
            error: CuError::INVALID_DEVICE
        }
    );
    m.fail_nth(DriverCall::DeviceCanAccessPeer, 1, CuError::UNKNOWN);
    assert_eq!(
        open().with_peers(&[1]).unwrap_err(),
        CudaError::Driver {
            call: DriverCall::DeviceCanAccessPeer,
            error: CuError::UNKNOWN
        }
    );
    // Memory mapped before the peers were set would lack their access.
    let early = open();
    let (addr, phys) = (early.reserve(G).unwrap(), early.create(G).unwrap());
    early.map(addr, G, phys, Access::ReadWrite).unwrap();
    assert!(matches!(
        early.with_peers(&[1]),
        Err(CudaError::BadPeers(_))
    ));
}

// ---- Every map: the device and every peer, in one call. ----

#[test]
fn a_commit_gives_the_device_and_every_peer_access_in_one_call() {
    let m = model();
    make_guard!(guard);
    let device = Device::new(guard, backend(&m));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let calls = m.count(DriverCall::MemSetAccess);
    let a = binding.reserve(2 * G).unwrap().commit().unwrap();
    assert_eq!(a.peers(), &[1, 2], "the token names its peers");
    assert_eq!(
        m.count(DriverCall::MemSetAccess),
        calls + 1,
        "one call for all three devices"
    );
    all_have(&m, a.addr(), 2 * G, Some(Access::ReadWrite), "committed");
    let addr = a.addr();
    a.release().complete().unwrap();
    all_have(&m, addr, 2 * G, None, "released");
    drop(binding);
    assert!(device.close().is_clean());
    assert!(m.outstanding().is_zero());
}

// ---- Remaps: a region grown after a shrink. ----

#[test]
fn a_region_grown_after_a_shrink_gives_every_peer_its_access_back() {
    let m = model();
    make_guard!(guard);
    let device = Device::new(guard, backend(&m));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * G).unwrap().into_region().grown(3);
    assert_eq!(region.peers(), &[1, 2]);
    let at = region.addr();
    all_have(&m, at, 3 * G, Some(Access::ReadWrite), "grown");
    region.shrink(2).unwrap();
    all_have(&m, at, G, Some(Access::ReadWrite), "kept");
    all_have(&m, at + G, 2 * G, None, "shrunk");
    let maps = m.count(DriverCall::MemMap);
    let region = region.grown(3);
    assert_eq!(m.count(DriverCall::MemMap), maps + 3, "remapped");
    all_have(&m, at, 4 * G, Some(Access::ReadWrite), "regrown");
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(m.outstanding().is_zero());
}

// ---- Remaps: the boundary granule of a copy-on-write. ----

#[test]
fn the_copy_on_write_boundary_is_remapped_with_every_peer() {
    let m = model();
    make_guard!(guard);
    let device = Device::new(guard, backend(&m));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(2 * G).unwrap().commit_prefix().unwrap();
    let bytes = pattern(2 * G, 3);
    prefix
        .copy_from_host(0, &bytes)
        .expect("no sharer yet")
        .unwrap();
    all_have(&m, prefix.addr(), 2 * G, Some(Access::ReadWrite), "owner");
    let shared = binding.reserve(2 * G).unwrap().map_prefix(&prefix).unwrap();
    let at = shared.addr();
    all_have(
        &m,
        at,
        2 * G,
        Some(Access::ReadOnly),
        "sharer: read-only for all",
    );
    let diverged = shared.diverge().unwrap();
    assert_eq!(diverged.peers(), &[1, 2]);
    all_have(&m, at, G, Some(Access::ReadOnly), "diverged body");
    let boundary = at + diverged.boundary_offset();
    all_have(
        &m,
        boundary,
        G,
        Some(Access::ReadWrite),
        "diverged boundary",
    );
    all_have(
        &m,
        prefix.addr(),
        2 * G,
        Some(Access::ReadWrite),
        "owner after",
    );
    let mut seen = vec![0; 2 * G];
    diverged.copy_to_host(0, &mut seen).unwrap();
    assert!(seen == bytes, "the boundary was copied");
    drop((diverged, prefix));
    drop(binding);
    assert!(device.close().is_clean());
    assert!(m.outstanding().is_zero());
}

// ---- Wake: memory mapped again at the same address. ----

#[test]
fn memory_woken_at_the_same_address_gives_every_peer_its_access_back() {
    let m = model();
    make_guard!(guard);
    let device = Device::new(guard, backend(&m));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * G).unwrap().commit().unwrap();
    let bytes = pattern(2 * G, 5);
    a.copy_from_host(0, &bytes).unwrap();
    let region = binding.reserve(4 * G).unwrap().into_region().grown(2);
    let (addr, raddr) = (a.addr(), region.addr());

    let asleep = a.suspend_saving().unwrap();
    let region_asleep = region.suspend().unwrap();
    assert_eq!(
        asleep.peers(),
        &[1, 2],
        "a sleeping token names its peers too"
    );
    all_have(&m, addr, 2 * G, None, "asleep");
    all_have(&m, raddr, 2 * G, None, "region asleep");

    let a = asleep.resume().unwrap();
    let region = region_asleep.resume().unwrap();
    assert_eq!((a.addr(), region.addr()), (addr, raddr));
    all_have(&m, addr, 2 * G, Some(Access::ReadWrite), "woken");
    all_have(&m, raddr, 2 * G, Some(Access::ReadWrite), "region woken");
    let mut seen = vec![0; 2 * G];
    a.copy_to_host(0, &mut seen).unwrap();
    assert!(seen == bytes, "restored");
    drop((a, region));
    drop(binding);
    assert!(device.close().is_clean());
    assert!(m.outstanding().is_zero());
}

// ---- The model's own checks (facts 18, 31, 32). ----

/// A model with its context current, a two-granule reservation and a one-granule handle on
/// device 0, with devices 1 and 2 asked about (both said 1): (model, reservation, handle).
fn raw() -> (DriverModel, u64, u64) {
    let m = model();
    m.init().unwrap();
    let ctx = m.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { m.ctx_set_current(ctx) }.unwrap();
    assert_eq!(m.device_can_access_peer(1, 0), Ok(true));
    assert_eq!(m.device_can_access_peer(2, 0), Ok(true));
    let ptr = m.mem_address_reserve(2 * G, G, 0).unwrap();
    let handle = m.mem_create(G, 0).unwrap();
    // SAFETY: the first granule of the fresh reservation is unmapped; `handle` is live and one
    // granule long.
    unsafe { m.mem_map(ptr, G, 0, handle) }.unwrap();
    (m, ptr, handle)
}

#[test]
fn one_call_grants_each_device_its_own_flags() {
    let (m, ptr, _) = raw();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping.
    unsafe { m.mem_set_access(ptr, G, &[(0, true), (1, false), (2, true)]) }.unwrap();
    assert_eq!(m.access_of(ptr, 0), Some(Access::ReadWrite));
    assert_eq!(m.access_of(ptr, 1), Some(Access::ReadOnly));
    assert_eq!(m.access_of(ptr, 2), Some(Access::ReadWrite));
    assert_eq!(m.access_of(ptr + G as u64, 0), None, "not mapped");
}

#[test]
fn a_peer_told_no_fails_the_whole_call_and_nothing_is_granted() {
    let m = DriverModel::new(ModelConfig {
        peer_access: vec![(1, 0)],
        ..config()
    })
    .unwrap();
    m.init().unwrap();
    let ctx = m.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model; the fresh reservation is unmapped,
    // `handle` live and one granule long, and the mapping exactly `[ptr, ptr + G)`.
    unsafe {
        m.ctx_set_current(ctx).unwrap();
        assert_eq!(m.device_can_access_peer(2, 0), Ok(false));
        let ptr = m.mem_address_reserve(G, G, 0).unwrap();
        let handle = m.mem_create(G, 0).unwrap();
        m.mem_map(ptr, G, 0, handle).unwrap();
        assert_eq!(
            m.mem_set_access(ptr, G, &[(0, true), (2, true)]),
            Err(CuError::INVALID_DEVICE)
        );
        assert_eq!(m.access_of(ptr, 0), None, "not even the owner's");
    }
}

#[test]
#[should_panic(expected = "a peer lost access across a remap")]
fn a_remap_that_leaves_out_a_peer_is_misuse() {
    let (m, ptr, handle) = raw();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping, unmapped and mapped again with the
    // live one-granule `handle` (the model panics at the second access: see above).
    unsafe {
        m.mem_set_access(ptr, G, &[(0, true), (1, true)]).unwrap();
        m.mem_unmap(ptr, G).unwrap();
        m.mem_map(ptr, G, 0, handle).unwrap();
        let _ = m.mem_set_access(ptr, G, &[(0, true)]);
    }
}

#[test]
#[should_panic(expected = "a peer lost access across a remap")]
fn a_new_mapping_beside_one_a_peer_can_reach_must_name_it_too() {
    let (m, ptr, _) = raw();
    let next = ptr + G as u64;
    let other = m.mem_create(G, 0).unwrap();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping; the reservation's second granule
    // is unmapped and `other` live and one granule long (the model panics: see above).
    unsafe {
        m.mem_set_access(ptr, G, &[(0, true), (2, false)]).unwrap();
        m.mem_map(next, G, 0, other).unwrap();
        let _ = m.mem_set_access(next, G, &[(0, true), (1, true)]);
    }
}

#[test]
fn a_freed_reservation_forgets_its_peers() {
    let (m, ptr, handle) = raw();
    // SAFETY: the mapping, reservation and handle are each live and given back once; the new
    // reservation is unmapped and `fresh` live and one granule long.
    unsafe {
        m.mem_set_access(ptr, G, &[(0, true), (1, true)]).unwrap();
        m.mem_unmap(ptr, G).unwrap();
        m.mem_address_free(ptr, 2 * G).unwrap();
        m.mem_release(handle).unwrap();
        let again = m.mem_address_reserve(2 * G, G, 0).unwrap();
        let fresh = m.mem_create(G, 0).unwrap();
        m.mem_map(again, G, 0, fresh).unwrap();
        m.mem_set_access(again, G, &[(0, true)])
            .expect("a new reservation starts with no peers, wherever it lands");
    }
}

#[test]
#[should_panic(expected = "device 1 is named twice")]
fn a_descriptor_list_naming_a_device_twice_is_misuse() {
    let (m, ptr, _) = raw();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping (the model panics: see above).
    let _ = unsafe { m.mem_set_access(ptr, G, &[(0, true), (1, true), (1, false)]) };
}

#[test]
#[should_panic(expected = "unknown device 3")]
fn a_descriptor_for_an_unknown_device_is_misuse() {
    let (m, ptr, _) = raw();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping (the model panics: see above).
    let _ = unsafe { m.mem_set_access(ptr, G, &[(0, true), (3, true)]) };
}

#[test]
#[should_panic(expected = "no access descriptor")]
fn an_empty_descriptor_list_is_misuse() {
    let (m, ptr, _) = raw();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping (the model panics: see above).
    let _ = unsafe { m.mem_set_access(ptr, G, &[]) };
}

#[test]
#[should_panic(expected = "without asking cuDeviceCanAccessPeer(1, 0) first")]
fn a_peer_never_asked_about_is_misuse_in_a_list_too() {
    let m = model();
    m.init().unwrap();
    let ctx = m.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model; the fresh reservation is unmapped and
    // `handle` live and one granule long; the mapping is exactly `[ptr, ptr + G)` (the model
    // panics: see above).
    unsafe {
        m.ctx_set_current(ctx).unwrap();
        let ptr = m.mem_address_reserve(G, G, 0).unwrap();
        let handle = m.mem_create(G, 0).unwrap();
        m.mem_map(ptr, G, 0, handle).unwrap();
        let _ = m.mem_set_access(ptr, G, &[(0, true), (1, true)]);
    }
}

/// A peer's work is not fenced (its events are in its own context), so it is
/// declared: while `peer_work` lives, a release waits — pending, and deferred on drop — and
/// once it drops (the peer's kernel done), the release completes. Without the declaration the
/// release would complete at once under the peer's kernel.
#[test]
fn a_release_waits_while_peer_work_is_declared() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, backend(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (a, b) = (
        binding.reserve(G).unwrap().commit().unwrap(),
        binding.reserve(G).unwrap().commit().unwrap(),
    );
    let peer_kernel = device.peer_work();
    let releasing = match a.release().complete().map_err(|e| e.into_token()) {
        Err(memtoken::errors::Returned::Unchanged(releasing)) => releasing,
        _ => panic!("released while a peer's work may use the memory"),
    };
    drop(b);
    assert_eq!(device.poll().deferred, 1, "the drop waits too");
    let nested = device.peer_work();
    drop(peer_kernel);
    assert_eq!(device.poll().deferred, 1, "declarations nest");
    drop(nested);
    releasing.complete().map_err(|e| e.cause).unwrap();
    assert_eq!(device.poll().deferred, 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A device dropped while peer work is declared (the guard forgotten) cannot wait for the
/// peer: what waits is left to the driver and reported, never freed under the peer's work.
#[test]
fn a_device_dropped_under_declared_peer_work_reports_what_it_left() {
    let model = model();
    let (sent, seen) = std::sync::mpsc::channel();
    {
        make_guard!(guard);
        let device = Device::new(guard, backend(&model));
        device.report_drop_to(move |report| sent.send(*report).unwrap());
        let binding = device.bind(Budget::unlimited()).unwrap();
        let a = binding.reserve(G).unwrap().commit().unwrap();
        std::mem::forget(device.peer_work());
        drop(a);
        drop(binding);
    }
    let report = seen.try_recv().unwrap();
    assert_eq!(report.left_waiting.count, 1, "{report:?}");
    assert_eq!(model.lost_with(), None);
}
