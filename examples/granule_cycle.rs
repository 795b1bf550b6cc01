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

use memtoken::backend::{Access, Backend, HostBackend};
use memtoken::{Binding, Budget, Device, make_guard};
use std::hint::black_box;

const GRANULE: usize = 4096;

#[inline(never)]
fn cycles_memtoken<B: Backend>(binding: &Binding<'_, '_, B>, n: u64) {
    for _ in 0..n {
        let a = binding.reserve(black_box(GRANULE)).unwrap();
        let a = a.commit().unwrap();
        black_box(a.addr());
        black_box(a.release().complete().unwrap());
    }
}

#[inline(never)]
fn cycles_raw<B: Backend>(raw: &B, n: u64) {
    for _ in 0..n {
        let len = black_box(GRANULE);
        let addr = raw.reserve(len).unwrap();
        let phys = raw.create(len).unwrap();
        raw.map(addr, len, phys, 0, Access::ReadWrite).unwrap();
        black_box(addr);
        let fence = raw.fence();
        assert!(raw.fence_done(&fence));
        raw.retire_fence(fence);
        raw.unmap(addr, len).unwrap();
        raw.release(phys, len).unwrap();
        raw.free(addr, len).unwrap();
    }
}

fn main() {
    // `cargo test --no-run` builds examples too, and some runners then start every binary it
    // built with the test harness's flags: this is a program, not a test binary.
    if std::env::args().any(|a| a == "--include-ignored" || a.starts_with("--test-threads")) {
        eprintln!("an example, not a test binary: run it with `cargo run --release --example`");
        return;
    }
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "memtoken".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    match which.as_str() {
        "memtoken" => {
            make_guard!(guard);
            let device = Device::new(guard, HostBackend::with_defaults().unwrap());
            let binding = device.bind(Budget::unlimited()).unwrap();
            cycles_memtoken(&binding, n);
        }
        "raw" => cycles_raw(&HostBackend::with_defaults().unwrap(), n),
        _ => {
            eprintln!("usage: granule_cycle memtoken|raw [cycles]");
            std::process::exit(2);
        }
    }
}
