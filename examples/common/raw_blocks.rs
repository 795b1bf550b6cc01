//! The hand-written reference for the KV cache's block cycle: block ids over one reservation per
//! plane, physical memory mapped by group (the blocks whose bytes share granules, in every
//! plane), a free list and a count of live blocks per group, and a new block always from the
//! lowest mapped group with room. Plain integers and direct backend calls — no tokens, no
//! typestate, no ledger, no fences (the host backend is immediate). Block 0 is the null block
//! (vLLM's, for padded tables): taken at the start, its group never unmapped.
//!
//! This is the bar the KV cache's "16 takes into a table and one clear" is counted against
//! (callgrind, `examples/block_cycle.rs`); it was written before the cache and is not changed to
//! suit it.
#![allow(dead_code)]

use memtoken::backend::{Access, Addr, Backend};

/// One plane: its reservation and the bytes between consecutive blocks.
struct Plane {
    base: Addr,
    stride: usize,
}

pub struct RawBlocks<'a, B: Backend> {
    backend: &'a B,
    planes: Vec<Plane>,
    /// Blocks per group, as a shift (a power of two).
    group_shift: u32,
    /// Per group: its physical memory in each plane, while mapped.
    mapped: Vec<Option<Vec<B::Phys>>>,
    /// Per group: the ids of its free blocks (a stack: the last given back is the next taken).
    free: Vec<Vec<u32>>,
    /// Per group: its blocks handed out.
    live: Vec<u32>,
    /// No group below this one has a free block.
    lowest: usize,
}

impl<'a, B: Backend> RawBlocks<'a, B> {
    /// A cache of `groups` groups over planes of `strides` bytes per block (each a power of two),
    /// nothing mapped; a group is the fewest blocks that fill whole granules in every plane.
    pub fn new(backend: &'a B, strides: &[usize], groups: usize) -> Result<Self, ()> {
        let g = backend.granularity();
        let per_group = strides
            .iter()
            .map(|&stride| (g / stride).max(1))
            .max()
            .ok_or(())?;
        let group_shift = per_group.trailing_zeros();
        let mut planes = Vec::with_capacity(strides.len());
        for &stride in strides {
            let len = (stride << group_shift) * groups;
            let base = backend.reserve(len).map_err(drop)?;
            planes.push(Plane { base, stride });
        }
        let mut cache = Self {
            backend,
            planes,
            group_shift,
            mapped: (0..groups).map(|_| None).collect(),
            free: (0..groups).map(|_| Vec::with_capacity(per_group)).collect(),
            live: vec![0; groups],
            lowest: 0,
        };
        cache.map_group(0)?;
        let null = cache.take().ok_or(())?;
        debug_assert_eq!(null, 0);
        Ok(cache)
    }

    fn group_bytes(&self, plane: &Plane) -> usize {
        plane.stride << self.group_shift
    }

    /// Maps group `group` in every plane: its blocks become free, lowest id taken first.
    pub fn map_group(&mut self, group: usize) -> Result<(), ()> {
        if self.mapped[group].is_some() {
            return Ok(());
        }
        let mut phys = Vec::with_capacity(self.planes.len());
        for plane in &self.planes {
            let len = self.group_bytes(plane);
            let p = self.backend.create(len).map_err(drop)?;
            self.backend
                .map(plane.base + group * len, len, p, Access::ReadWrite)
                .map_err(drop)?;
            phys.push(p);
        }
        self.mapped[group] = Some(phys);
        let first = (group as u32) << self.group_shift;
        let per_group = 1u32 << self.group_shift;
        self.free[group].extend((first..first + per_group).rev());
        self.lowest = self.lowest.min(group);
        Ok(())
    }

    /// Unmaps group `group` if none of its blocks is handed out (never the null block's).
    pub fn unmap_group(&mut self, group: usize) -> Result<(), ()> {
        if self.live[group] != 0 {
            return Err(());
        }
        let Some(phys) = self.mapped[group].take() else {
            return Ok(());
        };
        for (plane, p) in self.planes.iter().zip(phys) {
            let len = plane.stride << self.group_shift;
            self.backend
                .unmap(plane.base + group * len, len)
                .map_err(drop)?;
            self.backend.release(p, len).map_err(drop)?;
        }
        self.free[group].clear();
        Ok(())
    }

    /// A free block of the lowest mapped group with room; `None` if no mapped group has room.
    #[inline]
    pub fn take(&mut self) -> Option<u32> {
        loop {
            let group = self.lowest;
            match self.free.get_mut(group)?.pop() {
                Some(block) => {
                    self.live[group] += 1;
                    return Some(block);
                }
                None => self.lowest += 1,
            }
        }
    }

    /// Gives a sequence's blocks back at once.
    #[inline]
    pub fn give_back_all(&mut self, blocks: &[u32]) {
        for &block in blocks {
            let group = (block >> self.group_shift) as usize;
            self.free[group].push(block);
            self.live[group] -= 1;
            if group < self.lowest {
                self.lowest = group;
            }
        }
    }

    /// The address of block `block` in plane `plane`.
    pub fn addr(&self, plane: usize, block: u32) -> Addr {
        let p = &self.planes[plane];
        p.base + block as usize * p.stride
    }

    /// Groups mapped now.
    pub fn mapped_groups(&self) -> usize {
        self.mapped.iter().filter(|m| m.is_some()).count()
    }
}

impl<B: Backend> Drop for RawBlocks<'_, B> {
    fn drop(&mut self) {
        let groups = self.mapped.len();
        for group in 0..groups {
            if let Some(phys) = self.mapped[group].take() {
                for (plane, p) in self.planes.iter().zip(phys) {
                    let len = plane.stride << self.group_shift;
                    let _ = self.backend.unmap(plane.base + group * len, len);
                    let _ = self.backend.release(p, len);
                }
            }
        }
        for plane in &self.planes {
            let _ = self
                .backend
                .free(plane.base, (plane.stride << self.group_shift) * groups);
        }
    }
}
