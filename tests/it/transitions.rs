//! Every transition and every failure path, on the host backend and the strict simulator, with
//! faults injected through `Faulty`: nothing is lost, nothing is charged twice.

use crate::common::gate::manual_sim;
use crate::common::{self, GRANULE, assert_no_cause_repeated, host, says_first, setup};
use memtoken::backend::{
    HostBackend, HostConfig, Op,
    doubles::{Faulty, SimBackend, SimConfig},
};
use memtoken::{
    Budget, Device, TransitionError, errors::CommitFailure, errors::ReleaseFailure,
    errors::ReserveError, errors::Returned, make_guard,
};

const PAGE: usize = 4096;

#[test]
fn full_cycle_on_host_charges_and_refunds_each_axis_once() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(3 * PAGE + 1).unwrap();
    assert_eq!(reserved.len(), 4 * PAGE, "rounded up to the granularity");
    let l = device.ledger();
    assert_eq!(
        (l.reserved_bytes, l.mapped_bytes, l.owned_bytes),
        (4 * PAGE as u64, 0, 0)
    );

    let mut committed = reserved.commit().unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes),
        (4 * PAGE as u64, 4 * PAGE as u64)
    );
    assert_eq!(binding.used(), 4 * PAGE as u64);
    committed.as_mut_slice().fill(0xAB);
    assert!(committed.as_slice().iter().all(|&b| b == 0xAB));

    let releasing = committed.release();
    assert!(releasing.is_ready(), "host fences complete at once");
    let receipt = releasing.complete().unwrap();
    assert_eq!(receipt.len, 4 * PAGE);
    assert!(device.ledger().is_zero());
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    assert!(device.close().is_clean());
}

#[test]
fn failed_create_returns_the_reserved_token_with_nothing_charged() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(PAGE).unwrap();
    let (addr, generation) = (reserved.addr(), reserved.generation());
    faults.fail_nth(Op::Create, 1);
    let err = reserved.commit().unwrap_err();
    assert!(matches!(err.cause, CommitFailure::Backend(ref e) if e.op == Op::Create));
    assert_eq!(
        (err.token.addr(), err.token.generation()),
        (addr, generation)
    );
    let l = device.ledger();
    assert_eq!((l.mapped_bytes, l.owned_bytes), (0, 0));
    assert_eq!(binding.used(), 0);
    assert_eq!(faults.outstanding().physical, 0);
    // The same token commits once the fault is gone.
    let committed = err.into_token().commit().unwrap();
    assert_eq!(committed.addr(), addr);
}

#[test]
fn failed_map_rolls_back_the_physical_memory() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    faults.fail_nth(Op::Map, 1);
    let err = binding.reserve(PAGE).unwrap().commit().unwrap_err();
    assert!(matches!(err.cause, CommitFailure::Backend(ref e) if e.op == Op::Map));
    let o = faults.outstanding();
    assert_eq!((o.physical, o.mappings, o.reservations), (0, 0, 1));
    assert_eq!(device.ledger().owned_bytes, 0);
    assert_eq!(binding.used(), 0);
}

#[test]
fn failed_map_and_failed_rollback_quarantine_the_orphan_physical_memory() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    faults.fail_nth(Op::Map, 1);
    faults.fail_nth(Op::Release, 1);
    let err = binding.reserve(PAGE).unwrap().commit().unwrap_err();
    assert!(matches!(err.cause, CommitFailure::RollbackFailed { .. }));
    assert!(
        err.cause.to_string().contains("retry_quarantine"),
        "{}",
        err.cause
    );
    assert_no_cause_repeated(&err.cause);
    assert_eq!(
        binding.used(),
        0,
        "the binding is not charged for the orphan"
    );
    let l = device.ledger();
    assert_eq!((l.owned_bytes, l.quarantined), (PAGE as u64, 1));
    assert_eq!(device.custody().quarantined.owned_bytes, PAGE as u64);
    let p = device.retry_quarantine();
    assert_eq!((p.released, p.quarantined), (1, 0));
    assert_eq!(device.ledger().owned_bytes, 0);
    assert_eq!(faults.outstanding().physical, 0);
}

#[test]
fn failed_unmap_quarantines_with_va_withheld_and_mapped_bytes_charged() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let committed = binding.reserve(g).unwrap().commit().unwrap();
    let addr = committed.addr();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause,
    }) = committed.release().complete()
    else {
        panic!("unmap was failed on purpose");
    };
    assert!(matches!(cause, ReleaseFailure::Backend(ref e) if e.op == Op::Unmap));
    let r = quarantined.residual();
    assert!(r.holds_va());
    assert_eq!((r.mapped_bytes(), r.owned_bytes()), (g, g));
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes, l.quarantined),
        (g as u64, g as u64, 1)
    );
    assert_eq!(binding.used(), g as u64, "quarantined bytes stay charged");
    // The withheld VA is not handed out again (the simulator reuses the lowest free range).
    let next = binding.reserve(g).unwrap();
    assert_ne!(next.addr(), addr);
    // A retry after the fault clears releases everything.
    let receipt = quarantined.retry().unwrap();
    assert_eq!(receipt.len, g);
    drop(next);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn failed_physical_release_refunds_mapped_but_not_owned() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(2 * PAGE).unwrap().commit().unwrap();
    faults.fail_nth(Op::Release, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = committed.release().complete()
    else {
        panic!("release was failed on purpose");
    };
    let r = quarantined.residual();
    assert_eq!(
        (r.mapped_bytes(), r.owned_bytes(), r.holds_va()),
        (0, 2 * PAGE, true)
    );
    let l = device.ledger();
    assert_eq!((l.mapped_bytes, l.owned_bytes), (0, 2 * PAGE as u64));
    let o = faults.outstanding();
    assert_eq!((o.mappings, o.physical, o.reservations), (0, 1, 1));
    quarantined.retry().unwrap();
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn failed_free_of_reserved_quarantines_the_va_and_retry_frees_it() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let reserved = binding.reserve(g).unwrap();
    let addr = reserved.addr();
    faults.fail_from(Op::Free, 1);
    let releasing = reserved.release();
    assert!(releasing.is_ready(), "a reservation has no fence");
    let err = releasing.complete().unwrap_err();
    assert!(err.to_string().contains("VA withheld"), "{err}");
    let Returned::Quarantined(quarantined) = err.into_token() else {
        panic!("the free was failed on purpose");
    };
    let again = quarantined.retry().unwrap_err(); // still failing
    assert_eq!(again.token.residual().range(), (addr, g));
    faults.clear();
    again.into_token().retry().unwrap();
    assert!(device.ledger().is_zero());
}

#[test]
fn dropped_tokens_whose_teardown_fails_land_in_the_device_quarantine() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(PAGE).unwrap().commit().unwrap();
    let reserved = binding.reserve(PAGE).unwrap();
    faults.fail_nth(Op::Unmap, 1);
    faults.fail_nth(Op::Free, 1);
    drop(committed);
    drop(reserved);
    let l = device.ledger();
    assert_eq!(l.quarantined, 2);
    assert_eq!(device.withheld_ranges().len(), 2, "both withhold their VA");
    let q = device.custody().quarantined;
    assert_eq!((q.mapped_bytes, q.owned_bytes), (PAGE as u64, PAGE as u64));
    assert_eq!(
        binding.used(),
        0,
        "custody moved from the binding to the device"
    );
    let p = device.retry_quarantine();
    assert_eq!((p.released, p.quarantined), (2, 0));
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn dropped_quarantined_token_stays_counted_in_the_device() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(1).unwrap().commit().unwrap();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = committed.release().complete()
    else {
        panic!("unmap was failed on purpose");
    };
    drop(quarantined);
    assert_eq!(device.ledger().quarantined, 1);
    assert_eq!(device.retry_quarantine().released, 1);
    assert!(device.ledger().is_zero());
}

#[test]
fn budget_is_enforced_with_numbers_and_the_token_back() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::bytes(3 * PAGE as u64)).unwrap();
    let _a = binding.reserve(2 * PAGE).unwrap().commit().unwrap();
    let err = binding.reserve(2 * PAGE).unwrap().commit().unwrap_err();
    assert_eq!(
        err.cause,
        CommitFailure::Budget {
            requested: 2 * PAGE as u64,
            used: 2 * PAGE as u64,
            limit: 3 * PAGE as u64
        }
    );
    let message = err.cause.to_string();
    for n in ["8192 bytes", "8192 of 12288"] {
        assert!(message.contains(n), "{message}");
    }
    assert_no_cause_repeated(&err.cause);
    assert_eq!(
        faults.calls(Op::Create),
        1,
        "no backend call for a refused commit"
    );
    assert_eq!(err.token.len(), 2 * PAGE, "the reservation comes back");
    err.into_token().release().complete().unwrap();
    assert_eq!(device.ledger().owned_bytes, 2 * PAGE as u64);
    let _b = binding.reserve(PAGE).unwrap().commit().unwrap();
    assert_eq!(binding.used(), 3 * PAGE as u64);
}

#[test]
fn bad_input_is_an_error_value_and_changes_nothing() {
    make_guard!(guard);
    let config = HostConfig {
        physical_capacity: 16 * PAGE as u64,
        address_space: 1 << 30,
        ..HostConfig::default()
    };
    let backend = Faulty::new(HostBackend::new(config).unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();

    let zero = binding.reserve(0).unwrap_err();
    assert!(matches!(
        zero,
        ReserveError::ZeroLength { granularity: PAGE }
    ));
    let overflow = binding.reserve(usize::MAX).unwrap_err();
    assert!(matches!(
        overflow,
        ReserveError::Overflow {
            requested: usize::MAX,
            ..
        }
    ));
    let too_large = binding.reserve((1 << 30) + 1).unwrap_err();
    assert!(matches!(too_large, ReserveError::TooLarge { limit, .. } if limit == 1 << 30));
    assert!(
        too_large.to_string().contains("1073741825 bytes"),
        "{too_large}"
    );
    assert_eq!(
        faults.calls(Op::Reserve),
        0,
        "refused before any backend call"
    );

    let big = binding.reserve(17 * PAGE).unwrap();
    let err = big.commit().unwrap_err();
    assert!(
        matches!(err.cause, CommitFailure::Capacity { capacity, .. } if capacity == 16 * PAGE as u64)
    );
    // Fits the capacity in total, but not what is left: the backend says so, nothing is charged.
    let _held = binding.reserve(10 * PAGE).unwrap().commit().unwrap();
    let err = binding.reserve(10 * PAGE).unwrap().commit().unwrap_err();
    let chain = crate::common::transition_messages(&err);
    assert!(
        chain[1..]
            .iter()
            .any(|m| m.contains("out of physical memory")),
        "{chain:?}"
    );
    assert_no_cause_repeated(&err.cause);
    assert_eq!(device.ledger().owned_bytes, 10 * PAGE as u64);
    assert_eq!(binding.used(), 10 * PAGE as u64);
}

#[test]
fn generations_identify_allocations_even_when_va_is_reused() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let first = binding.reserve(1).unwrap();
    let (addr, generation) = (first.addr(), first.generation());
    let receipt = first.release().complete().unwrap();
    assert_eq!(receipt.generation, generation);
    let second = binding.reserve(1).unwrap();
    assert_eq!(
        second.addr(),
        addr,
        "the simulator reuses the lowest free range"
    );
    assert_ne!(second.generation(), generation);
    let _ = faults;
}

#[test]
fn drop_defers_until_the_fence_completes_and_never_blocks() {
    make_guard!(guard);
    let sim = SimBackend::new(SimConfig {
        fences_complete_at_once: false,
        ..SimConfig::strict()
    })
    .unwrap();
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(1).unwrap().commit().unwrap();
    let releasing = binding.reserve(1).unwrap().commit().unwrap().release();
    assert!(!releasing.is_ready());
    let Err(TransitionError {
        token: Returned::Unchanged(releasing),
        cause: ReleaseFailure::Pending,
    }) = releasing.complete()
    else {
        panic!("the fence is not complete");
    };
    let unmaps_before = sim.calls().iter().filter(|c| c.op == Op::Unmap).count();
    drop(committed);
    drop(releasing);
    assert_eq!(
        sim.calls().iter().filter(|c| c.op == Op::Unmap).count(),
        unmaps_before,
        "nothing is unmapped before the fence"
    );
    assert_eq!(device.poll().deferred, 2);
    assert_eq!(
        device.ledger().mapped_bytes,
        2 * device.granularity() as u64
    );
    sim.complete_fences();
    let p = device.poll();
    assert_eq!((p.released, p.deferred), (2, 0));
    assert!(device.ledger().is_zero());
    assert_eq!(sim.reservations(), 0);
}

#[test]
fn context_lost_means_no_backend_call_and_discharge_with_proof() {
    make_guard!(guard);
    let sim = SimBackend::strict();
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(1).unwrap().commit().unwrap();
    let doomed = binding.reserve(1).unwrap().commit().unwrap();
    assert!(device.confirm_context_lost().is_none());
    sim.lose_context(); // any later VMM call would panic in the simulator
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause,
    }) = committed.release().complete()
    else {
        panic!("the context is lost");
    };
    // No call was made: the backend's refusal without a call, not a driver's error.
    assert!(
        matches!(&cause, ReleaseFailure::Backend(b) if b.cause == memtoken::backend::Cause::ContextLost),
        "{cause:?}"
    );
    drop(doomed); // to the device quarantine, without a call
    // New work is refused with an error, not attempted (the simulator would panic on a call).
    assert!(binding.reserve(1).is_err());
    assert!(device.bind(Budget::unlimited()).is_err());
    let proof = device
        .confirm_context_lost()
        .expect("the simulator confirms it");
    quarantined.discharge(&proof);
    assert_eq!(device.discharge_all(&proof), 1);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    assert_eq!(binding.used(), 0);
    drop(binding); // the simulator would panic on an unpin after the loss
}

#[test]
fn a_forgotten_token_shows_in_the_close_report() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    std::mem::forget(binding.reserve(PAGE).unwrap().commit().unwrap());
    drop(binding);
    let report = device.close();
    assert!(!report.is_clean());
    assert_eq!(report.ledger.owned_bytes, PAGE as u64);
    let _ = faults;
}

#[test]
#[cfg_attr(miri, ignore = "reads the memfd's allocated size: Miri has no memfd")]
fn host_memory_is_real_and_released_to_the_os() {
    make_guard!(guard);
    let device = Device::new(guard, host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(PAGE).unwrap().commit().unwrap();
    let mut b = binding.reserve(PAGE).unwrap().commit().unwrap();
    a.as_mut_slice().fill(1);
    b.as_mut_slice().fill(2);
    assert!(
        a.as_slice().iter().all(|&x| x == 1),
        "two allocations never alias"
    );
    let (addr, generation) = (a.addr(), a.generation());
    a.release().complete().unwrap();
    // Fresh physical memory comes back zeroed: the old pages were punched out of the memfd.
    let c = binding.reserve(PAGE).unwrap().commit().unwrap();
    assert!(c.as_slice().iter().all(|&x| x == 0));
    assert_ne!(c.generation(), generation);
    let _ = addr;
}

#[test]
fn two_megabyte_granularity_aligns_reservations() {
    make_guard!(guard);
    let config = HostConfig {
        granularity: 2 << 20,
        ..HostConfig::default()
    };
    let device = Device::new(guard, HostBackend::new(config).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(1).unwrap().commit().unwrap();
    assert_eq!(a.len(), 2 << 20);
    assert_eq!(a.addr() % (2 << 20), 0);
    a.as_mut_slice()[(2 << 20) - 1] = 9;
    assert_eq!(a.as_slice()[(2 << 20) - 1], 9);
}

#[test]
fn an_invalid_host_granularity_is_refused() {
    let err = HostBackend::new(HostConfig {
        granularity: 3000,
        ..HostConfig::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("power of two"), "{err}");
}

#[test]
fn bindings_pin_and_unpin_the_context() {
    setup!(SimBackend::strict(), device, faults);
    let a = device.bind(Budget::unlimited()).unwrap();
    let b = device.bind(Budget::unlimited()).unwrap();
    assert_eq!(faults.outstanding().pins, 2);
    drop(a);
    drop(b);
    assert_eq!(faults.outstanding().pins, 0);
    faults.fail_nth(Op::Pin, 1);
    assert!(device.bind(Budget::unlimited()).is_err());
    assert_eq!(faults.outstanding().pins, 0);
    // A failed unpin is counted by the device, not lost silently.
    let c = device.bind(Budget::unlimited()).unwrap();
    faults.fail_nth(Op::Unpin, 1);
    drop(c);
    assert_eq!(device.failed_unpins(), 1);
    assert_eq!(
        faults.outstanding().pins,
        1,
        "the pin the driver still holds"
    );
    drop(device);
    assert_eq!(
        faults.outstanding().pins,
        0,
        "a pin whose unpin failed is given back as the device drops"
    );
}

// ---------------------------------------------------------------------------------------------
// Limits met exactly, what a device and its tokens show, what a failed commit or release says
// ---------------------------------------------------------------------------------------------

/// Kills `src/allocation.rs: replace > with >= in Allocation<'b, 'id, B, Reserved>::admit`:
/// a commit of exactly the physical capacity fits.
#[test]
fn a_commit_of_exactly_the_physical_capacity_fits() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(4 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let all = binding.reserve(4 * GRANULE).unwrap().commit().unwrap();
    assert_eq!(device.ledger().owned_bytes, 4 * GRANULE as u64);
    all.release().complete().unwrap();
}

/// Kills `src/allocation.rs: replace > with >= in Binding<'b, 'id, B>::reserve`: a binding may
/// reserve exactly its backend's whole address space.
#[test]
fn a_reservation_may_take_the_whole_address_space() {
    make_guard!(guard);
    let backend = SimBackend::new(SimConfig {
        address_space: 4 * GRANULE,
        ..SimConfig::strict()
    })
    .unwrap();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let all = binding
        .reserve(4 * GRANULE)
        .expect("exactly the address space");
    assert_eq!(all.len(), 4 * GRANULE);
}

/// Kills `src/allocation.rs: replace == with != in Allocation<'b, 'id, B, S>::is_empty`: a
/// token is never empty.
#[test]
fn a_token_is_never_empty() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(1).unwrap();
    assert!(!a.is_empty());
    let a = a.commit().unwrap();
    assert!(!a.is_empty());
}

/// Kills `src/error.rs: replace <impl Failure for CommitFailure>::summary -> &'static str with ""`:
/// a failed commit's message starts by saying so.
#[test]
fn a_failed_commit_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    faults.fail_nth(Op::Create, 1);
    let e = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .expect_err("the create was failed on purpose");
    says_first(&e, "commit failed: ");
}

/// Kills `src/error.rs: replace <impl Failure for ReleaseFailure>::summary -> &'static str with
/// "xyzzy"` and `src/device/quarantined.rs: replace <impl fmt::Debug for Quarantined<'_, '_, B>>::fmt ->
/// fmt::Result with Ok(Default::default())`: a release that cannot complete yet, and one that
/// failed, each say so first; the quarantined token debugs as its residual.
#[test]
fn a_release_not_done_says_why_first() {
    make_guard!(guard);
    let sim = manual_sim();
    let backend = Faulty::new(sim.clone());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let releasing = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .unwrap()
        .release();
    let e = releasing.complete().expect_err("its fence is pending");
    says_first(&e, "the release cannot complete yet: ");
    let Returned::Unchanged(releasing) = e.token else {
        panic!("a pending release hands its token back unchanged");
    };
    sim.complete_fences();
    faults.fail_nth(Op::Release, 1);
    let e = releasing
        .complete()
        .expect_err("the release was failed on purpose");
    says_first(&e, "the release failed: ");
    let Returned::Quarantined(quarantined) = e.token else {
        panic!("a failed release hands its token back quarantined");
    };
    let debug = format!("{quarantined:?}");
    assert!(debug.starts_with("Quarantined { residual: "), "{debug}");
    drop(quarantined); // it goes to the device's quarantine
    let p = device.retry_quarantine();
    assert_eq!((p.released, p.quarantined), (1, 0), "{p:?}");
}

/// Kills `src/device.rs: replace <impl std::fmt::Debug for Device<'_, B>>::fmt ->
/// std::fmt::Result with Ok(Default::default())` and `src/allocation.rs: replace <impl
/// fmt::Debug for Allocation<'_, '_, B, S>>::fmt -> fmt::Result with Ok(Default::default())`
/// and the same for its `fmt::Display` and for the `fmt::Debug` of `Binding`: a device debugs
/// as its granularity and ledger, a binding as what it uses, a token debugs and shows its
/// state and range.
#[test]
fn a_device_and_its_tokens_debug_as_what_they_hold() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap();
    let debug = format!("{device:?}");
    assert!(
        debug.starts_with(&format!(
            "Device {{ granularity: {GRANULE}, ledger: LedgerSnapshot {{ reserved_bytes: {GRANULE},"
        )),
        "{debug}"
    );
    let debug = format!("{binding:?}");
    assert!(debug.starts_with("Binding { used: 0, limit: "), "{debug}");
    let debug = format!("{a:?}");
    assert!(debug.starts_with("Allocation { state: "), "{debug}");
    let shown = a.to_string();
    assert!(shown.starts_with("the Reserved allocation #"), "{shown}");
    assert!(
        shown.ends_with(&format!(" of {GRANULE} bytes at {:#x}", a.addr())),
        "{shown}"
    );
    assert!(
        debug.contains(&format!("addr: {:#x}, len: {GRANULE},", a.addr())),
        "{debug}"
    );
}

/// Two allocations have different generations, as numbers too (what an export sends).
#[test]
fn two_allocations_have_different_generation_numbers() {
    setup!(host(), device, _faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(PAGE).unwrap();
    let b = binding.reserve(PAGE).unwrap();
    assert_ne!(a.generation(), b.generation());
    assert_ne!(a.generation().get(), b.generation().get());
    assert!(a.generation().get() > 0 && b.generation().get() > 0);
    drop((a, b));
}
