//! Hot paths, each measured side by side in one run against the hand-written equivalent on the
//! same backend: the zero-cost claim is the ratio `memtoken / raw`.
//!
//! - `block_cycle/{memtoken,raw,slab,malloc}`: take the 16 KV blocks of a 256-token sequence
//!   (16 tokens a block, two planes of 1 KiB a block) into a table and give them back, against
//!   the hand-written block cache (`common/raw_blocks.rs`), a slab and malloc.
//! - `granule_cycle/{memtoken,raw}`: reserve, commit, release one 4 KiB granule on the host.
//! - `region_cycle/{memtoken,raw}`: grow an elastic region by 16 granules and shrink it back,
//!   on the host, in steady state (every granule from the cache: no create or release).
//! - `sleep_wake/{memtoken,raw}`: suspend a 64 MiB allocation with its bytes saved to the host
//!   and resume it at the same address with its bytes, on the host.
//! - `block_scale/memtoken/N`: one block taken into a table and given back, with N blocks
//!   held.
//! - `gpu/...`: the cycles on a CUDA device, when one is present.
//!
//! `cargo run --release --bin bench_report` runs these and prints the ratios.

#[path = "../examples/common/granule.rs"]
mod granule;
#[path = "../examples/common/raw_blocks.rs"]
mod raw_blocks;
#[path = "../examples/common/region.rs"]
mod region;
#[path = "../examples/common/sleep.rs"]
mod sleep;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use memtoken::backend::{Backend, HostBackend, HostConfig};
use memtoken::kv::{KvCache, Layout as KvLayout};
use memtoken::{Binding, Budget, Device, make_guard};
use raw_blocks::RawBlocks;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;

/// The host's granule: the granule cycle's size.
const PAGE: usize = 4096;
/// A sequence's blocks per cycle.
const SEQ_BLOCKS: usize = 16;
/// Bytes per block in each of the two planes (K and V of one layer), as in
/// `examples/block_cycle.rs`.
const STRIDES: [usize; 2] = [1024, 1024];
/// Groups reserved, and mapped before the cycles.
const GROUPS: usize = 64;
const MAPPED: usize = 8;

/// A sequence's block table: 16 blocks pushed one by one as the sequence grows, then all given
/// back when it finishes. The table's storage is reused across iterations, as an engine would.
fn block_cycle_memtoken<B: Backend>(c: &mut Criterion, id: &str, binding: &Binding<'_, '_, B>) {
    let per_group = binding.device().granularity() / STRIDES[0];
    let layout = KvLayout::new(GROUPS * per_group, 16)
        .plane(STRIDES[0])
        .plane(STRIDES[1]);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, binding, &layout).unwrap();
    cache.set_watermarks(MAPPED - 1, GROUPS);
    cache.replenish().unwrap();
    let mut table = cache.table();
    c.bench_function(id, |b| {
        b.iter(|| {
            for _ in 0..SEQ_BLOCKS {
                cache.push(&mut table).unwrap();
            }
            black_box(table.ids());
            cache.clear(&mut table);
            // On a backend that is not immediate (CUDA) the blocks given back are free again
            // only after a replenish's fence: an engine's step makes one.
            if !B::IMMEDIATE {
                cache.replenish().unwrap();
            }
        })
    });
}

fn block_cycle_raw<B: Backend>(c: &mut Criterion, id: &str, backend: &B) {
    let mut cache = RawBlocks::new(backend, &STRIDES, GROUPS).unwrap();
    for group in 0..MAPPED {
        cache.map_group(group).unwrap();
    }
    let mut table: Vec<u32> = Vec::with_capacity(SEQ_BLOCKS);
    c.bench_function(id, |b| {
        b.iter(|| {
            for _ in 0..SEQ_BLOCKS {
                table.push(cache.take().unwrap());
            }
            black_box(table.as_slice());
            cache.give_back_all(&table);
            table.clear();
        })
    });
}

fn block_cycle(c: &mut Criterion) {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    block_cycle_memtoken(c, "block_cycle/memtoken", &binding);
    let raw = HostBackend::with_defaults().unwrap();
    block_cycle_raw(c, "block_cycle/raw", &raw);

    let mut slab = slab::Slab::<[u8; 0]>::with_capacity(SEQ_BLOCKS);
    let mut table = Vec::with_capacity(SEQ_BLOCKS);
    c.bench_function("block_cycle/slab", |b| {
        b.iter(|| {
            for _ in 0..SEQ_BLOCKS {
                table.push(slab.insert([]));
            }
            black_box(table.len());
            for k in table.drain(..) {
                slab.remove(k);
            }
        })
    });

    // Both planes' parts of a block: one allocation of their bytes each.
    let layout = Layout::from_size_align(STRIDES[0] + STRIDES[1], STRIDES[0]).unwrap();
    let mut table: Vec<*mut u8> = Vec::with_capacity(SEQ_BLOCKS);
    c.bench_function("block_cycle/malloc", |b| {
        b.iter(|| {
            for _ in 0..SEQ_BLOCKS {
                // SAFETY: `layout` has a non-zero size.
                let p = unsafe { System.alloc(layout) };
                assert!(!p.is_null());
                table.push(p);
            }
            black_box(table.len());
            for p in table.drain(..) {
                // SAFETY: allocated above with the same layout, freed once.
                unsafe { System.dealloc(p, layout) };
            }
        })
    });
}

fn granule_cycle_memtoken<B: Backend>(
    c: &mut Criterion,
    id: &str,
    binding: &Binding<'_, '_, B>,
    len: usize,
) {
    c.bench_function(id, |b| b.iter(|| granule::once_memtoken(binding, len)));
}

fn granule_cycle_raw<B: Backend>(c: &mut Criterion, id: &str, raw: &B, len: usize) {
    c.bench_function(id, |b| b.iter(|| granule::once_raw(raw, len)));
}

fn granule_cycle(c: &mut Criterion) {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let raw = HostBackend::with_defaults().unwrap();
    // Warm both memfds and the kernel's structures alike before measuring either: otherwise
    // whichever cycle runs first pays ~10% more.
    for _ in 0..20_000 {
        granule::once_memtoken(&binding, PAGE);
        granule::once_raw(&raw, PAGE);
    }
    granule_cycle_memtoken(c, "granule_cycle/memtoken", &binding, PAGE);
    granule_cycle_raw(c, "granule_cycle/raw", &raw, PAGE);
}

fn region_cycle(c: &mut Criterion) {
    // Both sides' steady state makes no create or release call (on `Faulty`'s counters).
    region::check_steady_state();
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let raw_backend = HostBackend::with_defaults().unwrap();
    let mut memtoken = region::warm_region(&binding);
    let mut raw = region::warm_raw(&raw_backend);
    // Warm both memfds and the kernel's structures alike, as for the granule cycle.
    for _ in 0..2_000 {
        region::once_memtoken(&mut memtoken, region::GRANULES);
        region::once_raw(&mut raw, region::GRANULES);
    }
    c.bench_function("region_cycle/memtoken", |b| {
        b.iter(|| region::once_memtoken(&mut memtoken, region::GRANULES))
    });
    c.bench_function("region_cycle/raw", |b| {
        b.iter(|| region::once_raw(&mut raw, region::GRANULES))
    });
    // Still in steady state: the cache holds the region's granules, nothing more was owned.
    let bytes = (region::GRANULES * device.granularity()) as u64;
    let owned = device.ledger().owned_bytes;
    assert_eq!((owned, device.cached_bytes()), (bytes, bytes));
    assert_eq!(raw.free_granules(), region::GRANULES);
    // The same cycle with the mapped tail keeping every granule: no backend call.
    memtoken.set_tail_cap(region::GRANULES).unwrap();
    region::once_memtoken(&mut memtoken, region::GRANULES);
    c.bench_function("region_cycle/tail", |b| {
        b.iter(|| region::once_memtoken(&mut memtoken, region::GRANULES))
    });
    assert_eq!(memtoken.tail_granules(), region::GRANULES);
    memtoken.release().complete().unwrap();
}

fn sleep_wake(c: &mut Criterion) {
    make_guard!(guard);
    let device = Device::new(guard, sleep::backend());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(sleep::LEN).unwrap().commit().unwrap();
    a.as_mut_slice().fill(7);
    let mut memtoken = Some(a);
    let raw = sleep::backend();
    let (addr, mut phys) = sleep::raw_committed(&raw, 7);
    let mut group = c.benchmark_group("sleep_wake");
    group.sample_size(20);
    group.bench_function("memtoken", |b| {
        b.iter(|| {
            let a = memtoken.take().unwrap();
            memtoken = Some(sleep::once_memtoken(a));
        })
    });
    group.bench_function("raw", |b| {
        b.iter(|| phys = sleep::once_raw(&raw, addr, phys))
    });
    group.finish();
    // Both woke with their bytes.
    let a = memtoken.unwrap();
    assert!(a.as_slice().iter().all(|&b| b == 7));
    let mut seen = vec![0; sleep::LEN];
    raw.copy_to_host(&mut seen, addr).unwrap();
    assert!(seen.iter().all(|&b| b == 7));
}

/// One block taken into a table and given back, with N blocks held by another table: the
/// cost does not depend on N.
fn block_scale(c: &mut Criterion) {
    let mut group = c.benchmark_group("block_scale/memtoken");
    for live in [1usize << 10, 1 << 16, 1 << 20] {
        make_guard!(guard);
        let backend = HostBackend::new(HostConfig {
            physical_capacity: 1 << 30,
            ..HostConfig::default()
        })
        .unwrap();
        let device = Device::new(guard, backend);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        // 64-byte blocks: 64 a host granule; room for the held blocks and a group more.
        let layout = KvLayout::new(live + 128, 16).plane(64);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        cache.set_watermarks(cache.groups(), cache.groups());
        cache.replenish().unwrap();
        let mut held = cache.table();
        for _ in 0..live {
            cache.push(&mut held).unwrap();
        }
        let mut table = cache.table();
        group.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                black_box(cache.push(&mut table).unwrap());
                cache.clear(&mut table);
            })
        });
        drop(held);
    }
    group.finish();
}

#[cfg(feature = "cuda")]
fn gpu(c: &mut Criterion) {
    use memtoken::backend::cuda::CudaBackend;
    let backends = (CudaBackend::open(0), CudaBackend::open(0));
    let (Ok(backend), Ok(raw)) = backends else {
        eprintln!("gpu benches skipped: no CUDA device");
        return;
    };
    let g = backend.granularity();
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    granule_cycle_memtoken(c, "gpu/granule_cycle/memtoken", &binding, g);
    granule_cycle_raw(c, "gpu/granule_cycle/raw", &raw, g);
    block_cycle_memtoken(c, "gpu/block_cycle/memtoken", &binding);
    block_cycle_raw(c, "gpu/block_cycle/raw", &raw);
}

#[cfg(not(feature = "cuda"))]
fn gpu(_: &mut Criterion) {}

criterion_group!(
    benches,
    block_cycle,
    granule_cycle,
    region_cycle,
    sleep_wake,
    block_scale,
    gpu
);
criterion_main!(benches);
