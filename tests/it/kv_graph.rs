//! Graphs over the KV cache on the driver model: captured through memtoken's `Capture`, a graph
//! borrows the cache, not its mappings — it launches before and after the cache grows, shrinks
//! and sleeps, never faulting, and a launch while the cache sleeps is refused.

use crate::common;
use memtoken::backend::cuda::CaptureMode;
use memtoken::backend::{Cause, Violation};
use memtoken::kv::{KvCache, KvError, Layout};
use memtoken::{Budget, interop::Capture, make_guard};

#[test]
fn a_graph_over_the_planes_launches_across_grow_shrink_and_sleep_and_is_refused_asleep() {
    let model = common::held_fences();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(4096, 16).plane(64 << 10).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(1, 1);
    cache.replenish().unwrap();
    let stride = cache.stride(0);
    let mut decode = cache.table();
    for _ in 0..3 {
        // (Under Miri the model's granule is one block: a group each.)
        if cache.push(&mut decode).is_err() {
            cache.replenish().unwrap();
            cache.push(&mut decode).unwrap();
        }
    }
    let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
    let planes = capture.kv_planes(&cache);
    assert_eq!((planes.len(), planes.is_empty()), (2, false));
    assert_eq!(planes.device_ptr(1), cache.base(1) as u64);
    // The captured kernel reads the decode table's blocks in both planes.
    let reads: Vec<(u64, usize)> = (0..planes.len())
        .flat_map(|p| {
            let base = planes.device_ptr(p);
            decode
                .ids()
                .iter()
                .map(move |&b| (base + u64::from(b) * stride as u64, stride))
        })
        .collect();
    model.submit_work_touching(stream, &reads);
    let graph = capture.end().unwrap();
    assert!(
        format!("{graph:?}").starts_with("CapturedGraph"),
        "{graph:?}"
    );
    let no_fault = || assert_eq!(model.lost_with(), None, "the graph faulted");

    graph.launch().unwrap();
    model.complete_work();
    no_fault();
    // Grow: other sequences take blocks, groups are mapped, while the graph lives.
    let mapped = cache.mapped_groups();
    let mut others = cache.table();
    for _ in 0..200 {
        if cache.push(&mut others).is_err() {
            cache.replenish().unwrap();
            cache.push(&mut others).unwrap();
        }
    }
    assert!(cache.mapped_groups() > mapped, "grown");
    graph.launch().unwrap();
    no_fault();
    // Shrink under a running launch: the groups go only once the launch has completed.
    drop(others);
    cache.replenish().unwrap();
    let before = cache.mapped_groups();
    model.complete_work();
    no_fault();
    cache.replenish().unwrap();
    cache.replenish().unwrap();
    assert!(cache.mapped_groups() < before, "shrunk");
    graph.launch().unwrap();
    model.complete_work();
    no_fault();
    // Asleep: refused, nothing launched; awake: launches again.
    cache.sleep_saving().unwrap();
    let launches = model.count(memtoken::backend::cuda::DriverCall::GraphLaunch);
    let e = graph.launch().unwrap_err();
    assert!(
        matches!(e.cause, Cause::Violation(Violation::Asleep { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("wake it before launching"), "{e}");
    assert_eq!(
        model.count(memtoken::backend::cuda::DriverCall::GraphLaunch),
        launches
    );
    assert_eq!(cache.push(&mut cache.table()), Err(KvError::Asleep));
    cache.wake().unwrap();
    graph.launch().unwrap();
    model.complete_work();
    no_fault();
    drop(graph);
    drop(decode);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// One capture lends a token's view, held until its graph goes, and then the KV planes, let go
/// as the capture ends in memtoken's graph: once the graph is dropped the token releases
/// cleanly. Fails if ending the capture lets go the view's range in place of the planes' (the
/// token's unmap would then be refused for good, held by a capture). An open capture names its
/// stream, and its `Debug` shows the stream and that it is open.
#[test]
fn a_graph_over_a_view_and_the_planes_lets_go_of_the_view_as_it_drops() {
    let model = common::held_fences();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut x = binding.reserve(g).unwrap().commit().unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(4096, 16).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
    assert_eq!(capture.stream(), stream);
    let shown = format!("{capture:?}");
    assert!(
        shown.starts_with("Capture {")
            && shown.contains(&format!("{stream:#x}"))
            && shown.contains("open: true"),
        "{shown}"
    );
    let view = capture.view_mut::<u8>(&mut x).unwrap();
    model.submit_work_touching(stream, &[(view.device_ptr(), g)]);
    drop(view);
    let planes = capture.kv_planes(&cache);
    assert_eq!(planes.len(), 1);
    let graph = capture.end().unwrap();
    graph.launch().unwrap();
    drop(graph);
    model.complete_work();
    x.release()
        .complete()
        .expect("the view's range went with the graph");
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A plane's stream view taken while a capture memtoken did not make is open on its stream: the
/// plane may be in that graph, so it stays mapped for good — a give-back above the high
/// watermark leaves its groups mapped (withheld), where the same cache without the foreign
/// capture gives them back.
#[test]
fn a_plane_pointer_taken_in_a_foreign_capture_keeps_the_plane_mapped_for_good() {
    for foreign in [false, true] {
        let model = common::model();
        common::covered_device!(model, device, stream);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let layout = Layout::new(1024, 16).plane(64 << 10);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        cache.set_watermarks(4, 4);
        cache.replenish().unwrap();
        let mapped = cache.mapped_groups();
        if foreign {
            model.begin_capture(stream, CaptureMode::Global);
        }
        let view = cache.plane_view::<u8>(0, stream).unwrap();
        let ptr = view.device_ptr();
        drop(view);
        if foreign {
            model.submit_work_touching(stream, &[(ptr, 4 << 21)]);
            model.end_capture(stream).unwrap();
        }
        cache.set_watermarks(0, 0);
        let done = cache.replenish();
        if foreign {
            assert!(matches!(done, Err(KvError::Unmap { .. })), "{done:?}");
            assert_eq!(
                cache.mapped_groups(),
                mapped,
                "held for good: nothing unmapped"
            );
        } else {
            assert_eq!(done.unwrap().unmapped, mapped - 1);
            assert_eq!(cache.mapped_groups(), 1, "only the null block's group");
        }
        assert_eq!(model.lost_with(), None);
    }
}
