//! The GPU cost table: what a granule costs on a CUDA device, raw and through an
//! elastic region, and the calls a region's grow and shrink make.
//!
//! 1. **Call counts, everywhere** (printed first; no GPU needed): a [`Region`] on
//!    `CudaBackend<DriverModel>` — memtoken's strict model of the CUDA driver — under [`Faulty`]
//!    grows and shrinks by [`N`] granules after a warm-up cycle, in three configurations:
//!    without the device's granule cache (cache cap 0, tail cap 0), with it (the default cap,
//!    tail cap 0), and with the mapped tail (default cache cap, `set_tail_cap(N)`). The table
//!    gives the backend calls per grow and per shrink (`Faulty`'s counters) and the driver calls
//!    behind them (the model's call log, where `cuMemSetAccess` is a call of its own). Then a
//!    [`KvCache`] of four planes: the calls of a `replenish` that maps one group (a map and an
//!    access call per plane, facts 47 and 48) and of one that fences and gives a group back.
//! 2. **Times, on a GPU** (criterion; every id contains `gpu`): per granule, the raw VMM calls
//!    `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap` and `cuMemRelease`, made below
//!    the backend through memtoken's driver seam (`SysDriver`, one `cudarc::driver::sys` call
//!    each: the backend's own `map` is `cuMemMap` + `cuMemSetAccess`, and each backend call
//!    also sets the context and the capture mode); and a region's grow and shrink in the three
//!    configurations. An iteration handles [`N`] granules and times only the step named (what
//!    sets it up and undoes it runs untimed, through `iter_custom`). After criterion's output, a
//!    table: mean µs per granule over criterion's measured samples (not its warm-up).
//!
//! Run: `cargo bench --bench gpu_costs -- gpu`. Without a CUDA driver or GPU, the timing part
//! prints one line saying why it skips and the run exits 0 — unless `MEMTOKEN_REQUIRE_GPU=1`,
//! which makes that a panic, as for the GPU tests (`tests/gpu/cases.rs`). For a GPU machine with no
//! Rust toolchain: `../shared/gpu/prepare.sh` here, then `bash .gpu/run.sh` there.

#[path = "common/gpu_costs.rs"]
mod gpu;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use gpu::Slots;
use memtoken::backend::cuda::{CudaBackend, Driver, DriverCall, SysDriver};
use memtoken::backend::doubles::{DriverModel, FaultHandle, Faulty};
use memtoken::backend::{Backend, Op};
use memtoken::kv::{KvCache, Layout};
use memtoken::{Binding, Budget, Device, errors::ShrinkError, make_guard, region::Region};
use std::time::{Duration, Instant};

/// Granules a grow, a shrink or a timed iteration handles.
const N: usize = 16;
/// Criterion's samples per benchmark: the table averages the last this many runs of each.
const SAMPLES: usize = 20;
/// Planes of the KV cache whose group mapping is counted.
const KV_PLANES: usize = 4;
/// Cycles the call counts are averaged over.
const CYCLES: u64 = 10;

/// A region configuration: its name, whether the device caches granules (at its default cap;
/// else cap 0), and whether the region keeps a mapped tail of [`N`] granules (else cap 0).
type Config = (&'static str, bool, bool);
const CONFIGS: [Config; 3] = [
    ("no_cache", false, false),
    ("cache", true, false),
    ("tail", true, true),
];

/// A region of [`N`] granules in `config`, after one grow/shrink cycle: the cache or the tail
/// now holds its granules. `default_cap` is the device's cache cap as it was made.
fn warm_region<'b, 'id, B: Backend>(
    binding: &'b Binding<'b, 'id, B>,
    (_, cache, tail): Config,
    default_cap: u64,
) -> Region<'b, 'id, B> {
    let device = binding.device();
    device.set_cache_cap(if cache { default_cap } else { 0 });
    let len = N * device.granularity();
    let mut region = binding.reserve(len).unwrap().into_region();
    region.set_tail_cap(if tail { N } else { 0 }).unwrap();
    region.grow(N).unwrap();
    shrink(&mut region);
    region
}

/// Shrinks `region` by [`N`] granules, trying again while a fence says work may use them.
fn shrink<B: Backend>(region: &mut Region<'_, '_, B>) {
    loop {
        match region.shrink(N) {
            Ok(()) => return,
            Err(ShrinkError::Pending) => std::hint::spin_loop(),
            Err(e) => panic!("shrink: {e}"),
        }
    }
}

/// Lets `region` go and waits for its release, so the next configuration starts afresh.
fn finish<B: Backend>(device: &Device<'_, B>, region: Region<'_, '_, B>) {
    drop(region);
    let start = Instant::now();
    while device.poll().deferred > 0 {
        assert!(start.elapsed() < Duration::from_secs(60), "a release waits");
        std::thread::yield_now();
    }
    device.trim_cache();
}

// Part 1: call counts on the driver model.

/// The backend calls by kind: the table has a column for each of the first five, one for the
/// others together, and one for the queries `Faulty` counts apart from these kinds
/// (`context_lost`, `withheld`, `keep_for_good`: answered in the process, no driver call).
const OPS: [Op; 11] = [
    Op::Create,
    Op::Map,
    Op::Unmap,
    Op::Release,
    Op::Fence,
    Op::Reserve,
    Op::Free,
    Op::Pin,
    Op::Unpin,
    Op::Copy,
    Op::Graph,
];
/// The driver calls counted by kind; the table lists every other kind after them.
const CALLS: [DriverCall; 5] = [
    DriverCall::MemCreate,
    DriverCall::MemMap,
    DriverCall::MemSetAccess,
    DriverCall::MemUnmap,
    DriverCall::MemRelease,
];

/// Adds the calls `step` makes to `ops` (by the kinds of [`OPS`], then the queries: every
/// other call `Faulty` counts but its getters) and to `log` (the driver calls, as logged).
fn count(
    faults: &FaultHandle,
    model: &DriverModel,
    ops: &mut [u64; 12],
    log: &mut Vec<DriverCall>,
    step: impl FnOnce(),
) {
    let now = || {
        let by_kind = OPS.map(|op| faults.calls(op));
        let queries = faults.any_calls() - faults.getter_calls() - by_kind.iter().sum::<u64>();
        (by_kind, queries)
    };
    let (before, logged) = (now(), model.log().len());
    step();
    let after = now();
    for (k, n) in ops[..11].iter_mut().enumerate() {
        *n += after.0[k] - before.0[k];
    }
    ops[11] += after.1 - before.1;
    log.extend_from_slice(&model.log()[logged..]);
}

/// Prints a row of the count table: the calls of [`CYCLES`] steps, per step.
fn count_row(name: &str, step: &str, ops: &[u64; 12], log: &[DriverCall]) {
    let per = |n: usize| n as f64 / CYCLES as f64;
    let of = |call: &DriverCall| log.iter().filter(|c| *c == call).count();
    let cols = |ns: Vec<f64>| ns.iter().map(|n| format!("{n:>10}")).collect::<String>();
    let other_ops = ops[5..11].iter().sum::<u64>();
    let backend = ops[..5].iter().chain([&other_ops, &ops[11]]);
    let mut others: Vec<DriverCall> = Vec::new();
    for call in log.iter().filter(|c| !CALLS.contains(c)) {
        if !others.contains(call) {
            others.push(*call);
        }
    }
    let others: Vec<String> = others
        .iter()
        .map(|c| format!("{c:?} {}", per(of(c))))
        .collect();
    println!(
        "{name:<8} {step:<9} |{} |{} | {}",
        cols(backend.map(|&n| per(n as usize)).collect()),
        cols(CALLS.iter().map(|c| per(of(c))).collect()),
        if others.is_empty() {
            "-".to_string()
        } else {
            others.join(", ")
        }
    );
}

/// Counts and prints the calls of a region's grow and shrink on the driver model.
fn count_calls() {
    let model = DriverModel::default();
    let backend = Faulty::new(CudaBackend::new(model.clone(), 0).expect("the model opens"));
    let faults = backend.handle();
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let default_cap = device.cache_cap();
    let binding = device.bind(Budget::unlimited()).unwrap();
    println!(
        "gpu_costs: calls per grow / shrink of {N} granules of {} B after one warm-up cycle \
         (mean of {CYCLES}), on memtoken's CUDA driver model: backend calls by Faulty's \
         counters, driver calls by the model's log (cuMemSetAccess counted apart; the \
         backend's map is cuMemMap + cuMemSetAccess; queries: context_lost, withheld, keep_for_good, answered \
         in the process). no_cache: cache cap 0, tail cap 0; \
         cache: default cache cap ({default_cap} B), tail cap 0; tail: default cache cap, \
         set_tail_cap({N}).",
        device.granularity()
    );
    let heads = |hs: &[&str]| hs.iter().map(|h| format!("{h:>10}")).collect::<String>();
    println!(
        "{:<8} {:<9} |{:<70} |{:<50} | other driver calls",
        "", "", " backend calls (Faulty)", " driver calls cuMem* (DriverModel)"
    );
    println!(
        "{:<8} {:<9} |{} |{} |",
        "config",
        "step",
        heads(&[
            "create", "map", "unmap", "release", "fence", "other", "queries"
        ]),
        heads(&["Create", "Map", "SetAccess", "Unmap", "Release"]),
    );
    for config in CONFIGS {
        let mut region = warm_region(&binding, config, default_cap);
        let mut ops = [[0; 12]; 2];
        let mut logs = [Vec::new(), Vec::new()];
        for _ in 0..CYCLES {
            let grow = || region.grow(N).unwrap();
            count(&faults, &model, &mut ops[0], &mut logs[0], grow);
            count(&faults, &model, &mut ops[1], &mut logs[1], || {
                shrink(&mut region)
            });
        }
        count_row(config.0, &format!("grow {N}"), &ops[0], &logs[0]);
        count_row(config.0, &format!("shrink {N}"), &ops[1], &logs[1]);
        finish(&device, region);
    }
    count_kv(&faults, &model, &binding);
}

/// Counts the calls of a KV cache's `replenish` that maps one group, and of one that fences
/// the blocks given back and gives a group back: a cache of [`KV_PLANES`] planes of 64 KiB
/// blocks (a group: 32 blocks, one granule per plane), watermarks 1 and 1.
fn count_kv<B: Backend>(faults: &FaultHandle, model: &DriverModel, binding: &Binding<'_, '_, B>) {
    let layout = (0..KV_PLANES).fold(Layout::new(4096, 16), |l, _| l.plane(64 << 10));
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, binding, &layout).unwrap();
    cache.set_watermarks(1, 1);
    cache.replenish().unwrap();
    let mut ops = [[0; 12]; 2];
    let mut logs = [Vec::new(), Vec::new()];
    for _ in 0..CYCLES {
        // Every free block taken: the next replenish maps a group.
        let mut table = cache.table();
        while cache.push(&mut table).is_ok() {}
        count(faults, model, &mut ops[0], &mut logs[0], || {
            assert_eq!(cache.replenish().unwrap().mapped, 1);
        });
        // Given back: the next replenish fences them, and gives a group back.
        drop(table);
        count(faults, model, &mut ops[1], &mut logs[1], || {
            assert_eq!(cache.replenish().unwrap().unmapped, 1);
        });
    }
    count_row("kv", &format!("map 1x{KV_PLANES}"), &ops[0], &logs[0]);
    count_row("kv", &format!("unmap 1x{KV_PLANES}"), &ops[1], &logs[1]);
}

// Part 2: times on a GPU.

/// Adds the time `f` takes to `total`.
fn timed<T>(total: &mut Duration, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    *total += start.elapsed();
    out
}

/// Each benchmark's mean µs per granule (`None`: filtered out), in the order run.
#[derive(Default)]
struct Table(Vec<(String, Option<f64>)>);

impl Table {
    /// Runs benchmark `name`, whose `cycle(iters)` returns the time `iters` iterations (of [`N`]
    /// granules each) spent in the step measured; records the mean per granule over
    /// criterion's measured samples — its last [`SAMPLES`] calls, after the warm-up's.
    fn bench(
        &mut self,
        group: &mut BenchmarkGroup<'_, WallTime>,
        name: &str,
        mut cycle: impl FnMut(u64) -> Duration,
    ) {
        let mut runs = Vec::new();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let spent = cycle(iters);
                runs.push(spent.as_secs_f64() * 1e6 / (iters * N as u64) as f64);
                spent
            })
        });
        let measured = &runs[runs.len().saturating_sub(SAMPLES)..];
        let mean =
            (!measured.is_empty()).then(|| measured.iter().sum::<f64>() / measured.len() as f64);
        self.0.push((name.to_string(), mean));
    }
}

/// Times the five raw VMM calls, a granule at a time: each case is what sets the slot up, the
/// call timed, and what undoes it.
fn raw_calls<D: Driver>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    table: &mut Table,
    s: &mut Slots<D, N>,
) {
    type Step<D> = fn(&mut Slots<D, N>, usize);
    type Case<D> = (&'static str, Vec<Step<D>>, Step<D>, Vec<Step<D>>);
    let (create, map, access) = (Slots::create, Slots::map, Slots::set_access);
    let (unmap, release) = (Slots::unmap, Slots::release);
    let cases: [Case<D>; 5] = [
        ("raw/cuMemCreate", vec![], create, vec![release]),
        ("raw/cuMemMap", vec![create], map, vec![unmap, release]),
        (
            "raw/cuMemSetAccess",
            vec![create, map],
            access,
            vec![unmap, release],
        ),
        (
            "raw/cuMemUnmap",
            vec![create, map, access],
            unmap,
            vec![release],
        ),
        ("raw/cuMemRelease", vec![create], release, vec![]),
    ];
    s.make_current();
    for (name, before, step, after) in cases {
        table.bench(group, name, |iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                for i in 0..N {
                    before.iter().for_each(|f| f(s, i));
                    timed(&mut spent, || step(s, i));
                    after.iter().for_each(|f| f(s, i));
                }
            }
            spent
        });
    }
}

/// Times a region's grow and shrink of [`N`] granules in each configuration.
fn region_steps<B: Backend>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    table: &mut Table,
    binding: &Binding<'_, '_, B>,
) {
    let device = binding.device();
    let default_cap = device.cache_cap();
    for config in CONFIGS {
        let mut region = warm_region(binding, config, default_cap);
        table.bench(group, &format!("region/{}/grow", config.0), |iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                timed(&mut spent, || region.grow(N).unwrap());
                shrink(&mut region);
            }
            spent
        });
        table.bench(group, &format!("region/{}/shrink", config.0), |iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                region.grow(N).unwrap();
                timed(&mut spent, || shrink(&mut region));
            }
            spent
        });
        finish(device, region);
    }
}

/// Whether criterion measures: `--bench`, and not `--test`, `--list` or `--profile-time`.
fn measuring() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a.split('=').next() == Some(flag));
    has("--bench") && !has("--test") && !has("--list") && !has("--profile-time")
}

/// Part 2 on `backend` and, below it, `driver`: criterion's runs, then the table.
fn time<D: Driver>(driver: D, backend: CudaBackend<D>) {
    let g = backend.granularity();
    let mut slots = Slots::new(driver, &backend);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut c = Criterion::default().configure_from_args();
    let mut table = Table::default();
    let mut group = c.benchmark_group("gpu_costs");
    group.sample_size(SAMPLES);
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::Elements(N as u64));
    raw_calls(&mut group, &mut table, &mut slots);
    region_steps(&mut group, &mut table, &binding);
    group.finish();
    c.final_summary();
    drop((slots, binding));
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");

    if !measuring() {
        return println!("gpu_costs: criterion did not measure (test or list mode): no table");
    }
    println!(
        "\ngpu_costs: mean µs per granule of {g} B on device 0, over criterion's {SAMPLES} \
         measured samples of {N} granules each. raw/*: one driver call, through memtoken's \
         driver seam (SysDriver: one cudarc::driver::sys call). region/*: Region::grow and \
         shrink on CudaBackend<SysDriver>; no_cache: cache cap 0, tail cap 0; cache: default \
         cache cap, tail cap 0; tail: default cache cap, set_tail_cap({N})."
    );
    println!("{:<34} {:>12}", "operation", "µs/granule");
    for (name, mean) in &table.0 {
        let mean = mean.map_or("not run".to_string(), |us| format!("{us:.4}"));
        println!("{:<34} {mean:>12}", format!("gpu_costs/{name}"));
    }
}

fn main() {
    count_calls();
    let Some(backend) = gpu::gpu_or_skip() else {
        return;
    };
    let driver = SysDriver::load().expect("the backend loaded it");
    time(driver, backend);
}
