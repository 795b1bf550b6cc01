//! CUDA graph captures (issue 22), on the driver model made strict on them (facts 39–43): what
//! memtoken does while a stream it covers captures. It records nothing into the capture and asks
//! none of the capture's events — a captured event's query would invalidate the user's capture
//! (fact 39) — so the capture ends valid, and every release goes through once it has ended.

use crate::common;
use memtoken::backend::cuda::{CuError, DriverCall};
use memtoken::backend::doubles::{CaptureMode, DriverModel, ModelConfig};
use memtoken::{Budget, Device, PagePool, make_guard};

const G: usize = common::MODEL_GRANULARITY;

/// A model whose events complete as soon as they are recorded (so a fence is done once it is
/// recorded at all).
fn model() -> DriverModel {
    DriverModel::new(ModelConfig {
        events_complete_at_once: true,
        ..common::model_config()
    })
    .unwrap()
}

/// A drop, a release, an idle check (a shrink) and a page-pool free while a covered stream
/// captures: nothing is recorded into the capture nor asked of it, so it ends valid; the drop
/// and the release wait for it, the shrink says it is pending, the page cools; once the capture
/// has ended, everything goes and nothing is left.
#[test]
fn releases_during_a_capture_on_a_covered_stream_leave_it_valid_and_complete_after_it() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let stream = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(stream) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, G / 4).unwrap();
    let (dropped, released) = (
        binding.reserve(G).unwrap().commit().unwrap(),
        binding.reserve(G).unwrap().commit().unwrap(),
    );
    let mut region = binding.reserve(2 * G).unwrap().into_region();
    region.grow(2).unwrap();
    let page = pool.alloc().unwrap();
    let queries = model.count(DriverCall::EventQuery);

    model.begin_capture(stream, CaptureMode::ThreadLocal);
    drop(dropped);
    let releasing = match released.release().complete().map_err(|e| e.into_token()) {
        Err(memtoken::Returned::Unchanged(releasing)) => releasing,
        _ => panic!("a release waits for the capture: neither done nor quarantined"),
    };
    assert!(
        matches!(region.shrink(1), Err(memtoken::ShrinkError::Pending)),
        "no unmap while work that may use the region is not known to have finished"
    );
    pool.free(page);
    assert_eq!(device.poll().deferred, 1, "the drop waits");
    assert_eq!(
        model.count(DriverCall::EventQuery),
        queries,
        "no event asked while its stream captures"
    );
    assert_eq!(model.end_capture(stream), Ok(()), "the capture ends valid");

    releasing.complete().unwrap();
    assert_eq!(device.poll().released, 1);
    region.shrink(1).unwrap();
    drop(region);
    drop(pool);
    device.poll();
    device.trim_cache();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.lost_with(), None);
}

/// A mark whose event answers an error that is not a loss (a captured event's 907, or any other
/// code: what the driver answers after a capture ends is not documented) is recorded again once
/// its stream no longer captures, rather than left failing for good: the release completes.
#[test]
fn a_mark_whose_query_fails_is_recorded_again_and_the_release_completes() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.fail_from(DriverCall::EventQuery, 1, CuError::CAPTURED_EVENT);
    let releasing = match a.release().complete().map_err(|e| e.into_token()) {
        Err(memtoken::Returned::Unchanged(releasing)) => releasing,
        _ => panic!("the fence's query failed: pending, neither done nor quarantined"),
    };
    model.clear();
    let records = model.count(DriverCall::EventRecord);
    releasing.complete().unwrap();
    assert!(
        model.count(DriverCall::EventRecord) > records,
        "the mark was recorded again"
    );
    drop(binding);
    assert!(device.close().is_clean());
}

/// While a blocking stream the device does not cover captures (cudarc's `per_thread_stream()`
/// is one, fact 2), any use of the legacy stream would invalidate the capture (fact 41): a host
/// copy is refused before it starts (a transient error, nothing done), and a fence's mark on the
/// legacy stream waits to be recorded. The capture ends valid; then the copy and the release go.
#[test]
fn a_host_copy_and_a_fence_during_a_blocking_streams_capture_leave_it_valid() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(G).unwrap().commit().unwrap();
    let b = binding.reserve(G).unwrap().commit().unwrap();
    let blocking = model.new_blocking_stream();
    model.begin_capture(blocking, CaptureMode::Relaxed);
    let refused = a.copy_from_host(0, &[7; 64]).unwrap_err();
    assert!(
        refused.to_string().contains("STREAM_CAPTURE_IMPLICIT"),
        "{refused}"
    );
    drop(b);
    assert_eq!(device.poll().deferred, 1, "its fence waits to be recorded");
    assert_eq!(
        model.end_capture(blocking),
        Ok(()),
        "the capture ends valid"
    );
    a.copy_from_host(0, &[7; 64]).unwrap();
    let mut back = [0; 64];
    a.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, [7; 64]);
    assert_eq!(device.poll().released, 1);
    drop(a);
    device.poll();
    drop(binding);
    assert!(device.close().is_clean());
}

/// A loss answered while asking whether a stream captures, as a fence's marks are recorded, is
/// noted and stops the recording: no call follows it (the next mark's stream is not asked).
#[test]
fn a_loss_while_asking_whether_a_stream_captures_stops_the_fence() {
    use memtoken::backend::Backend;
    let model = model();
    let backend = common::cuda(&model);
    let (one, two) = (model.new_stream(), model.new_stream());
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        backend.cover_stream(one);
        backend.cover_stream(two);
    }
    model.fail_nth(DriverCall::StreamIsCapturing, 1, CuError::ILLEGAL_ADDRESS);
    let fence = backend.fence();
    assert!(backend.context_lost());
    assert!(backend.fence_done(&fence), "lost: nothing runs any more");
    backend.retire_fence(fence);
    assert_eq!(model.calls_after_loss(), 0);
}

/// A device closed while a stream it covers captures: nothing is recorded into the capture or
/// waited on there, so the capture ends valid; what still waits for a fence is not freed under
/// the capture but reported by the close (the driver frees it with the context).
#[test]
fn a_device_closed_during_a_capture_leaves_it_valid_and_reports_what_it_could_not_release() {
    let model = model();
    let stream = model.new_stream();
    {
        make_guard!(guard);
        let device = Device::new(guard, common::cuda(&model));
        // SAFETY: a stream of the model's only context, live as long as the model.
        unsafe { device.cover_stream(stream) };
        let binding = device.bind(Budget::unlimited()).unwrap();
        let a = binding.reserve(G).unwrap().commit().unwrap();
        model.begin_capture(stream, CaptureMode::Global);
        drop(a);
        drop(binding);
        let report = device.close();
        assert_eq!(report.progress.deferred, 1, "{report:?}");
        assert!(!report.is_clean(), "what waits for the capture is reported");
    }
    assert_eq!(model.end_capture(stream), Ok(()), "the capture ends valid");
    assert_eq!(model.lost_with(), None);
}
