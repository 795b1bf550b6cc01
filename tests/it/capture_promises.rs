//! What memtoken promises about CUDA graph captures at the boundary with code that
//! captures on its own (cudarc's safe `begin_capture` and `end_capture`, the raw driver), on
//! the driver model, which gives every capture its own id (fact 60) and models a stream joining
//! a capture by waiting on one of its captured events (fact 39).
//!
//! - A memtoken [`Capture`] ends only the capture it began (by id): one ended elsewhere, with
//!   a new capture begun on its stream, is left alone and what it lent stays held for good.
//! - A view holds its memory when a capture is open at the pointer's take or at the view's
//!   drop; a capture begun and ended in between is seen by neither, and nothing is held — the
//!   `unsafe` launch's obligation, documented, and asserted as such here.
//! - After each record on a stream whose capture memtoken may not own, memtoken asks again: a
//!   capture begun between the check and the record is never joined, queried or synchronized,
//!   and the memory it fences stays held until it ends — one test per site, each with the
//!   model's hook that begins a capture at that point.

use crate::common;
use memtoken::backend::cuda::{CaptureInfo, CuError, CudaBackend, Driver, DriverCall, Stream};
use memtoken::backend::doubles::{CaptureMode, DriverModel, ModelConfig};
use memtoken::{Allocation, Budget, Committed, errors::Returned, interop::Capture};

const G: usize = common::MODEL_GRANULARITY;

/// A model whose work completes only when told.
fn slow_model() -> DriverModel {
    DriverModel::new(ModelConfig {
        events_complete_at_once: false,
        ..common::model_config()
    })
    .unwrap()
}

/// A model whose events complete as soon as they are recorded.
fn model() -> DriverModel {
    DriverModel::new(ModelConfig {
        events_complete_at_once: true,
        ..common::model_config()
    })
    .unwrap()
}

/// `stream`'s capture state, as the driver answers it.
fn info(model: &DriverModel, stream: Stream) -> CaptureInfo {
    // SAFETY: a live stream of the model's context.
    unsafe { model.stream_get_capture_info(stream) }.unwrap()
}

/// The opening of the tests of memtoken's own capture: a stream of `model()` that the device
/// covers, and `x`, committed, then `capture`, memtoken's, begun on the stream. A macro, not a
/// function: `x` borrows the binding, which borrows the device's guard.
macro_rules! memtoken_capture {
    ($model:ident, $device:ident, $stream:ident, $binding:ident, $x:ident, $capture:ident) => {
        let $model = model();
        common::covered_device!($model, $device, $stream);
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        let mut $x = $binding.reserve(G).unwrap().commit().unwrap();
        let $capture = Capture::begin(&$device, $stream, CaptureMode::Global).unwrap();
    };
}

// ---- 2: a capture ended elsewhere, and a new one begun on its stream ----

/// The audit's sequence: memtoken begins a capture; the program ends it itself and keeps the
/// graph (which uses the memory the capture lent); the program begins a new capture on the
/// same stream; then memtoken's `Capture::end` (and, in the second round, its drop). memtoken
/// never ends the new capture (its id is not the one memtoken began), never takes its graph,
/// and keeps what it lent held for good: the token's release is quarantined and the first
/// graph's launch after it runs on mapped memory. Fails without the id check, which
/// asked only whether the stream captured: it ended the new capture, took its graph, let go of
/// the memory as that graph dropped, and the first graph's launch faulted (700).
#[test]
fn a_capture_ended_elsewhere_never_ends_the_next_capture_on_its_stream() {
    for by_drop in [false, true] {
        let model = slow_model();
        common::covered_device!(model, device, stream);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let mut x = binding.reserve(G).unwrap().commit().unwrap();
        model.complete_work();
        let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
        let mut view = capture.view_mut::<u8>(&mut x).unwrap();
        model.submit_work_touching(stream, &[(view.device_ptr_mut(), G)]);
        drop(view);
        // The program ends memtoken's capture itself, and keeps its graph.
        // SAFETY: a live stream of the model's context that captures; the graph is the model's.
        let exec = unsafe {
            let graph = model.stream_end_capture(stream).unwrap();
            model.graph_instantiate(graph).unwrap()
        };
        // ... and begins a capture of its own on the same stream.
        model.begin_capture(stream, CaptureMode::Global);
        let CaptureInfo::Active { id: theirs } = info(&model, stream) else {
            panic!("the program's capture is active");
        };
        if by_drop {
            drop(capture);
        } else {
            let e = capture.end().map(drop).unwrap_err();
            let why = common::messages(&e).join("\n");
            assert!(why.contains("ended by someone else"), "{by_drop}: {why}");
        }
        assert_eq!(
            model.count(DriverCall::StreamEndCapture),
            1,
            "{by_drop}: memtoken ended no capture (only the program's own end)"
        );
        assert_eq!(
            info(&model, stream),
            CaptureInfo::Active { id: theirs },
            "{by_drop}: the program's capture is still open, and valid"
        );
        assert_eq!(model.end_capture(stream), Ok(()), "{by_drop}");
        model.complete_work();
        let released = x.release().complete().map(drop);
        let e = released.expect_err("the memory the first graph uses stays held");
        assert!(matches!(e.token, Returned::Quarantined(_)), "{by_drop}");
        // SAFETY: the model's own live instance; its memory is still mapped.
        unsafe { model.graph_launch(exec, stream) }.unwrap();
        model.complete_work();
        assert_eq!(
            model.lost_with(),
            None,
            "{by_drop}: the graph ran on mapped memory"
        );
    }
}

/// The same race one step later: memtoken asked, and its capture was its own and valid;
/// another party (a thread, in the relaxed mode) ends it before memtoken's `cuStreamEndCapture`
/// (the model's hook) and keeps the graph. memtoken's end then fails on a stream that no
/// longer captures: that is "ended elsewhere", and what the capture lent stays held for good —
/// the release is quarantined and the other party's graph runs on mapped memory. Fails where a
/// failed end was taken for an end with no graph: the memory was let go, and the launch
/// faulted (700).
#[test]
fn a_capture_ended_elsewhere_between_the_question_and_the_end_keeps_its_memory_held() {
    for by_drop in [false, true] {
        let model = slow_model();
        common::covered_device!(model, device, stream);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let mut x = binding.reserve(G).unwrap().commit().unwrap();
        model.complete_work();
        let capture = Capture::begin(&device, stream, CaptureMode::Relaxed).unwrap();
        let mut view = capture.view_mut::<u8>(&mut x).unwrap();
        model.submit_work_touching(stream, &[(view.device_ptr_mut(), G)]);
        drop(view);
        model.end_capture_before(&[DriverCall::StreamEndCapture], 1, stream);
        if by_drop {
            drop(capture);
        } else {
            let e = capture.end().map(drop).unwrap_err();
            let why = common::messages(&e).join("\n");
            assert!(why.contains("ended by someone else"), "{by_drop}: {why}");
        }
        let graph = model.hook_graph().expect("the other party holds the graph");
        // SAFETY: the model's own graph, instantiated once.
        let exec = unsafe { model.graph_instantiate(graph) }.unwrap();
        model.complete_work();
        let released = x.release().complete().map(drop);
        let e = released.expect_err("the memory the other party's graph uses stays held");
        assert!(matches!(e.token, Returned::Quarantined(_)), "{by_drop}");
        // SAFETY: the model's own live instance; its memory is still mapped.
        unsafe { model.graph_launch(exec, stream) }.unwrap();
        model.complete_work();
        assert_eq!(
            model.lost_with(),
            None,
            "{by_drop}: the graph ran on mapped memory"
        );
    }
}

/// memtoken's own capture, ended by memtoken, is told apart by its id: the graph comes back
/// and, once it is dropped, the memory is free again. (The id check does not refuse the
/// ordinary case.)
#[test]
fn a_capture_memtoken_began_is_ended_by_its_id_and_its_memory_let_go_with_its_graph() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    let CaptureInfo::Active { id } = info(&model, stream) else {
        panic!("the capture is active");
    };
    let mut view = capture.view_mut::<u8>(&mut x).unwrap();
    model.submit_work_touching(stream, &[(view.device_ptr_mut(), G)]);
    drop(view);
    let graph = capture.end().unwrap();
    assert_eq!(
        graph.stream(),
        stream,
        "the graph launches on the capture's stream"
    );
    assert_eq!(info(&model, stream), CaptureInfo::None);
    graph.launch().unwrap();
    drop(graph);
    x.release().complete().map(drop).unwrap();
    // Every capture gets an id of its own.
    model.begin_capture(stream, CaptureMode::Global);
    assert!(matches!(info(&model, stream), CaptureInfo::Active { id: next } if next != id));
    assert_eq!(model.end_capture(stream), Ok(()));
}

/// [`common::write_through_view`], then something invalidates the capture: a synchronize of the
/// capturing stream (fact 41).
fn write_then_invalidate<'t, 'id>(
    model: &DriverModel,
    stream: Stream,
    capture: &Capture<'t, 'id, DriverModel>,
    x: &'t mut Allocation<'_, 'id, CudaBackend<DriverModel>, Committed>,
) {
    common::write_through_view(model, stream, capture, x);
    // SAFETY: a live stream of the model's context.
    let refused = unsafe { model.stream_synchronize(stream) };
    assert_eq!(refused, Err(CuError::STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(info(model, stream), CaptureInfo::Invalidated);
}

/// A memtoken capture invalidated before its end has no id to compare (fact 60: the driver
/// gives one only for an active capture), so memtoken cannot tell it from a capture begun after
/// its own was ended elsewhere: it ends it (an invalidated capture yields no graph) and keeps
/// what it lent held for good. Documented; fails if the invalidated end lets the memory go.
#[test]
fn an_invalidated_capture_is_ended_and_what_it_lent_stays_held_for_good() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    write_then_invalidate(&model, stream, &capture, &mut x);
    let e = capture.end().map(drop).unwrap_err();
    assert!(e.to_string().contains("STREAM_CAPTURE_INVALIDATED"), "{e}");
    assert_eq!(info(&model, stream), CaptureInfo::None, "ended");
    let e = x.release().complete().map(drop).unwrap_err();
    assert!(matches!(e.token, Returned::Quarantined(_)), "held for good");
}

/// A memtoken capture still valid when asked, whose end fails on its own: the user forked it
/// onto stream `b` and never joined `b` back (fact 39), so the end fails with
/// `STREAM_CAPTURE_UNJOINED` and the stream captures no more. That capture was memtoken's and
/// yields no graph, so what it lent is let go: the error is the driver's, and the token
/// releases. Fails if such an end is taken for one by someone else (the memory held for good).
#[test]
fn a_capture_whose_own_end_fails_unjoined_lets_what_it_lent_go() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    common::write_through_view(&model, stream, &capture, &mut x);
    let b = model.new_stream();
    let forked = model.event_create().unwrap();
    // SAFETY: live streams and an event of the model's context.
    unsafe {
        model.event_record(forked, stream).unwrap();
        model.stream_wait_event(b, forked).unwrap(); // `b` joins the capture, never back
    }
    assert!(info(&model, stream).captures(), "still valid when asked");
    let e = capture.end().map(drop).unwrap_err();
    assert!(e.to_string().contains("STREAM_CAPTURE_UNJOINED"), "{e}");
    assert_eq!(info(&model, stream), CaptureInfo::None, "ended");
    model.complete_work();
    x.release()
        .complete()
        .map(drop)
        .map_err(|e| e.to_string())
        .expect("let go: no graph of it can launch");
    // SAFETY: an event of the model's, not used after.
    unsafe { model.event_destroy(forked) }.unwrap();
    drop(binding);
    assert!(device.close().is_clean());
}

/// The case the rule above is for: memtoken's invalidated capture is ended by another party
/// between memtoken's question and its end, and a new capture is begun on the stream just
/// before memtoken's `cuStreamEndCapture` (the model's hooks), which so ends the new one and
/// gets a graph. An invalidated capture yields none, so that graph is not memtoken's: it is
/// destroyed, the end says the capture was ended elsewhere, and what memtoken's capture lent
/// stays held for good. Fails if the graph is taken for memtoken's.
#[test]
fn a_graph_from_the_end_of_an_invalidated_capture_is_not_taken_for_its_own() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    write_then_invalidate(&model, stream, &capture, &mut x);
    // The end asks (entering once), then enters again to end: ended elsewhere at that second
    // entry, and begun anew just before the end.
    model.end_capture_before(&[DriverCall::CtxSetCurrent], 2, stream);
    model.begin_capture_before(
        &[DriverCall::StreamEndCapture],
        1,
        stream,
        CaptureMode::Global,
    );
    let destroyed = model.count(DriverCall::GraphExecDestroy);
    let e = capture
        .end()
        .map(drop)
        .expect_err("the graph of the capture begun since is not memtoken's");
    assert!(
        common::messages(&e)
            .join("\n")
            .contains("ended by someone else"),
        "{e}"
    );
    assert_eq!(
        model.count(DriverCall::GraphExecDestroy),
        destroyed + 1,
        "the other capture's graph was destroyed at once"
    );
    assert_eq!(info(&model, stream), CaptureInfo::None);
    let e = x.release().complete().map(drop).unwrap_err();
    assert!(matches!(e.token, Returned::Quarantined(_)), "held for good");
}

/// A capture whose end the driver refuses once (the stream still captures it) stays open, and
/// is ended as it drops: the stream captures no more, and the memory it lent is free again.
/// Fails if a refused end is taken for an end by someone else (what it lent then held for
/// good, and the capture left open on the stream).
#[test]
fn a_capture_whose_end_is_refused_once_is_ended_as_it_drops() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    common::write_through_view(&model, stream, &capture, &mut x);
    model.fail_nth(DriverCall::StreamEndCapture, 1, CuError::UNKNOWN);
    let e = capture.end().map(drop).expect_err("the end was refused");
    assert!(e.to_string().contains("UNKNOWN"), "{e}");
    assert_eq!(
        info(&model, stream),
        CaptureInfo::None,
        "ended as it dropped"
    );
    model.complete_work();
    x.release()
        .complete()
        .map(drop)
        .map_err(|e| e.to_string())
        .unwrap();
}

// ---- 3: what a view's probes see, and what they cannot ----

/// A pointer taken while a capture memtoken did not make is open: the probe at the take holds
/// the memory for good (the release is quarantined).
#[test]
fn a_capture_open_when_the_pointer_is_taken_keeps_the_memory_held() {
    let model = model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.begin_capture(stream, CaptureMode::Global);
    let view = x.stream_view::<u8>(stream).unwrap();
    assert_eq!(view.stream(), stream, "the view is for the stream asked");
    model.submit_work_touching(stream, &[(view.device_ptr(), G)]);
    assert_eq!(model.end_capture(stream), Ok(()));
    drop(view);
    let e = x.release().complete().map(drop).unwrap_err();
    assert!(matches!(e.token, Returned::Quarantined(_)));
}

/// A capture begun after the pointer's take and still open when the view drops: the probe at
/// the drop holds the memory for good.
#[test]
fn a_capture_open_only_when_the_view_drops_keeps_the_memory_held() {
    let model = model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    let view = x.stream_view::<u8>(stream).unwrap();
    let ptr = view.device_ptr();
    model.begin_capture(stream, CaptureMode::Global);
    model.submit_work_touching(stream, &[(ptr, G)]);
    drop(view);
    assert_eq!(model.end_capture(stream), Ok(()));
    let e = x.release().complete().map(drop).unwrap_err();
    assert!(matches!(e.token, Returned::Quarantined(_)));
}

/// What no probe can see, asserted as documented: a capture that begins after the pointer's
/// take and ends before the view drops is open at neither probe, so nothing is held — the
/// release completes and unmaps, and a launch of that graph afterwards faults (700). Keeping
/// the token alive while such a graph can launch (or capturing through memtoken's `Capture`)
/// is the `unsafe` kernel launch's obligation. Fails if memtoken starts holding memory here
/// (then the promise, and this test, should say more).
#[test]
fn a_capture_begun_and_ended_between_the_take_and_the_drop_is_seen_by_neither_probe_nothing_is_held()
 {
    let model = model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    let view = x.stream_view::<u8>(stream).unwrap();
    let ptr = view.device_ptr();
    // SAFETY: a live stream of the model's context; the graph and its instance are the model's.
    let exec = unsafe {
        model
            .stream_begin_capture(stream, CaptureMode::Global)
            .unwrap();
        model.submit_work_touching(stream, &[(ptr, G)]);
        let graph = model.stream_end_capture(stream).unwrap();
        model.graph_instantiate(graph).unwrap()
    };
    drop(view);
    x.release()
        .complete()
        .map(drop)
        .expect("nothing held: the release unmaps");
    // SAFETY: the model's instance; its memory is gone — the fault this test documents.
    let _ = unsafe { model.graph_launch(exec, stream) };
    model.complete_work();
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

// ---- 4: check, then act — a capture begun in between ----

/// The first site: a fence's mark. A capture begins on the covered stream between the
/// release's check of it and the record of its mark there (the model's hook): memtoken asks
/// again after the record, never queries, waits on or synchronizes the captured event while
/// the capture is open (any of them would invalidate it or join memtoken's stream to it), the
/// release stays pending — the memory held — and completes once the capture has ended. Fails
/// without the recheck: the captured mark was taken as recorded and queried, which
/// invalidated the capture.
#[test]
fn a_capture_begun_between_the_check_and_a_fence_mark_is_never_asked_and_holds_the_memory() {
    let model = model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    // The fence records on the legacy stream first, then on `stream`: the second record.
    model.begin_capture_before(
        &[DriverCall::EventRecord],
        2,
        stream,
        CaptureMode::ThreadLocal,
    );
    let releasing = match x.release().complete().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        other => panic!("the release waits for the capture: {:?}", other.map(drop)),
    };
    assert!(
        info(&model, stream).captures(),
        "the hook began the capture"
    );
    let releasing = match releasing.complete().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        other => panic!("still pending: {:?}", other.map(drop)),
    };
    assert_eq!(
        model.end_capture(stream),
        Ok(()),
        "neither invalidated nor joined"
    );
    releasing.complete().map(drop).unwrap();
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.lost_with(), None);
}

/// The second site: the handoff record of a use's order per memory. A write through a view on
/// stream `a`, then a read through a view on stream `b`, which waits for `a` by an event
/// recorded there; a capture begins on `a` between the check and that record: memtoken asks
/// again and does not make `b` wait on the captured event — which would join `b` to the
/// capture, capture its later work instead of running it, and make the capture fail to end
/// (904). Fails without the recheck (the model's capture ends `STREAM_CAPTURE_UNJOINED`).
#[test]
fn a_capture_begun_between_the_check_and_a_handoff_record_is_never_joined() {
    let model = model();
    common::covered_device!(model, device, a);
    let b = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(b) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    {
        let mut on_a = x.stream_view_mut::<u8>(a).unwrap();
        model.submit_work_touching(a, &[(on_a.device_ptr_mut(), G)]);
    }
    let waits = model.count(DriverCall::StreamWaitEvent);
    model.begin_capture_before(&[DriverCall::EventRecord], 1, a, CaptureMode::ThreadLocal);
    {
        let on_b = x.stream_view::<u8>(b).unwrap();
        model.submit_work_touching(b, &[(on_b.device_ptr(), G)]);
    }
    assert!(info(&model, a).captures(), "the hook began the capture");
    assert_eq!(info(&model, b), CaptureInfo::None, "`b` did not join it");
    assert_eq!(model.count(DriverCall::StreamWaitEvent), waits, "no wait");
    assert_eq!(
        model.end_capture(a),
        Ok(()),
        "neither invalidated nor unjoined"
    );
    model.complete_work();
    x.release().wait().map(drop).unwrap();
    assert_eq!(model.lost_with(), None);
}

/// The third site: a host copy orders the legacy stream after every covered stream by an event
/// recorded on each; a capture begins on the covered stream between the check and that
/// record: memtoken asks again, the legacy stream does not wait on the captured event (it would
/// join the capture, and the copy become a node of it), and the copy is refused as while any
/// such capture is open (transient). Fails without the recheck.
#[test]
fn a_capture_begun_between_the_check_and_a_host_copys_record_refuses_the_copy_and_joins_nothing() {
    let model = model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    model.begin_capture_before(
        &[DriverCall::EventRecord],
        1,
        stream,
        CaptureMode::ThreadLocal,
    );
    let e = x.copy_from_host(0, &[7; 64]).unwrap_err();
    assert!(
        e.to_string().contains("900") || format!("{e:?}").contains("UNSUPPORTED"),
        "{e}"
    );
    assert_eq!(
        info(&model, 0),
        CaptureInfo::None,
        "the legacy stream did not join it"
    );
    assert_eq!(
        model.end_capture(stream),
        Ok(()),
        "neither invalidated nor unjoined"
    );
    x.copy_from_host(0, &[7; 64]).unwrap();
    let mut back = [0; 64];
    x.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, [7; 64]);
    assert_eq!(model.lost_with(), None);
}

/// The fourth site: a host's wait for a whole stream (where the wait on a fence's event
/// failed) is a wait on an event recorded there now, asked again after the record. A capture
/// another thread begins between the check and that record (the model's hook) took the event:
/// it is never waited on or asked while the capture is open, the stream is never synchronized,
/// the capture stays valid, and the release stays pending — the memory held — until the
/// capture has ended. Fails without the question after the record (the captured event was
/// waited on, which invalidated the capture), and with the check-then-`cuStreamSynchronize`
/// this replaced (no record: the hook's capture never began, and the release completed).
#[test]
fn a_capture_begun_before_a_whole_stream_wait_records_its_event_is_never_synchronized() {
    let model = slow_model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.complete_work();
    model.submit_work_touching(stream, &[(x.addr() as u64, G)]);
    let releasing = x.release();
    let waits = model.count(DriverCall::EventSynchronize);
    // The wait on the stream's mark fails (the legacy stream's is the first): the whole stream,
    // through an event recorded there now — the first record from here on.
    model.fail_nth(DriverCall::EventSynchronize, 2, CuError::UNKNOWN);
    model.begin_capture_before(
        &[DriverCall::EventRecord],
        1,
        stream,
        CaptureMode::ThreadLocal,
    );
    let releasing = match releasing.wait().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        other => panic!("stuck while the capture is open: {:?}", other.map(drop)),
    };
    assert!(
        matches!(info(&model, stream), CaptureInfo::Active { .. }),
        "the capture begun at the record is still valid"
    );
    assert_eq!(
        model.count(DriverCall::StreamSynchronize),
        0,
        "the capturing stream was never synchronized"
    );
    assert_eq!(
        model.count(DriverCall::EventSynchronize) - waits,
        2,
        "the captured event was never waited on (the two are the fence's marks)"
    );
    let releasing = match releasing.wait().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        other => panic!("held while the capture is open: {:?}", other.map(drop)),
    };
    // A query or wait of the captured event, or a synchronize of its stream, would have
    // invalidated the capture (facts 39, 41).
    assert_eq!(
        model.end_capture(stream),
        Ok(()),
        "neither invalidated nor joined"
    );
    model.complete_work();
    releasing.wait().map(drop).unwrap();
    assert_eq!(model.lost_with(), None, "nothing ran on unmapped memory");
}

/// The fourth site's last resort, a known window: where no event can be made for that wait,
/// memtoken asks whether the stream captures, then synchronizes it; a capture another thread
/// begins in between is refused the synchronize and invalidated by it (fact 41) — no driver
/// call closes that window. What is kept: memtoken gets the error, the release is stuck, never
/// lost, nothing is unmapped, and it completes once the capture has ended. Asserted as it is,
/// named so.
#[test]
fn a_capture_begun_between_the_check_and_a_last_resort_stream_synchronize_is_invalidated_but_nothing_is_unmapped()
 {
    let model = slow_model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(G).unwrap().commit().unwrap();
    model.complete_work();
    model.submit_work_touching(stream, &[(x.addr() as u64, G)]);
    let releasing = x.release();
    // The wait on the stream's mark fails, and no event can be made for the whole stream.
    model.fail_nth(DriverCall::EventSynchronize, 2, CuError::UNKNOWN);
    model.fail_nth(DriverCall::EventCreate, 1, CuError::OUT_OF_MEMORY);
    model.begin_capture_before(
        &[DriverCall::StreamSynchronize],
        1,
        stream,
        CaptureMode::ThreadLocal,
    );
    let releasing = match releasing.wait().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        other => panic!("stuck while the capture is open: {:?}", other.map(drop)),
    };
    assert_eq!(
        model.end_capture(stream),
        Err(CuError::STREAM_CAPTURE_INVALIDATED),
        "the known window: the synchronize invalidated the capture begun in it"
    );
    model.complete_work();
    releasing.wait().map(drop).unwrap();
    assert_eq!(model.lost_with(), None, "nothing ran on unmapped memory");
}

/// `forget_stream` records an event on the stream and asks it: after the record it asks the
/// stream again, and a capture another thread began between the check and the record (the
/// model's hook) took the event — never asked while that capture is open, and the stream is
/// not let go. Fails without the question after the record: the query (907) invalidated the
/// capture.
#[test]
fn a_capture_begun_between_forget_streams_check_and_record_is_never_asked() {
    let model = model();
    common::known_device!(model, device, stream);
    model.begin_capture_before(
        &[DriverCall::EventRecord],
        1,
        stream,
        CaptureMode::ThreadLocal,
    );
    assert!(
        !device.forget_stream(stream),
        "not forgotten while it captures"
    );
    assert!(
        info(&model, stream).captures(),
        "the hook began the capture"
    );
    assert_eq!(
        model.end_capture(stream),
        Ok(()),
        "the captured event was never asked: the capture ends valid"
    );
    assert!(device.forget_stream(stream), "let go once it has ended");
}

/// A launch of memtoken's graph asks whether its stream captures, launches, and asks again: a
/// capture another thread began in between (cudarc's safe `begin_capture`, the model's hook)
/// took the graph's work into a graph memtoken does not know of, so what memtoken's graph uses
/// is held for good — after memtoken's graph drops, the release is quarantined and the other
/// party's graph runs on mapped memory. Fails without the question after the launch: the
/// release unmapped, and that launch faulted (700).
#[test]
fn a_capture_begun_between_a_launchs_check_and_the_launch_holds_the_memory_for_good() {
    memtoken_capture!(model, device, stream, binding, x, capture);
    let mut view = capture.view_mut::<u8>(&mut x).unwrap();
    model.submit_work_touching(stream, &[(view.device_ptr_mut(), G)]);
    drop(view);
    let graph = capture.end().unwrap();
    model.begin_capture_before(&[DriverCall::GraphLaunch], 1, stream, CaptureMode::Global);
    graph.launch().unwrap();
    // The other party ends its capture, and keeps its graph (memtoken's work in it).
    // SAFETY: a live stream of the model's context that captures; the graph is the model's.
    let exec = unsafe {
        let g = model.stream_end_capture(stream).unwrap();
        model.graph_instantiate(g).unwrap()
    };
    drop(graph);
    model.complete_work();
    let released = x.release().complete().map(drop);
    let e = released.expect_err("the memory a foreign capture took stays held");
    assert!(matches!(e.token, Returned::Quarantined(_)));
    // SAFETY: the model's own live instance; its memory is still mapped.
    unsafe { model.graph_launch(exec, stream) }.unwrap();
    model.complete_work();
    assert_eq!(model.lost_with(), None, "the graph ran on mapped memory");
}

/// What no probe closes, asserted as documented: the handoff's wait itself. After the record
/// on the earlier stream both streams are asked again; a capture another thread begins on the
/// *waiting* stream between that question and `cuStreamWaitEvent` makes it wait, while
/// capturing, on an event recorded outside the capture — the driver refuses that (905) and
/// invalidates the capture. Nothing is joined and nothing is unmapped: the view's pointer,
/// taken while the stream captures, holds the memory for good. Fails if memtoken stops asking
/// again after the record (then the stream would be joined) or the window closes (then this
/// test, and the guarantee, should say more).
#[test]
fn a_capture_begun_on_the_waiting_stream_after_the_second_question_is_invalidated_never_joined() {
    let model = model();
    common::covered_device!(model, device, a);
    let b = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(b) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut x = binding.reserve(G).unwrap().commit().unwrap();
    {
        let mut on_a = x.stream_view_mut::<u8>(a).unwrap();
        model.submit_work_touching(a, &[(on_a.device_ptr_mut(), G)]);
    }
    model.begin_capture_before(
        &[DriverCall::StreamWaitEvent],
        1,
        b,
        CaptureMode::ThreadLocal,
    );
    {
        let on_b = x.stream_view::<u8>(b).unwrap();
        model.submit_work_touching(b, &[(on_b.device_ptr(), G)]);
    }
    assert!(info(&model, b).captures(), "the hook began the capture");
    assert_eq!(info(&model, a), CaptureInfo::None, "`a` joined nothing");
    assert_eq!(
        model.end_capture(b),
        Err(CuError::STREAM_CAPTURE_INVALIDATED),
        "the known window: the wait invalidated the capture begun before it"
    );
    model.complete_work();
    let released = x.release().complete().map(drop);
    let e = released.expect_err("the pointer taken during the capture holds the memory");
    assert!(matches!(e.token, Returned::Quarantined(_)));
    assert_eq!(model.lost_with(), None);
}
