//! Block-level sharing in a paged KV cache: a prefix cache keyed by the whole prefix, and
//! parallel sampling as forks with copy-on-write — what an LLM-serving engine does with its
//! KV cache, on memtoken's `kv::KvCache`.
//!
//! Requests arrive over time. Each prompt is a system prompt (one of a few) and a user prefix
//! (one of a few, some far more frequent), then a few tokens of its own. The engine looks each
//! full block of the prompt up in the `kv::PrefixCache` under a key chained from its parent
//! block's key; a hit is a block shared by reference, a miss computes the block's K/V and
//! enters it. Each request samples several continuations in parallel: the prompt's table is
//! forked (no byte copied), and the first token a sample writes into the shared last block
//! copies that one block. Finished requests let their blocks go; cached ones stay findable until
//! the cache needs them (at most 2,048 of them). Every block's bytes are checked when its
//! request finishes, and the ledger ends at zero.
//!
//! ```text
//! cargo run --release --example prefix_cache [-- --requests N --live L --samples K
//!     --system-prompts S --system-tokens T --user-prefixes U --user-tokens V
//!     --own-tokens W --generate G --seed X]
//! ```

#[path = "common/cli.rs"]
mod cli;
mod common;
// The block keys, K/V bytes, samples and their check, shared with the serving engine.
#[allow(dead_code)]
#[path = "serving_engine/engine.rs"]
mod engine;

use cli::Arg;
use engine::{
    BYTES_PER_TOKEN, CACHED_BLOCKS, PAGE, Sample, TOKENS_PER_PAGE, admit, check, copy_on_write,
    kv_byte, layout, push,
};
use memtoken::backend::{Backend, HostBackend, HostConfig};
use memtoken::kv::{KvCache, PrefixCache};
use memtoken::{Budget, Device, make_guard};
use std::error::Error;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// The workload, all settable on the command line.
#[derive(Debug)]
struct Workload {
    requests: usize,
    live: usize,
    samples: usize,
    system_prompts: usize,
    system_tokens: usize,
    user_prefixes: usize,
    user_tokens: usize,
    own_tokens: usize,
    generate: usize,
    seed: u64,
}

const USAGE: &str = "\
usage: prefix_cache [--requests N] [--live L] [--samples K] [--system-prompts S]
                    [--system-tokens T] [--user-prefixes U] [--user-tokens V] [--own-tokens W]
                    [--generate G] [--seed X]

A paged KV cache with a prefix cache and parallel sampling, on memtoken
(cargo run --release --example prefix_cache -- ARGS).

  --requests N        requests that arrive (default 256)
  --live L            requests served at once (default 16)
  --samples K         continuations sampled per request, as forks (default 4)
  --system-prompts S  distinct system prompts (default 3)
  --system-tokens T   tokens in a system prompt (default 512)
  --user-prefixes U   distinct user prefixes, the first ones most frequent (default 12)
  --user-tokens V     tokens in a user prefix (default 128)
  --own-tokens W      tokens of a request's own after them (default 24)
  --generate G        tokens each sample generates (default 64)
  --seed X            seed of the choices (default 7)
  -h, --help          print this usage";

/// The command line (`--help`: the usage, exit 0; a usage error: exit 2).
fn parse() -> Workload {
    let mut w = Workload {
        requests: 256,
        live: 16,
        samples: 4,
        system_prompts: 3,
        system_tokens: 512,
        user_prefixes: 12,
        user_tokens: 128,
        own_tokens: 24,
        generate: 64,
        seed: 7,
    };
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        let Arg::Flag(flag) = arg else {
            cli.unknown(arg)
        };
        match flag.as_str() {
            "--requests" => w.requests = cli.value(&flag),
            "--live" => w.live = cli.value::<usize>(&flag).max(1),
            "--samples" => w.samples = cli.value::<usize>(&flag).max(1),
            "--system-prompts" => w.system_prompts = cli.value::<usize>(&flag).max(1),
            "--system-tokens" => w.system_tokens = cli.value(&flag),
            "--user-prefixes" => w.user_prefixes = cli.value::<usize>(&flag).max(1),
            "--user-tokens" => w.user_tokens = cli.value(&flag),
            "--own-tokens" => w.own_tokens = cli.value::<usize>(&flag).max(1),
            "--generate" => w.generate = cli.value(&flag),
            "--seed" => w.seed = cli.value(&flag),
            _ => cli.unknown(Arg::Flag(flag)),
        }
    }
    w
}

/// A tiny xorshift: the workload is reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// One of `n`, the first ones more likely (the square of a uniform draw).
    fn skewed(&mut self, n: usize) -> usize {
        let u = (self.next() % 1024) as f64 / 1024.0;
        ((u * u) * n as f64) as usize
    }
}

/// A request's prompt: system prompt, user prefix, and its own tokens.
fn prompt(w: &Workload, rng: &mut Rng, id: usize) -> Vec<u32> {
    let system = rng.skewed(w.system_prompts) as u32;
    let user = rng.skewed(w.user_prefixes) as u32;
    let mut tokens: Vec<u32> = (0..w.system_tokens as u32)
        .map(|t| system * 100_000 + t)
        .collect();
    tokens.extend((0..w.user_tokens as u32).map(|t| 10_000_000 + user * 100_000 + t));
    tokens.extend((0..w.own_tokens as u32).map(|t| 50_000_000 + id as u32 * 1_000 + t));
    tokens
}

struct Stats {
    hits: usize,
    lookups: usize,
    copies: usize,
    peak_pages: usize,
    peak_unshared_pages: usize,
}

fn run<B: Backend>(device: &Device<'_, B>, w: &Workload) -> Result<Stats> {
    let binding = device.bind(Budget::unlimited())?;
    make_guard!(cache_guard);
    let kv = KvCache::new(cache_guard, &binding, &layout())?;
    kv.set_watermarks(4, 16);
    let mut cache = PrefixCache::new(&kv)?;
    cache.set_limit(Some(CACHED_BLOCKS));
    let mut rng = Rng(w.seed.max(1));
    let mut stats = Stats {
        hits: 0,
        lookups: 0,
        copies: 0,
        peak_pages: 0,
        peak_unshared_pages: 0,
    };
    let mut live: Vec<(Vec<Sample<'_, '_, '_, '_, B>>, usize)> = Vec::new();
    let mut next = 0;
    while next < w.requests || !live.is_empty() {
        // Admit requests while there is room.
        while live.len() < w.live && next < w.requests {
            let tokens = prompt(w, &mut rng, next);
            next += 1;
            let (table, keys) = admit(
                &kv,
                &mut cache,
                &tokens,
                (&mut stats.lookups, &mut stats.hits),
            )?;
            // Parallel sampling: the prompt's table forked, no byte copied.
            let samples = (0..w.samples)
                .map(|_| Sample {
                    table: kv.fork(&table),
                    keys: keys.clone(),
                    tokens: tokens.len(),
                })
                .collect();
            drop(table);
            live.push((samples, w.generate));
        }
        // One token for every sample of every live request.
        for (samples, left) in &mut live {
            for (s, sample) in samples.iter_mut().enumerate() {
                let slot = sample.tokens % TOKENS_PER_PAGE;
                if slot == 0 {
                    push(&kv, &mut sample.table)?;
                    sample.keys.push(rng.next() ^ s as u64);
                } else {
                    let last = sample.table.len() - 1;
                    if copy_on_write(&kv, &mut sample.table, last)? {
                        stats.copies += 1;
                    }
                }
                let last = sample.table.len() - 1;
                let k = sample.keys[last];
                let bytes = [kv_byte(k, slot); BYTES_PER_TOKEN];
                sample
                    .table
                    .write(0, last, slot * BYTES_PER_TOKEN, &bytes)?;
                sample.tokens += 1;
            }
            *left -= 1;
        }
        stats.peak_pages = stats.peak_pages.max(kv.live_blocks());
        let unshared: usize = live
            .iter()
            .flat_map(|(samples, _)| samples)
            .map(|s| s.table.len())
            .sum();
        stats.peak_unshared_pages = stats.peak_unshared_pages.max(unshared);
        // Finished requests: every byte checked, then their blocks let go.
        let (done, going): (Vec<_>, Vec<_>) = live.into_iter().partition(|(_, left)| *left == 0);
        live = going;
        for (samples, _) in done {
            for sample in &samples {
                check(sample)?;
            }
        }
    }
    let evicted = kv.evict_idle();
    drop(cache);
    assert_eq!(kv.live_blocks(), 0);
    println!(
        "  at the end: {evicted} cached blocks evicted, every block back in the cache ({} of {} \
         groups mapped)",
        kv.mapped_groups(),
        kv.groups()
    );
    Ok(stats)
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let w = parse();
    cli::exit(run_workload(&w))
}

/// The workload, run and reported.
fn run_workload(w: &Workload) -> Result<()> {
    let prompt_tokens = w.system_tokens + w.user_tokens + w.own_tokens;
    println!(
        "prefix_cache: {} requests, {} at a time; each a {}-token prompt ({} system prompts of \
         {} tokens, {} user prefixes of {}, {} tokens of its own), {} samples of {} tokens each; \
         {}-token blocks of {} KiB (seed {})",
        w.requests,
        w.live,
        prompt_tokens,
        w.system_prompts,
        w.system_tokens,
        w.user_prefixes,
        w.user_tokens,
        w.own_tokens,
        w.samples,
        w.generate,
        TOKENS_PER_PAGE,
        PAGE / 1024,
        w.seed
    );
    make_guard!(guard);
    let backend = HostBackend::new(HostConfig {
        granularity: 64 << 10,
        physical_capacity: 4 << 30,
        ..HostConfig::default()
    })?;
    let device = Device::new(guard, backend);
    let stats = run(&device, w)?;
    let shared = stats.peak_pages * PAGE;
    let unshared = stats.peak_unshared_pages * PAGE;
    println!(
        "  prefix cache: {} hits of {} full prompt blocks looked up ({:.1} %)",
        stats.hits,
        stats.lookups,
        100.0 * stats.hits as f64 / stats.lookups.max(1) as f64
    );
    println!(
        "  copy-on-write: {} blocks copied (a sample's first write into a shared block)",
        stats.copies
    );
    println!(
        "  peak bytes the live requests own: {} KiB shared by block, {} KiB without sharing \
         ({:.2} of it, {} KiB saved)",
        shared / 1024,
        unshared / 1024,
        shared as f64 / unshared.max(1) as f64,
        (unshared - shared.min(unshared)) / 1024
    );
    let ledger = device.ledger();
    println!("  ledger at the end: {ledger:?}");
    if !ledger.is_zero() {
        return Err("the ledger did not end at zero".into());
    }
    if shared * 2 > unshared {
        return Err(format!("sharing saved less than half: {shared} of {unshared} bytes").into());
    }
    Ok(())
}
