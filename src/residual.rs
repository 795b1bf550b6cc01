//! [`Residual`]: exactly what one allocation or mapping still holds, part by part.

use crate::backend::Addr;
use crate::device::Generation;

/// The key of a shared physical allocation in its device's table.
pub(crate) type SharedKey = u64;

/// What is still held of one allocation or mapping after a failed or deferred release: exactly
/// the parts not yet given back, each still charged to the ledger.
///
/// Parts go back in a fixed order — unmap, drop the reference on shared physical memory,
/// release owned physical memory, free the VA — and each is refunded once, when it goes.
#[derive(Clone, Copy, Debug)]
pub struct Residual<P> {
    pub(crate) generation: Generation,
    pub(crate) addr: Addr,
    pub(crate) len: usize,
    /// Whether `[addr, addr + len)` is still reserved.
    pub(crate) reserved: bool,
    /// Bytes mapped from `addr` on (whole mappings, so one unmap covers them).
    pub(crate) mapped: usize,
    /// Physical memory owned by this allocation alone, and its length.
    pub(crate) phys: Option<(P, usize)>,
    /// A reference held on a shared physical allocation (dropped once the mapping is gone).
    pub(crate) shared: Option<SharedKey>,
}

impl<P> Residual<P> {
    /// A reservation holding nothing else.
    pub(crate) fn va(generation: Generation, addr: Addr, len: usize) -> Self {
        Self {
            generation,
            addr,
            len,
            reserved: true,
            mapped: 0,
            phys: None,
            shared: None,
        }
    }

    /// A committed allocation: reserved, mapped over its whole length, owning its memory.
    pub(crate) fn committed(generation: Generation, addr: Addr, len: usize, phys: P) -> Self {
        Self {
            mapped: len,
            phys: Some((phys, len)),
            ..Self::va(generation, addr, len)
        }
    }

    /// Physical memory alone (no VA): an orphan whose release failed.
    pub(crate) fn phys(generation: Generation, phys: P, len: usize) -> Self {
        Self {
            reserved: false,
            phys: Some((phys, len)),
            ..Self::va(generation, 0, 0)
        }
    }

    /// The allocation this is what is left of.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The VA range, withheld from reuse while [`holds_va`](Self::holds_va).
    pub fn range(&self) -> (Addr, usize) {
        (self.addr, self.len)
    }

    /// Whether the VA range is still reserved (and so withheld from reuse).
    pub fn holds_va(&self) -> bool {
        self.reserved
    }

    /// Bytes still mapped (still charged as mapped).
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// Bytes of physical memory owned by this residual alone (still charged as owned).
    pub fn owned_bytes(&self) -> usize {
        self.phys.as_ref().map_or(0, |&(_, len)| len)
    }

    /// Whether it still holds a reference on shared physical memory.
    pub fn holds_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        !self.reserved && self.mapped == 0 && self.phys.is_none() && self.shared.is_none()
    }
}

/// Totals over a set of residuals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holdings {
    /// How many residuals.
    pub count: usize,
    /// Bytes of VA they still reserve.
    pub reserved_bytes: u64,
    /// Bytes they still map.
    pub mapped_bytes: u64,
    /// Bytes of physical memory they alone still own.
    pub owned_bytes: u64,
    /// References they still hold on shared physical memory.
    pub shared_refs: u64,
}

impl Holdings {
    pub(crate) fn add<P>(&mut self, r: &Residual<P>) {
        self.count += 1;
        self.reserved_bytes += if r.reserved { r.len as u64 } else { 0 };
        self.mapped_bytes += r.mapped as u64;
        self.owned_bytes += r.owned_bytes() as u64;
        self.shared_refs += u64::from(r.shared.is_some());
    }
}
