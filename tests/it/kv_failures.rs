//! The KV cache when maps and unmaps fail halfway, when a plane is held for good by a graph
//! memtoken does not hold, and when the GPU runs a step behind: a group left partly mapped is
//! never handed out and is mapped whole again (by `replenish` or `wake`); a half-failed sleep
//! wakes with every table valid; a shrink armed under a lagging GPU happens; the plain
//! mechanism fences only what was given back. (Found by a review that broke each of them.)
use crate::common::{self, setup};
use memtoken::backend::cuda::{CaptureMode, CudaBackend, DriverCall};
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::backend::{BackendError, HostBackend, Op};
use memtoken::kv::{KvCache, KvError, Layout};
use memtoken::{Budget, Device, make_guard};

/// A host device with fault injection (`$faults`), its binding, and a KV cache of 64 blocks of
/// 2 KiB in two planes: host granules are 4 KiB, so a group is 2 blocks, one granule per plane.
macro_rules! two_plane_host_cache {
    ($device:ident, $faults:ident, $binding:ident, $cache:ident) => {
        setup!(HostBackend::with_defaults().unwrap(), $device, $faults);
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let $cache = KvCache::new(
            cache_guard,
            &$binding,
            &Layout::new(64, 16).plane(2048).plane(2048),
        )
        .unwrap();
    };
}

/// A sleep whose unmap fails for one plane of a group with live blocks leaves the group partly
/// mapped; the wake-up maps the rest, so every block the table holds is mapped, and every
/// block handed out afterwards too.
#[test]
fn a_sleep_whose_unmap_fails_halfway_wakes_with_every_held_block_mapped() {
    two_plane_host_cache!(device, faults, binding, cache);
    assert_eq!(cache.blocks_per_group(), 2);
    cache.set_watermarks(2, 2);
    cache.replenish().unwrap();
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    assert_eq!(table.ids(), &[1, 2, 3]); // blocks 2 and 3: group 1
    for p in 0..2 {
        table.write(p, 1, 0, b"before").unwrap();
    }
    // Unmaps in sleep: group 0 plane 0 (#1), plane 1 (#2), group 1 plane 0 (#3), plane 1 (#4).
    faults.fail_nth(Op::Unmap, 4);
    let e = cache.sleep();
    assert!(matches!(e, Err(KvError::Unmap { group: 1, .. })));
    assert!(cache.is_asleep());
    cache.wake().unwrap();
    assert!(!cache.is_asleep());
    // Block 2 (group 1) is held by the table: mapped in both planes again.
    let write = table.write(0, 1, 0, b"after");
    // Give the blocks back (host: immediate) and take every free block: all mapped.
    cache.clear(&mut table);
    let mut again = cache.table();
    while cache.push(&mut again).is_ok() {}
    assert!(
        again.ids().iter().any(|&b| b >> 1 == 1),
        "group 1 is handed out again"
    );
    assert!(
        write.is_ok(),
        "a held block of an awake cache is not mapped: {write:?}"
    );
    for pos in 0..again.len() {
        for p in 0..2 {
            again
                .write(p, pos, 0, b"x")
                .expect("every block handed out is mapped");
        }
    }
}

/// A wake whose map fails on a group's second plane, and whose undo of the first plane fails
/// too, leaves the group partly mapped and the cache asleep; the next wake maps the rest and
/// copies the saved bytes back.
#[test]
fn a_wake_whose_map_and_undo_fail_wakes_at_the_next_call_with_its_bytes() {
    two_plane_host_cache!(device, faults, binding, cache);
    cache.set_watermarks(2, 2);
    cache.replenish().unwrap();
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    table.write(1, 1, 0, b"saved").unwrap();
    cache.sleep_saving().unwrap();
    // Wake maps group 0 (maps #1, #2), group 1 (#3 plane 0, #4 plane 1: fails); the undo
    // unmaps group 1 plane 0 (unmap #1: fails).
    faults.fail_nth(Op::Map, 4);
    faults.fail_nth(Op::Unmap, 1);
    let first = cache.wake();
    assert!(matches!(first, Err(KvError::Map { group: 1, .. })));
    let mut results = Vec::new();
    for _ in 0..3 {
        results.push(cache.wake());
    }
    assert!(
        results[0].is_ok(),
        "the next wake goes on from there: {results:?}"
    );
    assert_eq!(results[1..], [Err(KvError::Awake), Err(KvError::Awake)]);
    let mut got = [0; 5];
    table.read(1, 1, 0, &mut got).unwrap();
    assert_eq!(&got, b"saved");
}

/// A plane view taken under a foreign capture holds plane 0 for good: sleep unmaps plane 1 of
/// every group and leaves plane 0 mapped; the wake-up maps plane 1 back, so a kernel reading a
/// held block in plane 1 reads mapped memory.
#[test]
fn a_plane_held_by_a_foreign_capture_sleeps_partly_and_wakes_whole() {
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    // Room for three blocks also where a group is one block (Miri's smaller granule).
    cache.set_watermarks(3, 8);
    cache.replenish().unwrap();
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    model.begin_capture(stream, CaptureMode::Global);
    let view = cache.plane_view::<u8>(0, stream).unwrap();
    let ptr = view.device_ptr();
    drop(view);
    model.submit_work_touching(stream, &[(ptr, 64 << 10)]);
    model.end_capture(stream).unwrap();
    model.complete_work();
    assert!(matches!(cache.sleep(), Err(KvError::Unmap { .. })));
    cache.wake().unwrap();
    let write = table.write(1, 0, 0, b"kv");
    // A kernel reading the table's block in plane 1.
    let b = u64::from(table.ids()[0]);
    let at = cache.base(1) as u64 + b * cache.stride(1) as u64;
    model.submit_work_touching(stream, &[(at, 64 << 10)]);
    model.complete_work();
    assert!(write.is_ok(), "{write:?}");
    assert_eq!(
        model.lost_with(),
        None,
        "a kernel reading a held block faulted"
    );
}

/// A GPU running one step behind (each replenish sees the previous step's fence pending): the
/// shrink armed by the first replenish over the high watermark happens once that fence has
/// completed — it is not re-armed by every later one — and no fence is recorded for nothing.
#[test]
fn a_shrink_armed_under_a_gpu_one_step_behind_happens() {
    for lag in [false, true] {
        let model = common::held_fences();
        common::covered_device!(model, device, a);
        let b = model.new_stream();
        // SAFETY: a stream of the model's only context, live as long as the model.
        unsafe { device.cover_stream(b) };
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let cache = KvCache::new(
            cache_guard,
            &binding,
            &Layout::new(1024, 16).plane(64 << 10),
        )
        .unwrap();
        cache.set_watermarks(6, 6);
        cache.replenish().unwrap();
        let full = cache.mapped_groups();
        assert!(full > 2);
        cache.set_watermarks(0, 1);
        let mut fences = 0;
        for k in 0..20 {
            let s = if k % 2 == 0 { a } else { b };
            if lag {
                model.complete_work_on(s); // the step before the last one completes
            } else {
                model.complete_work();
            }
            model.submit_work_on(s);
            let done = cache.replenish().unwrap();
            fences += usize::from(done.fenced);
        }
        model.complete_work();
        assert!(
            cache.mapped_groups() <= 2,
            "lag {lag}: {} groups mapped",
            cache.mapped_groups()
        );
        assert!(
            fences <= 2,
            "lag {lag}: {fences} fences for nothing given back"
        );
        drop(cache);
        drop(binding);
    }
}

/// On the plain mechanism (planes whole) a replenish records no fence when no block was given
/// back.
#[test]
fn on_the_plain_mechanism_a_replenish_fences_only_what_was_given_back() {
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        events_complete_at_once: false,
        ..common::model_config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(256, 16).plane(64 << 10)).unwrap();
    let before = model.count(DriverCall::EventRecord);
    let mut fenced = 0;
    for _ in 0..10 {
        fenced += usize::from(cache.replenish().unwrap().fenced);
    }
    assert_eq!(fenced, 0);
    assert_eq!(model.count(DriverCall::EventRecord), before);
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    cache.clear(&mut table);
    assert!(
        cache.replenish().unwrap().fenced,
        "what was given back is fenced"
    );
}

/// A map failing on a later plane of a group whose planes differ in granules, its undo failing
/// too: the budget used equals the mapped bytes, and later replenishes map the group whole (it
/// is not stuck).
#[test]
fn a_map_failure_with_a_failed_undo_keeps_the_ledger_and_maps_whole_later() {
    for (map_nth, unmap_nth) in [(5, Some(1)), (3, Some(1))] {
        setup!(HostBackend::with_defaults().unwrap(), device, faults);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        // 4 KiB granule: plane 0 8 KiB per block (2 granules per 2-block group), plane 1 2 KiB
        // (1 granule per group) → 2 blocks a group.
        let cache = KvCache::new(
            cache_guard,
            &binding,
            &Layout::new(64, 16).plane(8192).plane(2048),
        )
        .unwrap();
        faults.fail_nth(Op::Map, map_nth);
        if let Some(n) = unmap_nth {
            faults.fail_nth(Op::Unmap, n);
        }
        let e = cache.replenish();
        assert!(matches!(e, Err(KvError::Map { group: 1, .. })), "{e:?}");
        let l = device.ledger();
        assert_eq!(binding.used(), l.mapped_bytes);
        cache.set_watermarks(1, 1);
        let again: Vec<_> = (0..3)
            .map(|_| cache.replenish().map(|d| d.mapped))
            .collect();
        let stuck = again.iter().all(Result::is_err);
        drop(cache);
        assert_eq!(binding.used(), 0, "budget back");
        drop(binding);
        assert!(device.close().is_clean());
        assert!(!stuck, "the cache can never map another group");
    }
}

/// A relaxed memtoken capture ended by another party: its graph is theirs, so the KV planes it
/// lent are held for good, whole, as everything a capture lends then — the cache's sleep
/// leaves every group mapped, not only those at the planes' first bytes. Fails if less than
/// each whole plane is held.
#[test]
fn kv_planes_in_a_capture_ended_elsewhere_are_held_for_good() {
    use memtoken::interop::Capture;
    let model = common::model();
    common::covered_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(4, 4);
    cache.replenish().unwrap();
    let mapped = cache.mapped_groups();
    assert!(mapped > 2, "groups past the first: {mapped}");
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    let capture = Capture::begin(&device, stream, CaptureMode::Relaxed).unwrap();
    let planes = capture.kv_planes(&cache);
    let whole = cache.stride(0) * cache.blocks();
    model.submit_work_touching(stream, &[(planes.device_ptr(0), whole)]);
    model.end_capture(stream).unwrap(); // another thread ends it: the graph is theirs
    let ended = capture.end();
    assert!(ended.is_err());
    drop(ended);
    model.complete_work();
    let s = cache.sleep();
    assert!(
        s.is_err(),
        "the planes a foreign graph may use were unmapped"
    );
    assert_eq!(
        cache.mapped_groups(),
        mapped,
        "held for good: nothing unmapped"
    );
}

/// A give-back over the high watermark once the context is known lost makes no driver call,
/// and leaves every group as it was — mapped, its free blocks still free — for the discharge.
/// Fails if the cache empties a group's free list, or calls the driver, before it learns the
/// context is gone; the error names the group's memory in the first plane. A map after it names
/// the memory it could not map. Fails if the give-back does not ask first whether the context
/// lives (`KvCache::ensure_live` → `Ok(())`: each plane's unmap is refused in turn, and the
/// error names the last plane's memory).
#[test]
fn a_give_back_after_the_context_is_lost_calls_nothing_and_keeps_the_groups() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    // Two planes: an unmap that went ahead plane by plane would name the last plane's memory.
    let layout = Layout::new(1024, 16).plane(64 << 10).plane(64 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(4, 4);
    cache.replenish().unwrap();
    let (mapped, free) = (cache.mapped_groups(), cache.free_blocks());
    model.lose_context();
    assert!(
        binding.reserve(4096).is_err(),
        "the backend learns of the loss"
    );
    let before = model.calls_after_loss();
    cache.set_watermarks(0, 0);
    // Each error names the group's memory: its first granule in plane 0, and all of them.
    let names_the_group = |group: usize, cause: &BackendError| {
        assert!(cause.is_context_lost(), "{cause}");
        let first = group * cache.blocks_per_group();
        assert_eq!(
            (cause.addr, cause.len),
            (
                cache.block_addr(0, first as u32),
                cache.blocks_per_group() * (64 << 10)
            ),
            "{cause}"
        );
    };
    let Err(KvError::Unmap { group, cause }) = cache.replenish() else {
        panic!("no group can be given back");
    };
    names_the_group(group, &cause);
    assert_eq!(model.calls_after_loss(), before, "no call after the loss");
    assert_eq!((cache.mapped_groups(), cache.free_blocks()), (mapped, free));
    // A map names the memory it could not map.
    cache.set_watermarks(8, 8);
    let Err(KvError::Map { group, cause }) = cache.replenish() else {
        panic!("no group can be mapped");
    };
    let memtoken::errors::CommitFailure::Backend(cause) = *cause else {
        panic!("not the backend's refusal: {cause}");
    };
    names_the_group(group, &cause);
    assert_eq!(model.calls_after_loss(), before, "no call after the loss");
    cache.check_blocks().unwrap();
    drop(cache);
    let proof = device.confirm_context_lost().expect("the context is lost");
    device.discharge_all(&proof);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A group whose map fails halfway gives the granules it took from the device's granule cache
/// back to that cache, not to the backend: the cache loses only what the groups mapped whole
/// hold, and nothing is released. Fails if an undone growth releases granules that came from
/// the cache.
#[test]
fn a_failed_map_gives_the_granules_it_took_from_the_cache_back_to_it() {
    setup!(HostBackend::with_defaults().unwrap(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    // 4 KiB granules and 8 KiB blocks: a group is two granules.
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(8192)).unwrap();
    let per_group = 2 * 4096;
    cache.set_watermarks(3, 3);
    cache.replenish().unwrap();
    cache.set_watermarks(1, 1);
    cache.replenish().unwrap(); // groups' granules into the device's cache
    let (cached, groups) = (device.cached_bytes(), cache.mapped_groups());
    assert!(cached >= 2 * per_group, "granules in the cache: {cached}");
    let released = faults.calls(Op::Release);
    faults.fail_nth(Op::Map, 2); // a group's second granule
    cache.set_watermarks(3, 3);
    assert!(matches!(cache.replenish(), Err(KvError::Map { .. })));
    let whole = (cache.mapped_groups() - groups) as u64;
    assert_eq!(
        device.cached_bytes(),
        cached - whole * per_group,
        "the failed group's granules back in the cache"
    );
    assert_eq!(faults.calls(Op::Release), released, "nothing released");
    cache.check_blocks().unwrap();
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A group whose map fails after it took one granule from the device's cache and created
/// one gives the cached granule back to the cache and releases the created one: unmapping from
/// the top, the created granule's release comes between the two unmaps. Kills `src/kv/plane.rs:
/// replace match guard k < from_cache with true in map_granules`, which caches the created
/// granule in the room made for the cached one and releases the cached one instead.
#[test]
fn a_failed_map_releases_what_it_created_and_caches_what_it_took() {
    let sim = common::sim(64 * common::GRANULE as u64);
    setup!(sim.clone(), device, faults);
    let g = common::GRANULE;
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    // Blocks of three granules in one plane: a group is one block.
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(8, 16).plane(3 * g)).unwrap();
    device.set_cache_cap(g as u64);
    cache.set_watermarks(2, 2);
    cache.replenish().unwrap();
    cache.set_watermarks(1, 1);
    cache.replenish().unwrap(); // a group goes: one granule cached, two released
    assert_eq!(device.cached_bytes(), g as u64, "setup: one cached");
    let groups = cache.mapped_groups();
    faults.fail_nth(Op::Create, 2); // the group's second new granule, its third
    let start = sim.calls().len();
    cache.set_watermarks(2, 2);
    assert!(matches!(cache.replenish(), Err(KvError::Map { .. })));
    assert_eq!(
        cache.mapped_groups(),
        groups,
        "the failed group is not mapped"
    );
    common::assert_created_released_then_cached_unmapped(&sim, start);
    assert_eq!(device.cached_bytes(), g as u64, "the cache keeps one");
    cache.check_blocks().unwrap();
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A cache of [`two_plane_host_cache!`] whose group over the high watermark is left partly
/// mapped: its unmap fails on the second plane. `$g` is the granularity, `$mapped` the bytes
/// mapped before (the null block's group and three idle ones, whole).
macro_rules! partly_mapped_group {
    ($device:ident, $faults:ident, $binding:ident, $cache:ident, $g:ident, $mapped:ident) => {
        two_plane_host_cache!($device, $faults, $binding, $cache);
        $cache.set_watermarks(3, 3);
        $cache.replenish().unwrap();
        let $g = $device.granularity() as u64;
        let $mapped = $device.ledger().mapped_bytes;
        assert_eq!(
            $mapped,
            2 * 4 * $g,
            "the null block's group and three idle, two planes each"
        );
        $cache.set_watermarks(0, 2);
        // The idle group over the high watermark: its plane 0 unmaps (#1), its plane 1 fails (#2).
        $faults.fail_nth(Op::Unmap, 2);
        let e = $cache.replenish();
        assert!(matches!(e, Err(KvError::Unmap { .. })), "{e:?}");
        assert_eq!($device.ledger().mapped_bytes, $mapped - $g, "partly mapped");
    };
}

/// A group left partly mapped by a failed unmap goes as the cache sleeps: nothing of the planes
/// stays mapped while it sleeps, and the wake maps what it held whole again. Fails if the sleep
/// leaves the partly mapped group's granule mapped.
#[test]
fn a_group_left_partly_mapped_goes_as_the_cache_sleeps() {
    partly_mapped_group!(device, faults, binding, cache, g, mapped);
    cache.sleep().unwrap();
    assert_eq!(device.ledger().mapped_bytes, 0, "mapped while asleep");
    cache.wake().unwrap();
    assert_eq!(
        device.ledger().mapped_bytes % (2 * g),
        0,
        "groups mapped whole"
    );
}

/// A group left partly mapped (no live block in it) goes at the next replenish, whatever the
/// watermarks (here no idle group is over the high one): what it still had mapped is
/// unmapped. Fails if a replenish gives back only the idle groups over the high watermark and
/// keeps the partly mapped one's granule mapped for as long as the cache is awake.
#[test]
fn a_group_left_partly_mapped_goes_at_the_next_replenish() {
    partly_mapped_group!(device, faults, binding, cache, g, mapped);
    let done = cache.replenish().unwrap();
    assert_eq!(done.unmapped, 1, "{done:?}");
    assert_eq!(
        device.ledger().mapped_bytes,
        mapped - 2 * g,
        "the partly mapped group's other plane"
    );
    assert_eq!(cache.mapped_groups(), 3);
    cache.check_blocks().unwrap();
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}
