//! The sleep/wake cycle of `benches/hot_paths.rs` (suspend a 64 MiB allocation with its bytes
//! saved to the host, resume it at the same address with its bytes) on the host backend, as a
//! plain program for instruction counting and paired timing runs: `suspend_saving` + `resume`
//! versus the same backend calls by hand (`examples/common/sleep.rs`).
//!
//! ```text
//! cargo build --release --example sleep_wake
//! valgrind --tool=callgrind --toggle-collect='sleep_wake::cycles_*' \
//!     target/release/examples/sleep_wake memtoken 5
//! valgrind --tool=callgrind --toggle-collect='sleep_wake::cycles_*' \
//!     target/release/examples/sleep_wake raw 5
//! ```
//!
//! Each run prints the milliseconds per cycle of the cycles it counts (after one warm-up cycle).

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/sleep.rs"]
mod sleep;

use memtoken::backend::{Addr, Backend};
use memtoken::{Allocation, Budget, Committed, Device, make_guard};
use std::time::Instant;

const USAGE: &str = "\
usage: sleep_wake [MODE] [CYCLES]

A 64 MiB allocation suspended with its bytes saved and resumed at its address CYCLES times
(after one warm-up cycle), for instruction counts and paired timing runs (see the top of
examples/sleep_wake.rs); prints the milliseconds per cycle.

  MODE         memtoken (suspend_saving + resume, the default) or raw (the same backend calls
               by hand)
  CYCLES       a whole number (default 20)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_memtoken<'b, 'id, B: Backend>(
    mut a: Allocation<'b, 'id, B, Committed>,
    n: u64,
) -> Allocation<'b, 'id, B, Committed> {
    for _ in 0..n {
        a = sleep::once_memtoken(a);
    }
    a
}

#[inline(never)]
fn cycles_raw<B: Backend>(raw: &B, addr: Addr, mut phys: B::Phys, n: u64) -> B::Phys {
    for _ in 0..n {
        phys = sleep::once_raw(raw, addr, phys);
    }
    phys
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let (which, n) = cli::mode_and_count(USAGE, &["memtoken", "raw"], "CYCLES", ("memtoken", 20));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let elapsed = match which {
        "memtoken" => {
            make_guard!(guard);
            let device = Device::new(guard, sleep::backend());
            let binding = device.bind(Budget::unlimited())?;
            let mut a = binding.reserve(sleep::LEN)?.commit()?;
            a.as_mut_slice().fill(7);
            let a = sleep::once_memtoken(a);
            let start = Instant::now();
            let a = cycles_memtoken(a, n);
            let elapsed = start.elapsed();
            assert!(a.as_slice().iter().all(|&b| b == 7), "every byte woke");
            elapsed
        }
        "raw" => {
            let raw = sleep::backend();
            let (addr, phys) = sleep::raw_committed(&raw, 7);
            let phys = sleep::once_raw(&raw, addr, phys);
            let start = Instant::now();
            let phys = cycles_raw(&raw, addr, phys, n);
            let elapsed = start.elapsed();
            let mut seen = vec![0; sleep::LEN];
            raw.copy_to_host(&mut seen, addr)?;
            assert!(seen.iter().all(|&b| b == 7), "every byte woke");
            let _ = phys;
            elapsed
        }
        _ => unreachable!("a mode of the command line"),
    };
    let per = elapsed.as_secs_f64() * 1e3 / n.max(1) as f64;
    println!("{which}: {n} cycles, {per:.3} ms per cycle");
    Ok(())
}
