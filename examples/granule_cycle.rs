//! The granule cycle of `benches/hot_paths.rs` (reserve, commit, release and complete one
//! granule on the host backend), as a plain program for instruction counting: tokens versus the
//! same backend calls made by hand. Callgrind counts user-space instructions only, so the
//! system calls that both make cancel out and the ratio shows what the tokens add.
//!
//! ```text
//! cargo build --release --example granule_cycle
//! valgrind --tool=callgrind --toggle-collect='granule_cycle::cycles_*' \
//!     target/release/examples/granule_cycle memtoken 20000
//! valgrind --tool=callgrind --toggle-collect='granule_cycle::cycles_*' \
//!     target/release/examples/granule_cycle raw 20000
//! ```

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/granule.rs"]
mod granule;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Binding, Budget, Device, make_guard};

const GRANULE: usize = 4096;
const USAGE: &str = "\
usage: granule_cycle [MODE] [CYCLES]

One granule reserved, committed and released CYCLES times on the host backend, for
instruction counts (callgrind; see the top of examples/granule_cycle.rs).

  MODE         memtoken (the tokens, the default) or raw (the same backend calls by hand)
  CYCLES       a whole number (default 20000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_memtoken<B: Backend>(binding: &Binding<'_, '_, B>, n: u64) {
    for _ in 0..n {
        granule::once_memtoken(binding, GRANULE);
    }
}

#[inline(never)]
fn cycles_raw<B: Backend>(raw: &B, n: u64) {
    for _ in 0..n {
        granule::once_raw(raw, GRANULE);
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let (which, n) =
        cli::mode_and_count(USAGE, &["memtoken", "raw"], "CYCLES", ("memtoken", 20_000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match which {
        "memtoken" => {
            make_guard!(guard);
            let device = Device::new(guard, HostBackend::with_defaults()?);
            let binding = device.bind(Budget::unlimited())?;
            cycles_memtoken(&binding, n);
        }
        "raw" => cycles_raw(&HostBackend::with_defaults()?, n),
        _ => unreachable!("a mode of the command line"),
    }
    println!("{which}: {n} cycles of one granule (reserve, commit, release)");
    Ok(())
}
