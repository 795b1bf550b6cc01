//! The region cycle of `benches/hot_paths.rs` (grow an elastic region by 16 granules, shrink it
//! back, in steady state: every granule comes from the cache) on the host backend, as a plain
//! program for instruction counting and for paired timing runs: a `memtoken::region::Region` versus the
//! hand-written region of `examples/common/region.rs` (the same backend calls, with its own free
//! list). Callgrind counts user-space instructions only, so the system calls that both make
//! cancel out and the ratio shows what the tokens add.
//!
//! ```text
//! cargo build --release --example region_cycle
//! valgrind --tool=callgrind --toggle-collect='region_cycle::cycles_*' \
//!     target/release/examples/region_cycle memtoken 20000
//! valgrind --tool=callgrind --toggle-collect='region_cycle::cycles_*' \
//!     target/release/examples/region_cycle raw 20000
//! ```
//!
//! Each run prints the nanoseconds per cycle of the cycles it counts (after as many warm-up
//! cycles again, not counted): run both as separate processes, alternating, for a paired run.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/region.rs"]
mod region;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Budget, Device, make_guard, region::Region};
use region::{GRANULES, RawRegion};
use std::time::Instant;

const USAGE: &str = "\
usage: region_cycle [MODE] [CYCLES]

An elastic region grown by 16 granules and shrunk back CYCLES times (after as many warm-up
cycles), for instruction counts and paired timing runs (see the top of
examples/region_cycle.rs); prints the nanoseconds per cycle.

  MODE         memtoken (a Region, the default), tail (a Region with a mapped tail) or raw (the
               hand-written region of examples/common/region.rs)
  CYCLES       a whole number (default 20000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_memtoken<B: Backend>(region: &mut Region<'_, '_, B>, n: u64) {
    for _ in 0..n {
        region::once_memtoken(region, GRANULES);
    }
}

#[inline(never)]
fn cycles_raw<B: Backend>(raw: &mut RawRegion<'_, B>, n: u64) {
    for _ in 0..n {
        region::once_raw(raw, GRANULES);
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let modes = ["memtoken", "tail", "raw"];
    let (which, n) = cli::mode_and_count(USAGE, &modes, "CYCLES", ("memtoken", 20_000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // Both sides' steady state makes no create or release call (on `Faulty`'s counters).
    region::check_steady_state();
    let elapsed = match which {
        "memtoken" | "tail" => {
            make_guard!(guard);
            let device = Device::new(guard, HostBackend::with_defaults()?);
            let binding = device.bind(Budget::unlimited())?;
            let mut r = region::warm_region(&binding);
            if which == "tail" {
                // The mapped tail keeps every granule a shrink gives up: no backend call.
                r.set_tail_cap(GRANULES)?;
            }
            for _ in 0..n {
                region::once_memtoken(&mut r, GRANULES);
            }
            let start = Instant::now();
            cycles_memtoken(&mut r, n);
            let elapsed = start.elapsed();
            let bytes = (GRANULES * device.granularity()) as u64;
            assert_eq!(device.ledger().owned_bytes, bytes, "nothing created");
            r.release().complete()?;
            elapsed
        }
        "raw" => {
            let backend = HostBackend::with_defaults()?;
            let mut raw = region::warm_raw(&backend);
            for _ in 0..n {
                region::once_raw(&mut raw, GRANULES);
            }
            let start = Instant::now();
            cycles_raw(&mut raw, n);
            let elapsed = start.elapsed();
            assert_eq!(raw.free_granules(), GRANULES, "nothing created");
            elapsed
        }
        _ => unreachable!("a mode of the command line"),
    };
    let ns = elapsed.as_nanos() as f64 / n as f64;
    println!("{which}: {n} cycles of {GRANULES} granules, {ns:.1} ns per cycle");
    Ok(())
}
