//! Promises of the README's "What is guaranteed" that no other test proved on its own: each test
//! here asserts one promise, so that breaking the code that keeps it fails the test.
//!
//! - the device never calls the backend while it holds its own locks (its quarantine and its
//!   deferred queue): a backend call that blocks does not stall another thread's bookkeeping;
//! - `Drop` in every state never blocks and never unmaps under work its fences cover;
//! - bad input is an error value that says what was asked and what is allowed, nothing charged;
//! - the host backend, which skips panic containment, refuses misuse with an error, never a
//!   panic.

use crate::common;
use crate::common::Grown;
use crate::common::gate::{Gate, GateHandle, STALL, gated_sim};
use memtoken::backend::cuda::{CudaBackend, DriverCall};
use memtoken::backend::{
    Access, Backend, HostBackend, HostConfig, Op,
    doubles::{Faulty, SimBackend},
};
use memtoken::{
    Budget, Device, TransitionError, errors::CommitFailure, errors::ReserveError, errors::Returned,
    errors::ShrinkError, make_guard,
};
use std::sync::mpsc;

// ---------------------------------------------------------------------------------------------
// No backend call under the device's own locks
// ---------------------------------------------------------------------------------------------

/// While a poll on one thread is stopped inside the backend's unmap (tearing down a release
/// whose fence completed), another thread reads the custody, polls, retries the quarantine and
/// drops a token into the deferred queue, all without waiting for that call.
#[test]
fn a_poll_stalled_in_the_backend_holds_no_lock_of_the_device() {
    let (sim, gate, gated) = gated_sim();
    make_guard!(guard);
    let device = Device::new(guard, gated);
    let g = device.granularity() as u64;
    let binding = device.bind(Budget::unlimited()).unwrap();
    let stalled = binding.reserve(1).unwrap().commit().unwrap();
    let later = binding.reserve(1).unwrap().commit().unwrap();
    drop(stalled);
    assert_eq!(device.custody().deferred.count, 1);
    sim.complete_fences();
    gate.arm(Op::Unmap);
    let (sent, seen) = mpsc::channel();
    std::thread::scope(|s| {
        let poller = s.spawn(|| device.poll());
        let entered = gate.wait_entered();
        s.spawn(|| {
            // Each of these takes the device's books: none may wait for the stalled unmap.
            let custody = device.custody();
            let withheld = device.withheld_ranges().len();
            let progress = device.poll();
            let retried = device.retry_quarantine();
            drop(later); // its fence is pending: queued behind it
            let queued = device.custody().deferred.count;
            sent.send((
                custody.deferred,
                withheld,
                progress.deferred,
                retried,
                queued,
            ))
            .unwrap();
        });
        let observed = seen.recv_timeout(STALL);
        gate.open(); // (before any assertion can fail: the scope joins both threads)
        assert!(entered, "the poll never reached the backend's unmap");
        let (custody, withheld, deferred, retried, queued) =
            observed.expect("another thread's bookkeeping stalled behind a backend call");
        assert_eq!(
            (custody.count, custody.mapped_bytes),
            (1, g),
            "the release being torn down is still counted"
        );
        assert_eq!(withheld, 1, "and its VA still withheld");
        assert_eq!(deferred, 1);
        assert_eq!(retried.released, 0);
        assert_eq!(queued, 2, "the dropped token queued beside it");
        assert_eq!(poller.join().unwrap().released, 1);
    });
    sim.complete_fences();
    assert_eq!(device.poll().released, 1);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The same for the quarantine: while a retry on one thread is stopped inside the backend's
/// unmap, another thread reads the custody, retries and polls, and drops a quarantined token
/// into the device's quarantine.
#[test]
fn a_quarantine_retry_stalled_in_the_backend_holds_no_lock_of_the_device() {
    let gate = GateHandle::default();
    let faulty = Faulty::new(SimBackend::default());
    let faults = faulty.handle();
    make_guard!(guard);
    let device = Device::new(
        guard,
        Gate {
            inner: faulty,
            gate: gate.clone(),
        },
    );
    let g = device.granularity() as u64;
    let binding = device.bind(Budget::unlimited()).unwrap();
    // One residual in the device's quarantine, and one quarantined token kept by the test.
    let stalled = binding.reserve(1).unwrap().commit().unwrap();
    faults.fail_nth(Op::Unmap, 1);
    drop(stalled);
    let kept = binding.reserve(1).unwrap().commit().unwrap();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(kept),
        ..
    }) = kept.release().complete()
    else {
        panic!("the unmap was failed on purpose");
    };
    assert_eq!(device.custody().quarantined.count, 1);
    gate.arm(Op::Unmap);
    let (sent, seen) = mpsc::channel();
    std::thread::scope(|s| {
        let retrier = s.spawn(|| device.retry_quarantine());
        let entered = gate.wait_entered();
        s.spawn(|| {
            let custody = device.custody();
            let withheld = device.withheld_ranges().len();
            let retried = device.retry_quarantine();
            let progress = device.poll();
            drop(kept); // into the device's quarantine
            let quarantined = device.custody().quarantined.count;
            sent.send((
                custody.quarantined,
                withheld,
                retried,
                progress,
                quarantined,
            ))
            .unwrap();
        });
        let observed = seen.recv_timeout(STALL);
        gate.open();
        assert!(entered, "the retry never reached the backend's unmap");
        let (custody, withheld, retried, progress, quarantined) =
            observed.expect("another thread's bookkeeping stalled behind a backend call");
        assert_eq!(
            (custody.count, custody.mapped_bytes),
            (1, g),
            "the residual being retried is still counted"
        );
        assert_eq!(withheld, 1, "and its VA still withheld");
        assert_eq!((retried.released, retried.quarantined), (0, 1));
        assert_eq!(progress.quarantined, 1);
        assert_eq!(quarantined, 2, "the dropped token quarantined beside it");
        assert_eq!(retrier.join().unwrap().released, 1);
    });
    assert_eq!(device.retry_quarantine().released, 1);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
}

// ---------------------------------------------------------------------------------------------
// Drop in every state
// ---------------------------------------------------------------------------------------------

/// With a kernel running on every mapped token, a token dropped in any state waits for nothing
/// and unmaps nothing: what is mapped goes to the deferred queue behind its fence, a quarantined
/// token to the quarantine, and only VA that maps nothing is freed at once. Once the work is
/// done, a poll releases it all, and the strict driver model saw nothing unmapped under the
/// kernel.
#[test]
fn drop_in_every_state_waits_for_nothing_and_unmaps_nothing_under_running_work() {
    let model = common::held_fences();
    let faulty = Faulty::new(CudaBackend::new(model.clone(), 0).unwrap());
    let faults = faulty.handle();
    make_guard!(guard);
    let device = Device::new(guard, faulty);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();

    let reserved = binding.reserve(g).unwrap();
    let committed = binding.reserve(g).unwrap().commit().unwrap();
    let to_release = binding.reserve(g).unwrap().commit().unwrap();
    let prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    let diverged = binding
        .reserve(2 * g)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap()
        .diverge()
        .map_err(|e| e.to_string())
        .unwrap();
    let region = binding.reserve(4 * g).unwrap().into_region().grown(2);
    let mut withholding = binding.reserve(4 * g).unwrap().into_region().grown(3);
    faults.fail_nth(Op::Unmap, 1);
    assert!(matches!(
        withholding.shrink(1),
        Err(ShrinkError::Withheld { granules: 1, .. })
    ));
    let asleep = binding
        .reserve(g)
        .unwrap()
        .commit()
        .unwrap()
        .suspend()
        .unwrap();
    faults.fail_nth(Op::Unmap, 1);
    let asleep_withholding = binding
        .reserve(g)
        .unwrap()
        .commit()
        .unwrap()
        .suspend()
        .unwrap();
    assert_eq!(asleep_withholding.withheld_bytes(), g);
    let quarantined = binding.reserve(g).unwrap().commit().unwrap();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = quarantined.release().complete()
    else {
        panic!("the unmap was failed on purpose");
    };

    model.submit_work(); // a kernel that may use everything mapped now
    let releasing = to_release.release();
    let ledger = device.ledger();
    let start = model.log().len();
    drop(reserved);
    drop(committed);
    drop(releasing);
    drop(prefix);
    drop(shared);
    drop(diverged);
    drop(region);
    drop(withholding);
    drop(asleep);
    drop(asleep_withholding);
    drop(quarantined);

    let calls = model.log()[start..].to_vec();
    for call in [
        DriverCall::MemUnmap,
        DriverCall::MemRelease,
        DriverCall::StreamSynchronize,
        DriverCall::EventSynchronize,
    ] {
        assert!(
            !calls.contains(&call),
            "a drop made {call:?} while the kernel runs: {calls:?}"
        );
    }
    let frees = calls
        .iter()
        .filter(|&&c| c == DriverCall::MemAddressFree)
        .count();
    assert_eq!(frees, 2, "only the VA that maps nothing is freed at once");
    assert_eq!(
        device.ledger().mapped_bytes,
        ledger.mapped_bytes,
        "nothing unmapped"
    );
    let custody = device.custody();
    assert_eq!(
        (custody.deferred.count, custody.quarantined.count),
        (8, 1),
        "the mapped ones wait for their fence, the quarantined one is in the quarantine"
    );
    assert_eq!(device.poll().deferred, 8, "the kernel still runs");

    model.complete_work();
    let p = device.poll();
    assert_eq!((p.released, p.deferred), (8, 0));
    assert_eq!(device.retry_quarantine().released, 1);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    assert_eq!(
        model.lost_with(),
        None,
        "nothing was unmapped under the kernel"
    );
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

/// Each refusal of bad input names what was asked and what is allowed, in its fields and its
/// message, and leaves nothing charged: not the ledger (any axis), not the budget, not the
/// backend.
#[test]
fn bad_input_says_what_was_asked_and_what_is_allowed_and_charges_nothing() {
    const PAGE: usize = 4096;
    let backend = Faulty::new(
        HostBackend::new(HostConfig {
            physical_capacity: 16 * PAGE as u64,
            address_space: 1 << 30,
            ..HostConfig::default()
        })
        .unwrap(),
    );
    let faults = backend.handle();
    make_guard!(guard);
    let device = Device::new(guard, backend);
    assert_eq!(device.granularity(), PAGE);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let nothing_charged = |what: &str| {
        assert!(device.ledger().is_zero(), "{what}: {:?}", device.ledger());
        assert_eq!(binding.used(), 0, "{what}");
        let o = faults.outstanding();
        assert_eq!(
            (o.reservations, o.physical, o.mappings),
            (0, 0, 0),
            "{what}"
        );
    };
    let says = |what: &str, message: String, numbers: &[String]| {
        for n in numbers {
            assert!(
                message.contains(n.as_str()),
                "{what}: {message:?} lacks {n}"
            );
        }
    };

    let e = binding.reserve(0).unwrap_err();
    assert_eq!(e, ReserveError::ZeroLength { granularity: PAGE });
    says(
        "zero",
        e.to_string(),
        &["0 bytes".into(), format!("{PAGE} bytes")],
    );
    nothing_charged("zero");

    let e = binding.reserve(usize::MAX).unwrap_err();
    assert_eq!(
        e,
        ReserveError::Overflow {
            requested: usize::MAX,
            granularity: PAGE
        }
    );
    says(
        "overflow",
        e.to_string(),
        &[usize::MAX.to_string(), format!("{PAGE} bytes")],
    );
    nothing_charged("overflow");

    let asked = (1 << 30) + 1;
    let e = binding.reserve(asked).unwrap_err();
    assert_eq!(
        e,
        ReserveError::TooLarge {
            requested: asked,
            rounded: (1 << 30) + PAGE,
            limit: 1 << 30
        }
    );
    says(
        "too large",
        e.to_string(),
        &[asked.to_string(), (1usize << 30).to_string()],
    );
    nothing_charged("too large");
    assert_eq!(
        faults.calls(Op::Reserve),
        0,
        "refused before any backend call"
    );

    let reserved = binding.reserve(17 * PAGE).unwrap();
    let addr = reserved.addr();
    let e = reserved.commit().unwrap_err();
    assert_eq!(
        e.cause,
        CommitFailure::Capacity {
            requested: 17 * PAGE as u64,
            capacity: 16 * PAGE as u64
        }
    );
    says(
        "capacity",
        e.cause.to_string(),
        &[(17 * PAGE).to_string(), (16 * PAGE).to_string()],
    );
    assert_eq!(e.token.addr(), addr, "the reservation comes back");
    let l = device.ledger();
    assert_eq!(
        (l.reserved_bytes, l.mapped_bytes, l.owned_bytes),
        (17 * PAGE as u64, 0, 0),
        "only the reservation, which the token still holds"
    );
    assert_eq!(binding.used(), 0);
    assert_eq!(
        faults.calls(Op::Create),
        0,
        "refused before any backend call"
    );
    drop(e);
    nothing_charged("capacity");
}

// ---------------------------------------------------------------------------------------------
// The host backend: errors, never panics
// ---------------------------------------------------------------------------------------------

/// `HostBackend::MAY_PANIC` is false, so its calls are not contained: every misuse must come
/// back as an error value. Each call below breaks a rule (a length or an address unaligned,
/// zero or past the end of the address space, a range not reserved or not mapped, a handle of
/// the wrong length, released or still mapped, a copy onto itself or into read-only memory);
/// each is refused, and the backend is left as it was.
#[test]
fn the_host_backend_refuses_misuse_with_an_error_never_a_panic() {
    let b = HostBackend::with_defaults().unwrap();
    let g = b.granularity();
    // Aligned, but one granule from it runs past the end of the address space.
    let top = usize::MAX - (g - 1);
    let capacity = usize::try_from(b.physical_capacity()).unwrap_or(usize::MAX / 2);
    let past_capacity = capacity.next_multiple_of(g) + g;

    assert!(b.reserve(0).is_err(), "reserve 0");
    assert!(b.reserve(g + 1).is_err(), "reserve unaligned");
    assert!(b.reserve(top).is_err(), "reserve past the address space");
    assert!(b.create(0).is_err(), "create 0");
    assert!(b.create(g + 1).is_err(), "create unaligned");
    assert!(b.create(past_capacity).is_err(), "create past the capacity");

    let addr = b.reserve(2 * g).unwrap();
    let phys = b.create(g).unwrap();
    let big = b.create(2 * g).unwrap();
    let rw = Access::ReadWrite;
    for (why, at, len, p) in [
        ("unaligned address", addr + 1, g, phys),
        ("unaligned length", addr, g + 1, phys),
        ("zero length", addr, 0, phys),
        ("past the end of the address space", top, g, phys),
        ("past the reservation", addr + 2 * g, g, phys),
        ("straddling the reservation's end", addr + g, 2 * g, big),
        ("more than the handle holds", addr, 2 * g, phys),
        ("less than the handle holds", addr, g, big),
    ] {
        assert!(b.map(at, len, p, rw).is_err(), "map: {why}");
    }
    b.map(addr, g, phys, rw).unwrap();
    assert!(b.map(addr, g, phys, rw).is_err(), "map: twice");
    assert!(b.map(addr, 2 * g, big, rw).is_err(), "map: over a mapping");

    for (why, at, len) in [
        ("not mapped", addr + g, g),
        ("partly mapped", addr, 2 * g),
        ("zero length", addr, 0),
        ("inside a mapping", addr + 1, g - 1),
        ("past the end of the address space", top, g),
    ] {
        assert!(b.unmap(at, len).is_err(), "unmap: {why}");
    }

    assert!(
        b.copy_into_phys(phys, addr, g).is_err(),
        "copy: onto itself"
    );
    assert!(
        b.copy_into_phys(big, addr, g).is_err(),
        "copy: wrong length"
    );
    assert!(
        b.copy_into_phys(big, addr, 2 * g).is_err(),
        "copy: not mapped"
    );
    assert!(b.copy_into_phys(big, top, g).is_err(), "copy: past the end");
    let mut buf = [0u8; 16];
    assert!(
        b.copy_to_host(&mut buf, addr + g).is_err(),
        "to host: not mapped"
    );
    assert!(
        b.copy_to_host(&mut buf, usize::MAX - 7).is_err(),
        "to host: past the end"
    );
    assert!(
        b.copy_from_host(addr + g, &buf).is_err(),
        "from host: not mapped"
    );
    assert!(
        b.copy_from_host(usize::MAX - 7, &buf).is_err(),
        "from host: past the end"
    );
    let ro = b.reserve(g).unwrap();
    let ro_phys = b.create(g).unwrap();
    b.map(ro, g, ro_phys, Access::ReadOnly).unwrap();
    assert!(b.copy_from_host(ro, &buf).is_err(), "from host: read-only");

    assert!(b.release(phys, 2 * g).is_err(), "release: wrong length");
    assert!(b.release(phys, g).is_err(), "release: still mapped");
    assert!(b.free(addr, 2 * g).is_err(), "free: still mapped");
    assert!(b.free(addr, g).is_err(), "free: wrong length");
    assert!(
        b.free(addr + g, g).is_err(),
        "free: not a reservation's start"
    );

    // Undone properly, and then each call once more: the second is refused.
    b.unmap(addr, g).unwrap();
    assert!(b.unmap(addr, g).is_err(), "unmap: twice");
    b.release(phys, g).unwrap();
    assert!(b.release(phys, g).is_err(), "release: twice");
    assert!(b.map(addr, g, phys, rw).is_err(), "map: a released handle");
    b.free(addr, 2 * g).unwrap();
    assert!(b.free(addr, 2 * g).is_err(), "free: twice");
    assert!(b.map(addr, 2 * g, big, rw).is_err(), "map: into freed VA");
    assert!(b.copy_to_host(&mut buf, addr).is_err(), "to host: freed VA");

    b.unmap(ro, g).unwrap();
    b.release(ro_phys, g).unwrap();
    b.release(big, 2 * g).unwrap();
    b.free(ro, g).unwrap();
    assert_eq!(b.physical_in_use(), 0);
}

/// The typed layer reads a backend's getters (granularity, address space, capacity, location)
/// once, when the device is made, and never again: a backend whose getters panic from then on
/// goes through commits, prefixes and their sharers, copy-on-write, a region's growth and
/// shrink, sleep and wake, an export and its import, a KV cache and a registration without
/// one getter call — so no getter can panic in the middle of a transition and strand what it
/// had built — and everything goes back.
#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
fn getters_are_read_once_so_none_can_panic_inside_a_transition() {
    use memtoken::backend::PosixFd;
    use memtoken::sharing::Offer;
    use std::os::unix::net::UnixStream;
    make_guard!(guard);
    // A `memfd` store whatever MEMTOKEN_HOST_MEMORY says: this test exports.
    let backend = Faulty::new(memtoken::backend::HostBackend::with_defaults().unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let read_at_creation = faults.getter_calls();
    // Each of the four getters once, when the device is made.
    assert_eq!(read_at_creation, 4, "the device reads each getter once");
    faults.panic_getters(true);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let a = binding.reserve(g).unwrap().commit().unwrap();
    assert_eq!(a.register().descriptor().len, g); // its location, read once
    let prefix = binding.reserve(3 * g).unwrap().commit_prefix().unwrap();
    let sharer = binding.reserve(3 * g).unwrap().map_prefix(&prefix).unwrap();
    let diverged = sharer.diverge().unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(3);
    region.shrink(2).unwrap();
    region.grow(1).unwrap();
    let asleep = binding
        .reserve(g)
        .unwrap()
        .commit()
        .unwrap()
        .suspend_saving()
        .unwrap();
    let awake = asleep.resume().unwrap();
    let exportable = binding
        .reserve(2 * g)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    let export = exportable.export().unwrap();
    let (x, y) = UnixStream::pair().unwrap();
    export.send(&x).unwrap();
    let imported = binding.import(Offer::recv(&y).unwrap()).unwrap();
    make_guard!(cache_guard);
    let layout = memtoken::kv::Layout::new(64, 16).plane(g / 4);
    let cache = memtoken::kv::KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.replenish().unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    table.write(0, 0, 0, &[1; 8]).unwrap();
    cache.sleep_saving().unwrap();
    cache.wake().unwrap();
    cache.clear(&mut table);
    drop(table);
    drop(cache);
    assert_eq!(
        faults.getter_calls(),
        read_at_creation,
        "no getter after the device was made"
    );
    drop((
        imported, export, exportable, awake, region, diverged, prefix, a,
    ));
    drop(binding);
    faults.panic_getters(false);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// The premise of the test above: while `panic_getters(true)` holds, each of a `Faulty`
/// backend's four getters panics, naming itself, and once it is set back each answers again —
/// counted either way — so a getter read after the device was made would have panicked
/// there. Fails if `panic_getters` does not switch the getters' panic.
#[test]
fn getters_set_to_panic_panic_until_set_back() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let getters: [(&str, &dyn Fn()); 4] = [
        ("granularity", &|| {
            let _ = backend.granularity();
        }),
        ("address_space", &|| {
            let _ = backend.address_space();
        }),
        ("physical_capacity", &|| {
            let _ = backend.physical_capacity();
        }),
        ("location", &|| {
            let _ = backend.location();
        }),
    ];
    faults.panic_getters(true);
    for (name, getter) in getters {
        let Err(panic) = catch_unwind(AssertUnwindSafe(getter)) else {
            panic!("the getter {name} answered while set to panic");
        };
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(
            message,
            format!("Faulty: panic injected into the getter {name}")
        );
    }
    faults.panic_getters(false);
    for (name, getter) in getters {
        assert!(catch_unwind(AssertUnwindSafe(getter)).is_ok(), "{name}");
    }
    assert_eq!(faults.getter_calls(), 8, "counted either way");
}
