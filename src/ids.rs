//! Identities: the [`Generation`] of an allocation, the [`Released`] receipt, and the
//! [`ContextLost`] proof that a device's context is lost.

use crate::backend::unique;
use generativity::Id;
use std::num::NonZeroU64;

/// The identity of one allocation: unique in the process, across every device (two devices
/// never give out the same one), and never derived from an address, so a reused VA range never
/// makes a stale allocation look alive, and equal generations mean the same allocation (whose
/// physical memory may change over its life: copy-on-write, resume, growth).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(NonZeroU64);

impl Generation {
    /// The number behind it.
    pub fn get(self) -> u64 {
        self.0.get()
    }

    /// A generation no allocation of this process had before.
    pub(crate) fn next() -> Self {
        Self(unique())
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
    fn generations_never_repeat_and_grow() {
        let (a, b, c) = (Generation::next(), Generation::next(), Generation::next());
        assert!(a < b && b < c);
    }
}
