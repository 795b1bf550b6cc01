//! The zero-cost reference for shared pages: the hand-written page pool of
//! `raw_pool.rs` with a reference count per page, as an engine would write it — a `Vec<u32>`
//! of extra holders per page index (0: one holder), a fork that copies a table's indices and
//! counts one more holder per page, a release that frees a page when its last holder lets go.
//! No tokens, no typestate, no ledger. Landed before memtoken's shared pages, and not changed
//! after: memtoken's fork, release and share/unshare are measured against it.
#![allow(dead_code)]

use super::raw_pool::RawPool;
use memtoken::backend::Backend;

pub struct RcPool<'a, B: Backend> {
    pages: RawPool<'a, B>,
    /// Pages a chunk holds.
    per_chunk: usize,
    /// Extra holders per page index (0: one holder, or free).
    extra: Vec<u32>,
}

impl<'a, B: Backend> RcPool<'a, B> {
    pub fn new(backend: &'a B, page_size: usize) -> Self {
        Self {
            pages: RawPool::new(backend, page_size),
            per_chunk: backend.granularity().max(page_size) / page_size,
            extra: Vec::new(),
        }
    }

    /// Commits one more chunk; the counts cover its pages.
    pub fn grow(&mut self) -> Result<(), ()> {
        self.pages.grow()?;
        self.extra.resize(self.extra.len() + self.per_chunk, 0);
        Ok(())
    }

    /// A free page (the pool grows when it has none), counted with one holder.
    #[inline]
    pub fn alloc(&mut self) -> Result<u32, ()> {
        let index = self.pages.alloc()?;
        if index as usize >= self.extra.len() {
            self.cover(index);
        }
        Ok(index)
    }

    /// Counts for every page of the chunk holding `index` (the pool grew by itself).
    #[cold]
    fn cover(&mut self, index: u32) {
        let chunks = index as usize / self.per_chunk + 1;
        self.extra.resize(chunks * self.per_chunk, 0);
    }

    /// One more holder of `index`.
    #[inline]
    pub fn share(&mut self, index: u32) {
        self.extra[index as usize] += 1;
    }

    /// One holder of `index` lets go; the last one frees it.
    #[inline]
    pub fn unshare(&mut self, index: u32) {
        let extra = &mut self.extra[index as usize];
        if *extra == 0 {
            self.pages.free(index);
        } else {
            *extra -= 1;
        }
    }

    /// A table holding the same pages as `table`, each counted once more.
    #[inline]
    pub fn fork(&mut self, table: &[u32]) -> Vec<u32> {
        for &index in table {
            self.extra[index as usize] += 1;
        }
        table.to_vec()
    }

    /// Every holder of `table` lets go of its pages.
    #[inline]
    pub fn release(&mut self, table: &[u32]) {
        for &index in table {
            self.unshare(index);
        }
    }

    pub fn addr(&self, index: u32) -> memtoken::backend::Addr {
        self.pages.addr(index)
    }
}
