//! The KV cache's sharing and prefix-cache paths, as a plain program for instruction counting
//! at any size: memtoken's [`KvCache`] and [`PrefixCache`] (`cache`) against vLLM's block pool
//! algorithm written by hand in Rust (`raw`, `examples/common/raw_prefix.rs`).
//!
//! ```text
//! cargo build --release --example kv_prefix_cycle
//! valgrind --tool=callgrind --toggle-collect='kv_prefix_cycle::cycles_*' \
//!     target/release/examples/kv_prefix_cycle cache hit16 16384 20000
//! ```
//!
//! The count per cycle is the difference between two runs (e.g. 20,000 and 40,000 cycles)
//! divided by the difference in cycles, so set-up cancels out. `scripts/kv-scale` runs every
//! workload at 1 Ki, 16 Ki and 256 Ki blocks.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/raw_prefix.rs"]
mod raw_prefix;

use cli::{Arg, Args};
use memtoken::backend::HostBackend;
use memtoken::kv::{BlockTable, KvCache, Layout, PrefixCache, PrehashedKeys};
use memtoken::{Budget, Device, make_guard};
use raw_prefix::RawPrefix;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::hint::black_box;
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: kv_prefix_cycle MODE WORKLOAD BLOCKS CYCLES [--siphash]

One workload run CYCLES times over a KV cache of BLOCKS blocks (two planes of 1 KiB a block,
host granules of 64 KiB: groups of 64 blocks, every group mapped), for instruction counts (callgrind; see the top of
examples/kv_prefix_cycle.rs).

  MODE        cache (memtoken's KvCache and PrefixCache) or raw (vLLM's algorithm by hand,
              examples/common/raw_prefix.rs)
  WORKLOAD    take16     16 fresh blocks into a table, then its clear
              hit16      16 keys looked up, all hit, into a table; its clear
              hit8new8   9 lookups (8 hits, then a miss), 8 fresh blocks; the clear
              miss16     1 lookup (a miss), 16 fresh blocks; the clear
              enter16    16 fresh blocks (each evicting an idle cached one, once the cache
                         is full), entered under 16 new keys; the clear
              marked16   take16 on a table marked as sharing (a fork of it while empty
                         marks it): its clear looks at each block's word (cache only)
              half       8 blocks shared from a table another holds, 8 fresh; the clear
                         (cache only)
              share16    16 blocks shared from another table; the clear (cache only)
              fork1000   a fork of a table of 1,000 blocks, then its drop (cache only)
              cow        a fork of a 1-block table, a copy-on-write of its block (1 KiB in
                         each plane), its drop (cache only)
              build      the cache made, every group mapped, a prefix cache attached, all
                         dropped (cache only)
  BLOCKS      the cache's blocks (a multiple of 4)
  CYCLES      a whole number
  --siphash   keys hashed with SipHash (default: PrehashedKeys, keys that are keyed hashes)
  -h, --help  print this usage";

const WORKLOADS: &[&str] = &[
    "take16", "hit16", "hit8new8", "miss16", "enter16", "marked16", "half", "share16", "fork1000",
    "cow", "build",
];

/// A block's bytes in each of the two planes.
const BLOCK: usize = 1024;

type Key = [u8; 32];

/// Key `i`: 32 bytes as a keyed hash would be (splitmix64 of `i`, four words).
fn key(i: u64) -> Key {
    let mut out = [0; 32];
    for (w, chunk) in out.chunks_exact_mut(8).enumerate() {
        let mut z = (i * 4 + w as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out
}

struct Run {
    mode: String,
    workload: String,
    blocks: usize,
    cycles: u64,
    siphash: bool,
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let mut args = Args::new(USAGE);
    let mut positional = Vec::new();
    let mut siphash = false;
    while let Some(arg) = args.next_arg() {
        match arg {
            Arg::Flag(f) if f == "--siphash" => siphash = true,
            Arg::Positional(p) if positional.len() < 4 => positional.push(p),
            other => args.unknown(other),
        }
    }
    if positional.len() < 4 {
        args.error("MODE, WORKLOAD, BLOCKS and CYCLES are needed");
    }
    let mode = positional[0].clone();
    if mode != "cache" && mode != "raw" {
        args.error(format_args!("unknown mode {mode}"));
    }
    let workload = positional[1].clone();
    if !WORKLOADS.contains(&workload.as_str()) {
        args.error(format_args!("unknown workload {workload}"));
    }
    let blocks: usize = args.parse("BLOCKS", &positional[2]);
    if blocks < 1024 || !blocks.is_multiple_of(4) {
        args.error("BLOCKS is at least 1024, a multiple of 4");
    }
    let run = Run {
        mode,
        workload,
        blocks,
        cycles: args.parse("CYCLES", &positional[3]),
        siphash,
    };
    cli::exit(if run.siphash {
        dispatch(&run, RandomState::new())
    } else {
        dispatch(&run, PrehashedKeys)
    })
}

fn dispatch<S: BuildHasher + Clone>(
    run: &Run,
    hasher: S,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if run.mode == "raw" {
        let mut pool = RawPrefix::new(run.blocks, hasher);
        let elapsed = raw(&mut pool, run)?;
        println!(
            "raw {}: {} cycles, {} cached, {:.1} ns a cycle",
            run.workload,
            run.cycles,
            pool.cached(),
            per_cycle(elapsed, run.cycles)
        );
        return Ok(());
    }
    make_guard!(guard);
    let device = Device::new(guard, host()?);
    let binding = device.bind(Budget::unlimited())?;
    let layout = Layout::new(run.blocks, 16).plane(BLOCK).plane(BLOCK);
    if run.workload == "build" {
        cycles_build(&binding, &layout, hasher, run.cycles)?;
        println!(
            "cache build: {} cycles of {} blocks",
            run.cycles, run.blocks
        );
        return Ok(());
    }
    make_guard!(g);
    let cache = KvCache::new(g, &binding, &layout)?;
    let groups = cache.groups();
    cache.set_watermarks(groups, groups);
    cache.replenish()?;
    let mut prefixes = PrefixCache::with_hasher(&cache, hasher)?;
    let elapsed = cached(&cache, &mut prefixes, run)?;
    println!(
        "cache {}: {} cycles, {} cached, {} of {} groups mapped, {:.1} ns a cycle",
        run.workload,
        run.cycles,
        prefixes.len(),
        cache.mapped_groups(),
        groups,
        per_cycle(elapsed, run.cycles)
    );
    Ok(())
}

/// The host device: granules of 64 KiB (so 256 Ki blocks are 4,096 groups: the mappings stay
/// well below the kernel's limit of about 65,000 a process), and room for every block.
fn host() -> Result<HostBackend, memtoken::backend::ConfigError> {
    HostBackend::new(memtoken::backend::HostConfig {
        granularity: 64 << 10,
        physical_capacity: 4 << 30,
        ..memtoken::backend::HostConfig::default()
    })
}

/// Nanoseconds a cycle.
fn per_cycle(elapsed: Duration, cycles: u64) -> f64 {
    elapsed.as_nanos() as f64 / cycles.max(1) as f64
}

/// Keys for `enter16`: a ring long enough that a key comes back only after the cache has
/// evicted it.
fn ring(blocks: usize) -> Vec<Key> {
    (0..(blocks + 64) as u64)
        .map(|i| key(1_000_000 + i))
        .collect()
}

fn cached<'t, 'c, 'b, 'id, S: BuildHasher>(
    cache: &'t KvCache<'c, 'b, 'id, HostBackend>,
    prefixes: &mut PrefixCache<'t, 'c, 'b, 'id, HostBackend, Key, S>,
    run: &Run,
) -> Result<Duration, Box<dyn std::error::Error + Send + Sync>> {
    let keys: Vec<Key> = (0..16).map(key).collect();
    let ring = ring(if run.workload == "enter16" {
        run.blocks
    } else {
        0
    });
    let mut table = cache.table();
    let n = run.cycles;
    let elapsed = match run.workload.as_str() {
        "take16" => timed(|| cycles_take16(cache, &mut table, n)),
        "marked16" => timed(|| cycles_marked16(cache, &mut table, n)),
        "hit16" | "hit8new8" => {
            let entered = if run.workload == "hit16" { 16 } else { 8 };
            let mut first = cache.table();
            for (position, key) in keys.iter().take(entered).enumerate() {
                cache.push(&mut first)?;
                prefixes.enter(&first, position, *key);
            }
            drop(first);
            if entered == 16 {
                timed(|| cycles_hit16(cache, prefixes, &mut table, &keys, n))
            } else {
                timed(|| cycles_lookups(cache, prefixes, &mut table, &keys, n))
            }
        }
        "miss16" => timed(|| cycles_lookups(cache, prefixes, &mut table, &keys, n)),
        "enter16" => timed(|| cycles_enter16(cache, prefixes, &mut table, &ring, n)),
        "half" | "share16" => {
            let mut other = cache.table();
            let shared = if run.workload == "half" { 8 } else { 16 };
            for _ in 0..shared {
                cache.push(&mut other)?;
            }
            timed(|| cycles_shared(cache, &other, &mut table, 16 - shared, n))
        }
        "fork1000" => {
            for _ in 0..1000 {
                cache.push(&mut table)?;
            }
            timed(|| cycles_fork(cache, &table, n))
        }
        "cow" => {
            cache.push(&mut table)?;
            timed(|| cycles_cow(cache, &table, n))
        }
        _ => unreachable!("checked"),
    };
    Ok(elapsed)
}

/// How long `cycles` takes.
fn timed(cycles: impl FnOnce()) -> Duration {
    let start = Instant::now();
    cycles();
    start.elapsed()
}

#[inline(never)]
fn cycles_take16<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    n: u64,
) {
    for _ in 0..n {
        for _ in 0..16 {
            cache.push(table).expect("room");
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

#[inline(never)]
fn cycles_marked16<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    n: u64,
) {
    for _ in 0..n {
        drop(cache.fork(table)); // empty: marks the table, holds nothing
        for _ in 0..16 {
            cache.push(table).expect("room");
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

/// 16 lookups, every one a hit, then the clear (the hand-written side runs its lookup-until-a-
/// miss loop, its fastest).
#[inline(never)]
fn cycles_hit16<'t, 'c, 'b, 'id, S: BuildHasher>(
    cache: &'t KvCache<'c, 'b, 'id, HostBackend>,
    prefixes: &mut PrefixCache<'t, 'c, 'b, 'id, HostBackend, Key, S>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    keys: &[Key],
    n: u64,
) {
    for _ in 0..n {
        for key in &keys[..16] {
            assert!(prefixes.lookup(key, table));
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

/// Lookups until the first miss (each hit pushed into the table), then fresh blocks to 16, then
/// the clear: hit8new8 and miss16 as their set-up leaves the cache (as `cycles_raw_hits` on the
/// hand-written side).
#[inline(never)]
fn cycles_lookups<'t, 'c, 'b, 'id, S: BuildHasher>(
    cache: &'t KvCache<'c, 'b, 'id, HostBackend>,
    prefixes: &mut PrefixCache<'t, 'c, 'b, 'id, HostBackend, Key, S>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    keys: &[Key],
    n: u64,
) {
    for _ in 0..n {
        for key in keys {
            if !prefixes.lookup(key, table) {
                break;
            }
        }
        while table.len() < 16 {
            cache.push(table).expect("room");
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

#[inline(never)]
fn cycles_enter16<'t, 'c, 'b, 'id, S: BuildHasher>(
    cache: &'t KvCache<'c, 'b, 'id, HostBackend>,
    prefixes: &mut PrefixCache<'t, 'c, 'b, 'id, HostBackend, Key, S>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    ring: &[Key],
    n: u64,
) {
    let mut next = 0;
    for _ in 0..n {
        for position in 0..16 {
            cache.push(table).expect("room");
            if next == ring.len() {
                next = 0;
            }
            assert!(prefixes.enter(table, position, ring[next]));
            next += 1;
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

#[inline(never)]
fn cycles_shared<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    other: &BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    fresh: usize,
    n: u64,
) {
    for _ in 0..n {
        for position in 0..other.len() {
            cache.share(other, position, table);
        }
        for _ in 0..fresh {
            cache.push(table).expect("room");
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

#[inline(never)]
fn cycles_fork<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    n: u64,
) {
    for _ in 0..n {
        let fork = cache.fork(table);
        black_box(fork.ids());
    }
}

#[inline(never)]
fn cycles_cow<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    n: u64,
) {
    for _ in 0..n {
        let mut fork = cache.fork(table);
        assert!(cache.copy_on_write(&mut fork, 0).expect("room"));
        black_box(fork.ids());
    }
}

#[inline(never)]
fn cycles_build<'b, 'id, S: BuildHasher + Clone>(
    binding: &'b memtoken::Binding<'b, 'id, HostBackend>,
    layout: &Layout,
    hasher: S,
    n: u64,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    for _ in 0..n {
        make_guard!(g);
        let cache = KvCache::new(g, binding, layout)?;
        let groups = cache.groups();
        cache.set_watermarks(groups, groups);
        cache.replenish()?;
        let prefixes = PrefixCache::<_, Key, S>::with_hasher(&cache, hasher.clone())?;
        black_box(&prefixes);
    }
    Ok(())
}

fn raw<S: BuildHasher>(
    pool: &mut RawPrefix<Key, S>,
    run: &Run,
) -> Result<Duration, Box<dyn std::error::Error + Send + Sync>> {
    let keys: Vec<Key> = (0..16).map(key).collect();
    let ring = ring(if run.workload == "enter16" {
        run.blocks
    } else {
        0
    });
    let mut table = Vec::with_capacity(16);
    let n = run.cycles;
    let elapsed = match run.workload.as_str() {
        "take16" => timed(|| cycles_raw_take16(pool, &mut table, n)),
        "hit16" | "hit8new8" => {
            let entered = if run.workload == "hit16" { 16 } else { 8 };
            for key in keys.iter().take(entered) {
                let block = pool.take(&mut table).ok_or("room")?;
                pool.cache(block, *key);
            }
            pool.free(&mut table);
            // Its lookup-until-a-miss loop also for hit16: the hand-written side's fastest
            // (1,574 instructions, against 1,747 in a loop of 16 asserted hits).
            timed(|| cycles_raw_hits(pool, &mut table, &keys, n))
        }
        "miss16" => timed(|| cycles_raw_hits(pool, &mut table, &keys, n)),
        "enter16" => timed(|| cycles_raw_enter16(pool, &mut table, &ring, n)),
        other => return Err(format!("raw has no {other} workload").into()),
    };
    Ok(elapsed)
}

#[inline(never)]
fn cycles_raw_take16<S: BuildHasher>(pool: &mut RawPrefix<Key, S>, table: &mut Vec<u32>, n: u64) {
    for _ in 0..n {
        for _ in 0..16 {
            pool.take(table).expect("room");
        }
        black_box(table.as_slice());
        pool.free(table);
    }
}

/// Lookups until the first miss (each hit touched into the table), then fresh blocks to 16:
/// hit16, hit8new8 and miss16 as the cache's set-up leaves them.
#[inline(never)]
fn cycles_raw_hits<S: BuildHasher>(
    pool: &mut RawPrefix<Key, S>,
    table: &mut Vec<u32>,
    keys: &[Key],
    n: u64,
) {
    for _ in 0..n {
        for key in keys {
            match pool.lookup(key) {
                Some(block) => pool.touch(block, table),
                None => break,
            }
        }
        while table.len() < 16 {
            pool.take(table).expect("room");
        }
        black_box(table.as_slice());
        pool.free(table);
    }
}

#[inline(never)]
fn cycles_raw_enter16<S: BuildHasher>(
    pool: &mut RawPrefix<Key, S>,
    table: &mut Vec<u32>,
    ring: &[Key],
    n: u64,
) {
    let mut next = 0;
    for _ in 0..n {
        for _ in 0..16 {
            let block = pool.take(table).expect("room");
            if next == ring.len() {
                next = 0;
            }
            assert!(pool.cache(block, ring[next]));
            next += 1;
        }
        black_box(table.as_slice());
        pool.free(table);
    }
}
