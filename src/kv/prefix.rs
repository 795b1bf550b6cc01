//! [`PrefixCache`]: full blocks found again by a key for the whole prefix up to and including
//! them, kept until the KV cache needs them; [`PrehashedKeys`] for keys that are hashes
//! already; [`CacheEvent`]s for KV-aware routers.

use super::{BlockTable, KvCache, KvError, NULL_BLOCK};
use crate::backend::Backend;
use std::borrow::Borrow;
use std::collections::HashMap;
use std::collections::hash_map::{Entry, RandomState};
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};

/// What a [`PrefixCache`] tells its hook (vLLM's `BlockStored` and `BlockRemoved`, the events
/// a KV-aware router follows).
#[derive(Debug, PartialEq, Eq)]
pub enum CacheEvent<'k, K> {
    /// `block` was entered under `key`.
    Stored {
        /// The key.
        key: &'k K,
        /// The block.
        block: u32,
    },
    /// `block`, entered under `key`, was evicted: `key` finds nothing any more.
    Removed {
        /// The key.
        key: &'k K,
        /// The block.
        block: u32,
    },
}

/// A hook called with each [`CacheEvent`].
type Hook<'t, K> = Box<dyn FnMut(CacheEvent<'_, K>) + 't>;

/// A prefix cache's hook, which may hold anything (an `Rc`, the KV cache): `Send` and `Sync`
/// to the compiler only so that what keeps a [`PrefixCache`] from moving is, in its errors,
/// the KV cache's public mark [`OneThread`](super::OneThread) — not the hook's type.
struct LocalHook<'t, K>(Option<Hook<'t, K>>);

// SAFETY: a `LocalHook` is only ever the private field of a `PrefixCache`, which borrows its
// KV cache (`&KvCache`, and a KV cache is not `Sync` at any brand: its `OneThread`), so a prefix
// cache is neither `Send` nor `Sync` (tests/it/static_asserts.rs) and its hook never reaches
// another thread.
unsafe impl<K> Send for LocalHook<'_, K> {}
// SAFETY: as for `Send`.
unsafe impl<K> Sync for LocalHook<'_, K> {}

/// A prefix cache over a [`KvCache`]: full blocks entered under a key of the caller's, found
/// again by it — one more holder, no byte copied.
///
/// **The key** stands for everything the block's contents depend on: the whole prefix up to
/// and including the block (so a block's key is built from its parent block's key and its own
/// tokens) and anything else the KV depends on (an adapter, multimodal inputs, a cache salt).
/// Any `Hash + Eq + Clone` type serves. Keys are hashed with SipHash, randomly keyed, unless
/// the cache is made [`with_hasher`](Self::with_hasher): [`PrehashedKeys`] skips the hashing
/// for keys that are already keyed hashes.
///
/// ```
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::HostBackend;
/// use memtoken::kv::{KvCache, Layout, PrefixCache};
///
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// make_guard!(cache_guard);
/// let cache = KvCache::new(cache_guard, &binding, &Layout::per_layer(2, 16, 64, 1024))?;
/// cache.replenish()?;
/// let mut prefixes = PrefixCache::new(&cache)?;
///
/// // A prompt of two full blocks: their keys chain the whole prefix.
/// let keys = [("system prompt", 0), ("system prompt", 1)];
/// let mut first = cache.table();
/// for (position, key) in keys.iter().enumerate() {
///     cache.push(&mut first)?;
///     first.write(0, position, 0, &[position as u8])?; // the block's KV
///     prefixes.enter(&first, position, *key);
/// }
/// drop(first); // its blocks stay findable until the cache needs them
///
/// let mut second = cache.table();
/// for key in &keys {
///     if !prefixes.lookup(key, &mut second) {
///         cache.push(&mut second)?;
///     }
/// }
/// let mut byte = [0];
/// second.read(0, 1, 0, &mut byte)?;
/// assert_eq!(byte, [1]); // both blocks hit
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// **What it keeps.** A block entered is read-only until evicted — even while a single table
/// holds it, a write to it copies ([`KvCache::copy_on_write`]; [`BlockTable::write`] refuses
/// it). When its last table lets it go it is not freed but idle: findable, and evicted only
/// when the cache needs a block and no mapped group has a free one — the block let go least
/// recently first, and of one sequence its later blocks before its earlier ones — or by
/// [`KvCache::evict_idle`]. A held block is never evicted — but a sleep that drops the bytes
/// uncaches every block, held ones too (they stay in their tables, cached no more).
///
/// **The memory it keeps.** A group holding a cached block, idle or not, stays mapped. Without a
/// limit, cached blocks fill the free blocks of the mapped groups, and as `replenish` maps more
/// groups to keep its low watermark of idle groups, a long-running cache ends with every group
/// mapped. [`set_limit`](Self::set_limit) bounds the blocks cached at once: at the limit an
/// entry evicts the idle block let go least recently, and the groups left with no block go back
/// at the high watermark. `examples/kv_footprint.rs` (16 Ki blocks, groups of 64, 400 steps of
/// 8 requests sharing 32 system prompts): no limit, 256 of 256 groups mapped at the end and
/// 12,668 prompt blocks hit; a limit of 2,048 blocks, 34 groups and 12,640 hits; 512 blocks, 11
/// groups and 10,310 hits. Sleep without saving ([`KvCache::sleep`]) drops the bytes, so it
/// evicts every block.
///
/// One prefix cache per KV cache (it borrows it). Dropped, it lets its blocks go: each is
/// cached no more (writable again by a sole holder), and an idle one is freed.
///
/// An entry, a lookup and an eviction cost the same whatever the cache's size: a hash-map
/// operation, and O(1) work on the block's word and the eviction order ([`sync`](Self::sync):
/// O(1) per block evicted since the last). Making and dropping a prefix cache are O(blocks).
pub struct PrefixCache<'t, 'c, 'b, 'id, B: Backend, K, S = RandomState> {
    cache: &'t KvCache<'c, 'b, 'id, B>,
    /// Each key's block.
    entries: HashMap<K, u32, S>,
    /// Each block's key, while it is cached.
    keys: Vec<Option<K>>,
    hook: LocalHook<'t, K>,
    /// The most blocks cached at once ([`set_limit`](Self::set_limit)).
    limit: usize,
    /// The blocks of the eviction log whose keys are gone already (a `sync` a hook cut short).
    synced: usize,
}

impl<'t, 'c, 'b, 'id, B: Backend, K: Hash + Eq + Clone> PrefixCache<'t, 'c, 'b, 'id, B, K> {
    /// An empty prefix cache over `cache`, its keys hashed with randomly keyed SipHash.
    ///
    /// # Errors
    ///
    /// [`KvError::PrefixCacheTaken`] if `cache` has one already.
    pub fn new(cache: &'t KvCache<'c, 'b, 'id, B>) -> Result<Self, KvError> {
        Self::with_hasher(cache, RandomState::new())
    }
}

impl<'t, 'c, 'b, 'id, B: Backend, K: Hash + Eq + Clone, S: BuildHasher>
    PrefixCache<'t, 'c, 'b, 'id, B, K, S>
{
    /// An empty prefix cache over `cache`, its keys hashed by `hasher` ([`PrehashedKeys`] for
    /// keys that are keyed hashes already). Allocates O(blocks) once: each block's key slot
    /// and its links in the eviction order.
    ///
    /// # Errors
    ///
    /// [`KvError::PrefixCacheTaken`] if `cache` has one already.
    pub fn with_hasher(cache: &'t KvCache<'c, 'b, 'id, B>, hasher: S) -> Result<Self, KvError> {
        let blocks = cache.blocks();
        cache.with(|s| {
            if s.prefixed {
                return Err(KvError::PrefixCacheTaken);
            }
            s.prefixed = true;
            s.lru.attach(blocks);
            s.evicted = Vec::with_capacity(blocks);
            Ok(())
        })?;
        Ok(Self {
            cache,
            entries: HashMap::with_hasher(hasher),
            keys: vec![None; blocks],
            hook: LocalHook(None),
            limit: usize::MAX,
            synced: 0,
        })
    }

    /// Calls `hook` with every block entered and every block evicted from now on. An eviction
    /// is told at this cache's next [`enter`](Self::enter), [`sync`](Self::sync),
    /// [`set_limit`](Self::set_limit) or drop — or [`lookup`](Self::lookup), only when it meets
    /// the evicted block's key (a hit costs no look at the evictions): an engine that reports
    /// to a router calls `sync` once a step. The hook may call into the KV cache; a hook that
    /// panics leaves the cache consistent, and the evictions after its own are told at the next
    /// call.
    pub fn on_event(&mut self, hook: impl FnMut(CacheEvent<'_, K>) + 't) {
        self.hook.0 = Some(Box::new(hook));
    }

    /// Enters the block at `position` of `table` under `key` (the caller's key for the whole
    /// prefix up to and including the block: enter only full blocks, once their bytes are
    /// written). From now on the block is read-only until evicted. Whether it was entered: not
    /// if the key names a block already (the first stays), if the block is cached already, or
    /// while the KV cache sleeps.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    #[inline(always)]
    pub fn enter(
        &mut self,
        table: &BlockTable<'_, 'c, 'b, 'id, B>,
        position: usize,
        key: K,
    ) -> bool {
        self.sync();
        let block = table.ids()[position];
        debug_assert_ne!(block, NULL_BLOCK, "a table holds no null block");
        if self.cache.is_asleep() || self.cache.with(|s| s.is_cached(block)) {
            return false;
        }
        if self.entries.len() >= self.limit && !self.make_room(&key, block) {
            return false;
        }
        let Entry::Vacant(entry) = self.entries.entry(key) else {
            return false;
        };
        // The key's copy before anything changes: a `clone` that panics leaves all as it was.
        let copy = entry.key().clone();
        self.cache.with(|s| s.cache(block));
        table.mark_shared();
        debug_assert!(
            self.keys[block as usize].is_none(),
            "an uncached block has no key"
        );
        let key = self.keys[block as usize].insert(copy);
        entry.insert(block);
        if let Some(hook) = &mut self.hook.0 {
            hook(CacheEvent::Stored { key, block });
        }
        true
    }

    /// Appends the block entered under `key`, if there is one, to `table`, which becomes one
    /// more of its holders (an idle block leaves the eviction order); whether there was one.
    ///
    /// # Panics
    ///
    /// If the block already has 2^30 holders.
    #[inline(always)]
    pub fn lookup<Q>(&mut self, key: &Q, table: &mut BlockTable<'_, 'c, 'b, 'id, B>) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(&block) = self.entries.get(key) else {
            return false;
        };
        // Cached still, it is this key's: a block evicted is entered again only after its old
        // key is dropped (`enter` syncs first).
        if !self.cache.with(|s| s.hold_if_cached(block)) {
            self.sync_cold(); // evicted since the last look: its key goes now
            return false;
        }
        table.ids_mut().push(block);
        table.mark_shared();
        true
    }

    /// Whether `key` names a block not evicted.
    pub fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.entries
            .get(key)
            .is_some_and(|&block| self.cache.with(|s| s.is_cached(block)))
    }

    /// Keys that name a block not evicted.
    pub fn len(&self) -> usize {
        // Every block in the log was entered by this cache (the only one) and keeps its key
        // until `sync` drops it and empties the log, both before any hook runs.
        self.entries.len() - (self.cache.with(|s| s.evicted.len()) - self.synced)
    }

    /// Whether no key names a block not evicted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets the most blocks cached at once (`None`: no limit, the default), evicting the idle
    /// blocks let go least recently over it now. At the limit, [`enter`](Self::enter) evicts
    /// the idle block let go least recently first (idle blocks until the count is below the
    /// limit), and enters nothing if the held cached blocks alone reach it. This is how the cache bounds its share of the mapped memory: without a limit,
    /// cached blocks fill the free blocks of the mapped groups, and a group holding one is
    /// never given back (see the type's documentation).
    pub fn set_limit(&mut self, blocks: Option<usize>) {
        self.limit = blocks.unwrap_or(usize::MAX);
        self.sync();
        while self.entries.len() > self.limit && self.evict_one() {}
    }

    /// The most blocks cached at once (`None`: no limit).
    pub fn limit(&self) -> Option<usize> {
        (self.limit != usize::MAX).then_some(self.limit)
    }

    /// At the limit, before `key` is entered: whether there is room now. Idle blocks are
    /// evicted, the least recently let go first, until there is — more than one if the limit
    /// was lowered while they were held, and every one if the held blocks alone reach the limit
    /// (then there is none; nor if `key` is entered already).
    #[cold]
    fn make_room(&mut self, key: &K, block: u32) -> bool {
        if self.entries.contains_key(key) {
            return false;
        }
        while self.entries.len() >= self.limit {
            if !self.evict_one() {
                return false;
            }
        }
        // The hook heard of the evictions, and may have called into the KV cache (a sleep
        // that dropped the bytes, say): asked again.
        !self.cache.is_asleep() && !self.cache.is_cached(block)
    }

    /// Evicts the idle block let go least recently, its key dropped; whether there was one.
    fn evict_one(&mut self) -> bool {
        let evicted = self.cache.evict_lru(false).is_some();
        self.sync();
        evicted
    }

    #[cold]
    #[inline(never)]
    fn sync_cold(&mut self) {
        self.sync();
    }

    /// Drops the keys of the blocks evicted since the last call, telling the hook.
    pub fn sync(&mut self) {
        let synced = self.synced;
        if self.cache.with(|s| s.evicted.len() == synced) {
            return;
        }
        // Each block counts as synced, and its key leaves the map, before the hook hears of
        // it: a hook that panics leaves the cache consistent, and the evictions after its own
        // to the next call.
        let mut at = synced;
        while let Some(block) = self.cache.with(|s| s.evicted.get(at).copied()) {
            at += 1;
            let Some(key) = self.keys[block as usize].take() else {
                continue;
            };
            self.entries.remove(&key);
            if let Some(hook) = &mut self.hook.0 {
                self.synced = at;
                hook(CacheEvent::Removed { key: &key, block });
            }
        }
        // The log keeps its capacity: evicting never allocates.
        self.cache.with(|s| s.evicted.clear());
        self.synced = 0;
    }
}

impl<B: Backend, K, S> Drop for PrefixCache<'_, '_, '_, '_, B, K, S> {
    /// Its blocks are cached no more: writable again by a sole holder, and an idle one is
    /// freed (behind a fence where work may still use it). The hook hears each one removed.
    fn drop(&mut self) {
        let cache = self.cache;
        let shift = cache.group_shift;
        let at_once = B::IMMEDIATE && !cache.is_asleep();
        cache.with(|s| {
            s.uncache_all(at_once, shift);
            s.evicted.clear();
            s.prefixed = false;
        });
        for (block, key) in self.keys.iter().enumerate() {
            if let (Some(key), Some(hook)) = (key, &mut self.hook.0) {
                hook(CacheEvent::Removed {
                    key,
                    block: block as u32,
                });
            }
        }
    }
}

impl<B: Backend, K, S> fmt::Debug for PrefixCache<'_, '_, '_, '_, B, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixCache")
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

/// Hashing for keys that are already keyed hashes (of a secret the clients do not know, as
/// vLLM's block hashes with a random seed): the key's bytes are folded into 64 bits, not hashed
/// again. A [`PrefixCache`]'s keys are hashed with randomly keyed SipHash unless it is made
/// with this — keep SipHash wherever a client who chooses the prompts could choose the keys,
/// or it could aim every key at one bucket.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrehashedKeys;

impl BuildHasher for PrehashedKeys {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

/// [`PrehashedKeys`]'s hasher: each 8 bytes written are folded in by a rotate and an xor.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            self.write_u64(u64::from_le_bytes(word.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(29) ^ n;
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}
