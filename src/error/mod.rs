//! Why a transition failed: one cause type per transition, and [`TransitionError`], the one
//! shape of every error that hands a token back (the token and its cause).
//!
//! The rules every error of the typed layer follows (this module's, and the cross-process
//! [`ImportError`](crate::sharing::ImportError)); the backend layer's own error, [`BackendError`], is
//! a plain record of one call (its [`Cause`](crate::backend::Cause) a kind, not an error held
//! inside), and the wire's [`WireError`](crate::sharing::WireError) wraps `std::io::Error` as std
//! does:
//!
//! - **Names.** A type a public function returns in `Err` is named `…Error`; the cause a
//!   [`TransitionError`] carries beside the token it hands back is named `…Failure`.
//! - **Boxes.** Every error held inside a cause or an error is boxed — a [`BackendError`], a
//!   nested cause — so each `Err` stays a few words, small enough to return beside its token;
//!   with exceptions, measured: [`CommitFailure::Backend`] holds its `BackendError` by
//!   value, since boxing it there makes every commit's success path dearer (9 instructions
//!   more per reserve-commit-release cycle, callgrind, `examples/granule_cycle.rs`), and a
//!   commit's `Err` stays within clippy's `result_large_err` bound without it;
//!   [`CommitFailure::Unsupported`] and [`GrowError::Unsupported`] do the same, a refusal
//!   before anything was done being no larger.
//! - **Messages.** Each message says what failed, with numbers, and what to do; a cause that
//!   has a cause of its own returns it from [`source`](std::error::Error::source) instead of
//!   printing it, so no cause is printed twice along a chain.
//! - **A lost context** is said one way: in the [`BackendError`] of the variant that would
//!   have made (or made) the call — [`Cause::ContextLost`](crate::backend::Cause::ContextLost)
//!   when no call was made, the driver's sticky error when the call found the loss — and
//!   every cause a transition hands back, and every error it returns, answers
//!   [`Failure::is_context_lost`], which finds it along the chain. No variant of its own says
//!   it.

use crate::backend::BackendError;

mod transition;

pub use transition::{Error, Returned, TransitionError, is_context_lost};

/// Why a reservation was refused. Nothing was reserved or charged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// A zero-length request.
    #[error(
        "cannot reserve 0 bytes: ask for at least 1 (lengths round up to the granularity, {granularity} bytes)"
    )]
    ZeroLength {
        /// The device's granularity.
        granularity: usize,
    },
    /// The length overflows when rounded up to the granularity.
    #[error(
        "cannot reserve {requested} bytes: rounding up to the granularity ({granularity} bytes) overflows usize"
    )]
    Overflow {
        /// Bytes asked for.
        requested: usize,
        /// The device's granularity.
        granularity: usize,
    },
    /// The length exceeds the largest reservation the backend allows.
    #[error(
        "cannot reserve {requested} bytes ({rounded} rounded to the granularity): the largest reservation is {limit} bytes"
    )]
    TooLarge {
        /// Bytes asked for.
        requested: usize,
        /// Rounded up to the granularity.
        rounded: usize,
        /// The largest reservation allowed.
        limit: usize,
    },
    /// The backend failed.
    #[error("the backend could not reserve the range; nothing was reserved")]
    Backend(#[source] Box<BackendError>),
}

/// Why a commit failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommitFailure {
    /// The binding's budget would be exceeded.
    #[error(
        "{requested} bytes exceed the binding's budget: {used} of {limit} bytes already owned; release memory or bind with a larger budget"
    )]
    Budget {
        /// Bytes needed.
        requested: u64,
        /// Bytes the binding already owned.
        used: u64,
        /// The budget's cap.
        limit: u64,
    },
    /// The device's budget would be exceeded.
    #[error(
        "{requested} bytes exceed the device's budget: {used} of {limit} bytes already owned on the device; release memory or open the device with a larger budget"
    )]
    DeviceBudget {
        /// Bytes needed.
        requested: u64,
        /// Bytes the device already owned.
        used: u64,
        /// The device budget's cap.
        limit: u64,
    },
    /// The request exceeds the device's physical capacity.
    #[error("{requested} bytes exceed the device's physical capacity of {capacity} bytes")]
    Capacity {
        /// Bytes needed.
        requested: u64,
        /// The device's physical capacity.
        capacity: u64,
    },
    /// A backend call failed; everything done before it was undone.
    #[error(
        "a backend call failed; everything done before it was undone, nothing stays mapped or charged"
    )]
    Backend(#[source] BackendError),
    /// The device's mechanism cannot do this at all (its source is a
    /// [`Cause::Unsupported`](crate::backend::Cause::Unsupported) naming the capability, as
    /// [`Device::lacks`](crate::Device::lacks) says up front). Nothing was called or charged.
    #[error("the device's mechanism cannot do this; nothing was done")]
    Unsupported(#[source] BackendError),
    /// A backend call failed, and releasing the physical memory created for it failed too.
    #[error(
        "a backend call failed, and releasing the physical memory created for it failed too ({rollback}): that memory stays owned (and charged) in the device quarantine, until Device::retry_quarantine succeeds or, once the context is lost, Device::discharge_all"
    )]
    RollbackFailed {
        /// The failure that stopped the transition.
        #[source]
        error: Box<BackendError>,
        /// The failure of the rollback.
        rollback: Box<ReleaseFailure>,
    },
    /// A backend call failed, and unmapping what was already mapped failed too (a prefix,
    /// whose memory is mapped in two calls): the reservation, what is mapped in it and its
    /// physical memory are quarantined.
    #[error(
        "a backend call failed, and unmapping the part already mapped failed too ({rollback}): that part, its physical memory and the reservation are quarantined"
    )]
    UnmapFailed {
        /// The failure that stopped the transition.
        #[source]
        error: Box<BackendError>,
        /// The failed unmap.
        rollback: Box<BackendError>,
    },
}

impl CommitFailure {
    /// Why a transition stopped at `error`, given how undoing the memory it created went.
    pub(crate) fn undone(error: BackendError, rollback: Result<(), ReleaseFailure>) -> Self {
        match rollback {
            Ok(()) => Self::Backend(error),
            Err(rollback) => Self::RollbackFailed {
                error: Box::new(error),
                rollback: Box::new(rollback),
            },
        }
    }
}

/// Why a prefix could not be mapped into a reservation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShareFailure {
    /// The reservation's length differs from the prefix's.
    #[error(
        "a prefix of {prefix} bytes cannot be mapped into a reservation of {reservation} bytes: reserve exactly the prefix's length"
    )]
    SizeMismatch {
        /// The reservation's length.
        reservation: usize,
        /// The prefix's length.
        prefix: usize,
    },
    /// A backend call failed; everything done before it was undone.
    #[error("a backend call failed; everything done before it was undone, nothing stays mapped")]
    Backend(#[source] Box<BackendError>),
    /// A backend call failed, and unmapping what was already mapped failed too.
    #[error(
        "a backend call failed, and unmapping the part already mapped failed too ({rollback}): that part is quarantined"
    )]
    RollbackFailed {
        /// The failure that stopped the mapping.
        #[source]
        error: Box<BackendError>,
        /// The failed unmap.
        rollback: Box<BackendError>,
    },
}

/// Why copy-on-write of a sharer's boundary granule failed.
///
/// (Boxed second errors keep a [`CowError`](crate::sharing::CowError) and a
/// [`ShareError`](crate::sharing::ShareError) small enough to return by value.)
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CowFailure {
    /// The private granule could not be made (a budget refused it, or a backend call failed);
    /// the mapping is unchanged and still shared.
    #[error("the private copy of the boundary granule could not be made; the mapping is unchanged")]
    Private(#[source] Box<CommitFailure>),
    /// Work that may still read the mapping has not finished (its fence is pending), so the
    /// boundary cannot be unmapped yet; nothing was done.
    #[error(
        "work that may still read the mapping has not finished, so its boundary granule cannot be swapped yet; nothing was done: try again once it has (see Device::poll)"
    )]
    Pending,
    /// Unmapping the shared boundary granule failed: whether it is still mapped is unknown.
    #[error(
        "unmapping the shared boundary granule failed, so whether it is still mapped is unknown: the mapping's remains are quarantined"
    )]
    Unmap(#[source] Box<BackendError>),
    /// Mapping the private copy failed, and mapping the shared granule back failed too.
    #[error(
        "mapping the private copy failed, and mapping the shared granule back failed too ({restore}): the mapping's remains are quarantined"
    )]
    Remap {
        /// The failed map of the private copy.
        #[source]
        error: Box<BackendError>,
        /// The failed map of the shared granule back.
        restore: Box<BackendError>,
    },
}

/// Why giving memory back failed (or could not finish yet).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseFailure {
    /// The fence of the work that may still use the memory has not completed: nothing was done.
    #[error(
        "work that may use the memory has not finished (its fence is pending); nothing was done: complete it later"
    )]
    Pending,
    /// A wait for that fence cannot progress (the backend cannot wait for it — a stream it
    /// covers captures, so its work does not run; peer work is declared; or the backend has
    /// no way to wait): nothing was done, and nothing blocked. Complete it once that is over.
    #[error(
        "work that may use the memory cannot be waited for now (a stream captures, peer work is declared, or the backend cannot wait); nothing was done: complete it later"
    )]
    Stuck,
    /// A backend call failed, or was refused: with
    /// [`Cause::ContextLost`](crate::backend::Cause::ContextLost) no call was made
    /// (discharge the token with the proof from `Device::confirm_context_lost`).
    #[error("a backend call to give the memory back failed; what it holds is kept")]
    Backend(#[source] Box<BackendError>),
}

impl From<BackendError> for ReleaseFailure {
    fn from(e: BackendError) -> Self {
        Self::Backend(Box::new(e))
    }
}

impl From<BackendError> for ReserveError {
    fn from(e: BackendError) -> Self {
        Self::Backend(Box::new(e))
    }
}

/// Why memory could not be lent as elements of a type `T` (a typed view): nothing was lent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// The bytes are not a whole number of `T`s (or `T` is zero-sized).
    #[error(
        "{bytes} bytes do not hold a whole number of {size}-byte elements: view a type whose size divides the length (a zero-sized type never does)"
    )]
    Length {
        /// The length of the memory, in bytes.
        bytes: usize,
        /// The size of `T`, in bytes.
        size: usize,
    },
    /// The memory does not start at a multiple of `T`'s alignment.
    #[error("address {addr:#x} is not aligned to {align} bytes, the alignment of the element type")]
    Alignment {
        /// Where the memory starts.
        addr: usize,
        /// The alignment of `T`.
        align: usize,
    },
    /// The stream cannot be covered by the device's fences (it belongs to another context), so
    /// the memory's release could not wait for work on it: no view is lent for it.
    #[error(
        "the view's stream cannot be covered by the device's fences: use a stream of the device's context"
    )]
    Stream(#[source] Box<BackendError>),
}

/// Why committed memory (an allocation or a region) could not be suspended.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SuspendFailure {
    /// Work that may still use the memory has not finished (its fence is pending), so it cannot
    /// be unmapped yet (`cuMemUnmap` does not wait for it). Nothing was done.
    #[error(
        "work that may still use the memory has not finished, so it cannot be unmapped yet; nothing was done: try again once that work has finished"
    )]
    Pending,
    /// A backend call was refused: with
    /// [`Cause::ContextLost`](crate::backend::Cause::ContextLost), no call was made. Nothing was
    /// done.
    #[error("the memory could not be suspended; nothing was done")]
    Backend(#[source] Box<BackendError>),
    /// Saving the bytes to the host failed. Nothing else was done: the memory is as it was.
    #[error("saving the bytes to the host failed; nothing else was done")]
    Save(#[source] Box<BackendError>),
}

/// Why suspended memory could not be resumed. Whatever the cause, the token is still suspended,
/// with its addresses and its saved bytes, and nothing new is charged — unless undoing a
/// half-done resume failed too, and its remains are quarantined.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResumeFailure {
    /// The allocation's memory could not be committed again.
    #[error("its memory could not be committed again; nothing stays mapped or charged")]
    Commit(#[source] Box<CommitFailure>),
    /// The region could not grow back to its suspended length (every granule this call mapped
    /// was given back).
    #[error("the region could not grow back to its suspended length")]
    Grow(#[source] Box<GrowError>),
    /// Restoring the saved bytes failed; the memory mapped for them was given back.
    #[error("restoring the saved bytes failed; the memory mapped for them was given back")]
    Restore(#[source] Box<BackendError>),
    /// Memory withheld after an earlier failed unmap could not be reclaimed first, so nothing
    /// was mapped; the token is still suspended with its saved bytes.
    #[error(
        "memory withheld after an earlier failed unmap could not be reclaimed; nothing was mapped"
    )]
    Withheld(#[source] Box<ShrinkError>),
    /// Restoring the saved bytes failed, and unmapping the memory mapped for them failed too:
    /// the token is still suspended with its saved bytes, and that memory stays withheld in
    /// it, charged, until a reclaim (or the next resume) frees it.
    #[error(
        "restoring the saved bytes failed, and unmapping the memory mapped for them failed too ({rollback}): that memory stays withheld in the suspended token until a reclaim frees it"
    )]
    RestoreUndo {
        /// The failed restore.
        #[source]
        error: Box<BackendError>,
        /// The failed unmap.
        rollback: Box<BackendError>,
    },
}

/// Why an elastic region could not grow. Whatever the cause, the region comes back with the
/// committed length it had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GrowError {
    /// The growth does not fit: past the reserved range, or over granules withheld after a
    /// failed unmap (see [`Region::reclaim`](crate::region::Region::reclaim)). Nothing was done.
    #[error(
        "cannot grow by {requested} granules: {committed} are committed and the region has room for {room} (its reserved length, or up to its first withheld granule); shrink first, reclaim withheld granules, or reserve a larger region"
    )]
    Full {
        /// Granules asked for.
        requested: usize,
        /// Granules committed.
        committed: usize,
        /// Granules the region can hold now.
        room: usize,
    },
    /// The device's mechanism cannot grow a region in place (it lacks
    /// [`Ability::MapAtReservedAddress`](crate::backend::Ability::MapAtReservedAddress): its
    /// source names it). Nothing was done.
    #[error(
        "the region cannot grow: the device's mechanism cannot map at a reserved address; nothing was done"
    )]
    Unsupported(#[source] BackendError),
    /// A budget, the capacity or a backend call refused granule `at` (0-based, of this call):
    /// every granule this call mapped was unmapped again and given back where it came from
    /// (the cache, or released), and nothing stays charged to the binding.
    #[error(
        "growing stopped at granule {at} of this call (from 0): every granule this call mapped was unmapped and given back, the region is unchanged{}",
        quarantine_note(*quarantined)
    )]
    Undone {
        /// The granule (of this call, from 0) that could not be added.
        at: usize,
        /// Why it could not.
        #[source]
        cause: Box<CommitFailure>,
        /// Granules whose release failed while undoing: in the device's quarantine, still owned.
        quarantined: usize,
    },
    /// As [`Undone`](Self::Undone), but unmapping some of the granules this call mapped failed
    /// too: those stay owned, charged and withheld in the region, which cannot grow over them
    /// until [`Region::reclaim`](crate::region::Region::reclaim) frees them.
    #[error(
        "growing stopped at granule {at} of this call (from 0), and unmapping {granules} of the granules it had mapped failed too ({rollback}): they stay owned and withheld in the region, which cannot grow over them until Region::reclaim frees them; the committed length is unchanged (a granule whose release failed while undoing is in the device quarantine, counted on the ledger)"
    )]
    Withheld {
        /// The granule (of this call, from 0) that could not be added.
        at: usize,
        /// Why it could not.
        #[source]
        cause: Box<CommitFailure>,
        /// Granules left withheld in the region.
        granules: usize,
        /// The (last) failed unmap.
        rollback: Box<BackendError>,
    },
}

/// Why an elastic region could not shrink (or give back its withheld granules). The region
/// stays usable; its committed length says how far it shrank.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShrinkError {
    /// More granules asked for than are committed. Nothing was done.
    #[error("cannot shrink by {requested} granules: only {committed} are committed")]
    TooMany {
        /// Granules asked for.
        requested: usize,
        /// Granules committed.
        committed: usize,
    },
    /// A backend call was refused: with
    /// [`Cause::ContextLost`](crate::backend::Cause::ContextLost), no call was made. Nothing was
    /// done.
    #[error("the region could not shrink; nothing was done")]
    Backend(#[source] Box<BackendError>),
    /// Work that may still use the region's memory has not finished (its fence is pending), so
    /// no granule may be unmapped yet (`cuMemUnmap` does not wait for it). Nothing was done.
    #[error(
        "work that may still use the region has not finished, so it cannot shrink yet; nothing was done: try again once that work has finished"
    )]
    Pending,
    /// Unmapping `granules` granules failed: the committed length shrank as asked, but those
    /// granules stay owned, charged and withheld in the region (it cannot grow over them) until
    /// [`Region::reclaim`](crate::region::Region::reclaim) frees them; the others were given back.
    #[error(
        "unmapping {granules} granules failed: they stay owned, charged and withheld in the region (it cannot grow over them) until Region::reclaim frees them; the other granules were given back"
    )]
    Withheld {
        /// Granules withheld in the region now.
        granules: usize,
        /// The (last) failed unmap.
        #[source]
        error: Box<BackendError>,
    },
}

fn quarantine_note(quarantined: usize) -> String {
    if quarantined == 0 {
        String::new()
    } else {
        format!(
            " ({quarantined} granules whose release failed while undoing are in the device quarantine, still owned: see Device::retry_quarantine)"
        )
    }
}

pub(crate) mod sealed {
    /// Only this crate's causes are [`Failure`](super::Failure)s.
    pub trait Sealed {}
}

/// Why a transition failed (sealed): the cause a [`TransitionError`] carries beside its
/// token, or the error of a transition that keeps its token where it was (a region's
/// [`grow`](crate::region::Region::grow) and [`shrink`](crate::region::Region::shrink), a reservation, an
/// import, an export).
pub trait Failure: std::error::Error + sealed::Sealed + 'static {
    /// What happened, in a few words, for the top of the error's message.
    fn summary(&self) -> &'static str;

    /// Whether it failed because the device's context is lost — the one question to ask of
    /// every failure: it finds the first [`BackendError`] along the chain of
    /// [`source`](std::error::Error::source)s and asks it
    /// ([`BackendError::is_context_lost`]: refused with
    /// [`Cause::ContextLost`](crate::backend::Cause::ContextLost), or the
    /// driver's error that found the loss). What is left can be discharged with the proof
    /// from `Device::confirm_context_lost`.
    fn is_context_lost(&self) -> bool
    where
        Self: Sized,
    {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = next {
            // A boxed one is its own error type: look through the box.
            let backend = e.downcast_ref::<BackendError>();
            if let Some(b) = backend.or_else(|| e.downcast_ref::<Box<BackendError>>().map(|b| &**b))
            {
                return b.is_context_lost();
            }
            next = e.source();
        }
        false
    }
}

impl sealed::Sealed for CommitFailure {}
impl sealed::Sealed for ShareFailure {}
impl sealed::Sealed for CowFailure {}
impl sealed::Sealed for ReleaseFailure {}
impl sealed::Sealed for GrowError {}

impl sealed::Sealed for SuspendFailure {}
impl sealed::Sealed for ShrinkError {}
impl sealed::Sealed for ReserveError {}
impl sealed::Sealed for BackendError {}
impl sealed::Sealed for ViewError {}

impl Failure for ViewError {
    fn summary(&self) -> &'static str {
        "the view could not be made"
    }
}

impl Failure for ShrinkError {
    fn summary(&self) -> &'static str {
        "the region could not shrink"
    }
}

impl Failure for ReserveError {
    fn summary(&self) -> &'static str {
        "the reservation was refused"
    }
}

impl Failure for BackendError {
    fn summary(&self) -> &'static str {
        "a backend call failed"
    }
}
impl sealed::Sealed for ResumeFailure {}

impl Failure for SuspendFailure {
    fn summary(&self) -> &'static str {
        match self {
            Self::Pending => "the memory cannot be suspended yet",
            Self::Backend(_) | Self::Save(_) => "suspending the memory failed",
        }
    }
}

impl Failure for ResumeFailure {
    fn summary(&self) -> &'static str {
        "resuming the memory failed"
    }
}

impl Failure for GrowError {
    fn summary(&self) -> &'static str {
        "the region could not grow"
    }
}

impl Failure for CommitFailure {
    fn summary(&self) -> &'static str {
        "commit failed"
    }
}

impl Failure for ShareFailure {
    fn summary(&self) -> &'static str {
        "mapping the prefix failed"
    }
}

impl Failure for CowFailure {
    fn summary(&self) -> &'static str {
        match self {
            Self::Pending => "copy-on-write of the boundary granule cannot start yet",
            Self::Private(_) | Self::Unmap(_) | Self::Remap { .. } => {
                "copy-on-write of the boundary granule failed"
            }
        }
    }
}

impl Failure for ReleaseFailure {
    fn summary(&self) -> &'static str {
        match self {
            Self::Pending | Self::Stuck => "the release cannot complete yet",
            Self::Backend(_) => "the release failed",
        }
    }
}
