//! A lost context is said one way: every transition that can refuse because the device's
//! context is lost says so through the same question, [`Failure::is_context_lost`], whatever
//! its error type — one pattern for all of them.

use crate::common::{self, Grown};
use memtoken::backend::PosixFd;
use memtoken::{Budget, Device, Failure, Offer, PagePool, make_guard};
use std::os::unix::net::UnixStream;

/// The one pattern: the transition was refused, and it says the context is lost.
fn lost<T, E: Failure>(result: Result<T, E>) -> bool {
    matches!(result, Err(e) if e.is_context_lost())
}

/// The cause a refused transition hands back beside its token.
fn cause<T, U, C>(result: Result<T, memtoken::TransitionError<U, C>>) -> Result<T, C> {
    result.map_err(|e| e.cause)
}

#[test]
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
    let region_asleep = reserved().into_region().grown(1).suspend().unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, g).unwrap();

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
            token: memtoken::Returned::Quarantined(q),
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
    assert!(lost(pool.alloc()));
    let mut table = pool.table();
    assert!(lost(pool.push(&mut table)));
    assert!(lost(pool.grow()));
}
