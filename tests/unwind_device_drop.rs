//! Regression test (found in review, fixed): `Device::drop` calls `shutdown()` (poll, trim_cache, retry_quarantine) before it
//! opens its own scope, so `poll`'s `Scope::run` is the outermost scope and resumes a contained
//! backend panic in the middle of `Device::drop`: the rest of the drop (the deferred queue's
//! wait-and-release, the cache trim, the quarantine retry, the forgotten bindings' unpins) is
//! skipped, and what the device held is left in the backend while its context lives on.

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
