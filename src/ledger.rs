//! Byte accounting: the device's ledger on its axes — **reserved**, **mapped** and **owned**
//! bytes, the part of the owned bytes held in the device's granule cache (**cached**), and the
//! count of quarantined residuals — and the [`Budget`]s that cap owned bytes.
//! Each charge is refunded exactly once: the typed layer refunds an axis only when the
//! corresponding part of a residual goes from held to gone, and a refund of more than was
//! charged panics, because it can only be a double refund.

use crate::sync::{AtomicU64, Ordering};

/// A cap on the physical bytes a binding's (or a device's) tokens may own at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget(u64);

impl Budget {
    /// No cap beyond the device's physical capacity.
    pub fn unlimited() -> Self {
        Self(u64::MAX)
    }

    /// At most `limit` bytes owned at once.
    pub fn bytes(limit: u64) -> Self {
        Self(limit)
    }

    /// The cap in bytes (`u64::MAX` when unlimited).
    pub fn limit(self) -> u64 {
        self.0
    }
}

/// Adds `n` to `counter` if the total stays within `limit`; else returns what it holds.
#[inline]
pub(crate) fn try_add(counter: &AtomicU64, n: u64, limit: u64) -> Result<(), u64> {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            v.checked_add(n).filter(|&total| total <= limit)
        })
        .map(drop)
}

/// Adds as many `unit`s to `counter` as fit under `limit`, up to `n`; returns how many.
#[inline]
pub(crate) fn add_up_to(counter: &AtomicU64, unit: u64, n: u64, limit: u64) -> u64 {
    let mut taken = 0;
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        taken = (limit.saturating_sub(v) / unit).min(n);
        (taken > 0).then(|| v + taken * unit)
    });
    taken
}

/// Takes `n` from `counter`; returns what it held if that is less than `n` (then `counter`
/// is as it was, once the failed take is put back: only a refund bug gets there).
#[inline]
pub(crate) fn try_sub(counter: &AtomicU64, n: u64) -> Result<(), u64> {
    // One subtraction, not a compare-and-swap loop: a refund never needs a retry.
    let held = counter.fetch_sub(n, Ordering::Relaxed);
    if held < n {
        return Err(put_back(counter, n, held));
    }
    Ok(())
}

/// Undoes a take of `n` from `counter` that found `held`; returns `held`.
#[cold]
fn put_back(counter: &AtomicU64, n: u64, held: u64) -> u64 {
    counter.fetch_add(n, Ordering::Relaxed);
    held
}

/// A refund of `n` on `axis` found only `held` charged.
#[cold]
#[inline(never)]
fn double_refund(axis: Axis, n: u64, held: u64) -> ! {
    panic!("ledger: refund of {n} on {axis:?} exceeds the {held} charged (double refund)");
}

/// One ledger axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Axis {
    Reserved,
    Mapped,
    Owned,
    Cached,
    Tail,
    Quarantined,
}

/// A device's ledger.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    reserved: AtomicU64,
    mapped: AtomicU64,
    owned: AtomicU64,
    cached: AtomicU64,
    tail: AtomicU64,
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
    /// Of the owned bytes, those in the device's cache of physical granules: owned, mapped
    /// nowhere, reused by the next growth of an elastic region (see
    /// [`Device::trim_cache`](crate::Device::trim_cache)).
    pub cached_bytes: u64,
    /// Of the owned bytes, those in the mapped tails of elastic regions: granules a shrink kept
    /// mapped past a region's committed end, owned by the region and charged to its binding,
    /// lent to nothing, taken back by its next growth with no backend call (see
    /// [`Region::set_tail_cap`](crate::region::Region::set_tail_cap) and
    /// [`Device::set_tail_cap`](crate::Device::set_tail_cap)).
    pub tail_bytes: u64,
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
    #[inline]
    fn axis(&self, axis: Axis) -> &AtomicU64 {
        match axis {
            Axis::Reserved => &self.reserved,
            Axis::Mapped => &self.mapped,
            Axis::Owned => &self.owned,
            Axis::Cached => &self.cached,
            Axis::Tail => &self.tail,
            Axis::Quarantined => &self.quarantined,
        }
    }

    #[inline]
    pub(crate) fn charge(&self, axis: Axis, n: u64) {
        self.axis(axis).fetch_add(n, Ordering::Relaxed);
    }

    /// Charges as many `unit`s on `axis` as fit under `limit`, up to `n`; returns how many.
    #[inline]
    pub(crate) fn charge_up_to(&self, axis: Axis, unit: u64, n: u64, limit: u64) -> u64 {
        add_up_to(self.axis(axis), unit, n, limit)
    }

    /// Charges `n` on `axis` if the total stays within `limit`; else returns what is charged.
    pub(crate) fn try_charge(&self, axis: Axis, n: u64, limit: u64) -> Result<(), u64> {
        try_add(self.axis(axis), n, limit)
    }

    /// # Panics
    ///
    /// If `n` exceeds what is charged on `axis`: that is a double refund, a bug in this crate.
    #[inline]
    pub(crate) fn refund(&self, axis: Axis, n: u64) {
        if let Err(held) = try_sub(self.axis(axis), n) {
            double_refund(axis, n, held);
        }
    }

    pub(crate) fn snapshot(&self) -> LedgerSnapshot {
        LedgerSnapshot {
            reserved_bytes: self.reserved.load(Ordering::Relaxed),
            mapped_bytes: self.mapped.load(Ordering::Relaxed),
            owned_bytes: self.owned.load(Ordering::Relaxed),
            cached_bytes: self.cached.load(Ordering::Relaxed),
            tail_bytes: self.tail.load(Ordering::Relaxed),
            quarantined: self.quarantined.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_are_independent_and_refunds_restore_zero() {
        let ledger = Ledger::default();
        ledger.charge(Axis::Reserved, 8192);
        ledger.charge(Axis::Mapped, 4096);
        ledger.charge(Axis::Owned, 4096);
        ledger.charge(Axis::Quarantined, 1);
        let s = ledger.snapshot();
        assert_eq!(
            (
                s.reserved_bytes,
                s.mapped_bytes,
                s.owned_bytes,
                s.quarantined
            ),
            (8192, 4096, 4096, 1)
        );
        ledger.refund(Axis::Mapped, 4096);
        assert_eq!(ledger.snapshot().mapped_bytes, 0);
        assert_eq!(ledger.snapshot().owned_bytes, 4096);
        ledger.refund(Axis::Owned, 4096);
        ledger.refund(Axis::Reserved, 8192);
        ledger.refund(Axis::Quarantined, 1);
        assert!(ledger.snapshot().is_zero());
    }

    #[test]
    #[should_panic(expected = "double refund")]
    fn a_refund_past_the_charge_panics() {
        let ledger = Ledger::default();
        ledger.charge(Axis::Owned, 4096);
        ledger.refund(Axis::Owned, 4096);
        ledger.refund(Axis::Owned, 4096);
    }

    #[test]
    fn try_charge_stops_at_the_limit_and_reports_what_is_charged() {
        let ledger = Ledger::default();
        assert_eq!(ledger.try_charge(Axis::Owned, 600, 1000), Ok(()));
        assert_eq!(ledger.try_charge(Axis::Owned, 401, 1000), Err(600));
        assert_eq!(ledger.try_charge(Axis::Owned, 400, 1000), Ok(()));
        assert_eq!(ledger.snapshot().owned_bytes, 1000);
        // An overflowing charge is refused, never wrapped.
        assert_eq!(
            ledger.try_charge(Axis::Owned, u64::MAX, u64::MAX),
            Err(1000)
        );
    }

    #[test]
    fn try_sub_refuses_more_than_is_held() {
        let counter = AtomicU64::new(10);
        assert_eq!(try_sub(&counter, 11), Err(10));
        assert_eq!(try_sub(&counter, 10), Ok(()));
        assert_eq!(counter.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn budgets_say_their_limit() {
        assert_eq!(Budget::bytes(4096).limit(), 4096);
        assert_eq!(Budget::unlimited().limit(), u64::MAX);
    }
}
