//! Regression test (found in review, fixed): `Device::drop` calls `shutdown()` (poll, trim_cache, retry_quarantine) before it
//! opens its own scope, so `poll`'s `Scope::run` is the outermost scope and resumes a contained
//! backend panic in the middle of `Device::drop`: the rest of the drop (the deferred queue's
//! wait-and-release, the cache trim, the quarantine retry, the forgotten bindings' unpins) is
//! skipped, and what the device held is left in the backend while its context lives on.
//!
//! Also: what a dropped device says on stderr (child runs of this binary: stderr is the
//! process's there).

use memtoken::backend::{
    Op,
    doubles::{Faulty, SimBackend, SimConfig},
};
use memtoken::{Budget, Device, make_guard};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Silences the injected panics only (so assertion failures still print).
fn quiet() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.starts_with("Faulty: panic injected"));
        if !injected {
            default(info);
        }
    }));
}

fn sim() -> SimBackend {
    SimBackend::new(SimConfig {
        granularity: 4096,
        fences_complete_at_once: false,
        ..SimConfig::strict()
    })
    .unwrap()
}

#[test]
fn a_panic_in_the_drops_poll_leaves_the_deferred_queue_in_the_backend() {
    quiet();
    let sim = sim();
    let faulty = Faulty::new(sim.clone());
    let faults = faulty.handle();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        make_guard!(guard);
        let device = Device::new(guard, faulty);
        let binding = device.bind(Budget::unlimited()).unwrap();
        drop(binding.reserve(4096).unwrap().commit().unwrap()); // deferred: fence pending
        drop(binding);
        assert_eq!(device.custody().deferred.count, 1);
        sim.complete_fences();
        // The poll in shutdown() asks whether the fence is done: that call panics.
        faults.panic_nth(Op::Fence, 1);
        drop(device);
    }));
    assert!(caught.is_err(), "the contained panic resumes");
    assert!(
        faults.outstanding().is_zero(),
        "the device dropped with its context alive left {:?} in the backend",
        faults.outstanding()
    );
}

#[test]
fn a_panic_in_the_drops_poll_skips_the_forgotten_bindings_unpin() {
    quiet();
    let sim = sim();
    let faulty = Faulty::new(sim.clone());
    let faults = faulty.handle();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        make_guard!(guard);
        let device = Device::new(guard, faulty);
        let binding = device.bind(Budget::unlimited()).unwrap();
        drop(binding.reserve(4096).unwrap().commit().unwrap());
        std::mem::forget(binding);
        sim.complete_fences();
        faults.panic_nth(Op::Fence, 1);
        drop(device);
    }));
    assert!(caught.is_err());
    assert_eq!(
        sim.pins(),
        0,
        "the forgotten binding's pin was never given back"
    );
}

/// Which device the child run of [`a_dropped_device_speaks_only_of_what_it_leaves`] drops.
const DROP_CHILD: &str = "MEMTOKEN_DROP_CHILD";

/// A device dropped without `close` and without a sink says what it leaves, on stderr — and
/// says nothing when it leaves nothing. Each is dropped in a child run of this test (stderr is
/// the process's there), whose stderr the parent reads.
#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn a_dropped_device_speaks_only_of_what_it_leaves() {
    if let Ok(which) = std::env::var(DROP_CHILD) {
        // Fences complete at once: what a drop leaves is only what the faults leave.
        let sim = SimBackend::new(SimConfig {
            granularity: 4096,
            ..SimConfig::strict()
        });
        let backend = Faulty::new(sim.unwrap());
        let faults = backend.handle();
        make_guard!(guard);
        let device = Device::new(guard, backend);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let memory = binding.reserve(4096).unwrap().commit().unwrap();
        if which == "unclean" {
            // Every unmap fails: the memory is quarantined, and stays so through the drop.
            faults.fail_from(Op::Unmap, 1);
        }
        drop(memory);
        drop(binding);
        drop(device);
        return;
    }
    let run = |which: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "a_dropped_device_speaks_only_of_what_it_leaves",
                "--exact",
                "--nocapture",
            ])
            .env(DROP_CHILD, which)
            .output()
            .unwrap();
        assert!(out.status.success(), "the {which} child: {}", out.status);
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let clean = run("clean");
    assert!(
        !clean.contains("memtoken: a device dropped"),
        "a clean drop said something: {clean}"
    );
    let unclean = run("unclean");
    assert!(
        unclean.contains("memtoken: a device dropped") && unclean.contains("quarantine"),
        "a drop that leaves memory quarantined says so: {unclean}"
    );
}
