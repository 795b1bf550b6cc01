//! A small paged KV cache on the host backend: sequences arrive, grow one page every 16 tokens,
//! finish and give their pages back. Every page is a linear token; the table shows what the
//! device's ledger saw, and the run ends with the ledger at zero.
//!
//! ```text
//! cargo run --release --example kv_cache [-- --sequences N --seed S]
//! ```

use memtoken::backend::{HostBackend, HostConfig};
use memtoken::{Allocation, Binding, Budget, Committed, Device, make_guard};
use std::error::Error;

const TOKENS_PER_PAGE: usize = 16;
/// Bytes of K and V one token needs in this toy model (one 4 KiB page holds 16 tokens).
const BYTES_PER_TOKEN: usize = 256;
const PAGE: usize = TOKENS_PER_PAGE * BYTES_PER_TOKEN;

struct Sequence<'b, 'id> {
    id: usize,
    target: usize,
    tokens: usize,
    pages: Vec<Allocation<'b, 'id, HostBackend, Committed>>,
}

impl<'b, 'id> Sequence<'b, 'id> {
    /// Appends one token's K/V, committing a new page when the last one is full.
    fn push_token(
        &mut self,
        binding: &'b Binding<'b, 'id, HostBackend>,
    ) -> Result<(), Box<dyn Error>> {
        if self.tokens.is_multiple_of(TOKENS_PER_PAGE) {
            let page = binding.reserve(PAGE)?.commit().map_err(|e| e.cause)?;
            self.pages.push(page);
        }
        let slot = (self.tokens % TOKENS_PER_PAGE) * BYTES_PER_TOKEN;
        let page = self.pages.last_mut().expect("a page was just ensured");
        page.as_mut_slice()[slot..slot + BYTES_PER_TOKEN].fill((self.id + self.tokens) as u8);
        self.tokens += 1;
        Ok(())
    }

    /// Reads back every token's K/V: what was written is still there.
    fn verify(&self) -> bool {
        (0..self.tokens).all(|t| {
            let page = &self.pages[t / TOKENS_PER_PAGE];
            let slot = (t % TOKENS_PER_PAGE) * BYTES_PER_TOKEN;
            page.as_slice()[slot..slot + BYTES_PER_TOKEN]
                .iter()
                .all(|&b| b == (self.id + t) as u8)
        })
    }

    /// Releases every page explicitly (consuming the tokens), returning how many.
    fn finish(self) -> Result<usize, Box<dyn Error>> {
        let n = self.pages.len();
        for page in self.pages {
            page.release().complete().map_err(|e| e.to_string())?;
        }
        Ok(n)
    }
}

struct Args {
    sequences: usize,
    seed: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sequences: 24,
        seed: 7,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match flag.as_str() {
            "--sequences" => args.sequences = value("--sequences")? as usize,
            "--seed" => args.seed = value("--seed")?,
            "-h" | "--help" => {
                println!(
                    "kv_cache: a paged KV cache on memtoken's host backend\n\n\
                     --sequences N   how many sequences arrive (default 24)\n\
                     --seed S        seed of the sequence lengths (default 7)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    make_guard!(guard);
    let backend = HostBackend::new(HostConfig {
        granularity: PAGE,
        physical_capacity: 256 << 20,
        ..HostConfig::default()
    })?;
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::bytes(64 << 20))?;

    // A tiny xorshift for reproducible sequence lengths (16 to 400 tokens).
    let mut state = args.seed.max(1);
    let mut next_len = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        16 + (state % 385) as usize
    };

    let mut waiting: Vec<Sequence> = (0..args.sequences)
        .map(|id| Sequence {
            id,
            target: next_len(),
            tokens: 0,
            pages: Vec::new(),
        })
        .collect();
    waiting.reverse();
    let mut running: Vec<Sequence> = Vec::new();
    let (mut pages_committed, mut pages_released, mut finished) = (0usize, 0usize, 0usize);
    let max_batch = 8;

    println!(
        "memtoken kv_cache: {} sequences, {PAGE}-byte pages of {TOKENS_PER_PAGE} tokens, host backend\n",
        args.sequences
    );
    println!(
        "{:>5} {:>8} {:>8} {:>6} {:>11} {:>11} {:>11}",
        "step", "running", "finished", "pages", "mapped KiB", "owned KiB", "quarantine"
    );
    let mut step = 0;
    while !waiting.is_empty() || !running.is_empty() {
        while running.len() < max_batch {
            let Some(seq) = waiting.pop() else { break };
            running.push(seq);
        }
        for seq in &mut running {
            let before = seq.pages.len();
            seq.push_token(&binding)?;
            pages_committed += seq.pages.len() - before;
        }
        let (done, still): (Vec<_>, Vec<_>) =
            running.into_iter().partition(|s| s.tokens == s.target);
        running = still;
        for seq in done {
            assert!(seq.verify(), "sequence {} lost its K/V", seq.id);
            pages_released += seq.finish()?;
            finished += 1;
        }
        if step % 50 == 0 || (waiting.is_empty() && running.is_empty()) {
            let l = device.ledger();
            let pages: usize = running.iter().map(|s| s.pages.len()).sum();
            println!(
                "{step:>5} {:>8} {finished:>8} {pages:>6} {:>11} {:>11} {:>11}",
                running.len(),
                l.mapped_bytes / 1024,
                l.owned_bytes / 1024,
                l.quarantined
            );
        }
        step += 1;
    }
    drop((running, waiting)); // both empty: every sequence finished
    drop(binding);
    let report = device.close();
    println!(
        "\n{finished} sequences finished in {step} steps; {pages_committed} pages committed, {pages_released} released"
    );
    println!("ledger at close: {:?}", report.ledger);
    if !report.is_clean() {
        return Err("the ledger did not end at zero".into());
    }
    println!("ledger ends at zero: every page was released exactly once");
    Ok(())
}
