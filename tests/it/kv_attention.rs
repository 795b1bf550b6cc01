//! What an attention kernel sees of the KV cache: a reference paged-attention decode, written
//! here, reads K and V from the planes by block table and slot — one plane per layer, a block
//! holding K then V as `(2, block_tokens, kv_heads, head_size)` f32, vLLM's per-layer tensor
//! `(num_blocks, 2, block_size, num_kv_heads, head_size)` — and equals the same attention over
//! K and V gathered into contiguous arrays, for random tables over several layers — some of them
//! forks that share their blocks with another table, a shared block copied on write before a
//! token is written into it — on the host (the planes read in place) and on the driver model
//! (read by driver copies).

use crate::common::{self, Rng};
use memtoken::backend::cuda::Driver;
use memtoken::backend::{Addr, Backend};
use memtoken::kv::{BlockTable, KvCache, Layout};
use memtoken::{Budget, Device, make_guard};

const LAYERS: usize = 3;
const BLOCK_TOKENS: usize = 4;
const HEADS: usize = 2;
const HEAD_SIZE: usize = 8;
/// One token's K (or V) in one layer, in bytes.
const TOKEN_BYTES: usize = HEADS * HEAD_SIZE * 4;
const SEQS: usize = 6;

/// The layout: one plane per layer, K and V in each block.
fn layout(blocks: usize) -> Layout {
    Layout::per_layer(LAYERS, BLOCK_TOKENS, TOKEN_BYTES, blocks)
}

/// One token's K and V in one layer: `[kv][head][dim]`.
type Kv = [[[f32; HEAD_SIZE]; HEADS]; 2];

fn random_kv(rng: &mut Rng) -> Kv {
    let mut kv = [[[0.0; HEAD_SIZE]; HEADS]; 2];
    for x in kv.iter_mut().flatten().flatten() {
        *x = (rng.below(2001) as f32 - 1000.0) / 1000.0;
    }
    kv
}

/// The byte offset of token slot `offset` (within its block), head 0, of K (`kv = 0`) or V in
/// a block.
fn in_block(kv: usize, offset: usize) -> usize {
    (kv * BLOCK_TOKENS + offset) * TOKEN_BYTES
}

/// Attention of one query head over `len` tokens whose K and V `kv(t)` gives: softmax of the
/// scaled dot products, then the weighted sum of V — in the same order for both callers, so
/// equal inputs give equal bits (under Miri with `-Zmiri-no-extra-rounding-error`, as
/// `scripts/miri-all` runs it: Miri otherwise adds a random rounding error to each `exp`).
fn attend(
    q: &[f32; HEAD_SIZE],
    len: usize,
    kv: impl Fn(usize) -> ([f32; HEAD_SIZE], [f32; HEAD_SIZE]),
) -> [f32; HEAD_SIZE] {
    let scale = 1.0 / (HEAD_SIZE as f32).sqrt();
    let scores: Vec<f32> = (0..len)
        .map(|t| q.iter().zip(kv(t).0).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f32 = weights.iter().sum();
    let mut out = [0.0; HEAD_SIZE];
    for (t, w) in weights.iter().enumerate() {
        let v = kv(t).1;
        for (o, x) in out.iter_mut().zip(v) {
            *o += w / total * x;
        }
    }
    out
}

/// Reads `HEAD_SIZE` f32 at `addr` through `read_at`.
fn head_at(read_at: &impl Fn(Addr, &mut [u8]), addr: Addr) -> [f32; HEAD_SIZE] {
    let mut bytes = [0u8; HEAD_SIZE * 4];
    read_at(addr, &mut bytes);
    let mut out = [0.0; HEAD_SIZE];
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_ne_bytes(b.try_into().unwrap());
    }
    out
}

/// Fills `SEQS` sequences of random lengths with random K and V — written through their tables
/// at the slot vLLM's slot mapping gives each token — over tables made random by sequences
/// cleared and refilled, and by sequences replaced by a fork of another (sharing its blocks; a
/// shared block is copied on write before a token goes into it); then decodes one query per sequence, layer and head twice: paged
/// (reading the planes at `base(layer) + block × stride + offset`, the block from the table)
/// and gathered (from the test's own copy). Every output equal, bit for bit.
#[allow(clippy::needless_range_loop)] // sequence, layer and head are the kernel's coordinates
fn decode_equals_gathered<B: Backend>(
    cache: &KvCache<'_, '_, '_, B>,
    read_at: impl Fn(Addr, &mut [u8]),
) {
    let mut rng = Rng(0x5eed);
    let mut tables: Vec<BlockTable<'_, '_, '_, '_, B>> = (0..SEQS).map(|_| cache.table()).collect();
    // [seq][token][layer]
    let mut gathered: Vec<Vec<[Kv; LAYERS]>> = vec![Vec::new(); SEQS];
    let mut copied = 0;
    for round in 0..3 {
        for s in 0..SEQS {
            if round < 2 && rng.below(2) == 0 {
                cache.clear(&mut tables[s]);
                gathered[s].clear();
            } else if s > 0 && rng.below(3) == 0 {
                // A fork of another sequence: the same blocks, one more holder each.
                let t = rng.below(s as u64) as usize;
                tables[s] = cache.fork(&tables[t]);
                gathered[s] = gathered[t].clone();
            }
            for _ in 0..rng.below(23) {
                let t = gathered[s].len();
                if t.is_multiple_of(BLOCK_TOKENS) && cache.push(&mut tables[s]).is_err() {
                    cache.replenish().unwrap();
                    cache.push(&mut tables[s]).unwrap();
                }
                let position = t / BLOCK_TOKENS;
                if !cache.is_writable(&tables[s], position) {
                    // Another table holds the block this token goes into: a copy of its own.
                    if cache.copy_on_write(&mut tables[s], position).is_err() {
                        cache.replenish().unwrap();
                        cache.copy_on_write(&mut tables[s], position).unwrap();
                    }
                    copied += 1;
                }
                let slot = tables[s].slot(t) as usize;
                let (block, offset) = (slot / BLOCK_TOKENS, slot % BLOCK_TOKENS);
                assert_eq!(tables[s].ids()[position] as usize, block);
                let kv: [Kv; LAYERS] = std::array::from_fn(|_| random_kv(&mut rng));
                for (layer, kv) in kv.iter().enumerate() {
                    for (which, heads) in kv.iter().enumerate() {
                        let bytes: Vec<u8> = heads
                            .iter()
                            .flatten()
                            .flat_map(|x| x.to_ne_bytes())
                            .collect();
                        tables[s]
                            .write(layer, position, in_block(which, offset), &bytes)
                            .unwrap();
                    }
                }
                gathered[s].push(kv);
            }
        }
    }
    let shared = tables
        .iter()
        .flat_map(|t| t.ids())
        .filter(|&&b| cache.holders(b) > 1)
        .count();
    assert!(
        copied > 0 && shared > 0,
        "the decode reads shared blocks ({shared}) and copies ({copied})"
    );
    let mut decoded = 0;
    for s in 0..SEQS {
        let (table, len) = (&tables[s], gathered[s].len());
        for layer in 0..LAYERS {
            let stride = cache.layout().planes()[layer].stride;
            for head in 0..HEADS {
                let q: [f32; HEAD_SIZE] =
                    std::array::from_fn(|_| rng.below(1000) as f32 / 500.0 - 1.0);
                let block_table = table.ids_i32();
                let paged = attend(&q, len, |t| {
                    let block = block_table[t / BLOCK_TOKENS] as usize;
                    let at = cache.base(layer) + block * stride + head * HEAD_SIZE * 4;
                    let off = t % BLOCK_TOKENS;
                    (
                        head_at(&read_at, at + in_block(0, off)),
                        head_at(&read_at, at + in_block(1, off)),
                    )
                });
                let contiguous = attend(&q, len, |t| {
                    let kv = &gathered[s][t][layer];
                    (kv[0][head], kv[1][head])
                });
                assert_eq!(
                    paged, contiguous,
                    "sequence {s}, layer {layer}, head {head}"
                );
                decoded += usize::from(len > 0);
            }
        }
    }
    assert!(decoded > SEQS, "some sequences were decoded");
    for table in &mut tables {
        cache.clear(table);
    }
}

#[test]
fn a_paged_decode_over_block_tables_equals_attention_over_gathered_kv_on_the_host() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout(256)).unwrap();
    cache.replenish().unwrap();
    decode_equals_gathered(&cache, |addr, dst| {
        // SAFETY: the decode reads only blocks the tables hold: mapped, and written before.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, dst.len()) };
        dst.copy_from_slice(src);
    });
}

#[test]
fn a_paged_decode_over_block_tables_equals_attention_over_gathered_kv_on_the_driver_model() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout(256)).unwrap();
    cache.replenish().unwrap();
    decode_equals_gathered(&cache, |addr, dst| {
        // SAFETY: the decode reads only blocks the tables hold: mapped readable.
        unsafe { model.memcpy_dtoh(dst, addr as u64) }.unwrap();
    });
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}
