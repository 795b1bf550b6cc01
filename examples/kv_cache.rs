//! A small paged KV cache on the host backend, with a shared system prompt.
//!
//! Every sequence starts with the same system prompt. Its K/V pages are computed once, by the
//! owner, and mapped read-only into every sequence (zero extra physical bytes). The prompt ends
//! inside its last page, so the first token a sequence generates lands in a page it shares:
//! the sequence takes a private copy of that one page first (copy-on-write). After that it
//! grows one private page every 16 tokens, finishes, and gives everything back. The owner
//! drops its handle on the prompt once the last sequence has arrived; the prompt's memory
//! stays until the last sequence that maps it is gone.
//!
//! ```text
//! cargo run --release --example kv_cache [-- --sequences N --seed S --prompt-tokens P]
//! ```

use memtoken::backend::{HostBackend, HostConfig};
use memtoken::{
    Allocation, Binding, Budget, Committed, Device, DivergedMapping, Prefix, PrefixMapping,
    make_guard,
};
use std::error::Error;
use std::time::Instant;

const TOKENS_PER_PAGE: usize = 16;
/// Bytes of K and V one token needs in this toy model (one 4 KiB page holds 16 tokens).
const BYTES_PER_TOKEN: usize = 256;
const PAGE: usize = TOKENS_PER_PAGE * BYTES_PER_TOKEN;

type Host = HostBackend;

/// The bytes a token's K/V is filled with: prompt tokens are the same for every sequence.
fn kv_byte(seq: Option<usize>, position: usize) -> u8 {
    match seq {
        None => (position % 200) as u8 + 1,
        Some(id) => 201 + ((id * 7 + position) % 50) as u8,
    }
}

fn slot(bytes: &mut [u8], position: usize) -> &mut [u8] {
    let at = (position % TOKENS_PER_PAGE) * BYTES_PER_TOKEN;
    &mut bytes[at..at + BYTES_PER_TOKEN]
}

/// The prompt's last page: still shared, or privately copied.
enum Boundary<'b, 'id> {
    Shared(PrefixMapping<'b, 'id, Host>),
    Private(DivergedMapping<'b, 'id, Host>),
}

struct Sequence<'b, 'id> {
    id: usize,
    prompt_tokens: usize,
    target: usize,
    /// Tokens so far, the prompt's included.
    len: usize,
    prompt: Option<Boundary<'b, 'id>>,
    pages: Vec<Allocation<'b, 'id, Host, Committed>>,
    copies: usize,
}

impl<'b, 'id> Sequence<'b, 'id> {
    fn prompt_pages(&self) -> usize {
        self.prompt_tokens.div_ceil(TOKENS_PER_PAGE)
    }

    /// Appends one generated token's K/V; returns how many pages it committed (0 or 1).
    fn push_token(&mut self, binding: &'b Binding<'b, 'id, Host>) -> Result<usize, Box<dyn Error>> {
        let position = self.len;
        let byte = kv_byte(Some(self.id), position);
        let page = position / TOKENS_PER_PAGE;
        let mut committed = 0;
        if page < self.prompt_pages() {
            // Inside the prompt's last page: take a private copy before the first write.
            if let Some(Boundary::Shared(_)) = self.prompt {
                let Some(Boundary::Shared(m)) = self.prompt.take() else {
                    unreachable!()
                };
                let private = m.diverge().map_err(|e| e.to_string())?;
                self.prompt = Some(Boundary::Private(private));
                self.copies += 1;
            }
            let Some(Boundary::Private(d)) = &mut self.prompt else {
                unreachable!()
            };
            slot(d.boundary_mut(), position).fill(byte);
        } else {
            if position.is_multiple_of(TOKENS_PER_PAGE) {
                let page = binding.reserve(PAGE)?.commit().map_err(|e| e.cause)?;
                self.pages.push(page);
                committed = 1;
            }
            let page = self.pages.last_mut().expect("a page was just ensured");
            slot(page.as_mut_slice(), position).fill(byte);
        }
        self.len += 1;
        Ok(committed)
    }

    /// Reads back every token's K/V, the shared prompt's included.
    fn verify(&self) -> bool {
        let prompt = match &self.prompt {
            Some(Boundary::Shared(m)) => m.as_slice(),
            Some(Boundary::Private(d)) => d.as_slice(),
            None => return false,
        };
        (0..self.len).all(|position| {
            let page = position / TOKENS_PER_PAGE;
            let bytes = if page < self.prompt_pages() {
                &prompt[page * PAGE..(page + 1) * PAGE]
            } else {
                self.pages[page - self.prompt_pages()].as_slice()
            };
            let at = (position % TOKENS_PER_PAGE) * BYTES_PER_TOKEN;
            let owner = if position < self.prompt_tokens {
                None
            } else {
                Some(self.id)
            };
            bytes[at..at + BYTES_PER_TOKEN]
                .iter()
                .all(|&b| b == kv_byte(owner, position))
        })
    }

    /// Releases every page and the prompt mapping explicitly; returns the pages released.
    fn finish(self) -> Result<usize, Box<dyn Error>> {
        let n = self.pages.len();
        for page in self.pages {
            page.release().complete().map_err(|e| e.to_string())?;
        }
        match self.prompt {
            Some(Boundary::Shared(m)) => {
                m.release().map_err(|e| e.to_string())?;
            }
            Some(Boundary::Private(d)) => {
                d.release().map_err(|e| e.to_string())?;
            }
            None => {}
        }
        Ok(n)
    }
}

struct Args {
    sequences: usize,
    seed: u64,
    prompt_tokens: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sequences: 24,
        seed: 7,
        prompt_tokens: 40,
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
            "--prompt-tokens" => args.prompt_tokens = value("--prompt-tokens")?.max(1) as usize,
            "-h" | "--help" => {
                println!(
                    "kv_cache: a paged KV cache with a shared system prompt, on memtoken's host backend\n\n\
                     --sequences N       how many sequences arrive (default 24)\n\
                     --seed S            seed of the sequence lengths (default 7)\n\
                     --prompt-tokens P   tokens in the shared system prompt (default 40)"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(args)
}

fn kib(bytes: u64) -> String {
    format!("{}", bytes / 1024)
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
    let system = device.bind(Budget::unlimited())?;
    let session = device.bind(Budget::bytes(64 << 20))?;

    // The system prompt, computed once by its owner.
    let prompt_pages = args.prompt_tokens.div_ceil(TOKENS_PER_PAGE);
    let mut prompt: Prefix<'_, '_, Host> = system
        .reserve(prompt_pages * PAGE)?
        .commit()
        .map_err(|e| e.cause)?
        .into_prefix();
    {
        let bytes = prompt.as_mut_slice().expect("nobody shares it yet");
        for position in 0..args.prompt_tokens {
            let at = position * BYTES_PER_TOKEN;
            bytes[at..at + BYTES_PER_TOKEN].fill(kv_byte(None, position));
        }
    }
    let mut owner = Some(prompt);

    // A tiny xorshift for reproducible sequence lengths (16 to 400 generated tokens).
    let mut state = args.seed.max(1);
    let mut next_len = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        16 + (state % 385) as usize
    };
    let mut arrivals: Vec<(usize, usize)> =
        (0..args.sequences).map(|id| (id, next_len())).collect();
    arrivals.reverse();

    let mut running: Vec<Sequence> = Vec::new();
    let (mut committed, mut released, mut finished, mut copies, mut page_ops) = (0, 0, 0, 0, 0u64);
    let max_batch = 8;
    let started = Instant::now();

    println!(
        "memtoken kv_cache: {} sequences sharing a {}-token system prompt ({} pages of {} tokens), host backend\n",
        args.sequences, args.prompt_tokens, prompt_pages, TOKENS_PER_PAGE
    );
    println!(
        "{:>5} {:>7} {:>8} {:>6} {:>11} {:>10} {:>11} {:>10}",
        "step",
        "running",
        "finished",
        "pages",
        "mapped KiB",
        "owned KiB",
        "saved KiB",
        "quarantine"
    );
    let mut step = 0;
    while !arrivals.is_empty() || !running.is_empty() {
        while running.len() < max_batch {
            let Some((id, generated)) = arrivals.pop() else {
                break;
            };
            let prefix = owner.as_ref().expect("kept until the last arrival");
            let mapping = session
                .reserve(prefix.size())?
                .map_prefix(prefix)
                .map_err(|e| e.to_string())?;
            running.push(Sequence {
                id,
                prompt_tokens: args.prompt_tokens,
                target: args.prompt_tokens + generated,
                len: args.prompt_tokens,
                prompt: Some(Boundary::Shared(mapping)),
                pages: Vec::new(),
                copies: 0,
            });
        }
        if arrivals.is_empty()
            && let Some(prefix) = owner.take()
        {
            // The owner is done; the prompt lives on in the sequences that map it.
            prefix.release().map_err(|e| e.to_string())?;
        }
        for seq in &mut running {
            let n = seq.push_token(&session)?;
            committed += n;
            page_ops += n as u64;
        }
        let (done, still): (Vec<_>, Vec<_>) = running.into_iter().partition(|s| s.len == s.target);
        running = still;
        for seq in done {
            assert!(seq.verify(), "sequence {} lost its K/V", seq.id);
            copies += seq.copies;
            let n = seq.finish()?;
            released += n;
            page_ops += n as u64;
            finished += 1;
        }
        if step % 50 == 0 || (arrivals.is_empty() && running.is_empty()) {
            let l = device.ledger();
            let pages: usize = running
                .iter()
                .map(|s| s.pages.len() + s.prompt_pages())
                .sum();
            println!(
                "{step:>5} {:>7} {finished:>8} {pages:>6} {:>11} {:>10} {:>11} {:>10}",
                running.len(),
                kib(l.mapped_bytes),
                kib(l.owned_bytes),
                kib(l.mapped_bytes.saturating_sub(l.owned_bytes)),
                l.quarantined
            );
        }
        step += 1;
    }
    let elapsed = started.elapsed().as_secs_f64();
    drop((running, arrivals, owner));
    drop(session);
    drop(system);
    let report = device.close();
    println!(
        "\n{finished} sequences finished in {step} steps: {committed} private pages committed, \
         {released} released, {copies} boundary pages copied on write"
    );
    println!(
        "sharing: each sequence mapped the {prompt_pages}-page prompt without owning it; \
         'saved KiB' is what the prompt would have cost without sharing"
    );
    println!(
        "{:.0} page commits+releases per second (whole run, K/V writes included)",
        page_ops as f64 / elapsed
    );
    println!("ledger at close: {:?}", report.ledger);
    if !report.is_clean() {
        return Err("the ledger did not end at zero".into());
    }
    println!("ledger ends at zero: every page and every mapping was released exactly once");
    Ok(())
}
