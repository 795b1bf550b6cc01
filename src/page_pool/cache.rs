//! [`PrefixCache`]: full pages findable by a key for the whole prefix up to and including
//! them, kept until the pool needs them.

use super::PagePool;
use super::shared::{CACHED, IDLE, SharedPage, SharedTable};
use crate::backend::Backend;
use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;

/// A prefix cache over a [`PagePool`]: full pages entered under a key of the caller's, found
/// again by it as a [`SharedPage`] (one more holder, no byte copied).
///
/// **The key** stands for everything the page's contents depend on: the whole prefix up to
/// and including the page — so a page's key is built from its parent page's key and its own
/// tokens — and anything else the KV depends on (an adapter, multimodal inputs, a cache
/// salt). Hashing only the page's own tokens would match the same tokens after a different
/// prefix, whose KV differs. Any `Hash + Eq` type serves; the example chains the parent's key
/// into each page's key, as vLLM does:
///
/// ```
/// use memtoken::{make_guard, Budget, Device, PagePool, PrefixCache};
/// use memtoken::backend::HostBackend;
/// use std::collections::hash_map::DefaultHasher;
/// use std::hash::{Hash, Hasher};
///
/// /// A page's key: its parent's key, its tokens, and what else the KV depends on.
/// #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
/// struct Key { parent: u64, tokens: u64, adapter: u32 }
///
/// fn keys(tokens: &[u32], per_page: usize, adapter: u32) -> Vec<Key> {
///     let mut parent = 0;
///     tokens.chunks_exact(per_page) // only full pages are entered
///         .map(|page| {
///             let mut h = DefaultHasher::new();
///             page.hash(&mut h);
///             let key = Key { parent, tokens: h.finish(), adapter };
///             let mut chained = DefaultHasher::new();
///             key.hash(&mut chained);
///             parent = chained.finish();
///             key
///         })
///         .collect()
/// }
///
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 4096)?;
/// let mut cache = PrefixCache::new(&pool);
///
/// let prompt: Vec<u32> = (0..40).collect(); // 2 full pages of 16 tokens, and 8 more
/// let mut first = pool.shared_table();
/// for (position, key) in keys(&prompt, 16, 0).into_iter().enumerate() {
///     pool.push(&mut first)?;
///     first.page_mut(position).unwrap()[0] = position as u8; // the page's KV
///     cache.enter(&first, position, key);
/// }
/// drop(first); // its pages stay findable until the pool needs them
///
/// let mut second = pool.shared_table();
/// for key in keys(&prompt, 16, 0) {
///     match cache.lookup(&key) {
///         Some(page) => { pool.push_shared(&mut second, page); }
///         None => { pool.push(&mut second)?; }
///     }
/// }
/// assert_eq!((second.page(0)[0], second.page(1)[0]), (0, 1)); // both pages hit
/// assert!(cache.lookup(&keys(&prompt, 16, 1)[0]).is_none()); // another adapter: a miss
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// **What it keeps.** A page entered stays read-only until the pool evicts it — even while a
/// single table holds it, a write to it copies ([`PagePool::copy_on_write`]). When its last
/// holder lets it go it is not freed but idle: findable, and evicted only when the pool needs
/// a page and has no free one — the page let go least recently first, and of one sequence
/// its later pages before its earlier ones. A hit on an idle page takes it out of the
/// eviction order; a held page is never evicted. An evicted page's entries go stale and are
/// dropped at their next lookup (or in bulk as entries pile up).
///
/// It borrows its pool; the pages it hands out borrow the pool too. Dropped, it lets its pages
/// go: each is cached no more (writable again by a sole holder), and an idle one goes back to
/// the pool.
pub struct PrefixCache<'p, 'pool, 'b, 'id, B: Backend, K> {
    pool: &'p PagePool<'pool, 'b, 'id, B>,
    /// Each key's page, and the page's epoch when it was entered (stale once it differs).
    entries: HashMap<K, (u32, u64)>,
}

impl<'p, 'pool, 'b, 'id, B: Backend, K: Hash + Eq> PrefixCache<'p, 'pool, 'b, 'id, B, K> {
    /// An empty cache over `pool`.
    pub fn new(pool: &'p PagePool<'pool, 'b, 'id, B>) -> Self {
        Self {
            pool,
            entries: HashMap::new(),
        }
    }

    /// Enters the page at `position` of `table` under `key` (the caller's key for the whole
    /// prefix up to and including the page: enter only full pages). From now on the page is
    /// read-only until evicted. Whether it was entered: not if the key already names a live
    /// page (the first stays), or if the page is cached already.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn enter(
        &mut self,
        table: &SharedTable<'_, 'pool, 'b, 'id, B>,
        position: usize,
        key: K,
    ) -> bool {
        let index = table.pages[position];
        if self.pool.is_cached(index) || self.live(&key).is_some() {
            return false;
        }
        let epoch = self.pool.with(|s| {
            let meta = &mut s.meta[index as usize];
            meta.flags |= CACHED;
            meta.epoch
        });
        if self.entries.len() >= 2 * self.pool.capacity().max(64) {
            self.sweep();
        }
        self.entries.insert(key, (index, epoch));
        true
    }

    /// The page entered under `key`, as one more holder of it (an idle page leaves the
    /// eviction order), or `None` if there is none or it was evicted.
    pub fn lookup<Q>(&mut self, key: &Q) -> Option<SharedPage<'p, 'pool, 'b, 'id, B>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(index) = self.live(key) else {
            self.entries.remove(key); // stale, if there was one
            return None;
        };
        self.pool.hold_cached(index);
        Some(SharedPage {
            pool: self.pool,
            index,
        })
    }

    /// Whether `key` names a page that has not been evicted.
    pub fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.live(key).is_some()
    }

    /// Keys that name a page not evicted.
    pub fn len(&self) -> usize {
        self.entries
            .values()
            .filter(|&&(index, epoch)| self.is_live(index, epoch))
            .count()
    }

    /// Whether no key names a page not evicted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The page `key` names, if it has not been evicted since it was entered.
    fn live<Q>(&self, key: &Q) -> Option<u32>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let &(index, epoch) = self.entries.get(key)?;
        self.is_live(index, epoch).then_some(index)
    }

    /// Whether page `index`, entered at `epoch`, is still cached since.
    fn is_live(&self, index: u32, epoch: u64) -> bool {
        self.pool.with(|s| {
            let meta = &s.meta[index as usize];
            meta.epoch == epoch && meta.flags & CACHED != 0
        })
    }

    /// Drops the stale entries.
    fn sweep(&mut self) {
        let pool = self.pool;
        self.entries.retain(|_, &mut (index, epoch)| {
            pool.with(|s| {
                let meta = &s.meta[index as usize];
                meta.epoch == epoch && meta.flags & CACHED != 0
            })
        });
    }
}

impl<B: Backend, K> Drop for PrefixCache<'_, '_, '_, '_, B, K> {
    /// Its pages are cached no more: writable again by a sole holder, and an idle one goes
    /// back to the pool (behind a fence where work may still use it).
    fn drop(&mut self) {
        let pool = self.pool;
        for (_, (index, epoch)) in self.entries.drain() {
            let idle = pool.with(|s| {
                let meta = &mut s.meta[index as usize];
                if meta.epoch != epoch || meta.flags & CACHED == 0 {
                    return false; // evicted since: not this cache's any more
                }
                let idle = meta.flags & IDLE != 0;
                meta.flags = 0;
                meta.epoch += 1;
                if idle {
                    s.idle.remove(&mut s.meta, index);
                }
                idle
            });
            if idle {
                pool.give_back(&[index]);
            }
        }
    }
}

impl<B: Backend, K> fmt::Debug for PrefixCache<'_, '_, '_, '_, B, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixCache")
            .field("entries", &self.entries.len())
            .finish()
    }
}
