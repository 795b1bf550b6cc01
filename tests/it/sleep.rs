//! Sleep and wake: committed memory (an allocation or a region) suspended — unmapped, its
//! physical memory given back, its bytes optionally saved — with every address kept, and
//! resumed all or nothing, on the host, the strict simulator and the CUDA driver model.

use crate::common::Grown;
use crate::common::{self, GRANULE, assert_no_cause_repeated, host, pattern, says_first, setup};
use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::{
    Backend, Op,
    doubles::{Faulty, SimBackend},
};
use memtoken::{
    Budget, Device, errors::GrowError, errors::ResumeFailure, errors::SuspendFailure, make_guard,
};

const PAGE: usize = 4096;

#[test]
fn an_allocation_sleeps_with_nothing_owned_and_wakes_at_its_address_with_its_bytes() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(3 * PAGE).unwrap().commit().unwrap();
    let bytes = pattern(3 * PAGE, 7);
    a.as_mut_slice().copy_from_slice(&bytes);
    let (addr, generation) = (a.addr(), a.generation());

    let asleep = a.suspend_saving().unwrap();
    assert!(asleep.is_saved());
    assert_eq!((asleep.addr(), asleep.suspended_len()), (addr, 3 * PAGE));
    let l = device.ledger();
    assert_eq!(
        (l.owned_bytes, l.mapped_bytes),
        (0, 0),
        "nothing owned, nothing mapped"
    );
    assert_eq!(l.reserved_bytes, 3 * PAGE as u64, "the VA stays reserved");
    assert_eq!(binding.used(), 0);
    assert_eq!(faults.outstanding().physical, 0);

    let a = asleep.resume().unwrap();
    assert_eq!((a.addr(), a.generation()), (addr, generation));
    assert_eq!(a.as_slice(), &bytes[..], "every byte restored");
    assert_eq!(binding.used(), 3 * PAGE as u64);

    // Without saving: the addresses come back, the bytes need not.
    let a = a.suspend().unwrap();
    assert!(!a.is_saved());
    let a = a.resume().unwrap();
    assert_eq!(a.addr(), addr);
    drop(a);
    drop(binding);
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_region_sleeps_into_the_cache_and_wakes_from_it_without_a_create() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * PAGE).unwrap().into_region().grown(5);
    let bytes = pattern(5 * PAGE, 3);
    region.as_mut_slice().copy_from_slice(&bytes);
    let addr = region.addr();
    let creates = faults.calls(Op::Create);

    let asleep = region.suspend_saving().unwrap();
    assert_eq!(asleep.suspended_len(), 5 * PAGE);
    let l = device.ledger();
    assert_eq!(l.mapped_bytes, 0);
    assert_eq!(l.owned_bytes, l.cached_bytes, "owned only by the cache");
    assert_eq!(binding.used(), 0);

    let region = asleep.resume().unwrap();
    assert_eq!((region.addr(), region.committed_len()), (addr, 5 * PAGE));
    assert_eq!(region.as_slice(), &bytes[..]);
    assert_eq!(
        faults.calls(Op::Create),
        creates,
        "every granule came from the cache"
    );

    // With the cache off, a sleeping region owns nothing at all.
    device.set_cache_cap(0);
    let asleep = region.suspend().unwrap();
    assert_eq!(device.ledger().owned_bytes, 0);
    asleep.release().complete().unwrap();
    drop(binding);
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_resume_that_fails_halfway_leaves_the_token_asleep_with_nothing_charged() {
    setup!(host(), device, faults);
    device.set_cache_cap(0);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(6 * PAGE).unwrap().into_region().grown(4);
    let bytes = pattern(4 * PAGE, 9);
    region.as_mut_slice().copy_from_slice(&bytes);
    let mut asleep = region.suspend_saving().unwrap();
    let addr = asleep.addr();
    // The third granule's map (or create) fails: two were mapped, and are given back; or
    // the restore fails once all four are mapped.
    for (op, nth) in [(Op::Map, 3), (Op::Create, 3), (Op::Copy, 1)] {
        faults.clear();
        faults.fail_nth(op, nth);
        let e = asleep.resume().expect_err("failed on purpose");
        assert_no_cause_repeated(&e.cause);
        match (op, &e.cause) {
            (Op::Copy, ResumeFailure::Restore(b)) => assert_eq!(b.op, Op::Copy),
            (_, ResumeFailure::Grow(g)) => assert!(matches!(**g, GrowError::Undone { .. })),
            (_, cause) => panic!("{op:?}: {cause}"),
        }
        let back = e.into_token();
        asleep = back;
        assert_eq!((asleep.addr(), asleep.suspended_len()), (addr, 4 * PAGE));
        assert!(asleep.is_saved(), "{op:?}: the saved bytes are intact");
        let l = device.ledger();
        assert_eq!(
            (l.owned_bytes, l.mapped_bytes),
            (0, 0),
            "{op:?}: nothing charged"
        );
        assert_eq!(binding.used(), 0, "{op:?}");
        let o = faults.outstanding();
        assert_eq!((o.physical, o.mappings), (0, 0), "{op:?}");
    }
    faults.clear();
    let region = asleep.resume().unwrap();
    assert_eq!(region.as_slice(), &bytes[..], "the saved bytes, restored");
    drop(region);
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn an_allocation_whose_restore_fails_stays_asleep_and_wakes_on_retry() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * PAGE).unwrap().commit().unwrap();
    a.as_mut_slice().fill(4);
    let asleep = a.suspend_saving().unwrap();
    faults.fail_nth(Op::Copy, 1);
    let e = asleep
        .resume()
        .expect_err("the restore was failed on purpose");
    assert!(matches!(e.cause, ResumeFailure::Restore(_)));
    let asleep = e.into_token();
    assert_eq!((binding.used(), device.ledger().owned_bytes), (0, 0));
    let a = asleep.resume().unwrap();
    assert!(a.as_slice().iter().all(|&b| b == 4));
    drop(a);
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_suspend_whose_unmap_fails_withholds_the_mapping_and_keeps_the_saved_bytes() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * PAGE).unwrap().commit().unwrap();
    a.as_mut_slice().fill(6);
    faults.fail_nth(Op::Unmap, 1);
    let mut asleep = a.suspend_saving().unwrap();
    assert!(asleep.is_saved());
    assert_eq!(asleep.withheld_bytes(), 2 * PAGE, "withheld, still charged");
    assert_eq!(binding.used(), 2 * PAGE as u64);
    assert_eq!(device.ledger().mapped_bytes, 2 * PAGE as u64);
    asleep.reclaim().unwrap();
    assert_eq!((asleep.withheld_bytes(), binding.used()), (0, 0));
    assert_eq!(device.ledger().owned_bytes, 0);
    let a = asleep.resume().unwrap();
    assert!(
        a.as_slice().iter().all(|&b| b == 6),
        "the saved bytes came back"
    );
    drop(a);
    drop(binding);
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_resume_whose_restore_and_undo_fail_stays_asleep_with_its_bytes_and_wakes_later() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * PAGE).unwrap().commit().unwrap();
    a.as_mut_slice().fill(0xab);
    let asleep = a.suspend_saving().unwrap();
    faults.fail_nth(Op::Copy, 1);
    faults.fail_nth(Op::Unmap, 1);
    let e = asleep
        .resume()
        .expect_err("the restore and its undo were failed on purpose");
    assert!(matches!(e.cause, ResumeFailure::RestoreUndo { .. }));
    assert_no_cause_repeated(&e.cause);
    let asleep = e.into_token();
    assert!(asleep.is_saved(), "the saved bytes are kept");
    assert_eq!(
        asleep.withheld_bytes(),
        2 * PAGE,
        "the new mapping is withheld"
    );
    assert_eq!(binding.used(), 2 * PAGE as u64, "and charged");
    // The next resume reclaims it first, then maps and restores.
    let a = asleep.resume().unwrap();
    assert!(a.as_slice().iter().all(|&b| b == 0xab));
    assert_eq!(binding.used(), 2 * PAGE as u64);
    drop(a);
    drop(binding);
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn the_simulator_keeps_and_restores_the_saved_bytes() {
    let sim = SimBackend::strict();
    setup!(sim.clone(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let region = binding.reserve(4 * g).unwrap().into_region().grown(3);
    let bytes = pattern(3 * g, 5);
    sim.copy_from_host(region.addr(), &bytes).unwrap();
    let asleep = region.suspend_saving().unwrap();
    assert!(asleep.is_saved());
    let region = asleep.resume().unwrap();
    let mut seen = vec![0; 3 * g];
    sim.copy_to_host(&mut seen, region.addr()).unwrap();
    assert_eq!(seen, bytes);
    drop(region);
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn on_cuda_memory_sleeps_only_once_its_work_finished_and_wakes_with_its_bytes() {
    let model = common::held_fences();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * g).unwrap().commit().unwrap();
    let bytes = pattern(2 * g, 1);
    a.copy_from_host(0, &bytes).unwrap();
    let region = binding.reserve(4 * g).unwrap().into_region().grown(2);

    model.submit_work(); // a kernel may use both
    let e = a.suspend_saving().expect_err("work is running");
    assert!(matches!(e.cause, SuspendFailure::Pending));
    let a = e.into_token();
    let e = region.suspend().expect_err("work is running");
    assert!(matches!(e.cause, SuspendFailure::Pending));
    let region = e.into_token();
    model.complete_work();

    let (addr, raddr) = (a.addr(), region.addr());
    let asleep = a.suspend_saving().unwrap();
    let region_asleep = region.suspend().unwrap();
    assert_eq!(device.ledger().mapped_bytes, 0);
    let a = asleep.resume().unwrap();
    let region = region_asleep.resume().unwrap();
    assert_eq!((a.addr(), region.addr()), (addr, raddr));
    let mut seen = vec![0; 2 * g];
    a.copy_to_host(0, &mut seen).unwrap();
    assert_eq!(seen, bytes, "restored through the driver");
    drop((a, region));
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero());
}

#[test]
fn releasing_a_sleeping_token_frees_its_va_once() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let asleep = binding
        .reserve(g)
        .unwrap()
        .commit()
        .unwrap()
        .suspend()
        .unwrap();
    let frees = faults.calls(Op::Free);
    asleep.release().complete().unwrap();
    assert_eq!(faults.calls(Op::Free), frees + 1);
    let region = binding.reserve(2 * g).unwrap().into_region().grown(1);
    drop(region.suspend().unwrap()); // dropped asleep: the device frees it
    assert_eq!(faults.calls(Op::Free), frees + 2);
    drop(binding);
    assert_eq!(
        device.ledger().cached_bytes,
        g as u64,
        "its granule waits in the cache"
    );
    device.trim_cache();
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_region_whose_granules_left_the_cache_while_asleep_gets_its_bytes_back() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * PAGE).unwrap().into_region().grown(2);
    region.as_mut_slice().fill(7);
    let asleep = region.suspend_saving().unwrap();
    assert_eq!(device.trim_cache(), 2 * PAGE as u64);
    let region = asleep.resume().unwrap();
    assert!(
        region.as_slice().iter().all(|&b| b == 7),
        "restored, not the cache's"
    );
    drop(region);
    drop(binding);
    device.trim_cache();
    assert!(faults.outstanding().is_zero());
}

// ---------------------------------------------------------------------------------------------
// What a failed suspend or resume says, and what a suspended region withholds
// ---------------------------------------------------------------------------------------------

/// Kills `src/error.rs: replace <impl Failure for SuspendFailure>::summary -> &'static str
/// with ""`: a failed suspend says so first.
#[test]
fn a_failed_suspend_says_so_first() {
    let sim = common::sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    sim.lose_context();
    let e = a.suspend().expect_err("the context is lost");
    says_first(&e, "suspending the memory failed: ");
}

/// Kills `src/error.rs: replace <impl Failure for ResumeFailure>::summary -> &'static str with ""`:
/// a failed resume's message starts by saying so.
#[test]
fn a_failed_resume_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let asleep = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .unwrap()
        .suspend()
        .unwrap();
    faults.fail_nth(Op::Create, 1);
    let e = asleep
        .resume()
        .expect_err("the create was failed on purpose");
    says_first(&e, "resuming the memory failed: ");
    drop(e.into_token());
}

/// Kills `src/sleep.rs: replace Allocation<'b, 'id, B, Suspended<Elastic>>::withheld_granules
/// -> usize with 0`: a region suspended while its unmaps fail withholds those granules, and
/// says how many.
#[test]
fn a_region_suspended_while_unmaps_fail_says_what_it_withholds() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(4 * GRANULE).unwrap().into_region();
    let region = region.grown(3);
    faults.fail_from(Op::Unmap, 2);
    let mut asleep = region.suspend().unwrap();
    faults.clear();
    assert_eq!(asleep.withheld_granules(), 2, "the second and the first");
    assert_eq!(asleep.withheld_bytes(), 2 * GRANULE);
    asleep.reclaim().unwrap();
    assert_eq!(
        (asleep.withheld_granules(), asleep.withheld_bytes()),
        (0, 0)
    );
    asleep.release().complete().unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.reserved_bytes, l.mapped_bytes, binding.used()),
        (0, 0, 0),
        "{l:?}"
    );
    assert_eq!(l.owned_bytes, l.cached_bytes, "what is left is the cache");
}
