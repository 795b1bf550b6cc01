//! [`PagePool`]: fixed-size pages carved out of committed chunks — the KV cache's hot path.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, HostVisible};
use crate::device::Binding;
use crate::error::PoolError;
use crate::state::Committed;
use crate::token::{host_slice, host_slice_mut};
use crate::unwind::{Guarded, Scope};
use generativity::{Guard, Id};
use std::cell::UnsafeCell;
use std::fmt;

mod cache;
mod shared;

pub use cache::PrefixCache;
use shared::{Lru, Meta};
pub use shared::{SharedPage, SharedTable, Table};

struct PoolState<'b, 'id, B: Backend> {
    chunks: Vec<Option<Allocation<'b, 'id, B, Committed>>>,
    /// Indices of free pages; its capacity always covers every page of every chunk.
    free: Vec<u32>,
    /// Pages given back while work may still use them (a backend that is not
    /// [`IMMEDIATE`](Backend::IMMEDIATE)) since the last fence was recorded: no fence and no
    /// allocation per page given back; its capacity, like `free`'s, covers every page.
    unfenced: Vec<u32>,
    /// Batches of pages behind one fence each, recorded when the pool ran out of free pages
    /// (after every page of the batch was given back, so it covers their work): free once it
    /// has completed (`None`: recording it panicked, and one recorded at the next reclaim
    /// covers the same work). At most [`BATCHES`] at a time.
    cooling: Vec<(Option<B::Fence>, Vec<u32>)>,
    /// Pages whose memory the backend withholds (a graph may still use it: see
    /// [`Backend::withheld`]): never handed out again.
    withheld: Vec<u32>,
    /// Per page: its holders beyond the first (0 for a page free or held once, so the
    /// unshared hot path never reads it). Grown with the chunks.
    extra: Vec<u32>,
    /// Per page: whether a cache holds it, its cache epoch, its links in the eviction order
    /// (see `shared`). Grown with the chunks.
    meta: Vec<Meta>,
    /// Cached pages no one holds, least recently let go first.
    idle: Lru,
}

/// The most fenced batches a pool keeps cooling: a newer batch takes the newest one's pages
/// under its own fence (recorded later, it covers more work), so live fences stay bounded
/// however many pages are freed.
const BATCHES: usize = 2;

/// Fixed-size pages sub-allocated in O(1) from committed chunks — the KV cache's hot path.
///
/// Allocating and freeing a page is a pop from and a push onto a free list of page indices
/// whose capacity is reserved when a chunk is committed, so the hot path makes no system call
/// and no allocation. The pool commits a chunk (one granule, or one page if pages are larger)
/// when it runs out, and gives back chunks whose pages are all free when asked
/// ([`shrink`](PagePool::shrink)).
///
/// **One form of each operation, on the pool:** [`alloc`](Self::alloc) /
/// [`free`](Self::free) for one [`Page`] token, [`push`](Self::push) / [`clear`](Self::clear)
/// for a [`PageTable`]. The page table is the zero-cost form: it holds its pool once for all
/// its pages, and the pool at hand makes each push and clear the hand-written pool's code (see
/// the README's benchmark). A `Page` token carries its pool, so it can return itself on drop.
///
/// **On a GPU, a freed page waits.** Where work may still use memory asynchronously (a
/// backend that is not [`IMMEDIATE`](Backend::IMMEDIATE), such as CUDA), a page given back
/// waits, with no call and no allocation, until the pool runs out of free pages; then one
/// fence, over the streams that may use the pool's chunks, is recorded for every page given
/// back since, and they are handed out again once it has completed
/// ([`cooling_pages`](Self::cooling_pages) counts them meanwhile). At most two such fences live
/// at a time (a newer one takes over the newest batch: it covers more work). On the host a
/// page is free at once, and the hot path is unchanged.
///
/// **Metadata:** 4 bytes per free page (its index in the free list), 28 bytes per page of a
/// committed chunk for sharing (a count of extra holders, and cache state: see
/// [`SharedTable`]), one [`Allocation`] per chunk. A [`Page`] token is a reference to its pool and a
/// 4-byte index (16 bytes on 64-bit targets); a page in a [`PageTable`] is a 4-byte index.
///
/// A page borrows its pool, so it cannot outlive it, and it is returned once — by
/// [`free`](Self::free), which consumes it, or by its `Drop` — so it cannot be returned twice,
/// nor to another pool:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 256).unwrap();
/// let page = pool.alloc().unwrap();
/// drop(pool);
/// drop(page);
/// ```
///
/// ```compile_fail,E0382
/// # use memtoken::{make_guard, Budget, Device, PagePool};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 256).unwrap();
/// let page = pool.alloc().unwrap();
/// pool.free(page);
/// pool.free(page);
/// ```
///
/// Each pool is branded (like a [`Device`](crate::Device)), so a page of one pool cannot be
/// given back to another:
///
/// ```compile_fail
/// use memtoken::{Page, PagePool};
/// use memtoken::backend::doubles::SimBackend;
/// fn give_back<'pa, 'pb, 'b, 'id>(
///     page_of_a: Page<'_, 'pa, 'b, 'id, SimBackend>,
///     pool_b: &PagePool<'pb, 'b, 'id, SimBackend>,
/// ) {
///     pool_b.free(page_of_a); // error: lifetime may not live long enough
/// }
/// ```
///
/// The pool is single-threaded (`!Sync`): its free list is not locked.
pub struct PagePool<'pool, 'b, 'id, B: Backend> {
    _brand: Id<'pool>,
    binding: &'b Binding<'b, 'id, B>,
    page_shift: u32,
    chunk_bytes: usize,
    pages_per_chunk_shift: u32,
    state: UnsafeCell<PoolState<'b, 'id, B>>,
}

/// One page of a [`PagePool`]: a linear token, returned to its pool by
/// [`PagePool::free`] or when dropped.
pub struct Page<'p, 'pool, 'b, 'id, B: Backend> {
    pool: &'p PagePool<'pool, 'b, 'id, B>,
    index: u32,
}

/// A sequence's pages, in order: a token that owns every page pushed onto it
/// ([`PagePool::push`]) and returns them all to the pool when cleared ([`PagePool::clear`]) or
/// dropped. It holds its pool once, not once per page, so a
/// page in a table costs 4 bytes — the KV cache's page table, and its hot path.
///
/// ```
/// use memtoken::{make_guard, Budget, Device, PagePool};
/// use memtoken::backend::HostBackend;
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// make_guard!(pool_guard);
/// let pool = PagePool::new(pool_guard, &binding, 1024)?;
/// let mut table = pool.table();
/// for token in 0..40 {
///     if token % 16 == 0 {
///         pool.push(&mut table)?; // a new page every 16 tokens
///     }
/// }
/// assert_eq!((table.len(), pool.live_pages()), (3, 3));
/// drop(table);
/// assert_eq!(pool.live_pages(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PageTable<'p, 'pool, 'b, 'id, B: Backend> {
    pool: &'p PagePool<'pool, 'b, 'id, B>,
    pages: Vec<u32>,
}

impl<'pool, 'b, 'id, B: Backend> PagePool<'pool, 'b, 'id, B> {
    /// An empty pool of `page_size`-byte pages, committing through `binding` as it grows,
    /// branded by `guard` (from [`make_guard!`](crate::make_guard)): its pages and tables carry
    /// the brand, so returning one to another pool does not compile.
    ///
    /// # Errors
    ///
    /// [`PoolError::PageSize`] unless `page_size` is a power of two.
    pub fn new(
        guard: Guard<'pool>,
        binding: &'b Binding<'b, 'id, B>,
        page_size: usize,
    ) -> Result<Self, PoolError> {
        Scope::run::<B, _>(move || {
            let granularity = binding.device().granularity();
            if !page_size.is_power_of_two() || !granularity.is_power_of_two() {
                return Err(PoolError::PageSize(page_size));
            }
            let chunk_bytes = granularity.max(page_size);
            if chunk_bytes / page_size > 1 << 24 {
                // Indices are u32 and a chunk's pages must leave room for many chunks.
                return Err(PoolError::PageSize(page_size));
            }
            Ok(Self {
                _brand: guard.into(),
                binding,
                page_shift: page_size.trailing_zeros(),
                chunk_bytes,
                pages_per_chunk_shift: (chunk_bytes / page_size).trailing_zeros(),
                state: UnsafeCell::new(PoolState {
                    chunks: Vec::new(),
                    free: Vec::new(),
                    unfenced: Vec::new(),
                    cooling: Vec::new(),
                    withheld: Vec::new(),
                    extra: Vec::new(),
                    meta: Vec::new(),
                    idle: Lru::new(),
                }),
            })
        })
    }

    /// Runs `f` on the pool's state.
    #[inline(always)]
    fn with<R>(&self, f: impl FnOnce(&mut PoolState<'b, 'id, B>) -> R) -> R {
        // SAFETY: the pool is `!Sync`, so only this thread reaches the state, and no `f` passed
        // here calls back into the pool, so this is the only reference to it while `f` runs.
        f(unsafe { &mut *self.state.get() })
    }

    /// A free page, committing a new chunk first if none is left.
    ///
    /// # Errors
    ///
    /// [`PoolError`] when the pool must grow and cannot.
    #[inline]
    pub fn alloc(&self) -> Result<Page<'_, 'pool, 'b, 'id, B>, PoolError> {
        match self.with(|s| s.free.pop()) {
            Some(index) => Ok(Page { pool: self, index }),
            None => self.grow_and_alloc(),
        }
    }

    #[cold]
    fn grow_and_alloc(&self) -> Result<Page<'_, 'pool, 'b, 'id, B>, PoolError> {
        Scope::run::<B, _>(move || {
            // Freed pages first, then the idle cached page let go least recently, then a new
            // chunk.
            if !self.reclaim() {
                self.make_room()?;
            }
            self.alloc()
        })
    }

    /// With no page free: evicts the idle cached page let go least recently, if there is one
    /// — free at once where nothing runs asynchronously; elsewhere it cools behind a fence
    /// recorded now, like a freed page, and is free now only if that work has finished —
    /// otherwise commits one more chunk (so on a GPU at its budget an allocation fails while
    /// the evicted page cools, and succeeds again once the work has finished).
    #[cold]
    #[inline(never)]
    fn make_room(&self) -> Result<(), PoolError> {
        if self.evict_one() && (self.with(|s| !s.free.is_empty()) || self.reclaim()) {
            return Ok(());
        }
        self.grow()
    }

    fn backend(&self) -> &'b Guarded<B> {
        self.binding.device().backend()
    }

    /// Puts the pages given back since the last fence behind one fence recorded now, and frees
    /// the pages whose fence has completed; whether any page is free now.
    #[cold]
    fn reclaim(&self) -> bool {
        Scope::run::<B, _>(move || {
            if B::IMMEDIATE {
                return false; // nothing cools here
            }
            let backend = self.backend();
            // Two allocations per batch (the list that replaces the unfenced one, the chunks), none
            // per page.
            let batch = self.with(|s| {
                let capacity = s.unfenced.capacity();
                std::mem::replace(&mut s.unfenced, Vec::with_capacity(capacity))
            });
            if !batch.is_empty() {
                // Over what may use the pool's chunks: the streams its pages were used on.
                let chunks: Vec<_> =
                    self.with(|s| s.chunks.iter().flatten().map(|c| c.addr()).collect());
                let fence = backend.fence_for(&chunks);
                let merged = self.with(|s| {
                    let mut batch = batch;
                    let mut merged = None;
                    if s.cooling.len() >= BATCHES
                        && let Some((older, pages)) = s.cooling.pop()
                    {
                        batch.extend_from_slice(&pages);
                        merged = older;
                    }
                    s.cooling.push((fence, batch));
                    merged
                });
                if let Some(older) = merged {
                    backend.retire_fence(older);
                }
            }
            let cooling = self.with(|s| std::mem::take(&mut s.cooling));
            let mut still = Vec::new();
            for (fence, pages) in cooling {
                match fence.or_else(|| backend.fence()) {
                    Some(fence) if backend.fence_done(&fence) => {
                        backend.retire_fence(fence);
                        // A page a graph may still use goes to no new owner.
                        let size = self.page_size();
                        let (kept, free): (Vec<u32>, Vec<u32>) = pages
                            .iter()
                            .partition(|&&p| backend.withheld(self.page_addr(p), size));
                        self.with(|s| {
                            s.free.extend_from_slice(&free);
                            s.withheld.extend_from_slice(&kept);
                        });
                    }
                    fence => still.push((fence, pages)),
                }
            }
            self.with(|s| {
                s.cooling.extend(still);
                !s.free.is_empty()
            })
        })
    }

    /// Gives pages back: at once where nothing can use them asynchronously, else to the pages
    /// that wait for a fence, recorded when the pool next runs out of free pages (work on
    /// the streams that used the pool's chunks may still use them). No allocation, no call.
    #[inline]
    fn give_back(&self, pages: &[u32]) {
        if B::IMMEDIATE {
            self.with(|s| s.free.extend_from_slice(pages));
        } else {
            self.with(|s| s.unfenced.extend_from_slice(pages));
        }
    }

    /// Returns `page` to this pool — as dropping it does, without reading the pool back out of
    /// the page. The brand proves at compile time that the page is this pool's.
    #[inline]
    pub fn free(&self, page: Page<'_, 'pool, 'b, 'id, B>) {
        let index = page.index;
        std::mem::forget(page);
        self.give_back(&[index]);
    }

    /// Takes a page and appends it to `table` (a [`PageTable`], or a [`SharedTable`] — held by
    /// that table alone); returns its position.
    ///
    /// # Errors
    ///
    /// [`PoolError`] when the pool must grow and cannot; the table is unchanged.
    #[inline]
    pub fn push<T: Table<'pool, 'b, 'id, B>>(&self, table: &mut T) -> Result<usize, PoolError> {
        let index = match self.with(|s| s.free.split_last().map(|(&i, _)| i)) {
            Some(index) => {
                self.with(|s| {
                    let len = s.free.len();
                    s.free.truncate(len - 1)
                });
                index
            }
            None => {
                let page = self.grow_and_alloc()?;
                let index = page.index;
                std::mem::forget(page);
                index
            }
        };
        let pages = table.pages_mut(shared::INSIDE);
        let position = pages.len();
        pages.push(index);
        Ok(position)
    }

    /// Returns every page of `table` to this pool; the table can be reused. A
    /// [`SharedTable`] lets each page go, the last first: a page is freed with its last
    /// holder, and a cached one then waits, findable, to be evicted.
    #[inline]
    pub fn clear<T: Table<'pool, 'b, 'id, B>>(&self, table: &mut T) {
        let pages = table.pages_mut(shared::INSIDE);
        if T::SHARED {
            self.let_go_all(pages);
            pages.clear();
            return;
        }
        self.give_back(pages);
        pages.clear();
    }

    /// An empty page table drawing from this pool.
    pub fn table(&self) -> PageTable<'_, 'pool, 'b, 'id, B> {
        PageTable {
            pool: self,
            pages: Vec::new(),
        }
    }

    /// Commits one more chunk and adds its pages to the free list.
    ///
    /// # Errors
    ///
    /// [`PoolError`] when reserving or committing fails (nothing is kept or charged then).
    pub fn grow(&self) -> Result<(), PoolError> {
        Scope::run::<B, _>(move || {
            let per_chunk = 1usize << self.pages_per_chunk_shift;
            let slot = self.with(|s| {
                s.chunks
                    .iter()
                    .position(Option::is_none)
                    .unwrap_or(s.chunks.len())
            });
            let first = first_index(slot, per_chunk).ok_or(PoolError::Full)?;
            let reserved = self
                .binding
                .reserve(self.chunk_bytes)
                .map_err(|e| PoolError::Reserve(Box::new(e)))?;
            let chunk = reserved
                .commit()
                .map_err(|e| PoolError::Commit(Box::new(e.cause)))?;
            self.with(|s| {
                if slot == s.chunks.len() {
                    s.chunks.push(None);
                }
                s.chunks[slot] = Some(chunk);
                // Capacity for every page of every chunk: the hot path's pushes never reallocate.
                let total = s.chunks.len() * per_chunk;
                s.extra.resize(total, 0);
                s.meta.resize(total, Meta::default());
                s.free.reserve(total - s.free.len());
                if !B::IMMEDIATE {
                    s.unfenced.reserve(total - s.unfenced.len());
                }
                s.free
                    .extend((0..per_chunk as u32).rev().map(|i| first + i));
            });
            Ok(())
        })
    }

    /// Releases every chunk whose pages are all free; returns how many were released.
    pub fn shrink(&self) -> usize {
        Scope::run::<B, _>(move || {
            self.reclaim();
            let per_chunk = 1usize << self.pages_per_chunk_shift;
            let shift = self.pages_per_chunk_shift;
            let idle: Vec<Allocation<'b, 'id, B, Committed>> = self.with(|s| {
                let mut free_in = vec![0usize; s.chunks.len()];
                for &i in &s.free {
                    free_in[(i >> shift) as usize] += 1;
                }
                let idle: Vec<usize> = (0..s.chunks.len())
                    .filter(|&c| free_in[c] == per_chunk && s.chunks[c].is_some())
                    .collect();
                s.free
                    .retain(|&i| free_in[(i >> shift) as usize] != per_chunk);
                idle.iter().filter_map(|&c| s.chunks[c].take()).collect()
            });
            let n = idle.len();
            drop(idle); // teardown outside the state: it calls the backend
            n
        })
    }

    /// Pages in committed chunks.
    pub fn capacity(&self) -> usize {
        let chunks = self.with(|s| s.chunks.iter().flatten().count());
        chunks << self.pages_per_chunk_shift
    }

    /// Free pages.
    pub fn free_pages(&self) -> usize {
        self.with(|s| s.free.len())
    }

    /// Pages given back whose fence has not completed yet: work may still use them, so they
    /// are handed out again only once it has (never on the host).
    pub fn cooling_pages(&self) -> usize {
        self.with(|s| s.unfenced.len() + s.cooling.iter().map(|(_, p)| p.len()).sum::<usize>())
    }

    /// Pages given back whose memory the backend withholds for good (CUDA: a graph captured
    /// around memtoken may still use it): never handed out again; their chunk stays (and is
    /// quarantined as the pool drops).
    pub fn withheld_pages(&self) -> usize {
        self.with(|s| s.withheld.len())
    }

    /// Pages handed out and not yet returned (a shared page counts once).
    pub fn live_pages(&self) -> usize {
        self.capacity()
            - self.free_pages()
            - self.cooling_pages()
            - self.withheld_pages()
            - self.idle_pages()
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> usize {
        1 << self.page_shift
    }

    /// Address of page `index`.
    #[inline]
    fn page_addr(&self, index: u32) -> Addr {
        let (chunk, offset) = locate(index, self.pages_per_chunk_shift, self.page_shift);
        let base = self.with(|s| {
            s.chunks[chunk]
                .as_ref()
                .map(Allocation::addr)
                .expect("a live page's chunk is committed")
        });
        base + offset
    }
}

/// Where page `index` lies: its chunk, and its byte offset in the chunk, with
/// `2^per_chunk_shift` pages of `2^page_shift` bytes a chunk.
#[inline]
fn locate(index: u32, per_chunk_shift: u32, page_shift: u32) -> (usize, usize) {
    let chunk = (index >> per_chunk_shift) as usize;
    let slot = (index as usize) & ((1 << per_chunk_shift) - 1);
    (chunk, slot << page_shift)
}

/// The indices of chunk `slot`'s pages start at `slot * per_chunk`; `None` if its last page
/// would not fit in a `u32` index below `u32::MAX`.
fn first_index(slot: usize, per_chunk: usize) -> Option<u32> {
    let first = slot.checked_mul(per_chunk)?;
    let end = first.checked_add(per_chunk)?;
    // Below u32::MAX, which the eviction order keeps for "no page".
    (end as u64 <= u64::from(u32::MAX)).then_some(first as u32)
}

impl<'p, 'pool, 'b, 'id, B: Backend> Page<'p, 'pool, 'b, 'id, B> {
    /// The page's index in its pool (stable while the page lives).
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

    /// The page's size in bytes (its pool's page size).
    pub(crate) fn size(&self) -> usize {
        self.pool.page_size()
    }

    /// The backend, for interop.
    pub(crate) fn backend(&self) -> &Guarded<B> {
        self.pool.binding.device().backend()
    }
}

impl<'p, 'pool, 'b, 'id, B: Backend> PageTable<'p, 'pool, 'b, 'id, B> {
    /// Removes the last page as a token of its own.
    pub fn pop(&mut self) -> Option<Page<'p, 'pool, 'b, 'id, B>> {
        let index = self.pages.pop()?;
        Some(Page {
            pool: self.pool,
            index,
        })
    }

    /// The backend, for interop.
    pub(crate) fn backend(&self) -> &Guarded<B> {
        self.pool.binding.device().backend()
    }

    /// Pages in the table.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// The pool's page size in bytes.
    pub fn page_size(&self) -> usize {
        self.pool.page_size()
    }

    /// Whether the table has no page.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
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
}

impl<B: HostVisible> PageTable<'_, '_, '_, '_, B> {
    /// The bytes of the page at `position`.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn page(&self, position: usize) -> &[u8] {
        // SAFETY: as for `Page::as_slice`: the table owns this page, its chunk stays committed
        // while it does, and `&self` excludes writes through the table.
        unsafe { host_slice(self.addr(position), self.pool.page_size()) }
    }

    /// The bytes of the page at `position`, writable.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn page_mut(&mut self, position: usize) -> &mut [u8] {
        // SAFETY: as in `page`; `&mut self` makes this the only borrow of the table's pages.
        unsafe { host_slice_mut(self.addr(position), self.pool.page_size()) }
    }
}

impl<B: Backend> Drop for PageTable<'_, '_, '_, '_, B> {
    fn drop(&mut self) {
        self.pool.clear(self);
    }
}

impl<B: Backend> fmt::Display for PageTable<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a page table of {} pages", self.pages.len())
    }
}

impl<B: Backend> fmt::Debug for PageTable<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageTable")
            .field("pages", &self.pages)
            .finish()
    }
}

impl<B: HostVisible> Page<'_, '_, '_, '_, B> {
    /// The page's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the page's range lies in a committed chunk that the pool keeps while the
        // page lives (shrink only releases chunks whose pages are all free), mapped read-write
        // by a HostVisible backend; pages never overlap, and this page is its range's only token.
        unsafe { host_slice(self.addr(), self.pool.page_size()) }
    }

    /// The page's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow of the range.
        unsafe { host_slice_mut(self.addr(), self.pool.page_size()) }
    }
}

impl<B: Backend> Drop for Page<'_, '_, '_, '_, B> {
    #[inline]
    fn drop(&mut self) {
        self.pool.give_back(&[self.index]);
    }
}

impl<B: Backend> Drop for PagePool<'_, '_, '_, B> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        // A page borrows its pool: one still handed out now was forgotten (`mem::forget` of
        // the page or of its table). Its memory goes with the pool's chunks; the device's
        // close report counts it.
        let forgotten = self.live_pages();
        if forgotten > 0 {
            self.binding.device().note_forgotten_pages(forgotten as u64);
        }
        // The chunks' own teardown fences cover the work that cooling pages waited for.
        let backend = self.backend();
        for (fence, _) in std::mem::take(&mut self.state.get_mut().cooling) {
            if let Some(fence) = fence {
                backend.retire_fence(fence);
            }
        }
    }
}

impl<B: Backend> fmt::Debug for Page<'_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Page").field("index", &self.index).finish()
    }
}

impl<B: Backend> fmt::Debug for PagePool<'_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("page_size", &self.page_size())
            .field("capacity", &self.capacity())
            .field("free", &self.free_pages())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_index_splits_into_its_chunk_and_offset() {
        // 512 pages of 4 KiB a chunk (a 2 MiB granule).
        assert_eq!(locate(0, 9, 12), (0, 0));
        assert_eq!(locate(1, 9, 12), (0, 4096));
        assert_eq!(locate(511, 9, 12), (0, 511 * 4096));
        assert_eq!(locate(512, 9, 12), (1, 0));
        assert_eq!(locate(513, 9, 12), (1, 4096));
        // One page a chunk (pages as large as the granule).
        assert_eq!(locate(7, 0, 21), (7, 0));
        assert_eq!(
            locate(u32::MAX, 9, 12),
            ((u32::MAX >> 9) as usize, 511 * 4096)
        );
    }

    #[test]
    fn chunk_indices_stop_below_u32_max() {
        assert_eq!(first_index(0, 512), Some(0));
        assert_eq!(first_index(3, 512), Some(1536));
        // The last whole chunk below u32::MAX (kept for "no page" in the eviction order).
        let last = (1usize << 32) / 512 - 2;
        assert_eq!(first_index(last, 512), Some((last * 512) as u32));
        assert_eq!(first_index(last + 1, 512), None);
        assert_eq!(
            first_index((1 << 32) - 1, 1),
            None,
            "index u32::MAX is never a page"
        );
        assert_eq!(first_index(usize::MAX, 2), None);
    }
}
