//! The device's custody never under-reports: what a poll or a quarantine retry on one thread has
//! taken out of its queue and is tearing down stays counted, for every other thread, until it has
//! landed — so `custody()`, `withheld_ranges()` and `Progress` are never below what the ledger
//! still holds, and a loop such as `while device.poll().deferred > 0 {}` does not stop early.

use crate::common::gate::{gated_sim, manual_sim};
use crate::common::{self, GRANULE};
use memtoken::backend::{
    Backend, Op,
    doubles::{Faulty, SimBackend, SimConfig},
};
use memtoken::{Budget, Device, TransitionError, errors::Returned, make_guard};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};

/// Residuals queued per round: enough that a teardown of all of them takes a while.
const QUEUED: usize = common::unless_miri(300, 30);
/// Rounds per test.
const ROUNDS: usize = common::unless_miri(20, 2);

fn sim() -> (SimBackend, Faulty<SimBackend>) {
    let sim = SimBackend::new(SimConfig {
        granularity: 1 << 16,
        fences_complete_at_once: false,
        ..SimConfig::strict()
    })
    .unwrap();
    (sim.clone(), Faulty::new(sim))
}

/// One round: `QUEUED` committed allocations are dropped behind fences that are then completed
/// (or, with `fail_unmaps`, quarantined by failed unmaps); `tear_down` empties the queue on
/// one thread while `observe` reads the device on another until the first is done.
fn round(
    fail_unmaps: bool,
    tear_down: impl Fn(&Device<'_, Faulty<SimBackend>>) + Sync,
    observe: impl Fn(&Device<'_, Faulty<SimBackend>>, &AtomicBool) + Sync,
) {
    make_guard!(guard);
    let (sim, faulty) = sim();
    let faults = faulty.handle();
    let device = Device::new(guard, faulty);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let tokens: Vec<_> = (0..QUEUED)
        .map(|_| binding.reserve(1).unwrap().commit().unwrap())
        .collect();
    drop(tokens);
    assert_eq!(device.custody().deferred.count, QUEUED);
    sim.complete_fences();
    if fail_unmaps {
        faults.fail_from(Op::Unmap, 1);
        device.poll();
        faults.clear();
        assert_eq!(device.custody().quarantined.count, QUEUED);
    }
    let done = AtomicBool::new(false);
    let start = Barrier::new(2);
    std::thread::scope(|s| {
        s.spawn(|| {
            start.wait();
            tear_down(&device);
            done.store(true, Ordering::Release);
        });
        s.spawn(|| {
            start.wait();
            observe(&device, &done);
        });
    });
    device.poll();
    device.retry_quarantine();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
}

/// What the custody counts never falls below what the ledger still holds: nothing else is
/// charged while the queue is torn down, and the ledger only falls, so reading the custody first
/// and the ledger second can only favour the ledger.
fn custody_covers_the_ledger(device: &Device<'_, Faulty<SimBackend>>, done: &AtomicBool) {
    while !done.load(Ordering::Acquire) {
        let custody = device.custody();
        let withheld: usize = device.withheld_ranges().iter().map(|&(_, len)| len).sum();
        let ledger = device.ledger();
        let counted = custody.deferred.reserved_bytes + custody.quarantined.reserved_bytes;
        assert!(
            counted >= ledger.reserved_bytes,
            "custody counts {counted} reserved bytes while the ledger still holds {}",
            ledger.reserved_bytes
        );
        let owned = custody.deferred.owned_bytes + custody.quarantined.owned_bytes;
        assert!(
            owned >= ledger.owned_bytes,
            "custody counts {owned} owned bytes while the ledger still holds {}",
            ledger.owned_bytes
        );
        assert!(
            withheld as u64 >= device.ledger().reserved_bytes,
            "{withheld} bytes withheld while the ledger still holds {} reserved",
            device.ledger().reserved_bytes
        );
    }
}

#[test]
fn while_one_thread_polls_another_never_sees_less_than_the_ledger_holds() {
    for _ in 0..ROUNDS {
        round(
            false,
            |device| {
                device.poll();
            },
            custody_covers_the_ledger,
        );
    }
}

#[test]
fn while_one_thread_retries_the_quarantine_another_never_sees_less_than_the_ledger_holds() {
    for _ in 0..ROUNDS {
        round(
            true,
            |device| {
                device.retry_quarantine();
            },
            custody_covers_the_ledger,
        );
    }
}

#[test]
fn a_loop_until_poll_reports_nothing_deferred_ends_with_everything_released() {
    for _ in 0..ROUNDS {
        round(
            false,
            |device| {
                device.poll();
            },
            |device, _| {
                while device.poll().deferred > 0 {
                    std::hint::spin_loop(); // under Miri, lets the other thread run
                }
                let ledger = device.ledger();
                assert_eq!(
                    (ledger.reserved_bytes, ledger.owned_bytes),
                    (0, 0),
                    "poll() reported nothing deferred while releases were still being torn down"
                );
            },
        );
    }
}

#[test]
fn a_loop_until_the_retry_reports_nothing_quarantined_ends_with_everything_released() {
    for _ in 0..ROUNDS {
        round(
            true,
            |device| {
                device.retry_quarantine();
            },
            |device, _| {
                while device.retry_quarantine().quarantined > 0 {
                    std::hint::spin_loop(); // under Miri, lets the other thread run
                }
                let ledger = device.ledger();
                assert_eq!(
                    (ledger.reserved_bytes, ledger.quarantined),
                    (0, 0),
                    "retry_quarantine() reported nothing quarantined while residuals were still \
                     being torn down"
                );
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Teardown: a dropped device's retries, fences it leaves to the driver, sharers in teardown
// ---------------------------------------------------------------------------------------------

/// A device over `wrap(simulator)` dropped while a release waits for its fence: nothing of it
/// is freed.
fn dropped_before_the_fence_completes<W: Backend>(wrap: impl FnOnce(SimBackend) -> W) {
    let sim = manual_sim();
    {
        make_guard!(guard);
        let device = Device::new(guard, wrap(sim.clone()));
        let binding = device.bind(Budget::unlimited()).unwrap();
        drop(
            binding
                .reserve(GRANULE)
                .unwrap()
                .commit()
                .unwrap()
                .release(),
        );
    }
    assert_eq!(
        (sim.reservations(), sim.mappings(), sim.physical_in_use()),
        (1, 1, GRANULE as u64)
    );
}

/// Kills `src/device.rs: delete ! in <impl Drop for Device<'_, B>>::drop`: a device dropped
/// without `close` still shuts down first (a poll and a quarantine retry) before its own last
/// retry, so a residual whose first retry fails is released by the second.
#[test]
fn a_dropped_device_retries_its_quarantine_twice() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    faults.fail_nth(Op::Release, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = a.release().complete()
    else {
        panic!("the release was failed on purpose");
    };
    drop(quarantined); // into the device's quarantine
    faults.fail_nth(Op::Release, 1); // the next retry fails too
    drop(binding);
    drop(device);
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// Kills `src/backend/mod.rs: replace Backend::wait_fence -> bool with true` (the default, which
/// the simulator uses) and `src/backend/faulty.rs: replace <impl Backend for Faulty<B>>::wait_fence
/// -> bool with true`: a device dropped while a release's fence has not completed leaves that
/// memory to the driver, never frees it under the work.
#[test]
fn a_device_dropped_before_a_fence_completes_frees_nothing_under_it() {
    dropped_before_the_fence_completes(|sim| sim);
    dropped_before_the_fence_completes(Faulty::new);
}

/// Kills `src/residual.rs: replace += with -= in Holdings::absorb`: while a poll on one thread
/// is stopped in the backend tearing down a sharer's release, another thread's custody
/// reading counts the shared reference it still holds.
#[test]
fn a_sharer_being_torn_down_still_counts_its_shared_reference() {
    let (sim, gate, gated) = gated_sim();
    make_guard!(guard);
    let device = Device::new(guard, gated);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(1).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(1).unwrap().map_prefix(&prefix).unwrap();
    drop(shared);
    assert_eq!(device.custody().deferred.shared_refs, 1);
    sim.complete_fences();
    gate.arm(Op::Unmap);
    std::thread::scope(|s| {
        let poller = s.spawn(|| device.poll());
        let entered = gate.wait_entered();
        let reading = std::panic::catch_unwind(|| device.custody().deferred);
        gate.open(); // before any assertion can fail: the scope joins the poller
        assert!(entered, "the poll never reached the backend's unmap");
        let deferred = reading.expect("reading the custody");
        assert_eq!((deferred.count, deferred.shared_refs), (1, 1));
        assert_eq!(poller.join().unwrap().released, 1);
    });
    drop(prefix);
    sim.complete_fences();
    device.poll();
    drop(binding);
    assert!(device.close().is_clean());
}
