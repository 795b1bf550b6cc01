//! The device's custody never under-reports: what a poll or a quarantine retry on one thread has
//! taken out of its queue and is tearing down stays counted, for every other thread, until it has
//! landed — so `custody()`, `withheld_ranges()` and `Progress` are never below what the ledger
//! still holds, and a loop such as `while device.poll().deferred > 0 {}` does not stop early.

use memtoken::backend::{Faulty, Op, SimBackend, SimConfig};
use memtoken::{Budget, Device, make_guard};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};

/// Residuals queued per round: enough that a teardown of all of them takes a while.
const QUEUED: usize = 300;
/// Rounds per test.
const ROUNDS: usize = 20;

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
                while device.poll().deferred > 0 {}
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
                while device.retry_quarantine().quarantined > 0 {}
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
