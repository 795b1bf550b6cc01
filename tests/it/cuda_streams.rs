//! What a CUDA fence covers, and who waits for it, against the strict driver model: a release
//! waits for every stream that may still use the memory; a fence whose event could not be
//! recorded is never weaker for it; a copy waits for the GPU outside the backend's lock; and a
//! device dropped while its context lives on frees everything once the work is done.

use crate::common::{self, Grown};
use memtoken::backend::{Access, Addr, Backend, Cause, Violation};
use memtoken::backend::{
    cuda::{CuError, CudaBackend, CudaPhys, DriverCall, Stream},
    doubles::{DriverModel, ModelConfig},
};
use memtoken::{Budget, Device, make_guard};
use std::sync::mpsc;
use std::time::Duration;

const G: usize = common::MODEL_GRANULARITY;

fn model(synchronize_blocks: bool) -> DriverModel {
    DriverModel::new(ModelConfig {
        events_complete_at_once: false,
        synchronize_blocks,
        ..common::model_config()
    })
    .unwrap()
}

/// On `backend`: a source of `G` bytes mapped read-write, its memory, and a destination.
fn source_and_destination(backend: &CudaBackend<DriverModel>) -> (Addr, CudaPhys, CudaPhys) {
    let src = backend.reserve(G).unwrap();
    let phys = backend.create(G).unwrap();
    backend.map(src, G, phys, Access::ReadWrite).unwrap();
    (src, phys, backend.create(G).unwrap())
}

/// Copies `src` into `dst` with a wait that fails: no event can be made for it, and
/// synchronizing the legacy stream fails too. The copy is not known to have finished.
fn copy_whose_wait_fails(
    model: &DriverModel,
    backend: &CudaBackend<DriverModel>,
    src: Addr,
    dst: CudaPhys,
) {
    model.fail_nth(DriverCall::EventCreate, 1, CuError::OUT_OF_MEMORY);
    model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::OUT_OF_MEMORY);
    assert!(
        backend.copy_into_phys(dst, src, G).is_err(),
        "the wait failed"
    );
}

/// The model keeps streams apart: work on a non-blocking stream is not covered by an event on
/// the legacy stream. A device that was never told of the stream releases the memory while the
/// work still runs — the use after free the covered streams exist to prevent.
#[test]
fn an_uncovered_stream_is_not_waited_for() {
    let model = model(false);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let stream = model.new_stream();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream); // a kernel on `stream` reads `a`
    drop(a);
    assert_eq!(
        device.poll().deferred,
        0,
        "released under the running kernel"
    );
}

#[test]
fn a_release_waits_for_work_on_every_covered_stream() {
    let model = model(false);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let stream = model.new_stream();
    // SAFETY: `stream` is a stream of the model's only context and lives as long as the model.
    unsafe { device.cover_stream(stream) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream); // a kernel on `stream` reads `a`
    model.submit_work(); // and something on the legacy stream
    let unmaps = model.count(DriverCall::MemUnmap);
    drop(a);
    assert_eq!(device.poll().deferred, 1);
    model.complete_work_on(0);
    assert_eq!(
        device.poll().deferred,
        1,
        "the kernel on `stream` still runs"
    );
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "nothing unmapped under it"
    );
    model.complete_work_on(stream);
    let p = device.poll();
    assert_eq!((p.released, p.deferred), (1, 0));
    assert!(device.ledger().is_zero());
    assert_eq!(
        model.outstanding().events,
        0,
        "one event per stream, all destroyed"
    );
}

/// A failed `cuEventRecord` leaves the fence's mark to be recorded at the next query — never a
/// check of the legacy stream, which says nothing about a non-blocking one.
#[test]
fn a_fence_whose_event_could_not_be_recorded_still_waits_for_its_stream() {
    let model = model(false);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let stream = model.new_stream();
    // SAFETY: as above.
    unsafe { device.cover_stream(stream) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream);
    // The fence records on the legacy stream first, then on `stream`: the second one fails.
    model.fail_nth(DriverCall::EventRecord, 2, CuError::INVALID_VALUE);
    drop(a);
    assert_eq!(
        device.poll().deferred,
        1,
        "the legacy stream is idle, `stream` is not"
    );
    assert_eq!(device.poll().deferred, 1);
    model.complete_work_on(stream);
    assert_eq!(device.poll().released, 1);
    assert!(device.ledger().is_zero());
    assert_eq!(model.outstanding().events, 0);
}

/// Copy-on-write waits for its device-to-device copy outside the backend's lock: while it
/// waits, another thread's drop (a backend call) and poll finish.
#[test]
fn a_copy_that_waits_for_the_gpu_holds_no_lock() {
    let model = model(true);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
    let other = binding.reserve(G).unwrap();
    // The model runs the copy as work on the legacy stream, completed only when told.
    let (done, finished) = mpsc::channel();
    std::thread::scope(|scope| {
        let copier = scope.spawn(|| shared.diverge().map(drop).map_err(|e| e.to_string()));
        // Wait until the copy waits for the GPU (bounded: the copier is in no hurry).
        let waits = || {
            model.count(DriverCall::EventSynchronize) + model.count(DriverCall::StreamSynchronize)
        };
        for _ in 0..10_000 {
            if waits() > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let waiting = waits();
        scope.spawn(|| {
            drop(other); // frees its VA: a backend call
            device.poll();
            done.send(()).unwrap();
        });
        let unblocked = finished.recv_timeout(Duration::from_secs(20));
        model.complete_work(); // the GPU finishes the copy (before any assertion can fail)
        assert_eq!(waiting, 1, "the copy waits");
        assert!(
            unblocked.is_ok(),
            "a drop and a poll on another thread stalled behind the waiting copy"
        );
        assert_eq!(copier.join().unwrap(), Ok(()));
    });
    drop(prefix);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A device dropped while the context lives on (another owner retains it, as cudarc's
/// `CudaContext` does) frees everything its backend held, once the work is done.
#[test]
fn a_device_dropped_while_its_context_lives_frees_everything() {
    let model = model(true);
    let _ = common::cuda(&model); // initializes the driver (and gives its retain back)
    use memtoken::backend::cuda::Driver;
    model.primary_ctx_retain(0).unwrap(); // the other owner
    std::thread::scope(|scope| {
        make_guard!(guard);
        let device = Device::new(guard, common::cuda(&model));
        let binding = device.bind(Budget::unlimited()).unwrap();
        let a = binding.reserve(G).unwrap().commit().unwrap();
        let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
        let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
        model.submit_work(); // a kernel still uses them
        drop((a, shared, prefix));
        drop(binding);
        assert_eq!(device.poll().deferred, 3);
        let unmaps = model.count(DriverCall::MemUnmap);
        let model = &model;
        let gpu = scope.spawn(move || {
            // The GPU finishes while the device is being dropped.
            for _ in 0..10_000 {
                if model.count(DriverCall::EventSynchronize) > 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let unmapped_under_the_work = model.count(DriverCall::MemUnmap) - unmaps;
            model.complete_work();
            unmapped_under_the_work
        });
        drop(device); // waits for the work, then frees
        assert_eq!(gpu.join().unwrap(), 0, "unmapped before the work finished");
    });
    let held = model.outstanding();
    assert_eq!(
        (
            held.reservations,
            held.physical_bytes,
            held.mappings,
            held.events
        ),
        (0, 0, 0, 0),
        "the dropped device left {held:?}"
    );
    assert_eq!(held.retains, 1, "the other owner still retains the context");
}

/// A wait that fails without losing the context falls back to waiting for the whole stream —
/// never to freeing memory the work may still use, never to `cuCtxSynchronize` (which would
/// invalidate any capture open in the context).
#[test]
fn a_failed_wait_falls_back_to_the_whole_stream() {
    let model = model(false);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    let diverged = shared.diverge().map_err(|e| e.to_string()).unwrap();
    let log = model.log();
    let at = |c| log.iter().rposition(|&x| x == c).unwrap();
    assert!(
        at(DriverCall::StreamSynchronize) < at(DriverCall::MemUnmap),
        "the scratch range went before the copy was known to be done"
    );
    drop((diverged, prefix));
    drop(binding);
    assert!(device.close().is_clean());
}

/// A covered device over a new model, its binding, and a committed granule `$a` that a kernel
/// on `$stream` uses; the release's second `cuEventSynchronize` (the fence's marks: the legacy
/// stream's first, then `$stream`'s) is planned to fail with `$error`.
macro_rules! used_with_the_second_wait_failing {
    ($model:ident, $device:ident, $stream:ident, $binding:ident, $a:ident, $error:expr) => {
        let $model = model(false);
        common::covered_device!($model, $device, $stream);
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        let $a = $binding.reserve(G).unwrap().commit().unwrap();
        $model.submit_work_on($stream); // a kernel uses `$a`
        $model.fail_nth(DriverCall::EventSynchronize, 2, $error);
    };
}

/// A wait whose event wait loses the context stops there: the release is refused, and
/// nothing is called after the loss. Fails if the lost context is taken for an ordinary
/// failure, and the wait falls back to waiting for the whole stream.
#[test]
fn a_wait_that_loses_the_context_calls_nothing_after_it() {
    used_with_the_second_wait_failing!(
        model,
        device,
        stream,
        binding,
        a,
        CuError::CONTEXT_IS_DESTROYED
    );
    let e = a.release().wait().map(drop).unwrap_err();
    assert!(
        memtoken::errors::Failure::is_context_lost(&e.cause),
        "{}",
        e.cause
    );
    common::assert_lost_and_nothing_called_after(&model);
}

/// Runs `release` (a release and its wait) and checks that the wait fell back to one for the
/// whole stream: `cuEventSynchronize` is called more than once (the failed event's wait, then
/// the whole stream's event).
fn released_waiting_for_the_whole_stream(model: &DriverModel, release: impl FnOnce()) {
    let before = model.count(DriverCall::EventSynchronize);
    release();
    assert!(
        model.count(DriverCall::EventSynchronize) > before + 1,
        "the failed wait fell back to a wait for the whole stream"
    );
}

/// A fence's wait that fails falls back to waiting for the whole stream, and lends the stream
/// for that wait only: once the release is done, the stream can be let go, and no event of the
/// waits is left. Fails if the lend is never ended (`forget_stream` then says `false` for ever,
/// as for a stream a view still uses), or the whole-stream wait's event is never destroyed.
#[test]
fn a_stream_waited_for_whole_after_a_failed_wait_can_be_let_go() {
    used_with_the_second_wait_failing!(model, device, stream, binding, a, CuError::UNKNOWN);
    released_waiting_for_the_whole_stream(&model, || {
        a.release().wait().map_err(|e| e.to_string()).unwrap();
    });
    assert_eq!(
        model.outstanding().events,
        0,
        "an event of the waits outlived the release"
    );
    assert!(
        device.forget_stream(stream),
        "the stream was still lent after the wait for it ended"
    );
    drop(binding);
    assert!(device.close().is_clean());
}

/// The whole-stream wait that a failed event wait falls back to lends the stream for itself:
/// a view of the stream alive meanwhile keeps it held after the wait, so it cannot be let go
/// until the view is gone. Fails if the wait ends a lend it never took (its `stream != 0`
/// before the lend → `==`: the view's count is taken down in its place).
#[test]
fn a_whole_stream_wait_leaves_a_live_views_lend_of_the_stream() {
    used_with_the_second_wait_failing!(model, device, stream, binding, a, CuError::UNKNOWN);
    let b = binding.reserve(G).unwrap().commit().unwrap();
    let view = b.stream_view::<u8>(stream).unwrap();
    released_waiting_for_the_whole_stream(&model, || {
        a.release().wait().map_err(|e| e.to_string()).unwrap();
    });
    assert!(
        !device.forget_stream(stream),
        "a view of the stream still lives"
    );
    drop(view);
    assert!(device.forget_stream(stream), "the view is gone");
    drop(b);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A release's wait whose event wait for a covered stream fails falls back to waiting for the
/// whole stream, and recording that wait's own event on the stream (the release's third
/// `cuEventRecord`: the legacy stream's mark, the stream's, then this one) fails with
/// `error`. The wait's outcome, and the model after it.
fn release_whose_whole_stream_wait_cannot_record(error: CuError) -> (bool, DriverModel) {
    used_with_the_second_wait_failing!(model, device, stream, binding, a, CuError::UNKNOWN);
    model.fail_nth(DriverCall::EventRecord, 3, error);
    let waited = match a.release().wait() {
        Ok(_) => true,
        Err(e) => {
            std::mem::forget(e); // lost or stuck: its memory may still be used
            false
        }
    };
    drop(binding);
    drop(device);
    (waited, model)
}

/// The event of a whole-stream wait cannot be recorded, the context kept: the stream is
/// synchronized instead and the release goes through.
#[test]
fn a_whole_stream_wait_whose_event_cannot_be_recorded_synchronizes_the_stream() {
    let (waited, model) = release_whose_whole_stream_wait_cannot_record(CuError::UNKNOWN);
    assert!(waited, "the release's wait gave up: {:?}", model.log());
    assert_eq!(model.count(DriverCall::StreamSynchronize), 1);
    assert_eq!(model.lost_with(), None);
}

/// The record of a whole-stream wait's event loses the context: the wait stops there, and
/// nothing is called after the loss.
#[test]
#[cfg_attr(
    miri,
    ignore = "forgets the quarantined token on purpose (the context is lost): Miri reports it as a leak"
)]
fn a_whole_stream_wait_whose_record_loses_the_context_calls_nothing_after_it() {
    let (waited, model) =
        release_whose_whole_stream_wait_cannot_record(CuError::CONTEXT_IS_DESTROYED);
    assert!(!waited);
    common::assert_lost_and_nothing_called_after(&model);
}

/// Copy-on-write swaps the boundary granule only once nothing may still read it: while a
/// kernel on a covered stream runs, it is refused with the mapping unchanged.
#[test]
fn copy_on_write_waits_for_work_reading_the_mapping() {
    let model = model(false);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
    model.submit_work_on(stream); // a kernel reads `shared`
    let unmaps = model.count(DriverCall::MemUnmap);
    let err = shared.diverge().unwrap_err();
    assert_eq!(err.cause, memtoken::errors::CowFailure::Pending);
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "nothing unmapped under it"
    );
    let memtoken::errors::Returned::Unchanged(shared) = err.into_token() else {
        panic!("the mapping comes back unchanged");
    };
    model.complete_work_on(stream);
    let diverged = shared.diverge().map_err(|e| e.to_string()).unwrap();
    drop((diverged, prefix));
    drop(binding);
    assert!(device.close().is_clean());
}

/// Two copies from the same source: one that fails does not unmark the other's busy range.
#[test]
fn a_failed_copy_leaves_another_copys_range_busy() {
    use memtoken::backend::{Access, Backend};
    let model = model(true);
    let backend = common::cuda(&model);
    let src = backend.reserve(G).unwrap();
    let phys = backend.create(G).unwrap();
    backend.map(src, G, phys, Access::ReadWrite).unwrap();
    let (first, second) = (backend.create(G).unwrap(), backend.create(G).unwrap());
    model.submit_work(); // the first copy waits behind this
    std::thread::scope(|scope| {
        let copier = scope.spawn(|| backend.copy_into_phys(first, src, G));
        for _ in 0..10_000 {
            if model.count(DriverCall::EventSynchronize) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        model.fail_nth(DriverCall::MemSetAccess, 1, CuError::OUT_OF_MEMORY);
        assert!(backend.copy_into_phys(second, src, G).is_err());
        let refused = backend.unmap(src, G);
        model.complete_work();
        assert!(refused.is_err(), "unmapped under the first copy");
        copier.join().unwrap().unwrap();
    });
    backend.unmap(src, G).unwrap();
    for p in [phys, first, second] {
        backend.release(p, G).unwrap();
    }
    backend.free(src, G).unwrap();
}

/// A copy whose wait cannot record an event waits for the whole legacy stream instead (never less):
/// it succeeds, and its ranges are free at once.
#[test]
fn a_copy_that_cannot_record_its_event_waits_for_the_whole_context() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (src, phys, dst) = source_and_destination(&backend);
    model.fail_nth(DriverCall::EventCreate, 1, CuError::OUT_OF_MEMORY);
    let synchronized = model.count(DriverCall::StreamSynchronize);
    backend.copy_into_phys(dst, src, G).unwrap();
    assert_eq!(model.count(DriverCall::StreamSynchronize), synchronized + 1);
    backend.unmap(src, G).unwrap(); // not busy: the copy is known to have finished
    for p in [phys, dst] {
        backend.release(p, G).unwrap();
    }
    backend.free(src, G).unwrap();
    assert_eq!(model.outstanding().reservations, 0);
}

/// A copy whose wait failed (no event could be made, and synchronizing the context failed too)
/// is not known to have finished: its source stays busy and its scratch range mapped. Once a
/// fence recorded on the legacy stream after it has completed, so has the copy: the source can
/// be unmapped, and the scratch range is taken down — nothing stays busy or reserved for good.
#[test]
fn a_copy_whose_wait_failed_is_settled_by_a_later_fence_on_the_legacy_stream() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (src, phys, dst) = source_and_destination(&backend);
    copy_whose_wait_fails(&model, &backend, src, dst);
    assert!(
        backend.unmap(src, G).is_err(),
        "unmapped under a copy not known to have finished"
    );
    let fence = backend.fence(); // recorded on the legacy stream after the copy
    assert!(!backend.fence_done(&fence));
    assert!(
        backend.unmap(src, G).is_err(),
        "still not known to have finished"
    );
    model.complete_work();
    assert!(backend.fence_done(&fence));
    backend.retire_fence(fence);
    backend.unmap(src, G).unwrap();
    for p in [phys, dst] {
        backend.release(p, G).unwrap();
    }
    backend.free(src, G).unwrap();
    let left = model.outstanding();
    assert_eq!(
        (left.reservations, left.mappings, left.physical_bytes),
        (0, 0, 0),
        "the scratch range was taken down: {left:?}"
    );
    assert_eq!(model.lost_with(), None);
}

/// Only this backend's own events settle its copies: a fence of another backend (whose events
/// its record does not hold, and which waited for nothing of this context) settles nothing.
#[test]
fn a_fence_of_another_backend_settles_no_copy() {
    let (model, other) = (model(false), model(false));
    let backend = common::cuda(&model);
    let foreign = common::cuda(&other);
    let (src, _, dst) = source_and_destination(&backend);
    copy_whose_wait_fails(&model, &backend, src, dst);
    let fence = foreign.fence();
    other.complete_work();
    assert!(backend.fence_done(&fence), "a foreign fence counts as done");
    assert!(
        backend.unmap(src, G).is_err(),
        "still busy: nothing of this context was waited for"
    );
    foreign.retire_fence(fence);
    model.complete_work();
    assert_eq!(model.lost_with(), None);
}

/// A loss met while settling a copy (its scratch range's unmap answers a sticky error) is
/// noted: the backend is lost, and it calls the driver no more.
#[test]
fn a_loss_while_settling_a_copy_is_noted_and_nothing_more_is_called() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (src, _, dst) = source_and_destination(&backend);
    copy_whose_wait_fails(&model, &backend, src, dst);
    let fence = backend.fence();
    model.complete_work();
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::ILLEGAL_ADDRESS);
    assert!(backend.fence_done(&fence), "lost: nothing runs any more");
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
    assert!(backend.context_lost(), "the backend knows");
    backend.retire_fence(fence);
    assert_eq!(model.calls_after_loss(), 0);
}

/// A KV block given back while work on a covered stream may still use it is handed out again
/// only once that work has finished: until then the cache hands out other blocks.
#[test]
fn a_block_given_back_is_not_reissued_under_running_work() {
    use memtoken::kv::{KvCache, Layout};
    let model = model(false);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(G / 4)).unwrap();
    cache.set_watermarks(4, 64);
    cache.replenish().unwrap();
    let mut table = cache.table();
    let block = cache.push(&mut table).unwrap();
    model.submit_work_on(stream); // a kernel on `stream` uses the block
    cache.clear(&mut table);
    cache.replenish().unwrap(); // the fence over it: not done
    assert_eq!(cache.cooling_blocks(), 1);
    let mut others = cache.table();
    for _ in 0..8 {
        let b = cache.push(&mut others).unwrap();
        assert_ne!(b, block, "handed out again under the kernel");
    }
    model.complete_work_on(stream);
    cache.clear(&mut others);
    cache.replenish().unwrap();
    let mut seen = cache.table();
    while cache.free_blocks() > 0 {
        cache.push(&mut seen).unwrap();
    }
    assert!(
        seen.ids().contains(&block),
        "the block comes back once the work has finished"
    );
    drop((table, others, seen));
    drop(cache);
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

// ---------------------------------------------------------------------------------------------
// A range a copy left busy: only that range is held back
// ---------------------------------------------------------------------------------------------

/// Kills `src/backend/cuda/mod.rs: replace && with || in CudaBackend<D>::check_not_busy`: a
/// copy not known to have landed keeps its own range busy, and only that range: another
/// allocation still releases.
#[test]
fn a_range_left_busy_by_a_copy_holds_back_only_itself() {
    let model = common::small_model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(G).unwrap().commit().unwrap();
    let b = binding.reserve(G).unwrap().commit().unwrap();
    // Neither the event nor the legacy stream can be waited for: the copy into `a` is not
    // known to have landed, so `a` stays busy.
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::UNKNOWN);
    a.copy_from_host(0, &[7; 64])
        .expect_err("the wait was failed on purpose");
    b.release()
        .complete()
        .map_err(|e| e.to_string())
        .expect("b is not busy");
    std::mem::forget(a); // still busy: it may never be unmapped
}

/// Kills `src/backend/cuda/mod.rs: replace < with > in CudaBackend<D>::check_not_busy`: the
/// range a copy left busy is refused to an unmap.
#[test]
#[cfg_attr(
    miri,
    ignore = "forgets the backend on purpose (a copy may still run): Miri reports it as a leak"
)]
fn a_range_left_busy_by_a_copy_cannot_be_unmapped() {
    let model = common::small_model();
    let backend = common::cuda(&model);
    let (a, pa) = (backend.reserve(G).unwrap(), backend.create(G).unwrap());
    backend.map(a, G, pa, Access::ReadWrite).unwrap();
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::UNKNOWN);
    backend
        .copy_from_host(a, &[7; 64])
        .expect_err("the wait was failed on purpose");
    let e = backend.unmap(a, G).expect_err("a is busy");
    assert!(
        matches!(e.cause, Cause::Violation(Violation::Busy { .. })),
        "{e}"
    );
    std::mem::forget(backend); // a copy may still run: nothing may be freed under it
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::check_not_busy` (both
/// of its comparisons): a range a copy left busy holds back only itself, not the mappings just
/// before and just after it.
#[test]
#[cfg_attr(
    miri,
    ignore = "forgets the backend on purpose (a copy may still run): Miri reports it as a leak"
)]
fn a_range_left_busy_by_a_copy_leaves_the_mappings_beside_it_free() {
    let model = common::small_model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(3 * G).unwrap();
    for i in 0..3 {
        let phys = backend.create(G).unwrap();
        backend.map(a + i * G, G, phys, Access::ReadWrite).unwrap();
    }
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::UNKNOWN);
    backend
        .copy_from_host(a + G, &vec![7; G])
        .expect_err("the wait was failed on purpose");
    backend.unmap(a, G).expect("the mapping before is not busy");
    backend
        .unmap(a + 2 * G, G)
        .expect("the mapping after is not busy");
    std::mem::forget(backend); // a copy may still run: nothing may be freed under it
}

/// The driver model behind a hook on `cuStreamSynchronize` (the first call waits at a gate
/// after synchronizing; the second fails), a switch that fails the next `cuEventCreate` (for
/// the race between one thread's whole-stream wait and another thread's failed copy), and one
/// that gives any device device 0's primary context (the model gives contexts to device 0 alone).
mod hooked {
    #![allow(unsafe_code)] // forwards each call, unchanged, to the model's own
    use memtoken::backend::cuda::{
        AllocationProps, CaptureInfo, CaptureMode, Context, CuError, CuResult, DeviceAttribute,
        Driver, Event, Graph, GraphExec, ShareableHandle, Stream,
    };
    use memtoken::backend::doubles::DriverModel;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::{Arc, Condvar, Mutex};

    #[derive(Debug, Default)]
    pub struct Hook {
        pub fail_create: AtomicBool,
        pub context_of_device_0: AtomicBool,
        syncs: AtomicU32,
        /// 0: idle; 1: the first synchronize has returned and waits; 2: it goes on.
        gate: Mutex<u8>,
        cv: Condvar,
    }

    impl Hook {
        pub fn set(&self, v: u8) {
            *self.gate.lock().unwrap() = v;
            self.cv.notify_all();
        }

        pub fn wait_for(&self, v: u8) {
            let mut g = self.gate.lock().unwrap();
            while *g != v {
                g = self.cv.wait(g).unwrap();
            }
        }
    }

    #[derive(Debug)]
    pub struct Hooked {
        pub inner: DriverModel,
        pub hook: Arc<Hook>,
    }

    impl Hooked {
        /// The device whose primary context `device`'s stands for.
        fn context_device(&self, device: i32) -> i32 {
            if self.hook.context_of_device_0.load(Ordering::Relaxed) {
                0
            } else {
                device
            }
        }
    }

    // SAFETY (for each `unsafe` call below): the caller's promise for the call is the one the
    // model's same call asks for, passed on unchanged.
    #[allow(clippy::undocumented_unsafe_blocks)]
    impl Driver for Hooked {
        fn init(&self) -> CuResult<()> {
            self.inner.init()
        }
        fn device_get(&self, o: i32) -> CuResult<i32> {
            self.inner.device_get(o)
        }
        fn device_get_attribute(&self, a: DeviceAttribute, d: i32) -> CuResult<i32> {
            self.inner.device_get_attribute(a, d)
        }
        fn device_total_mem(&self, d: i32) -> CuResult<usize> {
            self.inner.device_total_mem(d)
        }
        fn mem_alloc(&self, size: usize) -> CuResult<u64> {
            self.inner.mem_alloc(size)
        }
        unsafe fn mem_free(&self, ptr: u64) -> CuResult<()> {
            unsafe { self.inner.mem_free(ptr) }
        }
        fn device_can_access_peer(&self, d: i32, p: i32) -> CuResult<bool> {
            self.inner.device_can_access_peer(d, p)
        }
        fn primary_ctx_retain(&self, d: i32) -> CuResult<Context> {
            self.inner.primary_ctx_retain(self.context_device(d))
        }
        unsafe fn primary_ctx_release(&self, d: i32) -> CuResult<()> {
            unsafe { self.inner.primary_ctx_release(self.context_device(d)) }
        }
        unsafe fn ctx_set_current(&self, c: Context) -> CuResult<()> {
            unsafe { self.inner.ctx_set_current(c) }
        }
        fn mem_get_allocation_granularity(&self, p: AllocationProps) -> CuResult<usize> {
            self.inner.mem_get_allocation_granularity(p)
        }
        fn mem_address_reserve(&self, s: usize, a: usize, h: u64) -> CuResult<u64> {
            self.inner.mem_address_reserve(s, a, h)
        }
        unsafe fn mem_address_free(&self, p: u64, s: usize) -> CuResult<()> {
            unsafe { self.inner.mem_address_free(p, s) }
        }
        fn mem_create_with(&self, s: usize, p: AllocationProps) -> CuResult<u64> {
            self.inner.mem_create_with(s, p)
        }
        unsafe fn mem_export_to_shareable_handle(
            &self,
            h: u64,
            t: u32,
        ) -> CuResult<ShareableHandle> {
            unsafe { self.inner.mem_export_to_shareable_handle(h, t) }
        }
        fn mem_import_from_shareable_handle(&self, s: u64, t: u32) -> CuResult<u64> {
            self.inner.mem_import_from_shareable_handle(s, t)
        }
        unsafe fn mem_allocation_size(&self, h: u64) -> Option<usize> {
            unsafe { self.inner.mem_allocation_size(h) }
        }
        unsafe fn mem_release(&self, h: u64) -> CuResult<()> {
            unsafe { self.inner.mem_release(h) }
        }
        unsafe fn mem_map(&self, p: u64, s: usize, o: usize, h: u64) -> CuResult<()> {
            unsafe { self.inner.mem_map(p, s, o, h) }
        }
        unsafe fn mem_set_access(&self, p: u64, s: usize, a: &[(i32, bool)]) -> CuResult<()> {
            unsafe { self.inner.mem_set_access(p, s, a) }
        }
        unsafe fn mem_unmap(&self, p: u64, s: usize) -> CuResult<()> {
            unsafe { self.inner.mem_unmap(p, s) }
        }
        unsafe fn memcpy_dtod(&self, d: u64, s: u64, n: usize) -> CuResult<()> {
            unsafe { self.inner.memcpy_dtod(d, s, n) }
        }
        unsafe fn stream_synchronize(&self, st: Stream) -> CuResult<()> {
            match self.hook.syncs.fetch_add(1, Ordering::SeqCst) {
                // The first (thread B's): synchronizes, then waits at the gate before going on.
                0 => {
                    let r = unsafe { self.inner.stream_synchronize(st) };
                    self.hook.set(1);
                    self.hook.wait_for(2);
                    r
                }
                // The second (thread A's): fails.
                1 => Err(CuError::OUT_OF_MEMORY),
                _ => unsafe { self.inner.stream_synchronize(st) },
            }
        }
        unsafe fn memcpy_htod(&self, d: u64, s: &[u8]) -> CuResult<()> {
            unsafe { self.inner.memcpy_htod(d, s) }
        }
        unsafe fn memcpy_dtoh(&self, d: &mut [u8], s: u64) -> CuResult<()> {
            unsafe { self.inner.memcpy_dtoh(d, s) }
        }
        fn event_create(&self) -> CuResult<Event> {
            if self.hook.fail_create.swap(false, Ordering::SeqCst) {
                return Err(CuError::OUT_OF_MEMORY);
            }
            self.inner.event_create()
        }
        unsafe fn event_record(&self, e: Event, s: Stream) -> CuResult<()> {
            unsafe { self.inner.event_record(e, s) }
        }
        unsafe fn event_query(&self, e: Event) -> CuResult<bool> {
            unsafe { self.inner.event_query(e) }
        }
        unsafe fn event_destroy(&self, e: Event) -> CuResult<()> {
            unsafe { self.inner.event_destroy(e) }
        }
        unsafe fn event_synchronize(&self, e: Event) -> CuResult<()> {
            unsafe { self.inner.event_synchronize(e) }
        }
        unsafe fn stream_is_capturing(&self, s: Stream) -> CuResult<bool> {
            unsafe { self.inner.stream_is_capturing(s) }
        }
        unsafe fn stream_get_capture_info(&self, s: Stream) -> CuResult<CaptureInfo> {
            unsafe { self.inner.stream_get_capture_info(s) }
        }
        fn thread_exchange_capture_mode(&self, m: CaptureMode) -> CuResult<CaptureMode> {
            self.inner.thread_exchange_capture_mode(m)
        }
        unsafe fn stream_begin_capture(&self, st: Stream, m: CaptureMode) -> CuResult<()> {
            unsafe { self.inner.stream_begin_capture(st, m) }
        }
        unsafe fn stream_end_capture(&self, st: Stream) -> CuResult<Graph> {
            unsafe { self.inner.stream_end_capture(st) }
        }
        unsafe fn graph_instantiate(&self, g: Graph) -> CuResult<GraphExec> {
            unsafe { self.inner.graph_instantiate(g) }
        }
        unsafe fn graph_launch(&self, e: GraphExec, st: Stream) -> CuResult<()> {
            unsafe { self.inner.graph_launch(e, st) }
        }
        unsafe fn graph_exec_destroy(&self, e: GraphExec) -> CuResult<()> {
            unsafe { self.inner.graph_exec_destroy(e) }
        }
        unsafe fn graph_destroy(&self, g: Graph) -> CuResult<()> {
            unsafe { self.inner.graph_destroy(g) }
        }
        unsafe fn stream_wait_event(&self, st: Stream, e: Event) -> CuResult<()> {
            unsafe { self.inner.stream_wait_event(st, e) }
        }
    }
}

/// A backend says the device it was opened on: device 1 here, opened on the plain mechanism
/// through a driver that gives it device 0's context (the model's only one). Fails if `device`
/// answers 0 whatever the ordinal.
#[test]
fn a_backend_opened_on_device_1_says_so() {
    use hooked::{Hook, Hooked};
    let model = model(false);
    let hook = Hook::default();
    hook.context_of_device_0
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let hooked = Hooked {
        inner: model.clone(),
        hook: std::sync::Arc::new(hook),
    };
    let backend = CudaBackend::new_plain(hooked, 1).unwrap();
    assert_eq!(backend.device(), 1);
    drop(backend);
    assert_eq!(
        model.outstanding(),
        memtoken::backend::doubles::ModelOutstanding::default()
    );
}

/// A synchronize of the legacy stream settles only the copies whose wait failed before it began: a
/// copy another thread starts (and whose wait fails) while the synchronize is under way may
/// still run, so its source stays busy and nothing is taken down under it.
#[test]
fn a_synchronize_settles_only_the_copies_that_failed_before_it_began() {
    use hooked::{Hook, Hooked};
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    let model = model(false);
    let hook = Arc::new(Hook::default());
    let hooked = Hooked {
        inner: model.clone(),
        hook: hook.clone(),
    };
    let backend = CudaBackend::new(hooked, 0).unwrap();
    let b_dst = backend.reserve(G).unwrap();
    let b_phys = backend.create(G).unwrap();
    backend.map(b_dst, G, b_phys, Access::ReadWrite).unwrap();
    let src = backend.reserve(G).unwrap();
    let phys = backend.create(G).unwrap();
    backend.map(src, G, phys, Access::ReadWrite).unwrap();
    let dst = backend.create(G).unwrap();
    std::thread::scope(|scope| {
        // Thread B: a host copy whose event cannot be made waits for the whole legacy stream.
        hook.fail_create.store(true, Ordering::SeqCst);
        let b = scope.spawn(|| backend.copy_from_host(b_dst, &[7; 64]));
        hook.wait_for(1);
        // Thread A, after B's synchronize: a copy whose wait fails.
        hook.fail_create.store(true, Ordering::SeqCst);
        assert!(
            backend.copy_into_phys(dst, src, G).is_err(),
            "A's wait failed"
        );
        hook.set(2);
        b.join().unwrap().unwrap();
    });
    assert!(
        backend.unmap(src, G).is_err(),
        "A's copy may still run: its source stays busy"
    );
    model.complete_work();
    assert_eq!(
        model.lost_with(),
        None,
        "nothing was taken down under A's copy"
    );
}

/// After a copy-on-write whose copy's wait failed (its event could not
/// be made, the synchronize of the legacy stream failed), the drop leaves nothing in the model:
/// a later fence settles the copy and its scratch mapping goes.
#[test]
fn after_a_failed_copy_the_drop_leaves_nothing() {
    let model = model(false);
    {
        make_guard!(guard);
        let device = Device::new(guard, common::cuda(&model));
        let binding = device.bind(Budget::unlimited()).unwrap();
        let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
        let first = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
        let second = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
        // How many events a copy-on-write creates: its copy's wait makes the last.
        let before = model.count(DriverCall::EventCreate);
        let diverged = first.diverge().map_err(|e| e.cause).unwrap();
        let created = model.count(DriverCall::EventCreate) - before;
        model.fail_nth(DriverCall::EventCreate, created, CuError::OUT_OF_MEMORY);
        model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::OUT_OF_MEMORY);
        let kept = second.diverge().map(drop).map_err(|e| e.into_token());
        assert!(kept.is_err(), "the copy's wait failed");
        assert_eq!(
            model.count(DriverCall::MemcpyDtoD),
            2,
            "both copies were made"
        );
        drop((kept, diverged, prefix));
        drop(binding);
    }
    model.complete_work();
    let held = model.outstanding();
    assert!(held.is_zero(), "the driver still holds {held:?}");
}

/// A release whose wait fails for good at the device's drop (the event's
/// wait and the fallback synchronize of its stream both fail) is not freed under work that may
/// still run: the drop report names exactly it, and the model holds exactly its memory — one
/// reservation, one mapping, its physical bytes — and nothing else.
#[test]
fn a_release_whose_wait_fails_at_the_drop_is_exactly_what_is_left() {
    let model = model(false);
    let (sent, seen) = std::sync::mpsc::channel();
    {
        make_guard!(guard);
        let device = Device::new(guard, common::cuda(&model));
        device.report_drop_to(move |report| sent.send(*report).unwrap());
        let binding = device.bind(Budget::unlimited()).unwrap();
        let x = binding.reserve(G).unwrap().commit().unwrap();
        model.submit_work(); // a kernel still running: the release waits
        drop(x);
        drop(binding);
        model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
        model.fail_nth(DriverCall::StreamSynchronize, 1, CuError::UNKNOWN);
    }
    let report = seen.try_recv().expect("the drop reports");
    assert_eq!(report.left_waiting.count, 1, "{report:?}");
    assert_eq!(report.left_waiting.mapped_bytes, G as u64, "{report:?}");
    assert_eq!(report.quarantined.count, 0, "{report:?}");
    let held = model.outstanding();
    assert_eq!(
        (
            held.reservations,
            held.mappings,
            held.physical_bytes,
            held.retains
        ),
        (1, 1, G, 0),
        "exactly the waiting release's memory: {held:?}"
    );
}

/// A backend dropped while a copy whose wait failed is unsettled (no later
/// fence settled it) waits for the legacy stream once and takes the copy's scratch range down:
/// what the model still holds is exactly the memory the test itself created and never gave
/// back — the source's reservation and mapping, and the two physical allocations.
#[test]
fn a_backend_dropped_with_an_unsettled_copy_takes_its_scratch_range_down() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (src, _, dst) = source_and_destination(&backend);
    copy_whose_wait_fails(&model, &backend, src, dst);
    drop(backend);
    let left = model.outstanding();
    assert_eq!(
        (
            left.reservations,
            left.mappings,
            left.physical_bytes,
            left.events
        ),
        (1, 1, 2 * G, 0),
        "only the test's own memory: {left:?}"
    );
    assert_eq!(model.lost_with(), None);
}

/// Without an unsettled copy, the backend's drop waits for nothing: it records no event and
/// synchronizes nothing (the one wait of the test above is for unsettled copies only). Fails if
/// the drop waits for the legacy stream anyway.
#[test]
fn a_backend_dropped_with_no_unsettled_copy_waits_for_nothing() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (src, _, dst) = source_and_destination(&backend);
    backend.copy_into_phys(dst, src, G).unwrap(); // its wait succeeded: settled
    let calls = [
        DriverCall::EventRecord,
        DriverCall::EventSynchronize,
        DriverCall::StreamSynchronize,
    ];
    let before = calls.map(|c| model.count(c));
    drop(backend);
    assert_eq!(calls.map(|c| model.count(c)), before, "{calls:?}");
    assert_eq!(model.lost_with(), None);
}

/// 10,000 KV block cycles on the driver model — a block pushed and given back, a replenish
/// every 64 cycles (an engine's step), the GPU catching up every 500 — make no driver call as a
/// block is taken or given back, allocate nothing as it is given back, keep at most a few
/// fences alive while the work they wait for runs (the cache keeps two batches waiting: one
/// event per covered stream each), and make less than one driver call a cycle: one fence per
/// replenish, not per block. Prints the figures (`-- --nocapture`).
#[test]
fn ten_thousand_block_cycles_keep_fences_bounded_and_make_less_than_one_driver_call_each() {
    use memtoken::kv::{KvCache, Layout};
    let model = model(false);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    // Room for the blocks that cool between two catch-ups of the GPU.
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(2048, 16).plane(G / 64)).unwrap();
    cache.set_watermarks(2, 32);
    cache.replenish().unwrap();
    let mut table = cache.table();
    let (mut most, mut allocations, mut in_cycles) = (0, 0, 0);
    let cycles = common::unless_miri(10_000, 1_000);
    let before = model.log().len();
    for i in 0..cycles {
        let calls = model.log().len();
        cache.push(&mut table).unwrap();
        let made = common::allocations::made();
        cache.clear(&mut table);
        allocations += common::allocations::made() - made;
        in_cycles += model.log().len() - calls;
        if i % 64 == 63 {
            model.submit_work_on(stream); // the step's kernels: the fence waits for them
            cache.replenish().unwrap();
        }
        most = most.max(model.outstanding().events);
        if i % 500 == 499 {
            model.complete_work(); // the GPU catches up now and then
        }
    }
    let per_cycle = (model.log().len() - before) as f64 / cycles as f64;
    println!("driver calls per KV block cycle: {per_cycle:.3}; most live events: {most}");
    assert_eq!(
        in_cycles, 0,
        "a block taken or given back makes no driver call"
    );
    assert!(most > 0, "the fences waited for work");
    assert!(most <= 4, "{most} live events");
    assert_eq!(allocations, 0, "giving a block back allocates nothing");
    assert!(per_cycle < 1.0, "{per_cycle} driver calls per block cycle");
    drop(table);
    drop(cache);
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

/// A shrink waits only for the streams that may use the region: a kernel on a known
/// stream that used another token through a view does not hold it back, while one that used the
/// region does. Fails with the shrink waiting for every stream the device holds. Then a view of
/// the region with nothing committed has no element, and one of a granule has a granule's.
#[test]
fn a_shrink_waits_for_the_streams_that_touched_the_region_only() {
    let model = model(false);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    let mut region = binding.reserve(4 * G).unwrap().into_region().grown(2);
    model.complete_work();
    let ptr = x.stream_view::<u8>(stream).unwrap().device_ptr();
    model.submit_work_touching(stream, &[(ptr, G)]); // a kernel reading `x`, not the region
    region.shrink(1).map_err(|e| e.to_string()).unwrap();
    let ptr = region.stream_view::<u8>(stream).unwrap().device_ptr();
    model.submit_work_touching(stream, &[(ptr, G)]); // now one using the region
    assert!(matches!(
        region.shrink(1),
        Err(memtoken::errors::ShrinkError::Pending)
    ));
    model.complete_work();
    region.shrink(1).map_err(|e| e.to_string()).unwrap();
    // Nothing committed now: its view has no element.
    let view = region.stream_view::<f32>(stream).unwrap();
    assert_eq!((view.len(), view.is_empty()), (0, true));
    drop(view);
    region.grow(1).unwrap();
    let view = region.stream_view::<f32>(stream).unwrap();
    assert_eq!((view.len(), view.is_empty()), (G / 4, false));
    drop(view);
    drop((x, region));
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

/// A host copy after a kernel on a covered non-blocking stream waits for it — the
/// legacy stream, where host copies run, does not wait for non-blocking streams by itself, so
/// the copy would read bytes the kernel may still write (the model counts such stale reads).
/// memtoken orders the legacy stream after every covered stream first (`cuStreamWaitEvent`).
/// Fails on the previous commit: one stale read.
#[test]
fn a_host_copy_after_a_kernel_on_a_covered_stream_waits_for_it() {
    let model = model(false);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    x.copy_from_host(0, &[7; 16]).unwrap();
    model.submit_work_touching(stream, &[(x.addr() as u64, G)]); // a kernel writing `x`
    let mut back = [0u8; 16];
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(model.stale_reads(), 0, "the copy read under the kernel");
    assert!(model.count(DriverCall::StreamWaitEvent) > 0);
    // The kernel on a stream the device does not know of is not waited for: the model sees it.
    let unknown = model.new_stream();
    model.submit_work_touching(unknown, &[(x.addr() as u64, G)]);
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(
        model.stale_reads(),
        1,
        "the model counts what nobody ordered"
    );
    model.complete_work();
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A host copy waits once for each stream it must follow: a covered stream that a view also
/// used the memory on is one stream, waited for once (one `cuStreamWaitEvent`). Fails if the
/// streams the views used are added again where the covered ones list them already
/// (`order_legacy_after`'s `&&` → `||`: a second wait for the stream).
#[test]
fn a_host_copy_waits_once_for_a_covered_stream_a_view_used() {
    let model = model(false);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<u8>(stream).unwrap().device_ptr_mut();
    model.submit_work_touching(stream, &[(ptr, G)]); // a kernel writing `x`
    let waits = model.count(DriverCall::StreamWaitEvent);
    let mut back = [0u8; 16];
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(model.stale_reads(), 0, "the copy read under the kernel");
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent),
        waits + 1,
        "one wait for the one stream: {:?}",
        model.log()
    );
    model.complete_work();
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Two views of one token on two streams — a read on the second
/// runs after the first's write, and a write runs after every earlier read on other streams.
/// On the model, finishing the later use finishes the earlier ones first (the GPU cannot run it
/// sooner); without the ordering they would stay unfinished. Fails on the previous commit.
#[test]
fn views_on_two_streams_are_ordered_per_memory() {
    use memtoken::backend::cuda::Driver;
    let model = model(false);
    common::covered_device!(model, device, a);
    let (b, c) = (model.new_stream(), model.new_stream());
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        device.cover_stream(b);
        device.cover_stream(c);
    }
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let kernel = |model: &DriverModel, stream, ptr: u64| {
        model.submit_work_touching(stream, &[(ptr, G)]);
        let done = model.event_create().unwrap();
        // SAFETY: a live event and stream of the model.
        unsafe { model.event_record(done, stream) }.unwrap();
        done
    };
    let done = |model: &DriverModel, event| {
        // SAFETY: a live event of the model.
        unsafe { model.event_query(event) }.unwrap()
    };
    // A write on `a`, then a read on `b`: `b` waits for it.
    let ptr = {
        let mut view = x.stream_view_mut::<u8>(a).unwrap();
        let said = format!("{view:?}");
        assert!(
            said.starts_with("StreamViewMut(StreamView { ptr: 0x")
                && said.ends_with(&format!("len: {G}, stream: {a:#x}, in_capture: false }})")),
            "{said}"
        );
        view.device_ptr_mut()
    };
    let wrote = kernel(&model, a, ptr);
    let ptr = x.stream_view::<u8>(b).unwrap().device_ptr();
    let read_b = kernel(&model, b, ptr);
    model.complete_work_on(b);
    assert!(
        done(&model, wrote),
        "the read ran before the write finished"
    );
    // Reads on `b` and `c`, then a write on `a`: it waits for both.
    let ptr = x.stream_view::<u8>(c).unwrap().device_ptr();
    let read_c = kernel(&model, c, ptr);
    let again = x.stream_view::<u8>(b).unwrap().device_ptr();
    let read_b2 = kernel(&model, b, again);
    let ptr = x.stream_view_mut::<u8>(a).unwrap().device_ptr_mut();
    let _wrote2 = kernel(&model, a, ptr);
    model.complete_work_on(a);
    assert!(
        done(&model, read_c) && done(&model, read_b2) && done(&model, read_b),
        "the write overtook an earlier read on another stream"
    );
    model.complete_work();
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A known stream (not covered) and the device, on `model`.
fn known(model: &DriverModel, device: &Device<'_, CudaBackend<DriverModel>>) -> Stream {
    let stream = model.new_stream();
    // SAFETY: a stream of the model's only context, destroyed only after the device forgot it.
    unsafe { device.know_stream(stream) };
    stream
}

/// A release fences the streams that used its memory (plus the legacy stream and
/// the covered ones), not every stream ever seen: 1,000 streams each used once through a view
/// of one token cost nothing to another token's release; once their owner has them forgotten
/// (their work complete) and destroys them, the device holds none of them, and no driver call
/// names them again (the model panics on a destroyed stream). Fails with every view's stream
/// fenced by every release (1,001 event records; 41 under Miri, which makes 40 streams).
#[test]
fn a_release_fences_only_the_streams_that_touched_its_memory() {
    const STREAMS: usize = common::unless_miri(1000, 40);
    let model = model(false);
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    let mut y = binding.reserve(G).unwrap().commit().unwrap();
    let streams: Vec<Stream> = (0..STREAMS).map(|_| known(&model, &device)).collect();
    for &s in &streams {
        let ptr = x.stream_view::<u8>(s).unwrap().device_ptr();
        model.submit_work_touching(s, &[(ptr, G)]);
    }
    let own = known(&model, &device);
    let ptr = y.stream_view_mut::<u8>(own).unwrap().device_ptr_mut();
    model.submit_work_touching(own, &[(ptr, G)]);
    let before = model.count(DriverCall::EventRecord);
    let releasing = y.release();
    let records = model.count(DriverCall::EventRecord) - before;
    assert!(
        records <= 2,
        "{records} event records for a token one stream touched"
    );
    assert!(
        !releasing.is_ready(),
        "the release waits for the kernel on `own`"
    );
    model.complete_work_on(own);
    assert!(releasing.is_ready());
    releasing.complete().map_err(|e| e.to_string()).unwrap();
    // Not let go while their work may run, nor while a view lives.
    assert!(!device.forget_stream(streams[0]), "its kernel still runs");
    model.complete_work();
    let view = x.stream_view::<u8>(streams[0]).unwrap();
    assert!(!device.forget_stream(streams[0]), "a view of it lives");
    drop(view);
    assert!(
        !device.forget_stream(0),
        "the legacy stream is never let go"
    );
    for &s in streams.iter().chain([&own]) {
        assert!(device.forget_stream(s));
        model.destroy_stream(s);
    }
    assert!(
        device.forget_stream(streams[0]),
        "a stream it no longer holds"
    );
    assert_eq!(
        device.streams(),
        (vec![0], vec![]),
        "the device holds none of them"
    );
    assert!(x.stream_view::<u8>(streams[1]).is_err(), "forgotten");
    // The token the streams touched: its release names none of them (the model would
    // panic), and records on the legacy stream only.
    let before = model.count(DriverCall::EventRecord);
    let releasing = x.release();
    assert_eq!(model.count(DriverCall::EventRecord) - before, 1);
    model.complete_work();
    releasing.complete().map_err(|e| e.to_string()).unwrap();
    drop(binding);
    assert!(device.close().is_clean());
}

/// A view's pointer used on its stream after the view is gone (the guard dropped at
/// once) is still fenced: the memory's release waits for the stream the view was made for,
/// which the device only knows (does not cover). Fails without the per-memory record of the
/// streams that touched the memory (the release would unmap under the kernel: a fault).
#[test]
fn a_view_dropped_at_once_still_fences_its_stream() {
    let model = model(false);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<f32>(stream).unwrap().device_ptr_mut(); // view dropped
    model.submit_work_on(stream); // the kernel, launched after
    let releasing = x.release();
    assert!(
        !releasing.is_ready(),
        "the release did not wait for the kernel"
    );
    model.complete_work();
    assert!(releasing.is_ready());
    releasing.complete().map_err(|e| e.to_string()).unwrap();
    assert_eq!(
        model.lost_with(),
        None,
        "{ptr:#x} unmapped under its kernel"
    );
    drop(binding);
    assert!(device.close().is_clean());
}

/// A host copy waits for a kernel on a stream a view of that memory used, though
/// the stream is only known (not covered): the legacy stream waits for the streams that
/// touched the memory too. Fails with host copies ordered after covered streams only.
#[test]
fn a_host_copy_waits_for_the_streams_that_touched_the_memory() {
    let model = model(false);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<u8>(stream).unwrap().device_ptr_mut();
    model.submit_work_touching(stream, &[(ptr, G)]);
    let mut back = [0u8; 16];
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(model.stale_reads(), 0, "the copy read under the kernel");
    model.complete_work();
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A kernel on `stream` touching `G` bytes at `ptr`, and an event recorded after it: whether
/// it has completed is [`finished`].
fn kernel(model: &DriverModel, stream: Stream, ptr: u64) -> memtoken::backend::cuda::Event {
    use memtoken::backend::cuda::Driver;
    model.submit_work_touching(stream, &[(ptr, G)]);
    let done = model.event_create().unwrap();
    // SAFETY: a live event and stream of the model.
    unsafe { model.event_record(done, stream) }.unwrap();
    done
}

/// Whether the work before `event` has completed.
fn finished(model: &DriverModel, event: memtoken::backend::cuda::Event) -> bool {
    use memtoken::backend::cuda::Driver;
    // SAFETY: a live event of the model.
    unsafe { model.event_query(event) }.unwrap()
}

/// A use whose ordering cannot be made (the context could not be
/// made current) is still noted, so its memory's release fences its stream. Fails if the
/// failed `enter` returns without noting it.
#[test]
fn a_use_that_cannot_be_ordered_is_still_fenced() {
    let model = model(false);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let mut view = x.stream_view_mut::<u8>(stream).unwrap();
    // The view's probe enters first, then the ordering: the second enter fails.
    model.fail_nth(DriverCall::CtxSetCurrent, 2, CuError::INVALID_VALUE);
    let ptr = view.device_ptr_mut();
    drop(view);
    model.submit_work_touching(stream, &[(ptr, G)]);
    let releasing = x.release();
    assert!(
        !releasing.is_ready(),
        "the release did not wait for the kernel"
    );
    model.complete_work();
    releasing.complete().map_err(|e| e.to_string()).unwrap();
    assert_eq!(model.lost_with(), None);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A host copy while a stream that used the memory captures is
/// refused (transient) — that stream's work from before the capture cannot be waited for
/// without invalidating the capture — and goes through once the capture has ended. Fails with
/// the capturing stream skipped (a stale read).
#[test]
fn a_host_copy_is_refused_while_a_stream_that_used_the_memory_captures() {
    let model = model(false);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<u8>(stream).unwrap().device_ptr_mut();
    let _wrote = kernel(&model, stream, ptr);
    model.begin_capture(stream, memtoken::backend::doubles::CaptureMode::Global);
    let mut back = [0u8; 16];
    let e = x.copy_to_host(0, &mut back).unwrap_err();
    assert!(e.to_string().contains("900"), "{e}");
    assert_eq!(model.stale_reads(), 0);
    model.end_capture(stream).unwrap();
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(model.stale_reads(), 0, "the copy read under the kernel");
    model.complete_work();
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A write taken while its stream captures (its work does not run
/// now) does not replace the memory's last uses, so a later write on a third stream still
/// waits for an earlier read. Fails if the captured write clears the readers.
#[test]
fn a_write_taken_during_a_capture_does_not_hide_earlier_reads() {
    let model = model(false);
    common::known_device!(model, device, a);
    let (b, c) = (model.new_stream(), model.new_stream());
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        device.know_stream(b);
        device.know_stream(c);
    }
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view::<u8>(a).unwrap().device_ptr();
    let read = kernel(&model, a, ptr);
    model.begin_capture(b, memtoken::backend::doubles::CaptureMode::Relaxed);
    let _ = x.stream_view_mut::<u8>(b).unwrap().device_ptr_mut();
    model.end_capture(b).unwrap();
    let ptr = x.stream_view_mut::<u8>(c).unwrap().device_ptr_mut();
    let _wrote = kernel(&model, c, ptr);
    model.complete_work_on(c);
    assert!(finished(&model, read), "the write overtook the read on `a`");
    model.complete_work();
    // Held for good: the view lent it to a capture memtoken did not make.
    std::mem::forget(x);
    drop(binding);
}

/// A graph's launch is ordered per memory like a view's use — a
/// launch reading `x` waits for the write on another stream. Fails without the ordering at
/// launch.
#[test]
fn a_graph_launch_waits_for_the_last_write_on_another_stream() {
    use memtoken::interop::Capture;
    let model = model(false);
    common::known_device!(model, device, a);
    let s = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.know_stream(s) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    model.complete_work();
    let ptr = x.stream_view_mut::<u8>(a).unwrap().device_ptr_mut();
    let wrote = kernel(&model, a, ptr); // still running when the graph launches
    let capture =
        Capture::begin(&device, s, memtoken::backend::doubles::CaptureMode::Global).unwrap();
    let view = capture.view::<u8, _>(&x).unwrap();
    model.submit_work_touching(s, &[(view.device_ptr(), G)]);
    drop(view);
    let graph = capture.end().unwrap();
    graph.launch().unwrap();
    model.complete_work_on(s);
    assert!(
        finished(&model, wrote),
        "the launch read before the write finished"
    );
    model.complete_work();
    drop(graph);
    drop(x);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A prefix's sharer joins the owner's memory in the order per
/// memory — a read through a sharer's view waits for the owner's last write through a view.
/// Fails with uses kept per reservation only.
#[test]
fn a_sharers_read_waits_for_the_owners_write() {
    let model = model(false);
    common::known_device!(model, device, a);
    let b = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.know_stream(b) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(2 * G).unwrap().commit_prefix().unwrap();
    let ptr = prefix
        .stream_view_mut::<u8>(a)
        .expect("no sharer yet")
        .unwrap()
        .device_ptr_mut();
    let wrote = kernel(&model, a, ptr);
    let sharer = binding.reserve(2 * G).unwrap().map_prefix(&prefix).unwrap();
    let ptr = sharer.stream_view::<u8>(b).unwrap().device_ptr();
    let _read = kernel(&model, b, ptr);
    model.complete_work_on(b);
    assert!(
        finished(&model, wrote),
        "the sharer read before the owner's write finished"
    );
    model.complete_work();
    drop((sharer, prefix));
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

/// After a sticky error in the ordering's wait, nothing more is
/// called. Fails if the loss is not noted (a host synchronize follows).
#[test]
fn a_loss_while_ordering_a_use_calls_nothing_more() {
    let model = model(false);
    common::known_device!(model, device, a);
    let b = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.know_stream(b) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<u8>(a).unwrap().device_ptr_mut();
    let _wrote = kernel(&model, a, ptr);
    model.fail_nth(DriverCall::StreamWaitEvent, 1, CuError::ILLEGAL_ADDRESS);
    let _ = x.stream_view::<u8>(b).unwrap().device_ptr();
    assert_eq!(model.calls_after_loss(), 0);
    std::mem::forget(x);
    drop(binding);
}

/// A scratch range whose teardown failed stays mapped with the new memory; the
/// diverge's map of that memory links the scratch reservation into the sharer's group, and the
/// sweep frees the scratch without leaving the group: the group outlives its members, and a new
/// reservation at the scratch's address inherits it (fences and orders after stream `a`).
#[test]
fn a_swept_scratch_range_leaves_its_uses_group() {
    use memtoken::backend::doubles::Placement;
    let model = DriverModel::new(ModelConfig {
        events_complete_at_once: false,
        synchronize_blocks: false,
        placement: Placement::LowestFirst,
        ..common::model_config()
    })
    .unwrap();
    common::known_device!(model, device, a);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let ptr = prefix
        .stream_view_mut::<u8>(a)
        .expect("no sharer yet")
        .unwrap()
        .device_ptr_mut();
    model.submit_work_touching(a, &[(ptr, G)]);
    model.complete_work();
    let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN);
    let diverged = shared.diverge().map_err(|e| e.to_string()).unwrap();
    // A second copy-on-write sweeps the first scratch range (freed: address reusable).
    let prefix2 = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let shared2 = binding.reserve(G).unwrap().map_prefix(&prefix2).unwrap();
    let diverged2 = shared2.diverge().map_err(|e| e.to_string()).unwrap();
    drop((diverged, prefix, diverged2, prefix2));
    model.complete_work();
    // A fresh token, never used through a view, at the scratch's old address.
    let y0 = binding.reserve(G).unwrap();
    let y1 = binding.reserve(G).unwrap();
    let y = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(a); // unrelated work on `a`
    let before = model.count(DriverCall::EventRecord);
    let releasing = y.release();
    let records = model.count(DriverCall::EventRecord) - before;
    let ready = releasing.is_ready();
    model.complete_work();
    releasing.complete().map_err(|e| e.to_string()).unwrap();
    assert!(
        ready,
        "a fresh token's release waited for unrelated work on `a`"
    );
    assert_eq!(
        records, 1,
        "a fresh token's release fenced `a` (stale group)"
    );
    drop((y0, y1));
    drop(binding);
    assert!(device.close().is_clean());
}

/// Once a host wait made while ordering a use loses the
/// context, nothing more is called (no other wait, no restore of the capture mode).
#[test]
fn a_loss_in_a_host_wait_while_ordering_calls_nothing_more() {
    let model = model(false);
    common::known_device!(model, device, a);
    let (b, c, d) = (model.new_stream(), model.new_stream(), model.new_stream());
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        device.know_stream(b);
        device.know_stream(c);
        device.know_stream(d);
    }
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let p = x.stream_view_mut::<u8>(a).unwrap().device_ptr_mut();
    let _w = kernel(&model, a, p);
    let p = x.stream_view::<u8>(b).unwrap().device_ptr();
    let _r1 = kernel(&model, b, p);
    let p = x.stream_view::<u8>(c).unwrap().device_ptr();
    let _r2 = kernel(&model, c, p);
    model.fail_from(DriverCall::StreamWaitEvent, 1, CuError::OUT_OF_MEMORY);
    // The host's wait is on an event recorded on the stream now (never a capture's: it is
    // asked again after the record).
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::ILLEGAL_ADDRESS);
    let _ = x.stream_view_mut::<u8>(d).unwrap().device_ptr_mut();
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
    assert_eq!(model.calls_after_loss(), 0, "calls after the loss");
    std::mem::forget(x);
    drop(binding);
}

/// `wait()` on a release behind a running kernel blocks until the kernel completes
/// (here from another thread), outside every lock: a commit on a third thread goes through
/// meanwhile.
#[test]
fn wait_returns_once_the_kernel_completes_while_a_commit_proceeds() {
    let model = model(true);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream); // a kernel that may use `x`
    let releasing = x.release();
    std::thread::scope(|scope| {
        let waiter =
            scope.spawn(move || releasing.wait().map(|r| r.len).map_err(|e| e.to_string()));
        for _ in 0..10_000 {
            if model.count(DriverCall::EventSynchronize) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let committed = scope
            .spawn(|| {
                let y = binding
                    .reserve(G)
                    .unwrap()
                    .commit()
                    .map_err(|e| e.to_string())?;
                drop(y);
                Ok::<(), String>(())
            })
            .join()
            .unwrap();
        let still_waiting = !waiter.is_finished();
        model.complete_work();
        assert_eq!(committed, Ok(()), "a commit stalled behind the wait");
        assert!(
            still_waiting,
            "the wait returned before the kernel completed"
        );
        assert_eq!(waiter.join().unwrap(), Ok(G));
    });
    model.complete_work();
    device.poll();
    drop(binding);
    assert!(device.close().is_clean());
}

/// A wait behind a stream that captures cannot progress (its work does not run until
/// the capture ends): `wait()` and `flush()` return an error instead of blocking, the token
/// comes back unchanged, and both go through once the capture has ended.
#[test]
fn a_wait_behind_a_capturing_stream_is_an_error_not_a_hang() {
    use memtoken::backend::doubles::CaptureMode;
    let model = model(true);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        let x = binding.reserve(G).unwrap().commit().unwrap();
        let y = binding.reserve(G).unwrap().commit().unwrap();
        model.begin_capture(stream, CaptureMode::Relaxed);
        let memtoken::TransitionError { token, cause } = x.release().wait().unwrap_err();
        assert!(
            matches!(cause, memtoken::errors::ReleaseFailure::Stuck),
            "{cause}"
        );
        let releasing = match token {
            memtoken::errors::Returned::Unchanged(releasing) => releasing,
            memtoken::errors::Returned::Quarantined(q) => {
                panic!("the token comes back unchanged, not {q}")
            }
        };
        drop(y); // deferred behind the same stream
        assert!(matches!(
            device.flush(),
            Err(memtoken::errors::ReleaseFailure::Stuck)
        ));
        model.end_capture(stream).unwrap();
        releasing.wait().map_err(|e| e.to_string()).unwrap();
        assert_eq!(device.flush().unwrap().deferred, 0);
    }
    drop(binding);
    assert!(device.close().is_clean());
}

/// `flush()` releases what waits behind a running kernel once it completes (here
/// from another thread).
#[test]
fn flush_releases_the_deferred_once_their_work_completes() {
    let model = model(true);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream);
    drop(x);
    assert_eq!(device.poll().deferred, 1);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..10_000 {
                if model.count(DriverCall::EventSynchronize) > 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            model.complete_work();
        });
        let progress = device.flush().unwrap();
        assert_eq!((progress.released, progress.deferred), (1, 0));
    });
    drop(binding);
    assert!(device.close().is_clean());
}

/// A wait that has waited is done, even if a capture begins on
/// the stream meanwhile (a second query would answer "not yet" while it captures).
#[test]
fn a_wait_is_done_once_waited_even_if_a_capture_begins_meanwhile() {
    use memtoken::backend::doubles::CaptureMode;
    let model = model(true);
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work_on(stream);
    let releasing = x.release();
    std::thread::scope(|scope| {
        let waiter = scope.spawn(move || releasing.wait().map(drop).map_err(|e| e.to_string()));
        // Until the waiter waits on `stream`'s mark: the legacy stream's is waited on first
        // (it has no work), and a capture begun before the second wait is seen by it (found
        // under Miri, whose threads interleave otherwise).
        for _ in 0..10_000 {
            if model.count(DriverCall::EventSynchronize) >= 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        model.begin_capture(stream, CaptureMode::Relaxed);
        model.complete_work();
        assert_eq!(waiter.join().unwrap(), Ok(()));
        model.end_capture(stream).unwrap();
    });
    drop(binding);
    assert!(device.close().is_clean());
}

/// A flush releases what is done even when another release is
/// stuck behind a capturing stream, and says so.
#[test]
fn a_flush_releases_what_is_done_and_reports_what_is_stuck() {
    use memtoken::backend::doubles::CaptureMode;
    let model = model(true);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let y = binding.reserve(G).unwrap().commit().unwrap();
    let _ = x.stream_view_mut::<u8>(stream).unwrap().device_ptr_mut(); // `x` only on `stream`
    model.begin_capture(stream, CaptureMode::Relaxed);
    drop((x, y));
    assert!(matches!(
        device.flush(),
        Err(memtoken::errors::ReleaseFailure::Stuck)
    ));
    assert_eq!(
        device.ledger().owned_bytes,
        G as u64,
        "`y` released, `x` waits"
    );
    assert_eq!(
        device.poll().deferred,
        1,
        "the stuck one is back in the queue"
    );
    model.end_capture(stream).unwrap();
    assert_eq!(device.flush().unwrap().deferred, 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// While `flush()` waits for one release, the others that are
/// done are not held back (their bytes leave the budget at once).
#[test]
fn a_flush_waiting_for_one_release_holds_back_none_that_is_done() {
    let model = model(true);
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let other = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.know_stream(other) };
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    let mut y = binding.reserve(G).unwrap().commit().unwrap();
    let ptr = x.stream_view_mut::<u8>(stream).unwrap().device_ptr_mut();
    model.submit_work_touching(stream, &[(ptr, G)]); // a long kernel on `x`
    let ptr = y.stream_view_mut::<u8>(other).unwrap().device_ptr_mut();
    model.submit_work_touching(other, &[(ptr, G)]); // a short one on `y`
    drop(x);
    drop(y);
    model.complete_work_on(other); // `y` may go now; `x` waits
    assert_eq!(device.custody().deferred.count, 2);
    std::thread::scope(|scope| {
        let flusher = scope.spawn(|| device.flush().map(|p| p.deferred));
        for _ in 0..10_000 {
            if model.count(DriverCall::EventSynchronize) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        device.poll();
        let owned = device.ledger().owned_bytes;
        model.complete_work();
        assert_eq!(
            owned, G as u64,
            "`y` was held back while the flush waited for `x`"
        );
        assert_eq!(flusher.join().unwrap(), Ok(0));
    });
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

/// The device names the streams it holds: the legacy stream and each covered one, then each
/// known one; forgotten, a stream leaves the list.
#[test]
fn the_device_names_the_streams_it_covers_and_knows() {
    let model = common::model();
    common::covered_device!(model, device, covered);
    let known = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.know_stream(known) };
    assert_eq!(device.streams(), (vec![0, covered], vec![known]));
    assert!(device.forget_stream(known));
    assert_eq!(device.streams(), (vec![0, covered], vec![]));
}

/// A backend says which streams it covers and which it knows: a new stream neither, a covered
/// one both, a known one known only. Fails if `covers` or `knows` answers yes for a stream it
/// was not given.
#[test]
fn a_backend_says_which_streams_it_covers_and_knows() {
    let model = model(false);
    let backend = common::cuda(&model);
    let (a, b) = (model.new_stream(), model.new_stream());
    assert!(!backend.covers(a) && !backend.knows(a), "a new stream");
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        backend.cover_stream(a);
        backend.know_stream(b);
    }
    assert!(backend.covers(a) && backend.knows(a), "covered, so known");
    assert!(!backend.covers(b) && backend.knows(b), "known, not covered");
}

/// A copy's wait for the legacy stream whose event wait fails falls back to synchronizing the
/// whole legacy stream, and making the context current for that fallback (the fourth
/// `cuCtxSetCurrent` of the copy) fails with `error`. The copy's outcome, and the model.
fn copy_whose_fallback_wait_cannot_enter(error: CuError) -> (Result<(), String>, DriverModel) {
    let model = common::small_model();
    let backend = common::cuda(&model);
    let (a, pa) = (backend.reserve(G).unwrap(), backend.create(G).unwrap());
    backend.map(a, G, pa, Access::ReadWrite).unwrap();
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::CtxSetCurrent, 4, error);
    let copied = backend
        .copy_from_host(a, &[7; 64])
        .map_err(|e| e.to_string());
    if copied.is_ok() {
        backend.unmap(a, G).unwrap();
        backend.release(pa, G).unwrap();
        backend.free(a, G).unwrap();
    }
    (copied, model)
}

/// The context lost by the call that makes it current for a fallback wait: the wait says so,
/// and nothing is called after it (not the whole-stream synchronize it fell back to).
#[test]
fn a_fallback_wait_that_loses_the_context_calls_nothing_after_it() {
    let (copied, model) = copy_whose_fallback_wait_cannot_enter(CuError::CONTEXT_IS_DESTROYED);
    assert!(copied.is_err(), "the copy's wait was cut short by the loss");
    common::assert_lost_and_nothing_called_after(&model);
}

/// The context not made current for a fallback wait, for a reason that does not lose it: the
/// legacy stream is still synchronized (no current context is needed for it), the copy lands,
/// and the backend goes on (no loss is said where there was none).
#[test]
fn a_fallback_wait_that_cannot_make_the_context_current_still_waits() {
    let (copied, model) = copy_whose_fallback_wait_cannot_enter(CuError::UNKNOWN);
    assert_eq!(copied, Ok(()));
    assert_eq!(model.lost_with(), None);
    assert_eq!(model.count(DriverCall::StreamSynchronize), 1);
}
