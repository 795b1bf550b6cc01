//! Hot paths, each measured side by side in one run against the hand-written equivalent on the
//! same backend: the zero-cost claim is the ratio `memtoken / raw`.
//!
//! - `page_cycle/{memtoken,raw,slab,malloc}`: allocate the 16 pages of a 256-token sequence
//!   (16 tokens a page, 4 KiB pages) and free them.
//! - `granule_cycle/{memtoken,raw}`: reserve, commit, release one 4 KiB granule on the host.
//! - `region_cycle/{memtoken,raw}`: grow an elastic region by 16 granules and shrink it back,
//!   on the host, in steady state (every granule from the cache: no create or release).
//! - `sleep_wake/{memtoken,raw}`: suspend a 64 MiB allocation with its bytes saved to the host
//!   and resume it at the same address with its bytes, on the host.
//! - `page_scale/memtoken/N`: one page alloc + free with N pages live.
//! - `shared_fork/{memtoken,raw}`: fork a 1,000-page table (a count more each page) and
//!   release the fork, against a hand-written reference-count pool (`common/rc_pool.rs`).
//! - `shared_share/{memtoken,raw}`: one more holder of each of 16 pages, let go again.
//! - `gpu/...`: the cycles on a CUDA device, when one is present.
//!
//! `cargo run --release --bin bench_report` runs these and prints the ratios.

#[path = "../examples/common/granule.rs"]
mod granule;
#[path = "../examples/common/raw_pool.rs"]
mod raw_pool;
#[path = "../examples/common/rc_pool.rs"]
mod rc_pool;
#[path = "../examples/common/region.rs"]
mod region;
#[path = "../examples/common/sleep.rs"]
mod sleep;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use memtoken::backend::{Backend, HostBackend, HostConfig};
use memtoken::{Binding, Budget, Device, PagePool, make_guard};
use raw_pool::RawPool;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;

const PAGE: usize = 4096;
const SEQ_PAGES: usize = 16;

/// A sequence's page table: 16 pages pushed one by one as the sequence grows, then all freed
/// when it finishes. The table's storage is reused across iterations, as a KV cache would.
fn page_cycle_memtoken<B: Backend>(c: &mut Criterion, id: &str, binding: &Binding<'_, '_, B>) {
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, binding, PAGE).unwrap();
    for _ in 0..SEQ_PAGES {
        pool.grow().unwrap();
    }
    let mut table = pool.table();
    c.bench_function(id, |b| {
        b.iter(|| {
            for _ in 0..SEQ_PAGES {
                pool.push(&mut table).unwrap();
            }
            black_box(table.len());
            pool.clear(&mut table);
        })
    });
    // The same with one `Page` token per page, each returned to the pool explicitly.
    let mut pages = Vec::with_capacity(SEQ_PAGES);
    c.bench_function(&format!("{id}_pages"), |b| {
        b.iter(|| {
            for _ in 0..SEQ_PAGES {
                pages.push(pool.alloc().unwrap());
            }
            black_box(pages.len());
            for page in pages.drain(..) {
                pool.free(page);
            }
        })
    });
}

fn page_cycle_raw<B: Backend>(c: &mut Criterion, id: &str, backend: &B) {
    let mut pool = RawPool::new(backend, PAGE);
    for _ in 0..SEQ_PAGES {
        pool.grow().unwrap();
    }
    let mut table = Vec::with_capacity(SEQ_PAGES);
    c.bench_function(id, |b| {
        b.iter(|| {
            for _ in 0..SEQ_PAGES {
                table.push(pool.alloc().unwrap());
            }
            black_box(table.len());
            pool.free_all(&table);
            table.clear();
        })
    });
}

fn page_cycle(c: &mut Criterion) {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    page_cycle_memtoken(c, "page_cycle/memtoken", &binding);
    let raw = HostBackend::with_defaults().unwrap();
    page_cycle_raw(c, "page_cycle/raw", &raw);

    let mut slab = slab::Slab::<[u8; 0]>::with_capacity(SEQ_PAGES);
    let mut table = Vec::with_capacity(SEQ_PAGES);
    c.bench_function("page_cycle/slab", |b| {
        b.iter(|| {
            for _ in 0..SEQ_PAGES {
                table.push(slab.insert([]));
            }
            black_box(table.len());
            for k in table.drain(..) {
                slab.remove(k);
            }
        })
    });

    let layout = Layout::from_size_align(PAGE, PAGE).unwrap();
    let mut table: Vec<*mut u8> = Vec::with_capacity(SEQ_PAGES);
    c.bench_function("page_cycle/malloc", |b| {
        b.iter(|| {
            for _ in 0..SEQ_PAGES {
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

/// Shared pages: a fork of a 1,000-page table and its release, and a page's share
/// and unshare, against the hand-written reference-count pool on the same backend.
fn shared_pages(c: &mut Criterion) {
    const FORK_PAGES: usize = 1000;
    let backend = HostBackend::with_defaults().unwrap();
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut table = pool.shared_table();
    for _ in 0..FORK_PAGES {
        pool.push(&mut table).unwrap();
    }
    let mut raw = rc_pool::RcPool::new(&backend, PAGE);
    let raw_table: Vec<u32> = (0..FORK_PAGES).map(|_| raw.alloc().unwrap()).collect();
    c.bench_function("shared_fork/memtoken", |b| {
        b.iter(|| {
            let fork = pool.fork(&table);
            black_box(fork.len());
        })
    });
    c.bench_function("shared_fork/raw", |b| {
        b.iter(|| {
            let fork = raw.fork(&raw_table);
            black_box(fork.len());
            raw.release(&fork);
        })
    });
    c.bench_function("shared_share/memtoken", |b| {
        b.iter(|| {
            for position in 0..SEQ_PAGES {
                drop(black_box(pool.share(&table, black_box(position))));
            }
        })
    });
    c.bench_function("shared_share/raw", |b| {
        b.iter(|| {
            for &index in &raw_table[..SEQ_PAGES] {
                raw.share(black_box(index));
            }
            for &index in &raw_table[..SEQ_PAGES] {
                raw.unshare(black_box(index));
            }
        })
    });
    raw.release(&raw_table);
}

fn page_scale(c: &mut Criterion) {
    let mut group = c.benchmark_group("page_scale/memtoken");
    for live in [1usize << 10, 1 << 16, 1 << 20] {
        make_guard!(guard);
        let backend = HostBackend::new(HostConfig {
            physical_capacity: 1 << 30,
            ..HostConfig::default()
        })
        .unwrap();
        let device = Device::new(guard, backend);
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(pool_guard);
        let pool = PagePool::new(pool_guard, &binding, 64).unwrap();
        let held: Vec<_> = (0..live).map(|_| pool.alloc().unwrap()).collect();
        pool.grow().unwrap(); // spare pages: the measured alloc never grows
        group.bench_with_input(BenchmarkId::from_parameter(live), &live, |b, _| {
            b.iter(|| {
                let page = pool.alloc().unwrap();
                black_box(page.index());
                drop(page);
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
    page_cycle_memtoken(c, "gpu/page_cycle/memtoken", &binding);
    page_cycle_raw(c, "gpu/page_cycle/raw", &raw);
}

#[cfg(not(feature = "cuda"))]
fn gpu(_: &mut Criterion) {}

criterion_group!(
    benches,
    page_cycle,
    granule_cycle,
    region_cycle,
    sleep_wake,
    page_scale,
    shared_pages,
    gpu
);
criterion_main!(benches);
