//! The KV cache when its memory is held for good — a failed unmap, a plane viewed under a
//! capture memtoken did not make, a memtoken graph taken into one or forgotten — and under random
//! map and unmap faults across replenish, sleep and wake: no block is lost or handed out twice,
//! every block held while awake is mapped, a pinned group is reported once, what a foreign graph
//! may use stays mapped, and the ledger ends at zero. (Found by a second review that broke the
//! first five.)
use crate::common::{self, setup};
use memtoken::backend::cuda::{CaptureMode, Driver, DriverCall};
use memtoken::backend::doubles::FaultHandle;
use memtoken::backend::{Backend, HostBackend, Op};
use memtoken::kv::{KvCache, KvError, Layout};
use memtoken::{Budget, interop::Capture, make_guard};

/// One plane, one granule a group: an unmap in replenish that fails leaves the group mapped
/// whole, and its blocks free again (not an idle group with an empty free list, which would
/// make replenish map nothing and push fail).
#[test]
fn a_group_nothing_of_which_could_be_unmapped_hands_its_blocks_out_again() {
    setup!(HostBackend::with_defaults().unwrap(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(2048)).unwrap();
    assert_eq!(cache.blocks_per_group(), 2);
    cache.set_watermarks(2, 2);
    cache.replenish().unwrap(); // groups 1 and 2 mapped, idle
    assert_eq!(cache.idle_groups(), 2);
    cache.set_watermarks(1, 1);
    faults.fail_nth(Op::Unmap, 1);
    let e = cache.replenish();
    assert!(matches!(e, Err(KvError::Unmap { group: 2, .. })), "{e:?}");
    let mut t = cache.table();
    while cache.push(&mut t).is_ok() {}
    cache.replenish().unwrap();
    let p = cache.push(&mut t);
    assert!(
        p.is_ok(),
        "push after a successful replenish with low 1: {p:?}"
    );
}

/// The same without fault injection: a single-plane cache whose plane was viewed under a
/// foreign capture (held for good). Its idle groups can never be given back, yet the cache
/// goes on handing out their blocks.
#[test]
fn a_single_plane_held_for_good_keeps_handing_out_blocks() {
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(4, 4);
    cache.replenish().unwrap();
    model.begin_capture(stream, CaptureMode::Global);
    let view = cache.plane_view::<u8>(0, stream).unwrap();
    let ptr = view.device_ptr();
    drop(view);
    model.submit_work_touching(stream, &[(ptr, 4 << 21)]);
    model.end_capture(stream).unwrap();
    cache.set_watermarks(0, 0);
    assert!(matches!(cache.replenish(), Err(KvError::Unmap { .. })));
    cache.set_watermarks(1, 1);
    let mut t = cache.table();
    while cache.push(&mut t).is_ok() {}
    let mut pushed = 0;
    for _ in 0..4 {
        cache.replenish().unwrap(); // the pinned groups are not reported again
        let p = cache.push(&mut t);
        pushed += usize::from(p.is_ok());
    }
    assert!(pushed > 0, "the cache never hands out a block again");
}

/// A memtoken graph over the KV planes launched while another thread begins a capture on its
/// stream (the model's hook): the foreign graph holds the launch's work, so the planes are held
/// for good — sleep leaves them mapped, and the foreign graph launches without a fault.
#[test]
fn a_kv_graph_launched_into_a_foreign_capture_holds_the_planes_for_good() {
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.replenish().unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    let b = u64::from(table.ids()[0]);
    let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
    let planes = capture.kv_planes(&cache);
    let at = planes.device_ptr(0) + b * cache.stride(0) as u64;
    model.submit_work_touching(stream, &[(at, cache.stride(0))]);
    drop(planes);
    let graph = capture.end().unwrap();
    model.begin_capture_before(&[DriverCall::GraphLaunch], 1, stream, CaptureMode::Global);
    graph.launch().unwrap();
    // SAFETY: a live stream of the model's context that captures.
    let exec = unsafe {
        let g = model.stream_end_capture(stream).unwrap();
        model.graph_instantiate(g).unwrap()
    };
    drop(graph);
    model.complete_work();
    let slept = cache.sleep();
    assert!(matches!(slept, Err(KvError::Unmap { .. })), "{slept:?}");
    // SAFETY: the model's own live instance.
    unsafe { model.graph_launch(exec, stream) }.unwrap();
    model.complete_work();
    assert_eq!(
        model.lost_with(),
        None,
        "the foreign graph read unmapped KV planes"
    );
}

/// A memtoken capture that lent the KV planes, forgotten, and ended by another party: what it
/// lent stays held for good (held from the lend until memtoken's own end), so sleep leaves the
/// planes mapped for the other party's graph.
#[test]
#[cfg_attr(
    miri,
    ignore = "forgets a capture on purpose (what it lent is held for good): Miri reports it as a leak"
)]
fn kv_planes_lent_to_a_forgotten_capture_are_held_for_good() {
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.replenish().unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    let b = u64::from(table.ids()[0]);
    let capture = Capture::begin(&device, stream, CaptureMode::Relaxed).unwrap();
    let planes = capture.kv_planes(&cache);
    let at = planes.device_ptr(0) + b * cache.stride(0) as u64;
    model.submit_work_touching(stream, &[(at, cache.stride(0))]);
    drop(planes);
    std::mem::forget(capture);
    // SAFETY: a live stream of the model's context that captures.
    let exec = unsafe {
        let g = model.stream_end_capture(stream).unwrap();
        model.graph_instantiate(g).unwrap()
    };
    let slept = cache.sleep();
    assert!(matches!(slept, Err(KvError::Unmap { .. })), "{slept:?}");
    // SAFETY: the model's own live instance.
    unsafe { model.graph_launch(exec, stream) }.unwrap();
    model.complete_work();
    assert_eq!(
        model.lost_with(),
        None,
        "the foreign graph read unmapped KV planes"
    );
}

/// Drop while asleep, with a partial group (an unmap failed in sleep), and after a failed wake:
/// budget and ledger back to zero.
#[test]
fn a_cache_dropped_asleep_with_partial_groups_leaves_the_ledger_at_zero() {
    for (unmap_nth, map_nth) in [(Some(4), None), (Some(3), Some(2)), (None, Some(3))] {
        setup!(HostBackend::with_defaults().unwrap(), device, faults);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let cache = KvCache::new(
            cache_guard,
            &binding,
            &Layout::new(64, 16).plane(2048).plane(2048),
        )
        .unwrap();
        cache.set_watermarks(2, 2);
        cache.replenish().unwrap();
        let mut table = cache.table();
        for _ in 0..3 {
            cache.push(&mut table).unwrap();
        }
        if let Some(n) = unmap_nth {
            faults.fail_nth(Op::Unmap, n);
        }
        let _ = cache.sleep(); // fails or not: the drop below must leave nothing either way
        if let Some(n) = map_nth {
            faults.fail_nth(Op::Map, n);
            let _ = cache.wake();
        }
        drop(table);
        drop(cache);
        assert_eq!(binding.used(), 0);
        drop(binding);
        assert!(device.close().is_clean());
    }
}

/// A replenish that fails to unmap a group halfway (no live block), then sleep and wake: the
/// group is never handed out while partial; the ledger ends at zero.
#[test]
fn a_partial_idle_group_across_sleep_and_wake_is_mapped_whole_or_given_back() {
    setup!(HostBackend::with_defaults().unwrap(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(
        cache_guard,
        &binding,
        &Layout::new(64, 16).plane(2048).plane(2048),
    )
    .unwrap();
    cache.set_watermarks(3, 3);
    cache.replenish().unwrap(); // groups 1..=3
    cache.set_watermarks(1, 1);
    // unmap group 3 plane 0 (#1) ok, plane 1 (#2) fails -> partial
    faults.fail_nth(Op::Unmap, 2);
    let e = cache.replenish();
    assert!(matches!(e, Err(KvError::Unmap { .. })), "{e:?}");
    faults.fail_nth(Op::Unmap, 1);
    let s = cache.sleep();
    assert!(matches!(s, Err(KvError::Unmap { .. })), "{s:?}");
    cache.wake().unwrap();
    let mut t = cache.table();
    while cache.push(&mut t).is_ok() {}
    for pos in 0..t.len() {
        for p in 0..2 {
            t.write(p, pos, 0, b"x").expect("mapped");
        }
    }
    for _ in 0..3 {
        let _ = cache.replenish(); // a partial group may fail to go again: not the point here
        while cache.push(&mut t).is_ok() {}
    }
    for pos in 0..t.len() {
        for p in 0..2 {
            t.write(p, pos, 0, b"x").expect("mapped");
        }
    }
    drop(t);
    drop(cache);
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Two planes, plane 0 held for good by a foreign capture: the group left partial is pinned —
/// reported once, not by every later replenish of an ordinary step loop.
#[test]
fn a_held_plane_is_reported_once_not_by_every_replenish() {
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(3, 3);
    cache.replenish().unwrap();
    model.begin_capture(stream, CaptureMode::Global);
    let view = cache.plane_view::<u8>(0, stream).unwrap();
    let ptr = view.device_ptr();
    drop(view);
    model.submit_work_touching(stream, &[(ptr, 4 << 21)]);
    model.end_capture(stream).unwrap();
    model.complete_work();
    cache.set_watermarks(1, 2);
    let mut errors = 0;
    for _ in 0..10 {
        let mut t = cache.table();
        cache.push(&mut t).unwrap();
        drop(t);
        let r = cache.replenish();
        model.complete_work();
        errors += usize::from(r.is_err());
    }
    assert!(errors <= 1, "{errors} of 10 replenishes failed");
}

/// 60 random steps on `cache` — pushes, clears, replenishes, watermarks, sleeps and wakes, a
/// map or an unmap planned to fail (`faults`), and what `other` does with the rest of the
/// draw — checking after each that no block is in two tables nor the null block handed out,
/// and that while the cache is awake every block a table holds is mapped in every plane.
fn random_steps<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    faults: &FaultHandle,
    rng: &mut common::Rng,
    seed: u64,
    mut other: impl FnMut(u64),
) {
    let planes = cache.layout().planes().len();
    let mut tables: Vec<_> = (0..3).map(|_| cache.table()).collect();
    let mut log = Vec::new();
    for step in 0..60 {
        let op = rng.below(13);
        log.push(op);
        match op {
            0..=3 => {
                let t = rng.below(3) as usize;
                for _ in 0..rng.below(4) {
                    let _ = cache.push(&mut tables[t]);
                }
            }
            4 => cache.clear(&mut tables[rng.below(3) as usize]),
            5 | 6 => drop(cache.replenish()),
            7 => {
                let lo = rng.below(3) as usize;
                cache.set_watermarks(lo, lo + rng.below(3) as usize);
            }
            8 if rng.below(2) == 0 => drop(cache.sleep()),
            8 => drop(cache.sleep_saving()),
            9 => drop(cache.wake()),
            10 => faults.fail_nth(Op::Map, 1 + rng.below(6)),
            11 => faults.fail_nth(Op::Unmap, 1 + rng.below(6)),
            _ => other(rng.next()),
        }
        let mut all: Vec<u32> = tables.iter().flat_map(|t| t.ids().to_vec()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len(),
            n,
            "seed {seed} step {step}: a block in two tables {log:?}"
        );
        assert!(!all.contains(&0), "seed {seed}: null block handed out");
        if cache.is_asleep() {
            continue;
        }
        for t in &mut tables {
            for pos in 0..t.len() {
                for p in 0..planes {
                    let w = t.write(p, pos, 0, b"x");
                    assert!(
                        w.is_ok(),
                        "seed {seed} step {step}: held block {} plane {p} unmapped: {w:?} {log:?}",
                        t.ids()[pos]
                    );
                }
            }
        }
    }
    faults.clear();
}

/// A layout of 1 to 3 planes whose bytes per block `rng` draws from `sizes`.
fn random_layout(rng: &mut common::Rng, blocks: usize, sizes: [usize; 4]) -> Layout {
    (0..1 + rng.below(3)).fold(Layout::new(blocks, 16), |l, _| {
        l.plane(sizes[rng.below(4) as usize])
    })
}

/// Random pushes, clears, replenishes, sleeps and wakes with injected map and unmap failures
/// on the host (`random_steps`); the budget and the ledger end at zero.
#[test]
fn random_faults_on_the_host_lose_nothing() {
    for seed in 1..=common::seeds(399, 2) {
        let mut rng = common::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        setup!(HostBackend::with_defaults().unwrap(), device, faults);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let layout = random_layout(&mut rng, 16, [1024, 2048, 4096, 8192]);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        random_steps(&cache, &faults, &mut rng, seed, |_| {});
        drop(cache);
        assert_eq!(binding.used(), 0, "seed {seed}: budget");
        drop(binding);
        assert!(device.close().is_clean(), "seed {seed}: close");
    }
}

/// The same on the driver model, where kernels run on a covered stream and complete only when
/// the test says (a fence waits), among the random steps.
#[test]
fn random_faults_on_the_driver_model_lose_nothing() {
    for seed in 1..=common::seeds(299, 2) {
        let model = common::held_fences();
        let stream = model.new_stream();
        let mut rng = common::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let cuda = common::cuda(&model);
        // SAFETY: the model's stream, live as long as the model.
        unsafe { cuda.cover_stream(stream) };
        setup!(cuda, device, faults);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let layout = random_layout(&mut rng, 64, [16 << 10, 64 << 10, 128 << 10, 1 << 20]);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        random_steps(&cache, &faults, &mut rng, seed, |r| {
            if r % 2 == 0 {
                model.complete_work();
            } else {
                model.submit_work_on(stream);
            }
        });
        drop(cache);
        model.complete_work();
        assert_eq!(binding.used(), 0, "seed {seed}: budget");
        drop(binding);
        assert!(device.close().is_clean(), "seed {seed}: close");
    }
}
