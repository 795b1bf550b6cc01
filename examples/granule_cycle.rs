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

mod common;
#[path = "common/granule.rs"]
mod granule;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Binding, Budget, Device, make_guard};

const GRANULE: usize = 4096;
const USAGE: &str = "usage: granule_cycle [memtoken|raw] [cycles]  (default: memtoken 20000)";

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

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    if common::started_by_test_harness() {
        return Ok(());
    }
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "memtoken".into());
    let n: u64 = match args.next().map(|s| s.parse()) {
        None => 20_000,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("granule_cycle: cycles must be a whole number ({e})\n{USAGE}");
            std::process::exit(2);
        }
    };
    match which.as_str() {
        "memtoken" => {
            make_guard!(guard);
            let device = Device::new(guard, HostBackend::with_defaults()?);
            let binding = device.bind(Budget::unlimited())?;
            cycles_memtoken(&binding, n);
        }
        "raw" => cycles_raw(&HostBackend::with_defaults()?, n),
        "--help" | "-h" => {
            println!("{USAGE}");
            return Ok(());
        }
        other => {
            eprintln!("granule_cycle: no mode {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
    println!("{which}: {n} cycles of one granule (reserve, commit, release)");
    Ok(())
}
