//! Shared pages (issue 24) as plain programs for instruction counting, against the
//! hand-written reference-count pool (`benches/common/rc_pool.rs`):
//!
//! - `fork`: fork a 1,000-page table (every page counted once more) and release the fork;
//! - `share`: share the 16 pages of a sequence one by one (one more holder each), then let
//!   each go.
//!
//! ```text
//! cargo build --release --example share_cycle
//! valgrind --tool=callgrind --toggle-collect='share_cycle::cycles_*' \
//!     target/release/examples/share_cycle raw-fork 1000
//! valgrind --tool=callgrind --toggle-collect='share_cycle::cycles_*' \
//!     target/release/examples/share_cycle raw-share 100000
//! ```

mod common;
#[path = "../benches/common/raw_pool.rs"]
mod raw_pool;
#[path = "../benches/common/rc_pool.rs"]
mod rc_pool;

use memtoken::backend::{Backend, HostBackend};
use rc_pool::RcPool;
use std::hint::black_box;

const PAGE: usize = 4096;
const FORK_PAGES: usize = 1000;
const SEQ_PAGES: usize = 16;

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

/// A reference pool of `pages` pages held by one table.
fn raw_table<B: Backend>(backend: &B, pages: usize) -> (RcPool<'_, B>, Vec<u32>) {
    let mut pool = RcPool::new(backend, PAGE);
    let table = (0..pages).map(|_| pool.alloc().unwrap()).collect();
    (pool, table)
}

fn main() {
    if common::started_by_test_harness() {
        return;
    }
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "raw-fork".into());
    let n: u64 = args.next().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let backend = HostBackend::with_defaults().unwrap();
    match which.as_str() {
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
        other => {
            eprintln!("usage: share_cycle raw-fork|raw-share [cycles]  (got {other:?})");
            std::process::exit(2);
        }
    }
    println!("{which}: {n} cycles");
}
