//! [`BlockTable`]: a sequence's block ids, in the forms kernels take.

use super::{KvCache, KvError};
use crate::backend::Backend;
use crate::unwind::Scope;
use std::cell::Cell;
use std::fmt;
use std::ops::Range;

/// A sequence's blocks, in order: the ids [`KvCache::push`] handed out, held by the table
/// until [`KvCache::clear`] (or its drop) lets them go. A block may have other holders — a
/// fork ([`KvCache::fork`]), a share ([`KvCache::share`]), a prefix cache's hit — and is then
/// read-only through every one of them until [`KvCache::copy_on_write`]. It borrows its cache once for all its
/// blocks — a block costs 4 bytes — and carries the cache's brand, so only that cache fills or
/// clears it.
///
/// What kernels take: [`ids`](Self::ids) (`&[u32]`), [`ids_i32`](Self::ids_i32) (`&[i32]`,
/// vLLM's block tables; ids stay below 2^31), and the slot of a token
/// ([`slot`](Self::slot), [`slots`](Self::slots): `block × block_tokens + offset`, `i64`, vLLM's
/// slot mapping).
///
/// It is `Send` only at `'static` brands — its cache is used from one thread at a time
/// ([`OneThread`](super::OneThread)) — and only an [`Engine`](crate::Engine) makes those: what
/// an engine keeps carries them, so an engine moves to another thread with its KV cache and
/// the tables it keeps. Inside [`Engine::with`](crate::Engine::with) a table is branded
/// afresh and does not move on its own (`ui-tests/engine_table_to_thread.rs`). Unsafe code
/// that makes a guard itself (`Guard::new`) must not make it `'static`.
///
/// ```compile_fail,E0521
/// use memtoken::{Budget, Engine, Keeps};
/// use memtoken::backend::HostBackend;
/// use memtoken::kv::{BlockTable, Layout};
/// struct Tables;
/// impl Keeps<HostBackend> for Tables {
///     type Of<'e> = Vec<BlockTable<'e, 'e, 'e, 'e, HostBackend>>;
/// }
/// let mut engine = Engine::<HostBackend, Tables>::new(
///     HostBackend::with_defaults().unwrap(), Budget::unlimited(),
///     &Layout::new(64, 16).plane(4096), |parts| Ok(vec![parts.cache.table()]),
/// ).unwrap();
/// engine.with(|_, tables| {
///     let table = tables.pop().unwrap();
///     std::thread::scope(|s| {
///         s.spawn(move || drop(table)); // error: the table would leave its cache's thread
///     });
/// });
/// ```
///
/// Its ids change only through its cache: code outside the crate cannot write one (the cache's
/// counts per block rely on every id in a table being one it handed out;
/// `ui-tests/block_table_ids_from_outside.rs`):
///
/// ```compile_fail,E0624
/// # use memtoken::backend::HostBackend;
/// # use memtoken::kv::{KvCache, Layout};
/// # use memtoken::{make_guard, Budget, Device};
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// # make_guard!(g);
/// let cache = KvCache::new(g, &binding, &Layout::new(64, 16).plane(4096)).unwrap();
/// let mut table = cache.table();
/// table.ids_mut().push(1 << 30); // error: `ids_mut` is private
/// ```
pub struct BlockTable<'t, 'c, 'b, 'id, B: Backend> {
    cache: &'t KvCache<'c, 'b, 'id, B>,
    ids: Vec<u32>,
    /// Whether one of its blocks may have another holder or a prefix cache: set by every
    /// operation that can give one of its blocks a second holder or a cache entry (a fork or
    /// share from or into it, an entry from it, a hit into it), cleared when it is emptied.
    /// Unset, every block it holds is its alone and uncached (only those operations make a
    /// block's word other than 0, and each marks every table that holds the block), so its
    /// clear frees them without looking at their words.
    shared: Cell<bool>,
}

impl<'t, 'c, 'b, 'id, B: Backend> BlockTable<'t, 'c, 'b, 'id, B> {
    pub(super) fn new(cache: &'t KvCache<'c, 'b, 'id, B>) -> Self {
        Self {
            cache,
            ids: Vec::new(),
            shared: Cell::new(false),
        }
    }

    /// Marks the table as one whose blocks may be shared or cached.
    #[inline(always)]
    pub(super) fn mark_shared(&self) {
        self.shared.set(true);
    }

    /// Whether the table's blocks may be shared or cached, the mark cleared (it is being
    /// emptied).
    #[inline(always)]
    pub(super) fn take_shared(&mut self) -> bool {
        self.shared.replace(false)
    }

    /// The cache it draws from.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn cache(&self) -> &'t KvCache<'c, 'b, 'id, B> {
        self.cache
    }

    #[inline(always)]
    pub(super) fn ids_mut(&mut self) -> &mut Vec<u32> {
        &mut self.ids
    }

    /// The block ids, in order.
    #[inline]
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The block ids as `i32`, what attention kernels take: the same memory (ids are below
    /// 2^31, so each reads the same number).
    #[inline]
    pub fn ids_i32(&self) -> &[i32] {
        bytemuck::cast_slice(&self.ids)
    }

    /// Blocks held.
    #[inline]
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the table holds no block.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The slot of the sequence's token `token`: `ids[token / block_tokens] × block_tokens +
    /// token % block_tokens`.
    ///
    /// # Panics
    ///
    /// If the table holds no block for that token.
    #[inline]
    pub fn slot(&self, token: usize) -> i64 {
        let t = self.cache.block_tokens();
        let block = self.ids[token / t];
        (block as usize * t + token % t) as i64
    }

    /// Appends the slots of tokens `tokens` to `out` (vLLM's `slot_mapping` for them).
    ///
    /// # Panics
    ///
    /// If the table holds no block for one of them.
    pub fn slots(&self, tokens: Range<usize>, out: &mut Vec<i64>) {
        out.extend(tokens.map(|token| self.slot(token)));
    }

    /// Copies `src` from the host into block `position`'s bytes in plane `plane`, at `offset`
    /// into the block — on any backend (the host: a copy; CUDA: a driver copy, ordered as any
    /// use of the memory).
    ///
    /// # Errors
    ///
    /// [`KvError::ReadOnly`] if another table or a prefix cache holds the block
    /// ([`KvCache::copy_on_write`] first); [`KvError::Copy`] with the backend's error;
    /// [`KvError::Asleep`] while the cache sleeps.
    ///
    /// # Panics
    ///
    /// If there is no such plane or position, or the bytes go past the block.
    pub fn write(
        &mut self,
        plane: usize,
        position: usize,
        offset: usize,
        src: &[u8],
    ) -> Result<(), KvError> {
        let at = self.at(plane, position, offset, src.len())?;
        if !self.cache.is_writable(self, position) {
            return Err(KvError::ReadOnly { position });
        }
        Scope::run::<B, _>(move || {
            self.cache
                .backend()
                .copy_from_host(at, src)
                .map_err(|e| KvError::Copy(Box::new(e)))
        })
    }

    /// Copies block `position`'s bytes in plane `plane`, from `offset` into the block, to
    /// `dst` on the host.
    ///
    /// # Errors
    ///
    /// As for [`write`](Self::write).
    ///
    /// # Panics
    ///
    /// As for [`write`](Self::write).
    pub fn read(
        &self,
        plane: usize,
        position: usize,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), KvError> {
        let at = self.at(plane, position, offset, dst.len())?;
        Scope::run::<B, _>(move || {
            self.cache
                .backend()
                .copy_to_host(dst, at)
                .map_err(|e| KvError::Copy(Box::new(e)))
        })
    }

    /// The address of `len` bytes at `offset` into block `position` of plane `plane` (none
    /// while the cache sleeps).
    fn at(
        &self,
        plane: usize,
        position: usize,
        offset: usize,
        len: usize,
    ) -> Result<usize, KvError> {
        if self.cache.is_asleep() {
            return Err(KvError::Asleep);
        }
        let block_bytes = self.cache.layout().planes()[plane].block_bytes;
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= block_bytes),
            "{len} bytes at {offset} go past a block of {block_bytes} bytes"
        );
        Ok(self.cache.block_addr(plane, self.ids[position]) + offset)
    }
}

// SAFETY: a table borrows its cache, which is not `Sync` (its free lists are not locked), so a
// table may only move to another thread together with its cache and everything else that
// borrows the cache. That is what an `Engine` does, and the `'static` brands say a table is an
// engine's: the cache's brand `'c` and the device's `'id` are `'static` only where
// `Engine::with_bindings` makes them (`make_guard!`'s brands borrow a local, and
// `Guard::new` is unsafe), and the engine lends its parts and what it keeps only at a fresh
// brand `'e` (`Engine::with`'s closure is generic over it), where this impl does not apply:
// no closure can send a table to a thread of its own (`ui-tests/engine_table_to_thread.rs`).
// A `'static`-branded table is thus only ever part of what an engine keeps (`K::Of<'static>`),
// and it moves with that engine — its cache with it, and whatever else borrows the cache, which
// is the engine's too (what `with` returns cannot borrow the parts: `'e` is not nameable
// outside the call). The engine itself is not `Sync`, so no two threads use the cache at once.
// Two limits, neither opened by this impl: unsafe code that makes a `'static` guard of its own
// for a cache (the docs of `Device::new`, `KvCache::new` and `BlockTable` forbid it); and the
// compiler's known unsoundness around implied bounds (rust-lang/rust#25860 and kin), through
// which a function item can assume `'e: 'static` inside `with` — the same hole returns the
// engine's parts from `with` outright (a use after free), with or without this impl.
unsafe impl<B: Backend> Send for BlockTable<'static, 'static, 'static, 'static, B> where
    KvCache<'static, 'static, 'static, B>: Send
{
}

impl<B: Backend> Drop for BlockTable<'_, '_, '_, '_, B> {
    fn drop(&mut self) {
        let shared = self.shared.get();
        self.cache.give_back(&self.ids, shared);
    }
}

impl<B: Backend> fmt::Display for BlockTable<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a block table of {} blocks", self.ids.len())
    }
}

impl<B: Backend> fmt::Debug for BlockTable<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockTable")
            .field("ids", &self.ids)
            .finish()
    }
}
