//! memtoken's showcase: a serving engine's KV cache.
//!
//! By default it runs memtoken's `KvCache` (`examples/common/kv_blocks.rs`): a real model's
//! per-layer KV size (Llama 3 8B: 32 layers, 8 KV heads × 128 × 2 bytes, 16-token blocks), one
//! plane per layer whose block `b` is at `base + b × stride` for attention kernels, block tables
//! of ids, physical memory mapped a group at a time by `replenish()` between steps. It prints
//! blocks taken and given back, groups mapped, owned bytes and backend calls every 100 steps,
//! and ends with the ledger at zero. On a device without virtual memory management the cache is
//! allocated whole, and it says so.
//!
//! `--prefix` shares a system prompt instead: every sequence starts with the same system
//! prompt, whose K/V is computed once by its owner and mapped read-only into every sequence
//! (zero extra physical bytes). The prompt ends inside its last granule, so a sequence's first
//! generated token lands in a granule it shares: it takes a private copy of that one granule
//! first (copy-on-write). After that it takes a KV block every 16 tokens (O(1), no system
//! call), finishes, and gives everything back. New
//! sequences keep arriving; the prompt's owner lets go after the last arrival, and the prompt's
//! memory lives on until the last sequence that maps it is gone.
//!
//! `--elastic` runs the same workload vAttention-style instead: each sequence's K/V is one
//! virtually contiguous `Region` that grows one granule at a time and is shrunk to nothing when
//! the sequence finishes, its granules reused through the device's granule cache (the prompt is
//! copied into every region: regions share no physical memory). Half-way, every live sequence
//! sleeps (`suspend_saving`: the device owns nothing) and wakes at the same addresses, every
//! byte checked. At the end it prints the create and release calls that the cache avoided.
//!
//! On a CUDA device without virtual memory management (`--gpu` on such a device, or
//! `--model-no-vmm`: the driver model of one), the backend falls back to its plain mechanism
//! (`cuMemAlloc`): the demo says so and why; with `--prefix` it runs the KV blocks (allocated
//! whole) with a private copy of the prompt per sequence (no prefix sharing there), after showing three refusals the
//! mechanism makes instead of what it cannot do (prefix sharing, region growth, sleep).
//!
//! ```text
//! cargo run --release --example kv_cache [-- --gpu --sequences N --seed S --prompt-tokens P]
//! cargo run --release --example kv_cache -- --prefix [--gpu ...]  # a shared prompt
//! cargo run --release --example kv_cache -- --elastic [--tail] [--gpu ...]
//! cargo run --release --example kv_cache -- --model            # the CUDA driver model (VMM)
//! cargo run --release --example kv_cache -- --model-no-vmm     # ... of a device without VMM
//! cargo run --release --example kv_cache -- --help             # every flag
//! ```
//!
//! The command line follows the grammar of `examples/common/cli.rs`: a flag that does not apply
//! (`--tail` without `--elastic`, `--elastic` with `--model-no-vmm`, two of `--gpu`, `--model`
//! and `--model-no-vmm`) is refused with exit code 2; a failure while running prints `error: …`
//! and exits with code 1. The rate in the table, block ops/s, is over the steps since the row
//! before.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/kv_blocks.rs"]
mod kv_blocks;

use cli::Arg;
use memtoken::backend::cuda::{CudaBackend, CudaMechanism, Driver};
use memtoken::backend::{
    Backend, HostBackend, HostConfig, HostMemory, HostVisible, Op,
    doubles::{DriverModel, FaultHandle, Faulty, ModelConfig},
};
use memtoken::kv::{BlockTable, KvCache, Layout};
use memtoken::{
    Allocation, Budget, Device, Releasing, errors::Returned, make_guard, region::Region,
    sharing::DivergedMapping, sharing::Prefix, sharing::PrefixMapping,
};
use std::error::Error;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const TOKENS_PER_PAGE: usize = 16;
/// Bytes of K and V one token needs in this toy model.
const BYTES_PER_TOKEN: usize = 256;
const PAGE: usize = TOKENS_PER_PAGE * BYTES_PER_TOKEN;
/// Tokens a sequence generates: from 16 to 400.
const MIN_GENERATED: usize = 16;
const MAX_GENERATED: usize = 400;

/// How the demo reads and writes K/V on a backend: host slices, or copies to a device.
trait Kv<B: Backend> {
    fn name(&self) -> &'static str;
    fn write_prompt(&self, p: &mut Prefix<'_, '_, B>, at: usize, kv: &[u8]) -> Result<()>;
    fn write_boundary(
        &self,
        d: &mut DivergedMapping<'_, '_, B>,
        at: usize,
        kv: &[u8],
    ) -> Result<()>;
    fn read_shared(&self, m: &PrefixMapping<'_, '_, B>, at: usize, out: &mut [u8]) -> Result<()>;
    fn read_diverged(
        &self,
        d: &DivergedMapping<'_, '_, B>,
        at: usize,
        out: &mut [u8],
    ) -> Result<()>;
    /// `--elastic`: a sequence's region, over its committed part.
    fn write_region(&self, r: &mut Region<'_, '_, B>, at: usize, kv: &[u8]) -> Result<()>;
    fn read_region(&self, r: &Region<'_, '_, B>, at: usize, out: &mut [u8]) -> Result<()>;
}

/// Host slices, on the host backend (or on any backend whose memory the host can touch, such as
/// the call-counting `Faulty<HostBackend>` of `--elastic`).
struct HostKv;
impl<B: HostVisible> Kv<B> for HostKv {
    fn name(&self) -> &'static str {
        "host backend"
    }
    fn write_prompt(&self, p: &mut Prefix<'_, '_, B>, at: usize, kv: &[u8]) -> Result<()> {
        let bytes = p
            .as_mut_slice()
            .ok_or("the prompt is written before it is shared")?;
        bytes[at..at + kv.len()].copy_from_slice(kv);
        Ok(())
    }
    fn write_boundary(
        &self,
        d: &mut DivergedMapping<'_, '_, B>,
        at: usize,
        kv: &[u8],
    ) -> Result<()> {
        d.boundary_mut()[at..at + kv.len()].copy_from_slice(kv);
        Ok(())
    }
    fn read_shared(&self, m: &PrefixMapping<'_, '_, B>, at: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&m.as_slice()[at..at + out.len()]);
        Ok(())
    }
    fn read_diverged(
        &self,
        d: &DivergedMapping<'_, '_, B>,
        at: usize,
        out: &mut [u8],
    ) -> Result<()> {
        out.copy_from_slice(&d.as_slice()[at..at + out.len()]);
        Ok(())
    }
    fn write_region(&self, r: &mut Region<'_, '_, B>, at: usize, kv: &[u8]) -> Result<()> {
        r.as_mut_slice()[at..at + kv.len()].copy_from_slice(kv);
        Ok(())
    }
    fn read_region(&self, r: &Region<'_, '_, B>, at: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&r.as_slice()[at..at + out.len()]);
        Ok(())
    }
}

mod gpu {
    use super::*;
    use memtoken::backend::cuda::{CudaBackend, Driver};
    #[cfg(feature = "cuda")]
    pub type Gpu = CudaBackend<memtoken::backend::cuda::SysDriver>;
    /// K/V copied to and from CUDA memory, on the real driver or the driver model.
    pub struct GpuKv(pub &'static str);
    impl<D: Driver> Kv<CudaBackend<D>> for GpuKv {
        fn name(&self) -> &'static str {
            self.0
        }
        fn write_prompt(
            &self,
            p: &mut Prefix<'_, '_, CudaBackend<D>>,
            at: usize,
            kv: &[u8],
        ) -> Result<()> {
            let copied = p.copy_from_host(at, kv);
            Ok(copied.ok_or("the prompt is written before it is shared")??)
        }
        fn write_boundary(
            &self,
            d: &mut DivergedMapping<'_, '_, CudaBackend<D>>,
            at: usize,
            kv: &[u8],
        ) -> Result<()> {
            Ok(d.copy_boundary_from_host(at, kv)?)
        }
        fn read_shared(
            &self,
            m: &PrefixMapping<'_, '_, CudaBackend<D>>,
            at: usize,
            out: &mut [u8],
        ) -> Result<()> {
            Ok(m.copy_to_host(at, out)?)
        }
        fn read_diverged(
            &self,
            d: &DivergedMapping<'_, '_, CudaBackend<D>>,
            at: usize,
            out: &mut [u8],
        ) -> Result<()> {
            Ok(d.copy_to_host(at, out)?)
        }
        fn write_region(
            &self,
            r: &mut Region<'_, '_, CudaBackend<D>>,
            at: usize,
            kv: &[u8],
        ) -> Result<()> {
            Ok(r.copy_from_host(at, kv)?)
        }
        fn read_region(
            &self,
            r: &Region<'_, '_, CudaBackend<D>>,
            at: usize,
            out: &mut [u8],
        ) -> Result<()> {
            Ok(r.copy_to_host(at, out)?)
        }
    }
}

/// Finishes a release now if nothing can still use the memory; else leaves it to the device,
/// which finishes it at a later poll.
fn finish<B: Backend>(releasing: Allocation<'_, '_, B, Releasing>) -> Result<()> {
    match releasing.complete() {
        Ok(_) => Ok(()),
        Err(e) => match e.token {
            Returned::Unchanged(pending) => {
                drop(pending); // queued behind its fence in the device
                Ok(())
            }
            Returned::Quarantined(q) => Err(format!("{q}: {}", e.cause).into()),
        },
    }
}

/// The K/V bytes of a token: prompt tokens are the same for every sequence.
fn kv_bytes(seq: Option<usize>, position: usize) -> [u8; BYTES_PER_TOKEN] {
    let b = match seq {
        None => (position % 200) as u8 + 1,
        Some(id) => 201 + ((id * 7 + position) % 50) as u8,
    };
    [b; BYTES_PER_TOKEN]
}

/// The prompt's last page: still shared, or privately copied.
enum Boundary<'b, 'id, B: Backend> {
    Shared(PrefixMapping<'b, 'id, B>),
    Private(DivergedMapping<'b, 'id, B>),
}

struct Sequence<'t, 'c, 'b, 'id, B: Backend> {
    id: usize,
    prompt_tokens: usize,
    /// Tokens the prompt's mapping has room for (a whole number of granules).
    mapped_tokens: usize,
    target: usize,
    /// Tokens so far, the prompt's included.
    len: usize,
    /// `None` only for the moment of the copy-on-write.
    prompt: Option<Boundary<'b, 'id, B>>,
    blocks: BlockTable<'t, 'c, 'b, 'id, B>,
}

#[derive(Default)]
struct Stats {
    committed: usize,
    released: usize,
    copies: usize,
    block_ops: u64,
}

impl<'t, 'c, 'b, 'id, B: Backend> Sequence<'t, 'c, 'b, 'id, B> {
    /// Where token `position` lives: in the prompt's mapping (offset into it), or in a block of
    /// the table (position in the table, offset into the block).
    fn place(&self, position: usize) -> (Option<usize>, usize) {
        if position < self.mapped_tokens {
            (None, position * BYTES_PER_TOKEN)
        } else {
            let past = position - self.mapped_tokens;
            (
                Some(past / TOKENS_PER_PAGE),
                (past % TOKENS_PER_PAGE) * BYTES_PER_TOKEN,
            )
        }
    }

    /// Appends one generated token's K/V.
    fn push_token(
        &mut self,
        kv: &impl Kv<B>,
        cache: &'t KvCache<'c, 'b, 'id, B>,
        stats: &mut Stats,
    ) -> Result<()> {
        let position = self.len;
        let bytes = kv_bytes(Some(self.id), position);
        match self.place(position) {
            (None, at) => {
                // Inside the prompt's last granule: take a private copy before the first write.
                if let Some(Boundary::Shared(_)) = self.prompt {
                    let Some(Boundary::Shared(m)) = self.prompt.take() else {
                        unreachable!()
                    };
                    let private = m.diverge()?;
                    self.prompt = Some(Boundary::Private(private));
                    stats.copies += 1;
                }
                let Some(Boundary::Private(d)) = &mut self.prompt else {
                    unreachable!()
                };
                let into = at - d.boundary_offset();
                kv.write_boundary(d, into, &bytes)?;
            }
            (Some(block), at) => {
                if block == self.blocks.len() {
                    cache.push(&mut self.blocks)?;
                    stats.committed += 1;
                    stats.block_ops += 1;
                }
                self.blocks.write(0, block, at, &bytes)?;
            }
        }
        self.len += 1;
        Ok(())
    }

    /// Reads back every token's K/V, the shared prompt's included.
    fn verify(&self, kv: &impl Kv<B>) -> Result<bool> {
        let mut got = [0u8; BYTES_PER_TOKEN];
        for position in 0..self.len {
            match (self.place(position), &self.prompt) {
                ((None, at), Some(Boundary::Shared(m))) => kv.read_shared(m, at, &mut got)?,
                ((None, at), Some(Boundary::Private(d))) => kv.read_diverged(d, at, &mut got)?,
                ((Some(block), at), _) => self.blocks.read(0, block, at, &mut got)?,
                (_, None) => return Ok(false),
            }
            let owner = (position >= self.prompt_tokens).then_some(self.id);
            if got != kv_bytes(owner, position) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn blocks_in_use(&self) -> usize {
        self.blocks.len() + self.mapped_tokens / TOKENS_PER_PAGE
    }
}

struct Args {
    sequences: usize,
    seed: u64,
    prompt_tokens: usize,
    gpu: bool,
    /// `--model` (`Some(true)`) or `--model-no-vmm` (`Some(false)`): the CUDA driver model of
    /// a device with or without virtual memory management.
    model: Option<bool>,
    elastic: bool,
    /// `--prefix`: a shared system prompt mapped into every sequence, its generated tokens in
    /// KV blocks.
    prefix: bool,
    /// `--tail`: with `--elastic`, a finished sequence's region keeps its granules mapped in its
    /// tail and serves the next request.
    tail: bool,
}

const USAGE: &str = "\
usage: kv_cache [--gpu | --model | --model-no-vmm] [--prefix | --elastic [--tail]]
                [--sequences N] [--seed S] [--prompt-tokens P]

A serving engine's KV cache on memtoken: block ids over one reservation per layer, physical
memory mapped by group (cargo run --release --example kv_cache -- ARGS).

  --gpu               run on CUDA device 0 instead of the host backend (its VMM mechanism, or
                      plain cuMemAlloc where the device has no VMM)
  --model             run on the CUDA driver model of a device with VMM (no GPU needed)
  --model-no-vmm      ... of a device without virtual memory management (the plain mechanism:
                      the KV cache allocated whole, no --elastic)
  --prefix            a shared system prompt mapped into every sequence (copy-on-write of its
                      last granule), generated tokens in KV blocks
  --elastic           one growing region per sequence instead (vAttention)
  --tail              with --elastic: a finished sequence's region keeps its granules mapped
                      (its tail) and serves the next request
  --sequences N       how many sequences arrive (default 64)
  --seed S            seed of the sequence lengths (default 7)
  --prompt-tokens P   tokens in the shared system prompt (default 40)
  -h, --help          print this usage";

/// The command line (`--help`: the usage, exit 0; a usage error: exit 2).
fn parse_args() -> Args {
    let mut args = Args {
        sequences: 64,
        seed: 7,
        prompt_tokens: 40,
        gpu: false,
        model: None,
        elastic: false,
        prefix: false,
        tail: false,
    };
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        match arg {
            Arg::Flag(flag) => match flag.as_str() {
                "--sequences" => args.sequences = cli.value(&flag),
                "--seed" => args.seed = cli.value(&flag),
                "--prompt-tokens" => args.prompt_tokens = cli.value::<usize>(&flag).max(1),
                "--gpu" => args.gpu = true,
                "--model" => args.model = Some(true),
                "--model-no-vmm" => args.model = Some(false),
                "--elastic" => args.elastic = true,
                "--prefix" => args.prefix = true,
                "--tail" => args.tail = true,
                _ => cli.unknown(Arg::Flag(flag)),
            },
            other => cli.unknown(other),
        }
    }
    cli.at_most_one(&["--gpu", "--model", "--model-no-vmm"]);
    cli.at_most_one(&["--prefix", "--elastic"]);
    cli.only_with("--tail", "--elastic");
    // The plain mechanism has no regions: it shows their refusal and runs the blocks instead.
    if cli.given("--elastic") && cli.given("--model-no-vmm") {
        cli.error(
            "--elastic does not apply with --model-no-vmm (a device without VMM has no regions)",
        );
    }
    args
}

fn kib(bytes: u64) -> u64 {
    bytes / 1024
}

/// The sequences that will arrive, as (id, tokens to generate), the first one last (to `pop`).
/// A tiny xorshift makes the lengths reproducible; both modes see the same ones.
fn arrivals(args: &Args) -> Vec<(usize, usize)> {
    let mut state = args.seed.max(1);
    let mut next_len = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        MIN_GENERATED + (state % (MAX_GENERATED - MIN_GENERATED + 1) as u64) as usize
    };
    let mut arrivals: Vec<(usize, usize)> =
        (0..args.sequences).map(|id| (id, next_len())).collect();
    arrivals.reverse();
    arrivals
}

/// The whole demo, for any backend.
fn run<B: Backend>(device: &Device<'_, B>, kv: &impl Kv<B>, args: &Args) -> Result<()> {
    let g = device.granularity();
    let system = device.bind(Budget::unlimited())?;
    let session = device.bind(Budget::bytes(1 << 30))?;
    make_guard!(cache_guard);
    // Blocks of 16 tokens in one plane: room for 16 running sequences of the longest length.
    let layout = Layout::new(1024, TOKENS_PER_PAGE).plane(PAGE);
    let cache = KvCache::new(cache_guard, &session, &layout)?;
    cache.set_watermarks(16, 32);

    // The system prompt, computed once by its owner, in granules of the device.
    let prompt_bytes = args.prompt_tokens * BYTES_PER_TOKEN;
    let mut owner_alloc = system.reserve(prompt_bytes)?.commit_prefix()?;
    for position in 0..args.prompt_tokens {
        kv.write_prompt(
            &mut owner_alloc,
            position * BYTES_PER_TOKEN,
            &kv_bytes(None, position),
        )?;
    }
    let prompt_len = owner_alloc.len();
    let mut owner: Option<Prefix<'_, '_, B>> = Some(owner_alloc);

    let mut arrivals = arrivals(args);
    let mut running: Vec<Sequence<'_, '_, '_, '_, B>> = Vec::new();
    cache.replenish()?;
    let mut stats = Stats::default();
    let max_batch = 16;
    let started = Instant::now();
    println!(
        "memtoken kv_cache on the {}: {} sequences sharing a {}-token system prompt \
         ({} bytes mapped, granule {} bytes), KV blocks of {} tokens ({} bytes)\n",
        kv.name(),
        args.sequences,
        args.prompt_tokens,
        prompt_len,
        g,
        TOKENS_PER_PAGE,
        PAGE
    );
    println!(
        "{:>5} {:>7} {:>8} {:>6} {:>11} {:>10} {:>10} {:>10} {:>27}",
        "step",
        "running",
        "finished",
        "blocks",
        "mapped KiB",
        "owned KiB",
        "saved KiB",
        "quarantine",
        "block ops/s (last interval)"
    );
    // The rate of each row is over the interval since the row before (the first: since the
    // start), not an average of the whole run so far.
    let (mut last_row, mut last_ops) = (started, 0u64);
    let mut finished = 0;
    let mut step = 0;
    while !arrivals.is_empty() || !running.is_empty() {
        while running.len() < max_batch {
            let Some((id, generated)) = arrivals.pop() else {
                break;
            };
            let prefix = owner.as_ref().expect("kept until the last arrival");
            let mapping = session.reserve(prefix.len())?.map_prefix(prefix)?;
            running.push(Sequence {
                id,
                prompt_tokens: args.prompt_tokens,
                mapped_tokens: prompt_len / BYTES_PER_TOKEN,
                target: args.prompt_tokens + generated,
                len: args.prompt_tokens,
                prompt: Some(Boundary::Shared(mapping)),
                blocks: cache.table(),
            });
        }
        if arrivals.is_empty()
            && let Some(prefix) = owner.take()
        {
            // The owner is done; the prompt lives on in the sequences that map it.
            finish(prefix.release())?;
        }
        // Between steps: a fence over the blocks given back, groups mapped up to the watermark.
        cache.replenish()?;
        for seq in &mut running {
            seq.push_token(kv, &cache, &mut stats)?;
        }
        let (done, still): (Vec<_>, Vec<_>) = running.into_iter().partition(|s| s.len == s.target);
        running = still;
        for mut seq in done {
            if !seq.verify(kv)? {
                return Err(format!("sequence {} lost its K/V", seq.id).into());
            }
            let n = seq.blocks.len();
            cache.clear(&mut seq.blocks);
            stats.released += n;
            stats.block_ops += n as u64;
            match seq.prompt.take() {
                Some(Boundary::Shared(m)) => finish(m.release())?,
                Some(Boundary::Private(d)) => finish(d.release())?,
                None => {}
            }
            finished += 1;
        }
        if step % 100 == 0 || (arrivals.is_empty() && running.is_empty()) {
            let l = device.ledger();
            let blocks: usize = running.iter().map(Sequence::blocks_in_use).sum();
            let now = Instant::now();
            let interval = now.duration_since(last_row).as_secs_f64().max(1e-9);
            let rate = (stats.block_ops - last_ops) as f64 / interval;
            (last_row, last_ops) = (now, stats.block_ops);
            println!(
                "{step:>5} {:>7} {finished:>8} {blocks:>6} {:>11} {:>10} {:>10} {:>10} {:>27.0}",
                running.len(),
                kib(l.mapped_bytes),
                kib(l.owned_bytes),
                kib(l.mapped_bytes.saturating_sub(l.owned_bytes)),
                l.quarantined,
                rate
            );
        }
        step += 1;
    }
    let elapsed = started.elapsed();
    drop((running, arrivals, owner));
    cache.set_watermarks(0, 0);
    let shrunk = cache.replenish()?.unmapped;
    drop(cache);
    drop(session);
    drop(system);
    device.poll();
    device.trim_cache(); // the groups' granules the device's cache kept for reuse
    println!(
        "\n{finished} sequences in {step} steps ({:.1} ms): {} KV blocks taken and {} given back, \
         {} prompt granules copied on write, {shrunk} idle groups unmapped at the end",
        elapsed.as_secs_f64() * 1e3,
        stats.committed,
        stats.released,
        stats.copies
    );
    println!(
        "block ops/s (last interval): blocks taken + given back per second over the steps since \
         the row before (K/V writes and checks included); the cache's own cost is in \
         `cargo run --release --bin bench_report`"
    );
    println!(
        "sharing: 'saved KiB' = mapped − owned: the prompt's bytes that every sequence maps without owning"
    );
    let ledger = device.ledger();
    println!("ledger at the end: {ledger:?}");
    if !ledger.is_zero() {
        return Err("the ledger did not end at zero".into());
    }
    println!(
        "ledger ends at zero: every block's group and every mapping was released exactly once"
    );
    Ok(())
}

// ---- `--elastic`: one growing region per sequence (vAttention-style) ----

/// A sequence whose K/V — its own copy of the prompt's included — lies in one virtually
/// contiguous region `R`: a `Region` while awake, a suspended region while asleep.
struct ElasticSeq<R> {
    id: usize,
    prompt_tokens: usize,
    target: usize,
    /// Tokens written so far, the prompt's included: token `i` lies at `i * BYTES_PER_TOKEN`.
    len: usize,
    region: R,
}

impl<R> ElasticSeq<R> {
    /// The same sequence, its region passed through `f` (suspended, or resumed).
    fn map_region<T>(self, f: impl FnOnce(R) -> Result<T>) -> Result<ElasticSeq<T>> {
        let ElasticSeq {
            id,
            prompt_tokens,
            target,
            len,
            region,
        } = self;
        let region = f(region)?;
        Ok(ElasticSeq {
            id,
            prompt_tokens,
            target,
            len,
            region,
        })
    }
}

impl<'b, 'id, B: Backend> ElasticSeq<Region<'b, 'id, B>> {
    /// Appends the next token's K/V (a prompt token's first), growing the region by one
    /// granule when its committed part is full.
    fn push_token(mut self, kv: &impl Kv<B>, grown: &mut usize) -> Result<Self> {
        let at = self.len * BYTES_PER_TOKEN;
        if at + BYTES_PER_TOKEN > self.region.committed_len() {
            self.region.grow(1)?;
            *grown += 1;
        }
        let owner = (self.len >= self.prompt_tokens).then_some(self.id);
        kv.write_region(&mut self.region, at, &kv_bytes(owner, self.len))?;
        self.len += 1;
        Ok(self)
    }

    /// Reads back every token's K/V.
    fn verify(&self, kv: &impl Kv<B>) -> Result<bool> {
        let mut got = [0u8; BYTES_PER_TOKEN];
        for position in 0..self.len {
            kv.read_region(&self.region, position * BYTES_PER_TOKEN, &mut got)?;
            let owner = (position >= self.prompt_tokens).then_some(self.id);
            if got != kv_bytes(owner, position) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// What the elastic run counts: granules its regions grew by and gave back, and (on a backend
/// wrapped in `Faulty`) the create and release calls the backend really received.
struct Counts<'h> {
    handle: Option<&'h FaultHandle>,
    grown: usize,
    given_back: usize,
}

impl Counts<'_> {
    fn of(&self, op: Op) -> String {
        self.handle
            .map_or_else(|| "n/a".into(), |h| h.calls(op).to_string())
    }

    fn avoided(&self, granules: usize, op: Op) -> String {
        self.handle.map_or_else(
            || "not counted on this backend".into(),
            |h| {
                format!(
                    "{} avoided by the cache",
                    granules as i64 - h.calls(op) as i64
                )
            },
        )
    }
}

/// Parks every live sequence — its bytes saved to the host, its physical memory given back, its
/// VA kept — shows that the device then owns nothing, and wakes them all at the same addresses,
/// every byte checked.
fn sleep_and_wake<'b, 'id, B: Backend>(
    device: &Device<'id, B>,
    kv: &impl Kv<B>,
    running: Vec<ElasticSeq<Region<'b, 'id, B>>>,
    counts: &mut Counts<'_>,
) -> Result<Vec<ElasticSeq<Region<'b, 'id, B>>>> {
    let g = device.granularity();
    let addrs: Vec<_> = running.iter().map(|s| s.region.addr()).collect();
    let same_addrs = |now: Vec<usize>| now == addrs;

    let mut asleep = Vec::with_capacity(running.len());
    for seq in running {
        asleep.push(seq.map_region(|r| Ok(r.suspend_saving()?))?);
    }
    let granules = asleep
        .iter()
        .map(|s| s.region.suspended_len())
        .sum::<usize>()
        / g;
    counts.given_back += granules;
    let parked = device.ledger();
    println!(
        "\nsleep: {} sequences suspended, their bytes saved to the host ({} KiB committed); their \
         {granules} granules went to the cache (cap: {} granules; the rest released): owned {} KiB \
         = cached {} KiB, mapped {} KiB",
        asleep.len(),
        kib((granules * g) as u64),
        device.cache_cap() / g as u64,
        kib(parked.owned_bytes),
        kib(parked.cached_bytes),
        kib(parked.mapped_bytes)
    );
    let trimmed = device.trim_cache();
    let l = device.ledger();
    println!(
        "sleep: trim_cache released {} KiB: owned {} KiB, mapped {} KiB; VA still reserved: {} KiB",
        kib(trimmed),
        kib(l.owned_bytes),
        kib(l.mapped_bytes),
        kib(l.reserved_bytes)
    );
    if parked.owned_bytes != parked.cached_bytes || l.owned_bytes != 0 || l.mapped_bytes != 0 {
        return Err("asleep, the device still owned memory".into());
    }
    if !asleep.iter().all(|s| s.region.is_saved()) {
        return Err("a sequence slept without its bytes".into());
    }
    let asleep_at_same = same_addrs(asleep.iter().map(|s| s.region.addr()).collect());

    let creates = counts.of(Op::Create);
    let mut awake = Vec::with_capacity(asleep.len());
    for seq in asleep {
        awake.push(seq.map_region(|r| Ok(r.resume()?))?);
    }
    counts.grown += granules;
    if !(asleep_at_same && same_addrs(awake.iter().map(|s| s.region.addr()).collect())) {
        return Err("a region moved while asleep".into());
    }
    println!(
        "wake: {} regions resumed, {granules} granules grown back (create calls: {creates} before, \
         {} after); addresses unchanged: yes",
        awake.len(),
        counts.of(Op::Create)
    );
    let mut tokens = 0;
    for seq in &awake {
        if !seq.verify(kv)? {
            return Err(format!("sequence {} lost its K/V in its sleep", seq.id).into());
        }
        tokens += seq.len;
    }
    println!(
        "wake: every byte checked: {tokens} tokens of {} sequences ({} KiB of K/V, prompt copies \
         included); owned {} KiB again\n",
        awake.len(),
        kib((tokens * BYTES_PER_TOKEN) as u64),
        kib(device.ledger().owned_bytes)
    );
    Ok(awake)
}

/// `--elastic`: the same workload as `run`, each sequence in one region that grows a granule at a
/// time; half-way, every live sequence sleeps and wakes.
fn run_elastic<B: Backend>(
    device: &Device<'_, B>,
    kv: &impl Kv<B>,
    args: &Args,
    counted: Option<&FaultHandle>,
) -> Result<()> {
    let g = device.granularity();
    let session = device.bind(Budget::bytes(1 << 30))?;
    // Every region reserves VA for the longest sequence; only what is written is committed.
    let region_bytes = ((args.prompt_tokens + MAX_GENERATED) * BYTES_PER_TOKEN).next_multiple_of(g);
    let mut counts = Counts {
        handle: counted,
        grown: 0,
        given_back: 0,
    };
    let mut arrivals = arrivals(args);
    let mut running: Vec<ElasticSeq<Region<'_, '_, B>>> = Vec::new();
    // `--tail`: finished sequences' regions, their granules still mapped, for the next ones.
    let mut free: Vec<Region<'_, '_, B>> = Vec::new();
    let mut slept = false;
    let max_batch = 16;
    let started = Instant::now();
    println!(
        "memtoken kv_cache --elastic on the {}{}: {} sequences, each in one region of {} KiB of \
         VA that grows one granule ({} bytes, {} tokens) at a time; the {}-token system prompt \
         is copied into every region (regions share no physical memory)\n",
        kv.name(),
        if counted.is_some() {
            ", backend calls counted by backend::doubles::Faulty"
        } else {
            ""
        },
        args.sequences,
        region_bytes / 1024,
        g,
        g / BYTES_PER_TOKEN,
        args.prompt_tokens,
    );
    println!(
        "{:>5} {:>7} {:>8} {:>8} {:>11} {:>10} {:>10} {:>7} {:>8}",
        "step",
        "running",
        "finished",
        "granules",
        "mapped KiB",
        "owned KiB",
        "cached KiB",
        "creates",
        "releases"
    );
    let mut finished = 0;
    let mut step = 0;
    while !arrivals.is_empty() || !running.is_empty() {
        while running.len() < max_batch {
            let Some((id, generated)) = arrivals.pop() else {
                break;
            };
            let region = match free.pop() {
                Some(region) => region, // a slot's region serves the next request
                None => {
                    let mut region = session.reserve(region_bytes)?.into_region();
                    if args.tail {
                        region.set_tail_cap(region_bytes / g)?;
                    }
                    region
                }
            };
            let mut seq = ElasticSeq {
                id,
                prompt_tokens: args.prompt_tokens,
                target: args.prompt_tokens + generated,
                len: 0,
                region,
            };
            for _ in 0..args.prompt_tokens {
                seq = seq.push_token(kv, &mut counts.grown)?; // the prompt's copy
            }
            running.push(seq);
        }
        running = running
            .into_iter()
            .map(|seq| seq.push_token(kv, &mut counts.grown))
            .collect::<Result<_>>()?;
        let (done, still): (Vec<_>, Vec<_>) = running.into_iter().partition(|s| s.len == s.target);
        running = still;
        for mut seq in done {
            if !seq.verify(kv)? {
                return Err(format!("sequence {} lost its K/V", seq.id).into());
            }
            // Its granules go to the device's cache, for the next growth, and its VA goes — or,
            // with `--tail`, they stay mapped in its tail and the region serves the next request.
            let n = seq.region.committed_granules();
            seq.region.shrink(n)?;
            counts.given_back += n;
            if args.tail {
                free.push(seq.region);
            } else {
                finish(seq.region.release())?;
            }
            finished += 1;
        }
        // Half-way: every live sequence sleeps, and wakes.
        if !slept && finished >= args.sequences / 2 && !running.is_empty() {
            // The idle slots give their tails back first: asleep, nothing stays mapped.
            for region in &mut free {
                region.trim_tail()?;
            }
            running = sleep_and_wake(device, kv, running, &mut counts)?;
            slept = true;
        }
        if step % 100 == 0 || (arrivals.is_empty() && running.is_empty()) {
            let l = device.ledger();
            let granules: usize = running.iter().map(|s| s.region.committed_granules()).sum();
            println!(
                "{step:>5} {:>7} {finished:>8} {granules:>8} {:>11} {:>10} {:>10} {:>7} {:>8}",
                running.len(),
                kib(l.mapped_bytes),
                kib(l.owned_bytes),
                kib(l.cached_bytes),
                counts.of(Op::Create),
                counts.of(Op::Release),
            );
        }
        step += 1;
    }
    let elapsed = started.elapsed();
    for region in free {
        finish(region.release())?;
    }
    drop((running, arrivals));
    drop(session);
    let trimmed = device.trim_cache();
    device.poll();
    println!(
        "\n{finished} sequences in {step} steps ({:.1} ms); at the end trim_cache released the \
         {} KiB left in the cache",
        elapsed.as_secs_f64() * 1e3,
        kib(trimmed)
    );
    if !slept {
        println!("sleep: skipped (no sequence was running half-way)");
    }
    println!(
        "creates, releases: the backend's create and release calls so far (counted by \
         backend::doubles::Faulty on the host)"
    );
    println!(
        "granules grown: {}; create calls: {} ({})",
        counts.grown,
        counts.of(Op::Create),
        counts.avoided(counts.grown, Op::Create)
    );
    println!(
        "granules given back: {}; release calls: {} ({})",
        counts.given_back,
        counts.of(Op::Release),
        counts.avoided(counts.given_back, Op::Release)
    );
    // Without a tail each granule grown is mapped and each given back unmapped.
    println!(
        "map calls: {} for {} granules grown (without the tail: {}); unmap calls: {} for {} given \
         back (without the tail: {}){}",
        counts.of(Op::Map),
        counts.grown,
        counts.grown,
        counts.of(Op::Unmap),
        counts.given_back,
        counts.given_back,
        if args.tail {
            "; --tail: a finished sequence's region keeps its granules mapped and serves the next"
        } else {
            ""
        }
    );
    let ledger = device.ledger();
    println!("ledger at the end: {ledger:?}");
    if !ledger.is_zero() {
        return Err("the ledger did not end at zero".into());
    }
    println!("ledger ends at zero: every granule and every region was released exactly once");
    Ok(())
}

/// Runs the demo on a CUDA backend, after saying which mechanism it opened on and why: the
/// whole demo on VMM, the paged workload without sharing on the plain mechanism.
fn run_cuda<D: Driver>(backend: CudaBackend<D>, kv: &gpu::GpuKv, args: &Args) -> Result<()> {
    make_guard!(guard);
    match backend.mechanism() {
        CudaMechanism::Vmm => println!(
            "mechanism: CUDA VMM (the device supports virtual memory management): everything"
        ),
        CudaMechanism::Plain => println!(
            "mechanism: CUDA plain allocation (cuMemAlloc), because the device has no virtual \
             memory management (attribute 102 is {}): commits, releases, fences and the KV cache \
             (allocated whole) work; prefix sharing, regions, sleep and export are refused",
            u8::from(backend.vmm_supported())
        ),
    }
    let plain = backend.mechanism() == CudaMechanism::Plain;
    if !args.prefix && !args.elastic {
        // `Faulty` with no fault planned forwards every call and counts it.
        let backend = Faulty::new(backend);
        let calls = backend.handle();
        let device = Device::new(guard, backend);
        return run_blocks(&device, &calls, args);
    }
    let device = Device::new(guard, backend);
    if plain {
        if args.elastic {
            // Known only now that the device is open (`--model-no-vmm --elastic` is refused at
            // the command line).
            println!(
                "--elastic{}: not run: the plain mechanism has no regions (its refusal is shown \
                 below); the KV blocks run instead",
                if args.tail { " --tail" } else { "" }
            );
        }
        return run_plain(&device, kv, args);
    }
    if args.elastic {
        // Without create and release counts: the region copies are `CudaBackend`'s own.
        return run_elastic(&device, kv, args, None);
    }
    run(&device, kv, args)
}

/// The KV blocks on a mechanism that cannot share or grow in place (CUDA's plain one): each
/// sequence writes its own copy of the prompt into its blocks, then generates; every byte
/// is checked before it finishes. First it shows what the mechanism refuses, and that each
/// refusal names the capability and hands the token back.
fn run_plain<B: Backend>(device: &Device<'_, B>, kv: &impl Kv<B>, args: &Args) -> Result<()> {
    let g = device.granularity();
    let session = device.bind(Budget::bytes(1 << 30))?;
    let reserved = session.reserve(g)?;
    let reserved = match reserved.commit_prefix() {
        Ok(_) => return Err("the plain mechanism shared a prefix".into()),
        Err(e) => {
            println!("prefix sharing: refused: {}", chain(&e.cause));
            match e.token {
                Returned::Unchanged(reserved) => reserved,
                Returned::Quarantined(_) => return Err("a refusal quarantined".into()),
            }
        }
    };
    let mut region = session.reserve(4 * g)?.into_region();
    match region.grow(1) {
        Ok(()) => return Err("the plain mechanism grew a region in place".into()),
        Err(e) => println!("region growth: refused: {}", chain(&e)),
    }
    finish(region.release())?;
    let committed = reserved.commit()?;
    let committed = match committed.suspend() {
        Ok(_) => return Err("the plain mechanism suspended memory in place".into()),
        Err(e) => {
            println!("sleep: refused: {}", chain(&e.cause));
            e.token
        }
    };
    finish(committed.release())?;

    make_guard!(cache_guard);
    // Allocated whole on the plain mechanism: every group mapped when the cache is made.
    let layout = Layout::new(1024, TOKENS_PER_PAGE).plane(PAGE);
    let cache = KvCache::new(cache_guard, &session, &layout)?;
    println!(
        "\nmemtoken kv_cache on the {}, plain mechanism: {} sequences, each with its own copy \
         of a {}-token prompt, KV blocks of {} tokens ({} bytes), granule {} bytes",
        kv.name(),
        args.sequences,
        args.prompt_tokens,
        TOKENS_PER_PAGE,
        PAGE,
        g
    );
    let started = Instant::now();
    let mut arrivals = arrivals(args);
    let (mut finished, mut blocks_max) = (0, 0);
    while !arrivals.is_empty() {
        // A batch of up to 16 sequences at a time, each a block table of its own.
        let batch: Vec<(usize, usize)> = (0..16).map_while(|_| arrivals.pop()).collect();
        let mut tables: Vec<_> = batch.iter().map(|_| cache.table()).collect();
        for (&(id, generated), table) in batch.iter().zip(&mut tables) {
            let total = args.prompt_tokens + generated;
            for position in 0..total {
                let (block, at) = (position / TOKENS_PER_PAGE, position % TOKENS_PER_PAGE);
                if at == 0 {
                    cache.push(table)?;
                }
                let seq = (position >= args.prompt_tokens).then_some(id);
                table.write(0, block, at * BYTES_PER_TOKEN, &kv_bytes(seq, position))?;
            }
        }
        blocks_max = blocks_max.max(cache.live_blocks());
        for (&(id, generated), table) in batch.iter().zip(&tables) {
            let mut out = [0; BYTES_PER_TOKEN];
            for position in 0..args.prompt_tokens + generated {
                let (block, at) = (position / TOKENS_PER_PAGE, position % TOKENS_PER_PAGE);
                table.read(0, block, at * BYTES_PER_TOKEN, &mut out)?;
                let seq = (position >= args.prompt_tokens).then_some(id);
                if out != kv_bytes(seq, position) {
                    return Err(format!("sequence {id}: token {position} differs").into());
                }
            }
        }
        finished += batch.len();
        for mut table in tables {
            cache.clear(&mut table);
        }
        // Between batches: a fence over the blocks given back (free once it has completed).
        cache.replenish()?;
    }
    println!(
        "{finished} sequences in {:.1} ms, every byte checked; at most {blocks_max} blocks in use \
         ({} KiB mapped by the cache, allocated whole)",
        started.elapsed().as_secs_f64() * 1e3,
        kib(cache.mapped_bytes() as u64)
    );
    drop(cache);
    drop(session);
    device.poll();
    let ledger = device.ledger();
    println!("ledger at the end: {ledger:?}");
    if !ledger.is_zero() {
        return Err("the ledger did not end at zero".into());
    }
    println!("ledger ends at zero: every block and plane was released exactly once");
    Ok(())
}

/// An error and its sources, joined by ": ".
fn chain(e: &dyn Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        text = format!("{text}: {cause}");
        next = cause.source();
    }
    text
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let args = parse_args();
    cli::exit(run_args(&args))
}

/// The demo the command line asks for.
/// The KV cache workload (`examples/common/kv_blocks.rs`) over the same arrivals as the other
/// modes.
fn run_blocks<B: Backend>(device: &Device<'_, B>, calls: &FaultHandle, args: &Args) -> Result<()> {
    let lengths = arrivals(args).into_iter().map(|(_, len)| len).collect();
    kv_blocks::run(device, calls, lengths, args.prompt_tokens)?;
    Ok(())
}

fn run_args(args: &Args) -> Result<()> {
    if let Some(vmm) = args.model {
        let model = DriverModel::new(ModelConfig {
            vmm,
            ..ModelConfig::default()
        })?;
        let backend = CudaBackend::new_auto(model, 0)?;
        return run_cuda(backend, &gpu::GpuKv("CUDA driver model"), args);
    }
    if args.gpu {
        #[cfg(feature = "cuda")]
        {
            let backend = gpu::Gpu::open_auto(0).map_err(|e| format!("--gpu: {e}"))?;
            return run_cuda(backend, &gpu::GpuKv("CUDA device 0"), args);
        }
        #[cfg(not(feature = "cuda"))]
        return Err("--gpu: built without the `cuda` feature".into());
    }
    make_guard!(guard);
    if !args.prefix && !args.elastic {
        // Granules of 64 KiB: one block of one layer.
        let backend = Faulty::new(HostBackend::new(HostConfig {
            granularity: 64 << 10,
            physical_capacity: 4 << 30,
            ..HostConfig::default()
        })?);
        let calls = backend.handle();
        let device = Device::new(guard, backend);
        return run_blocks(&device, &calls, args);
    }
    let backend = HostBackend::new(HostConfig {
        granularity: 4 << 10,
        physical_capacity: 1 << 30,
        ..HostConfig::default()
    })?;
    // Which mechanism the host backend chose, and why.
    match backend.memory() {
        HostMemory::Anonymous => println!(
            "mechanism: host, anonymous store (memfd_create is refused here): everything but export"
        ),
        _ => println!("mechanism: host, memfd store (the default where the OS gives a memfd)"),
    }
    if args.elastic {
        // `Faulty` with no fault planned forwards every call and counts it.
        let backend = Faulty::new(backend);
        let counted = backend.handle();
        let device = Device::new(guard, backend);
        return run_elastic(&device, &HostKv, args, Some(&counted));
    }
    let device = Device::new(guard, backend);
    run(&device, &HostKv, args)
}
