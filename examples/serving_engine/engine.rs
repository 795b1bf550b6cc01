//! The engine of `examples/serving_engine`: built by a constructor, it serves requests on
//! worker threads, each with its own KV cache and prefix cache (block-level sharing within a
//! worker; requests that share a system prompt go to the same worker). Shared with the test
//! `tests/it/engine.rs` and with `examples/prefix_cache.rs`.
//!
//! **Why one cache per worker.** A `KvCache`'s hot path takes no lock (907 instructions per
//! 16-block cycle), so a cache is not `Sync`, and its tables stay on the thread that owns it.
//! An engine shards by worker, as serving stacks shard by GPU: the device and its bindings
//! (`Sync`) are shared by reference; each worker makes its cache from a shared binding;
//! requests are routed by the key of their first block, so the ones that could share blocks
//! meet in the same cache.

use memtoken::backend::Backend;
use memtoken::kv::{BlockTable, KvCache, KvError, Layout, PrefixCache};
use memtoken::{Binding, make_guard};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::mpsc;
use std::thread::{Scope, ScopedJoinHandle};

/// Tokens a block holds.
pub const TOKENS_PER_PAGE: usize = 16;
/// Bytes of K and V one token needs in this toy model (one plane).
pub const BYTES_PER_TOKEN: usize = 256;
/// A block's bytes.
pub const PAGE: usize = TOKENS_PER_PAGE * BYTES_PER_TOKEN;
/// Blocks in a worker's KV cache (its reservation: 32 MiB; memory is mapped as used).
pub const BLOCKS: usize = 8192;
/// Blocks a prefix cache keeps at most: the rest of the cache is the running requests'.
pub const CACHED_BLOCKS: usize = 2048;

/// A KV cache of `BLOCKS` blocks of one plane, its groups mapped as they are used.
pub fn layout() -> Layout {
    Layout::new(BLOCKS, TOKENS_PER_PAGE).plane(PAGE)
}

/// A new block at the end of `table`: with no room, groups are mapped first (between steps,
/// in an engine that schedules ahead).
pub fn push<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, B>,
) -> Result<usize, KvError> {
    if cache.push(table).is_err() {
        cache.replenish()?;
        cache.push(table)?;
    }
    Ok(table.len() - 1)
}

/// [`KvCache::copy_on_write`], with groups mapped first when there is no room.
pub fn copy_on_write<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    table: &mut BlockTable<'_, 'c, 'b, 'id, B>,
    position: usize,
) -> Result<bool, KvError> {
    cache.copy_on_write(table, position).or_else(|_| {
        cache.replenish()?;
        cache.copy_on_write(table, position)
    })
}

/// How the engine runs.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Worker threads, each with its own KV cache and prefix cache.
    pub workers: usize,
}

/// A request: its prompt, how many continuations to sample (as forks), and how many tokens
/// each generates.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub samples: usize,
    pub generate: usize,
}

/// What a worker did, summed over its requests.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub requests: usize,
    pub lookups: usize,
    pub hits: usize,
    pub copies: usize,
    /// The most blocks its live requests held at once, shared by block.
    pub peak_pages: usize,
    /// What the same requests would have held without sharing.
    pub peak_unshared_pages: usize,
}

impl Stats {
    fn add(&mut self, other: &Stats) {
        self.requests += other.requests;
        self.lookups += other.lookups;
        self.hits += other.hits;
        self.copies += other.copies;
        self.peak_pages += other.peak_pages;
        self.peak_unshared_pages += other.peak_unshared_pages;
    }
}

/// A running engine: its workers, and the way to them. Dropping it without
/// [`finish`](Engine::finish) still stops the workers (their channels close) when the scope
/// ends.
pub struct Engine<'scope> {
    to_workers: Vec<mpsc::Sender<Request>>,
    workers: Vec<ScopedJoinHandle<'scope, Result<Stats, memtoken::Error>>>,
}

impl<'scope> Engine<'scope> {
    /// Starts `config.workers` worker threads in `scope`, each with a KV cache drawing from
    /// `binding` and a prefix cache over it.
    pub fn start<'env, 'id, B>(
        scope: &'scope Scope<'scope, 'env>,
        binding: &'env Binding<'env, 'id, B>,
        config: Config,
    ) -> Self
    where
        B: Backend,
        Binding<'env, 'id, B>: Sync,
    {
        let mut to_workers = Vec::new();
        let mut workers = Vec::new();
        for _ in 0..config.workers.max(1) {
            let (send, receive) = mpsc::channel::<Request>();
            to_workers.push(send);
            workers.push(scope.spawn(move || work(binding, receive)));
        }
        Self {
            to_workers,
            workers,
        }
    }

    /// Hands `request` to the worker that serves its first page's prefix.
    pub fn submit(&self, request: Request) {
        let first = &request.prompt[..request.prompt.len().min(TOKENS_PER_PAGE)];
        let worker = (key(0, first) % self.to_workers.len() as u64) as usize;
        // A worker gone (its error is reported by `finish`) drops the request.
        let _ = self.to_workers[worker].send(request);
    }

    /// Waits for every request submitted to be served, and stops the workers; what they did.
    ///
    /// # Errors
    ///
    /// The first error a worker stopped with.
    pub fn finish(self) -> Result<Stats, memtoken::Error> {
        drop(self.to_workers); // the workers stop once their queues are empty
        let mut total = Stats::default();
        let mut first_error = None;
        for worker in self.workers {
            match worker.join().expect("a worker panicked") {
                Ok(stats) => total.add(&stats),
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        first_error.map_or(Ok(total), Err)
    }
}

/// A page's key: its parent page's key and its own tokens — the whole prefix up to it.
pub fn key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The K/V byte of a token: a function of the whole prefix up to it (through its page's key).
pub fn kv_byte(page_key: u64, slot: usize) -> u8 {
    (page_key.rotate_left(slot as u32 % 64) as u8) | 1
}

/// One sample of a request: its table, each block's key, its tokens.
pub struct Sample<'t, 'c, 'b, 'id, B: Backend> {
    pub table: BlockTable<'t, 'c, 'b, 'id, B>,
    pub keys: Vec<u64>,
    pub tokens: usize,
}

/// A worker: its own KV cache and prefix cache; serves requests until its queue closes.
fn work<B: Backend>(
    binding: &Binding<'_, '_, B>,
    requests: mpsc::Receiver<Request>,
) -> Result<Stats, memtoken::Error> {
    make_guard!(cache_guard);
    let kv = KvCache::new(cache_guard, binding, &layout())?;
    kv.set_watermarks(4, 16);
    let mut cache = PrefixCache::new(&kv)?;
    cache.set_limit(Some(CACHED_BLOCKS));
    let mut stats = Stats::default();
    for request in requests {
        serve(&kv, &mut cache, &request, &mut stats)?;
    }
    drop(cache);
    assert_eq!(kv.live_blocks(), 0, "every block back in the cache");
    Ok(stats)
}

/// A prompt's blocks through the prefix cache: a full block the cache holds is shared, any
/// other is written (its K/V) and, when full, entered; the table and its blocks' keys. Counts
/// the cache's lookups and hits in `counts`.
pub fn admit<'t, 'c, 'b, 'id, B: Backend>(
    kv: &'t KvCache<'c, 'b, 'id, B>,
    cache: &mut PrefixCache<'t, 'c, 'b, 'id, B, u64>,
    prompt: &[u32],
    counts: (&mut usize, &mut usize),
) -> Result<(BlockTable<'t, 'c, 'b, 'id, B>, Vec<u64>), memtoken::Error> {
    let (lookups, hits) = counts;
    let mut table = kv.table();
    let mut keys = Vec::new();
    let mut parent = 0;
    for chunk in prompt.chunks(TOKENS_PER_PAGE) {
        let k = key(parent, chunk);
        parent = k;
        keys.push(k);
        let full = chunk.len() == TOKENS_PER_PAGE;
        if full {
            *lookups += 1;
            if cache.lookup(&k, &mut table) {
                *hits += 1;
                continue;
            }
        }
        let at = push(kv, &mut table)?;
        let bytes: Vec<u8> = (0..chunk.len() * BYTES_PER_TOKEN)
            .map(|i| kv_byte(k, i / BYTES_PER_TOKEN))
            .collect();
        table.write(0, at, 0, &bytes)?;
        if full {
            cache.enter(&table, at, k); // only full blocks
        }
    }
    Ok((table, keys))
}

/// Serves one request: the prompt through the cache, the samples as forks, each generating
/// its tokens (a copy-on-write where it writes into a shared block), every byte checked.
fn serve<'t, 'c, 'b, 'id, B: Backend>(
    kv: &'t KvCache<'c, 'b, 'id, B>,
    cache: &mut PrefixCache<'t, 'c, 'b, 'id, B, u64>,
    request: &Request,
    stats: &mut Stats,
) -> Result<(), memtoken::Error> {
    let (table, keys) = admit(
        kv,
        cache,
        &request.prompt,
        (&mut stats.lookups, &mut stats.hits),
    )?;
    let mut samples: Vec<Sample<'_, '_, '_, '_, B>> = (0..request.samples.max(1))
        .map(|_| Sample {
            table: kv.fork(&table),
            keys: keys.clone(),
            tokens: request.prompt.len(),
        })
        .collect();
    drop(table);
    for step in 0..request.generate {
        for (s, sample) in samples.iter_mut().enumerate() {
            let slot = sample.tokens % TOKENS_PER_PAGE;
            if slot == 0 {
                push(kv, &mut sample.table)?;
                sample.keys.push(key(request.id, &[s as u32, step as u32]));
            } else {
                let last = sample.table.len() - 1;
                if copy_on_write(kv, &mut sample.table, last)? {
                    stats.copies += 1;
                }
            }
            let last = sample.table.len() - 1;
            let byte = kv_byte(sample.keys[last], slot);
            sample
                .table
                .write(0, last, slot * BYTES_PER_TOKEN, &[byte; BYTES_PER_TOKEN])?;
            sample.tokens += 1;
        }
        stats.peak_pages = stats.peak_pages.max(kv.live_blocks());
        let unshared = samples.iter().map(|s| s.table.len()).sum();
        stats.peak_unshared_pages = stats.peak_unshared_pages.max(unshared);
    }
    for sample in &samples {
        check(sample)?;
    }
    stats.requests += 1;
    Ok(())
}

/// Every token of every block of `sample` holds its K/V byte.
pub fn check<B: Backend>(sample: &Sample<'_, '_, '_, '_, B>) -> Result<(), memtoken::Error> {
    let mut page = vec![0u8; PAGE];
    for (position, &k) in sample.keys.iter().enumerate() {
        let tokens = (sample.tokens - position * TOKENS_PER_PAGE).min(TOKENS_PER_PAGE);
        sample.table.read(0, position, 0, &mut page)?;
        for slot in 0..tokens {
            assert_eq!(
                page[slot * BYTES_PER_TOKEN],
                kv_byte(k, slot),
                "page {position} token {slot}: a sequence read back other bytes"
            );
        }
    }
    Ok(())
}
