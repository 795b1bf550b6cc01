//! Blocks of the KV cache with more than one holder: forks, shares, copy-on-write in every
//! plane, and the prefix cache with its eviction order and events — behaviours one by one, then
//! a property test over random steps with faults injected, on the host and on the CUDA backend
//! over the driver model.

use crate::common;
use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::doubles::{FaultHandle, Faulty};
use memtoken::backend::{Backend, Op};
use memtoken::kv::{BlockTable, CacheEvent, KvCache, KvError, Layout, PrefixCache, PrehashedKeys};
use memtoken::make_guard;
use memtoken::{Budget, Device};
use proptest::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::rc::Rc;

/// The first bytes of a block in each plane, which the tests write and read back.
const HEAD: usize = 16;

/// Two planes of `block` bytes a block, 16 blocks.
fn layout(block: usize) -> Layout {
    Layout::new(16, 16).plane(block).plane(block)
}

/// Writes `byte` (plane 0) and `!byte` (plane 1) at the head of the block at `position`.
fn write<B: Backend>(table: &mut BlockTable<'_, '_, '_, '_, B>, position: usize, byte: u8) {
    table.write(0, position, 0, &[byte; HEAD]).unwrap();
    table.write(1, position, 0, &[!byte; HEAD]).unwrap();
}

/// The bytes at the head of the block at `position`, in each plane (each head all one byte).
fn read<B: Backend>(table: &BlockTable<'_, '_, '_, '_, B>, position: usize) -> [u8; 2] {
    let mut out = [0; 2];
    for (plane, out) in out.iter_mut().enumerate() {
        let mut head = [0u8; HEAD];
        table.read(plane, position, 0, &mut head).unwrap();
        assert!(head.iter().all(|&b| b == head[0]), "{head:?}");
        *out = head[0];
    }
    out
}

/// A device over the host backend, a binding, and a KV cache of 16 blocks (`layout(1024)`)
/// with 4 idle groups mapped.
macro_rules! host_cache {
    ($cache:ident, $binding:ident, $device:ident) => {
        make_guard!(guard);
        let $device = Device::new(guard, common::host());
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        make_guard!(g);
        let $cache = KvCache::new(g, &$binding, &layout(1024)).unwrap();
        $cache.set_watermarks(4, 4);
        $cache.replenish().unwrap();
    };
}

/// As [`host_cache!`], on the driver model (`$model`), with blocks of a quarter granule.
macro_rules! model_cache {
    ($model:ident, $device:ident, $binding:ident, $cache:ident) => {
        let $model = common::model();
        make_guard!(guard);
        let $device = Device::new(guard, CudaBackend::new($model.clone(), 0).unwrap());
        let $binding = $device.bind(Budget::unlimited()).unwrap();
        make_guard!(g);
        let $cache = KvCache::new(g, &$binding, &layout(common::MODEL_GRANULARITY / 4)).unwrap();
        $cache.set_watermarks(4, 4);
        $cache.replenish().unwrap();
    };
}

/// A fork holds the same blocks (one more holder each, no byte copied); a write to one of them
/// is refused until a copy-on-write gives the fork its own copy, in every plane.
#[test]
fn a_fork_shares_every_block_and_a_copy_on_write_copies_one_in_every_plane() {
    host_cache!(cache, binding, device);
    let mut prompt = cache.table();
    for position in 0..3 {
        cache.push(&mut prompt).unwrap();
        write(&mut prompt, position, 10 + position as u8);
    }
    let mut fork = cache.fork(&prompt);
    assert_eq!(fork.ids(), prompt.ids());
    assert!(prompt.ids().iter().all(|&b| cache.holders(b) == 2));
    assert_eq!(cache.live_blocks(), 3, "a shared block counts once");
    assert_eq!(
        fork.write(0, 1, 0, &[1]),
        Err(KvError::ReadOnly { position: 1 })
    );
    assert!(cache.copy_on_write(&mut fork, 1).unwrap());
    assert_ne!(fork.ids()[1], prompt.ids()[1]);
    assert_eq!(read(&fork, 1), [11, !11], "copied in both planes");
    write(&mut fork, 1, 99);
    assert_eq!(read(&prompt, 1), [11, !11], "the prompt keeps its bytes");
    assert_eq!(cache.holders(prompt.ids()[1]), 1);
    assert!(!cache.copy_on_write(&mut fork, 1).unwrap(), "its own now");
    drop(fork);
    assert!(prompt.ids().iter().all(|&b| cache.holders(b) == 1));
    assert_eq!(cache.live_blocks(), 3);
    drop(prompt);
    assert_eq!(cache.live_blocks(), 0);
}

/// A block shared into another table counts that table as a holder; the last to let it go
/// frees it, whichever it is.
#[test]
fn a_shared_block_is_freed_by_its_last_holder() {
    host_cache!(cache, binding, device);
    let mut a = cache.table();
    cache.push(&mut a).unwrap();
    let mut b = cache.table();
    let block = cache.share(&a, 0, &mut b);
    assert_eq!(cache.holders(block), 2);
    assert!(!cache.is_writable(&a, 0) && !cache.is_writable(&b, 0));
    let free = cache.free_blocks();
    cache.clear(&mut a);
    assert_eq!(cache.free_blocks(), free, "b holds it still");
    assert!(cache.is_writable(&b, 0));
    drop(b);
    assert_eq!(cache.free_blocks(), free + 1);
}

/// [`PrehashedKeys`] folds a key's bytes, never hashes them again: a `u64` key is its own hash,
/// as is a `usize` key, and keys that differ in any 8-byte word, or in a short tail, hash apart;
/// each word is folded in by a rotate and an xor, so a word written again, turned as the fold
/// turned the first, cancels it. Fails if the hasher loses what was written, drops a `usize`
/// (`write_usize` → `()`: every such key hashes to 0) or folds by an or (`^` → `|`).
#[test]
fn prehashed_keys_fold_every_word_of_a_key() {
    use std::hash::{BuildHasher, Hasher};
    assert_eq!(
        PrehashedKeys.hash_one(0x0123_4567_89ab_cdef_u64),
        0x0123_4567_89ab_cdef
    );
    assert_eq!(PrehashedKeys.hash_one(0x1234_usize), 0x1234);
    let w = 0xf0f0_0000_0000_000f_u64;
    assert_eq!(PrehashedKeys.hash_one((w, w.rotate_left(29))), 0);
    let a = [1_u64, 2, 3, 4];
    let b = [1_u64, 2, 3, 5];
    assert_ne!(PrehashedKeys.hash_one(a), PrehashedKeys.hash_one(b));
    let bytes = |bytes: &[u8]| {
        let mut h = PrehashedKeys.build_hasher();
        h.write(bytes);
        h.finish()
    };
    assert_eq!(bytes(&7_u64.to_le_bytes()), 7);
    assert_ne!(bytes(&[1, 2, 3]), bytes(&[1, 2, 4]));
    assert_ne!(
        bytes(&[0; 12]),
        bytes(&[0, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0])
    );
}

/// Blocks entered stay findable after their tables go, and are evicted least recently let go
/// first — of one sequence its later blocks before its earlier ones — only when the cache has no
/// free block; the hook hears each one stored and removed.
#[test]
fn the_prefix_cache_keeps_blocks_findable_and_evicts_later_blocks_first() {
    host_cache!(cache, binding, device);
    let events = Rc::new(RefCell::new(Vec::new()));
    let mut prefixes = PrefixCache::with_hasher(&cache, PrehashedKeys).unwrap();
    let heard = events.clone();
    prefixes.on_event(move |event| {
        heard.borrow_mut().push(match event {
            CacheEvent::Stored { key, block } => ('+', *key, block),
            CacheEvent::Removed { key, block } => ('-', *key, block),
        })
    });
    assert_eq!(
        PrefixCache::<_, u64>::new(&cache).err(),
        Some(KvError::PrefixCacheTaken)
    );
    let mut seq = cache.table();
    for position in 0..3 {
        cache.push(&mut seq).unwrap();
        write(&mut seq, position, position as u8);
        assert!(prefixes.enter(&seq, position, 100 + position as u64));
    }
    let ids = seq.ids().to_vec();
    assert!(!prefixes.enter(&seq, 0, 7), "cached already");
    assert!(!cache.is_writable(&seq, 0), "read-only once cached");
    assert_eq!(prefixes.len(), 3);
    drop(seq);
    assert_eq!(cache.idle_cached_blocks(), 3);
    assert_eq!(cache.live_blocks(), 0);

    let mut hit = cache.table();
    assert!(prefixes.lookup(&100, &mut hit));
    assert_eq!(read(&hit, 0), [0, !0]);
    assert_eq!(cache.idle_cached_blocks(), 2);

    // Take every free block: the next pushes evict the idle ones, the later block first.
    let mut filler = cache.table();
    while cache.free_blocks() > 0 {
        cache.push(&mut filler).unwrap();
    }
    assert_eq!(cache.push(&mut filler), Ok(ids[2]));
    assert_eq!(cache.push(&mut filler), Ok(ids[1]));
    assert!(
        matches!(cache.push(&mut filler), Err(KvError::NoRoom { .. })),
        "the held one stays"
    );
    assert!(prefixes.contains(&100) && !prefixes.contains(&102));
    assert_eq!(prefixes.len(), 1);
    assert!(!prefixes.lookup(&101, &mut hit));
    let events = events.borrow().clone();
    assert_eq!(
        events,
        [
            ('+', 100, ids[0]),
            ('+', 101, ids[1]),
            ('+', 102, ids[2]),
            ('-', 102, ids[2]),
            ('-', 101, ids[1]),
        ]
    );
}

/// A sleep that drops the bytes evicts every cached block (no key finds bytes that are gone);
/// a sleep that saves them keeps the cache.
#[test]
fn a_sleep_that_drops_the_bytes_empties_the_prefix_cache_and_one_that_saves_does_not() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let mut seq = cache.table();
    for position in 0..2 {
        cache.push(&mut seq).unwrap();
        write(&mut seq, position, 5);
        prefixes.enter(&seq, position, position);
    }
    cache.clear(&mut seq);
    cache.push(&mut seq).unwrap();
    prefixes.enter(&seq, 0, 2);
    cache.sleep_saving().unwrap();
    cache.wake().unwrap();
    assert_eq!(prefixes.len(), 3);
    assert!(!prefixes.is_empty());
    assert_eq!(cache.idle_cached_blocks(), 2);
    cache.sleep().unwrap();
    assert_eq!(prefixes.len(), 0);
    assert!(prefixes.is_empty());
    assert_eq!(cache.idle_cached_blocks(), 0);
    cache.wake().unwrap();
    assert!(!prefixes.lookup(&0, &mut seq));
    assert!(cache.is_writable(&seq, 0), "cached no more");
}

/// Dropping the prefix cache lets its blocks go: idle ones are freed, held ones writable again.
#[test]
fn a_dropped_prefix_cache_lets_its_blocks_go() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let (mut a, mut b) = (cache.table(), cache.table());
    cache.push(&mut a).unwrap();
    cache.push(&mut b).unwrap();
    prefixes.enter(&a, 0, 1);
    prefixes.enter(&b, 0, 2);
    drop(a);
    let free = cache.free_blocks();
    drop(prefixes);
    assert_eq!(cache.free_blocks(), free + 1, "the idle one is free");
    assert!(cache.is_writable(&b, 0));
    assert_eq!(cache.live_blocks(), 1);
    assert!(
        PrefixCache::<_, u32>::new(&cache).is_ok(),
        "a new one may be made"
    );
}

/// A copy-on-write whose copy fails leaves the table as it was, and gives the new block back.
#[test]
fn a_failed_copy_on_write_changes_nothing() {
    let backend = Faulty::new(common::host());
    let faults = backend.handle();
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(g);
    let cache = KvCache::new(g, &binding, &layout(1024)).unwrap();
    cache.replenish().unwrap();
    let mut a = cache.table();
    cache.push(&mut a).unwrap();
    write(&mut a, 0, 3);
    let mut b = cache.fork(&a);
    let free = cache.free_blocks();
    faults.fail_nth(Op::Copy, 2); // the second plane's copy
    assert!(matches!(
        cache.copy_on_write(&mut b, 0),
        Err(KvError::Copy(_))
    ));
    assert_eq!(b.ids(), a.ids());
    assert_eq!(cache.holders(a.ids()[0]), 2);
    assert_eq!(cache.free_blocks(), free);
}

/// On a backend that is not immediate an evicted block waits for a fence, as any block given
/// back: the push that evicts it fails, and the block is handed out after `replenish`.
#[test]
fn on_the_driver_model_an_evicted_block_waits_for_its_fence() {
    model_cache!(model, device, binding, cache);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let mut seq = cache.table();
    cache.push(&mut seq).unwrap();
    prefixes.enter(&seq, 0, 'k');
    let cached = seq.ids()[0];
    drop(seq);
    let mut filler = cache.table();
    while cache.free_blocks() > 0 {
        cache.push(&mut filler).unwrap();
    }
    assert!(matches!(
        cache.push(&mut filler),
        Err(KvError::NoRoom { cooling: 1, .. })
    ));
    assert!(!prefixes.contains(&'k'));
    cache.replenish().unwrap();
    assert_eq!(cache.push(&mut filler), Ok(cached));
    drop((filler, prefixes));
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero());
}

/// On the driver model a prefix cache dropped with an idle block cached lets it go behind a
/// fence, as any block given back: it cools until a replenish sees the fence done. Fails if
/// the drop frees it at once on a backend that is not immediate (a kernel may still read it).
#[test]
fn on_the_driver_model_a_dropped_prefix_caches_idle_block_cools() {
    model_cache!(model, device, binding, cache);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let mut seq = cache.table();
    cache.push(&mut seq).unwrap();
    prefixes.enter(&seq, 0, 'k');
    drop(seq);
    let (free, cooling) = (cache.free_blocks(), cache.cooling_blocks());
    drop(prefixes);
    assert_eq!(
        (cache.free_blocks(), cache.cooling_blocks()),
        (free, cooling + 1),
        "the idle cached block cools behind a fence"
    );
    cache.replenish().unwrap();
    assert_eq!((cache.free_blocks(), cache.cooling_blocks()), (free + 1, 0));
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero());
}

#[derive(Clone, Debug)]
enum Step {
    /// A new sequence of n fresh blocks, each written.
    New(usize),
    /// A fork of a sequence.
    Fork(usize),
    /// A sequence's block shared into another sequence.
    Share(usize, usize, usize),
    /// A write to a sequence's block (a copy-on-write first if it is shared or cached).
    Write(usize, usize, u8),
    /// One more fresh block at a sequence's end.
    Push(usize),
    /// A sequence goes.
    Free(usize),
    /// A sequence's block is entered in the prefix cache under a new key.
    Enter(usize, usize),
    /// A key is looked up; a hit joins a sequence (or a new one).
    Lookup(usize, usize),
    /// Every idle block is evicted.
    EvictIdle,
    /// The prefix cache's limit is set (0: none).
    Limit(usize),
    /// Between steps: fences and groups.
    Replenish,
    /// The nth backend call of a kind fails.
    Fault(Op, u64),
}

fn step() -> impl Strategy<Value = Step> {
    let op = prop::sample::select(vec![Op::Map, Op::Copy, Op::Unmap]);
    prop_oneof![
        3 => (1usize..5).prop_map(Step::New),
        2 => any::<usize>().prop_map(Step::Fork),
        2 => (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(s, p, t)| Step::Share(s, p, t)),
        4 => (any::<usize>(), any::<usize>(), any::<u8>()).prop_map(|(s, p, b)| Step::Write(s, p, b)),
        2 => any::<usize>().prop_map(Step::Push),
        3 => any::<usize>().prop_map(Step::Free),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(s, p)| Step::Enter(s, p)),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(k, s)| Step::Lookup(k, s)),
        1 => Just(Step::EvictIdle),
        1 => (0usize..6).prop_map(Step::Limit),
        2 => Just(Step::Replenish),
        2 => (op, 1u64..4).prop_map(|(op, n)| Step::Fault(op, n)),
    ]
}

/// What the test expects: each sequence's blocks and the bytes each holds; each key's block
/// and its bytes when entered; the idle blocks in the order they were let go; what the hook
/// heard.
struct World<'t, 'c, 'b, 'id, B: Backend, S> {
    cache: &'t KvCache<'c, 'b, 'id, B>,
    prefixes: PrefixCache<'t, 'c, 'b, 'id, B, u64, S>,
    faults: FaultHandle,
    seqs: Vec<(BlockTable<'t, 'c, 'b, 'id, B>, Vec<[u8; 2]>)>,
    /// Key → (block, its bytes when entered).
    keys: HashMap<u64, (u32, [u8; 2])>,
    next_key: u64,
    /// Idle blocks, least recently let go first (as the test believes).
    idle: Vec<u32>,
    /// Cached blocks (as the test believes).
    cached: Vec<u32>,
    /// Blocks the hook heard removed, not yet checked.
    removed: Rc<RefCell<Vec<(u64, u32)>>>,
    /// The prefix cache's limit.
    limit: usize,
}

impl<'t, 'c, 'b, 'id, B: Backend, S: BuildHasher> World<'t, 'c, 'b, 'id, B, S> {
    /// Holders of each block, counted from what the test holds.
    fn holders(&self) -> HashMap<u32, u32> {
        let mut held = HashMap::new();
        for (table, _) in &self.seqs {
            for &block in table.ids() {
                *held.entry(block).or_default() += 1;
            }
        }
        held
    }

    /// One holder of `block` let it go (`held`: the holders just before): with none left, a
    /// cached block becomes idle, last in the eviction order.
    fn let_go(&mut self, held: &mut HashMap<u32, u32>, block: u32) {
        let n = held.get_mut(&block).expect("a held block");
        *n -= 1;
        if *n == 0 {
            held.remove(&block);
            if self.cached.contains(&block) {
                self.idle.push(block);
            }
        }
    }

    /// A fresh block just handed out: held by no one before, not idle.
    fn check_fresh(&self, block: u32, holders_before: &HashMap<u32, u32>) {
        assert!(
            !holders_before.contains_key(&block),
            "block {block} handed out twice"
        );
        assert!(
            !self.idle.contains(&block),
            "idle block {block} handed out without eviction"
        );
    }

    /// Writes `byte` at `position` of sequence `s`, plane by plane: what each plane holds
    /// after it (a faulted copy writes nothing).
    fn write(&mut self, s: usize, position: usize, byte: u8) {
        let (table, bytes) = &mut self.seqs[s];
        for (plane, value) in [byte, !byte].into_iter().enumerate() {
            if table.write(plane, position, 0, &[value; HEAD]).is_ok() {
                bytes[position][plane] = value;
            }
        }
    }

    /// Appends a fresh block to sequence `s`, written with `byte`: whether one was had.
    fn push(&mut self, s: usize, byte: u8) -> bool {
        let before = self.holders();
        let pushed = self.cache.push(&mut self.seqs[s].0);
        self.sync_evictions(&before);
        let Ok(block) = pushed else { return false };
        self.check_fresh(block, &before);
        // What a fresh block holds: the test reads it to know.
        self.faults.clear();
        let now = read(&self.seqs[s].0, self.seqs[s].0.len() - 1);
        self.seqs[s].1.push(now);
        self.write(s, self.seqs[s].1.len() - 1, byte);
        true
    }

    fn apply(&mut self, step: &Step) {
        let cache = self.cache;
        match *step {
            Step::New(n) => {
                self.seqs.push((cache.table(), Vec::new()));
                let s = self.seqs.len() - 1;
                for i in 0..n {
                    let byte = (self.next_key as u8).wrapping_add(i as u8) | 1;
                    if !self.push(s, byte) {
                        break;
                    }
                }
            }
            Step::Fork(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    let fork = cache.fork(&self.seqs[s].0);
                    let bytes = self.seqs[s].1.clone();
                    self.seqs.push((fork, bytes));
                }
            }
            Step::Share(s, p, t) => {
                if let (Some((s, p)), Some(t)) = (self.position(s, p), pick(t, self.seqs.len()))
                    && s != t
                {
                    let (from, into) = two(&mut self.seqs, s, t);
                    let block = cache.share(&from.0, p, &mut into.0);
                    assert_eq!(block, from.0.ids()[p]);
                    into.1.push(from.1[p]);
                }
            }
            Step::Write(s, p, byte) => {
                if let Some((s, p)) = self.position(s, p) {
                    let before = self.holders();
                    let old = self.seqs[s].0.ids()[p];
                    match cache.copy_on_write(&mut self.seqs[s].0, p) {
                        Ok(copied) => {
                            self.sync_evictions(&before);
                            if copied {
                                self.check_fresh(self.seqs[s].0.ids()[p], &before);
                                let mut held = before;
                                self.let_go(&mut held, old);
                                self.faults.clear();
                                assert_eq!(
                                    read(&self.seqs[s].0, p),
                                    self.seqs[s].1[p],
                                    "a copy-on-write copied other bytes"
                                );
                            }
                            assert!(cache.is_writable(&self.seqs[s].0, p));
                            self.write(s, p, byte);
                        }
                        Err(_) => {
                            self.sync_evictions(&before);
                            assert_eq!(
                                self.seqs[s].0.ids()[p],
                                old,
                                "a failed copy-on-write changed the table"
                            );
                            assert_eq!(
                                self.seqs[s].0.write(0, p, 0, &[byte]).err(),
                                Some(KvError::ReadOnly { position: p })
                            );
                        }
                    }
                }
            }
            Step::Push(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    self.push(s, 0x5a);
                }
            }
            Step::Free(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    let mut held = self.holders();
                    let (table, _) = self.seqs.swap_remove(s);
                    let order: Vec<u32> = table.ids().iter().rev().copied().collect();
                    drop(table);
                    // Let go last block first: the later blocks become idle first.
                    for block in order {
                        self.let_go(&mut held, block);
                    }
                }
            }
            Step::Enter(s, p) => {
                if let Some((s, p)) = self.position(s, p) {
                    let key = self.next_key;
                    self.next_key += 1;
                    let block = self.seqs[s].0.ids()[p];
                    let before = self.holders();
                    // At the limit, idle blocks are evicted until there is room: there is,
                    // unless the held cached blocks alone reach the limit.
                    let room = self.cached.len() - self.idle.len() < self.limit;
                    let entered = self.prefixes.enter(&self.seqs[s].0, p, key);
                    self.sync_evictions(&before);
                    assert_eq!(entered, !self.cached.contains(&block) && room);
                    if entered {
                        self.cached.push(block);
                        self.keys.insert(key, (block, self.seqs[s].1[p]));
                    }
                }
            }
            Step::Lookup(k, s) => {
                if self.next_key == 0 {
                    return;
                }
                let key = (k as u64) % self.next_key;
                let before = self.holders();
                let s = match pick(s, self.seqs.len()).filter(|_| s % 2 == 0) {
                    Some(s) => s,
                    None => {
                        self.seqs.push((cache.table(), Vec::new()));
                        self.seqs.len() - 1
                    }
                };
                let hit = self.prefixes.lookup(&key, &mut self.seqs[s].0);
                self.sync_evictions(&before);
                match (hit, self.keys.get(&key).copied()) {
                    (true, Some((block, bytes))) => {
                        let table = &self.seqs[s].0;
                        assert_eq!(table.ids().last(), Some(&block));
                        self.faults.clear();
                        assert_eq!(
                            read(table, table.len() - 1),
                            bytes,
                            "a hit read other bytes than were entered"
                        );
                        self.idle.retain(|&i| i != block);
                        self.seqs[s].1.push(bytes);
                    }
                    (false, None) => {}
                    (hit, expected) => {
                        panic!(
                            "key {key}: the cache answered {hit}, the test expected {expected:?}"
                        )
                    }
                }
            }
            Step::EvictIdle => {
                let before = self.holders();
                let n = cache.evict_idle();
                assert_eq!(n, self.idle.len());
                self.sync_evictions(&before);
            }
            Step::Limit(n) => {
                let before = self.holders();
                let limit = (n > 0).then_some(n);
                self.prefixes.set_limit(limit);
                self.limit = limit.unwrap_or(usize::MAX);
                self.sync_evictions(&before);
                let held_cached = self.cached.len() - self.idle.len();
                assert!(
                    self.cached.len() <= self.limit.max(held_cached),
                    "over the limit with idle blocks left"
                );
            }
            Step::Replenish => {
                let before = self.holders();
                let _ = cache.replenish();
                self.sync_evictions(&before);
            }
            Step::Fault(op, n) => self.faults.fail_nth(op, n),
        }
    }

    /// Blocks evicted since the last look (`held`: the holders before the step): they were
    /// held by no one, and are the idle blocks let go least recently (a prefix of the test's
    /// order); their keys find nothing, and the hook heard each one removed.
    fn sync_evictions(&mut self, held: &HashMap<u32, u32>) {
        let evicted: Vec<u32> = self
            .cached
            .iter()
            .copied()
            .filter(|&i| !self.cache.is_cached(i))
            .collect();
        self.prefixes.sync();
        let mut heard: Vec<u32> = self
            .removed
            .borrow_mut()
            .drain(..)
            .map(|(key, block)| {
                assert_eq!(
                    self.keys.get(&key).map(|k| k.0),
                    Some(block),
                    "removed under its key"
                );
                block
            })
            .collect();
        heard.sort_unstable();
        let mut sorted_evicted = evicted.clone();
        sorted_evicted.sort_unstable();
        assert_eq!(heard, sorted_evicted, "the hook heard every eviction once");
        if evicted.is_empty() {
            return;
        }
        for &block in &evicted {
            assert!(!held.contains_key(&block), "held block {block} was evicted");
        }
        let mut sorted_prefix = self.idle[..evicted.len()].to_vec();
        sorted_prefix.sort_unstable();
        assert_eq!(
            sorted_evicted, sorted_prefix,
            "eviction took {evicted:?}, not the least recently let go {:?}",
            self.idle
        );
        self.idle.drain(..evicted.len());
        self.cached.retain(|i| !evicted.contains(i));
        self.keys.retain(|_, (i, _)| !evicted.contains(i));
    }

    fn position(&self, s: usize, p: usize) -> Option<(usize, usize)> {
        let s = pick(s, self.seqs.len())?;
        let p = pick(p, self.seqs[s].0.len())?;
        Some((s, p))
    }

    fn check(&self) {
        let held = self.holders();
        for (&block, &n) in &held {
            assert_eq!(
                self.cache.holders(block),
                n,
                "block {block}: count vs live holders"
            );
            assert_eq!(self.cache.is_cached(block), self.cached.contains(&block));
        }
        assert_eq!(self.cache.idle_cached_blocks(), self.idle.len());
        for &block in &self.idle {
            assert_eq!(self.cache.holders(block), 0);
            assert!(self.cache.is_cached(block));
        }
        assert_eq!(self.cache.live_blocks(), held.len());
        if let Err(e) = self.cache.check_blocks() {
            panic!("a block lost or free twice: {e}");
        }
        assert_eq!(self.prefixes.len(), self.keys.len());
        for (table, bytes) in &self.seqs {
            assert_eq!(table.len(), bytes.len());
            for (position, &expected) in bytes.iter().enumerate() {
                assert_eq!(
                    read(table, position),
                    expected,
                    "a sequence read back other bytes"
                );
            }
        }
    }
}

/// Sequences `a` and `b` (distinct), both mutable.
fn two<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&mut lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&mut hi[0], &mut lo[b])
    }
}

fn pick(i: usize, len: usize) -> Option<usize> {
    (len > 0).then(|| i % len)
}

fn run<B: Backend, S: BuildHasher>(
    device: &Device<'_, B>,
    faults: FaultHandle,
    steps: &[Step],
    block: usize,
    hasher: S,
) {
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        make_guard!(g);
        let cache = KvCache::new(g, &binding, &layout(block)).unwrap();
        cache.set_watermarks(2, 3);
        cache.replenish().unwrap();
        let removed = Rc::new(RefCell::new(Vec::new()));
        let mut prefixes = PrefixCache::with_hasher(&cache, hasher).unwrap();
        let heard = removed.clone();
        prefixes.on_event(move |event| {
            if let CacheEvent::Removed { key, block } = event {
                heard.borrow_mut().push((*key, block));
            }
        });
        let mut world = World {
            cache: &cache,
            prefixes,
            faults: faults.clone(),
            seqs: Vec::new(),
            keys: HashMap::new(),
            next_key: 0,
            idle: Vec::new(),
            cached: Vec::new(),
            removed,
            limit: usize::MAX,
        };
        for step in steps {
            world.apply(step);
            faults.clear();
            world.check();
        }
        let World { seqs, prefixes, .. } = world;
        drop((seqs, prefixes));
        assert_eq!(cache.live_blocks(), 0, "every block is free at the end");
        assert_eq!(cache.idle_cached_blocks(), 0);
        cache
            .check_blocks()
            .expect("every block of a mapped group free, once");
    }
    drop(binding);
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: common::proptest_cases(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn shared_blocks_on_the_host_keep_counts_bytes_and_eviction_order(steps in prop::collection::vec(step(), 1..60)) {
        make_guard!(guard);
        let backend = Faulty::new(common::host());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        run(&device, faults.clone(), &steps, 1024, std::collections::hash_map::RandomState::new());
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero());
    }

    #[test]
    fn shared_blocks_on_the_driver_model_keep_counts_bytes_and_eviction_order(steps in prop::collection::vec(step(), 1..60)) {
        let model = common::model();
        make_guard!(guard);
        let backend = Faulty::new(CudaBackend::new(model.clone(), 0).unwrap());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        run(&device, faults.clone(), &steps, common::MODEL_GRANULARITY / 4, PrehashedKeys);
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero());
        assert!(model.outstanding().is_zero());
    }
}

/// At its limit the prefix cache evicts the idle block let go least recently before it enters
/// another, enters nothing while every cached block is held, and a lower limit evicts at once.
#[test]
fn a_prefix_cache_at_its_limit_evicts_before_it_enters() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    prefixes.set_limit(Some(2));
    assert_eq!(prefixes.limit(), Some(2));
    let mut seq = cache.table();
    for _ in 0..3 {
        cache.push(&mut seq).unwrap();
    }
    assert!(prefixes.enter(&seq, 0, 0));
    assert!(prefixes.enter(&seq, 1, 1));
    assert!(!prefixes.enter(&seq, 2, 2), "both cached blocks are held");
    assert_eq!(prefixes.len(), 2);
    assert_eq!(format!("{prefixes:?}"), "PrefixCache { entries: 2, .. }");
    let ids = seq.ids().to_vec();
    let mut tail = cache.table();
    cache.share(&seq, 2, &mut tail);
    drop(seq); // blocks 0 and 1 idle, block 1 first (the later block is let go first)
    assert!(
        prefixes.enter(&tail, 0, 2),
        "the idle block let go least recently makes room"
    );
    assert!(!prefixes.contains(&1) && prefixes.contains(&0) && prefixes.contains(&2));
    assert!(!cache.is_cached(ids[1]));
    prefixes.set_limit(Some(1));
    assert_eq!(prefixes.len(), 1, "the idle block 0 goes at once");
    assert!(
        prefixes.contains(&2),
        "held: kept over the limit's lowering"
    );
    prefixes.set_limit(None);
    assert_eq!(prefixes.limit(), None);
}

/// A limit lowered while every cached block is held: once they are idle, an entry evicts them
/// until there is room. A limit set at the count of cached blocks evicts none.
#[test]
fn an_entry_over_a_lowered_limit_evicts_until_there_is_room() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let mut seq = cache.table();
    for p in 0..4 {
        cache.push(&mut seq).unwrap();
        assert!(prefixes.enter(&seq, p, p as u32));
    }
    prefixes.set_limit(Some(1));
    assert_eq!(prefixes.len(), 4, "held: none evicted");
    drop(seq);
    let mut other = cache.table();
    cache.push(&mut other).unwrap();
    assert!(prefixes.enter(&other, 0, 99));
    assert_eq!(prefixes.len(), 1);
    drop(other);
    prefixes.set_limit(Some(1));
    assert_eq!(
        prefixes.len(),
        1,
        "at its limit, not over it: nothing evicted"
    );
}

/// A hook that panics leaves the prefix cache consistent: the keys of the evicted blocks are
/// gone, and its count right.
#[test]
fn a_hook_that_panics_leaves_the_prefix_cache_consistent() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let armed = Rc::new(RefCell::new(true));
    let fire = armed.clone();
    prefixes.on_event(move |e| {
        if let CacheEvent::Removed { .. } = e
            && fire.replace(false)
        {
            panic!("the hook fails once");
        }
    });
    let mut seq = cache.table();
    for p in 0..2 {
        cache.push(&mut seq).unwrap();
        prefixes.enter(&seq, p, p as u32);
    }
    drop(seq);
    assert_eq!(cache.evict_idle(), 2);
    let sync = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| prefixes.sync()));
    assert!(sync.is_err());
    assert_eq!(prefixes.len(), 0);
    assert!(!prefixes.contains(&0) && !prefixes.contains(&1));
}

/// A key whose `Clone` panics is not entered, and nothing changes.
#[test]
fn a_key_whose_clone_panics_enters_nothing() {
    #[derive(PartialEq, Eq, Debug, Hash)]
    struct Brittle(u32);
    impl Clone for Brittle {
        fn clone(&self) -> Self {
            panic!("clone fails");
        }
    }
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    let mut seq = cache.table();
    cache.push(&mut seq).unwrap();
    let entered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        prefixes.enter(&seq, 0, Brittle(1))
    }));
    assert!(entered.is_err());
    assert!(!cache.is_cached(seq.ids()[0]));
    assert!(cache.is_writable(&seq, 0));
    assert_eq!(prefixes.len(), 0);
}

/// A hook that puts the cache to sleep while an entry makes room: the entry is refused (no key
/// names bytes a sleep dropped).
#[test]
fn an_entry_is_refused_when_the_hook_puts_the_cache_to_sleep() {
    host_cache!(cache, binding, device);
    let mut prefixes = PrefixCache::new(&cache).unwrap();
    prefixes.set_limit(Some(1));
    let c = &cache;
    prefixes.on_event(move |e| {
        if let CacheEvent::Removed { .. } = e {
            c.sleep().unwrap();
        }
    });
    let mut a = cache.table();
    cache.push(&mut a).unwrap();
    assert!(prefixes.enter(&a, 0, 0u32));
    drop(a);
    let mut b = cache.table();
    cache.push(&mut b).unwrap();
    assert!(!prefixes.enter(&b, 0, 1), "refused: the cache fell asleep");
    assert!(cache.is_asleep());
    assert!(!cache.is_cached(b.ids()[0]));
    assert_eq!(prefixes.len(), 0);
}
