//! The records of what one transition of a token has made so far, kept in the shape a token
//! holds it: a [`Build`] (the budget it took, the memory it created, what of it is mapped) and a
//! [`Borrow`] (a reference taken on a prefix's memory, and what of it is mapped). Undoing the
//! transition is the ordinary teardown of the record (the code every release goes through);
//! finishing it hands what it made to the token, charged as it is.

use super::Device;
use super::binding::Binding;
use crate::backend::{Access, Addr, Backend, BackendError};
use crate::error::{CommitFailure, ReleaseFailure};
use crate::residual::{Granule, Held, Residual, SharedPhys};
use crate::unwind::Guarded;

/// The pieces a [`Build`] made, in the order it made them.
pub(crate) type Pieces<P> = [Option<Granule<P>>; 2];

/// What a transition made so far, for one token at `addr` (see the module docs).
#[must_use = "a build is finished or undone; dropping it refunds only its unused charge"]
pub(crate) struct Build<'a, 'b, 'id, B: Backend> {
    binding: &'a Binding<'b, 'id, B>,
    addr: Addr,
    /// Bytes charged to the budgets and not made into memory yet.
    charged: usize,
    /// Memory made here (owned, charged), each piece at its offset into the range and mapped
    /// there or not. At most two: a prefix's body and boundary.
    pieces: Pieces<B::Phys>,
}

/// A mapping of a prefix's memory being made into the range at `addr`: the reference taken on
/// the memory, and the bytes mapped so far from the start of the range.
#[must_use = "a borrow is finished or undone"]
pub(crate) struct Borrow<'a, 'b, 'id, B: Backend> {
    binding: &'a Binding<'b, 'id, B>,
    addr: Addr,
    mapped: usize,
    shared: SharedPhys<B::Phys>,
}

/// How undoing a [`Build`] went.
pub(crate) enum Undone<P> {
    /// Everything it made is gone.
    Clean,
    /// Something it made could not be given back, nothing of it mapped: it is in the device's
    /// quarantine, still owned; the failure.
    Quarantined(ReleaseFailure),
    /// A mapping it made could not be undone: what is left (VA not included) goes into the
    /// token's quarantined remains, still charged to the binding; the failure.
    Stuck(Held<P>, ReleaseFailure),
}

impl<P> Undone<P> {
    /// The rollback's outcome, for an undo that cannot leave anything stuck in the range
    /// (nothing it made was mapped yet).
    pub(crate) fn rollback(self) -> Result<(), ReleaseFailure> {
        debug_assert!(
            !matches!(self, Self::Stuck(..)),
            "stuck remains go with the token's"
        );
        match self {
            Self::Clean => Ok(()),
            Self::Quarantined(failure) | Self::Stuck(_, failure) => Err(failure),
        }
    }
}

impl<'b, 'id, B: Backend> Binding<'b, 'id, B> {
    /// An empty record for a transition of the token at `addr`.
    #[inline]
    pub(crate) fn build(&self, addr: Addr) -> Build<'_, 'b, 'id, B> {
        Build {
            binding: self,
            addr,
            charged: 0,
            pieces: [None, None],
        }
    }

    /// A record for a mapping of the prefix whose memory `prefix` references into the range
    /// at `addr`: one more reference is taken for it.
    #[inline]
    pub(crate) fn borrow(
        &self,
        addr: Addr,
        prefix: &SharedPhys<B::Phys>,
    ) -> Borrow<'_, 'b, 'id, B> {
        Borrow {
            binding: self,
            addr,
            mapped: 0,
            shared: self.device().shared().another(prefix),
        }
    }
}

impl<B: Backend> Borrow<'_, '_, '_, B> {
    /// Maps `len` bytes of the shared memory's `phys` right after what is mapped so far, with
    /// `access`.
    #[inline]
    pub(crate) fn map(
        &mut self,
        len: usize,
        phys: B::Phys,
        access: Access,
    ) -> Result<(), BackendError> {
        let device = self.binding.device();
        device.map(self.addr + self.mapped, len, phys, access)?;
        self.mapped += len;
        Ok(())
    }

    /// The reference, for the mapping that keeps it.
    #[inline]
    pub(crate) fn finish(self) -> SharedPhys<B::Phys> {
        self.shared
    }

    /// Undoes the mapping: the ordinary teardown (unmap, give the reference back). With
    /// nothing mapped yet, the reference goes back without a backend call (so even once the
    /// context is lost).
    #[cold]
    pub(crate) fn undo(self) -> Undone<B::Phys> {
        if self.mapped == 0 {
            self.binding.device().unshare(self.shared);
            return Undone::Clean;
        }
        let held = Held {
            reserved: false,
            shared: Some(self.shared),
            ..Held::mapped(self.mapped)
        };
        let mut stuck = None;
        match tear_down(self.binding, self.addr, held, &mut stuck) {
            Ok(()) => Undone::Clean,
            Err(failure) => match stuck {
                Some(stuck) => Undone::Stuck(stuck, failure),
                None => Undone::Quarantined(failure),
            },
        }
    }
}

impl<'a, 'b, 'id, B: Backend> Build<'a, 'b, 'id, B> {
    fn device(&self) -> &'a Device<'id, B> {
        self.binding.device()
    }

    /// Takes `len` more bytes of the budgets (the binding's and the device's), for memory about
    /// to be created; or says which budget refuses (nothing taken).
    #[inline]
    pub(crate) fn budget(&mut self, len: usize) -> Result<(), CommitFailure> {
        self.binding.charge(len)?;
        self.charged += len;
        Ok(())
    }

    /// Creates `len` bytes of the charge with `create`, for offset `offset` of the range.
    #[inline]
    pub(crate) fn create(
        &mut self,
        offset: usize,
        len: usize,
        create: impl FnOnce(&Guarded<B>, usize) -> Result<B::Phys, BackendError>,
    ) -> Result<B::Phys, BackendError> {
        debug_assert!(len <= self.charged, "memory is charged before it is made");
        debug_assert!(self.pieces[1].is_none(), "a build makes at most two pieces");
        let slot = usize::from(self.pieces[0].is_some());
        let phys = create(self.device().backend(), len)?;
        self.charged -= len;
        self.pieces[slot] = Some(Granule {
            offset,
            len,
            phys,
            mapped: false,
        });
        Ok(phys)
    }

    /// Maps the `nth` piece made (0: the first) at its offset, with `access`.
    #[inline]
    pub(crate) fn map(&mut self, nth: usize, access: Access) -> Result<(), BackendError> {
        let (addr, device) = (self.addr, self.device());
        let piece = self.pieces[nth].as_mut().expect("a piece made");
        device.map(addr + piece.offset, piece.len, piece.phys, access)?;
        piece.mapped = true;
        Ok(())
    }

    /// The token took what was made already (as `create` returned it): the build has nothing
    /// left to charge or undo.
    #[inline]
    pub(crate) fn keep(self) {
        debug_assert_eq!(self.charged, 0, "a kept build made all it charged");
    }

    /// What was made, for the token that keeps it: the pieces in the order they were made.
    /// Their charges stay with them.
    #[inline]
    pub(crate) fn finish(mut self) -> Pieces<B::Phys> {
        debug_assert_eq!(self.charged, 0, "a finished build made all it charged");
        std::mem::take(&mut self.pieces)
    }

    /// Undoes what was made: the ordinary teardown of each piece on its own (unmap, release),
    /// each refunded as it goes, and the budget not made into memory refunded (as the build
    /// drops). A piece that cannot be given back is quarantined, or — if it is still mapped in
    /// the range — handed back to go with the token's remains; the first failure is said.
    #[cold]
    pub(crate) fn undo(mut self) -> Undone<B::Phys> {
        let mut stuck: Option<Held<B::Phys>> = None;
        let mut first = None;
        for piece in std::mem::take(&mut self.pieces).into_iter().flatten() {
            let part = Held {
                reserved: false,
                granules: vec![piece],
                ..Held::mapped(0)
            };
            let Err(failure) = tear_down(self.binding, self.addr, part, &mut stuck) else {
                continue;
            };
            first.get_or_insert(failure);
        }
        match (first, stuck) {
            (None, _) => Undone::Clean,
            (Some(failure), Some(stuck)) => Undone::Stuck(stuck, failure),
            (Some(failure), None) => Undone::Quarantined(failure),
        }
    }
}

/// Tears down one part of a record made for the range at `addr` through `binding`: refunded as
/// far as it goes; what is left joins `stuck` while still mapped in the range, else goes to the
/// device's quarantine (owned, out of the budget).
fn tear_down<B: Backend>(
    binding: &Binding<'_, '_, B>,
    addr: Addr,
    held: Held<B::Phys>,
    stuck: &mut Option<Held<B::Phys>>,
) -> Result<(), ReleaseFailure> {
    let device = binding.device();
    let mut part = Residual {
        generation: device.next_generation(),
        addr,
        len: 0,
        held,
    };
    let owned = part.owned_bytes();
    let result = device.teardown(&mut part);
    // What went leaves the budget; what is left stays charged with it.
    let gone = owned - part.owned_bytes();
    if gone > 0 {
        binding.refund(gone);
    }
    if result.is_err() {
        if part.mapped_bytes() > 0 {
            let left = part.held;
            match stuck {
                None => *stuck = Some(left),
                Some(s) => s.granules.extend(left.granules),
            }
        } else {
            // Mapped nowhere: the device keeps it, owned, out of the budget.
            binding.refund(part.owned_bytes());
            device.quarantine(part);
        }
    }
    result
}

impl<B: Backend> Drop for Build<'_, '_, '_, B> {
    #[inline]
    fn drop(&mut self) {
        if self.charged > 0 {
            self.binding.uncharge(self.charged);
        }
    }
}
