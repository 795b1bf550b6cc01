//! The driver model's strictest readings of the CUDA facts sheet (`CUDA-FACTS.md`), one group
//! per rule, each named by its fact number: the model refuses, faults or places as the sheet
//! says it should, and the backend and the typed layer still lose nothing.

use crate::common;
use memtoken::backend::{Backend, ConfigError};
use memtoken::backend::{
    cuda::{CuError, CudaBackend, Driver, DriverCall, ErrorFate, ShareableHandle},
    doubles::{CaptureMode, DriverModel, ModelConfig, ModelOutstanding, Placement},
};
use memtoken::{Budget, Device, make_guard};
use std::os::fd::{AsRawFd, OwnedFd};

const G: usize = common::MODEL_GRANULARITY;

fn config() -> ModelConfig {
    common::model_config()
}

/// A model with `config`, initialized, with its context retained and current.
fn opened(config: ModelConfig) -> DriverModel {
    let model = DriverModel::new(config).unwrap();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    model
}

/// Reserves, creates, maps and grants read-write access to `G` bytes on device 0; (address,
/// handle).
fn mapped(model: &DriverModel) -> (u64, u64) {
    let ptr = model.mem_address_reserve(G, G, 0).unwrap();
    let handle = model.mem_create(G, 0).unwrap();
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` bytes long; the
    // mapping just made is exactly `[ptr, ptr + G)`.
    unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
    }
    (ptr, handle)
}

// ---- Fact 21: cuMemUnmap does not wait for work in flight. ----

#[test]
fn unmapping_memory_under_running_work_faults_when_the_work_completes() {
    let model = opened(config());
    let stream = model.new_stream();
    let (ptr, handle) = mapped(&model);
    model.submit_work_on(stream); // a kernel that may use `ptr`
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping; `handle` is live.
    unsafe {
        model
            .mem_unmap(ptr, G)
            .expect("the unmap itself does not wait");
        model.mem_release(handle).unwrap();
    }
    assert_eq!(model.lost_with(), None, "nothing has touched it yet");
    model.complete_work_on(stream);
    assert_eq!(
        model.event_create().unwrap_err(),
        CuError::ILLEGAL_ADDRESS,
        "the kernel faulted on the unmapped range: the context is lost, sticky"
    );
    assert_eq!(model.device_get(0).unwrap_err(), CuError::ILLEGAL_ADDRESS);
}

#[test]
fn synchronizing_work_whose_memory_was_unmapped_returns_illegal_address() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let (ptr, _handle) = mapped(&model);
    model.submit_work();
    let event = model.event_create().unwrap();
    // SAFETY: `event` is live, stream 0 always is; `[ptr, ptr + G)` is exactly one mapping.
    unsafe {
        model.event_record(event, 0).unwrap();
        model.mem_unmap(ptr, G).unwrap();
        assert_eq!(
            model.event_synchronize(event).unwrap_err(),
            CuError::ILLEGAL_ADDRESS
        );
    }
}

#[test]
fn memory_mapped_after_the_work_was_submitted_may_be_unmapped_under_it() {
    let model = opened(config());
    let stream = model.new_stream();
    let (old, _) = mapped(&model);
    model.submit_work_on(stream);
    let (new, _) = mapped(&model); // given access after the kernel was launched
    // SAFETY: `[new, new + G)` is exactly one live mapping.
    unsafe { model.mem_unmap(new, G) }.unwrap();
    // Work that named its ranges faults only on those.
    model.submit_work_touching(stream, &[(old, G)]);
    let (other, _) = mapped(&model);
    model.submit_work_touching(stream, &[(old, G)]);
    // SAFETY: as above.
    unsafe { model.mem_unmap(other, G) }.unwrap();
    model.complete_work_on(stream);
    assert_eq!(model.lost_with(), None);
    assert!(model.event_create().is_ok());
}

/// Fact 21: a copy the model runs is work on the legacy stream that touches its source and its
/// destination, no other memory: unmapping another mapping under it harms nothing, unmapping
/// its source faults when it completes.
#[test]
fn a_copy_in_flight_touches_only_its_source_and_destination() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let ((src, _), (dst, _), (other, _)) = (mapped(&model), mapped(&model), mapped(&model));
    // SAFETY: `[src, src + G)` and `[dst, dst + G)` are two live mappings with access; `other`
    // is one live mapping.
    unsafe {
        model.memcpy_dtod(dst, src, G).unwrap();
        model.mem_unmap(other, G).unwrap();
    }
    model.complete_work_on(0);
    assert_eq!(model.lost_with(), None, "the copy never touched `other`");
    // SAFETY: as above.
    unsafe {
        model.memcpy_dtod(dst, src, G).unwrap();
        model.mem_unmap(src, G).unwrap();
    }
    model.complete_work_on(0);
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

/// The backend never unmaps under work on a stream its fences cover; work on a stream it was
/// never told of is the caller's to finish first, and the model shows what happens otherwise.
#[test]
fn a_kernel_on_an_uncovered_stream_faults_once_its_memory_is_released() {
    let model = DriverModel::new(ModelConfig {
        events_complete_at_once: false,
        ..config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (covered, uncovered) = (model.new_stream(), model.new_stream());
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(covered) };
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(covered);
    drop(a);
    assert_eq!(device.poll().deferred, 1, "waits for the covered stream");
    model.complete_work_on(covered);
    assert_eq!(device.poll().released, 1);
    assert_eq!(model.lost_with(), None, "nothing was unmapped under it");

    let b = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(uncovered);
    let unmaps = model.count(DriverCall::MemUnmap);
    drop(b);
    device.poll();
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps + 1,
        "released under the kernel"
    );
    model.complete_work_on(uncovered);
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
    assert!(binding.reserve(G).is_err());
    assert!(device.confirm_context_lost().is_some());
}

// ---- Fact 12: an address hint to cuMemAddressReserve may be ignored. ----

const PLACEMENTS: [Placement; 5] = [
    Placement::LowestFirst,
    Placement::TopDown,
    Placement::Scattered { seed: 1 },
    Placement::Scattered { seed: 2 },
    Placement::Scattered { seed: 0x5eed },
];

#[test]
fn an_address_hint_is_ignored() {
    for placement in PLACEMENTS {
        let model = opened(ModelConfig {
            placement,
            ..config()
        });
        let first = model.mem_address_reserve(G, G, 0).unwrap();
        let hint = first + 64 * G as u64; // free and aligned
        let second = model.mem_address_reserve(G, G, hint).unwrap();
        assert_ne!(second, hint, "{placement:?}");
        assert_ne!(second, first, "{placement:?}");
    }
}

#[test]
fn by_default_reservations_do_not_land_in_the_lowest_gap() {
    let model = opened(config());
    let first = model.mem_address_reserve(G, G, 0).unwrap();
    let second = model.mem_address_reserve(G, G, 0).unwrap();
    assert_ne!(second, first + G as u64, "placed right after the first");
    // SAFETY: `first` is exactly one live reservation with nothing mapped.
    unsafe { model.mem_address_free(first, G) }.unwrap();
    let third = model.mem_address_reserve(G, G, 0).unwrap();
    assert_ne!(third, first, "the freed gap was filled first");
}

/// The whole typed cycle — commit, copies, sharing, copy-on-write, pages, release — works
/// wherever the driver places reservations.
#[test]
fn the_backend_works_wherever_reservations_land() {
    for placement in PLACEMENTS {
        let model = DriverModel::new(ModelConfig {
            placement,
            ..config()
        })
        .unwrap();
        make_guard!(guard);
        let device = Device::new(guard, common::cuda(&model));
        let binding = device.bind(Budget::unlimited()).unwrap();
        let mut prefix = binding.reserve(2 * G).unwrap().commit_prefix().unwrap();
        let filled = prefix.copy_from_host(G, &[7; 64]);
        filled.expect("no sharer yet").unwrap();
        let shared = binding.reserve(2 * G).unwrap().map_prefix(&prefix).unwrap();
        let mut seen = [0; 64];
        shared.copy_to_host(G, &mut seen).unwrap();
        assert_eq!(seen, [7; 64], "{placement:?}");
        let mut diverged = shared.diverge().unwrap();
        diverged.copy_boundary_from_host(0, &[9; 8]).unwrap();
        diverged.copy_to_host(G, &mut seen[..8]).unwrap();
        assert_eq!(seen[..8], [9; 8], "{placement:?}");
        make_guard!(cache_guard);
        let layout = memtoken::kv::Layout::new(64, 16).plane(4096);
        let cache = memtoken::kv::KvCache::new(cache_guard, &binding, &layout).unwrap();
        cache.replenish().unwrap();
        let mut table = cache.table();
        cache.push(&mut table).unwrap();
        table.write(0, 0, 0, &[5; 8]).unwrap();
        drop(table);
        drop(cache);
        let a = binding.reserve(3 * G).unwrap().commit().unwrap();
        a.release().complete().unwrap();
        drop((diverged, prefix));
        drop(binding);
        assert!(device.close().is_clean(), "{placement:?}");
        assert_eq!(model.outstanding(), ModelOutstanding::default());
    }
}

// ---- Facts 33–35: exactly the sheet's sticky codes stick. ----

/// Fact 33 and 34: "any further CUDA work will return the same error".
const SHEET_STICKY: [i32; 13] = [
    700, 702, 714, 715, 716, 717, 718, 719, 911, 226, 721, 710, 810,
];
/// Fact 35: no such wording (709 apart: see below).
const SHEET_NOT_STICKY: [i32; 15] = [
    214, 220, 999, 46, 701, 2, 600, 900, 901, 902, 903, 904, 905, 906, 907,
];

#[test]
fn the_error_table_has_the_sheets_fates() {
    for code in SHEET_STICKY {
        assert_eq!(CuError(code).fate(), ErrorFate::Sticky, "{code}");
    }
    for code in SHEET_NOT_STICKY.into_iter().chain([908]) {
        assert_eq!(CuError(code).fate(), ErrorFate::Transient, "{code}");
    }
    // 709 is not sticky (the process may make a new context), but the context that returned
    // it is destroyed with everything in it: the backend takes it for loss, so that it never
    // passes that context's handles on again (see the model's docs).
    assert_eq!(CuError(709).fate(), ErrorFate::ContextGone);
}

#[test]
fn the_model_makes_exactly_the_sheets_sticky_codes_sticky() {
    let mut wrong = Vec::new();
    for code in SHEET_STICKY
        .into_iter()
        .chain(SHEET_NOT_STICKY)
        .chain([908, 709, 4])
    {
        let model = opened(config());
        model.fail_nth(DriverCall::MemCreate, 1, CuError(code));
        let first = model.mem_create(G, 0);
        let (later, device) = (model.mem_create(G, 0).map(|_| ()), model.device_get(0));
        let expected = if SHEET_STICKY.contains(&code) || code == 4 {
            // Every later call, into the context or not, returns the same error.
            (Err(CuError(code)), Err(CuError(code)))
        } else if code == 709 {
            // The context is destroyed: calls into it fail; the driver itself lives on.
            (Err(CuError(code)), Ok(0))
        } else {
            (Ok(()), Ok(0))
        };
        if first != Err(CuError(code)) || (later, device) != expected {
            wrong.push(format!(
                "{code}: first {first:?}, then {later:?} and device_get {device:?}; \
                 expected {expected:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---- Facts 40–43: VMM calls are refused while a global capture is open. ----

/// Each VMM call, made while a capture of `mode` is open: its result and whether the capture
/// survived.
fn vmm_calls_during_capture(mode: CaptureMode, other_thread: bool) -> Vec<(DriverCall, bool)> {
    const CALLS: [DriverCall; 8] = [
        DriverCall::MemAddressReserve,
        DriverCall::MemAddressFree,
        DriverCall::MemCreate,
        DriverCall::MemRelease,
        DriverCall::MemMap,
        DriverCall::MemSetAccess,
        DriverCall::MemUnmap,
        DriverCall::StreamSynchronize,
    ];
    let mut out = Vec::new();
    for call in CALLS {
        // A fresh model for each call: an allowed call changes what the next would find.
        let model = opened(config());
        let stream = model.new_stream();
        let (ptr, _) = mapped(&model);
        let spare = model.mem_create(G, 0).unwrap();
        let free = model.mem_address_reserve(G, G, 0).unwrap();
        let make = || -> Result<(), CuError> {
            // SAFETY: (each call) the values are live and the ranges as the call requires.
            unsafe {
                match call {
                    DriverCall::MemAddressReserve => model.mem_address_reserve(G, G, 0).map(drop),
                    DriverCall::MemAddressFree => model.mem_address_free(free, G),
                    DriverCall::MemCreate => model.mem_create(G, 0).map(drop),
                    DriverCall::MemRelease => model.mem_release(spare),
                    DriverCall::MemMap => model.mem_map(free, G, 0, spare),
                    DriverCall::MemSetAccess => model.mem_set_access(ptr, G, &[(0, false)]),
                    DriverCall::MemUnmap => model.mem_unmap(ptr, G),
                    _ => model.stream_synchronize(0),
                }
            }
        };
        model.begin_capture(stream, mode);
        let r = if other_thread {
            std::thread::scope(|s| s.spawn(make).join().unwrap())
        } else {
            make()
        };
        let ended = model.end_capture(stream);
        let refused = r == Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
        assert!(refused || r.is_ok(), "{call:?}: {r:?}");
        assert_eq!(
            ended.is_err(),
            refused,
            "{call:?}: a refused call invalidates the capture, an allowed one does not"
        );
        if refused {
            assert_eq!(ended, Err(CuError::STREAM_CAPTURE_INVALIDATED));
            assert_eq!(model.lost_with(), None, "900 is not sticky");
        }
        out.push((call, refused));
    }
    out
}

#[test]
fn vmm_calls_are_refused_while_a_global_capture_is_open() {
    for other_thread in [false, true] {
        for (call, refused) in vmm_calls_during_capture(CaptureMode::Global, other_thread) {
            assert!(refused, "{call:?} (other thread: {other_thread})");
        }
    }
    // A thread-local capture bars only its own thread; a relaxed one bars nobody (a
    // synchronize of a stream that does not capture included).
    for (call, refused) in vmm_calls_during_capture(CaptureMode::ThreadLocal, false) {
        assert!(refused, "{call:?}");
    }
    for (mode, other_thread) in [
        (CaptureMode::ThreadLocal, true),
        (CaptureMode::Relaxed, false),
    ] {
        for (call, refused) in vmm_calls_during_capture(mode, other_thread) {
            assert!(!refused, "{mode:?} {call:?}");
        }
    }
}

/// Fact 41: synchronizing a capturing stream is refused, and invalidates its capture, in every
/// mode; the legacy stream while a blocking stream captures, with `STREAM_CAPTURE_IMPLICIT`.
#[test]
fn a_synchronize_of_a_capturing_stream_is_refused_in_every_mode() {
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        let model = opened(config());
        let stream = model.new_stream();
        model.begin_capture(stream, mode);
        // SAFETY: a live stream of the model.
        let r = unsafe { model.stream_synchronize(stream) };
        assert_eq!(r, Err(CuError::STREAM_CAPTURE_UNSUPPORTED), "{mode:?}");
        assert_eq!(
            model.end_capture(stream),
            Err(CuError::STREAM_CAPTURE_INVALIDATED),
            "{mode:?}"
        );
        let blocking = model.new_blocking_stream();
        model.begin_capture(blocking, mode);
        // SAFETY: 0 is the legacy stream, always live.
        let r = unsafe { model.stream_synchronize(0) };
        assert_eq!(r, Err(CuError::STREAM_CAPTURE_IMPLICIT), "{mode:?}");
        assert_eq!(
            model.end_capture(blocking),
            Err(CuError::STREAM_CAPTURE_INVALIDATED),
            "{mode:?}"
        );
    }
}

/// Fact 40: the backend makes its VMM calls with the calling thread's capture interaction mode
/// exchanged to relaxed, so a global capture on a stream the device does not cover refuses none
/// of them and is not invalidated by them: commits, a release, a drop and a cache trim go
/// through during it — from the capturing thread and from another — and the capture ends
/// valid, with nothing lost. (Before, each was refused with 900 and invalidated the capture.)
#[test]
fn vmm_work_during_a_global_capture_goes_through_and_leaves_it_valid() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 * G).unwrap().into_region();
    region.grow(2).unwrap();
    region.shrink(2).unwrap(); // two granules in the device's cache
    let stream = model.new_stream();
    model.begin_capture(stream, CaptureMode::Global);
    let a = binding.reserve(G).unwrap().commit().unwrap();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let b = binding.reserve(G).unwrap().commit().unwrap();
                b.release().complete().unwrap();
                assert_eq!(device.trim_cache(), 2 * G as u64);
            })
            .join()
            .unwrap();
    });
    drop(a);
    assert_eq!(device.poll().deferred, 0);
    assert_eq!(model.end_capture(stream), Ok(()), "the capture ends valid");
    assert!(device.confirm_context_lost().is_none());
    drop(region);
    device.poll();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// The relaxed exchange is the thread's own and is given back: after a VMM call, the thread's
/// mode is what it was, so its own calls to the driver outside memtoken keep their rules.
#[test]
fn the_threads_capture_mode_is_given_back_after_each_vmm_call() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    model
        .thread_exchange_capture_mode(CaptureMode::ThreadLocal)
        .unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    assert_eq!(
        model.thread_exchange_capture_mode(CaptureMode::Global),
        Ok(CaptureMode::ThreadLocal)
    );
    drop(a);
    drop(binding);
    assert!(device.close().is_clean());
}

// ---- Fact 32: access for a peer only after cuDeviceCanAccessPeer. ----

fn two_devices(peer_access: Vec<(i32, i32)>) -> DriverModel {
    opened(ModelConfig {
        devices: 2,
        peer_access,
        ..config()
    })
}

#[test]
fn a_peer_gets_access_only_where_can_access_peer_said_1() {
    let model = two_devices(vec![(1, 0)]);
    assert_eq!(model.device_get(1), Ok(1));
    assert_eq!(
        model.device_can_access_peer(0, 1),
        Ok(false),
        "one way only"
    );
    assert_eq!(
        model.device_can_access_peer(1, 1),
        Ok(false),
        "not its own peer"
    );
    assert_eq!(
        model.device_can_access_peer(1, 2),
        Err(CuError::INVALID_DEVICE)
    );
    assert_eq!(model.device_can_access_peer(1, 0), Ok(true));
    let (ptr, _) = mapped(&model); // on device 0
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping.
    unsafe { model.mem_set_access(ptr, G, &[(1, false)]) }.expect("device 1 may read device 0's");
    // Memory on device 1: device 0 asked, and was told no.
    let far = model.mem_address_reserve(G, G, 0).unwrap();
    let handle = model.mem_create(G, 1).unwrap();
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` long.
    unsafe {
        model.mem_map(far, G, 0, handle).unwrap();
        assert_eq!(
            model.mem_set_access(far, G, &[(0, true)]),
            Err(CuError::INVALID_DEVICE)
        );
        model
            .mem_set_access(far, G, &[(1, true)])
            .expect("its own device");
    }
    assert_eq!(model.lost_with(), None);
}

// ---- Fact 59: VMM calls on cuMemAlloc memory. ----

/// A `cuMemAlloc` allocation placed below a VMM mapping, a granule apart (top-down: the
/// mapping first, then a spacer reservation, freed once the allocation is placed below it).
fn an_allocation_below_a_mapping() -> (DriverModel, (u64, u64), u64) {
    let model = opened(ModelConfig {
        placement: Placement::TopDown,
        ..config()
    });
    let mapping = mapped(&model);
    let spacer = model.mem_address_reserve(G, G, 0).unwrap();
    let plain = model.mem_alloc(G).unwrap();
    // SAFETY: `spacer` is exactly one live reservation with nothing mapped.
    unsafe { model.mem_address_free(spacer, G) }.unwrap();
    assert!(
        plain + (G as u64) < mapping.0,
        "top-down, apart: {plain:#x} below {:#x}",
        mapping.0
    );
    (model, mapping, plain)
}

/// VMM calls on a reservation beside a `cuMemAlloc` allocation (above it) are not misuse.
/// Fails if the model takes memory past the allocation's end for the allocation's.
#[test]
fn vmm_calls_beside_cumemalloc_memory_are_not_misuse() {
    let (model, (ptr, handle), plain) = an_allocation_below_a_mapping();
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping of `handle`, unmapped before the
    // release and the free; `plain` is a live `cuMemAlloc` start.
    unsafe {
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
        model.mem_unmap(ptr, G).unwrap();
        model.mem_release(handle).unwrap();
        model.mem_address_free(ptr, G).unwrap();
        model.mem_free(plain).unwrap();
    }
    assert_eq!(model.lost_with(), None);
}

/// A VMM call on `cuMemAlloc` memory is misuse. Fails if the model lets it through.
#[test]
#[should_panic(expected = "a VMM call on memory cuMemAlloc made")]
fn a_vmm_call_on_cumemalloc_memory_is_misuse() {
    // No spacer here: its free, next to the allocation, must not be what panics.
    let model = opened(config());
    let plain = model.mem_alloc(G).unwrap();
    // SAFETY: none holds — on purpose: the model panics before it touches anything.
    let _ = unsafe { model.mem_unmap(plain, G) };
}

/// The legacy stream is not the model's to destroy (it is no stream object): misuse. Fails if
/// the model lets it be marked destroyed.
#[test]
#[should_panic(expected = "cannot destroy stream 0x0")]
fn destroying_the_legacy_stream_is_misuse() {
    let model = opened(config());
    model.destroy_stream(0);
}

/// A stream destroyed once is gone: destroying it again is misuse, as any later call naming it.
/// Until then the model says it is live.
#[test]
fn a_stream_is_destroyed_once() {
    let model = opened(config());
    let stream = model.new_stream();
    assert!(!model.stream_destroyed(stream), "a new stream is live");
    model.destroy_stream(stream);
    assert!(model.stream_destroyed(stream));
    let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.destroy_stream(stream);
    }));
    assert!(again.is_err(), "destroyed twice");
}

#[test]
#[should_panic(expected = "without asking cuDeviceCanAccessPeer(1, 0) first")]
fn access_for_a_peer_never_asked_about_is_misuse() {
    let model = two_devices(vec![(1, 0)]);
    let (ptr, _) = mapped(&model);
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping (the model panics: see above).
    let _ = unsafe { model.mem_set_access(ptr, G, &[(1, true)]) };
}

#[test]
fn two_peer_devices_by_default() {
    let model = opened(config());
    assert_eq!(model.device_get(1), Ok(1));
    assert_eq!(model.device_get(2), Err(CuError::INVALID_DEVICE));
    assert_eq!(model.device_can_access_peer(0, 1), Ok(true));
    assert_eq!(model.device_can_access_peer(1, 0), Ok(true));
    assert_eq!(
        model.device_can_access_peer(0, 2),
        Err(CuError::INVALID_DEVICE)
    );
}

// ---- Facts 26–29: export as a POSIX descriptor, import, and the memory's lifetime. ----

/// Maps `handle` (`G` bytes) read-only at a fresh reservation; its address.
fn map_read_only(model: &DriverModel, handle: u64) -> u64 {
    let ptr = model.mem_address_reserve(G, G, 0).unwrap();
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` bytes long; the
    // mapping just made is exactly `[ptr, ptr + G)`.
    unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, false)]).unwrap();
    }
    ptr
}

/// Unmaps, releases and frees `[ptr, ptr + G)` mapped over `handle`.
fn unmap_release_free(model: &DriverModel, ptr: u64, handle: u64) {
    // SAFETY: `[ptr, ptr + G)` is exactly one live mapping of live `handle`, in a reservation of
    // exactly that range.
    unsafe {
        model.mem_unmap(ptr, G).unwrap();
        model.mem_release(handle).unwrap();
        model.mem_address_free(ptr, G).unwrap();
    }
}

/// The descriptor of an exported POSIX handle.
fn fd_of(shared: ShareableHandle) -> OwnedFd {
    match shared {
        ShareableHandle::Fd(fd) => fd,
        other => panic!("a POSIX handle is a descriptor, got {other:?}"),
    }
}

#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn export_needs_the_handle_type_requested_at_creation() {
    use memtoken::backend::cuda::{HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD};
    let model = opened(config());
    let plain = model.mem_create(G, 0).unwrap();
    let fabric = model
        .mem_create_exportable(G, 0, HANDLE_TYPE_FABRIC)
        .unwrap();
    let fd = model
        .mem_create_exportable(G, 0, HANDLE_TYPE_POSIX_FD)
        .unwrap();
    // SAFETY: the three handles are live.
    unsafe {
        let e = model.mem_export_to_shareable_handle(plain, HANDLE_TYPE_POSIX_FD);
        assert_eq!(
            e.err(),
            Some(CuError::INVALID_VALUE),
            "fact 26: not requested"
        );
        let e = model.mem_export_to_shareable_handle(fabric, HANDLE_TYPE_POSIX_FD);
        assert_eq!(
            e.err(),
            Some(CuError::INVALID_VALUE),
            "fact 26: another type requested"
        );
        let ShareableHandle::Opaque(shared) = model
            .mem_export_to_shareable_handle(fabric, HANDLE_TYPE_FABRIC)
            .unwrap()
        else {
            panic!("a fabric handle is an opaque value in the model");
        };
        model.close_shareable(shared).unwrap();
        assert_eq!(model.close_shareable(shared), Err(CuError::INVALID_VALUE));
        let shared = fd_of(
            model
                .mem_export_to_shareable_handle(fd, HANDLE_TYPE_POSIX_FD)
                .unwrap(),
        );
        assert_eq!(model.open_shareables(), 1);
        let raw = shared.as_raw_fd() as u64;
        assert_eq!(
            model.close_shareable(raw),
            Err(CuError::INVALID_VALUE),
            "a descriptor is closed by closing it"
        );
        drop(shared);
        assert_eq!(model.open_shareables(), 0);
        for h in [plain, fabric, fd] {
            model.mem_release(h).unwrap();
        }
    }
    let e = model.mem_create_exportable(G, 0, 2); // a Win32 handle: not modelled
    assert_eq!(e, Err(CuError::INVALID_VALUE));
    assert_eq!(model.outstanding().physical_bytes, 0);
}

#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn an_import_maps_the_exported_bytes_and_the_memory_lives_while_anything_holds_it() {
    use memtoken::backend::cuda::{HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD};
    let model = opened(config());
    let ptr = model.mem_address_reserve(G, G, 0).unwrap();
    let handle = model
        .mem_create_exportable(G, 0, HANDLE_TYPE_POSIX_FD)
        .unwrap();
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` bytes long; the
    // mapping made is exactly `[ptr, ptr + G)`, read-write.
    let shared = unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
        model.memcpy_htod(ptr, b"system prompt").unwrap();
        fd_of(
            model
                .mem_export_to_shareable_handle(handle, HANDLE_TYPE_POSIX_FD)
                .unwrap(),
        )
    };
    // A real descriptor: a copy of it (another number, as in another process) names the same
    // memory; anything else is an error, not misuse.
    let copy = shared.try_clone().unwrap();
    let other = std::fs::File::open("/dev/null").unwrap();
    for bad in [other.as_raw_fd() as u64, u64::MAX, 1 << 40] {
        let e = model.mem_import_from_shareable_handle(bad, HANDLE_TYPE_POSIX_FD);
        assert_eq!(e, Err(CuError::INVALID_VALUE), "{bad}");
    }
    let e = model.mem_import_from_shareable_handle(copy.as_raw_fd() as u64, HANDLE_TYPE_FABRIC);
    assert_eq!(e, Err(CuError::INVALID_VALUE));
    let imported = model
        .mem_import_from_shareable_handle(copy.as_raw_fd() as u64, HANDLE_TYPE_POSIX_FD)
        .unwrap();
    assert_ne!(imported, handle, "a handle of its own");
    // SAFETY: `imported` is live.
    assert_eq!(unsafe { model.mem_allocation_size(imported) }, Some(G));
    // Fact 28: the importer may close the descriptor right after import; the exporter's stays
    // open until it drops it.
    drop(copy);
    assert_eq!(model.open_shareables(), 1);
    drop(shared);
    assert_eq!(model.open_shareables(), 0);
    let at = map_read_only(&model, imported);
    let mut bytes = [0u8; 13];
    // SAFETY: `[at, at + 13)` is mapped readable.
    unsafe { model.memcpy_dtoh(&mut bytes, at) }.unwrap();
    assert_eq!(&bytes, b"system prompt");
    // The exporter goes first: the import keeps the memory (fact 27).
    unmap_release_free(&model, ptr, handle);
    assert_eq!(model.outstanding().physical_bytes, G);
    // SAFETY: as above.
    unsafe { model.memcpy_dtoh(&mut bytes, at) }.unwrap();
    assert_eq!(&bytes, b"system prompt");
    unmap_release_free(&model, at, imported);
    assert_eq!(
        model.outstanding().physical_bytes,
        0,
        "the last holder freed it"
    );

    // An open descriptor alone keeps released memory too.
    let handle = model
        .mem_create_exportable(G, 0, HANDLE_TYPE_POSIX_FD)
        .unwrap();
    // SAFETY: `handle` is live; released once.
    let shared = unsafe {
        let shared = model
            .mem_export_to_shareable_handle(handle, HANDLE_TYPE_POSIX_FD)
            .unwrap();
        model.mem_release(handle).unwrap();
        fd_of(shared)
    };
    assert_eq!(
        model.outstanding().physical_bytes,
        G,
        "the descriptor is open"
    );
    drop(shared);
    assert_eq!(model.outstanding().physical_bytes, 0);
    let e = model.mem_import_from_shareable_handle(u64::from(u32::MAX), HANDLE_TYPE_POSIX_FD);
    assert_eq!(e, Err(CuError::INVALID_VALUE));
}

// ---- Fact 14: `gpuDirectRDMACapable` needs attribute 110. ----

/// A model whose attribute 110 is `rdma`.
fn rdma_model(rdma: bool) -> DriverModel {
    opened(ModelConfig {
        rdma_with_vmm: rdma,
        ..config()
    })
}

#[test]
fn attribute_110_says_whether_memory_may_be_rdma_capable() {
    use memtoken::backend::cuda::{AllocationProps, DeviceAttribute};
    let attribute = DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported;
    assert_eq!(attribute.code(), 110);
    for rdma in [true, false] {
        let model = rdma_model(rdma);
        assert_eq!(
            model.device_get_attribute(attribute, 0),
            Ok(i32::from(rdma))
        );
        assert_eq!(
            model.device_get_attribute(attribute, 7),
            Err(CuError::INVALID_DEVICE),
            "a device the model does not have"
        );
        let props = AllocationProps::pinned(0).with_gpu_direct_rdma(rdma);
        assert_eq!(model.mem_get_allocation_granularity(props), Ok(G));
        let handle = model.mem_create_with(G, props).unwrap();
        // Memory that is not RDMA-capable may always be made.
        let plain = model.mem_create(G, 0).unwrap();
        assert_eq!(
            model.props_log(),
            [
                (DriverCall::MemGetAllocationGranularity, props),
                (DriverCall::MemCreate, props),
                (DriverCall::MemCreate, AllocationProps::pinned(0)),
            ],
            "every create and granularity query is recorded with its properties"
        );
        // SAFETY: both handles are live, released once.
        unsafe {
            model.mem_release(handle).unwrap();
            model.mem_release(plain).unwrap();
        }
    }
}

#[test]
#[should_panic(expected = "whose attribute 110 (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) is 0")]
fn creating_rdma_capable_memory_without_attribute_110_is_misuse() {
    use memtoken::backend::cuda::AllocationProps;
    let model = rdma_model(false);
    let props = AllocationProps::pinned(0).with_gpu_direct_rdma(true);
    let _ = model.mem_create_with(G, props);
}

#[test]
#[should_panic(expected = "whose attribute 110 (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) is 0")]
fn asking_the_granularity_of_rdma_capable_memory_without_attribute_110_is_misuse() {
    use memtoken::backend::cuda::{AllocationProps, HANDLE_TYPE_POSIX_FD};
    let model = rdma_model(false);
    let props = AllocationProps::pinned(0)
        .with_handle_types(HANDLE_TYPE_POSIX_FD)
        .with_gpu_direct_rdma(true);
    let _ = model.mem_get_allocation_granularity(props);
}

// ---- Fact 15: granularity depends on the allocation properties. ----

/// A model whose exportable memory has a granularity of two plain granules.
fn coarse_exports() -> DriverModel {
    opened(ModelConfig {
        exportable_granularity: Some(2 * G),
        ..config()
    })
}

#[test]
fn the_granularity_is_that_of_the_properties_asked_with() {
    use memtoken::backend::cuda::{AllocationProps, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD};
    let model = coarse_exports();
    let plain = AllocationProps::pinned(0);
    let granularity = |props| model.mem_get_allocation_granularity(props);
    assert_eq!(granularity(plain), Ok(G));
    assert_eq!(granularity(plain.with_gpu_direct_rdma(true)), Ok(G));
    for kind in [HANDLE_TYPE_POSIX_FD, HANDLE_TYPE_FABRIC] {
        assert_eq!(
            granularity(plain.with_handle_types(kind)),
            Ok(2 * G),
            "{kind}"
        );
    }
    assert_eq!(
        granularity(plain.with_handle_types(2)),
        Err(CuError::INVALID_VALUE),
        "a Win32 handle: not modelled"
    );
    // By default, exportable memory has the plain granularity.
    let model = opened(config());
    let exportable = plain.with_handle_types(HANDLE_TYPE_POSIX_FD);
    assert_eq!(model.mem_get_allocation_granularity(exportable), Ok(G));

    // Memory of its properties' granularity is created and mapped at a multiple of it.
    let model = coarse_exports();
    let handle = model.mem_create_with(2 * G, exportable).unwrap();
    let ptr = model.mem_address_reserve(2 * G, 2 * G, 0).unwrap();
    // SAFETY: the fresh reservation is unmapped, `handle` live and `2 * G` long; each is given
    // back once.
    unsafe {
        model.mem_map(ptr, 2 * G, 0, handle).unwrap();
        model.mem_unmap(ptr, 2 * G).unwrap();
        model.mem_address_free(ptr, 2 * G).unwrap();
        model.mem_release(handle).unwrap();
    }
    assert!(model.outstanding().physical_bytes == 0);
}

#[test]
#[should_panic(expected = "is not a multiple of the granularity")]
fn creating_memory_smaller_than_its_properties_granularity_is_misuse() {
    use memtoken::backend::cuda::HANDLE_TYPE_POSIX_FD;
    let model = coarse_exports();
    // One plain granule: a multiple of the plain granularity, not of the exportable one.
    let _ = model.mem_create_exportable(G, 0, HANDLE_TYPE_POSIX_FD);
}

#[test]
#[should_panic(expected = "is not a multiple of the granularity")]
fn mapping_memory_off_its_properties_granularity_is_misuse() {
    use memtoken::backend::cuda::HANDLE_TYPE_POSIX_FD;
    let model = coarse_exports();
    let handle = model
        .mem_create_exportable(2 * G, 0, HANDLE_TYPE_POSIX_FD)
        .unwrap();
    let ptr = model.mem_address_reserve(4 * G, 2 * G, 0).unwrap();
    // SAFETY: `[ptr + G, ptr + 3G)` lies in the fresh reservation, unmapped; `handle` is live
    // and `2 * G` long. The model panics before mapping: `ptr + G` is one plain granule off.
    let _ = unsafe { model.mem_map(ptr + G as u64, 2 * G, 0, handle) };
}

// ---- Fact 21 again: work faults exactly on the ranges it named. ----

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::unmap_under_work`: work
/// that named the range it uses faults when exactly that range is unmapped under it (fact 21).
#[test]
fn work_that_named_its_range_faults_when_that_range_is_unmapped() {
    let model = opened(config());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(G, G, 0).unwrap();
    let handle = model.mem_create(G, 0).unwrap();
    model.submit_work_touching(stream, &[]); // an epoch before the access below
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` bytes long;
    // the mapping is exactly `[ptr, ptr + G)`, unmapped once, then released.
    unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
        model.submit_work_touching(stream, &[(ptr, G)]);
        model.mem_unmap(ptr, G).unwrap();
        model.mem_release(handle).unwrap();
    }
    model.complete_work_on(stream);
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

/// Kills `src/backend/cuda/model.rs: replace < with <= in ModelState::unmap_under_work`: work
/// that named only the ranges beside a mapping, just before and just after it, goes on when
/// that mapping is unmapped under it.
#[test]
fn work_that_named_only_the_ranges_beside_a_mapping_survives_its_unmap() {
    let model = opened(config());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(3 * G, G, 0).unwrap();
    let handle = model.mem_create(G, 0).unwrap();
    let middle = ptr + G as u64;
    model.submit_work_touching(stream, &[]); // an epoch before the access below
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `G` bytes long;
    // the mapping is exactly `[middle, middle + G)`, unmapped once, then released.
    unsafe {
        model.mem_map(middle, G, 0, handle).unwrap();
        model.mem_set_access(middle, G, &[(0, true)]).unwrap();
        let beside = [(ptr, G), (middle + G as u64, G)];
        model.submit_work_touching(stream, &beside);
        model.mem_unmap(middle, G).unwrap();
        model.mem_release(handle).unwrap();
    }
    model.complete_work_on(stream);
    assert_eq!(model.lost_with(), None);
}

/// A synchronous copy to the host reads stale bytes only where unfinished work on another
/// stream named the range it reads: work that named only the ranges just before and just
/// after it makes no stale read, work that named the range itself makes one. Fails if
/// `busy_elsewhere` takes a range that ends where the copy begins, or begins where it ends,
/// for one it overlaps.
#[test]
fn a_copy_to_the_host_beside_unfinished_work_reads_nothing_stale() {
    let model = opened(config());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(3 * G, G, 0).unwrap();
    let handle = model.mem_create(3 * G, 0).unwrap();
    let middle = ptr + G as u64;
    let mut bytes = vec![0u8; G];
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `3 * G` bytes long; the
    // mapping is exactly `[ptr, ptr + 3 * G)`, read within, unmapped once, then released.
    unsafe {
        model.mem_map(ptr, 3 * G, 0, handle).unwrap();
        model.mem_set_access(ptr, 3 * G, &[(0, true)]).unwrap();
        model.submit_work_touching(stream, &[(ptr, G)]);
        model.submit_work_touching(stream, &[(middle + G as u64, G)]);
        model.memcpy_dtoh(&mut bytes, middle).unwrap();
        assert_eq!(model.stale_reads(), 0, "read beside the work, not under it");
        model.submit_work_touching(stream, &[(middle, G)]);
        model.memcpy_dtoh(&mut bytes, middle).unwrap();
        assert_eq!(model.stale_reads(), 1, "read under the work");
        model.complete_work_on(stream);
        model.mem_unmap(ptr, 3 * G).unwrap();
        model.mem_release(handle).unwrap();
    }
    assert_eq!(model.lost_with(), None);
}

// ---- Where reservations land: each placement's search. ----

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place` (the lowest-first
/// search): a lowest-first model places each reservation right above the one before.
#[test]
fn lowest_first_reservations_stack_upwards() {
    let model = opened(ModelConfig {
        placement: Placement::LowestFirst,
        ..config()
    });
    let len = 4 * G;
    let a = model.mem_address_reserve(len, G, 0).unwrap();
    let b = model.mem_address_reserve(len, G, 0).unwrap();
    assert_eq!(a + len as u64, b);
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place` (the top-down
/// search's first candidate) and `replace - with / in ModelState::place` (its next candidate,
/// below a reservation in the way): a top-down model places each reservation right below the
/// highest one it fits under.
#[test]
fn top_down_reservations_stack_downwards() {
    let model = opened(ModelConfig {
        placement: Placement::TopDown,
        ..config()
    });
    let len = 4 * G;
    let a = model.mem_address_reserve(len, G, 0).unwrap();
    let b = model.mem_address_reserve(len, G, 0).unwrap();
    assert_eq!(b + len as u64, a);
    // With the top free again, twice as much no longer fits there: it goes right below `b`.
    // SAFETY: `a` is a reservation of `len` bytes made above, with nothing mapped in it.
    unsafe { model.mem_address_free(a, len) }.unwrap();
    let c = model.mem_address_reserve(2 * len, G, 0).unwrap();
    assert_eq!(c + 2 * len as u64, b);
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place` and `replace - with /
/// in ModelState::place` in the top-down search's alignment masks: a top-down model honours an
/// alignment larger than the length, for the first reservation and for one placed below
/// another.
#[test]
fn top_down_placement_honours_a_larger_alignment() {
    let model = opened(ModelConfig {
        placement: Placement::TopDown,
        ..config()
    });
    let align = 4 * G;
    let a = model.mem_address_reserve(G, align, 0).unwrap();
    let b = model.mem_address_reserve(G, align, 0).unwrap();
    assert_eq!(
        (a % align as u64, b % align as u64),
        (0, 0),
        "{a:#x} {b:#x}"
    );
    assert_eq!(b + align as u64, a, "the next aligned place below");
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place`: scattered
/// reservations never overlap, even when they are large enough that random places collide.
#[test]
fn scattered_reservations_never_overlap() {
    let len = 1usize << 45; // two fit in the model's window, at most three
    for seed in 1..=8 {
        let model = opened(ModelConfig {
            placement: Placement::Scattered { seed },
            ..config()
        });
        let a = model.mem_address_reserve(len, G, 0).unwrap();
        let b = model.mem_address_reserve(len, G, 0).unwrap();
        let (a, b) = (a as usize, b as usize);
        assert!(
            a + len <= b || b + len <= a,
            "seed {seed}: {a:#x} and {b:#x}"
        );
        // SAFETY: each is exactly one reservation with nothing mapped in it.
        unsafe {
            model.mem_address_free(a as u64, len).unwrap();
            model.mem_address_free(b as u64, len).unwrap();
        }
    }
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place`: scattered
/// reservations stay inside the model's window, whose top is where a top-down model places.
#[test]
fn scattered_reservations_stay_inside_the_window() {
    let len = 1usize << 45;
    let top_down = opened(ModelConfig {
        placement: Placement::TopDown,
        ..config()
    });
    let top = top_down.mem_address_reserve(len, G, 0).unwrap() as usize + len;
    for seed in 1..=8 {
        let model = opened(ModelConfig {
            placement: Placement::Scattered { seed },
            ..config()
        });
        for _ in 0..2 {
            let a = model.mem_address_reserve(len, G, 0).unwrap() as usize;
            assert!(
                a + len <= top,
                "seed {seed}: {a:#x} + {len:#x} is past {top:#x}"
            );
        }
    }
}

/// Kills `src/backend/cuda/model.rs: replace + with * in ModelState::place` (in the number of
/// slots a scattered placement draws from): a scattered model can place a reservation as long
/// as its whole window, which has one slot.
#[test]
fn a_scattered_model_places_a_reservation_of_its_whole_window() {
    let window = 0x7000_0000_0000;
    let model = opened(ModelConfig {
        placement: Placement::Scattered { seed: 1 },
        ..config()
    });
    let a = model.mem_address_reserve(window, G, 0).unwrap();
    assert_eq!(a, 0x1000_0000_0000);
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place` (the lowest-first
/// search's check of the window's top): once a reservation fills the window, no other fits.
#[test]
fn a_full_window_places_nothing_more() {
    let model = opened(ModelConfig {
        placement: Placement::LowestFirst,
        ..config()
    });
    let window = 0x7000_0000_0000;
    let all = model.mem_address_reserve(window, G, 0).unwrap();
    assert_eq!(all, 0x1000_0000_0000);
    assert!(model.mem_address_reserve(G, G, 0).is_err());
}

// ---- The model's memory, streams, events and synchronize. ----

/// Kills `src/backend/cuda/model.rs: replace > with >= in DriverModel::create`: the model
/// creates up to exactly its device's memory.
#[test]
fn the_model_creates_up_to_exactly_its_memory() {
    let model = opened(ModelConfig {
        total_mem: 4 * G,
        ..config()
    });
    let all = model.mem_create(4 * G, 0).expect("exactly the memory");
    assert_eq!(model.mem_create(G, 0), Err(CuError::OUT_OF_MEMORY));
    // SAFETY: `all` was created above, is mapped nowhere, and is released once.
    unsafe { model.mem_release(all) }.unwrap();
}

/// Kills `src/backend/cuda/model.rs: replace ModelOutstanding::is_zero -> bool with true`: a
/// model that holds a reservation does not say it holds nothing.
#[test]
fn a_model_holding_a_reservation_is_not_empty() {
    let model = common::small_model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let addr = backend.reserve(G).unwrap();
    assert!(!model.outstanding().is_zero(), "{:?}", model.outstanding());
    backend.free(addr, G).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Fact 39: an event recorded on a capturing stream is a captured event, graph nodes rather
/// than a mark of the stream's work. Querying or synchronizing it returns `CAPTURED_EVENT`,
/// even in relaxed mode, and (fact 41) invalidates the capture while it is open; it keeps
/// answering so after the capture, until it is recorded again on a stream that does not
/// capture.
#[test]
fn an_event_recorded_in_a_capture_is_captured_and_asking_it_invalidates_the_capture() {
    let model = opened(config());
    let stream = model.new_stream();
    let event = model.event_create().unwrap();
    model.begin_capture(stream, CaptureMode::Relaxed);
    // SAFETY: `event` is live and `stream` is one of the model's, throughout.
    unsafe {
        model.event_record(event, stream).unwrap();
        assert_eq!(model.event_query(event), Err(CuError::CAPTURED_EVENT));
        assert_eq!(
            model.end_capture(stream),
            Err(CuError::STREAM_CAPTURE_INVALIDATED)
        );
        // After the capture: still a captured event.
        assert_eq!(model.event_synchronize(event), Err(CuError::CAPTURED_EVENT));
        // A capture that never asks its events ends valid.
        model.begin_capture(stream, CaptureMode::Global);
        model.event_record(event, stream).unwrap();
        assert_eq!(model.end_capture(stream), Ok(()));
        // Recorded again outside any capture, it marks work again.
        model.event_record(event, stream).unwrap();
        assert_eq!(model.event_query(event), Ok(true));
    }
    assert_eq!(model.lost_with(), None, "907 is not sticky");
}

/// Fact 41: while a blocking stream (the per-thread stream is one, fact 2) captures, any use of
/// the legacy stream — an event recorded there, a synchronous copy — is refused with
/// `STREAM_CAPTURE_IMPLICIT` and invalidates the capture. A non-blocking stream's capture
/// (cudarc's `new_stream()`) leaves the legacy stream usable.
#[test]
fn the_legacy_stream_is_refused_while_a_blocking_stream_captures() {
    let model = opened(config());
    let (ptr, _handle) = mapped(&model);
    let event = model.event_create().unwrap();
    let blocking = model.new_blocking_stream();
    model.begin_capture(blocking, CaptureMode::Relaxed);
    // SAFETY: `event` is live; `[ptr, ptr + 64)` lies in one mapping with read-write access.
    unsafe {
        assert_eq!(
            model.event_record(event, 0),
            Err(CuError::STREAM_CAPTURE_IMPLICIT)
        );
        assert_eq!(
            model.memcpy_htod(ptr, &[1; 64]),
            Err(CuError::STREAM_CAPTURE_IMPLICIT)
        );
        let mut back = [0; 64];
        assert_eq!(
            model.memcpy_dtoh(&mut back, ptr),
            Err(CuError::STREAM_CAPTURE_IMPLICIT)
        );
    }
    assert_eq!(
        model.end_capture(blocking),
        Err(CuError::STREAM_CAPTURE_INVALIDATED)
    );
    let other = model.new_stream();
    model.begin_capture(other, CaptureMode::Global);
    // SAFETY: as above.
    unsafe {
        model.event_record(event, 0).unwrap();
        model.memcpy_htod(ptr, &[2; 64]).unwrap();
    }
    assert_eq!(model.end_capture(other), Ok(()));
    assert_eq!(model.lost_with(), None);
}

/// Fact 41: asking whether a stream captures (`cuStreamIsCapturing`) invalidates nothing; asked
/// of the legacy stream while a blocking stream captures, it answers 906 (the probe before any
/// use of the legacy stream).
#[test]
fn asking_whether_a_stream_captures_invalidates_nothing() {
    let model = opened(config());
    let (stream, blocking) = (model.new_stream(), model.new_blocking_stream());
    // SAFETY: 0 and the model's own streams, live as long as the model.
    unsafe {
        assert_eq!(model.stream_is_capturing(stream), Ok(false));
        model.begin_capture(stream, CaptureMode::Global);
        assert_eq!(model.stream_is_capturing(stream), Ok(true));
        assert_eq!(
            model.stream_is_capturing(0),
            Ok(false),
            "a non-blocking capture"
        );
        assert_eq!(model.end_capture(stream), Ok(()));
        model.begin_capture(blocking, CaptureMode::Global);
        assert_eq!(
            model.stream_is_capturing(0),
            Err(CuError::STREAM_CAPTURE_IMPLICIT)
        );
        assert_eq!(model.stream_is_capturing(blocking), Ok(true));
        assert_eq!(
            model.end_capture(blocking),
            Ok(()),
            "nothing invalidated it"
        );
    }
}

/// Fact 40: a thread's capture interaction mode (`cuThreadExchangeStreamCaptureMode`) decides
/// which open captures refuse its potentially unsafe calls. In the relaxed mode another
/// thread's global capture refuses nothing; in the thread-local mode only the thread's own
/// capture does; the exchange returns the mode the thread had.
#[test]
fn a_threads_capture_mode_decides_which_captures_refuse_its_vmm_calls() {
    let model = opened(config());
    let stream = model.new_stream();
    model.begin_capture(stream, CaptureMode::Global);
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let old = model.thread_exchange_capture_mode(CaptureMode::Relaxed);
                assert_eq!(old, Ok(CaptureMode::Global), "the default");
                let handle = model.mem_create(G, 0).expect("relaxed: not refused");
                // SAFETY: created just above, released once.
                unsafe { model.mem_release(handle) }.unwrap();
                let old = model.thread_exchange_capture_mode(CaptureMode::ThreadLocal);
                assert_eq!(old, Ok(CaptureMode::Relaxed));
                let handle = model.mem_create(G, 0).expect("another thread's capture");
                // SAFETY: as above.
                unsafe { model.mem_release(handle) }.unwrap();
            })
            .join()
            .unwrap();
    });
    assert_eq!(model.end_capture(stream), Ok(()), "nothing refused");
    // The capturing thread itself, in the thread-local mode: refused by its own capture.
    model
        .thread_exchange_capture_mode(CaptureMode::ThreadLocal)
        .unwrap();
    model.begin_capture(stream, CaptureMode::Global);
    assert_eq!(
        model.mem_create(G, 0),
        Err(CuError::STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(
        model.end_capture(stream),
        Err(CuError::STREAM_CAPTURE_INVALIDATED)
    );
    // A thread in the default mode is refused by another thread's global capture.
    model.begin_capture(stream, CaptureMode::Global);
    std::thread::scope(|scope| {
        let refused = scope.spawn(|| model.mem_create(G, 0)).join().unwrap();
        assert_eq!(refused, Err(CuError::STREAM_CAPTURE_UNSUPPORTED));
    });
    assert_eq!(
        model.end_capture(stream),
        Err(CuError::STREAM_CAPTURE_INVALIDATED)
    );
}

/// Kills `src/backend/cuda/model.rs: replace += with -= in DriverModel::new_stream`: every new
/// stream, however many the model made, is one of its own and never the legacy stream (a
/// capture may begin on it: fact 41).
#[test]
fn tens_of_thousands_of_new_streams_are_each_their_own() {
    let model = common::small_model();
    // A few hundred under Miri: it checks the memory, not the count.
    let count = common::unless_miri(1 << 16, 1 << 8);
    let streams: Vec<_> = (0..count).map(|_| model.new_stream()).collect();
    let distinct: std::collections::HashSet<_> = streams.iter().collect();
    assert_eq!(distinct.len(), streams.len());
    for &stream in &streams {
        model.begin_capture(stream, CaptureMode::Global);
        model.end_capture(stream).unwrap();
    }
}

/// Kills `src/backend/cuda/model.rs: replace DriverModel::enqueue_legacy with ()`: a copy from
/// the host is work on the legacy stream, so an event recorded there after it is not done
/// until that work completes (when events do not complete at once).
#[test]
fn a_copy_is_work_an_event_after_it_waits_for() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let ptr = model.mem_address_reserve(G, G, 0).unwrap();
    let handle = model.mem_create(G, 0).unwrap();
    let event = model.event_create().unwrap();
    // SAFETY: the fresh reservation is unmapped and `handle` is live and `G` bytes long;
    // the copy stays inside the mapping, which has read-write access; the event is ours; all
    // is given back once, in order, after the work completed.
    unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
        model.memcpy_htod(ptr, &[7; 64]).unwrap();
        model.event_record(event, 0).unwrap();
        assert_eq!(
            model.event_query(event),
            Ok(false),
            "the copy has not completed"
        );
        model.complete_work();
        assert_eq!(model.event_query(event), Ok(true));
        model.event_destroy(event).unwrap();
        model.mem_unmap(ptr, G).unwrap();
        model.mem_release(handle).unwrap();
        model.mem_address_free(ptr, G).unwrap();
    }
}

/// Kills `src/backend/cuda/model.rs: replace >= with < in <impl Driver for
/// DriverModel>::stream_synchronize`: with nothing submitted, a blocking synchronize returns at
/// once (it waits only for unfinished work).
#[test]
fn a_blocking_synchronize_with_nothing_submitted_returns() {
    let model = opened(ModelConfig {
        synchronize_blocks: true,
        ..config()
    });
    let (sent, seen) = std::sync::mpsc::channel();
    let other = model.clone();
    std::thread::spawn(move || {
        let ctx = other.primary_ctx_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this model.
        unsafe { other.ctx_set_current(ctx) }.unwrap();
        // SAFETY: 0 is the legacy stream, always live.
        let _ = sent.send(unsafe { other.stream_synchronize(0) });
    });
    let synchronized = seen.recv_timeout(common::gate::STALL);
    assert_eq!(synchronized, Ok(Ok(())), "the synchronize never returned");
}

// ---- The model's misuse checks and its test controls. ----

/// Kills `src/backend/cuda/model.rs: replace && with || in DriverModel::enter`: a call that
/// needs a context is misuse while the primary context is retained but not current.
#[test]
#[should_panic(expected = "no current context")]
fn a_call_with_a_retained_context_not_current_is_misuse() {
    let model = DriverModel::new(config()).unwrap();
    model.init().unwrap();
    let _ctx = model.primary_ctx_retain(0).unwrap();
    let _ = model.mem_create(G, 0);
}

/// Kills `src/backend/cuda/model.rs: replace || with && in DriverModel::begin_capture`: a
/// capture cannot begin on the legacy stream (fact 41).
#[test]
#[should_panic(expected = "cannot capture on stream")]
fn a_capture_on_the_legacy_stream_is_misuse() {
    common::small_model().begin_capture(0, CaptureMode::Global);
}

/// Kills `src/backend/cuda/model.rs: replace DriverModel::fail_from with ()`: a failure planned
/// from the nth call on fails that call and every later one, until cleared.
#[test]
fn a_model_failure_planned_from_a_call_on_lasts_until_cleared() {
    let model = opened(config());
    model.fail_from(DriverCall::MemAddressReserve, 2, CuError::OUT_OF_MEMORY);
    let first = model.mem_address_reserve(G, G, 0).unwrap();
    for _ in 0..3 {
        assert_eq!(
            model.mem_address_reserve(G, G, 0),
            Err(CuError::OUT_OF_MEMORY)
        );
    }
    model.clear();
    let second = model.mem_address_reserve(G, G, 0).unwrap();
    // SAFETY: both are reservations made above with nothing mapped in them, each freed once.
    unsafe {
        model.mem_address_free(first, G).unwrap();
        model.mem_address_free(second, G).unwrap();
    }
}

/// Kills `src/backend/cuda/model.rs: replace += with *= in DriverModel::enter`: the model
/// counts every call made after its context was lost.
#[test]
fn the_model_counts_the_calls_after_a_loss() {
    let model = opened(config());
    model.fail_nth(DriverCall::MemCreate, 1, CuError::ILLEGAL_ADDRESS); // sticky
    assert!(model.mem_create(G, 0).is_err());
    assert_eq!(model.calls_after_loss(), 0);
    assert!(model.mem_create(G, 0).is_err());
    assert!(model.mem_create(G, 0).is_err());
    assert_eq!(model.calls_after_loss(), 2);
}

/// Fact 14: on a device without virtual memory management (attribute 102 is 0), every VMM
/// call is misuse, and the model panics at it, naming the attribute — whatever its arguments,
/// before it looks at them. Fails if the model's VMM check is skipped (the calls then fail or
/// panic for their arguments instead, or succeed).
#[test]
fn every_vmm_call_on_a_device_without_vmm_is_misuse() {
    use memtoken::backend::cuda::AllocationProps;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let model = opened(ModelConfig {
        vmm: false,
        ..config()
    });
    let props = AllocationProps::pinned(0);
    let calls: [(DriverCall, &dyn Fn()); 8] = [
        (DriverCall::MemGetAllocationGranularity, &|| {
            let _ = model.mem_get_allocation_granularity(props);
        }),
        (DriverCall::MemAddressReserve, &|| {
            let _ = model.mem_address_reserve(G, G, 0);
        }),
        (DriverCall::MemAddressFree, &|| {
            // SAFETY: the model touches no real memory; it panics at this misuse first.
            let _ = unsafe { model.mem_address_free(1 << 40, G) };
        }),
        (DriverCall::MemCreate, &|| {
            let _ = model.mem_create(G, 0);
        }),
        (DriverCall::MemRelease, &|| {
            // SAFETY: the model touches no real memory; it panics at this misuse first.
            let _ = unsafe { model.mem_release(1) };
        }),
        (DriverCall::MemMap, &|| {
            // SAFETY: the model touches no real memory; it panics at this misuse first.
            let _ = unsafe { model.mem_map(1 << 40, G, 0, 1) };
        }),
        (DriverCall::MemSetAccess, &|| {
            // SAFETY: the model touches no real memory; it panics at this misuse first.
            let _ = unsafe { model.mem_set_access(1 << 40, G, &[(0, true)]) };
        }),
        (DriverCall::MemUnmap, &|| {
            // SAFETY: the model touches no real memory; it panics at this misuse first.
            let _ = unsafe { model.mem_unmap(1 << 40, G) };
        }),
    ];
    for (call, make) in calls {
        let Err(panic) = catch_unwind(AssertUnwindSafe(make)) else {
            panic!("{call:?} on a device without VMM was let through");
        };
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        let misuse = format!(
            "DriverModel: illegal {call:?}: a VMM call on a device without virtual memory \
             management (attribute 102 is 0)"
        );
        assert_eq!(message, misuse);
    }
    let made = model.outstanding();
    assert_eq!(
        (made.reservations, made.physical_bytes, made.mappings),
        (0, 0, 0),
        "nothing made"
    );
}

// ---- Graphs (facts 39–41): what the model runs for `memtoken::interop::Capture`. ----

/// A capture through the driver: work submitted on the capturing stream becomes a node of
/// the graph, not work (fact 39); each launch of the instance runs the node as work on the
/// launch stream; an instance outlives its graph, and launches in flight outlive the instance.
#[test]
fn captured_work_runs_only_when_its_graph_is_launched() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let stream = model.new_stream();
    let (ptr, _) = mapped(&model);
    // SAFETY: (each call) a live stream of the model; the graph and instance are its own.
    unsafe {
        model
            .stream_begin_capture(stream, CaptureMode::Global)
            .unwrap();
        model.submit_work_touching(stream, &[(ptr, G)]);
        let graph = model.stream_end_capture(stream).unwrap();
        let exec = model.graph_instantiate(graph).unwrap();
        model.graph_destroy(graph).unwrap();
        model.graph_launch(exec, stream).unwrap();
        model.graph_exec_destroy(exec).unwrap();
        // The launch is work, still running after its instance went: unmapping under it
        // faults when it completes (fact 21).
        model.mem_unmap(ptr, G).unwrap();
    }
    model.complete_work();
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

/// The same capture with the memory unmapped before the launch is never run: nothing faults
/// while the graph is not launched.
#[test]
fn captured_work_never_launched_touches_nothing() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let stream = model.new_stream();
    let (ptr, _) = mapped(&model);
    // SAFETY: as above.
    unsafe {
        model
            .stream_begin_capture(stream, CaptureMode::Global)
            .unwrap();
        model.submit_work_touching(stream, &[(ptr, G)]);
        let graph = model.stream_end_capture(stream).unwrap();
        model.mem_unmap(ptr, G).unwrap();
        model.graph_destroy(graph).unwrap();
    }
    model.complete_work();
    assert_eq!(model.lost_with(), None);
}

/// A non-relaxed capture ends only on the thread that began it: from another, 908 and the
/// stream still captures; a begin on a capturing stream is refused.
#[test]
fn a_capture_ends_on_its_own_thread() {
    let model = opened(config());
    let stream = model.new_stream();
    // SAFETY: (each call) a live stream of the model.
    unsafe {
        model
            .stream_begin_capture(stream, CaptureMode::ThreadLocal)
            .unwrap();
        assert_eq!(
            model.stream_begin_capture(stream, CaptureMode::Global),
            Err(CuError::STREAM_CAPTURE_UNSUPPORTED)
        );
    }
    let other = model.clone();
    let ended = std::thread::scope(|s| {
        s.spawn(|| {
            let ctx = other.primary_ctx_retain(0).unwrap();
            // SAFETY: `ctx` was just retained; `stream` is live.
            unsafe {
                other.ctx_set_current(ctx).unwrap();
                other.stream_end_capture(stream)
            }
        })
        .join()
        .unwrap()
    });
    assert_eq!(ended, Err(CuError::STREAM_CAPTURE_WRONG_THREAD));
    // SAFETY: as above.
    unsafe {
        assert_eq!(model.stream_is_capturing(stream), Ok(true));
        let graph = model.stream_end_capture(stream).unwrap();
        model.graph_destroy(graph).unwrap();
    }
}

/// Fact 40, the strict reading (as for the VMM calls): instantiating and destroying graphs
/// from a thread in the global mode while another thread's global capture is open is refused
/// (900) and invalidates that capture; in the relaxed mode — how the backend makes them — both
/// go through and the capture ends valid.
#[test]
fn graph_calls_during_another_threads_global_capture_need_the_relaxed_mode() {
    for relaxed in [false, true] {
        let model = opened(config());
        let (first, capturing) = (model.new_stream(), model.new_stream());
        // SAFETY: (each call) live streams of the model; graphs and instances its own.
        let graph = unsafe {
            model
                .stream_begin_capture(first, CaptureMode::Global)
                .unwrap();
            model.stream_end_capture(first).unwrap()
        };
        model.begin_capture(capturing, CaptureMode::Global);
        let other = model.clone();
        let r = std::thread::scope(|s| {
            s.spawn(|| {
                let ctx = other.primary_ctx_retain(0).unwrap();
                // SAFETY: `ctx` was just retained; `graph` is the model's live graph.
                unsafe { other.ctx_set_current(ctx) }.unwrap();
                if relaxed {
                    other
                        .thread_exchange_capture_mode(CaptureMode::Relaxed)
                        .unwrap();
                }
                // SAFETY: as above.
                unsafe {
                    let exec = other.graph_instantiate(graph)?;
                    other.graph_exec_destroy(exec)?;
                    other.graph_destroy(graph)
                }
            })
            .join()
            .unwrap()
        });
        let ended = model.end_capture(capturing);
        if relaxed {
            assert_eq!((r, ended), (Ok(()), Ok(())));
        } else {
            assert_eq!(r, Err(CuError::STREAM_CAPTURE_UNSUPPORTED));
            assert_eq!(ended, Err(CuError::STREAM_CAPTURE_INVALIDATED));
        }
    }
}

// ---- cuStreamWaitEvent: order across streams. ----

/// A stream that waited on another's event runs its later work after that event's work: the
/// GPU cannot finish it sooner, so completing it completes the work it waited for; without
/// the wait, the other stream's work stays unfinished.
#[test]
fn a_stream_that_waited_finishes_only_after_the_work_it_waited_for() {
    for wait in [true, false] {
        let model = opened(ModelConfig {
            events_complete_at_once: false,
            ..config()
        });
        let (writer, reader) = (model.new_stream(), model.new_stream());
        let (written, read) = (model.event_create().unwrap(), model.event_create().unwrap());
        model.submit_work_on(writer); // a kernel writing
        // SAFETY: (each call) live streams and events of the model.
        unsafe {
            model.event_record(written, writer).unwrap();
            if wait {
                model.stream_wait_event(reader, written).unwrap();
            }
            model.submit_work_on(reader); // a kernel reading
            model.event_record(read, reader).unwrap();
        }
        model.complete_work_on(reader);
        // SAFETY: as above.
        let (w, r) = unsafe { (model.event_query(written), model.event_query(read)) };
        assert_eq!(r, Ok(true), "wait: {wait}");
        assert_eq!(w, Ok(wait), "the writer finished first only if waited for");
    }
}

/// A wait on an event never recorded waits for nothing; a capturing stream may not wait on an
/// event that is not captured: 905, and its capture is invalidated (fact 39).
#[test]
fn waits_on_unrecorded_events_and_from_captures() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..config()
    });
    let (a, b) = (model.new_stream(), model.new_stream());
    let event = model.event_create().unwrap();
    // SAFETY: (each call) live streams and events of the model.
    unsafe {
        model.stream_wait_event(b, event).unwrap();
        model.submit_work_on(b);
        model.complete_work_on(b);
        model.submit_work_on(a);
        model.event_record(event, a).unwrap();
        model.begin_capture(b, CaptureMode::Global);
        assert_eq!(
            model.stream_wait_event(b, event),
            Err(CuError::STREAM_CAPTURE_ISOLATION)
        );
    }
    assert_eq!(
        model.end_capture(b),
        Err(CuError::STREAM_CAPTURE_INVALIDATED)
    );
}

/// A stream that joined a capture stays joined when it waits on an event captured on itself:
/// only the capture's origin waiting on a joined stream joins that stream back, so the capture
/// still ends unjoined (fact 39). Fails if any wait inside the capture counts as a join back.
#[test]
fn a_joined_stream_waiting_on_its_own_captured_event_is_not_joined_back() {
    let model = opened(config());
    let (origin, joined) = (model.new_stream(), model.new_stream());
    let (forked, own) = (model.event_create().unwrap(), model.event_create().unwrap());
    model.begin_capture(origin, CaptureMode::Global);
    // SAFETY: (each call) live streams and events of the model.
    unsafe {
        model.event_record(forked, origin).unwrap();
        model.stream_wait_event(joined, forked).unwrap(); // `joined` joins the capture
        model.event_record(own, joined).unwrap();
        model.stream_wait_event(joined, own).unwrap(); // a dependency inside it
    }
    assert_eq!(
        model.end_capture(origin),
        Err(CuError::STREAM_CAPTURE_UNJOINED),
        "the joined stream was taken for joined back"
    );
}

/// The capture's origin waiting on an event captured on a joined stream joins that stream
/// back, and the capture ends (fact 39). Fails if the origin's wait does not join it back (the
/// end would be refused as unjoined).
#[test]
fn the_origin_waiting_on_a_joined_streams_event_joins_it_back() {
    let model = opened(config());
    let (origin, joined) = (model.new_stream(), model.new_stream());
    let (forked, back) = (model.event_create().unwrap(), model.event_create().unwrap());
    model.begin_capture(origin, CaptureMode::Global);
    // SAFETY: (each call) live streams and events of the model.
    unsafe {
        model.event_record(forked, origin).unwrap();
        model.stream_wait_event(joined, forked).unwrap(); // `joined` joins the capture
        model.event_record(back, joined).unwrap();
        model.stream_wait_event(origin, back).unwrap(); // and is joined back
    }
    assert!(model.end_capture(origin).is_ok(), "the capture ends joined");
}

/// A stream of one capture waiting on an event captured by another is refused
/// (`STREAM_CAPTURE_MERGE`) and invalidates both captures (fact 39), where a wait inside one
/// capture is a dependency. Fails if any capturing stream's wait is taken for one inside its
/// own capture (both captures would end with a graph).
#[test]
fn a_wait_across_two_captures_is_refused_and_invalidates_both() {
    let model = opened(config());
    let (a, b) = (model.new_stream(), model.new_stream());
    let on_a = model.event_create().unwrap();
    model.begin_capture(a, CaptureMode::Relaxed);
    model.begin_capture(b, CaptureMode::Relaxed);
    // SAFETY: (each call) live streams and events of the model.
    unsafe {
        model.event_record(on_a, a).unwrap();
        assert_eq!(
            model.stream_wait_event(b, on_a),
            Err(CuError::STREAM_CAPTURE_MERGE)
        );
    }
    for stream in [a, b] {
        assert_eq!(
            model.end_capture(stream),
            Err(CuError::STREAM_CAPTURE_INVALIDATED),
            "{stream:#x}"
        );
    }
}

/// A graph node whose range runs past a mapping's end into unmapped memory faults when the
/// graph is launched: every byte of the range must be mapped with access, not only its start.
#[test]
fn a_graph_node_reaching_past_a_mapping_into_unmapped_memory_faults() {
    let model = opened(config());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(2 * G, G, 0).unwrap();
    let handle = model.mem_create(G, 0).unwrap();
    // SAFETY: the fresh reservation's first granule is unmapped; `handle` is live and `G`
    // bytes long; the mapping just made is exactly `[ptr, ptr + G)`.
    unsafe {
        model.mem_map(ptr, G, 0, handle).unwrap();
        model.mem_set_access(ptr, G, &[(0, true)]).unwrap();
    }
    // SAFETY: a live stream of the model's context; the graph and its instance are the model's.
    let exec = unsafe {
        model
            .stream_begin_capture(stream, CaptureMode::Global)
            .unwrap();
        model.submit_work_touching(stream, &[(ptr, 2 * G)]); // the granule, and the next
        let graph = model.stream_end_capture(stream).unwrap();
        model.graph_instantiate(graph).unwrap()
    };
    // SAFETY: the model's instance on a live stream; half its memory is not mapped — the fault
    // this test documents.
    let _ = unsafe { model.graph_launch(exec, stream) };
    model.complete_work();
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

// The model's own settings and counts, its driver calls made directly.

#[test]
fn a_bad_configuration_is_an_error_not_a_panic() {
    let e = DriverModel::new(ModelConfig {
        granularity: 3 << 20,
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(e, ConfigError::GranularityNotPowerOfTwo { .. }),
        "{e}"
    );
    let e = DriverModel::new(ModelConfig {
        total_mem: 0,
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Zero {
                what: "device memory"
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("device memory is zero"), "{e}");
    let e = DriverModel::new(ModelConfig {
        exportable_granularity: Some(3 << 20),
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::GranularityNotPowerOfTwo {
                granularity: 0x30_0000
            }
        ),
        "{e}"
    );
}

#[test]
fn outstanding_names_what_the_model_holds() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let g = ModelConfig::default().granularity;
    let ptr = model.mem_address_reserve(2 * g, g, 0).unwrap();
    let handle = model.mem_create(g, 0).unwrap();
    // SAFETY: the first granule of the fresh reservation is unmapped; `handle` is live and
    // one granule long.
    unsafe { model.mem_map(ptr, g, 0, handle) }.unwrap();
    let event = model.event_create().unwrap();
    let held = model.outstanding();
    assert_eq!(
        held,
        ModelOutstanding {
            reservations: 1,
            physical_bytes: g,
            mappings: 1,
            events: 1,
            retains: 1,
        }
    );
    // SAFETY: each value was made above by this model and is given back once, the mapping
    // before its handle's memory and reservation, the retain last.
    unsafe {
        model.event_destroy(event).unwrap();
        model.mem_release(handle).unwrap();
        assert_eq!(
            model.outstanding().physical_bytes,
            g,
            "released while mapped"
        );
        model.mem_unmap(ptr, g).unwrap();
        model.mem_address_free(ptr, 2 * g).unwrap();
        model.primary_ctx_release(0).unwrap();
    }
    assert!(model.outstanding().is_zero());
}

#[test]
fn released_handles_and_destroyed_events_come_back() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let g = ModelConfig::default().granularity;
    let ptr = model.mem_address_reserve(g, g, 0).unwrap();
    let old = model.mem_create(g, 0).unwrap();
    let event = model.event_create().unwrap();
    // SAFETY: the fresh reservation is unmapped and `old` live; each value is given back
    // once, and the reissued ones are new live values.
    unsafe {
        model.mem_map(ptr, g, 0, old).unwrap();
        model.mem_release(old).unwrap();
        let new = model.mem_create(g, 0).unwrap();
        assert_eq!(
            new, old,
            "released while mapped, the value comes back at once"
        );
        assert_eq!(model.outstanding().physical_bytes, 2 * g);
        model.mem_unmap(ptr, g).unwrap();
        assert_eq!(model.outstanding().physical_bytes, g, "the old memory went");
        model.mem_release(new).unwrap();
        model.event_destroy(event).unwrap();
        assert_eq!(model.event_create().unwrap(), event);
        model.event_destroy(event).unwrap();
        model.mem_address_free(ptr, g).unwrap();
        model.primary_ctx_release(0).unwrap();
    }
    assert!(model.outstanding().is_zero());
}

/// The model's hooks between a check and an act count the calls they wait for: a capture
/// planned before the second `cuEventCreate` begins there, not at the first, and one planned to
/// end before the second ends there; none is planned on the legacy stream or a stream the model
/// does not know. Fails if a hook fires at another call than the one it was given.
/// Each capture the hook ends keeps a graph of its own: two ended in turn on one stream are two
/// graphs, never one number for both. Fails if the model's graph numbers do not advance.
#[test]
fn captures_ended_by_the_hook_each_keep_a_graph_of_their_own() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let stream = model.new_stream();
    let mut graphs = Vec::new();
    for _ in 0..2 {
        model.begin_capture(stream, CaptureMode::Global);
        model.end_capture_before(&[DriverCall::EventCreate], 1, stream);
        let event = model.event_create().unwrap();
        // SAFETY: a live event of the model, destroyed once.
        unsafe { model.event_destroy(event) }.unwrap();
        graphs.push(model.hook_graph().expect("the hook ended a valid capture"));
    }
    assert_ne!(graphs[0], graphs[1], "two captures, one graph number");
    // SAFETY: retained above, released once.
    unsafe { model.primary_ctx_release(0) }.unwrap();
}

#[test]
fn the_capture_hooks_fire_before_the_call_they_count_to() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let stream = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    let capturing = || unsafe { model.stream_is_capturing(stream) }.unwrap();
    let mut events = Vec::new();
    model.begin_capture_before(&[DriverCall::EventCreate], 2, stream, CaptureMode::Global);
    events.push(model.event_create().unwrap());
    assert!(!capturing(), "not before the first");
    events.push(model.event_create().unwrap());
    assert!(capturing(), "begun before the second");
    model.end_capture_before(&[DriverCall::EventCreate], 2, stream);
    events.push(model.event_create().unwrap());
    assert!(capturing(), "not ended before the first");
    events.push(model.event_create().unwrap());
    assert!(!capturing(), "ended before the second");
    for event in events {
        // SAFETY: live events of the model, destroyed once.
        unsafe { model.event_destroy(event) }.unwrap();
    }
    let legacy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.begin_capture_before(&[DriverCall::EventCreate], 1, 0, CaptureMode::Global)
    }));
    assert!(legacy.is_err(), "the legacy stream never captures");
    let unknown = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.begin_capture_before(&[DriverCall::EventCreate], 1, 0xdead, CaptureMode::Global)
    }));
    assert!(unknown.is_err(), "no stream of the model's");
    // SAFETY: retained above, released once.
    unsafe { model.primary_ctx_release(0) }.unwrap();
}
