//! The KV cache: block ids over one reservation per plane. Bytes written through a table are
//! where a kernel reads them — `base(p) + b × stride(p)`, read here by the host or the driver
//! model directly, not through the cache; tables in the forms kernels take; the hot path makes
//! no backend call, `replenish` at most one fence, and the mapped groups stay within the
//! watermark; a block given back waits for its fence; the plain mechanism allocates whole.

use crate::common::{self, Rng, says_first, setup};
use memtoken::backend::cuda::{CudaBackend, Driver, DriverCall};
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::backend::{Addr, Backend, HostBackend, Op};
use memtoken::kv::{BlockTable, KvCache, KvError, Layout, NULL_BLOCK};
use memtoken::{Budget, Device, make_guard};
use std::collections::HashSet;

/// Blocks written in the byte round trips (fewer under Miri).
const WRITES: usize = common::unless_miri(100_000, 300);
/// The same on the driver model, whose every copy is checked against its mappings: 20,000 (five
/// sweeps of the live blocks up to 7/8 of the cache and back, so every group is written), where
/// 100,000 took 6 s of an unoptimized build: two thirds of the suite's longest binary,
/// `tests/it`, and of each mutant's test run.
const MODEL_WRITES: usize = common::unless_miri(20_000, 300);
/// Takes and give-backs after warm-up in the call-count workloads (fewer under Miri).
const OPS: usize = common::unless_miri(10_000, 400);
/// The same on the driver model, whose every replenish Miri interprets call by call (400 ran
/// past 1,500 s there).
const MODEL_OPS: usize = common::unless_miri(OPS, 100);

/// Three planes that differ (a hybrid model's): 64 bytes a block back to back, 192 bytes in a
/// 256-byte stride, 96 bytes back to back. On a 4 KiB granule a group is 128 blocks (96-byte
/// strides share a granule every 128 blocks).
fn hybrid(blocks: usize) -> Layout {
    Layout::new(blocks, 16)
        .plane(64)
        .plane_with_stride(192, 256)
        .plane(96)
}

/// Block-sized planes for the driver model's 2 MiB granule: 64 KiB and 32 KiB per block.
fn model_layout(blocks: usize) -> Layout {
    Layout::new(blocks, 16).plane(64 << 10).plane(32 << 10)
}

/// What the test wrote into one block: per plane, an offset and the bytes.
type Written = Vec<(usize, Vec<u8>)>;

/// Random tables filled and cleared, the live blocks swept up to 7/8 of the cache and back five
/// times (takes come from the lowest group with room: with a steady few live blocks, as before,
/// only the first one or two groups were ever written); each block pushed gets random bytes at
/// a random offset in every plane, written through its table. Every write is read back at once, and every block's
/// bytes again before its table is cleared, by `read_at` at the address the test computes
/// itself — `base(p) + b × stride(p)` from the layout — so two blocks that overlapped, or a block
/// written where the formula does not put it, fail. Tables: ids below the cache's blocks, never
/// the null block, no id in two places; `ids_i32` the same numbers; slots as vLLM computes them.
fn round_trip<B: Backend>(
    cache: &KvCache<'_, '_, '_, B>,
    layout: &Layout,
    writes: usize,
    read_at: impl Fn(Addr, &mut [u8]),
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut tables: Vec<BlockTable<'_, '_, '_, '_, B>> = (0..8).map(|_| cache.table()).collect();
    let mut shadow: Vec<Vec<Written>> = vec![Vec::new(); tables.len()];
    let t = layout.block_tokens();
    let at = |p: usize, block: u32| cache.base(p) + block as usize * layout.planes()[p].stride;
    let check = |block: u32, written: &Written| {
        for (p, (offset, bytes)) in written.iter().enumerate() {
            let mut got = vec![0; bytes.len()];
            read_at(at(p, block) + offset, &mut got);
            assert_eq!(&got, bytes, "block {block}, plane {p}, at {offset}");
        }
    };
    let mut written = 0;
    let mut ops = 0u64;
    // The live blocks the test aims at after `written` writes: a triangle wave, five periods.
    let period = (writes / 5).max(2);
    let most = cache.blocks() * 7 / 8;
    let target = |written: usize| {
        let phase = written % period;
        most * phase.min(period - phase) / (period / 2)
    };
    let mut highest = 0;
    while written < writes {
        ops += 1;
        let i = rng.below(tables.len() as u64) as usize;
        if cache.live_blocks() <= target(written) {
            let block = match cache.push(&mut tables[i]) {
                Ok(block) => block,
                Err(KvError::NoRoom { .. }) => {
                    cache.replenish().unwrap();
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            let position = tables[i].len() - 1;
            let mut w = Written::new();
            for (p, plane) in layout.planes().iter().enumerate() {
                let len = 1 + rng.below(48) as usize;
                let offset = rng.below((plane.block_bytes - len + 1) as u64) as usize;
                let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                tables[i].write(p, position, offset, &bytes).unwrap();
                w.push((offset, bytes));
            }
            check(block, &w);
            shadow[i].push(w);
            written += 1;
            highest = highest.max(block);
        } else {
            for (&block, w) in tables[i].ids().iter().zip(&shadow[i]) {
                check(block, w);
            }
            cache.clear(&mut tables[i]);
            shadow[i].clear();
        }
        if ops.is_multiple_of(64) {
            cache.replenish().unwrap();
            let mut seen = HashSet::new();
            for table in &tables {
                let ids = table.ids();
                assert!(
                    ids.iter()
                        .all(|&b| b != NULL_BLOCK && (b as usize) < cache.blocks())
                );
                assert!(ids.iter().all(|&b| seen.insert(b)), "a block in two places");
                let as_i32: Vec<i32> = ids.iter().map(|&b| b as i32).collect();
                assert_eq!(table.ids_i32(), &as_i32[..]);
                if !ops.is_multiple_of(1024) {
                    continue; // the slots, less often: a table can hold thousands
                }
                let mut slots = Vec::new();
                table.slots(0..ids.len() * t, &mut slots);
                assert_eq!(slots.len(), ids.len() * t, "a slot per token");
                for (token, &slot) in slots.iter().enumerate() {
                    let expected = ids[token / t] as i64 * t as i64 + (token % t) as i64;
                    assert_eq!((table.slot(token), slot), (expected, expected));
                }
            }
            assert_eq!(cache.live_blocks(), seen.len());
        }
    }
    // Where a half period has writes enough to follow the wave (not Miri's few hundred).
    if period / 2 >= most {
        assert!(
            highest as usize >= most - cache.blocks_per_group(),
            "the sweeps wrote blocks up to {highest} of {} only",
            cache.blocks()
        );
    }
    for (table, shadow) in tables.iter_mut().zip(&shadow) {
        for (&block, w) in table.ids().iter().zip(shadow) {
            check(block, w);
        }
        cache.clear(table);
    }
}

#[test]
fn every_byte_written_through_a_table_is_at_base_plus_block_times_stride_on_the_host() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let layout = hybrid(4096);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    assert_eq!((cache.blocks_per_group(), cache.groups()), (128, 32));
    round_trip(&cache, &layout, WRITES, |addr, dst| {
        // SAFETY: the test reads only blocks its tables hold, so their groups are mapped
        // read-write for as long as this runs, and nothing writes them meanwhile.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, dst.len()) };
        dst.copy_from_slice(src);
    });
    assert_eq!(cache.live_blocks(), 0);
    drop(cache);
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(device.close().is_clean());
}

#[test]
fn every_byte_written_through_a_table_is_at_base_plus_block_times_stride_on_the_driver_model() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let layout = model_layout(1024);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    let g = common::MODEL_GRANULARITY;
    assert_eq!(cache.blocks_per_group(), g / (32 << 10));
    round_trip(&cache, &layout, MODEL_WRITES, |addr, dst| {
        // SAFETY: the test reads only blocks its tables hold: mapped readable.
        unsafe { model.memcpy_dtoh(dst, addr as u64) }.unwrap();
    });
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// The groups holding a block the test's tables hold, or gave back since the work was last
/// completed (a block waits for its fence), by block id.
fn groups_of<'a>(blocks: impl IntoIterator<Item = &'a u32>, per_group: usize) -> HashSet<usize> {
    blocks
        .into_iter()
        .map(|&b| b as usize / per_group)
        .collect()
}

/// A step's takes and give-backs: up to `most` blocks pushed into random tables, some tables
/// cleared. Returns the blocks given back.
fn step<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    tables: &mut [BlockTable<'_, 'c, 'b, 'id, B>],
    rng: &mut Rng,
    most: usize,
    ops: &mut usize,
) -> Vec<u32> {
    let mut given = Vec::new();
    for _ in 0..rng.below(most as u64 + 1) {
        let i = rng.below(tables.len() as u64) as usize;
        cache.push(&mut tables[i]).expect("between the watermarks");
        *ops += 1;
    }
    for table in tables.iter_mut() {
        if rng.below(4) == 0 {
            given.extend_from_slice(table.ids());
            *ops += table.len();
            cache.clear(table);
        }
    }
    given
}

/// After warm-up, 10,000 takes and give-backs between the watermarks: no backend call but in
/// `replenish`, at most one fence each, and after every step the mapped groups at most those
/// holding a live or fenced block, the null block's and the high watermark. On `Faulty` (its
/// call counters) over the host: every group given back at once.
#[test]
fn takes_and_give_backs_call_nothing_and_the_mapped_groups_follow_the_watermarks_on_the_host() {
    setup!(common::host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(8192, 16).plane(1024)).unwrap();
    let per_group = cache.blocks_per_group();
    assert_eq!(per_group, 4);
    cache.set_watermarks(2, 3);
    cache.replenish().unwrap();
    let mut tables: Vec<_> = (0..6).map(|_| cache.table()).collect();
    let mut rng = Rng(7);
    let mut ops = 0;
    let (mut most_mapped, mut replenishes) = (0, 0);
    while ops < OPS {
        let before = faults.any_calls();
        step(&cache, &mut tables, &mut rng, 2 * per_group, &mut ops);
        assert_eq!(
            faults.any_calls(),
            before,
            "a backend call outside replenish"
        );
        let fences = faults.calls(Op::Fence);
        cache.replenish().unwrap();
        replenishes += 1;
        assert!(faults.calls(Op::Fence) - fences <= 1, "more than one fence");
        let live = groups_of(tables.iter().flat_map(BlockTable::ids), per_group);
        let bound = live.len() + usize::from(!live.contains(&0)) + cache.watermarks().1;
        assert!(
            cache.mapped_groups() <= bound,
            "{} > {bound}",
            cache.mapped_groups()
        );
        assert!(cache.idle_groups() >= 2, "the low watermark");
        most_mapped = most_mapped.max(cache.mapped_groups());
    }
    assert!(
        replenishes > OPS / 100 && most_mapped > 4,
        "{replenishes} {most_mapped}"
    );
    drop(tables);
    cache.replenish().unwrap();
    assert!(cache.mapped_groups() <= 1 + 3);
    drop(cache);
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A replenish maps exactly the groups that bring the idle ones up to the low watermark — one
/// granule a group here — and a second replenish maps none. Fails if a replenish maps further
/// groups than the watermark asks (to give them back above the high one).
#[test]
fn a_replenish_maps_only_what_the_low_watermark_asks() {
    setup!(common::host(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(8192, 16).plane(1024)).unwrap();
    assert_eq!(cache.idle_groups(), 0, "only the null block's group");
    cache.set_watermarks(2, 3);
    let maps = faults.calls(Op::Map);
    cache.replenish().unwrap();
    assert_eq!(faults.calls(Op::Map) - maps, 2, "two groups of one granule");
    assert_eq!((cache.idle_groups(), cache.mapped_groups()), (2, 3));
    cache.replenish().unwrap();
    assert_eq!(faults.calls(Op::Map) - maps, 2, "nothing more");
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The same on the driver model, where a block given back waits for a fence: the work is
/// completed before each step, so the blocks given back in the step before are free after the
/// next replenish, and count as fenced until then. Calls counted on the model's own log.
#[test]
fn takes_and_give_backs_call_nothing_and_the_mapped_groups_follow_the_watermarks_on_the_model() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &model_layout(4096)).unwrap();
    let per_group = cache.blocks_per_group();
    cache.set_watermarks(2, 3);
    cache.replenish().unwrap();
    let mut tables: Vec<_> = (0..6).map(|_| cache.table()).collect();
    let mut rng = Rng(11);
    let mut ops = 0;
    while ops < MODEL_OPS {
        let before = model.log().len();
        let given = step(&cache, &mut tables, &mut rng, per_group, &mut ops);
        assert_eq!(model.log().len(), before, "a driver call outside replenish");
        let records = model.count(DriverCall::EventRecord);
        cache.replenish().unwrap();
        assert!(model.count(DriverCall::EventRecord) - records <= 1);
        // The fence just recorded covers them; the one before has completed.
        let fenced = given;
        let live = groups_of(
            tables.iter().flat_map(BlockTable::ids).chain(&fenced),
            per_group,
        );
        let bound = live.len() + usize::from(!live.contains(&0)) + cache.watermarks().1;
        assert!(
            cache.mapped_groups() <= bound,
            "{} > {bound}",
            cache.mapped_groups()
        );
    }
    drop(tables);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// A device over the driver model `$model` (made by `$new`), its binding, and a KV cache of
/// [`model_layout`]`(1024)` on it, nothing mapped yet. A macro, not a function: the cache
/// borrows the guard and the binding.
macro_rules! model_kv_cache {
    ($model:ident = $new:expr, $device:ident, $binding:ident, $cache:ident) => {
        let $model = $new;
        make_guard!(guard);
        let $device = Device::new(guard, common::cuda(&$model));
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let $cache = KvCache::new(cache_guard, &$binding, &model_layout(1024)).unwrap();
    };
}

/// A block given back while a kernel may still use it is not handed out again until the
/// kernel's work has completed and a replenish has seen its fence done; meanwhile other blocks
/// are, and the cache counts it cooling.
#[test]
fn a_block_given_back_under_a_running_kernel_waits_for_its_fence() {
    model_kv_cache!(model = common::held_fences(), device, binding, cache);
    cache.replenish().unwrap();
    let mut table = cache.table();
    let block = cache.push(&mut table).unwrap();
    model.submit_work(); // a kernel reading the block
    cache.clear(&mut table);
    assert_eq!(cache.cooling_blocks(), 1);
    let done = cache.replenish().unwrap();
    assert!(done.fenced && done.freed == 0);
    let mut others = cache.table();
    while cache.push(&mut others).is_ok() {}
    assert!(
        !others.ids().contains(&block),
        "handed out under the kernel"
    );
    let n = others.len();
    cache.clear(&mut others);
    cache.replenish().unwrap();
    assert_eq!(cache.cooling_blocks(), 1 + n);
    model.complete_work();
    let done = cache.replenish().unwrap();
    assert!(done.freed > 0 && cache.cooling_blocks() == 0, "{done:?}");
    while cache.push(&mut others).is_ok() {}
    assert!(
        others.ids().contains(&block),
        "free once its fence completed"
    );
    drop(others);
    drop(table);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// On a model whose work completes at once, the blocks given back are fenced by the next
/// replenish and freed by it at once, and it counts them freed. Fails if that count is lost.
#[test]
fn a_replenish_counts_the_blocks_its_own_fence_freed() {
    model_kv_cache!(model = common::model(), device, binding, cache);
    cache.replenish().unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    cache.push(&mut table).unwrap();
    cache.clear(&mut table);
    let done = cache.replenish().unwrap();
    assert!(done.fenced, "{done:?}");
    assert_eq!((done.freed, cache.cooling_blocks()), (2, 0), "{done:?}");
    drop(table);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The opening of the high-watermark tests: a cache over the held-fences model with four idle
/// groups mapped, then its watermarks lowered to (0, 1), so that the next replenish finds three
/// groups over the high one. A macro, not a function: the cache borrows the guard and the binding.
macro_rules! over_the_high_watermark {
    ($model:ident, $device:ident, $binding:ident, $cache:ident) => {
        model_kv_cache!($model = common::held_fences(), $device, $binding, $cache);
        $cache.set_watermarks(4, 4);
        $cache.replenish().unwrap();
        assert_eq!($cache.idle_groups(), 4);
        $cache.set_watermarks(0, 1);
    };
}

/// Groups over the high watermark go only once the work that may still use the planes has
/// completed: the replenish that finds them arms a fence, and they stay mapped through every
/// replenish while that work runs, then go. Fails if the groups are unmapped once armed,
/// whatever the fence says (under the kernel: the model would fault).
#[test]
fn groups_over_the_high_watermark_wait_for_the_work_before_the_fence_that_armed_them() {
    over_the_high_watermark!(model, device, binding, cache);
    model.submit_work(); // a kernel that may read the planes
    let unmaps = model.count(DriverCall::MemUnmap);
    for round in 0..3 {
        let done = cache.replenish().unwrap();
        assert_eq!(done.fenced, round == 0, "one fence, by the first: {done:?}");
        assert_eq!(done.unmapped, 0, "round {round}: unmapped under the kernel");
    }
    assert_eq!(model.count(DriverCall::MemUnmap), unmaps);
    model.complete_work();
    let done = cache.replenish().unwrap();
    assert_eq!((done.unmapped, cache.idle_groups()), (3, 1), "{done:?}");
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.lost_with(), None);
}

/// The groups over the high watermark go as soon as the fence that armed them has completed,
/// even while a fence recorded after it (for blocks given back later, over a stream whose work
/// still runs) has not. Fails if they wait for every fence, or only for the later ones.
#[test]
fn groups_over_the_high_watermark_go_once_their_fence_completes_while_a_later_one_waits() {
    over_the_high_watermark!(model, device, binding, cache);
    model.submit_work(); // on the legacy stream, before the arming fence
    let done = cache.replenish().unwrap();
    assert!(done.fenced && done.unmapped == 0, "{done:?}");
    // A stream every fence covers from now on (not the one that armed the groups), with a
    // kernel reading a block given back after the groups were armed.
    let later = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(later) };
    let mut table = cache.table();
    let block = cache.push(&mut table).unwrap();
    model.submit_work_touching(later, &[(cache.block_addr(0, block) as u64, 64 << 10)]);
    cache.clear(&mut table);
    let done = cache.replenish().unwrap();
    assert!(done.fenced && done.unmapped == 0, "{done:?}");
    model.complete_work_on(0);
    let idle = cache.idle_groups();
    assert!(idle > 1, "{idle} idle groups");
    let done = cache.replenish().unwrap();
    assert_eq!(
        (done.unmapped, cache.idle_groups(), cache.cooling_blocks()),
        (idle - 1, 1, 1),
        "block {block} still waits for its fence; {done:?}"
    );
    model.complete_work();
    cache.replenish().unwrap();
    assert_eq!(cache.cooling_blocks(), 0);
    drop(table);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.lost_with(), None);
}

/// With no room in a mapped group, a push fails with an error that says so, the table
/// unchanged; replenish maps more.
#[test]
fn a_push_with_no_room_fails_naming_replenish_with_the_table_unchanged() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(1024)).unwrap();
    // Only the null block's group is mapped: 3 blocks besides it.
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    let ids = table.ids().to_vec();
    let e = cache.push(&mut table).unwrap_err();
    says_first(&e, "no mapped group of the KV cache has a free block");
    assert!(e.to_string().contains("replenish()"), "{e}");
    assert_eq!(
        e,
        KvError::NoRoom {
            mapped: 1,
            groups: 16,
            cooling: 0
        }
    );
    assert_eq!(table.ids(), &ids[..]);
    cache.replenish().unwrap();
    cache.push(&mut table).unwrap();
}

/// On a device without virtual memory management the planes are allocated whole: every
/// group mapped from the start, the same ids and strides, bytes that round-trip, and a
/// replenish that maps nothing.
#[test]
fn without_vmm_the_cache_is_allocated_whole_with_the_same_ids() {
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let layout = model_layout(256);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    assert!(!cache.maps_on_demand());
    assert_eq!(cache.mapped_groups(), cache.groups());
    assert_eq!(cache.replenish().unwrap().mapped, 0);
    let mut table = cache.table();
    let ids: Vec<u32> = (0..5).map(|_| cache.push(&mut table).unwrap()).collect();
    assert_eq!(ids, [1, 2, 3, 4, 5]);
    table.write(1, 4, 100, b"plain").unwrap();
    let mut got = [0; 5];
    let at = cache.base(1) + 5 * (32 << 10) + 100;
    // SAFETY: block 5 of plane 1 is allocated.
    unsafe { model.memcpy_dtoh(&mut got, at as u64) }.unwrap();
    assert_eq!(&got, b"plain");
    for _ in 0..3 {
        for _ in 0..40 {
            cache.push(&mut table).unwrap();
        }
        cache.clear(&mut table);
        let done = cache.replenish().unwrap();
        assert_eq!(
            (done.mapped, done.unmapped),
            (0, 0),
            "every group stays mapped"
        );
        assert_eq!(cache.mapped_groups(), cache.groups());
    }
    drop(table);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Groups map on the host as on the model: a layout the host's 4 KiB granule splits into
/// groups, watermarks that map and give back, and the ledger at zero once the cache is gone.
/// A take comes from the lowest mapped group with a free block, whichever groups the blocks
/// given back before it were in: the blocks in use stay packed low, so the high groups empty
/// out for the high watermark to unmap. Fails if a block given back in a lower group is passed
/// over (a give-back that leaves the search to start above it).
#[test]
fn a_take_comes_from_the_lowest_group_with_a_free_block() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(1024, 16).plane(2048)).unwrap();
    cache.set_watermarks(3, 5);
    cache.replenish().unwrap();
    let per = cache.blocks_per_group();
    // A block a table, until three groups are full (the null block is the first group's).
    let mut tables: Vec<_> = (1..3 * per)
        .map(|_| {
            let mut table = cache.table();
            cache.push(&mut table).unwrap();
            table
        })
        .collect();
    let first = |table: &BlockTable<'_, '_, '_, '_, HostBackend>| table.ids()[0];
    let ids: Vec<u32> = tables.iter().map(first).collect();
    assert_eq!(
        ids,
        (1..3 * per as u32).collect::<Vec<_>>(),
        "taken in order"
    );
    // Given back: a block of the middle group, then one of the first, then one of the last.
    let order = [per, 0, 2 * per - 1];
    for &t in &order {
        cache.clear(&mut tables[t]);
    }
    for want in [ids[0], ids[per], ids[2 * per - 1]] {
        let mut table = cache.table();
        cache.push(&mut table).unwrap();
        assert_eq!(
            first(&table),
            want,
            "a take passed over a lower group's free block"
        );
        tables.push(table);
    }
    drop(tables);
    drop(cache);
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Groups map up to the low watermark and go back above the high one; a table of twenty blocks
/// says so (`len`, `is_empty`, its `Display`) and shows its ids (`Debug`). Fails if a table
/// says it is empty, or prints nothing.
#[test]
fn groups_map_to_the_low_watermark_and_go_back_above_the_high_one() {
    setup!(HostBackend::with_defaults().unwrap(), device, faults);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(1024, 16).plane(2048)).unwrap();
    assert_eq!((cache.blocks_per_group(), cache.mapped_groups()), (2, 1));
    cache.set_watermarks(3, 5);
    let done = cache.replenish().unwrap();
    assert_eq!(
        (done.mapped, cache.mapped_groups(), cache.idle_groups()),
        (3, 4, 3)
    );
    let maps = faults.calls(Op::Map);
    let mut table = cache.table();
    for _ in 0..20 {
        cache.push(&mut table).ok();
        cache.replenish().unwrap();
    }
    assert_eq!(table.len(), 20);
    assert!(!table.is_empty() && cache.table().is_empty());
    assert_eq!(table.to_string(), "a block table of 20 blocks");
    let shown = format!("{table:?}");
    let last = table.ids()[19];
    assert!(
        shown.starts_with("BlockTable { ids: [") && shown.contains(&format!(", {last}]")),
        "{shown}"
    );
    assert!(faults.calls(Op::Map) > maps);
    let mapped = cache.mapped_groups();
    drop(table);
    let done = cache.replenish().unwrap();
    assert_eq!(cache.idle_groups(), 5);
    assert_eq!(done.unmapped, mapped - 1 - 5);
    drop(cache);
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The smallest layout has 2 blocks (block 0 is the null block, so one to hand out): 2 are
/// accepted and hand out block 1, 1 is refused by name. Fails if 2 is refused too (`< 2` →
/// `<= 2`).
#[test]
fn a_cache_of_two_blocks_hands_out_one_and_one_block_is_refused() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(refused_guard);
    let refused = KvCache::new(refused_guard, &binding, &Layout::new(1, 16).plane(64));
    assert!(
        matches!(&refused, Err(KvError::Layout(why)) if why.starts_with("fewer than 2 blocks")),
        "{:?}",
        refused.err()
    );
    make_guard!(cache_guard);
    let layout = Layout::new(2, 16).plane(64);
    assert_eq!((layout.blocks(), layout.block_tokens()), (2, 16));
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.replenish().unwrap();
    let mut table = cache.table();
    assert_eq!(cache.push(&mut table).unwrap(), 1);
    assert_eq!(
        format!("{cache:?}"),
        format!(
            "KvCache {{ planes: 1, blocks: {}, mapped_groups: {}, live_blocks: 1, .. }}",
            cache.blocks(),
            cache.mapped_groups()
        ),
        "its Debug says what it holds"
    );
    cache.clear(&mut table);
    drop(table);
    drop(cache);
    drop(refused);
    drop(binding);
    assert!(device.close().is_clean());
}
