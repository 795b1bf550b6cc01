//! A lost context is said one way: every transition that can refuse because the device's
//! context is lost says so through the same question, [`Failure::is_context_lost`], whatever
//! its error type — one pattern for all of them.

use crate::common::{self, Grown};
use memtoken::backend::cuda::{CaptureMode, CuError, DriverCall};
use memtoken::backend::{Addr, BackendError, Op, PosixFd};
use memtoken::interop::OwningGraph;
use memtoken::kv::{KvCache, Layout};
use memtoken::{Budget, Device, errors::Failure, make_guard, sharing::Offer};
use std::os::unix::net::UnixStream;

/// The one pattern: the transition was refused, and it says the context is lost.
fn lost<T, E: Failure>(result: Result<T, E>) -> bool {
    matches!(result, Err(e) if e.is_context_lost())
}

/// The cause a refused transition hands back beside its token.
fn cause<T, U, C>(result: Result<T, memtoken::TransitionError<U, C>>) -> Result<T, C> {
    result.map_err(|e| e.cause)
}

/// The refusal found the context lost and names the call it could not make: `(op, addr, len)`.
fn names_the_lost_call(e: &BackendError, call: (Op, Addr, usize), what: &str) {
    assert!(e.is_context_lost(), "{e}");
    assert_eq!((e.op, e.addr, e.len), call, "{what}");
}

#[test]
#[cfg_attr(miri, ignore = "the model's POSIX-fd export: Miri has no fstat")]
fn every_transition_refused_for_a_lost_context_says_so_one_way() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    // Everything each transition starts from, made while the context lives.
    let reserved = || binding.reserve(2 * g).unwrap();
    let (to_commit, to_prefix, to_export, to_share) =
        (reserved(), reserved(), reserved(), reserved());
    let prefix = reserved().commit_prefix().unwrap();
    let sharer = reserved().map_prefix(&prefix).map_err(|e| e.cause).unwrap();
    let exportable = reserved().commit_prefix_exportable::<PosixFd>().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let export = exportable.export().unwrap();
    export.send(&a).unwrap();
    let offer = Offer::recv(&b).unwrap();
    let (to_release, to_suspend, to_save) = (
        reserved().commit().unwrap(),
        reserved().commit().unwrap(),
        reserved().commit().unwrap(),
    );
    let asleep = reserved().commit().unwrap().suspend().unwrap();
    let mut region = reserved().into_region().grown(1);
    let to_sleep = reserved().into_region().grown(1);
    let to_save_region = reserved().into_region().grown(1);
    let to_copy = reserved().commit().unwrap();
    // A region with a granule withheld (its unmap refused once): its reclaim must call.
    let mut to_reclaim = reserved().into_region().grown(2);
    model.fail_nth(DriverCall::MemUnmap, 1, CuError(2));
    assert!(to_reclaim.shrink(1).is_err(), "setup: one granule withheld");
    assert_eq!(to_reclaim.withheld_granules(), 1);
    let region_asleep = reserved().into_region().grown(1).suspend().unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(g)).unwrap();
    let (stream, to_capture) = (model.new_stream(), reserved().commit().unwrap());
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(stream) };

    model.lose_context();

    assert!(lost(binding.reserve(g)));
    assert!(lost(device.bind(Budget::unlimited())));
    assert!(lost(cause(to_commit.commit())));
    assert!(lost(cause(to_prefix.commit_prefix())));
    assert!(lost(cause(to_export.commit_prefix_exportable::<PosixFd>())));
    assert!(lost(cause(to_share.map_prefix(&prefix))));
    assert!(lost(cause(sharer.diverge())));
    assert!(lost(exportable.export()));
    assert!(lost(binding.import(offer)));
    let quarantined = match to_release.release().complete() {
        Err(memtoken::TransitionError {
            token: memtoken::errors::Returned::Quarantined(q),
            cause,
        }) if cause.is_context_lost() => q,
        other => panic!("not refused for the lost context: {:?}", other.map(|_| ())),
    };
    assert!(lost(cause(quarantined.retry())));
    assert!(lost(cause(to_suspend.suspend())));
    assert!(lost(cause(to_save.suspend_saving())));
    assert!(lost(cause(asleep.resume())));
    assert!(lost(region.grow(1)));
    assert!(lost(region.shrink(1)));
    assert!(lost(cause(to_sleep.suspend())));
    assert!(lost(cause(region_asleep.resume())));
    assert!(lost(cache.replenish()), "a group mapped");
    assert!(lost(cause(to_save_region.suspend_saving())));
    assert!(lost(to_reclaim.reclaim()));
    let mut bytes = [0u8; 8];
    assert!(lost(to_copy.copy_to_host(0, &mut bytes)));
    let capture = OwningGraph::capture(&device, stream, CaptureMode::Global, to_capture, |_, _| {
        Ok(())
    });
    assert!(lost(cause(capture)));
}

/// The same question answers no when a transition was refused for another reason: a budget, a
/// transient driver error (by value in `CommitFailure::Backend`, boxed inside a growth's
/// cause), a length the device cannot hold, a full region.
#[test]
fn a_transition_refused_for_another_reason_does_not_say_the_context_is_lost() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let poor = device.bind(Budget::bytes(0)).unwrap();
    let g = device.granularity();
    let budget = poor.reserve(g).unwrap().commit();
    assert!(!lost(cause(budget)));
    model.fail_nth(DriverCall::MemCreate, 1, CuError(2)); // OUT_OF_MEMORY: transient
    let transient = cause(binding.reserve(g).unwrap().commit());
    assert!(matches!(
        &transient,
        Err(memtoken::errors::CommitFailure::Backend(_))
    ));
    assert!(!lost(transient));
    let mut region = binding.reserve(2 * g).unwrap().into_region();
    model.fail_nth(DriverCall::MemCreate, 1, CuError(2));
    let undone = region.grow(1);
    assert!(matches!(
        &undone,
        Err(memtoken::errors::GrowError::Undone { .. })
    ));
    assert!(!lost(undone));
    assert!(!lost(region.grow(3))); // full
    assert!(!lost(binding.reserve(usize::MAX / 2)));
    assert!(!lost(region.shrink(1))); // nothing committed: too many
    // Into memtoken's `Error`, the answer stays no.
    let as_error = memtoken::Error::from(poor.reserve(g).unwrap().commit().unwrap_err());
    assert!(!as_error.is_context_lost(), "{as_error}");
}

/// A share whose first mapping loses the context is undone without a backend call: the
/// reference goes back, the reservation comes back unchanged, nothing is quarantined, and the
/// failure says the context is lost.
#[test]
fn a_share_that_loses_the_context_at_its_first_map_quarantines_nothing() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let before = device.ledger();
    model.fail_nth(DriverCall::MemMap, 1, CuError(700)); // sticky: the context is lost
    let refused = binding
        .reserve(2 * g)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap_err();
    assert!(refused.cause.is_context_lost(), "{}", refused.cause);
    assert!(matches!(
        refused.token,
        memtoken::errors::Returned::Unchanged(_)
    ));
    let ledger = device.ledger();
    assert_eq!(ledger.quarantined, 0, "{ledger:?}");
    assert_eq!(device.custody().quarantined.count, 0);
    assert_eq!(
        ledger.mapped_bytes, before.mapped_bytes,
        "the half-made mapping is gone"
    );
    assert_eq!(device.outstanding_exports(), 0);
    drop(refused);
    drop(prefix);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A prefix whose boundary map loses the context cannot unmap its body: the reservation and
/// the body are quarantined together, and the failed rollback names the unmap of the body
/// that was refused, not a release.
#[test]
fn a_prefix_that_loses_the_context_at_its_boundary_names_the_unmap_it_could_not_make() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let reserved = binding.reserve(3 * g).unwrap();
    let addr = reserved.addr();
    model.fail_nth(DriverCall::MemMap, 2, CuError(700)); // the boundary's; sticky
    let refused = reserved.commit_prefix().unwrap_err();
    let memtoken::errors::CommitFailure::UnmapFailed { rollback, .. } = &refused.cause else {
        panic!("{}", refused.cause);
    };
    names_the_lost_call(rollback, (Op::Unmap, addr, 2 * g), "the body's unmap");
    assert!(matches!(
        refused.token,
        memtoken::errors::Returned::Quarantined(_)
    ));
    drop(refused);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A quarantined token whose teardown failed at `call` (not a loss), retried once the context
/// is known lost, is refused before any call, and the refusal names the call it could not make
/// next, `(op, the token's address, its length)`: not one for memory it no longer holds.
fn a_quarantined_token_retried_after_the_loss_names(call: DriverCall, op: Op) {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let token = binding.reserve(g).unwrap().commit().unwrap();
    let addr = token.addr();
    model.fail_nth(call, 1, CuError::INVALID_VALUE); // not a loss
    let failed = token.release().complete().unwrap_err();
    let quarantined = match failed.into_token() {
        memtoken::errors::Returned::Quarantined(quarantined) => quarantined,
        other => panic!("{call:?} failed, so the remains are quarantined: {other:?}"),
    };
    model.lose_context();
    assert!(lost(binding.reserve(g)), "the backend learns of the loss");
    let refused = quarantined.retry().unwrap_err();
    let memtoken::errors::ReleaseFailure::Backend(e) = &refused.cause else {
        panic!("{}", refused.cause);
    };
    let what = format!("after {call:?} failed, the {op:?} of what is left");
    names_the_lost_call(e, (op, addr, g), &what);
    drop(refused);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}

/// [`a_quarantined_token_retried_after_the_loss_names`] a token that holds only its VA (its
/// free failed): the refusal names the free, not a release of memory it no longer owns. Fails
/// if the refusal names another call.
#[test]
fn a_quarantined_reservation_retried_after_the_loss_names_its_free() {
    a_quarantined_token_retried_after_the_loss_names(DriverCall::MemAddressFree, Op::Free);
}

/// [`a_quarantined_token_retried_after_the_loss_names`] a token that still owns its physical
/// memory, unmapped (its release failed): the refusal names that release, not the free after
/// it. Fails if owned memory is passed over (`next_call`'s `owned_bytes() > 0` → `< 0`).
#[test]
fn a_quarantined_token_that_owns_its_memory_retried_after_the_loss_names_its_release() {
    a_quarantined_token_retried_after_the_loss_names(DriverCall::MemRelease, Op::Release);
}

/// A region whose shrink left its top granule withheld (its unmap failed) and gave the one
/// below back, released once the context is known lost, is refused before any call, and the
/// refusal names the unmap of the withheld granule at its own address: the region's plus the
/// granule's offset. Fails if the name places it anywhere else.
#[test]
fn a_region_released_after_the_loss_names_the_unmap_of_its_withheld_granule() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(4 * g).unwrap().into_region().grown(2);
    let addr = region.addr();
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::INVALID_VALUE); // the top's, not a loss
    assert!(region.shrink(2).is_err());
    assert_eq!(
        (region.committed_granules(), region.withheld_granules()),
        (0, 1)
    );
    model.lose_context();
    assert!(lost(binding.reserve(g)), "the backend learns of the loss");
    let Err(failed) = region.release().complete() else {
        panic!("the context is lost");
    };
    let memtoken::errors::ReleaseFailure::Backend(e) = &failed.cause else {
        panic!("{}", failed.cause);
    };
    let withheld = (Op::Unmap, addr + g, g);
    names_the_lost_call(
        e,
        withheld,
        "the withheld granule, one granule into the region",
    );
    drop(failed);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A tail given back once the context is known lost is refused before any call, and the refusal
/// names the unmap it could not make: the top of the mapped part, as many granules as were
/// given back. The tail stays the region's.
#[test]
fn a_tail_given_back_after_the_context_is_lost_names_the_granules_it_could_not_unmap() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.set_tail_cap(3).unwrap();
    let mut region = region.grown(4);
    region.shrink(3).expect("into the tail");
    assert_eq!(
        (region.committed_granules(), region.tail_granules()),
        (1, 3)
    );
    model.lose_context();
    assert!(lost(binding.reserve(g)), "the backend learns of the loss");
    let r = region.set_tail_cap(1);
    let Err(memtoken::errors::ShrinkError::Backend(refused)) = r else {
        panic!("a tail given back after the loss is refused: {r:?}");
    };
    let top_two = (Op::Unmap, region.addr() + 2 * g, 2 * g);
    names_the_lost_call(&refused, top_two, "the top two of the four mapped granules");
    assert_eq!(region.tail_granules(), 3, "the tail stays");
    drop(region);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}
