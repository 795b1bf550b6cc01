//! The mappings of a [`Book`](super::Book) by granule: the mapping under an address in O(1),
//! whatever the number of mappings, so that a copy's check (a copy-on-write, a block's bytes
//! written) costs the same in a KV cache of 1 Ki blocks as of 256 Ki.

use super::Access;
use crate::backend::Addr;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// One mapped granule: the mapping over it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mapped<P> {
    pub(super) start: Addr,
    pub(super) len: usize,
    pub(super) phys: P,
    pub(super) access: Access,
}

/// Each mapped granule's mapping, keyed by the granule's number (`addr / granularity`).
#[derive(Debug)]
pub(super) struct Index<P> {
    granularity: usize,
    granules: HashMap<usize, Mapped<P>, BuildHasherDefault<GranuleHasher>>,
}

impl<P: Copy> Index<P> {
    pub(super) fn new(granularity: usize) -> Self {
        Self {
            granularity,
            granules: HashMap::default(),
        }
    }

    /// The granules of a mapping of `len` bytes at `start` (both aligned).
    fn numbers(&self, start: Addr, len: usize) -> std::ops::Range<usize> {
        start / self.granularity..(start + len) / self.granularity
    }

    /// Records a mapping.
    pub(super) fn insert(&mut self, mapped: Mapped<P>) {
        for n in self.numbers(mapped.start, mapped.len) {
            self.granules.insert(n, mapped);
        }
    }

    /// Forgets the mapping of `len` bytes at `start`.
    pub(super) fn remove(&mut self, start: Addr, len: usize) {
        for n in self.numbers(start, len) {
            self.granules.remove(&n);
        }
    }

    /// The mapping of `len` bytes at `start` has access `access` now.
    pub(super) fn set_access(&mut self, start: Addr, len: usize, access: Access) {
        for n in self.numbers(start, len) {
            if let Some(m) = self.granules.get_mut(&n) {
                m.access = access;
            }
        }
    }

    /// The mapping under `addr`.
    #[inline]
    pub(super) fn get(&self, addr: Addr) -> Option<&Mapped<P>> {
        self.granules.get(&(addr / self.granularity))
    }

    pub(super) fn clear(&mut self) {
        self.granules.clear();
    }
}

/// A hasher for granule numbers: one multiplication (Fibonacci hashing). The numbers are
/// addresses a backend chose, not input an attacker picks.
#[derive(Default)]
pub(super) struct GranuleHasher(u64);

impl Hasher for GranuleHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
