//! The region cycle of `benches/hot_paths.rs` (grow an elastic region by 16 granules, shrink it
//! back, in steady state: every granule comes from the cache) on the host backend, as a plain
//! program for instruction counting and for paired timing runs: a `memtoken::Region` versus the
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

mod common;
#[path = "common/region.rs"]
mod region;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Budget, Device, Region, make_guard};
use region::{GRANULES, RawRegion};
use std::time::Instant;

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

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if common::started_by_test_harness() {
        return Ok(());
    }
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "memtoken".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    // Both sides' steady state makes no create or release call (on `Faulty`'s counters).
    region::check_steady_state();
    let elapsed = match which.as_str() {
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
        _ => {
            eprintln!("usage: region_cycle memtoken|tail|raw [cycles]");
            std::process::exit(2);
        }
    };
    let ns = elapsed.as_nanos() as f64 / n as f64;
    println!("{which}: {n} cycles of {GRANULES} granules, {ns:.1} ns per cycle");
    Ok(())
}
