//! Byte accounting on two axes — **mapped** and **owned** — plus reserved VA and the count of
//! quarantined residuals. Each charge is refunded exactly once: the typed layer refunds an axis
//! only when the corresponding part of a residual goes from held to gone, and a refund of more
//! than was charged panics, because it can only be a double refund.

use std::sync::atomic::{AtomicU64, Ordering};

/// One ledger axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Axis {
    Reserved,
    Mapped,
    Owned,
    Quarantined,
}

/// A device's ledger.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    reserved: AtomicU64,
    mapped: AtomicU64,
    owned: AtomicU64,
    quarantined: AtomicU64,
}

/// The ledger at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// Bytes of VA reserved (live tokens, quarantined residuals, deferred releases).
    pub reserved_bytes: u64,
    /// Bytes mapped: refunded when a mapping really goes away.
    pub mapped_bytes: u64,
    /// Bytes of physical memory owned: refunded only when the backend confirms the release.
    pub owned_bytes: u64,
    /// Residuals in quarantine (as tokens or in the device's quarantine), not yet released.
    pub quarantined: u64,
}

impl LedgerSnapshot {
    /// True when nothing is charged and nothing is quarantined.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

impl Ledger {
    fn axis(&self, axis: Axis) -> &AtomicU64 {
        match axis {
            Axis::Reserved => &self.reserved,
            Axis::Mapped => &self.mapped,
            Axis::Owned => &self.owned,
            Axis::Quarantined => &self.quarantined,
        }
    }

    pub(crate) fn charge(&self, axis: Axis, n: u64) {
        self.axis(axis).fetch_add(n, Ordering::Relaxed);
    }

    /// Charges `n` on `axis` if the total stays within `limit`; else returns what is charged.
    pub(crate) fn try_charge(&self, axis: Axis, n: u64, limit: u64) -> Result<(), u64> {
        self.axis(axis)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                v.checked_add(n).filter(|&total| total <= limit)
            })
            .map(drop)
    }

    /// # Panics
    ///
    /// If `n` exceeds what is charged on `axis`: that is a double refund, a bug in this crate.
    pub(crate) fn refund(&self, axis: Axis, n: u64) {
        let counter = self.axis(axis);
        if let Err(held) =
            counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(n))
        {
            panic!("ledger: refund of {n} on {axis:?} exceeds the {held} charged (double refund)");
        }
    }

    pub(crate) fn snapshot(&self) -> LedgerSnapshot {
        LedgerSnapshot {
            reserved_bytes: self.reserved.load(Ordering::Relaxed),
            mapped_bytes: self.mapped.load(Ordering::Relaxed),
            owned_bytes: self.owned.load(Ordering::Relaxed),
            quarantined: self.quarantined.load(Ordering::Relaxed),
        }
    }
}
