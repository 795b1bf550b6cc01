//! [`Residual`]: exactly what one token still holds, part by part, once it leaves its owner.

use crate::backend::Addr;
use crate::ids::Generation;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A shared prefix's physical memory, laid out for sharing when it is made: the body (all but
/// the last granule, when there is more than one) in one allocation, and the boundary granule
/// in an allocation of its own. Every mapping of it maps whole allocations from offset 0 (the
/// only mapping the CUDA driver documents), and copy-on-write swaps the boundary's allocation
/// for a private one without touching the body's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Split<P> {
    /// The body's memory and length, when the prefix is longer than one granule.
    pub(crate) body: Option<(P, usize)>,
    /// The boundary granule's memory and length.
    pub(crate) boundary: (P, usize),
}

impl<P> Split<P> {
    /// The body's length: where the boundary granule starts.
    pub(crate) fn body_len(&self) -> usize {
        self.body.as_ref().map_or(0, |&(_, len)| len)
    }

    /// Bytes of physical memory in all.
    pub(crate) fn len(&self) -> usize {
        self.body_len() + self.boundary.1
    }
}

/// A reference on physical memory that several tokens map (a shared prefix): the memory goes
/// with the last reference. The count is the number of references alive, and it is touched only
/// when a mapping is made or torn down, never on access.
///
/// It has no `Drop`: the device gives each reference back (and releases the memory with the
/// last one) when the mapping holding it is confirmed gone.
#[derive(Debug)]
pub struct SharedPhys<P>(Arc<Shared<P>>);

/// What the references of a [`SharedPhys`] share: the memory, and whether it was ever exported
/// to another process (from then on nobody in this process writes it: an importer elsewhere
/// may be reading it, whatever this process's count of references says).
#[derive(Debug)]
struct Shared<P> {
    split: Split<P>,
    exported: AtomicBool,
}

impl<P: Copy> SharedPhys<P> {
    /// The first reference on `split`.
    pub(crate) fn new(split: Split<P>) -> Self {
        Self(Arc::new(Shared {
            split,
            exported: AtomicBool::new(false),
        }))
    }

    /// Marks the memory exported, for good: it is never written again from this process.
    pub(crate) fn mark_exported(&self) {
        self.0.exported.store(true, Ordering::Release);
    }

    /// One more reference, for one more mapping.
    pub(crate) fn another(&self) -> Self {
        Self(Arc::clone(&self.0))
    }

    /// The physical memory's layout and handles.
    pub(crate) fn split(&self) -> Split<P> {
        self.0.split
    }

    /// References alive now, this one included. Only a count: it orders nothing (see
    /// [`is_unique`](Self::is_unique)).
    pub(crate) fn refs(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Whether the memory may be written: this is the only reference, and the memory was never
    /// exported to another process. When it is the only reference, every access through a
    /// mapping that held another reference happened before this returns (the check acquires
    /// what their teardown released).
    pub(crate) fn is_unique(&mut self) -> bool {
        Arc::get_mut(&mut self.0).is_some_and(|s| !*s.exported.get_mut())
    }

    /// Gives this reference back: the last one returns the memory, now owned by no mapping.
    pub(crate) fn into_last(self) -> Option<Split<P>> {
        Arc::into_inner(self.0).map(|s| s.split)
    }
}

/// Totals over one device's shared physical memory: how many prefixes, their bytes (owned
/// once each, whatever the number of mappings), and the references on them. Every reference is
/// made and given back through it.
#[derive(Debug, Default)]
pub(crate) struct SharedTotals {
    count: AtomicU64,
    bytes: AtomicU64,
    refs: AtomicU64,
    exports: AtomicU64,
}

impl SharedTotals {
    /// Shares the memory of `split` (already charged as owned): its first reference.
    pub(crate) fn share<P: Copy>(&self, split: Split<P>) -> SharedPhys<P> {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(split.len() as u64, Ordering::Relaxed);
        self.refs.fetch_add(1, Ordering::Relaxed);
        SharedPhys::new(split)
    }

    /// One more reference on `shared`, for one more mapping.
    pub(crate) fn another<P: Copy>(&self, shared: &SharedPhys<P>) -> SharedPhys<P> {
        self.refs.fetch_add(1, Ordering::Relaxed);
        shared.another()
    }

    /// Gives a reference back; the last one returns the memory, now owned by no mapping.
    pub(crate) fn give_back<P: Copy>(&self, shared: SharedPhys<P>) -> Option<Split<P>> {
        self.refs.fetch_sub(1, Ordering::Relaxed);
        let split = shared.into_last()?;
        self.count.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(split.len() as u64, Ordering::Relaxed);
        Some(split)
    }

    /// One more reference on `shared`, held by an export to another process.
    pub(crate) fn export<P: Copy>(&self, shared: &SharedPhys<P>) -> SharedPhys<P> {
        self.exports.fetch_add(1, Ordering::Relaxed);
        self.another(shared)
    }

    /// An export ended: its reference is given back with [`give_back`](Self::give_back).
    pub(crate) fn export_ended(&self) {
        self.exports.fetch_sub(1, Ordering::Relaxed);
    }

    /// How many exports are outstanding.
    pub(crate) fn exports(&self) -> u64 {
        self.exports.load(Ordering::Relaxed)
    }

    /// The totals now: `count` prefixes, their `owned_bytes`, `shared_refs` references.
    pub(crate) fn holdings(&self) -> Holdings {
        Holdings {
            count: self.count.load(Ordering::Relaxed) as usize,
            owned_bytes: self.bytes.load(Ordering::Relaxed),
            shared_refs: self.refs.load(Ordering::Relaxed),
            ..Holdings::default()
        }
    }
}

/// The parts of a token still held, in the order they go back: mapped bytes, a reference on
/// shared physical memory, owned physical memory, the reserved VA.
#[derive(Debug)]
pub struct Held<P> {
    /// Whether the VA range is still reserved.
    pub(crate) reserved: bool,
    /// Bytes mapped from the start of the range (whole mappings, so one unmap covers them).
    pub(crate) mapped: usize,
    /// Physical memory owned by this token alone, and its length.
    pub(crate) phys: Option<(P, usize)>,
    /// A reference on shared physical memory, given back once the mapping is gone.
    pub(crate) shared: Option<SharedPhys<P>>,
    /// Granules of an elastic region: each one whole physical allocation of its own, owned by
    /// these parts alone, and mapped at its offset unless `mapped` covers it already.
    pub(crate) granules: Vec<Granule<P>>,
    /// Handles on another process's physical memory (an imported prefix), each released once
    /// after the mapping is gone. They are this process's handles only: they were never
    /// charged as owned here, and releasing them refunds nothing.
    pub(crate) imported: Vec<(P, usize)>,
}

/// One granule of an elastic region, as a residual holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Granule<P> {
    /// Where it is (or was) mapped, as an offset into the range.
    pub(crate) offset: usize,
    /// Its length (the granularity).
    pub(crate) len: usize,
    /// Its physical memory.
    pub(crate) phys: P,
    /// Whether it is mapped at `offset` on its own (apart from the `mapped` bytes from the
    /// start of the range, which one unmap covers).
    pub(crate) mapped: bool,
}

impl<P> Held<P> {
    /// A reservation and nothing else.
    pub(crate) fn va() -> Self {
        Self {
            reserved: true,
            mapped: 0,
            phys: None,
            shared: None,
            granules: Vec::new(),
            imported: Vec::new(),
        }
    }

    /// A reservation mapped over `mapped` bytes.
    pub(crate) fn mapped(mapped: usize) -> Self {
        Self {
            mapped,
            ..Self::va()
        }
    }

    /// A reservation of `len` bytes mapped whole over its own physical memory.
    pub(crate) fn committed(len: usize, phys: P) -> Self {
        Self {
            phys: Some((phys, len)),
            ..Self::mapped(len)
        }
    }

    /// Physical memory alone, no VA: memory that no token owns any more.
    pub(crate) fn orphan(phys: P, len: usize) -> Self {
        Self {
            reserved: false,
            phys: Some((phys, len)),
            ..Self::va()
        }
    }

    /// Bytes of physical memory owned by these parts alone.
    pub(crate) fn owned_bytes(&self) -> usize {
        let granules: usize = self.granules.iter().map(|g| g.len).sum();
        self.phys.as_ref().map_or(0, |&(_, len)| len) + granules
    }

    /// Bytes still mapped, in all.
    pub(crate) fn mapped_bytes(&self) -> usize {
        let granules: usize = self
            .granules
            .iter()
            .filter(|g| g.mapped)
            .map(|g| g.len)
            .sum();
        self.mapped + granules
    }

    /// Whether nothing is left.
    pub(crate) fn is_empty(&self) -> bool {
        !self.reserved
            && self.mapped == 0
            && self.phys.is_none()
            && self.shared.is_none()
            && self.granules.is_empty()
            && self.imported.is_empty()
    }
}

/// What is still held of one allocation or mapping after a failed or deferred release: exactly
/// the parts not yet given back, each still charged to the ledger.
///
/// Parts go back in a fixed order — unmap, drop the reference on shared physical memory,
/// release owned physical memory, free the VA — and each is refunded once, when it goes.
#[derive(Debug)]
pub struct Residual<P> {
    pub(crate) generation: Generation,
    pub(crate) addr: Addr,
    pub(crate) len: usize,
    pub(crate) held: Held<P>,
}

impl<P> Residual<P> {
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
        self.held.reserved
    }

    /// Bytes still mapped (still charged as mapped).
    pub fn mapped_bytes(&self) -> usize {
        self.held.mapped_bytes()
    }

    /// Bytes of physical memory owned by this residual alone (still charged as owned).
    pub fn owned_bytes(&self) -> usize {
        self.held.owned_bytes()
    }

    /// Whether it still holds a reference on shared physical memory.
    pub fn holds_shared(&self) -> bool {
        self.held.shared.is_some()
    }

    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
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
    /// Adds what `other` counts.
    pub(crate) fn absorb(&mut self, other: &Holdings) {
        self.count += other.count;
        self.reserved_bytes += other.reserved_bytes;
        self.mapped_bytes += other.mapped_bytes;
        self.owned_bytes += other.owned_bytes;
        self.shared_refs += other.shared_refs;
    }

    pub(crate) fn add<P>(&mut self, r: &Residual<P>) {
        self.count += 1;
        self.reserved_bytes += if r.held.reserved { r.len as u64 } else { 0 };
        self.mapped_bytes += r.held.mapped_bytes() as u64;
        self.owned_bytes += r.owned_bytes() as u64;
        self.shared_refs += u64::from(r.held.shared.is_some());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Generation;

    fn residual(held: Held<u32>) -> Residual<u32> {
        let generation = Generation::next();
        Residual {
            generation,
            addr: 0x1000,
            len: 8192,
            held,
        }
    }

    #[test]
    fn each_part_is_reported_and_empty_means_all_gone() {
        let r = residual(Held::committed(8192, 7));
        assert!(r.holds_va() && !r.holds_shared() && !r.is_empty());
        assert_eq!((r.mapped_bytes(), r.owned_bytes()), (8192, 8192));

        let mut held = Held::committed(8192, 7);
        held.mapped = 0;
        held.phys = None;
        assert!(!residual(held).is_empty(), "the VA is still reserved");
        let orphan = residual(Held::orphan(7, 4096));
        assert!(!orphan.holds_va() && orphan.owned_bytes() == 4096);
        let mut gone = Held::<u32>::va();
        gone.reserved = false;
        assert!(residual(gone).is_empty());
    }

    #[test]
    fn holdings_add_up_parts() {
        let shared = SharedPhys::new(Split {
            body: None,
            boundary: (9u32, 4096),
        });
        let mut h = Holdings::default();
        h.add(&residual(Held::committed(8192, 7)));
        h.add(&residual(Held {
            shared: Some(shared.another()),
            ..Held::mapped(8192)
        }));
        h.add(&residual(Held::orphan(3, 4096)));
        assert_eq!(
            h,
            Holdings {
                count: 3,
                reserved_bytes: 16384,
                mapped_bytes: 16384,
                owned_bytes: 12288,
                shared_refs: 1,
            }
        );
    }

    #[test]
    fn only_the_last_shared_reference_returns_the_memory() {
        let totals = SharedTotals::default();
        let split = Split {
            body: Some((4u32, 8192)),
            boundary: (5u32, 4096),
        };
        let mut first = totals.share(split);
        let second = totals.another(&first);
        assert_eq!((first.refs(), second.refs()), (2, 2));
        assert!(!first.is_unique());
        assert_eq!(second.split(), split);
        let h = totals.holdings();
        assert_eq!((h.count, h.owned_bytes, h.shared_refs), (1, 12288, 2));
        assert_eq!(totals.give_back(second), None);
        assert!(first.is_unique());
        assert_eq!(totals.holdings().shared_refs, 1);
        assert_eq!(totals.give_back(first), Some(split));
        assert_eq!(totals.holdings(), Holdings::default());
    }
}
