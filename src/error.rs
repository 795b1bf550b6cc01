//! Error types of the typed layer. Fallible transitions hand the token back inside the error.

use crate::allocation::Allocation;
use crate::backend::{Backend, BackendError};
use crate::mapping::PrefixMapping;
use crate::quarantine::Quarantined;
use crate::state::{Releasing, Reserved};
use std::fmt;

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
    #[error("reservation failed, nothing reserved: {0}")]
    Backend(#[from] BackendError),
}

/// Why a commit failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommitFailure {
    /// The binding's budget would be exceeded.
    #[error(
        "commit of {requested} bytes exceeds the binding's budget: {used} of {limit} bytes already owned; release memory or bind with a larger budget"
    )]
    Budget {
        /// Bytes the commit needed.
        requested: u64,
        /// Bytes the binding already owned.
        used: u64,
        /// The budget's cap.
        limit: u64,
    },
    /// The device's budget would be exceeded.
    #[error(
        "commit of {requested} bytes exceeds the device's budget: {used} of {limit} bytes already owned on the device; release memory or open the device with a larger budget"
    )]
    DeviceBudget {
        /// Bytes the commit needed.
        requested: u64,
        /// Bytes the device already owned.
        used: u64,
        /// The device budget's cap.
        limit: u64,
    },
    /// The request exceeds the device's physical capacity.
    #[error(
        "commit of {requested} bytes exceeds the device's physical capacity of {capacity} bytes"
    )]
    Capacity {
        /// Bytes the commit needed.
        requested: u64,
        /// The device's physical capacity.
        capacity: u64,
    },
    /// A backend call failed; everything done before it was undone.
    #[error("{0}; nothing stayed mapped or charged")]
    Backend(BackendError),
    /// A backend call failed, and releasing the physical memory created for the commit failed too.
    #[error(
        "{error}; releasing the physical memory created for it failed too ({rollback}): it stays owned (and charged) in the device quarantine until Device::retry_quarantine succeeds"
    )]
    RollbackFailed {
        /// The failure that stopped the commit.
        error: BackendError,
        /// The failure of the rollback.
        rollback: ReleaseFailure,
    },
}

/// A failed [`commit`](Allocation::commit): the same reserved token, and why.
pub struct CommitError<'b, 'id, B: Backend> {
    /// The reserved token, unchanged.
    pub token: Allocation<'b, 'id, B, Reserved>,
    /// Why the commit failed.
    pub cause: CommitFailure,
}

/// Why a prefix could not be mapped into a reservation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShareFailure {
    /// The reservation's length differs from the prefix's.
    #[error(
        "a prefix of {prefix} bytes cannot be mapped into a reservation of {reservation} bytes: reserve exactly the prefix's size"
    )]
    SizeMismatch {
        /// The reservation's length.
        reservation: usize,
        /// The prefix's length.
        prefix: usize,
    },
    /// A backend call failed; everything done before it was undone.
    #[error("{0}; nothing stayed mapped")]
    Backend(BackendError),
}

/// A failed [`map_prefix`](Allocation::map_prefix).
pub enum ShareError<'b, 'id, B: Backend> {
    /// Nothing changed: the same reservation, and why.
    Refused {
        /// The reservation, unchanged.
        token: Allocation<'b, 'id, B, Reserved>,
        /// Why the share failed.
        cause: ShareFailure,
    },
    /// Undoing a half-made mapping failed: its remains are quarantined.
    Quarantined(QuarantineError<'b, 'id, B>),
}

/// A failed [`diverge`](PrefixMapping::diverge).
pub enum CowError<'b, 'id, B: Backend> {
    /// Nothing changed: the same mapping, and why.
    Refused {
        /// The mapping, unchanged and still shared.
        token: PrefixMapping<'b, 'id, B>,
        /// Why the copy-on-write failed.
        cause: CommitFailure,
    },
    /// The boundary could be neither remapped nor restored: the remains are quarantined.
    Quarantined(QuarantineError<'b, 'id, B>),
}

impl<B: Backend> fmt::Display for ShareError<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused { cause, .. } => {
                write!(f, "{cause} (the reservation is returned in the error)")
            }
            Self::Quarantined(e) => e.fmt(f),
        }
    }
}

impl<B: Backend> fmt::Display for CowError<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused { cause, .. } => write!(
                f,
                "copy-on-write of the boundary granule failed: {cause} (the shared mapping is returned unchanged)"
            ),
            Self::Quarantined(e) => e.fmt(f),
        }
    }
}

/// Why giving memory back failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseFailure {
    /// A backend call failed.
    #[error(transparent)]
    Backend(Box<BackendError>),
    /// The context is gone: no backend call was made.
    #[error(
        "the device's context is gone, so no backend call was made; discharge with the proof from Device::confirm_context_gone"
    )]
    ContextGone,
}

impl From<BackendError> for ReleaseFailure {
    fn from(e: BackendError) -> Self {
        Self::Backend(Box::new(e))
    }
}

/// A failed release: the [`Quarantined`] token holding exactly what is left, and why.
pub struct QuarantineError<'b, 'id, B: Backend> {
    /// What is left, still charged and withheld.
    pub token: Quarantined<'b, 'id, B>,
    /// Why the release stopped.
    pub cause: ReleaseFailure,
}

/// A [`complete`](Allocation::complete) that could not finish.
pub enum CompleteError<'b, 'id, B: Backend> {
    /// The fence has not completed: the same token, to try again later.
    Pending(Allocation<'b, 'id, B, Releasing>),
    /// A backend call failed: what is left is quarantined.
    Failed(QuarantineError<'b, 'id, B>),
}

impl<'b, 'id, B: Backend> CommitError<'b, 'id, B> {
    /// The reserved token, to retry the commit or release it.
    pub fn into_token(self) -> Allocation<'b, 'id, B, Reserved> {
        self.token
    }
}

impl<'b, 'id, B: Backend> QuarantineError<'b, 'id, B> {
    /// The quarantined token, to retry or discharge it.
    pub fn into_token(self) -> Quarantined<'b, 'id, B> {
        self.token
    }
}

impl<B: Backend> fmt::Display for CommitError<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (the reserved token of {} bytes is returned in the error)",
            self.cause,
            self.token.size()
        )
    }
}

impl<B: Backend> fmt::Display for QuarantineError<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.token.residual();
        let (addr, len) = r.range();
        write!(
            f,
            "release of {len} bytes at {addr:#x} failed: {}; quarantined: {} bytes still mapped, \
             {} owned, VA {}; retry the token, or discharge it once the context is gone",
            self.cause,
            r.mapped_bytes(),
            r.owned_bytes(),
            if r.holds_va() { "withheld" } else { "freed" },
        )
    }
}

impl<B: Backend> fmt::Display for CompleteError<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pending(t) => write!(
                f,
                "the release fence of {} bytes has not completed yet; the token is returned: complete it later",
                t.size()
            ),
            Self::Failed(e) => e.fmt(f),
        }
    }
}

macro_rules! debug_as_display {
    ($($t:ident),*) => {$(
        impl<B: Backend> fmt::Debug for $t<'_, '_, B> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($t))
            }
        }
        impl<B: Backend> std::error::Error for $t<'_, '_, B> {}
    )*};
}
debug_as_display!(
    CommitError,
    QuarantineError,
    CompleteError,
    ShareError,
    CowError
);
