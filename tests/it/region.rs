//! Elastic regions and the device's cache of physical granules: growth and shrinkage by
//! granules, all-or-nothing growth, withheld granules after a failed unmap, reuse of cached
//! granules (counted on `Faulty`'s call counters), budgets that trim the cache, and fences that
//! hold cached granules back on CUDA.

use crate::common::Grown;
use crate::common::{self, GRANULE, host, says_first, setup};
use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::{
    Cause, Op,
    doubles::{Faulty, SimBackend},
};
use memtoken::{
    Budget, Device, errors::CommitFailure, errors::GrowError, errors::ShrinkError, make_guard,
};

const PAGE: usize = 4096;

#[test]
fn grow_and_shrink_move_the_ledger_and_budget_granule_by_granule() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(8 * PAGE).unwrap().into_region();
    assert_eq!((region.len(), region.committed_len()), (8 * PAGE, 0));
    assert!(region.as_slice().is_empty());

    let mut region = region.grown(3);
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes),
        (3 * PAGE as u64, 3 * PAGE as u64)
    );
    assert_eq!(binding.used(), 3 * PAGE as u64);
    region.as_mut_slice().fill(5);
    assert_eq!(region.as_slice().len(), 3 * PAGE);

    region.shrink(1).unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes, l.cached_bytes),
        (2 * PAGE as u64, 3 * PAGE as u64, PAGE as u64),
        "the shrunk granule is cached: owned, not mapped"
    );
    assert_eq!(binding.used(), 2 * PAGE as u64);
    assert!(region.as_slice().iter().all(|&b| b == 5));

    let creates = faults.calls(Op::Create);
    let region = region.grown(2);
    assert_eq!(faults.calls(Op::Create), creates + 1, "one from the cache");
    assert_eq!(device.ledger().cached_bytes, 0);
    assert_eq!(binding.used(), 4 * PAGE as u64);

    region.release().complete().unwrap();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    assert!(device.close().is_clean());
}

/// The grow-and-shrink cycles of the cache tests below (fewer under Miri).
const CYCLES: usize = common::unless_miri(10_000, 10);

/// Grows and shrinks a region of `granules` granules `cycles` times after one warm-up cycle;
/// returns the create and release calls made by the cycles.
fn cycle_calls(cache_cap: u64, granules: usize, cycles: usize) -> (u64, u64) {
    setup!(SimBackend::strict(), device, faults);
    device.set_cache_cap(cache_cap);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(granules * g).unwrap().into_region();
    region = region.grown(granules);
    region.shrink(granules).unwrap();
    let (creates, releases) = (faults.calls(Op::Create), faults.calls(Op::Release));
    for _ in 0..cycles {
        region = region.grown(granules);
        region.shrink(granules).unwrap();
    }
    let calls = (
        faults.calls(Op::Create) - creates,
        faults.calls(Op::Release) - releases,
    );
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    calls
}

#[test]
fn cached_granules_make_grow_shrink_cycles_free_of_create_and_release() {
    let g = backend_granularity() as u64;
    assert_eq!(cycle_calls(4 * g, 4, CYCLES), (0, 0));
}

#[test]
fn with_the_cache_capped_at_zero_each_cycle_creates_and_releases_each_granule() {
    let each = 4 * CYCLES as u64; // 40_000 outside Miri
    assert_eq!(cycle_calls(0, 4, CYCLES), (each, each));
}

#[test]
fn grow_failing_at_the_kth_granule_hands_back_the_unchanged_region_with_nothing_charged() {
    for (op, k) in [(Op::Create, 3), (Op::Map, 3), (Op::Map, 1), (Op::Create, 5)] {
        setup!(host(), device, faults);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let mut region = binding.reserve(8 * PAGE).unwrap().into_region().grown(2);
        region.as_mut_slice().fill(9);
        // One granule in the cache, so the growth takes one from there and creates the rest.
        region.shrink(1).unwrap();
        let (generation, addr) = (region.generation(), region.addr());
        let ledger = device.ledger();
        let used = binding.used();
        let outstanding = faults.outstanding();

        // Granule 0 comes from the cache: creates are one behind maps.
        faults.fail_nth(op, if op == Op::Create { k - 1 } else { k });
        let e = region.grow(5).unwrap_err();
        match &e {
            GrowError::Undone {
                at,
                cause,
                quarantined: 0,
            } => {
                let CommitFailure::Backend(b) = &**cause else {
                    panic!("{cause:?}")
                };
                assert_eq!(*at, k as usize - 1, "{op:?} #{k}");
                assert!(b.is_injected());
            }
            other => panic!("{op:?} #{k}: {other:?}"),
        }
        assert_eq!((region.generation(), region.addr()), (generation, addr));
        assert_eq!(
            region.committed_len(),
            PAGE,
            "the committed length is unchanged"
        );
        assert_eq!(region.withheld_granules(), 0);
        assert!(region.as_slice().iter().all(|&b| b == 9), "bytes kept");
        assert_eq!(device.ledger(), ledger, "{op:?} #{k}: nothing charged");
        assert_eq!(binding.used(), used, "the budget is unchanged");
        assert_eq!(
            faults.outstanding(),
            outstanding,
            "every granule mapped was unmapped"
        );

        // The same region grows once the fault is gone.
        let region = region.grown(5);
        assert_eq!(region.committed_len(), 6 * PAGE);
        drop(region);
        drop(binding);
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero());
    }
}

#[test]
fn grow_refused_by_the_budget_at_the_kth_granule_is_undone() {
    setup!(SimBackend::strict(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::bytes(3 * g as u64)).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region().grown(1);
    let ledger = device.ledger();
    let e = region.grow(4).unwrap_err();
    assert!(
        matches!(
            e,
            GrowError::Undone { at: 2, ref cause, .. } if matches!(**cause, CommitFailure::Budget { .. })
        ),
        "{:?}",
        e
    );
    assert_eq!(region.committed_granules(), 1);
    assert_eq!(device.ledger(), ledger);
    assert_eq!(binding.used(), g as u64);
    let e = region.grow(8).unwrap_err();
    assert!(matches!(e, GrowError::Full { room: 8, .. }));
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_failed_unmap_while_undoing_a_growth_withholds_the_granule() {
    setup!(SimBackend::strict(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region().grown(1);
    faults.fail_nth(Op::Map, 3);
    faults.fail_nth(Op::Unmap, 1);
    let e = region.grow(4).unwrap_err();
    assert!(
        matches!(
            e,
            GrowError::Withheld {
                at: 2,
                granules: 1,
                ..
            }
        ),
        "{:?}",
        e
    );
    assert_eq!(
        (region.committed_granules(), region.withheld_granules()),
        (1, 1)
    );
    // The granule at index 2 is withheld: the region cannot grow over it.
    assert_eq!(region.room_granules(), 2);
    let e = region.grow(2).unwrap_err();
    assert!(matches!(e, GrowError::Full { room: 2, .. }));
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes),
        (2 * g as u64, 2 * g as u64)
    );
    assert_eq!(
        binding.used(),
        2 * g as u64,
        "the withheld granule stays charged"
    );
    region.reclaim().unwrap();
    assert_eq!(region.withheld_granules(), 0);
    let region = region.grown(7);
    assert_eq!(region.committed_granules(), 8);
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_failed_shrink_withholds_the_stuck_granules_until_a_retry_frees_them() {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * PAGE).unwrap().into_region().grown(6);
    // Unmaps go from the tail: the 2nd and 3rd of this shrink are granules 4 and 3.
    faults.fail_from(Op::Unmap, 2);
    let e = region.shrink(4).unwrap_err();
    faults.clear();
    assert!(
        matches!(e, ShrinkError::Withheld { granules: 3, .. }),
        "{e:?}"
    );
    assert_eq!(region.committed_len(), 2 * PAGE, "shrunk as asked");
    assert_eq!(region.withheld_granules(), 3);
    assert_eq!(
        region.room_granules(),
        2,
        "no growth over the withheld granules"
    );
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes, l.cached_bytes),
        (5 * PAGE as u64, 6 * PAGE as u64, PAGE as u64),
        "stuck granules stay mapped and owned; the unmapped one is cached"
    );
    assert_eq!(binding.used(), 5 * PAGE as u64);
    let e = region.grow(1).unwrap_err();
    assert!(matches!(e, GrowError::Full { .. }));

    // A retry that fails again keeps them; one that succeeds frees them.
    faults.fail_nth(Op::Unmap, 1);
    assert!(matches!(
        region.reclaim(),
        Err(ShrinkError::Withheld { granules: 1, .. })
    ));
    region.reclaim().unwrap();
    assert_eq!(region.withheld_granules(), 0);
    assert_eq!(region.room_granules(), 8);
    let l = device.ledger();
    assert_eq!(
        (l.mapped_bytes, l.owned_bytes, l.cached_bytes),
        (2 * PAGE as u64, 6 * PAGE as u64, 4 * PAGE as u64)
    );
    assert_eq!(binding.used(), 2 * PAGE as u64);
    let region = region.grown(6);
    assert_eq!(device.ledger().cached_bytes, 0);
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_region_dropped_with_withheld_granules_hands_them_to_the_device() {
    setup!(SimBackend::strict(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(3);
    faults.fail_nth(Op::Unmap, 1);
    assert!(region.shrink(2).is_err());
    assert_eq!(region.withheld_granules(), 1);
    drop(region);
    // Teardown unmaps the withheld granule on its own and releases every granule.
    assert_eq!(binding.used(), 0);
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

#[test]
fn a_device_budget_trims_the_cache_when_it_needs_the_bytes() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let g = backend_granularity();
    let device = Device::with_cache(
        guard,
        backend,
        Budget::bytes(4 * g as u64),
        Budget::unlimited(),
    );
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(4);
    region.shrink(4).unwrap();
    assert_eq!(device.ledger().cached_bytes, 4 * g as u64);
    // The cached bytes count in the device's budget; a commit that needs them trims them.
    let releases = faults.calls(Op::Release);
    let committed = binding.reserve(3 * g).unwrap().commit().unwrap();
    assert_eq!(
        faults.calls(Op::Release),
        releases + 3,
        "just enough trimmed"
    );
    assert_eq!(device.ledger().cached_bytes, g as u64);
    assert_eq!(device.trim_cache(), g as u64);
    assert_eq!(device.ledger().owned_bytes, 3 * g as u64);
    drop((committed, region));
    drop(binding);
    assert!(device.close().is_clean());
}

fn backend_granularity() -> usize {
    memtoken::backend::Backend::granularity(&SimBackend::strict())
}

#[test]
fn the_cache_cap_bounds_what_is_kept_and_a_lower_cap_trims() {
    setup!(SimBackend::strict(), device, faults);
    let g = device.granularity() as u64;
    device.set_cache_cap(2 * g);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding
        .reserve(4 * g as usize)
        .unwrap()
        .into_region()
        .grown(4);
    let releases = faults.calls(Op::Release);
    region.shrink(4).unwrap();
    assert_eq!(device.cached_bytes(), 2 * g);
    assert_eq!(
        faults.calls(Op::Release),
        releases + 2,
        "past the cap: released"
    );
    device.set_cache_cap(g);
    assert_eq!(device.cached_bytes(), g);
    assert_eq!(device.cache_cap(), g);
    // A cached granule whose release fails is quarantined, still owned.
    faults.fail_nth(Op::Release, 1);
    assert_eq!(device.trim_cache(), g);
    let l = device.ledger();
    assert_eq!((l.cached_bytes, l.owned_bytes, l.quarantined), (0, g, 1));
    assert_eq!(device.retry_quarantine().released, 1);
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

/// A region whose release fails at a granule's release is quarantined with what is left, each
/// granule at its own offset in the range: the quarantine's `Debug` (what `{:?}` of it shows,
/// the derived `Debug` of its residual's parts) places a region of two granules at offsets 0
/// and one granule, and the retry releases them.
/// Fails if a released region hands its residual the granules at other offsets (`retire`'s
/// `i * g` → `i + g` or `i / g`).
#[test]
fn a_region_quarantined_on_release_shows_each_granule_at_its_offset() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(4 * g).unwrap().into_region().grown(2);
    faults.fail_nth(Op::Release, 1); // the top granule's: both stay
    let failed = region.release().complete().unwrap_err();
    let memtoken::errors::Returned::Quarantined(quarantined) = failed.into_token() else {
        panic!("a failed release is quarantined");
    };
    let shown = format!("{quarantined:?}");
    let offsets: Vec<&str> = shown
        .split("Granule { offset: ")
        .skip(1)
        .map(|rest| rest.split(',').next().unwrap())
        .collect();
    assert_eq!(offsets, ["0".to_owned(), g.to_string()], "{shown}");
    quarantined.retry().expect("the second try releases them");
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn on_cuda_a_region_shrinks_only_once_work_that_may_use_it_has_finished() {
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(2);
    model.submit_work(); // a kernel may still use the region's memory
    assert!(matches!(region.shrink(2), Err(ShrinkError::Pending)));
    assert_eq!(
        region.committed_granules(),
        2,
        "nothing was unmapped under the kernel"
    );
    model.complete_work();
    region.shrink(2).unwrap();
    assert_eq!(device.cached_bytes(), 2 * g as u64);
    let creates = faults.calls(Op::Create);
    let region = region.grown(2);
    assert_eq!(
        faults.calls(Op::Create),
        creates,
        "granules cached after the work finished are reused"
    );
    drop(region);
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

/// Withheld granules are unmapped by `reclaim` only once no work may use them: the strict model
/// faults the context (sticky 700) when memory goes under a running kernel.
#[test]
fn on_cuda_reclaim_waits_for_work_that_may_use_the_withheld_granules() {
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(3);
    faults.fail_nth(Op::Unmap, 1);
    assert!(matches!(
        region.shrink(1),
        Err(ShrinkError::Withheld { .. })
    ));
    assert_eq!(region.withheld_granules(), 1);
    model.submit_work(); // a kernel that may reach the withheld granule
    assert!(matches!(region.reclaim(), Err(ShrinkError::Pending)));
    assert_eq!(
        region.withheld_granules(),
        1,
        "nothing was unmapped under it"
    );
    model.complete_work();
    region.reclaim().unwrap();
    assert_eq!(region.withheld_granules(), 0);
    drop(region);
    drop(binding);
    assert!(model.lost_with().is_none(), "no kernel faulted");
    assert!(device.close().is_clean());
}

// ---------------------------------------------------------------------------------------------
// Growth and shrinkage refused or undone: what each says, counts and gives back
// ---------------------------------------------------------------------------------------------

/// Kills `src/error.rs: replace <impl Failure for GrowError>::summary -> &'static str with
/// "xyzzy"`: a failed growth's message starts by saying so, and its summary says what failed.
#[test]
fn a_failed_growth_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Create, 1);
    let e = region
        .grow(1)
        .expect_err("the create was failed on purpose");
    says_first(&e, "growing stopped at granule 0 of this call");
    assert_eq!(
        memtoken::errors::Failure::summary(&e),
        "the region could not grow"
    );
    region.release().complete().unwrap();
}

/// Kills `src/error.rs: replace quarantine_note -> String with String::new()`: an undone
/// growth whose granule could not be released either says that it is in the quarantine.
#[test]
fn an_undone_growth_tells_of_what_it_left_in_the_quarantine() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 1);
    faults.fail_nth(Op::Release, 1);
    let e = region.grow(1).expect_err("the map was failed on purpose");
    assert!(
        matches!(e, GrowError::Undone { quarantined: 1, .. }),
        "{:?}",
        e
    );
    let message = e.to_string();
    assert!(
        message
            .contains("1 granules whose release failed while undoing are in the device quarantine"),
        "{message}"
    );
    assert_eq!(device.retry_quarantine().released, 1);
    region.release().complete().unwrap();
}

/// Kills `src/region.rs: replace += with -= in Allocation<'b, 'id, B, Elastic>::undo_grow`: an
/// undone growth counts the granule it had created and mapped and then failed to release, as
/// well as the one whose map failed.
#[test]
fn an_undone_growth_counts_every_granule_it_left_in_the_quarantine() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 2);
    faults.fail_from(Op::Release, 1);
    let e = region
        .grow(2)
        .expect_err("the second map was failed on purpose");
    faults.clear();
    assert!(
        matches!(
            e,
            GrowError::Undone {
                at: 1,
                quarantined: 2,
                ..
            }
        ),
        "{:?}",
        e
    );
    assert_eq!(device.retry_quarantine().released, 2);
    region.release().complete().unwrap();
    assert_eq!(binding.used(), 0);
}

/// Kills `src/region.rs: replace < with == in Allocation<'b, 'id, B, Elastic>::undo_grow`: an
/// undone growth gives every granule it took from the cache back to the cache.
#[test]
fn an_undone_growth_from_the_cache_gives_it_all_back() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_cache_cap(3 * GRANULE as u64);
    let mut warm = binding.reserve(3 * GRANULE).unwrap().into_region().grown(3);
    warm.shrink(3).unwrap();
    warm.release().complete().unwrap();
    assert_eq!(
        device.cached_bytes(),
        3 * GRANULE as u64,
        "setup: three cached"
    );
    let mut region = binding.reserve(3 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 3);
    let e = region
        .grow(3)
        .expect_err("the third map was failed on purpose");
    assert!(matches!(e, GrowError::Undone { at: 2, .. }), "{e:?}");
    assert_eq!(
        device.cached_bytes(),
        3 * GRANULE as u64,
        "all back in the cache"
    );
    assert_eq!(faults.calls(Op::Release), 0, "none released");
    region.release().complete().unwrap();
}

/// An undone growth that took one granule from the cache and created one gives the cached one
/// back to the cache and releases the created one: unmapping from the top, the created
/// granule's release comes between the two unmaps, and the cache keeps the granule it had.
/// Kills `src/region.rs: replace match guard i - start < from_cache with true` and `replace <
/// with <=` in `Allocation<'b, 'id, B, Elastic>::undo_grow`, which cache the created granule in
/// the room made for the cached one and release the cached one instead.
#[test]
fn an_undone_growth_releases_what_it_created_and_caches_what_it_took() {
    let sim = common::sim(16 * GRANULE as u64);
    setup!(sim.clone(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_cache_cap(GRANULE as u64);
    let mut warm = binding.reserve(GRANULE).unwrap().into_region().grown(1);
    warm.shrink(1).unwrap();
    warm.release().complete().unwrap();
    assert_eq!(device.cached_bytes(), GRANULE as u64, "setup: one cached");
    let mut region = binding.reserve(3 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Create, 2); // the growth's second new granule, its third
    let start = sim.calls().len();
    let e = region
        .grow(3)
        .expect_err("the second create was failed on purpose");
    assert!(
        matches!(
            e,
            GrowError::Undone {
                at: 2,
                quarantined: 0,
                ..
            }
        ),
        "{e:?}"
    );
    common::assert_created_released_then_cached_unmapped(&sim, start);
    assert_eq!(device.cached_bytes(), GRANULE as u64, "the cache keeps one");
    region.release().complete().unwrap();
    drop(binding);
    assert!(device.close().is_clean());
}

/// Kills `src/region.rs: replace * with / in Allocation<'b, 'id, B, Elastic>::grow`: a growth
/// refused for a lost context names the granules it would have mapped.
#[test]
fn a_growth_after_the_context_is_lost_names_the_granules_it_would_map() {
    let sim = common::sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(4 * GRANULE).unwrap().into_region();
    let mut region = region.grown(1);
    sim.lose_context();
    let e = region.grow(2).expect_err("the context is lost");
    let GrowError::Undone { cause, .. } = &e else {
        panic!("{e:?}");
    };
    let CommitFailure::Backend(b) = &**cause else {
        panic!("{cause:?}");
    };
    assert_eq!(b.cause, Cause::ContextLost);
    assert_eq!((b.addr, b.len), (region.addr() + GRANULE, 2 * GRANULE));
}

/// Kills `src/region.rs: replace - with + in Allocation<'b, 'id, B, Elastic>::shrink`: a shrink
/// refused for a lost context names the granules it was asked to give back, at the tail.
#[test]
fn a_shrink_after_the_context_is_lost_names_the_tail_it_would_unmap() {
    let sim = common::sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region();
    region = region.grown(3);
    sim.lose_context();
    let Err(ShrinkError::Backend(e)) = region.shrink(1) else {
        panic!("a lost context refuses the shrink");
    };
    assert_eq!(e.cause, Cause::ContextLost);
    assert_eq!(e.op, Op::Unmap);
    assert_eq!((e.addr, e.len), (region.addr() + 2 * GRANULE, GRANULE));
    assert_eq!(region.committed_len(), 3 * GRANULE, "nothing was done");
}

/// Kills `src/device/steps.rs: replace += with *= in GiveBack<'_, '_, '_, B>::give` (formerly
/// in `src/region.rs`): the granules a shrink gives back, cached or released, leave
/// the binding's budget.
#[test]
fn a_shrink_refunds_the_binding_for_what_it_gave_back() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_cache_cap(GRANULE as u64);
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region().grown(3);
    assert_eq!(binding.used(), 3 * GRANULE as u64);
    region.shrink(2).unwrap(); // one cached, one released
    assert_eq!(binding.used(), GRANULE as u64);
    region.release().complete().unwrap();
    assert_eq!(binding.used(), 0);
}

/// Kills `src/device.rs: replace Device<'id, B>::forget_cache with ()`: once the context is
/// lost, discharging the device forgets its cached granules (the driver freed them), so the
/// ledger holds nothing owned or cached any more.
#[test]
fn a_lost_context_discharges_the_granule_cache_from_the_ledger() {
    let sim = common::sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region();
    region = region.grown(3);
    region.shrink(3).unwrap();
    region.release().complete().unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.owned_bytes, l.cached_bytes),
        (3 * GRANULE as u64, 3 * GRANULE as u64)
    );
    sim.lose_context();
    let proof = device
        .confirm_context_lost()
        .expect("the simulator says it is lost");
    device.discharge_all(&proof);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
}

// ---- The mapped tail: shrinks and grows within its cap call nothing. ----

/// Every backend call `faults` counted: each kind, the fences' and queries', the getters.
fn all_calls(faults: &memtoken::backend::doubles::FaultHandle) -> u64 {
    use Op::*;
    let kinds = [
        Reserve, Free, Create, Release, Map, Unmap, Pin, Unpin, Copy, Fence, Graph,
    ];
    kinds.iter().map(|&op| faults.calls(op)).sum::<u64>()
        + faults.any_calls()
        + faults.getter_calls()
}

/// Grow/shrink cycles of a region of `granules` whose mapped tail keeps `cap` granules, after
/// one warm-up cycle: the backend calls of every kind the cycles made.
fn tail_cycle_calls(cap: usize, granules: usize, cycles: usize) -> u64 {
    setup!(host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(granules * g).unwrap().into_region();
    region.set_tail_cap(cap).unwrap();
    region = region.grown(granules);
    region.shrink(granules).unwrap();
    let before = all_calls(&faults);
    for _ in 0..cycles {
        region = region.grown(granules);
        region.as_mut_slice()[0] = 1; // lent as committed again
        region.shrink(granules).unwrap();
    }
    let calls = all_calls(&faults) - before;
    assert_eq!(region.tail_granules(), cap.min(granules));
    let l = device.ledger();
    assert_eq!(
        l.mapped_bytes,
        (cap.min(granules) * g) as u64,
        "the tail stays mapped"
    );
    assert_eq!(
        binding.used(),
        (cap.min(granules) * g) as u64,
        "and charged"
    );
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    calls
}

/// Within the tail's cap, 10,000 grow/shrink cycles of 16 granules make no backend call of any
/// kind; with the cap at 0, each cycle makes today's calls: a map and an unmap per granule (from
/// the cache) and the fences' idle query. Fails if the tail is ignored (calls) or unbounded
/// (the tail and the mapped bytes past the cap). The cycles that do call (cap 0, cap 4) run a
/// tenth as many times: each makes real mappings, and their count only has to show the calls.
#[test]
fn grow_shrink_cycles_within_the_tail_cap_call_nothing() {
    assert_eq!(tail_cycle_calls(16, 16, CYCLES), 0);
    let calling = CYCLES.div_ceil(10);
    let today = tail_cycle_calls(0, 16, calling);
    assert!(
        today >= 2 * 16 * calling as u64,
        "with no tail each cycle maps and unmaps every granule: {today}"
    );
    // A cap under the growth keeps that many; the rest go as without a tail.
    let part = tail_cycle_calls(4, 16, calling);
    assert!(part > 0 && part < today, "{part} vs {today}");
}

/// On the driver model: a shrink while a kernel may still read the shrunk granules keeps them
/// mapped in the tail — no unmap, no wait, no fault; the regrowth over them maps nothing and
/// the region's fences still cover them; the release waits for the kernel as before.
#[test]
fn on_cuda_a_shrink_into_the_tail_neither_unmaps_nor_waits_for_a_kernel() {
    use memtoken::backend::cuda::DriverCall;
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(2).unwrap();
    let mut region = region.grown(3);
    model.submit_work(); // a kernel may still read the region
    let (unmaps, maps) = (
        model.count(DriverCall::MemUnmap),
        model.count(DriverCall::MemMap),
    );
    region
        .shrink(2)
        .expect("into the tail: no wait for the kernel");
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "nothing unmapped under it"
    );
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (1, 2)
    );
    assert!(
        matches!(region.shrink(1), Err(ShrinkError::Pending)),
        "past the cap, an unmap waits for the kernel as before"
    );
    region.grow(2).expect("from the tail");
    assert_eq!(model.count(DriverCall::MemMap), maps, "nothing mapped");
    let releasing = match region.release().complete().map_err(|e| e.into_token()) {
        Err(memtoken::errors::Returned::Unchanged(releasing)) => releasing,
        _ => panic!("the release waits for the kernel"),
    };
    model.complete_work();
    releasing
        .complete()
        .expect("done once the kernel has finished");
    assert_eq!(model.lost_with(), None, "nothing ran on unmapped memory");
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// A tail left over its cap (the cap lowered while a kernel may still read the tail, so
/// nothing could be unmapped then) is cut to the cap by the next shrink, and the device's
/// ledger of tail bytes follows: the granules that left the tail are refunded. Fails if the
/// shrink's count of what its tail keeps grows with what it unmapped (the ledger would go on
/// charging the unmapped granules as tail).
#[test]
fn a_shrink_cuts_a_tail_left_over_its_lowered_cap_and_refunds_it() {
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(3).unwrap();
    let mut region = region.grown(4);
    region.shrink(3).expect("into the tail");
    assert_eq!(device.tail_bytes(), 3 * g as u64);
    model.submit_work(); // a kernel may still read the tail
    assert!(
        matches!(region.set_tail_cap(1), Err(ShrinkError::Pending)),
        "nothing is unmapped under the kernel"
    );
    assert_eq!((region.tail_granules(), region.tail_cap()), (3, 1));
    model.complete_work();
    region.shrink(1).expect("the kernel is done");
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (0, 1)
    );
    assert_eq!(device.tail_bytes(), g as u64, "two granules left the tail");
    drop(region);
    assert_eq!(device.tail_bytes(), 0);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// A suspend gives the mapped tail back with the rest (nothing stays mapped or charged while
/// asleep), and the region resumes with its tail cap.
#[test]
fn a_suspended_region_gives_its_tail_back_and_resumes_with_its_cap() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(2).unwrap();
    let mut region = region.grown(3);
    region.shrink(2).unwrap();
    assert_eq!(region.tail_granules(), 2);
    let asleep = region.suspend().map_err(memtoken::Error::from).unwrap();
    assert_eq!(device.ledger().mapped_bytes, 0, "the tail went too");
    assert_eq!(binding.used(), 0);
    let region = asleep.resume().map_err(memtoken::Error::from).unwrap();
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (1, 0)
    );
    assert_eq!(region.tail_cap(), 2, "the cap comes back");
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// A growth that takes the tail and then fails (a budget) or panics (a map) gives the tail
/// granules back to the tail: all or nothing, as without a tail; the error counts the granule
/// that stopped it from the call's first (the review's two breaks).
#[test]
fn a_growth_through_the_tail_is_all_or_nothing_even_when_it_panics() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::bytes(5 * g as u64)).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    region.set_tail_cap(2).unwrap();
    let mut region = region.grown(4);
    region.shrink(2).unwrap(); // 2 committed, 2 in the tail: 4 charged
    match region.grow(4) {
        Err(GrowError::Undone { at, .. }) => assert_eq!(at, 3, "the 4th granule: 2 from the tail"),
        other => panic!("the budget has room for 1 more granule: {other:?}"),
    }
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (2, 2)
    );
    faults.panic_nth(Op::Map, 1);
    let grown = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| region.grow(3)));
    assert!(grown.is_err(), "the map's panic resumes");
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (2, 2),
        "the tail taken goes back before the panic resumes"
    );
    assert_eq!(binding.used(), 4 * g as u64);
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

// ---- Tails on the ledger, under a device-wide cap, and asked back. ----

/// The ledger counts the tails apart (`tail_bytes`, part of the owned and mapped bytes): a
/// shrink into a tail charges it, a growth out of it, a release and a suspend refund it. The
/// device's cap bounds all tails together: past it, a shrink unmaps as without a tail. Fails if
/// a move of a tail is not on the ledger, or if the device's cap is ignored.
#[test]
fn the_ledger_counts_tails_apart_and_the_device_cap_bounds_them_together() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let tails = || device.ledger().tail_bytes / g as u64;
    let binding = device.bind(Budget::unlimited()).unwrap();
    // A lower device cap asks the tails back: set it first (a region's cap answers it).
    device.set_tail_cap(6 * g as u64);
    let mut a = binding.reserve(8 * g).unwrap().into_region();
    let mut b = binding.reserve(8 * g).unwrap().into_region();
    a.set_tail_cap(4).unwrap();
    b.set_tail_cap(4).unwrap();
    assert_eq!(device.tail_cap(), 6 * g as u64);
    let (mut a, mut b) = (a.grown(5), b.grown(5));
    a.shrink(4).unwrap();
    assert_eq!((a.tail_granules(), tails()), (4, 4));
    let unmaps = faults.calls(Op::Unmap);
    b.shrink(4).unwrap();
    assert_eq!(
        (b.tail_granules(), tails()),
        (2, 6),
        "only 2 more fit under the device's cap"
    );
    assert_eq!(faults.calls(Op::Unmap) - unmaps, 2, "the other 2 unmapped");
    assert_eq!(device.cached_bytes(), 2 * g as u64, "through the cache");
    let l = device.ledger();
    // Each region: 1 committed granule, and its tail.
    assert_eq!(l.mapped_bytes, (1 + 1 + 6) * g as u64, "tails stay mapped");
    assert_eq!(binding.used(), (1 + 1 + 6) * g as u64, "and charged");
    a.grow(1).unwrap();
    assert_eq!(tails(), 5, "a growth takes from its tail");
    b.release().complete().unwrap();
    assert_eq!(tails(), 3, "a release takes its region's tail");
    let asleep = a.suspend().unwrap();
    assert_eq!(tails(), 0, "so does a suspend");
    let a = asleep.resume().unwrap();
    assert_eq!((a.committed_granules(), a.tail_granules()), (2, 0));
    drop(a);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// Only a lower device tail cap asks the tails back: set to the same cap, or raised, a region
/// keeps its tail at its next shrink; lowered, it gives it back there.
#[test]
fn only_a_lower_device_tail_cap_asks_the_tails_back() {
    make_guard!(guard);
    let device = Device::new(guard, host());
    let g = device.granularity() as u64;
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_tail_cap(4 * g);
    let mut region = binding.reserve(8 * g as usize).unwrap().into_region();
    region.set_tail_cap(2).unwrap();
    let mut region = region.grown(4);
    region.shrink(2).unwrap();
    assert_eq!(region.tail_granules(), 2);
    for (cap, kept) in [(4 * g, 2), (8 * g, 2), (4 * g, 0)] {
        device.set_tail_cap(cap);
        region.grow(1).unwrap();
        region.shrink(1).unwrap();
        assert_eq!(
            region.tail_granules(),
            kept,
            "device tail cap {} granules",
            cap / g
        );
        region.set_tail_cap(2).unwrap(); // answers the requests so far
        region.grow(2).unwrap();
        region.shrink(2).unwrap();
    }
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A growth that fails having taken nothing from its region's tail asks no tail back, even
/// while the tails are over the device's cap (one that took granules from its tail and puts
/// them back there asks then). Fails if its undo asks too (`grow`'s `from_tail > 0` →
/// `>= 0`): a region that had answered every request would give its tail back at its next
/// shrink.
#[test]
fn a_failed_growth_that_took_nothing_from_its_tail_asks_no_tail_back() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(4 * g).unwrap().into_region();
    let mut b = binding.reserve(4 * g).unwrap().into_region();
    a.set_tail_cap(2).unwrap();
    let mut a = a.grown(2);
    a.shrink(2).unwrap();
    assert_eq!(a.tail_granules(), 2);
    device.set_tail_cap(g as u64); // lowered, under a's tail: asks the tails back
    b.set_tail_cap(2).unwrap(); // b answers the request
    faults.fail_nth(Op::Map, 1);
    let e = b.grow(1).expect_err("its map was failed on purpose");
    assert!(matches!(e, GrowError::Undone { at: 0, .. }), "{e:?}");
    a.release().complete().unwrap(); // the tails are under the cap again
    assert_eq!(device.tail_bytes(), 0);
    b.grow(1).unwrap();
    b.shrink(1).unwrap();
    assert_eq!(
        b.tail_granules(),
        1,
        "b answered every request: its shrink keeps a tail under the cap"
    );
    drop(b);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Asked for the tails back — by a budget that refuses a commit while tails hold bytes, by
/// `trim_cache`, or by hand — a region keeps no tail at its next shrink: its tail goes through
/// the cache (and `trim_cache` releases it there). A growth before that takes the tail first, as
/// always; a refusal while no tail holds a byte asks nothing. Fails if budget pressure does
/// not ask, asks with no tail held (`ask_tails_back_if_held`'s `> 0` → `>= 0`), or if a region
/// ignores the request.
#[test]
fn tails_asked_back_under_budget_pressure_come_back_at_their_regions_next_shrink() {
    memtoken::make_guard!(guard);
    let backend = memtoken::backend::doubles::Faulty::new(host());
    let faults = backend.handle();
    let g = memtoken::backend::Backend::granularity(&backend);
    let device = memtoken::Device::with_cache(
        guard,
        backend,
        Budget::bytes(6 * g as u64),
        Budget::unlimited(),
    );
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    region.set_tail_cap(4).unwrap();
    let mut region = region.grown(5);
    let other = device.bind(Budget::unlimited()).unwrap();
    // Refused while no tail holds a byte, a commit asks nothing back: the shrink keeps its tail.
    assert!(other.reserve(2 * g).unwrap().commit().is_err(), "5 of 6");
    region.shrink(4).unwrap();
    assert_eq!(device.tail_bytes(), 4 * g as u64);
    // Another engine needs 2 granules: the budget (6) is full with the region's 5.
    let refused = other.reserve(2 * g).unwrap().commit().is_err();
    assert!(refused, "the tail holds what the budget needs");
    // The region answers at its next shrink: it keeps no tail.
    region.grow(1).unwrap();
    assert_eq!(region.tail_granules(), 3, "a growth takes the tail first");
    region.shrink(1).unwrap();
    assert_eq!((region.tail_granules(), device.tail_bytes()), (0, 0));
    assert_eq!(device.cached_bytes(), 4 * g as u64, "through the cache");
    // The commit fits now (the cache is trimmed for it).
    let committed = other.reserve(2 * g).unwrap().commit().unwrap();
    // Once answered, the region keeps its tail again.
    region.grow(1).unwrap();
    region.shrink(1).unwrap();
    assert_eq!(region.tail_granules(), 1);
    // `trim_cache` asks too.
    device.trim_cache();
    region.grow(1).unwrap();
    region.shrink(1).unwrap();
    assert_eq!(region.tail_granules(), 0, "asked by trim_cache");
    drop((committed, region));
    drop((other, binding));
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// On the driver model, a shrink refused while a kernel may still read what it would unmap
/// changes nothing — the room it took in the tails goes back too. Fails if a refused shrink
/// keeps its tail room on the ledger.
#[test]
fn on_cuda_a_shrink_refused_for_a_kernel_keeps_the_tails_figure() {
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_tail_cap(2 * g as u64);
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(3).unwrap();
    let mut region = region.grown(4);
    region.shrink(1).unwrap();
    model.submit_work(); // a kernel may still read the region
    // 2 more fit under the region's cap, 1 under the device's: the other must be unmapped.
    assert!(matches!(region.shrink(2), Err(ShrinkError::Pending)));
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (3, 1),
        "nothing done"
    );
    assert_eq!(device.tail_bytes(), g as u64, "nor charged");
    model.complete_work();
    region.shrink(2).unwrap();
    assert_eq!(
        (region.tail_granules(), device.tail_bytes()),
        (2, 2 * g as u64)
    );
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

// ---- Requests for the tails back: who asks, who answers. ----

/// A device-budget refusal asks the tails back even when it trimmed the cache first (and that
/// was not enough). Fails if only a refusal with nothing trimmed asks.
#[test]
fn a_device_budget_refusal_after_a_partial_trim_asks_the_tails_back() {
    make_guard!(guard);
    let backend = memtoken::backend::doubles::Faulty::new(host());
    let g = memtoken::backend::Backend::granularity(&backend);
    let device = Device::with_cache(
        guard,
        backend,
        Budget::bytes(6 * g as u64),
        Budget::unlimited(),
    );
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    region.set_tail_cap(4).unwrap();
    let mut region = region.grown(5);
    region.shrink(4).unwrap();
    // One granule in the cache: 5 owned by the region and 1 cached fill the budget.
    let mut other_region = binding.reserve(g).unwrap().into_region().grown(1);
    other_region.shrink(1).unwrap();
    assert_eq!(device.cached_bytes(), g as u64);
    let other = device.bind(Budget::unlimited()).unwrap();
    assert!(other.reserve(2 * g).unwrap().commit().is_err(), "refused");
    assert_eq!(device.cached_bytes(), 0, "the cache was trimmed for it");
    region.grow(1).unwrap();
    region.shrink(1).unwrap();
    assert_eq!(region.tail_granules(), 0, "asked, and answered");
    drop((region, other_region));
    drop((other, binding));
    assert!(device.close().is_clean());
}

/// A binding refused by its own budget asks its own regions only: another binding's tail
/// cannot make room in it. Fails if it asks every region of the device (every shrink of
/// the other binding's regions would unmap).
#[test]
fn a_bindings_own_budget_refusal_asks_only_its_own_regions() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let tenant = device.bind(Budget::unlimited()).unwrap();
    let small = device.bind(Budget::bytes(g as u64)).unwrap();
    let mut hot = tenant.reserve(8 * g).unwrap().into_region();
    hot.set_tail_cap(4).unwrap();
    let mut mine = small.reserve(2 * g).unwrap().into_region();
    mine.set_tail_cap(1).unwrap();
    let mut mine = mine.grown(1);
    mine.shrink(1).unwrap();
    for _ in 0..10 {
        // `small` asks for 2 granules: its own budget (1, all in its tail) refuses.
        assert!(small.reserve(2 * g).unwrap().commit().is_err());
        hot.grow(4).unwrap();
        let before = faults.calls(Op::Unmap);
        hot.shrink(4).unwrap();
        assert_eq!(
            faults.calls(Op::Unmap),
            before,
            "another binding's tail stays"
        );
    }
    // Its own region answers at its next shrink.
    mine.grow(1).unwrap();
    mine.shrink(1).unwrap();
    assert_eq!(mine.tail_granules(), 0);
    drop((hot, mine));
    drop((tenant, small));
    assert!(device.close().is_clean());
}

/// A cap set (or a tail trimmed) after a request answers it: the next shrink keeps its tail.
/// Fails if a region that had nothing to give back still answers an old request at its next
/// shrink.
#[test]
fn a_cap_set_after_a_request_answers_it() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    device.ask_tails_back(); // long ago, for other regions
    region.set_tail_cap(4).unwrap();
    let mut region = region.grown(4);
    let before = faults.calls(Op::Unmap);
    region.shrink(4).unwrap();
    assert_eq!(region.tail_granules(), 4);
    assert_eq!(faults.calls(Op::Unmap), before, "no unmap");
    device.ask_tails_back();
    region.trim_tail().unwrap();
    region.grow(2).unwrap();
    region.shrink(2).unwrap();
    assert_eq!(region.tail_granules(), 2, "the trim answered the request");
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A request is advice: a shrink that cannot unmap now — a kernel may still read the region,
/// or the context is lost — keeps its tail as its cap allows (no wait, no error) and answers at
/// a later shrink. Fails if a request turns a shrink into the tail into `Pending` or `Backend`.
#[test]
fn a_request_never_makes_a_shrink_into_the_tail_fail() {
    let model = common::held_fences();
    setup!(CudaBackend::new(model.clone(), 0).unwrap(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(4).unwrap();
    let mut region = region.grown(4);
    model.submit_work();
    region
        .shrink(1)
        .expect("into the tail under a kernel: no wait");
    device.ask_tails_back();
    region
        .shrink(1)
        .expect("asked, but the kernel may read it: keeps the tail");
    assert_eq!(region.tail_granules(), 2);
    model.complete_work();
    region.shrink(1).expect("answers now");
    assert_eq!(region.tail_granules(), 0, "answered once it could unmap");
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());

    // After a context loss, a shrink within the tail makes no call: a request does not change
    // that.
    let sim = common::sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region();
    region.set_tail_cap(4).unwrap();
    let mut region = region.grown(3);
    region.shrink(1).unwrap();
    sim.lose_context();
    device.trim_cache(); // asks
    region.shrink(1).expect("within the tail after a loss");
    assert_eq!(region.tail_granules(), 2);
}

/// A growth that took its region's tail and then failed puts the tail back "whatever the cap";
/// if another region used the room meanwhile, the tails are over the device's cap — and asked
/// back. Fails if nothing asks (the excess would stay for good).
#[test]
fn a_failed_growth_that_puts_its_tail_back_over_the_device_cap_asks_the_tails_back() {
    use crate::common::gate::{Gate, GateHandle};
    make_guard!(guard);
    let inner = Faulty::new(host());
    let faults = inner.handle();
    let gate = GateHandle::default();
    let backend = Gate {
        inner,
        gate: gate.clone(),
    };
    let g = memtoken::backend::Backend::granularity(&backend);
    let device = Device::with_cache(guard, backend, Budget::unlimited(), Budget::bytes(0));
    device.set_tail_cap(4 * g as u64);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(8 * g).unwrap().into_region();
    let mut b = binding.reserve(8 * g).unwrap().into_region();
    a.set_tail_cap(4).unwrap();
    b.set_tail_cap(4).unwrap();
    let mut a = a.grown(4);
    let mut b = b.grown(4);
    a.shrink(4).unwrap();
    assert_eq!(device.tail_bytes(), 4 * g as u64);
    std::thread::scope(|s| {
        // The next create (a's, past its tail) stops at the gate, then fails.
        gate.arm(Op::Create);
        faults.fail_nth(Op::Create, 1);
        let growing = s.spawn(|| a.grow(6).is_err());
        assert!(gate.wait_entered(), "a's growth creates");
        b.shrink(4).unwrap(); // a took its tail: b keeps 4 under the device cap
        gate.open();
        assert!(growing.join().unwrap(), "a's growth failed");
    });
    assert_eq!(device.tail_bytes(), 8 * g as u64, "over the cap, for now");
    // Asked back: each region answers at its next shrink.
    for r in [&mut a, &mut b] {
        r.grow(1).unwrap();
        r.shrink(1).unwrap();
    }
    assert_eq!(device.tail_bytes(), 0);
    drop((a, b));
    drop(binding);
    assert!(device.close().is_clean());
}

/// A growth that takes its region's tail and then fails puts the tail back; at exactly the
/// device's tail cap that is no request for the tails: the region keeps its tail at its next
/// shrink (only a tail over the cap asks them back).
#[test]
fn a_tail_put_back_at_the_device_cap_is_not_asked_back() {
    setup!(host(), device, faults);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_tail_cap(2 * g as u64);
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    region.set_tail_cap(2).unwrap();
    let mut region = region.grown(4);
    region.shrink(2).unwrap();
    assert_eq!(region.tail_granules(), 2);
    faults.fail_nth(Op::Map, 1); // the growth's first new granule
    assert!(region.grow(3).is_err());
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (2, 2)
    );
    region.grow(1).unwrap();
    region.shrink(1).unwrap();
    assert_eq!(region.tail_granules(), 2, "asked back at exactly the cap");
    drop(region);
    drop(binding);
    assert!(device.close().is_clean());
}
