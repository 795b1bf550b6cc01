//! The VMM rules, as bookkeeping shared by every backend: what is reserved, what physical memory
//! exists, what is mapped where. Every backend refuses a call that breaks them with
//! [`Cause::Violation`](super::Cause::Violation) before it makes any system or driver call
//! ([`SimBackend`](crate::backend::doubles::SimBackend) also records it, and panics on it when strict).
//!
//! Every check takes arbitrary input: an address, a length or a handle the backend never handed
//! out, a range whose end `addr + len` overflows, a zero or unaligned length. Each one is a
//! [`Violation`], never a panic or a wrapped sum: a range's end is computed by `Span::end`
//! (checked) before anything uses it.

use super::{Access, Addr, Span};
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

mod index;
mod violation;

pub use violation::Violation;

#[derive(Debug)]
struct PhysRecord {
    len: usize,
    maps: usize,
    /// Released while mapped (allowed where the driver defers the release to the last unmap).
    released: bool,
}

#[derive(Debug)]
struct MapRecord<P> {
    len: usize,
    phys: P,
    access: Access,
}

/// The record of one backend's reservations, physical memory and mappings.
#[derive(Debug)]
pub(crate) struct Book<P> {
    granularity: usize,
    /// CUDA lets `cuMemRelease` run while mapped (the memory goes with the last unmap); the host
    /// cannot punch a hole under a live mapping without the mapping silently reading zeros.
    release_while_mapped: bool,
    reservations: BTreeMap<Addr, usize>,
    /// Reservations (by start) poisoned by a failed system call.
    poisoned: std::collections::BTreeSet<Addr>,
    phys: HashMap<P, PhysRecord>,
    mappings: BTreeMap<Addr, MapRecord<P>>,
    /// The same mappings by granule, for [`resolve`](Self::resolve).
    index: index::Index<P>,
}

impl<P: Copy + Eq + Hash> Book<P> {
    pub(crate) fn new(granularity: usize, release_while_mapped: bool) -> Self {
        Self {
            granularity,
            release_while_mapped,
            reservations: BTreeMap::new(),
            poisoned: std::collections::BTreeSet::new(),
            phys: HashMap::new(),
            mappings: BTreeMap::new(),
            index: index::Index::new(granularity),
        }
    }

    fn aligned(&self, what: &'static str, value: usize, positive: bool) -> Result<(), Violation> {
        if !value.is_multiple_of(self.granularity) || (positive && value == 0) {
            return Err(Violation::Unaligned {
                what,
                value,
                granularity: self.granularity,
            });
        }
        Ok(())
    }

    /// The reservation that contains `[addr, addr + len)`, if any.
    fn containing_reservation(&self, addr: Addr, len: usize) -> Option<(Addr, usize)> {
        let (&start, &rlen) = self.reservations.range(..=addr).next_back()?;
        let end = Span::new(addr, len).end()?;
        (end <= start + rlen).then_some((start, rlen))
    }

    /// Mappings that start in `[addr, addr + len)` (the end saturates at the top of the
    /// address space).
    fn mappings_in(&self, addr: Addr, len: usize) -> usize {
        self.mappings
            .range(addr..Span::new(addr, len).end_or_top())
            .count()
    }

    /// The starts of the reservations that overlap `[addr, addr + len)` (the end saturates at
    /// the top of the address space).
    fn reservations_over(&self, addr: Addr, len: usize) -> impl Iterator<Item = Addr> + '_ {
        let end = Span::new(addr, len).end_or_top();
        let first = self
            .reservations
            .range(..=addr)
            .next_back()
            .filter(|&(&s, &l)| s + l > addr)
            .map(|(&s, _)| s);
        let after = self.reservations.range(addr..end).map(|(&s, _)| s);
        first.into_iter().chain(after.filter(move |&s| s != addr))
    }

    /// The start of the live reservation that contains `addr`, if any.
    pub(crate) fn reservation_of(&self, addr: Addr) -> Option<Addr> {
        self.containing_reservation(addr, 1).map(|(start, _)| start)
    }

    /// Whether `[addr, addr + len)` overlaps any live reservation.
    pub(crate) fn overlaps_reservation(&self, addr: Addr, len: usize) -> bool {
        self.reservations_over(addr, len).next().is_some()
    }

    /// Refuses any call on a range that touches a poisoned reservation, wherever in the range
    /// (a range that starts in a sound reservation and runs on into a poisoned neighbour is
    /// refused too).
    fn unpoisoned(&self, addr: Addr, len: usize) -> Result<(), Violation> {
        if self.poisoned.is_empty() {
            // The common case, and the hot path's: nothing to look up.
            return Ok(());
        }
        let start_in_poisoned = self
            .reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(s, _)| self.poisoned.contains(s));
        let poisoned = start_in_poisoned
            || self
                .reservations_over(addr, len.max(1))
                .any(|s| self.poisoned.contains(&s));
        if poisoned {
            return Err(Violation::Poisoned { addr, len });
        }
        Ok(())
    }

    /// Marks every reservation that overlaps `[addr, addr + len)` as poisoned: no call touches
    /// any of them again, and their VA is never handed out again.
    pub(crate) fn poison(&mut self, addr: Addr, len: usize) {
        let hit: Vec<Addr> = self.reservations_over(addr, len.max(1)).collect();
        self.poisoned.extend(hit);
    }

    /// Checks that `phys` is live (created, not released) and that `len` bytes from `offset`
    /// are all of it.
    fn check_whole_phys(&self, phys: P, offset: usize, len: usize) -> Result<(), Violation> {
        let rec = self.phys.get(&phys).filter(|r| !r.released);
        let rec = rec.ok_or(Violation::UnknownPhys)?;
        if offset != 0 || len != rec.len {
            return Err(Violation::PartialHandle {
                offset,
                len,
                phys_len: rec.len,
            });
        }
        Ok(())
    }

    pub(crate) fn check_reserve(&self, len: usize) -> Result<(), Violation> {
        self.aligned("length", len, true)
    }

    /// Records a new reservation. The backend checked [`overlaps_reservation`] first (the
    /// host) or got the range from a system that never hands out VA twice (the simulator's own
    /// [`lowest_gap`], the driver): an overlap here is a bug of the backend, not of its caller.
    ///
    /// [`overlaps_reservation`]: Self::overlaps_reservation
    /// [`lowest_gap`]: Self::lowest_gap
    pub(crate) fn apply_reserve(&mut self, addr: Addr, len: usize) {
        assert!(
            Span::new(addr, len).end().is_some() && !self.overlaps_reservation(addr, len),
            "VA [{addr:#x}, +{len:#x}) handed out twice: it overlaps a live reservation"
        );
        self.reservations.insert(addr, len);
    }

    pub(crate) fn check_free(&self, addr: Addr, len: usize) -> Result<(), Violation> {
        self.unpoisoned(addr, len)?;
        if self.reservations.get(&addr) != Some(&len) {
            return Err(Violation::NotReserved { addr, len });
        }
        match self.mappings_in(addr, len) {
            0 => Ok(()),
            mappings => Err(Violation::StillMapped { addr, mappings }),
        }
    }

    pub(crate) fn apply_free(&mut self, addr: Addr) {
        self.reservations.remove(&addr);
    }

    pub(crate) fn check_create(&self, len: usize) -> Result<(), Violation> {
        self.aligned("length", len, true)
    }

    /// Records new physical memory. `phys` must not be recorded already, live or released while
    /// still mapped: a backend whose system may hand a released value out again (CUDA's
    /// handles) keys its record by a serial of its own.
    pub(crate) fn apply_create(&mut self, phys: P, len: usize) {
        let fresh = self
            .phys
            .insert(
                phys,
                PhysRecord {
                    len,
                    maps: 0,
                    released: false,
                },
            )
            .is_none();
        assert!(fresh, "physical handle handed out twice");
    }

    pub(crate) fn check_release(&self, phys: P, len: usize) -> Result<(), Violation> {
        let rec = self.phys.get(&phys).filter(|r| !r.released);
        let rec = rec.ok_or(Violation::UnknownPhys)?;
        if rec.len != len {
            return Err(Violation::PhysLength {
                actual: rec.len,
                given: len,
            });
        }
        if rec.maps > 0 && !self.release_while_mapped {
            return Err(Violation::PhysStillMapped { mappings: rec.maps });
        }
        Ok(())
    }

    pub(crate) fn apply_release(&mut self, phys: P) {
        let rec = self.phys.get_mut(&phys).expect("checked");
        if rec.maps == 0 {
            self.phys.remove(&phys);
        } else {
            rec.released = true;
        }
    }

    pub(crate) fn check_map(
        &self,
        addr: Addr,
        len: usize,
        phys: P,
        offset: usize,
    ) -> Result<(), Violation> {
        self.aligned("address", addr, false)?;
        self.aligned("length", len, true)?;
        self.unpoisoned(addr, len)?;
        if self.containing_reservation(addr, len).is_none() {
            return Err(Violation::NotReserved { addr, len });
        }
        let overlaps = self
            .mappings
            .range(..addr + len)
            .next_back()
            .is_some_and(|(&s, m)| s + m.len > addr);
        if overlaps {
            return Err(Violation::AlreadyMapped { addr, len });
        }
        self.check_whole_phys(phys, offset, len)
    }

    pub(crate) fn apply_map(&mut self, addr: Addr, len: usize, phys: P, access: Access) {
        self.phys.get_mut(&phys).expect("checked").maps += 1;
        let record = MapRecord { len, phys, access };
        self.mappings.insert(addr, record);
        self.index.insert(index::Mapped {
            start: addr,
            len,
            phys,
            access,
        });
    }

    /// The mapping under `addr`: its physical memory, the offset of `addr` into it, the bytes
    /// left in the mapping from `addr`, and its access.
    /// O(1): by the granule under `addr` ([`index`]).
    pub(crate) fn resolve(&self, addr: Addr) -> Option<(P, usize, usize, Access)> {
        let m = self.index.get(addr)?;
        let into = addr - m.start;
        debug_assert!(
            into < m.len,
            "the index lists a mapping under every byte it covers"
        );
        Some((m.phys, into, m.len - into, m.access))
    }

    /// Changes the recorded access of the mappings that exactly cover `[addr, addr + len)`.
    pub(crate) fn set_access(
        &mut self,
        addr: Addr,
        len: usize,
        access: Access,
    ) -> Result<(), Violation> {
        self.check_unmap(addr, len)?;
        for (&start, m) in self.mappings.range_mut(addr..addr + len) {
            m.access = access;
            self.index.set_access(start, m.len, access);
        }
        Ok(())
    }

    /// Checks that every byte of `[addr, addr + len)` is mapped, read-write if `write`: the
    /// range of a copy to (`write`) or from the host.
    pub(crate) fn check_access(
        &self,
        addr: Addr,
        len: usize,
        write: bool,
    ) -> Result<(), Violation> {
        let not_mapped = || Violation::NotMapped { addr, len };
        let end = Span::new(addr, len).end().ok_or_else(not_mapped)?;
        self.unpoisoned(addr, len)?;
        let mut at = addr;
        while at < end {
            let (_, _, run, access) = self.resolve(at).ok_or_else(not_mapped)?;
            if write && access != Access::ReadWrite {
                return Err(Violation::ReadOnly { addr, len });
            }
            at += run;
        }
        Ok(())
    }

    // Inlined into `unmap`, the hot path (regions, pools): a second caller (an export's seal)
    // made LLVM keep it out of line, 62 instructions more per 16-granule region cycle.
    #[inline(always)]
    pub(crate) fn check_unmap(&self, addr: Addr, len: usize) -> Result<(), Violation> {
        let not_mapped = Violation::NotMapped { addr, len };
        if len == 0 || Span::new(addr, len).end().is_none() {
            return Err(not_mapped);
        }
        self.unpoisoned(addr, len)?;
        let mut next = addr;
        for (&start, m) in self.mappings.range(addr..addr + len) {
            if start != next {
                return Err(not_mapped);
            }
            next = start + m.len;
        }
        let straddles_start = self
            .mappings
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, m)| s + m.len > addr);
        if next != addr + len || straddles_start {
            return Err(not_mapped);
        }
        Ok(())
    }

    /// Checks that every byte of `[addr, addr + len)` is mapped, and that `phys` has exactly
    /// `len` bytes: the arguments of a copy from mapped memory into (all of) physical memory.
    pub(crate) fn check_copy(&self, phys: P, addr: Addr, len: usize) -> Result<(), Violation> {
        let not_mapped = Violation::NotMapped { addr, len };
        let end = Span::new(addr, len)
            .end()
            .filter(|_| len > 0)
            .ok_or(not_mapped.clone())?;
        self.aligned("address", addr, false)?;
        self.aligned("length", len, true)?;
        self.unpoisoned(addr, len)?;
        let mut next = addr;
        let first = self.mappings.range(..=addr).next_back();
        if let Some((&s, m)) = first
            && s + m.len > addr
        {
            next = s + m.len;
        }
        for (&s, m) in self.mappings.range(addr + 1..end) {
            if s != next {
                return Err(not_mapped);
            }
            next = s + m.len;
        }
        if next < end {
            return Err(not_mapped);
        }
        let from_itself = self
            .mappings
            .range(..end)
            .rev()
            .take_while(|(s, m)| **s + m.len > addr)
            .any(|(_, m)| m.phys == phys);
        if from_itself {
            return Err(Violation::SelfCopy { addr, len });
        }
        self.check_whole_phys(phys, 0, len)
    }

    pub(crate) fn apply_unmap(&mut self, addr: Addr, len: usize) {
        let starts: Vec<Addr> = self
            .mappings
            .range(addr..addr + len)
            .map(|(&s, _)| s)
            .collect();
        for start in starts {
            let m = self.mappings.remove(&start).expect("listed");
            self.index.remove(start, m.len);
            let rec = self.phys.get_mut(&m.phys).expect("mapped phys is known");
            rec.maps -= 1;
            if rec.maps == 0 && rec.released {
                self.phys.remove(&m.phys);
            }
        }
    }

    /// The lowest gap of `len` bytes at or above `base`, granularity-aligned; `None` if no gap
    /// of `len` bytes is left below the top of the address space.
    pub(crate) fn lowest_gap(&self, base: Addr, len: usize) -> Option<Addr> {
        let mut candidate = base;
        for (&start, &rlen) in self.reservations.range(base..) {
            if start >= Span::new(candidate, len).end()? {
                break;
            }
            candidate = candidate.max(start + rlen);
        }
        Span::new(candidate, len).end().map(|_| candidate)
    }

    pub(crate) fn reservations(&self) -> usize {
        self.reservations.len()
    }

    /// Live mappings.
    pub(crate) fn mappings(&self) -> usize {
        self.mappings.len()
    }

    /// Removes and returns every reservation (for a backend tearing itself down).
    pub(crate) fn drain_reservations(&mut self) -> Vec<(Addr, usize, bool)> {
        self.mappings.clear();
        self.index.clear();
        self.phys.clear();
        let poisoned = std::mem::take(&mut self.poisoned);
        std::mem::take(&mut self.reservations)
            .into_iter()
            .map(|(a, l)| (a, l, poisoned.contains(&a)))
            .collect()
    }

    /// The length of a live (not released) physical allocation.
    pub(crate) fn phys_len(&self, phys: P) -> Option<usize> {
        self.phys.get(&phys).filter(|r| !r.released).map(|r| r.len)
    }

    /// The length of a physical allocation, released-while-mapped ones included.
    pub(crate) fn phys_len_any(&self, phys: P) -> usize {
        self.phys.get(&phys).map_or(0, |r| r.len)
    }

    /// Every mapping of `phys`: (start, length, access), lowest first. Linear in the mappings
    /// of the backend: for rare calls (an export), not for a hot path.
    /// How many mappings `phys` has now (0 for unknown memory).
    pub(crate) fn maps_of(&self, phys: P) -> usize {
        self.phys.get(&phys).map_or(0, |r| r.maps)
    }

    pub(crate) fn mappings_of(&self, phys: P) -> Vec<(Addr, usize, Access)> {
        self.mappings
            .iter()
            .filter(|(_, m)| m.phys == phys)
            .map(|(&start, m)| (start, m.len, m.access))
            .collect()
    }

    /// The mappings that start in `[addr, addr + len)`: start, length, physical memory.
    pub(crate) fn mappings_within(&self, addr: Addr, len: usize) -> Vec<(Addr, usize, P)> {
        self.mappings
            .range(addr..addr.saturating_add(len))
            .map(|(&start, m)| (start, m.len, m.phys))
            .collect()
    }

    /// Whether physical memory (live, or released while mapped) has a mapping.
    pub(crate) fn is_mapped(&self, phys: P) -> bool {
        self.phys.get(&phys).is_some_and(|r| r.maps > 0)
    }

    /// Start of the mapping under `addr`.
    pub(crate) fn mapping_start(&self, addr: Addr) -> Option<Addr> {
        let (&start, m) = self.mappings.range(..=addr).next_back()?;
        (addr < start + m.len).then_some(start)
    }

    /// The physical allocations whose last mapping lies in `[addr, addr + len)` and that were
    /// released while mapped: they go when that range is unmapped. (handle, length)
    pub(crate) fn handles_in(&self, addr: Addr, len: usize) -> Vec<(P, usize)> {
        let mut counts: HashMap<P, usize> = HashMap::new();
        for (_, m) in self.mappings.range(addr..addr + len) {
            *counts.entry(m.phys).or_default() += 1;
        }
        counts
            .into_iter()
            .filter_map(|(p, n)| {
                let rec = self.phys.get(&p)?;
                (rec.released && rec.maps == n).then_some((p, rec.len))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 4096;

    /// The granule index's hasher keeps granule numbers apart (one multiplication by an odd
    /// constant: a bijection), and bytes written to it too (each step an xor, then that
    /// multiplication). The index's keys are `usize`, so it calls only `write_usize`: with that
    /// step dropped every key lands in one bucket and the index degrades to a list (its speed,
    /// not its answers); `write` is the trait's, checked for its own sake. Fails if a step is
    /// dropped (`write_usize` or `write` → `()`) or folds by an or (`^` → `|`: last bytes
    /// collide).
    #[test]
    fn the_granule_hasher_hashes_every_granule_number_and_byte_apart() {
        use std::collections::HashSet;
        use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
        let build = BuildHasherDefault::<index::GranuleHasher>::default();
        let numbers: HashSet<u64> = (0..4096_usize).map(|n| build.hash_one(n)).collect();
        assert_eq!(numbers.len(), 4096);
        let bytes = |bytes: &[u8]| {
            let mut h = build.build_hasher();
            h.write(bytes);
            h.finish()
        };
        let last: HashSet<u64> = (0..=255_u8).map(|b| bytes(&[1, b])).collect();
        assert_eq!(last.len(), 256);
    }

    #[test]
    fn a_poisoned_reservation_refuses_every_call() {
        let mut book: Book<u32> = Book::new(G, false);
        book.apply_reserve(0x10000, 4 * G);
        book.apply_create(7, 2 * G);
        book.apply_map(0x10000, 2 * G, 7, Access::ReadWrite);
        book.poison(0x10000 + G, G);
        let poisoned = |r: Result<(), Violation>| matches!(r, Err(Violation::Poisoned { .. }));
        assert!(poisoned(book.check_unmap(0x10000, 2 * G)));
        assert!(poisoned(book.check_map(0x10000 + 2 * G, G, 7, 0)));
        assert!(poisoned(book.check_free(0x10000, 4 * G)));
        assert!(poisoned(book.check_copy(7, 0x10000, G)));
        let drained = book.drain_reservations();
        assert_eq!(drained, vec![(0x10000, 4 * G, true)]);
        // Drained, the book holds nothing: the memory mapped before is mapped nowhere now.
        assert_eq!((book.reservations(), book.mappings()), (0, 0));
        assert!(book.check_access(0x10000, G, false).is_err());
    }

    #[test]
    fn a_range_that_runs_on_into_a_poisoned_neighbour_is_refused() {
        let mut book: Book<u32> = Book::new(G, false);
        // Two adjacent reservations, each with one mapping; the second one is poisoned.
        book.apply_reserve(0x10000, G);
        book.apply_reserve(0x10000 + G, G);
        book.apply_create(1, G);
        book.apply_create(2, G);
        book.apply_map(0x10000, G, 1, Access::ReadWrite);
        book.apply_map(0x10000 + G, G, 2, Access::ReadWrite);
        assert_eq!(book.check_unmap(0x10000, 2 * G), Ok(()));
        book.poison(0x10000 + G, G);
        let poisoned = |r: Result<(), Violation>| matches!(r, Err(Violation::Poisoned { .. }));
        assert!(poisoned(book.check_unmap(0x10000, 2 * G)));
        assert!(poisoned(book.check_access(0x10000, 2 * G, false)));
        assert!(poisoned(book.check_access(0x10000 + G - 1, 2, true)));
        // The sound neighbour on its own is still served.
        assert_eq!(book.check_unmap(0x10000, G), Ok(()));
        assert_eq!(book.check_access(0x10000, G, true), Ok(()));
    }

    #[test]
    fn a_range_whose_end_overflows_is_refused_by_every_check() {
        let mut book: Book<u32> = Book::new(G, false);
        // The highest granule a reservation can have: its end, 2^64 - G, still fits.
        let top = usize::MAX - 2 * G + 1;
        book.apply_reserve(top, G);
        book.apply_create(1, G);
        book.apply_create(2, G);
        book.apply_map(top, G, 1, Access::ReadWrite);
        for (addr, len) in [
            (top, 2 * G),
            (top, 3 * G),
            (top, usize::MAX - G + 1),
            (top, usize::MAX),
            (top + G, G + 1),
            (usize::MAX - G + 1, 2 * G),
        ] {
            let at = format!("{len:#x} bytes at {addr:#x}");
            assert!(book.check_map(addr, len, 2, 0).is_err(), "{at}");
            assert!(book.check_unmap(addr, len).is_err(), "{at}");
            assert!(book.check_access(addr, len, false).is_err(), "{at}");
            assert!(book.check_access(addr, len, true).is_err(), "{at}");
            assert!(book.check_copy(2, addr, len).is_err(), "{at}");
            assert!(book.check_free(addr, len).is_err(), "{at}");
        }
        assert!(book.overlaps_reservation(0, usize::MAX));
        assert!(!book.overlaps_reservation(top + G, usize::MAX));
        // Past `top` only the last granule is left, and its end, 2^64, does not fit.
        assert_eq!(book.lowest_gap(top, G), None);
        assert_eq!(book.lowest_gap(top - G, G), Some(top - G));
        assert_eq!(book.lowest_gap(top - G, 2 * G), None);
        assert_eq!(book.lowest_gap(0, usize::MAX), None);
        assert_eq!(book.lowest_gap(0, top), Some(0));
        assert_eq!(book.check_unmap(top, G), Ok(()));
        assert_eq!(book.check_copy(2, top, G), Ok(()));
    }

    #[test]
    fn an_unmap_from_inside_a_mapping_at_the_lowest_addresses_is_refused_without_overflow() {
        // A mapping that starts below its own length. The loop over the mappings in the range
        // already refuses these unmaps; the check of what straddles the range's start
        // (`s + len > addr`) must not overflow on the way (a subtraction would, here).
        let mut book: Book<u32> = Book::new(G, false);
        book.apply_reserve(G, 4 * G);
        book.apply_create(1, 2 * G);
        book.apply_map(G, 2 * G, 1, Access::ReadWrite);
        for (addr, len) in [(2 * G, G), (2 * G, 2 * G), (2 * G, 3 * G)] {
            assert_eq!(
                book.check_unmap(addr, len),
                Err(Violation::NotMapped { addr, len }),
                "{len:#x} bytes at {addr:#x}"
            );
        }
        assert_eq!(book.check_unmap(G, 2 * G), Ok(()));
    }

    #[test]
    fn only_whole_physical_allocations_from_offset_zero_are_mapped_or_copied_into() {
        let mut book: Book<u32> = Book::new(G, false);
        book.apply_reserve(0x10000, 4 * G);
        book.apply_create(1, 2 * G);
        book.apply_create(2, G);
        let partial = |r: Result<(), Violation>| matches!(r, Err(Violation::PartialHandle { .. }));
        // A part of a handle: its first granule, its second one, or a non-zero offset.
        assert!(partial(book.check_map(0x10000, G, 1, 0)));
        assert!(partial(book.check_map(0x10000, G, 1, G)));
        assert!(partial(book.check_map(0x10000, 2 * G, 2, 0)));
        assert_eq!(book.check_map(0x10000, 2 * G, 1, 0), Ok(()));
        book.apply_map(0x10000, 2 * G, 1, Access::ReadWrite);
        // A copy must fill the whole destination allocation.
        book.apply_create(3, 2 * G);
        assert!(partial(book.check_copy(3, 0x10000, G)));
        assert!(partial(book.check_copy(2, 0x10000, 2 * G)));
        assert_eq!(book.check_copy(2, 0x10000 + G, G), Ok(()));
    }

    #[test]
    fn a_copy_from_memory_into_itself_is_refused() {
        let mut book: Book<u32> = Book::new(G, false);
        book.apply_reserve(0x10000, 2 * G);
        book.apply_create(1, G);
        book.apply_create(2, G);
        book.apply_map(0x10000, G, 1, Access::ReadOnly);
        assert!(matches!(
            book.check_copy(1, 0x10000, G),
            Err(Violation::SelfCopy { .. })
        ));
        assert_eq!(book.check_copy(2, 0x10000, G), Ok(()));
        assert!(matches!(
            book.check_copy(2, 0x10000, 0),
            Err(Violation::NotMapped { .. })
        ));
        assert!(matches!(
            book.check_copy(2, 0x10000 + G, G),
            Err(Violation::NotMapped { .. })
        ));
    }
}
