//! Identities: the [`Generation`] of an allocation, the [`Released`] receipt, and the
//! [`ContextLost`] proof that a device's context is lost.

use generativity::Id;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};

/// The identity of one allocation, from a per-device counter: never derived from an address, so
/// a reused VA range never makes a stale allocation look alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(NonZeroU64);

impl Generation {
    /// The number behind it.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

/// A device's source of generations, counting from 1.
#[derive(Debug)]
pub(crate) struct Generations(AtomicU64);

impl Generations {
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(1))
    }

    pub(crate) fn next(&self) -> Generation {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        Generation(NonZeroU64::new(n).expect("generations count from 1 and never wrap"))
    }
}

/// Proof that an allocation was released: its mappings are gone, its physical memory released,
/// its VA freed. A plain receipt, not a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// Which allocation.
    pub generation: Generation,
    /// Its length in bytes.
    pub len: usize,
}

/// Proof that a device's context is lost: the driver freed everything it held, so quarantined
/// residuals may be discharged. Branded: it discharges only its own device's tokens.
#[derive(Debug)]
pub struct ContextLost<'id> {
    _brand: Id<'id>,
}

impl<'id> ContextLost<'id> {
    /// Only the device whose backend confirmed the loss makes one.
    pub(crate) fn new(brand: Id<'id>) -> Self {
        Self { _brand: brand }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_count_from_one_and_never_repeat() {
        let g = Generations::new();
        let (a, b, c) = (g.next(), g.next(), g.next());
        assert_eq!((a.get(), b.get(), c.get()), (1, 2, 3));
        assert!(a < b && b < c);
    }
}
