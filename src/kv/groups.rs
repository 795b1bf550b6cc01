//! Between steps: fences over the blocks given back, and groups mapped and given back to the
//! watermarks — every backend call the KV cache makes after it is made.

use super::{Batch, Blocks, KvCache, KvError, Memory, PlaneMemory};
use crate::backend::{Addr, Backend, BackendError, Op};
use crate::error::CommitFailure;
use crate::unwind::Scope;

/// The most fenced batches the cache keeps waiting: a newer batch takes the newest one's blocks
/// under its own fence (recorded later, it covers more work).
const BATCHES: usize = 2;

/// What one [`replenish`](KvCache::replenish) did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replenished {
    /// Whether it recorded a fence (at most one).
    pub fenced: bool,
    /// Blocks whose fence had completed, free again.
    pub freed: usize,
    /// Groups mapped.
    pub mapped: usize,
    /// Groups unmapped and given back to the device's granule cache.
    pub unmapped: usize,
}

impl<B: Backend> KvCache<'_, '_, '_, B> {
    /// Sets the watermarks of idle groups (mapped, no live block): [`replenish`](Self::replenish)
    /// maps groups until at least `low` are idle, and gives back idle groups above `high`.
    ///
    /// # Panics
    ///
    /// If `low > high`.
    pub fn set_watermarks(&self, low: usize, high: usize) {
        assert!(
            low <= high,
            "the low watermark {low} is above the high {high}"
        );
        self.with(|s| (s.low, s.high) = (low, high));
    }

    /// The watermarks of idle groups: `(low, high)`.
    pub fn watermarks(&self) -> (usize, usize) {
        self.with(|s| (s.low, s.high))
    }

    /// Every backend call of the cache after it was made, once per step, in order:
    ///
    /// 1. blocks whose fence has completed become free;
    /// 2. on a backend that is not [`IMMEDIATE`](Backend::IMMEDIATE), **one fence** over the
    ///    planes is recorded for the blocks given back since the last call (they become free once
    ///    it has completed: at once if it already has), and for groups to give back while work may
    ///    still use the planes;
    /// 3. the lowest unmapped groups are mapped until `low` groups are idle (the groups holding a
    ///    live block do not count);
    /// 4. idle groups above `high` are unmapped, the highest first, and given back to the
    ///    device's granule cache — once no work recorded before the fence that armed them may
    ///    still run (on an immediate backend, at once).
    ///
    /// # Errors
    ///
    /// [`KvError::Map`] when a group cannot be mapped whole (the budget, the backend: what this
    /// call mapped of it is given back, the groups before it stay mapped); [`KvError::Unmap`]
    /// when a group cannot be unmapped whole (its granules that could not be stay mapped: if
    /// none could, its blocks are handed out again at once; if some could, not before a later
    /// `replenish` has mapped it whole). Such a group is pinned: given back after the others,
    /// and a later failure to give it back is not reported again. [`KvError::Asleep`] while the
    /// cache sleeps.
    pub fn replenish(&self) -> Result<Replenished, KvError> {
        Scope::run::<B, _>(move || {
            if self.is_asleep() {
                return Err(KvError::Asleep);
            }
            let mut done = Replenished {
                freed: self.complete_fences(),
                ..Replenished::default()
            };
            // Planes allocated whole (the plain mechanism): every group stays mapped, and only
            // the blocks given back are fenced.
            let on_demand = self.maps_on_demand();
            let over = self.with(|s| s.idle_groups().saturating_sub(s.high));
            let may_shrink = if B::IMMEDIATE {
                true
            } else {
                // Armed once, by the first replenish that finds groups over the high watermark;
                // they go once the work recorded up to then has completed (a later fence that
                // has completed says so too).
                let (armed, done_through) = self.with(|s| {
                    let armed = s.shrink_after.is_some();
                    (armed, s.shrink_after.is_some_and(|at| s.fenced_through(at)))
                });
                let unfenced = self.with(|s| !s.unfenced.is_empty());
                let arm = on_demand && over > 0 && !armed;
                if unfenced || arm {
                    done.fenced = true;
                    let (freed, at_once) = self.record_fence(arm);
                    done.freed += freed;
                    done_through || at_once
                } else {
                    done_through
                }
            };
            if on_demand {
                done.mapped = self.map_to_low()?;
                if may_shrink {
                    done.unmapped = self.unmap_over_high()?;
                }
            }
            Ok(done)
        })
    }

    /// Frees the blocks of every batch whose fence has completed; how many.
    pub(super) fn complete_fences(&self) -> usize {
        if B::IMMEDIATE {
            return 0;
        }
        let backend = self.backend();
        let shift = self.group_shift;
        let cooling = self.with(|s| std::mem::take(&mut s.cooling));
        let mut freed = 0;
        let mut still = Vec::new();
        for mut batch in cooling {
            match batch.fence.take().or_else(|| backend.fence()) {
                Some(fence) if backend.fence_done(&fence) => {
                    backend.retire_fence(fence);
                    freed += batch.blocks.len();
                    self.with(|s| s.free_all(&batch.blocks, shift));
                }
                fence => still.push(Batch { fence, ..batch }),
            }
        }
        self.with(|s| s.cooling.extend(still));
        freed
    }

    /// Records one fence over the planes for the blocks given back since the last one (and, if
    /// `arm`, for the groups over the high watermark); how many blocks it freed at once (it had
    /// completed already), and whether it had.
    fn record_fence(&self, arm: bool) -> (usize, bool) {
        let backend = self.backend();
        let fence = backend.fence_for(&self.bases);
        let blocks = self.with(|s| {
            let capacity = s.unfenced.capacity();
            std::mem::replace(&mut s.unfenced, Vec::with_capacity(capacity))
        });
        if fence.as_ref().is_some_and(|f| backend.fence_done(f)) {
            // Everything recorded so far has completed: free now, and the groups over the
            // high watermark may go now.
            let shift = self.group_shift;
            let n = blocks.len();
            self.with(|s| {
                s.free_all(&blocks, shift);
                s.shrink_after = None;
            });
            if let Some(fence) = fence {
                backend.retire_fence(fence);
            }
            return (n, true);
        }
        let merged = self.with(|s| {
            s.serial += 1;
            let serial = s.serial;
            if arm {
                s.shrink_after = Some(serial);
            }
            let (mut blocks, mut serial) = (blocks, serial);
            let mut merged = None;
            if s.cooling.len() >= BATCHES
                && let Some(newest) = s.cooling.pop()
            {
                // The new fence covers the newest batch's work too; the batch stands for the
                // oldest work it holds.
                blocks.extend_from_slice(&newest.blocks);
                serial = newest.serial;
                merged = newest.fence;
            }
            s.cooling.push(Batch {
                fence,
                blocks,
                serial,
            });
            merged
        });
        if let Some(older) = merged {
            backend.retire_fence(older);
        }
        (0, false)
    }

    /// Maps the lowest groups not mapped whole until `low` are idle; how many it mapped. One
    /// pass over the groups: each group mapped makes one more idle (a group not mapped whole
    /// holds no live block).
    fn map_to_low(&self) -> Result<usize, KvError> {
        let (mut idle, low, groups) = self.with(|s| (s.idle_groups(), s.low, s.groups.len()));
        let mut mapped = 0;
        let mut group = 0;
        while idle < low && group < groups {
            if self.with(|s| s.groups[group].memory) != Memory::Mapped {
                self.map_group(group).map_err(|cause| KvError::Map {
                    group,
                    cause: Box::new(cause),
                })?;
                mapped += 1;
                idle += 1;
            }
            group += 1;
        }
        Ok(mapped)
    }

    /// Unmaps the highest idle groups above `high`, and every group left partly mapped with no
    /// live block; how many went. A group whose unmap fails (some of its memory held for good,
    /// say) is pinned: tried again at each shrink, and reported only the first time.
    fn unmap_over_high(&self) -> Result<usize, KvError> {
        let over: Vec<usize> = self.with(|s| {
            let n = s.idle_groups().saturating_sub(s.high);
            let partial = (0..s.groups.len())
                .filter(|&g| s.groups[g].memory == Memory::Partial && s.groups[g].live == 0);
            // Pinned groups last: the others are given back first.
            let mut idle: Vec<usize> = (0..s.groups.len())
                .rev()
                .filter(|&g| s.groups[g].is_idle())
                .collect();
            idle.sort_by_key(|&g| s.groups[g].pinned);
            idle.into_iter().take(n).chain(partial).collect()
        });
        let (mut unmapped, mut failed) = (0, None);
        for &group in &over {
            let pinned = self.with(|s| s.groups[group].pinned);
            match self.unmap_group(group) {
                Ok(()) => unmapped += 1,
                Err(cause) if !pinned => {
                    failed.get_or_insert(KvError::Unmap {
                        group,
                        cause: Box::new(cause),
                    });
                }
                Err(_) => {} // pinned already: said the first time
            }
        }
        self.with(|s| s.shrink_after = None);
        failed.map_or(Ok(unmapped), Err)
    }

    /// The bytes of group `group` in plane `plane`: where, and how many.
    pub(crate) fn group_span(&self, plane: usize, group: usize) -> (Addr, usize) {
        let len = self.stride(plane) << self.group_shift;
        (self.base(plane) + group * len, len)
    }

    /// The granules of group `group` in each plane: the first one, and how many.
    pub(super) fn granules_of(&self, plane: usize, group: usize) -> (usize, usize) {
        let g = self.binding.device().granularity();
        let n = (self.stride(plane) << self.group_shift) / g;
        (group * n, n)
    }

    /// Maps group `group` in every plane, all or nothing, and adds its blocks.
    pub(super) fn map_group(&self, group: usize) -> Result<(), CommitFailure> {
        self.map_memory(group)?;
        self.add_group(group);
        Ok(())
    }

    /// Maps what is not mapped yet of group `group`'s memory, in every plane, all or nothing
    /// (its blocks are not added): on failure what this call mapped is unmapped again (a granule
    /// whose unmap fails stays mapped, and the group partly mapped).
    pub(super) fn map_memory(&self, group: usize) -> Result<(), CommitFailure> {
        let mut planes = self.planes.borrow_mut();
        let mut mapped: Vec<Vec<usize>> = Vec::with_capacity(planes.len());
        let mut failed = None;
        for p in 0..planes.len() {
            let (first, n) = self.granules_of(p, group);
            let PlaneMemory::Sparse(plane) = &mut planes[p] else {
                continue;
            };
            match plane.map_granules(first, n) {
                Ok(granules) => mapped.push(granules),
                Err(cause) => {
                    failed = Some(cause);
                    break;
                }
            }
        }
        if let Some(cause) = failed {
            // Undo the planes before it: what this call mapped goes back.
            let mut back = self.binding.give_back(mapped.iter().map(Vec::len).sum());
            for (undo, granules) in planes.iter_mut().zip(mapped) {
                if let PlaneMemory::Sparse(undo) = undo {
                    let _still_mapped = undo.unmap_granules(granules, &mut back);
                }
            }
            back.finish();
            drop(planes);
            self.settle(group);
            return Err(cause);
        }
        drop(planes);
        self.settle(group);
        Ok(())
    }

    /// Records what group `group`'s memory is now: mapped whole, not at all, or partly.
    fn settle(&self, group: usize) {
        let planes = self.planes.borrow();
        let (mut mapped, mut total) = (0, 0);
        for (p, plane) in planes.iter().enumerate() {
            let (first, n) = self.granules_of(p, group);
            total += n;
            mapped += match plane {
                PlaneMemory::Sparse(plane) => plane.mapped_in(first, n),
                PlaneMemory::Whole(_) => n,
            };
        }
        let memory = match mapped {
            0 => Memory::Unmapped,
            m if m == total => Memory::Mapped,
            _ => Memory::Partial,
        };
        self.with(|s| s.set_memory(group, memory));
    }

    /// Group `group`, mapped, joins the free blocks.
    pub(super) fn add_group(&self, group: usize) {
        let per_group = 1u32 << self.group_shift;
        let first = (group as u32) << self.group_shift;
        let blocks = self.blocks();
        self.with(|s| {
            s.set_memory(group, Memory::Mapped);
            let g = &mut s.groups[group];
            g.free.reserve_exact(per_group as usize);
            g.free.extend((first..first + per_group).rev());
            s.lowest = s.lowest.min(group);
            if !B::IMMEDIATE {
                // Giving back never allocates: room for every block.
                let room = (s.mapped << self.group_shift).min(blocks);
                s.unfenced.reserve(room.saturating_sub(s.unfenced.len()));
            }
        });
    }

    /// Unmaps idle group `group` in every plane and gives its granules back; its blocks leave
    /// the free list.
    fn unmap_group(&self, group: usize) -> Result<(), BackendError> {
        self.ensure_live(group)?;
        self.with(|s| {
            let g = &mut s.groups[group];
            debug_assert_eq!(g.live, 0);
            g.free.clear();
        });
        let done = self.unmap_memory(group);
        // Nothing of it could be unmapped: still mapped whole, its blocks free again.
        if self.with(|s| s.groups[group].memory) == Memory::Mapped {
            self.add_group(group);
        }
        done
    }

    /// Whether the context lives, asked before unmapping group `group`.
    fn ensure_live(&self, group: usize) -> Result<(), BackendError> {
        let device = self.binding.device();
        let (first, n) = self.granules_of(0, group);
        let at = self.bases[0] + first * device.granularity();
        device.ensure_live(Op::Unmap, at, n * device.granularity())
    }

    /// Unmaps group `group`'s memory in every plane and gives its granules back (its blocks
    /// stay as they are: the caller sees to them). A granule whose unmap fails stays mapped,
    /// and the group partly mapped: never handed out until mapped whole again.
    pub(super) fn unmap_memory(&self, group: usize) -> Result<(), BackendError> {
        self.ensure_live(group)?;
        // A transfer engine's registrations of it go first.
        self.unmapping(group);
        let mut planes = self.planes.borrow_mut();
        let total: usize = (0..planes.len())
            .map(|p| self.granules_of(p, group).1)
            .sum();
        let mut back = self.binding.give_back(total);
        let mut failed = None;
        for (p, plane) in planes.iter_mut().enumerate() {
            let (first, n) = self.granules_of(p, group);
            if let PlaneMemory::Sparse(plane) = plane
                && let Err(e) = plane.unmap_granules(first..first + n, &mut back)
            {
                failed = Some(e);
            }
        }
        back.finish();
        drop(planes);
        self.settle(group);
        self.with(|s| s.groups[group].pinned = failed.is_some());
        failed.map_or(Ok(()), Err)
    }
}

impl<F> Blocks<F> {
    /// Whether the work recorded up to replenish `serial` has completed: no batch waiting
    /// stands for work that old (a merged batch stands for its oldest).
    fn fenced_through(&self, serial: u64) -> bool {
        self.cooling.iter().all(|b| b.serial > serial)
    }
}
