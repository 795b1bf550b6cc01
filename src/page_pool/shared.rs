//! Pages shared by reference: [`SharedTable`] (a sequence's pages, any of which another holder
//! may have), [`SharedPage`] (one more holder of one page, read-only by type), forks and
//! copy-on-write. The counts live in the pool's own per-page words (a `u32` of extra holders,
//! and [`Meta`]), never in a per-share allocation.
#![allow(unsafe_code)] // host slices of shared pages, and unchecked counts, each with its `// SAFETY:` proof

use super::{PagePool, PageTable};
use crate::backend::{Addr, Backend, HostVisible};
use crate::error::PoolError;
use crate::token::{host_slice, host_slice_mut};
use crate::unwind::Scope;
use std::fmt;

/// A page's flags: a prefix cache holds it (read-only until evicted).
pub(super) const CACHED: u32 = 1;
/// A page's flags: cached and held by no one — in the eviction order ([`Lru`]).
pub(super) const IDLE: u32 = 2;
/// No page (the ends of the eviction order).
const NIL: u32 = u32::MAX;

/// What the pool keeps per page beside its count of extra holders (`PoolState::extra`, a
/// `u32` a page, 0 for a page free or held once): its flags ([`CACHED`], [`IDLE`]), the epoch
/// its cache entries name (bumped when it is evicted), and its links in the eviction order
/// while idle. 24 bytes a page; 28 with the count.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Meta {
    pub(super) flags: u32,
    prev: u32,
    next: u32,
    /// 64 bits: never wraps back to an epoch a stale entry names.
    pub(super) epoch: u64,
}

/// Cached pages no one holds, least recently let go first: a doubly linked list through the
/// pages' [`Meta`], so taking one out (a cache hit) is O(1).
#[derive(Debug)]
pub(super) struct Lru {
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    pub(super) fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Idle pages.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Puts page `i` last: evicted after every page let go before it.
    pub(super) fn push_back(&mut self, meta: &mut [Meta], i: u32) {
        meta[i as usize].prev = self.tail;
        meta[i as usize].next = NIL;
        match self.tail {
            NIL => self.head = i,
            tail => meta[tail as usize].next = i,
        }
        self.tail = i;
        self.len += 1;
    }

    /// Takes page `i`, idle, out of the order.
    pub(super) fn remove(&mut self, meta: &mut [Meta], i: u32) {
        let Meta { prev, next, .. } = meta[i as usize];
        match prev {
            NIL => self.head = next,
            prev => meta[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => meta[next as usize].prev = prev,
        }
        self.len -= 1;
    }

    /// Takes the page let go least recently.
    pub(super) fn pop_front(&mut self, meta: &mut [Meta]) -> Option<u32> {
        let head = self.head;
        (head != NIL).then(|| {
            self.remove(meta, head);
            head
        })
    }
}

/// One more holder of one page of a [`PagePool`], read-only by type: its bytes are read
/// (`as_slice` on the host) but never written through it, since another holder — a table, a
/// prefix cache's next hit — may read them. Made by [`PagePool::share`] or a
/// [`PrefixCache`](crate::PrefixCache) hit; [`Clone`] counts one more holder, and dropping it
/// lets the page go (freed with its last holder; a cached page then stays findable until the
/// pool evicts it).
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// # make_guard!(pool_guard);
/// # let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let mut table = pool.shared_table();
/// pool.push(&mut table).unwrap();
/// let mut page = pool.share(&table, 0);
/// page.as_mut_slice()[0] = 1; // error: a shared page lends no `&mut`
/// ```
///
/// It borrows its pool:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let mut table = pool.shared_table();
/// pool.push(&mut table).unwrap();
/// let page = pool.share(&table, 0);
/// drop(table);
/// drop(pool); // error: `pool` is borrowed by the page
/// drop(page);
/// ```
pub struct SharedPage<'p, 'pool, 'b, 'id, B: Backend> {
    pub(super) pool: &'p PagePool<'pool, 'b, 'id, B>,
    pub(super) index: u32,
}

/// A sequence's pages, in order, any of which may be shared — with a fork
/// ([`PagePool::fork`]), a [`SharedPage`], or a prefix cache. A page another holder has, or a
/// cache holds, is read-only: [`page_mut`](Self::page_mut) answers `None` for it, and
/// [`PagePool::copy_on_write`] gives the table a private copy first. Pages are pushed with
/// [`PagePool::push`] (a new page, held by this table alone) or [`PagePool::push_shared`] (a
/// [`SharedPage`], a cache hit); cleared with [`PagePool::clear`] or when dropped, each page
/// let go in reverse order, so a cached sequence's later pages are evicted before its earlier
/// ones. A [`PageTable`] becomes one with [`PageTable::into_shared`].
///
/// ```
/// use memtoken::{make_guard, Budget, Device, PagePool};
/// use memtoken::backend::HostBackend;
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 4096)?;
/// let mut prompt = pool.shared_table();
/// pool.push(&mut prompt)?;
/// prompt.page_mut(0).expect("held by this table alone")[0] = 7;
/// let mut sample = pool.fork(&prompt); // no byte copied
/// assert!(sample.page_mut(0).is_none(), "shared with the prompt");
/// pool.copy_on_write(&mut sample, 0)?; // one page copied
/// sample.page_mut(0).expect("private now")[0] = 8;
/// assert_eq!((prompt.page(0)[0], sample.page(0)[0]), (7, 8));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A fork borrows its pool, and a page's slice cannot be kept across the copy-on-write that
/// replaces the page (compile-fail cases in `ui-tests/`: `forked_table_outlives_pool`,
/// `page_slice_across_copy_on_write`, `page_slice_across_fork`):
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let table = pool.shared_table();
/// let fork = pool.fork(&table);
/// drop(table);
/// drop(pool); // error: `pool` is borrowed by the fork
/// drop(fork);
/// ```
///
/// ```compile_fail,E0502
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// # make_guard!(pool_guard);
/// # let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let mut table = pool.shared_table();
/// pool.push(&mut table).unwrap();
/// let fork = pool.fork(&table);
/// let old = table.page(0);
/// pool.copy_on_write(&mut table, 0).unwrap(); // error: `table` is borrowed by `old`
/// println!("{}", old[0]);
/// ```
///
/// Nor can a writable slice be kept across a fork, which shares the page:
///
/// ```compile_fail,E0502
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// # make_guard!(pool_guard);
/// # let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let mut table = pool.shared_table();
/// pool.push(&mut table).unwrap();
/// let bytes = table.page_mut(0).unwrap();
/// let fork = pool.fork(&table); // error: `table` is borrowed mutably by `bytes`
/// bytes[0] = 1;
/// ```
pub struct SharedTable<'p, 'pool, 'b, 'id, B: Backend> {
    pub(super) pool: &'p PagePool<'pool, 'b, 'id, B>,
    pub(super) pages: Vec<u32>,
}

/// A page table of a pool (sealed): [`PageTable`], whose pages it holds alone, or
/// [`SharedTable`]. [`PagePool::push`] and [`PagePool::clear`] take either. Its page indices
/// are the pool's to change (`ui-tests/table_indices_from_outside.rs`):
///
/// ```compile_fail,E0603
/// # use memtoken::{make_guard, Budget, Device, PagePool, Table};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// # make_guard!(pool_guard);
/// # let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
/// let mut table = pool.table();
/// let inside = memtoken::page_pool::shared::sealed::Inside(()); // error: private module
/// table.pages_mut(inside).push(u32::MAX);
/// ```
pub trait Table<'pool, 'b, 'id, B: Backend>: sealed::Sealed {
    /// Whether its pages may be shared: known at compile time, so a [`PageTable`]'s clear is
    /// the hand-written pool's code.
    #[doc(hidden)]
    const SHARED: bool;
    /// Its page indices — only for this crate: the argument cannot be made outside it, so no
    /// caller can put an index the table does not hold in it.
    #[doc(hidden)]
    fn pages_mut(&mut self, _: sealed::Inside) -> &mut Vec<u32>;
}

mod sealed {
    pub trait Sealed {}

    /// Made only inside the crate: a method taking it cannot be called from outside.
    #[derive(Clone, Copy, Debug)]
    pub struct Inside(pub(in crate::page_pool) ());
}

/// The argument of [`Table::pages_mut`].
pub(super) const INSIDE: sealed::Inside = sealed::Inside(());

impl<B: Backend> sealed::Sealed for PageTable<'_, '_, '_, '_, B> {}
impl<B: Backend> sealed::Sealed for SharedTable<'_, '_, '_, '_, B> {}

impl<'pool, 'b, 'id, B: Backend> Table<'pool, 'b, 'id, B> for PageTable<'_, 'pool, 'b, 'id, B> {
    const SHARED: bool = false;

    #[inline(always)]
    fn pages_mut(&mut self, _: sealed::Inside) -> &mut Vec<u32> {
        &mut self.pages
    }
}

impl<'pool, 'b, 'id, B: Backend> Table<'pool, 'b, 'id, B> for SharedTable<'_, 'pool, 'b, 'id, B> {
    const SHARED: bool = true;

    #[inline(always)]
    fn pages_mut(&mut self, _: sealed::Inside) -> &mut Vec<u32> {
        &mut self.pages
    }
}

impl<'pool, 'b, 'id, B: Backend> PagePool<'pool, 'b, 'id, B> {
    /// An empty table whose pages may be shared, drawing from this pool.
    pub fn shared_table(&self) -> SharedTable<'_, 'pool, 'b, 'id, B> {
        SharedTable {
            pool: self,
            pages: Vec::new(),
        }
    }

    /// One more holder of the page at `position` of `table`, read-only by type.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds, or the page already has 2^32 holders.
    pub fn share(
        &self,
        table: &SharedTable<'_, 'pool, 'b, 'id, B>,
        position: usize,
    ) -> SharedPage<'_, 'pool, 'b, 'id, B> {
        let index = table.pages[position];
        self.hold(index);
        SharedPage { pool: self, index }
    }

    /// Appends `page` to `table`, which becomes one of its holders (the page's hold moves into
    /// the table); returns its position.
    pub fn push_shared(
        &self,
        table: &mut SharedTable<'_, 'pool, 'b, 'id, B>,
        page: SharedPage<'_, 'pool, 'b, 'id, B>,
    ) -> usize {
        let index = page.index;
        std::mem::forget(page);
        table.pages.push(index);
        table.pages.len() - 1
    }

    /// A table holding the same pages as `table`, in O(pages): each page counts one more
    /// holder, and no byte is copied. Writing a page afterwards copies that one page
    /// ([`copy_on_write`](Self::copy_on_write)).
    ///
    /// # Panics
    ///
    /// If a page already has 2^32 holders (the counts are as they were).
    pub fn fork(
        &self,
        table: &SharedTable<'_, 'pool, 'b, 'id, B>,
    ) -> SharedTable<'_, 'pool, 'b, 'id, B> {
        self.hold_all(&table.pages);
        SharedTable {
            pool: self,
            pages: table.pages.clone(),
        }
    }

    /// Makes the page at `position` of `table` writable through it: if another holder has
    /// it or a cache holds it, copies it into a new page (a device-to-device copy on CUDA,
    /// ordered like any use of the memory) that replaces it in the table, and lets the old
    /// one go; whether it copied.
    ///
    /// # Errors
    ///
    /// [`PoolError`] if no page can be had or the copy fails: the table is unchanged (the
    /// new page, if any, goes back to the pool).
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn copy_on_write(
        &self,
        table: &mut SharedTable<'_, 'pool, 'b, 'id, B>,
        position: usize,
    ) -> Result<bool, PoolError> {
        let old = table.pages[position];
        if self.writable(old) {
            return Ok(false);
        }
        Scope::run::<B, _>(move || {
            let new = self.alloc()?;
            let size = self.page_size();
            if let Err(e) = self
                .backend()
                .copy_within(new.addr(), self.page_addr(old), size)
            {
                return Err(PoolError::Copy(Box::new(e))); // `new` goes back as it drops
            }
            table.pages[position] = new.index;
            std::mem::forget(new);
            self.let_go(old);
            Ok(true)
        })
    }

    /// How many holders the page `index` has (tables, shared pages), for a page that some
    /// holder has: exact. An idle cached page answers 0. A page free or cooling answers 1 (its
    /// count does not say whether it is held), so ask only of pages you know to be held.
    ///
    /// # Panics
    ///
    /// If `index` is not a page of this pool's committed chunks.
    pub fn holders(&self, index: u32) -> u64 {
        self.with(|s| match s.meta[index as usize].flags & IDLE {
            0 => u64::from(s.extra[index as usize]) + 1,
            _ => 0,
        })
    }

    /// Whether a prefix cache holds the page `index` (read-only until it is evicted).
    pub fn is_cached(&self, index: u32) -> bool {
        self.with(|s| s.meta[index as usize].flags & CACHED != 0)
    }

    /// Cached pages no one holds: findable by their cache until the pool needs them.
    pub fn idle_pages(&self) -> usize {
        self.with(|s| s.idle.len())
    }

    /// Evicts every idle cached page (their cache entries go stale), so that
    /// [`shrink`](Self::shrink) can give their chunks back; returns how many.
    pub fn evict_idle(&self) -> usize {
        let mut n = 0;
        while self.evict_one() {
            n += 1;
        }
        n
    }

    /// Evicts the idle page let go least recently, if any: it goes back as a freed page
    /// (behind a fence where work may still use it), its cache entries stale.
    pub(super) fn evict_one(&self) -> bool {
        let Some(index) = self.with(|s| {
            let index = s.idle.pop_front(&mut s.meta)?;
            let meta = &mut s.meta[index as usize];
            meta.flags = 0;
            meta.epoch += 1;
            Some(index)
        }) else {
            return false;
        };
        self.give_back(&[index]);
        true
    }

    /// Whether page `index` has one holder and no cache holds it: writable by that holder.
    #[inline]
    pub(super) fn writable(&self, index: u32) -> bool {
        self.with(|s| s.extra[index as usize] == 0 && s.meta[index as usize].flags == 0)
    }

    /// One more holder of page `index`, which someone holds (a table, a shared page).
    ///
    /// # Panics
    ///
    /// If the page already has 2^32 holders.
    #[inline]
    pub(super) fn hold(&self, index: u32) {
        self.with(|s| {
            let extra = extra_of(&mut s.extra, index);
            *extra = extra.checked_add(1).expect("a page has 2^32 holders");
        });
    }

    /// One more holder of page `index`, cached: held, or idle (then taken out of the
    /// eviction order).
    pub(super) fn hold_cached(&self, index: u32) {
        let idle = self.with(|s| {
            let meta = &mut s.meta[index as usize];
            let idle = meta.flags & IDLE != 0;
            if idle {
                meta.flags &= !IDLE;
                s.idle.remove(&mut s.meta, index);
            }
            idle
        });
        if !idle {
            self.hold(index);
        }
    }

    /// One more holder of each of `pages` (a table's, so held).
    #[inline]
    fn hold_all(&self, pages: &[u32]) {
        let full = self.with(|s| {
            for (i, &index) in pages.iter().enumerate() {
                let extra = extra_of(&mut s.extra, index);
                match extra.checked_add(1) {
                    Some(more) => *extra = more,
                    None => return Some(i),
                }
            }
            None
        });
        if let Some(i) = full {
            // Undone before the panic: no count is left raised with no holder.
            self.with(|s| {
                for &index in &pages[..i] {
                    *extra_of(&mut s.extra, index) -= 1;
                }
            });
            panic!("a page has 2^32 holders");
        }
    }

    /// One holder of page `index` lets it go: the last one frees it, or, for a cached page,
    /// puts it last in the eviction order.
    #[inline]
    pub(super) fn let_go(&self, index: u32) {
        let free = self.with(|s| {
            let extra = extra_of(&mut s.extra, index);
            if *extra != 0 {
                *extra -= 1;
                return false;
            }
            let meta = &mut s.meta[index as usize];
            if meta.flags & CACHED == 0 {
                return true;
            }
            meta.flags |= IDLE;
            s.idle.push_back(&mut s.meta, index);
            false
        });
        if free {
            self.give_back(&[index]);
        }
    }

    /// Every page of a shared table lets go, the last first (so a cached sequence's later
    /// pages are evicted before its earlier ones).
    pub(super) fn let_go_all(&self, pages: &[u32]) {
        let mut rest = pages.len();
        while rest > 0 {
            // Pages other holders keep, under one borrow of the state, until one is its
            // last holder's (freed, or idle).
            rest = self.with(|s| {
                let mut rest = rest;
                while rest > 0 {
                    let extra = extra_of(&mut s.extra, pages[rest - 1]);
                    if *extra == 0 {
                        break;
                    }
                    *extra -= 1;
                    rest -= 1;
                }
                rest
            });
            if rest > 0 {
                self.let_go(pages[rest - 1]);
                rest -= 1;
            }
        }
    }
}

/// Page `index`'s count of extra holders, with no bounds check: the hot loops of forks,
/// shares and releases do one load and one store a page, as the hand-written pool's do less
/// its bounds check.
#[inline(always)]
fn extra_of(extra: &mut [u32], index: u32) -> &mut u32 {
    debug_assert!(
        (index as usize) < extra.len(),
        "page {index} is not the pool's"
    );
    // SAFETY: `index` is a page some holder of this pool holds (a table's entry, a shared
    // page, a cache hit being taken): every such index was handed out from the free list,
    // whose indices are all below the pages of the chunks committed so far, and `extra` is
    // resized to exactly that count at each commit (`grow`) and never shrinks (a released
    // chunk's slot keeps its counts, and its pages come back with the same indices).
    unsafe { extra.get_unchecked_mut(index as usize) }
}

impl<'p, 'pool, 'b, 'id, B: Backend> PageTable<'p, 'pool, 'b, 'id, B> {
    /// The same pages as a table whose pages may be shared (forked, shared, cached).
    pub fn into_shared(mut self) -> SharedTable<'p, 'pool, 'b, 'id, B> {
        let pages = std::mem::take(&mut self.pages);
        SharedTable {
            pool: self.pool,
            pages,
        }
    }
}

impl<'p, 'pool, 'b, 'id, B: Backend> SharedTable<'p, 'pool, 'b, 'id, B> {
    /// Pages in the table.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether the table has no page.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The pool's page size in bytes.
    pub fn page_size(&self) -> usize {
        self.pool.page_size()
    }

    /// The pool's index of the page at `position` (see [`PagePool::holders`]).
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn index(&self, position: usize) -> u32 {
        self.pages[position]
    }

    /// Whether the page at `position` is this table's alone and not cached: writable.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn is_writable(&self, position: usize) -> bool {
        self.pool.writable(self.pages[position])
    }

    /// Address of the page at `position`.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    ///
    /// On CUDA, the address used in work captured by a capture memtoken did not make is the
    /// `unsafe` kernel launch's obligation: the page must outlive every launch of that graph.
    pub fn addr(&self, position: usize) -> Addr {
        self.pool.page_addr(self.pages[position])
    }

    /// The backend, for interop.
    pub(crate) fn backend(&self) -> &crate::unwind::Guarded<B> {
        self.pool.backend()
    }

    /// Copies bytes of the page at `position`, from `offset`, to the host (any backend).
    ///
    /// # Errors
    ///
    /// [`PoolError::Copy`] with the backend's error.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds or the range does not fit in the page.
    pub fn copy_page_to_host(
        &self,
        position: usize,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), PoolError> {
        let at = self.at(position, offset, dst.len());
        Scope::run::<B, _>(move || self.pool.backend().copy_to_host(dst, at))
            .map_err(|e| PoolError::Copy(Box::new(e)))
    }

    /// Copies `src` from the host into the page at `position`, at `offset` (any backend) —
    /// only into a page this table alone holds, uncached.
    ///
    /// # Errors
    ///
    /// [`PoolError::Shared`] if the page is shared or cached (nothing written: see
    /// [`PagePool::copy_on_write`]); [`PoolError::Copy`] with the backend's error.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds or the range does not fit in the page.
    pub fn copy_page_from_host(
        &mut self,
        position: usize,
        offset: usize,
        src: &[u8],
    ) -> Result<(), PoolError> {
        if !self.is_writable(position) {
            return Err(PoolError::Shared(position));
        }
        let at = self.at(position, offset, src.len());
        Scope::run::<B, _>(move || self.pool.backend().copy_from_host(at, src))
            .map_err(|e| PoolError::Copy(Box::new(e)))
    }

    /// The address of `len` bytes at `offset` into the page at `position`.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds or the range does not fit in the page.
    fn at(&self, position: usize, offset: usize, len: usize) -> Addr {
        let size = self.page_size();
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= size),
            "{len} bytes at offset {offset} do not fit in a {size}-byte page"
        );
        self.addr(position) + offset
    }
}

impl<B: HostVisible> SharedTable<'_, '_, '_, '_, B> {
    /// The bytes of the page at `position`.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn page(&self, position: usize) -> &[u8] {
        // SAFETY: the table holds this page, so its chunk stays committed while it does; a
        // page's bytes are written only through the one holder that has it alone, uncached
        // (`page_mut` and `copy_page_from_host` check it, and need `&mut` of that holder), so
        // no write happens while `&self` is borrowed: if this table is that holder, the
        // borrow excludes its writes; if not, it cannot write.
        unsafe { host_slice(self.addr(position), self.pool.page_size()) }
    }

    /// The bytes of the page at `position`, writable — `None` if another holder has the page
    /// or a cache holds it (read-only: [`PagePool::copy_on_write`] first).
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn page_mut(&mut self, position: usize) -> Option<&mut [u8]> {
        if !self.is_writable(position) {
            return None;
        }
        // SAFETY: as in `page`; this table is the page's only holder and no cache holds it,
        // so no other slice of it exists (a `SharedPage`, a fork or a cache hit would count
        // as a holder), and `&mut self` makes this the only borrow of the table's pages.
        Some(unsafe { host_slice_mut(self.addr(position), self.pool.page_size()) })
    }
}

impl<'p, 'pool, 'b, 'id, B: Backend> SharedPage<'p, 'pool, 'b, 'id, B> {
    /// The page's index in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The page's address.
    ///
    /// On CUDA, the address used in work captured by a capture memtoken did not make is the
    /// `unsafe` kernel launch's obligation: the token (or page) must outlive every launch of
    /// that graph (memtoken's `Capture` borrows it instead).
    pub fn addr(&self) -> Addr {
        self.pool.page_addr(self.index)
    }

    /// Copies bytes of the page, from `offset`, to the host (any backend).
    ///
    /// # Errors
    ///
    /// [`PoolError::Copy`] with the backend's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the page.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), PoolError> {
        let size = self.pool.page_size();
        assert!(
            offset.checked_add(dst.len()).is_some_and(|end| end <= size),
            "{} bytes at offset {offset} do not fit in a {size}-byte page",
            dst.len()
        );
        let at = self.addr() + offset;
        Scope::run::<B, _>(move || self.pool.backend().copy_to_host(dst, at))
            .map_err(|e| PoolError::Copy(Box::new(e)))
    }
}

impl<B: HostVisible> SharedPage<'_, '_, '_, '_, B> {
    /// The page's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: this holder keeps the page (and its chunk) alive; while it holds the page,
        // the page has at least two holders or only this one, and a write needs a holder
        // that has it alone through a table (`page_mut`, `copy_page_from_host` check it), so
        // no one writes the bytes while this borrow lives.
        unsafe { host_slice(self.addr(), self.pool.page_size()) }
    }
}

impl<B: Backend> Clone for SharedPage<'_, '_, '_, '_, B> {
    /// One more holder of the same page.
    fn clone(&self) -> Self {
        self.pool.hold(self.index);
        Self {
            pool: self.pool,
            index: self.index,
        }
    }
}

impl<B: Backend> Drop for SharedPage<'_, '_, '_, '_, B> {
    fn drop(&mut self) {
        self.pool.let_go(self.index);
    }
}

impl<B: Backend> Drop for SharedTable<'_, '_, '_, '_, B> {
    fn drop(&mut self) {
        self.pool.clear(self);
    }
}

impl<B: Backend> fmt::Debug for SharedPage<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPage")
            .field("index", &self.index)
            .finish()
    }
}

impl<B: Backend> fmt::Debug for SharedTable<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedTable")
            .field("pages", &self.pages)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eviction_order_takes_pages_out_in_order_and_from_the_middle() {
        let mut meta = vec![Meta::default(); 8];
        let mut lru = Lru::new();
        for i in [3, 1, 4, 5] {
            lru.push_back(&mut meta, i);
        }
        lru.remove(&mut meta, 4); // from the middle
        assert_eq!(lru.pop_front(&mut meta), Some(3));
        lru.remove(&mut meta, 5); // the tail
        lru.push_back(&mut meta, 6);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.pop_front(&mut meta), Some(1));
        assert_eq!(lru.pop_front(&mut meta), Some(6));
        assert_eq!(lru.pop_front(&mut meta), None);
        assert_eq!(lru.len(), 0);
    }
}
