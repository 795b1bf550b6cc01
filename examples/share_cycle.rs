//! Shared pages as plain programs for instruction counting: memtoken's
//! `PagePool` (`fork`, `share`) against the hand-written reference-count pool
//! (`examples/common/rc_pool.rs`, `raw-fork`, `raw-share`):
//!
//! - `fork`: fork a 1,000-page table (every page counted once more) and release the fork;
//! - `share`: one more holder of each of a sequence's 16 pages, let go again — memtoken's
//!   `share` returns a token, so each is let go before the next (`raw-share`, the reference,
//!   counts 16 holders up, then 16 down: the same operations a page).
//!
//! ```text
//! cargo build --release --example share_cycle
//! for mode in fork raw-fork; do valgrind --tool=callgrind \
//!     --toggle-collect='share_cycle::cycles_*' target/release/examples/share_cycle $mode 1000; done
//! for mode in share raw-share; do valgrind --tool=callgrind \
//!     --toggle-collect='share_cycle::cycles_*' target/release/examples/share_cycle $mode 100000; done
//! ```

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/raw_pool.rs"]
mod raw_pool;
#[path = "common/rc_pool.rs"]
mod rc_pool;

use memtoken::backend::{Backend, HostBackend};
use memtoken::{Budget, Device, PagePool, SharedTable, make_guard};
use rc_pool::RcPool;
use std::hint::black_box;

const PAGE: usize = 4096;
const FORK_PAGES: usize = 1000;
const SEQ_PAGES: usize = 16;
const USAGE: &str = "\
usage: share_cycle [MODE] [CYCLES]

Shared pages, for instruction counts (callgrind; see the top of examples/share_cycle.rs).

  MODE         fork (fork a 1,000-page table and release the fork), share (one more holder of
               each of 16 pages, let go again) on memtoken's PagePool, or raw-fork (the
               default), raw-share: the same on the reference-count pool of
               examples/common/rc_pool.rs
  CYCLES       a whole number (default 1000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_raw_fork<B: Backend>(pool: &mut RcPool<'_, B>, table: &[u32], n: u64) {
    for _ in 0..n {
        let fork = pool.fork(table);
        black_box(fork.len());
        pool.release(&fork);
    }
}

#[inline(never)]
fn cycles_raw_share<B: Backend>(pool: &mut RcPool<'_, B>, table: &[u32], n: u64) {
    for _ in 0..n {
        for &index in table {
            pool.share(black_box(index));
        }
        for &index in table {
            pool.unshare(black_box(index));
        }
    }
}

#[inline(never)]
fn cycles_fork<'pool, 'b, 'id, B: Backend>(
    pool: &PagePool<'pool, 'b, 'id, B>,
    table: &SharedTable<'_, 'pool, 'b, 'id, B>,
    n: u64,
) {
    for _ in 0..n {
        let fork = pool.fork(table);
        black_box(fork.len());
        drop(fork);
    }
}

#[inline(never)]
fn cycles_share<'pool, 'b, 'id, B: Backend>(
    pool: &PagePool<'pool, 'b, 'id, B>,
    table: &SharedTable<'_, 'pool, 'b, 'id, B>,
    n: u64,
) {
    for _ in 0..n {
        // Each of the 16 pages: one more holder, which then lets it go.
        for position in 0..table.len() {
            let page = pool.share(table, black_box(position));
            drop(black_box(page));
        }
    }
}

/// A reference pool of `pages` pages held by one table.
fn raw_table<B: Backend>(backend: &B, pages: usize) -> (RcPool<'_, B>, Vec<u32>) {
    let mut pool = RcPool::new(backend, PAGE);
    let table = (0..pages).map(|_| pool.alloc().unwrap()).collect();
    (pool, table)
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let modes = ["fork", "share", "raw-fork", "raw-share"];
    let (which, n) = cli::mode_and_count(USAGE, &modes, "CYCLES", ("raw-fork", 1000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let backend = HostBackend::with_defaults()?;
    if which == "fork" || which == "share" {
        make_guard!(guard);
        let device = Device::new(guard, HostBackend::with_defaults()?);
        let binding = device.bind(Budget::unlimited())?;
        make_guard!(pool_guard);
        let pool = PagePool::new(pool_guard, &binding, PAGE)?;
        let pages = if which == "fork" {
            FORK_PAGES
        } else {
            SEQ_PAGES
        };
        let mut table = pool.shared_table();
        for _ in 0..pages {
            pool.push(&mut table)?;
        }
        if which == "fork" {
            cycles_fork(&pool, &table, n);
        } else {
            cycles_share(&pool, &table, n);
        }
        println!("{which}: {n} cycles");
        return Ok(());
    }
    match which {
        "raw-fork" => {
            let (mut pool, table) = raw_table(&backend, FORK_PAGES);
            cycles_raw_fork(&mut pool, &table, n);
            pool.release(&table);
        }
        "raw-share" => {
            let (mut pool, table) = raw_table(&backend, SEQ_PAGES);
            cycles_raw_share(&mut pool, &table, n);
            pool.release(&table);
        }
        _ => unreachable!("a mode of the command line"),
    }
    println!("{which}: {n} cycles");
    Ok(())
}
