//! The KV cache demo's default workload: memtoken's `KvCache` in the shape a serving engine
//! and its attention kernels use — a real model's per-layer KV size (Llama 3 8B: 32 layers,
//! 8 KV heads × 128 × 2 bytes, 16-token blocks, K and V of a layer in one block: 64 KiB per
//! block per layer), one plane per layer, block tables of ids, `replenish()` between steps.
//!
//! Sequences arrive (up to 16 at a time), prefill their prompt, then generate one token per
//! step; a new block every 16 tokens; each token's K and V written into one layer's plane
//! through the table (a rotating layer: the demo moves bytes, the model does not compute); every
//! written byte is read back before the sequence finishes and its table is cleared.
#![allow(dead_code)]

use memtoken::backend::Backend;
use memtoken::backend::doubles::FaultHandle;
use memtoken::kv::{BlockTable, KvCache, KvError, Layout};
use memtoken::{Budget, Device, make_guard};
use std::error::Error;

/// Llama 3 8B's KV shape.
pub const LAYERS: usize = 32;
pub const KV_HEADS: usize = 8;
pub const HEAD_SIZE: usize = 128;
/// bf16.
pub const DTYPE_BYTES: usize = 2;
pub const BLOCK_TOKENS: usize = 16;
/// One token's K (or V) in one layer.
pub const TOKEN_BYTES: usize = KV_HEADS * HEAD_SIZE * DTYPE_BYTES;
/// Sequences running at once.
const CONCURRENT: usize = 16;
/// The cache's blocks (the null block among them): room for every sequence at once.
const BLOCKS: usize = 1024;

/// One running sequence.
struct Seq<'t, 'c, 'b, 'id, B: Backend> {
    id: usize,
    table: BlockTable<'t, 'c, 'b, 'id, B>,
    tokens: usize,
    len: usize,
}

/// What the run saw.
#[derive(Default)]
struct Counts {
    taken: usize,
    given: usize,
    most_groups: usize,
    most_owned: u64,
    calls_in_replenish: u64,
    calls_elsewhere: u64,
    steps: usize,
    /// Owned bytes at every 100th step.
    owned: Vec<(usize, u64)>,
}

/// K or V of token `token` of sequence `seq`: bytes the demo can check.
fn kv_bytes(seq: usize, token: usize, which: usize) -> Vec<u8> {
    (0..TOKEN_BYTES)
        .map(|i| (seq * 31 + token * 7 + which * 13 + i) as u8)
        .collect()
}

/// Writes token `t`'s K and V into its slot of one layer's plane (layer `t % LAYERS`).
fn write_token<B: Backend>(
    seq: &mut Seq<'_, '_, '_, '_, B>,
    t: usize,
) -> Result<(), Box<dyn Error>> {
    let (position, offset) = (t / BLOCK_TOKENS, t % BLOCK_TOKENS);
    for which in 0..2 {
        let at = (which * BLOCK_TOKENS + offset) * TOKEN_BYTES;
        let bytes = kv_bytes(seq.id, t, which);
        seq.table.write(t % LAYERS, position, at, &bytes)?;
    }
    Ok(())
}

/// Reads back every token's K and V.
fn check<B: Backend>(seq: &Seq<'_, '_, '_, '_, B>) -> Result<(), Box<dyn Error>> {
    let mut got = vec![0; TOKEN_BYTES];
    for t in 0..seq.tokens {
        let (position, offset) = (t / BLOCK_TOKENS, t % BLOCK_TOKENS);
        for which in 0..2 {
            let at = (which * BLOCK_TOKENS + offset) * TOKEN_BYTES;
            seq.table.read(t % LAYERS, position, at, &mut got)?;
            if got != kv_bytes(seq.id, t, which) {
                return Err(format!("sequence {}: token {t}'s K/V changed", seq.id).into());
            }
        }
    }
    Ok(())
}

/// Grows `seq` by one token: a new block every 16 tokens (a replenish, counted, if no mapped
/// group has room), then its K and V.
fn generate<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    seq: &mut Seq<'_, 'c, 'b, 'id, B>,
    counts: &mut Counts,
    calls: &FaultHandle,
) -> Result<(), Box<dyn Error>> {
    let t = seq.tokens;
    if t.is_multiple_of(BLOCK_TOKENS) {
        match cache.push(&mut seq.table) {
            Ok(_) => {}
            Err(KvError::NoRoom { .. }) => {
                let before = calls.any_calls();
                cache.replenish()?;
                counts.calls_in_replenish += calls.any_calls() - before;
                cache.push(&mut seq.table)?;
            }
            Err(e) => return Err(e.into()),
        }
        counts.taken += 1;
    }
    write_token(seq, t)?;
    seq.tokens += 1;
    Ok(())
}

/// The workload on `device` (a device over `Faulty`, whose `calls` count every backend call);
/// `arrivals` are the sequences' lengths, the first to arrive last. Returns the owned bytes at
/// peak.
pub fn run<B: Backend>(
    device: &Device<'_, B>,
    calls: &FaultHandle,
    mut arrivals: Vec<usize>,
    prompt_tokens: usize,
) -> Result<u64, Box<dyn Error>> {
    let binding = device.bind(Budget::unlimited())?;
    let layout = Layout::per_layer(LAYERS, BLOCK_TOKENS, TOKEN_BYTES, BLOCKS);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout)?;
    cache.set_watermarks(1, 2);
    println!(
        "KV cache: {LAYERS} planes (one per layer) of {} KiB per block, {} blocks of \
         {BLOCK_TOKENS} tokens, {} blocks per group (the blocks whose bytes share granules of \
         {} KiB), {}; watermarks of idle groups: {:?}",
        layout.planes()[0].block_bytes / 1024,
        cache.blocks(),
        cache.blocks_per_group(),
        device.granularity() / 1024,
        if cache.maps_on_demand() {
            "groups mapped on demand"
        } else {
            "allocated whole (no virtual memory management: no groups mapped later, no sleep)"
        },
        cache.watermarks(),
    );
    let mut counts = Counts::default();
    let mut running: Vec<Seq<'_, '_, '_, '_, B>> = Vec::new();
    let mut next_id = 0;
    println!("  step  running  blocks live  taken  given back  groups mapped  owned KiB  calls");
    while !running.is_empty() || !arrivals.is_empty() {
        let before = calls.any_calls();
        while running.len() < CONCURRENT
            && let Some(len) = arrivals.pop()
        {
            let mut seq = Seq {
                id: next_id,
                table: cache.table(),
                tokens: 0,
                len: prompt_tokens + len,
            };
            next_id += 1;
            for _ in 0..prompt_tokens {
                generate(&cache, &mut seq, &mut counts, calls)?;
            }
            running.push(seq);
        }
        for seq in &mut running {
            generate(&cache, seq, &mut counts, calls)?;
        }
        let mut i = 0;
        while i < running.len() {
            if running[i].tokens == running[i].len {
                let mut seq = running.swap_remove(i);
                check(&seq)?;
                counts.given += seq.table.len();
                cache.clear(&mut seq.table);
            } else {
                i += 1;
            }
        }
        let between = calls.any_calls();
        cache.replenish()?;
        counts.calls_in_replenish += calls.any_calls() - between;
        counts.calls_elsewhere += between - before;
        counts.steps += 1;
        let owned = device.ledger().owned_bytes;
        counts.most_owned = counts.most_owned.max(owned);
        counts.most_groups = counts.most_groups.max(cache.mapped_groups());
        if counts.steps.is_multiple_of(100) {
            counts.owned.push((counts.steps, owned));
            println!(
                "{:>6}  {:>7}  {:>11}  {:>5}  {:>10}  {:>13}  {:>9}  {:>5}",
                counts.steps,
                running.len(),
                cache.live_blocks(),
                counts.taken,
                counts.given,
                cache.mapped_groups(),
                owned / 1024,
                calls.any_calls() - before,
            );
        }
    }
    println!(
        "{} steps: {} blocks taken and {} given back, at most {} groups mapped, owned at peak {} \
         KiB; backend calls: {} in replenish() (maps, unmaps, fences), {} elsewhere (the K/V \
         copies), {:.1} per step",
        counts.steps,
        counts.taken,
        counts.given,
        counts.most_groups,
        counts.most_owned / 1024,
        counts.calls_in_replenish,
        counts.calls_elsewhere,
        (counts.calls_in_replenish + counts.calls_elsewhere) as f64 / counts.steps as f64,
    );
    drop(running);
    drop(cache);
    drop(binding);
    device.poll();
    device.trim_cache();
    let ledger = device.ledger();
    if !ledger.is_zero() {
        return Err(format!("the ledger does not end at zero: {ledger:?}").into());
    }
    println!("ledger at the end: zero");
    Ok(counts.most_owned)
}
