//! A serving engine on memtoken: built by a constructor (`Engine::start`), it serves requests
//! on worker threads — each with its own KV cache and prefix cache, so requests that share a
//! system prompt share its blocks by reference and sample their continuations as forks with
//! copy-on-write — with `?` throughout. Between two phases of requests the engine's weights
//! sleep (suspended, their bytes saved: the device owns none of them) and wake at the same
//! address with the same bytes; the KV caches are let go and made again (their prefix caches
//! start empty). The ledger ends at zero.
//!
//! ```text
//! cargo run --release --example serving_engine [-- --workers N --requests R --seed S]
//! ```

#[path = "../common/cli.rs"]
mod cli;
#[path = "../common/mod.rs"]
mod common;
mod engine;

use cli::Arg;
use engine::{Config, Engine, Request, Stats, TOKENS_PER_PAGE};
use memtoken::backend::{HostBackend, HostConfig};
use memtoken::{Budget, Device, make_guard};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The workload: settable on the command line, printed at the start.
struct Workload {
    workers: usize,
    requests: usize,
    seed: u64,
}

const USAGE: &str = "\
usage: serving_engine [--workers N] [--requests R] [--seed S]

A serving engine with worker threads on memtoken
(cargo run --release --example serving_engine -- ARGS).

  --workers N    worker threads, each with a KV cache (default 4)
  --requests R   requests per phase (default 96)
  --seed S       seed of the prompts (default 7)
  -h, --help     print this usage";

/// The command line (`--help`: the usage, exit 0; a usage error: exit 2).
fn parse() -> Workload {
    let mut w = Workload {
        workers: 4,
        requests: 96,
        seed: 7,
    };
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        let Arg::Flag(flag) = arg else {
            cli.unknown(arg)
        };
        match flag.as_str() {
            "--workers" => w.workers = cli.value::<usize>(&flag).max(1),
            "--requests" => w.requests = cli.value(&flag),
            "--seed" => w.seed = cli.value(&flag),
            _ => cli.unknown(Arg::Flag(flag)),
        }
    }
    w
}

/// `n` requests: one of 4 system prompts of 256 tokens, one of 8 user prefixes of 64, and 20
/// tokens of their own; 4 samples of 32 tokens each.
fn requests(n: usize, seed: u64, first_id: u64) -> Vec<Request> {
    let mut state = seed.max(1);
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n as u64)
        .map(|i| {
            let (system, user) = ((next() % 4) as u32, (next() % 8) as u32);
            let id = first_id + i;
            let mut prompt: Vec<u32> = (0..256).map(|t| system * 100_000 + t).collect();
            prompt.extend((0..64).map(|t| 10_000_000 + user * 1_000 + t));
            prompt.extend((0..20).map(|t| 50_000_000 + id as u32 * 100 + t));
            Request {
                id,
                prompt,
                samples: 4,
                generate: 32,
            }
        })
        .collect()
}

fn print(phase: &str, stats: &Stats) {
    println!(
        "  {phase}: {} requests served; prefix cache {} hits of {} full prompt blocks ({:.1} %); \
         {} blocks copied on write; peak {} KiB owned shared by block, {} KiB without sharing",
        stats.requests,
        stats.hits,
        stats.lookups,
        100.0 * stats.hits as f64 / stats.lookups.max(1) as f64,
        stats.copies,
        stats.peak_pages * engine::PAGE / 1024,
        stats.peak_unshared_pages * engine::PAGE / 1024,
    );
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let w = parse();
    cli::exit(serve(&w))
}

/// The two phases of the workload, and the sleep between them.
fn serve(w: &Workload) -> Result<()> {
    println!(
        "serving_engine: {} workers, 2 phases of {} requests (4 system prompts of 256 tokens, 8 \
         user prefixes of 64, 20 tokens of their own; 4 samples of 32 tokens each; {}-token \
         blocks); the weights sleep and wake between the phases (seed {})",
        w.workers, w.requests, TOKENS_PER_PAGE, w.seed
    );
    make_guard!(guard);
    let device = Device::new(
        guard,
        HostBackend::new(HostConfig {
            granularity: 64 << 10,
            physical_capacity: 4 << 30,
            ..HostConfig::default()
        })?,
    );
    let binding = device.bind(Budget::unlimited())?;
    let weights_len = 8 << 20;
    let mut weights = binding.reserve(weights_len)?.commit()?;
    weights
        .as_mut_slice_of::<u32>()?
        .iter_mut()
        .enumerate()
        .for_each(|(i, w)| *w = i as u32);
    let config = Config { workers: w.workers };
    let first = std::thread::scope(|scope| {
        let engine = Engine::start(scope, &binding, config);
        for request in requests(w.requests, w.seed, 0) {
            engine.submit(request);
        }
        engine.finish()
    })?;
    print("phase 1", &first);
    // Sleep: the weights' bytes saved to the host, the device owns none of them; wake at the
    // same address with the same bytes.
    let at = weights.addr();
    let before = device.ledger().owned_bytes;
    let asleep = weights.suspend_saving()?;
    let during = device.ledger().owned_bytes;
    let weights = asleep.resume()?;
    assert_eq!(weights.addr(), at, "woke at another address");
    let intact = weights
        .as_slice_of::<u32>()?
        .iter()
        .enumerate()
        .all(|(i, &w)| w == i as u32);
    println!(
        "  sleep: the weights ({} KiB) suspended — owned bytes {} KiB → {} KiB — and resumed at \
         {at:#x}, every byte {}; the KV caches were let go with their workers and are made \
         again (their prefix caches start empty)",
        weights_len / 1024,
        before / 1024,
        during / 1024,
        if intact { "back" } else { "LOST" }
    );
    if !intact {
        return Err("the weights came back changed".into());
    }
    let second = std::thread::scope(|scope| {
        let engine = Engine::start(scope, &binding, config);
        for request in requests(w.requests, w.seed + 1, w.requests as u64) {
            engine.submit(request);
        }
        engine.finish()
    })?;
    print("phase 2", &second);
    weights.release().wait()?;
    drop(binding);
    let report = device.close();
    println!("  ledger at the end: {:?}", report.ledger);
    if !report.is_clean() {
        return Err(format!("the device did not close clean: {report:?}").into());
    }
    Ok(())
}
