//! How much memory a prefix cache keeps mapped: a serving loop over a KV cache whose groups are
//! mapped on demand, with a prefix cache with no limit and with limits
//! ([`PrefixCache::set_limit`]), printing the groups mapped as it goes.
//!
//! Each step, 8 requests arrive: a system prompt of 4 blocks, one of 32, then a user's own 4
//! to 12 blocks. Their prompt blocks are looked up (the system prompt hits once it has been
//! seen), the rest pushed, every full block entered under its prefix's key; each request then
//! decodes for 3 to 10 steps, a block every other step, and ends. `replenish` runs between
//! steps with watermarks of 1 and 2 idle groups.
//!
//! ```text
//! cargo run --release --example kv_footprint [STEPS]
//! ```

#[path = "common/cli.rs"]
mod cli;
mod common;

use memtoken::backend::{HostBackend, HostConfig};
use memtoken::kv::{BlockTable, KvCache, Layout, PrefixCache};
use memtoken::{Budget, Device, make_guard};

const USAGE: &str = "\
usage: kv_footprint [STEPS]

A serving loop over a KV cache of 16 Ki blocks (groups of 64 mapped on demand) with a prefix
cache without a limit and with limits of 2,048 and 512 blocks; prints the groups mapped.

  STEPS        a whole number (default 400)
  -h, --help   print this usage";

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let mut args = cli::Args::new(USAGE);
    let mut steps = 400;
    if let Some(arg) = args.next_arg() {
        match arg {
            cli::Arg::Positional(n) => steps = args.parse("STEPS", &n),
            other => args.unknown(other),
        }
    }
    if let Some(arg) = args.next_arg() {
        args.unknown(arg);
    }
    cli::exit(run(steps))
}

fn run(steps: u64) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    println!(
        "| prefix cache limit | groups mapped: peak | at the end | blocks held at the end | cached at the end | hits |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for limit in [None, Some(2048), Some(512)] {
        let r = serve(steps, limit)?;
        let name = limit.map_or("none".to_string(), |l| format!("{l} blocks"));
        println!(
            "| {name} | {} of {} | {} | {} | {} | {} |",
            r.peak, r.groups, r.end, r.held, r.cached, r.hits
        );
    }
    Ok(())
}

struct Report {
    groups: usize,
    peak: usize,
    end: usize,
    held: usize,
    cached: usize,
    hits: u64,
}

/// A request: its table, the key of its last full block, and the steps it has left.
struct Request<'t, 'c, 'b, 'id> {
    table: BlockTable<'t, 'c, 'b, 'id, HostBackend>,
    key: u64,
    left: u64,
}

/// A block into `table`: with no room, groups are mapped first (as an engine does before it
/// schedules more work).
fn push<'c, 'b, 'id>(
    cache: &KvCache<'c, 'b, 'id, HostBackend>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, HostBackend>,
) -> Result<u32, memtoken::kv::KvError> {
    cache.push(table).or_else(|_| {
        cache.replenish()?;
        cache.push(table)
    })
}

fn serve(
    steps: u64,
    limit: Option<usize>,
) -> Result<Report, Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(
        guard,
        HostBackend::new(HostConfig {
            granularity: 64 << 10,
            physical_capacity: 1 << 30,
            ..HostConfig::default()
        })?,
    );
    let binding = device.bind(Budget::unlimited())?;
    make_guard!(g);
    let cache = KvCache::new(
        g,
        &binding,
        &Layout::new(16 << 10, 16).plane(1024).plane(1024),
    )?;
    cache.set_watermarks(1, 2);
    let mut prefixes = PrefixCache::new(&cache)?;
    prefixes.set_limit(limit);
    let mut rng = Rng(7);
    let mut running: Vec<Request<'_, '_, '_, '_>> = Vec::new();
    let (mut peak, mut hits) = (0, 0);
    for step in 0..steps {
        cache.replenish()?;
        for _ in 0..8 {
            let system = rng.below(32);
            let mut table = cache.table();
            let mut key = system.wrapping_mul(0x100_0000_01b3);
            let user = 4 + rng.below(9);
            for position in 0..4 + user {
                // The chained key of the prefix up to this block: the user's blocks are their
                // own (a fresh random part), the system prompt's are shared.
                let own = if position < 4 { position } else { rng.next() };
                key = key.rotate_left(17) ^ own.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                if position < 4 && prefixes.lookup(&key, &mut table) {
                    hits += 1;
                    continue;
                }
                push(&cache, &mut table)?;
                prefixes.enter(&table, position as usize, key);
            }
            running.push(Request {
                table,
                key,
                left: 3 + rng.below(8),
            });
        }
        for r in &mut running {
            if step % 2 == 0 {
                push(&cache, &mut r.table)?;
                r.key = r.key.rotate_left(17) ^ rng.next();
                prefixes.enter(&r.table, r.table.len() - 1, r.key);
            }
            r.left -= 1;
        }
        running.retain(|r| r.left > 0);
        peak = peak.max(cache.mapped_groups());
    }
    let held = cache.live_blocks();
    drop(running);
    cache.replenish()?;
    Ok(Report {
        groups: cache.groups(),
        peak,
        end: cache.mapped_groups(),
        held,
        cached: prefixes.len(),
        hits,
    })
}
