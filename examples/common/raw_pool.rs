//! The zero-cost reference: the same page pool as `memtoken::PagePool`, written by hand with
//! plain integer handles and direct backend calls — no tokens, no typestate, no ledger.
#![allow(dead_code)]

use memtoken::backend::{Access, Addr, Backend};

pub struct RawPool<'a, B: Backend> {
    backend: &'a B,
    page_shift: u32,
    chunk_bytes: usize,
    pages_per_chunk_shift: u32,
    /// (address, physical memory) of each chunk.
    chunks: Vec<(Addr, B::Phys)>,
    free: Vec<u32>,
}

impl<'a, B: Backend> RawPool<'a, B> {
    pub fn new(backend: &'a B, page_size: usize) -> Self {
        let chunk_bytes = backend.granularity().max(page_size);
        Self {
            backend,
            page_shift: page_size.trailing_zeros(),
            chunk_bytes,
            pages_per_chunk_shift: (chunk_bytes / page_size).trailing_zeros(),
            chunks: Vec::new(),
            free: Vec::new(),
        }
    }

    #[inline]
    pub fn alloc(&mut self) -> Result<u32, ()> {
        match self.free.pop() {
            Some(index) => Ok(index),
            None => self.grow_and_alloc(),
        }
    }

    #[cold]
    fn grow_and_alloc(&mut self) -> Result<u32, ()> {
        self.grow()?;
        self.alloc()
    }

    pub fn grow(&mut self) -> Result<(), ()> {
        let len = self.chunk_bytes;
        let addr = self.backend.reserve(len).map_err(drop)?;
        let phys = self.backend.create(len).map_err(drop)?;
        self.backend
            .map(addr, len, phys, Access::ReadWrite)
            .map_err(drop)?;
        let per_chunk = 1u32 << self.pages_per_chunk_shift;
        let first = self.chunks.len() as u32 * per_chunk;
        self.chunks.push((addr, phys));
        let total = self.chunks.len() * per_chunk as usize;
        self.free.reserve(total - self.free.len());
        self.free.extend((0..per_chunk).rev().map(|i| first + i));
        Ok(())
    }

    #[inline]
    pub fn free(&mut self, index: u32) {
        self.free.push(index);
    }

    /// Frees a whole sequence's pages at once.
    #[inline]
    pub fn free_all(&mut self, indices: &[u32]) {
        self.free.extend_from_slice(indices);
    }

    pub fn addr(&self, index: u32) -> Addr {
        let chunk = (index >> self.pages_per_chunk_shift) as usize;
        let slot = (index as usize) & ((1 << self.pages_per_chunk_shift) - 1);
        self.chunks[chunk].0 + (slot << self.page_shift)
    }
}

impl<B: Backend> Drop for RawPool<'_, B> {
    fn drop(&mut self) {
        for &(addr, phys) in &self.chunks {
            let _ = self.backend.unmap(addr, self.chunk_bytes);
            let _ = self.backend.release(phys, self.chunk_bytes);
            let _ = self.backend.free(addr, self.chunk_bytes);
        }
    }
}
