//! The KV cache's block cycle (a 256-token sequence's 16 blocks of 16 tokens taken into a
//! table, then given back), as a plain program for instruction counting: memtoken's
//! [`KvCache`] (`cache`) against the hand-written reference (`raw`,
//! `examples/common/raw_blocks.rs`: block ids over one reservation per plane, a free list and
//! a live count per group, the lowest mapped group with room first), which was written before
//! the cache and is not changed to suit it.
//!
//! ```text
//! cargo build --release --example block_cycle
//! valgrind --tool=callgrind --toggle-collect='block_cycle::cycles_*' \
//!     target/release/examples/block_cycle cache 100000
//! ```
//!
//! The count per cycle is the difference between two runs (e.g. 20,000 and 40,000 cycles)
//! divided by the difference in cycles, so set-up and the first cycle's growth cancel out.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/raw_blocks.rs"]
mod raw_blocks;

use memtoken::backend::HostBackend;
use memtoken::kv::{BlockTable, KvCache, Layout};
use memtoken::{Budget, Device, make_guard};
use raw_blocks::RawBlocks;
use std::hint::black_box;

/// A sequence's blocks per cycle.
const SEQ_BLOCKS: usize = 16;
/// Bytes per block in each of the two planes (K and V of one layer): small, so that a host
/// granule holds several blocks and groups matter.
const STRIDES: [usize; 2] = [1024, 1024];
/// Groups reserved, and mapped before the cycles (room for the null block and a sequence).
const GROUPS: usize = 64;
const MAPPED: usize = 8;
const USAGE: &str = "\
usage: block_cycle [MODE] [CYCLES]

A 256-token sequence's 16 blocks taken into a table and given back CYCLES times, for
instruction counts (callgrind; see the top of examples/block_cycle.rs).

  MODE         cache (memtoken's KvCache) or raw (the hand-written reference of
               examples/common/raw_blocks.rs, the default)
  CYCLES       a whole number (default 1000000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_raw(cache: &mut RawBlocks<'_, HostBackend>, n: u64) {
    let mut table: Vec<u32> = Vec::with_capacity(SEQ_BLOCKS);
    for _ in 0..n {
        for _ in 0..SEQ_BLOCKS {
            table.push(cache.take().expect("a mapped group has room"));
        }
        black_box(table.as_slice());
        cache.give_back_all(&table);
        table.clear();
    }
}

#[inline(never)]
fn cycles_cache<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
    n: u64,
) {
    for _ in 0..n {
        for _ in 0..SEQ_BLOCKS {
            cache.push(table).expect("a mapped group has room");
        }
        black_box(table.ids());
        cache.clear(table);
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let (which, n) = cli::mode_and_count(USAGE, &["raw", "cache"], "CYCLES", ("raw", 1_000_000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if which == "cache" {
        return run_cache(n);
    }
    let backend = HostBackend::with_defaults()?;
    let mut cache = RawBlocks::new(&backend, &STRIDES, GROUPS).map_err(|()| "the raw cache")?;
    for group in 0..MAPPED {
        cache.map_group(group).map_err(|()| "a group maps")?;
    }
    cycles_raw(&mut cache, n);
    println!(
        "{which}: {n} cycles of {SEQ_BLOCKS} blocks, {} groups mapped",
        cache.mapped_groups()
    );
    Ok(())
}

/// The same cycle on memtoken's KV cache: the same planes and groups, the same groups mapped
/// (the null block's and 7 more, by `replenish` to a low watermark of 7 idle groups).
fn run_cache(n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let per_group = device.granularity() / STRIDES[0];
    let layout = Layout::new(GROUPS * per_group, 16)
        .plane(STRIDES[0])
        .plane(STRIDES[1]);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout)?;
    cache.set_watermarks(MAPPED - 1, GROUPS);
    cache.replenish()?;
    let mut table = cache.table();
    cycles_cache(&cache, &mut table, n);
    println!(
        "cache: {n} cycles of {SEQ_BLOCKS} blocks, {} groups mapped",
        cache.mapped_groups()
    );
    Ok(())
}
