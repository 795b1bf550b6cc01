//! The page cycle of `benches/hot_paths.rs` (allocate a 256-token sequence's 16 pages, free
//! them), as a plain program for instruction counting: tokens versus the hand-written pool.
//!
//! ```text
//! cargo build --release --example page_cycle
//! valgrind --tool=callgrind --toggle-collect='page_cycle::cycles_*' \
//!     target/release/examples/page_cycle memtoken 100000
//! valgrind --tool=callgrind --toggle-collect='page_cycle::cycles_*' \
//!     target/release/examples/page_cycle raw 100000
//! ```
//!
//! `cargo run --release --bin bench_report` runs both and prints the ratio.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/raw_pool.rs"]
mod raw_pool;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Budget, Device, PagePool, make_guard};
use raw_pool::RawPool;
use std::hint::black_box;

const PAGE: usize = 4096;
const SEQ_PAGES: usize = 16;
const USAGE: &str = "\
usage: page_cycle [MODE] [CYCLES]

A 256-token sequence's 16 pages allocated and freed CYCLES times, for instruction counts
(callgrind; see the top of examples/page_cycle.rs).

  MODE         memtoken (a PagePool's page table, the default), pages (the pool's alloc and
               free, page by page) or raw (the hand-written pool of examples/common/raw_pool.rs)
  CYCLES       a whole number (default 1000000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_memtoken<B: Backend>(pool: &PagePool<'_, '_, '_, B>, n: u64) {
    let mut table = pool.table();
    for _ in 0..n {
        for _ in 0..SEQ_PAGES {
            pool.push(&mut table).unwrap();
        }
        black_box(table.len());
        pool.clear(&mut table);
    }
}

#[inline(never)]
fn cycles_pages<B: Backend>(pool: &PagePool<'_, '_, '_, B>, n: u64) {
    let mut table = Vec::with_capacity(SEQ_PAGES);
    for _ in 0..n {
        for _ in 0..SEQ_PAGES {
            table.push(pool.alloc().unwrap());
        }
        black_box(table.len());
        for page in table.drain(..) {
            pool.free(page);
        }
    }
}

#[inline(never)]
fn cycles_raw<B: Backend>(pool: &mut RawPool<'_, B>, n: u64) {
    let mut table = Vec::with_capacity(SEQ_PAGES);
    for _ in 0..n {
        for _ in 0..SEQ_PAGES {
            table.push(pool.alloc().unwrap());
        }
        black_box(table.len());
        pool.free_all(&table);
        table.clear();
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let modes = ["memtoken", "pages", "raw"];
    let (which, n) = cli::mode_and_count(USAGE, &modes, "CYCLES", ("memtoken", 1_000_000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match which {
        "memtoken" | "pages" => {
            make_guard!(guard);
            let device = Device::new(guard, HostBackend::with_defaults()?);
            let binding = device.bind(Budget::unlimited())?;
            make_guard!(pool_guard);
            let pool = PagePool::new(pool_guard, &binding, PAGE)?;
            for _ in 0..SEQ_PAGES {
                pool.grow()?;
            }
            if which == "memtoken" {
                cycles_memtoken(&pool, n);
            } else {
                cycles_pages(&pool, n);
            }
        }
        "raw" => {
            let backend = HostBackend::with_defaults()?;
            let mut pool = RawPool::new(&backend, PAGE);
            for _ in 0..SEQ_PAGES {
                pool.grow().expect("the raw pool grows");
            }
            cycles_raw(&mut pool, n);
        }
        _ => unreachable!("a mode of the command line"),
    }
    println!("{which}: {n} cycles of {SEQ_PAGES} pages");
    Ok(())
}
