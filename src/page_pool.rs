//! [`PagePool`]: fixed-size pages carved out of committed chunks — the KV cache's hot path.
//!
//! Allocating and freeing a page is O(1): a pop from and a push onto a free list of page
//! indices whose capacity is reserved when a chunk is committed, so the hot path makes no
//! system call and no allocation. The pool commits a chunk (one granule, or one page if pages
//! are larger) when it runs out, and gives back chunks whose pages are all free when asked
//! ([`shrink`](PagePool::shrink)).
//!
//! **Metadata:** 4 bytes per free page (its index in the free list), nothing per live page in
//! the pool, one [`Allocation`] per chunk. A [`Page`] token is a reference to its pool and a
//! 4-byte index (16 bytes on 64-bit targets).
//!
//! A page borrows its pool, so it cannot outlive it, and it returns itself — by
//! [`free`](Page::free) or by `Drop` — so it cannot be returned to another pool, nor twice:
//!
//! ```compile_fail,E0505
//! # use memtoken::{make_guard, Budget, Device, PagePool};
//! # use memtoken::backend::HostBackend;
//! # make_guard!(guard);
//! # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
//! # let binding = device.bind(Budget::unlimited()).unwrap();
//! let pool = PagePool::new(&binding, 256).unwrap();
//! let page = pool.alloc().unwrap();
//! drop(pool);
//! drop(page);
//! ```
//!
//! ```compile_fail,E0382
//! # use memtoken::{make_guard, Budget, Device, PagePool};
//! # use memtoken::backend::HostBackend;
//! # make_guard!(guard);
//! # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
//! # let binding = device.bind(Budget::unlimited()).unwrap();
//! let pool = PagePool::new(&binding, 256).unwrap();
//! let page = pool.alloc().unwrap();
//! page.free();
//! page.free();
//! ```
//!
//! The pool is single-threaded (`!Sync`): its free list is not locked.

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, HostVisible};
use crate::binding::Binding;
use crate::error::{CommitFailure, ReserveError};
use crate::state::Committed;
use std::cell::UnsafeCell;
use std::fmt;

/// Why a pool could not be made or grown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The page size is not a power of two that divides a chunk.
    #[error(
        "page size {page_size} must be a power of two (and a divisor or multiple of the granularity, {granularity} bytes)"
    )]
    PageSize {
        /// The page size asked for.
        page_size: usize,
        /// The device's granularity.
        granularity: usize,
    },
    /// Reserving a new chunk failed.
    #[error("the pool could not grow: {0}")]
    Reserve(#[from] ReserveError),
    /// Committing a new chunk failed (its reservation was released).
    #[error("the pool could not grow: {0}")]
    Commit(#[from] CommitFailure),
    /// The pool already has 2^32 pages.
    #[error("the pool cannot index more than 2^32 pages")]
    Full,
}

struct PoolState<'b, 'id, B: Backend> {
    chunks: Vec<Option<Allocation<'b, 'id, B, Committed>>>,
    /// Indices of free pages; its capacity always covers every page of every chunk.
    free: Vec<u32>,
}

/// Fixed-size pages sub-allocated in O(1) from committed chunks. See the [module docs](self).
pub struct PagePool<'b, 'id, B: Backend> {
    binding: &'b Binding<'b, 'id, B>,
    page_shift: u32,
    chunk_bytes: usize,
    pages_per_chunk_shift: u32,
    state: UnsafeCell<PoolState<'b, 'id, B>>,
}

/// One page of a [`PagePool`]: a linear token that returns itself to its pool when freed or
/// dropped.
pub struct Page<'p, 'b, 'id, B: Backend> {
    pool: &'p PagePool<'b, 'id, B>,
    index: u32,
}

impl<'b, 'id, B: Backend> PagePool<'b, 'id, B> {
    /// An empty pool of `page_size`-byte pages, committing through `binding` as it grows.
    ///
    /// # Errors
    ///
    /// [`PoolError::PageSize`] unless `page_size` is a power of two.
    pub fn new(binding: &'b Binding<'b, 'id, B>, page_size: usize) -> Result<Self, PoolError> {
        let granularity = binding.device().granularity();
        if !page_size.is_power_of_two() || !granularity.is_power_of_two() {
            return Err(PoolError::PageSize {
                page_size,
                granularity,
            });
        }
        let chunk_bytes = granularity.max(page_size);
        Ok(Self {
            binding,
            page_shift: page_size.trailing_zeros(),
            chunk_bytes,
            pages_per_chunk_shift: (chunk_bytes / page_size).trailing_zeros(),
            state: UnsafeCell::new(PoolState {
                chunks: Vec::new(),
                free: Vec::new(),
            }),
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
    pub fn alloc(&self) -> Result<Page<'_, 'b, 'id, B>, PoolError> {
        match self.with(|s| s.free.pop()) {
            Some(index) => Ok(Page { pool: self, index }),
            None => self.grow_and_alloc(),
        }
    }

    #[cold]
    fn grow_and_alloc(&self) -> Result<Page<'_, 'b, 'id, B>, PoolError> {
        self.grow()?;
        self.alloc()
    }

    /// Commits one more chunk and adds its pages to the free list.
    ///
    /// # Errors
    ///
    /// [`PoolError`] when reserving or committing fails (nothing is kept or charged then).
    pub fn grow(&self) -> Result<(), PoolError> {
        let per_chunk = 1usize << self.pages_per_chunk_shift;
        let slot = self.with(|s| s.chunks.iter().position(Option::is_none).unwrap_or(s.chunks.len()));
        let first = (slot * per_chunk) as u64;
        if first + per_chunk as u64 > u64::from(u32::MAX) + 1 {
            return Err(PoolError::Full);
        }
        let reserved = self.binding.reserve(self.chunk_bytes)?;
        let chunk = reserved.commit().map_err(|e| e.cause)?;
        self.with(|s| {
            if slot == s.chunks.len() {
                s.chunks.push(None);
            }
            s.chunks[slot] = Some(chunk);
            // Capacity for every page of every chunk: the hot path's pushes never reallocate.
            let total = s.chunks.len() * per_chunk;
            s.free.reserve(total - s.free.len());
            s.free.extend((0..per_chunk as u32).rev().map(|i| first as u32 + i));
        });
        Ok(())
    }

    /// Releases every chunk whose pages are all free; returns how many were released.
    pub fn shrink(&self) -> usize {
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
            s.free.retain(|&i| free_in[(i >> shift) as usize] != per_chunk);
            idle.iter().filter_map(|&c| s.chunks[c].take()).collect()
        });
        let n = idle.len();
        drop(idle); // teardown outside the state: it calls the backend
        n
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

    /// Pages handed out and not yet returned.
    pub fn live_pages(&self) -> usize {
        self.capacity() - self.free_pages()
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> usize {
        1 << self.page_shift
    }

    /// Address of page `index`.
    #[inline]
    fn page_addr(&self, index: u32) -> Addr {
        let chunk = (index >> self.pages_per_chunk_shift) as usize;
        let slot = (index as usize) & ((1 << self.pages_per_chunk_shift) - 1);
        let base = self.with(|s| {
            s.chunks[chunk]
                .as_ref()
                .map(Allocation::addr)
                .expect("a live page's chunk is committed")
        });
        base + (slot << self.page_shift)
    }
}

impl<'p, 'b, 'id, B: Backend> Page<'p, 'b, 'id, B> {
    /// The page's index in its pool (stable while the page lives).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The page's address.
    pub fn addr(&self) -> Addr {
        self.pool.page_addr(self.index)
    }

    /// Returns the page to its pool (as dropping it does).
    #[inline]
    pub fn free(self) {}
}

impl<B: HostVisible> Page<'_, '_, '_, B> {
    /// The page's bytes.
    pub fn as_slice(&self) -> &[u8] {
        let len = self.pool.page_size();
        // SAFETY: the page's range lies in a committed chunk that the pool keeps while the
        // page lives (shrink only releases chunks whose pages are all free), mapped read-write
        // by a HostVisible backend; pages never overlap, and this page is its range's only token.
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, len) }
    }

    /// The page's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.pool.page_size();
        // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow of the range.
        unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, len) }
    }
}

impl<B: Backend> Drop for Page<'_, '_, '_, B> {
    #[inline]
    fn drop(&mut self) {
        let index = self.index;
        self.pool.with(|s| s.free.push(index));
    }
}

impl<B: Backend> fmt::Debug for Page<'_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Page").field("index", &self.index).finish()
    }
}

impl<B: Backend> fmt::Debug for PagePool<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("page_size", &self.page_size())
            .field("capacity", &self.capacity())
            .field("free", &self.free_pages())
            .finish()
    }
}
