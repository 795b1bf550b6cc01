//! Steps: every backend call a transition makes that builds or takes apart what a token holds,
//! each with the ledger and budget moves that go with it. With the custody's teardown, the one
//! place where money moves: policies (sharing, regions, sleep, pools, import) call these steps
//! and charge or refund nothing themselves.
//!
//! - VA and mappings: [`Device::reserve_va`], [`Device::map`], [`Device::unmap`] — the axis
//!   moves once the backend call succeeded, never before.
//! - Memory a token will own: a [`Build`](super::Build) records what a transition makes
//!   (budget, memory, mappings, a shared reference); undoing it is the ordinary teardown.
//! - Memory a transition made and no token will own: [`Binding::discard`], which is the
//!   ordinary teardown of an orphan (released, or quarantined still owned).
//! - Granules of elastic regions: a [`Growth`] (taken from the budget at once, from the cache
//!   or created one by one, the axes settled once) and a [`GiveBack`] (to the cache, or
//!   released; the axes settled once).

use super::Device;
use super::binding::Binding;
use crate::backend::{Access, Addr, Backend, BackendError};
use crate::error::{CommitFailure, ReleaseFailure};
use crate::ledger::Axis;
use crate::residual::{Held, SharedPhys, Split};

impl<B: Backend> Device<'_, B> {
    /// Reserves `len` bytes of VA, charged as reserved once made.
    #[inline]
    pub(crate) fn reserve_va(&self, len: usize) -> Result<Addr, BackendError> {
        let addr = self.backend.reserve(len)?;
        self.charge(Axis::Reserved, len);
        Ok(addr)
    }

    /// Maps `len` bytes of `phys` at `addr`, charged as mapped once mapped.
    #[inline]
    pub(crate) fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: B::Phys,
        access: Access,
    ) -> Result<(), BackendError> {
        self.backend.map(addr, len, phys, access)?;
        self.charge(Axis::Mapped, len);
        Ok(())
    }

    /// Unmaps `len` bytes at `addr`, refunded as mapped once gone.
    #[inline]
    pub(crate) fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.backend.unmap(addr, len)?;
        self.refund(Axis::Mapped, len);
        Ok(())
    }

    /// Shares the memory of `split` (made and charged as owned by a [`Build`](super::Build)):
    /// its first reference, counted in the device's shared totals.
    #[inline]
    pub(crate) fn share(&self, split: Split<B::Phys>) -> SharedPhys<B::Phys> {
        self.shared.share(split)
    }

    /// One more reference on a prefix's memory, held by an export to another process.
    pub(crate) fn export_ref(&self, shared: &SharedPhys<B::Phys>) -> SharedPhys<B::Phys> {
        self.shared.export(shared)
    }

    /// An export ended: its reference goes back, and the last one releases the memory (a
    /// failure is quarantined).
    pub(crate) fn end_export(&self, shared: SharedPhys<B::Phys>) {
        self.shared.export_ended();
        self.unshare(shared);
    }
}

impl<'b, 'id, B: Backend> Binding<'b, 'id, B> {
    /// Gives back `len` bytes of `phys` that a transition of this binding made and no token
    /// will own: they leave the budget, and the memory is released — or quarantined, still
    /// owned by the device, when that fails (the failure said).
    pub(crate) fn discard(&self, phys: B::Phys, len: usize) -> Result<(), ReleaseFailure> {
        self.refund(len);
        self.device().release_orphan(phys, len)
    }

    /// A token is retiring, charged `charged` bytes: what `held` no longer owns (a prefix's
    /// bytes stay with its mappings) leaves this binding's budget now, the rest with the
    /// release; its `tail` granules (a region's mapped tail) leave the ledger's tail axis.
    #[inline]
    pub(crate) fn retire(&self, charged: usize, tail: usize, held: &Held<B::Phys>) {
        self.device().tail_left(tail);
        let kept = held.owned_bytes();
        if charged > kept {
            self.refund(charged - kept);
        }
    }

    /// Starts a growth of `granules` granules: the budget takes all of them, or none; then as
    /// many granules as the device's cache has ready, up to `granules`, move from it to the end
    /// of `into` under one lock ([`Growth::taken`] says how many), for the caller to map with
    /// [`Growth::map_cached`] before it creates any with [`Growth::map_new`].
    #[inline]
    pub(crate) fn grow(
        &self,
        granules: usize,
        into: &mut Vec<B::Phys>,
    ) -> Result<Growth<'_, 'b, 'id, B>, CommitFailure> {
        let g = self.device().granularity();
        self.charge_budget(granules * g)?;
        let taken = self.device().cache_take(granules, into);
        Ok(Growth {
            binding: self,
            charged: granules,
            taken,
            from_cache: 0,
            mapped: 0,
        })
    }

    /// Ready to give back up to `expected` granules (see [`GiveBack`]).
    #[inline]
    pub(crate) fn give_back(&self, expected: usize) -> GiveBack<'_, 'b, 'id, B> {
        GiveBack {
            device: self.device(),
            binding: self,
            room: self.device().cache_admit(expected),
            given: 0,
            unmapped: 0,
            quarantined: 0,
        }
    }
}

/// A region's growth in progress: its granules' budget taken at once, and the granules the
/// device's cache had ready taken from it at once; each granule mapped — those from the cache
/// first, then created ones; the cached and mapped axes moved once, when it
/// [`finish`](Self::finish)es, for what was mapped. Cached granules it did not map go back to
/// the cache ([`put_back`](Self::put_back)); granules it did not map leave the budget.
#[must_use = "a growth settles its axes when it finishes"]
pub(crate) struct Growth<'a, 'b, 'id, B: Backend> {
    binding: &'a Binding<'b, 'id, B>,
    /// Granules charged to the budget.
    charged: usize,
    /// Granules taken from the cache.
    taken: usize,
    /// Granules taken from the cache and mapped.
    from_cache: usize,
    /// Granules mapped.
    mapped: usize,
}

impl<B: Backend> Growth<'_, '_, '_, B> {
    /// Granules taken from the cache when the growth started.
    #[inline]
    pub(crate) fn taken(&self) -> usize {
        self.taken
    }

    /// Maps `phys`, a granule taken from the cache, read-write at `addr`. On failure it is
    /// still the caller's, to [`put_back`](Self::put_back).
    #[inline]
    pub(crate) fn map_cached(&mut self, addr: Addr, phys: B::Phys) -> Result<(), BackendError> {
        let device = self.binding.device();
        device
            .backend()
            .map(addr, device.granularity(), phys, Access::ReadWrite)?;
        self.mapped += 1;
        self.from_cache += 1;
        Ok(())
    }

    /// A new granule, created (charged to the device's budget first, trimming the cache if it
    /// stands in the way) and mapped read-write at `addr`. On failure it is released; the
    /// cause, and whether that release failed (the granule then quarantined, still owned).
    #[inline]
    pub(crate) fn map_new(&mut self, addr: Addr) -> Result<B::Phys, (CommitFailure, bool)> {
        let device = self.binding.device();
        let g = device.granularity();
        let phys = self.create().map_err(|cause| (cause, false))?;
        match device.backend().map(addr, g, phys, Access::ReadWrite) {
            Ok(()) => {
                self.mapped += 1;
                Ok(phys)
            }
            Err(e) => {
                let quarantined = device.release_orphan(phys, g).is_err();
                Err((CommitFailure::Backend(e), quarantined))
            }
        }
    }

    /// A new granule, charged to the device's budget first.
    fn create(&self) -> Result<B::Phys, CommitFailure> {
        let device = self.binding.device();
        let g = device.granularity();
        device.charge_owned_or_trim(g)?;
        device.backend().create(g).map_err(|e| {
            device.refund(Axis::Owned, g);
            CommitFailure::Backend(e)
        })
    }

    /// Puts the granules of `from[at..]` — taken from the cache, not mapped — back there, under
    /// one lock.
    #[cold]
    pub(crate) fn put_back(&self, from: &mut Vec<B::Phys>, at: usize) {
        self.binding.device().cache_put(&from[at..]);
        from.truncate(at);
    }

    /// Granules taken from the cache and mapped so far.
    #[inline]
    pub(crate) fn cached(&self) -> usize {
        self.from_cache
    }

    /// Settles the growth: the granules mapped from the cache leave its axis, those mapped are
    /// charged as mapped, and the budget of those not mapped goes back.
    #[inline]
    pub(crate) fn finish(self) {
        let device = self.binding.device();
        let g = device.granularity();
        device.cache_taken(self.from_cache);
        if self.mapped > 0 {
            device.charge(Axis::Mapped, self.mapped * g);
        }
        if self.charged > self.mapped {
            self.binding.refund((self.charged - self.mapped) * g);
        }
    }
}

/// Gives granules that a region no longer maps, and that no work can still use, back to the
/// device: to its cache while the cap allows, else released (a failure is quarantined). They
/// leave the binding's budget, and their mappings the mapped axis, all at once when it
/// [`finish`](Self::finish)es.
#[must_use = "a give-back settles its axes when it finishes"]
pub(crate) struct GiveBack<'a, 'b, 'id, B: Backend> {
    device: &'b Device<'id, B>,
    binding: &'a Binding<'b, 'id, B>,
    /// Room made in the cache and not used yet.
    room: usize,
    /// Granules given back (and so out of the budget at the finish).
    given: usize,
    /// Granules whose mapping went (refunded as mapped at the finish).
    unmapped: usize,
    /// Granules whose release failed, in the device's quarantine.
    quarantined: usize,
}

impl<B: Backend> GiveBack<'_, '_, '_, B> {
    /// Unmaps the granule mapped at `addr`; its mapping leaves the mapped axis at the finish.
    #[inline(always)]
    pub(crate) fn unmap(&mut self, addr: Addr) -> Result<(), BackendError> {
        let device = self.device;
        device.backend().unmap(addr, device.granularity())?;
        self.unmapped += 1;
        Ok(())
    }

    /// `phys`, unmapped and unused, leaves the binding: cached or released.
    #[inline]
    pub(crate) fn give(&mut self, phys: B::Phys) {
        self.give_all(&[phys]);
    }

    /// `granules`, unmapped and unused, leave the binding: as many as the cache has room for
    /// go there under one lock, the others are released.
    #[inline]
    pub(crate) fn give_all(&mut self, granules: &[B::Phys]) {
        let device = self.device;
        self.given += granules.len();
        let cached = granules.len().min(self.room);
        self.room -= cached;
        let (to_cache, to_release) = granules.split_at(cached);
        if !to_cache.is_empty() {
            device.cache_put(to_cache);
        }
        for &phys in to_release {
            if device.release_orphan(phys, device.granularity()).is_err() {
                // Quarantined in the device, still owned.
                self.quarantined += 1;
            }
        }
    }

    /// `len` bytes of `phys`, unmapped and unused but not a granule the cache could hand out
    /// (a suspended allocation's whole mapping), leave the binding: released.
    pub(crate) fn release(&mut self, phys: B::Phys, len: usize) {
        self.quarantined += usize::from(self.binding.discard(phys, len).is_err());
    }

    /// Settles: the given granules leave the budget, the unmapped ones the mapped axis, the
    /// cache room not used goes back; how many granules went to quarantine.
    #[inline]
    pub(crate) fn finish(self) -> usize {
        let device = self.device;
        let g = device.granularity();
        if self.given > 0 {
            self.binding.refund(self.given * g);
        }
        if self.unmapped > 0 {
            device.refund(Axis::Mapped, self.unmapped * g);
        }
        device.cache_taken(self.room);
        self.quarantined
    }
}
