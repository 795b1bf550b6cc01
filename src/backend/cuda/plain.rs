//! The plain mechanism of the CUDA backend (fact 59): `cuMemAlloc` and `cuMemFree`, for a
//! device without virtual memory management.
//!
//! What it can do, it does with the VMM mechanism's record, fences and tokens; what it cannot
//! is refused with [`Cause::Unsupported`](crate::backend::Cause::Unsupported) naming the
//! capability, before any memory call (the context is made current first), never emulated:
//!
//! - **reserve** claims a length only: the record books it at a *placeholder* address, above
//!   every device address, that no driver call and no token's memory ever sees;
//! - **create** is `cuMemAlloc`: the memory, at the driver's address, is the handle;
//! - **map** is the one placement a commit makes: the whole of a fresh allocation over the
//!   whole of a placeholder reservation. The record moves the reservation to the driver's
//!   address, and the committed token takes it ([`Backend::placed`]). Any other map — part of
//!   a reservation (a region's growth), an allocation mapped before (sharing, a wake), a
//!   read-only one, one that peers would need access to — is refused;
//! - **unmap** only takes the mapping off the record (the memory stays allocated, unreachable
//!   through any token), after the same checks as the VMM mechanism's;
//! - **free** of a placed reservation is `cuMemFree`, and releases the allocation placed there
//!   with it ([`Backend::placed`]): one call, so the typed layer's owned bytes go exactly when
//!   the memory does (a failed `cuMemFree` leaves both, charged, in quarantine). The typed
//!   layer frees only after the token's fence and unmap, so no work can touch it;
//! - **release** of an allocation never placed (a commit that failed after its create) is
//!   `cuMemFree`; of one still placed, it only marks it released (its memory goes with its
//!   reservation's free).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::Driver;
use super::{CudaBackend, CudaPhys, next_serial};
use crate::backend::Refuse;
use crate::backend::{
    Ability, Access, Addr, Backend, BackendError, Op, Violation, address_space_exhausted,
    check_address_space,
};

/// The first placeholder address: above every device address (CUDA's unified address space
/// is 49 bits wide at most), with room below the top for every reservation ever made.
pub(super) const PLACEHOLDER_BASE: Addr = 1 << 60;

/// The plain mechanism's granularity: what every length is rounded to. Not a driver's
/// answer (`cuMemGetAllocationGranularity` is a VMM call): the VMM mechanism's usual
/// recommendation, so that sizes are the same on both.
pub(super) const PLAIN_GRANULARITY: usize = 2 << 20;

/// The plain mechanism, named in its errors.
pub(super) const PLAIN: &str =
    "the CUDA plain-allocation mechanism (cuMemAlloc: the device has no virtual memory management)";

// Each `plain_*` is cold and out of line: the VMM mechanism's calls keep their code as it was
// but for one test of `plain` (see `examples/mechanism_cycle.rs` for the count).
impl<D: Driver> CudaBackend<D> {
    /// A claim on `len` bytes: booked at the next placeholder address, no driver call.
    #[cold]
    #[inline(never)]
    pub(super) fn plain_reserve(&self, len: usize) -> Result<Addr, BackendError> {
        let mut s = self.enter(Op::Reserve, 0, len)?;
        s.book.check_reserve(len).refused(Op::Reserve, 0, len)?;
        check_address_space(len, self.address_space())?;
        // The lowest gap among the placeholders not placed yet (real addresses are all below
        // the base): freed ones are reused, so they never run out while fewer than 2^60 bytes
        // are claimed at once.
        let addr = s
            .book
            .lowest_gap(PLACEHOLDER_BASE, len)
            .ok_or_else(|| address_space_exhausted(len, self.address_space()))?;
        s.book.apply_reserve(addr, len);
        Ok(addr)
    }

    /// A placeholder: forgotten. A placed reservation with nothing mapped: its memory freed
    /// (`cuMemFree`), and its allocation released with it (see [`Backend::placed`]).
    #[cold]
    #[inline(never)]
    pub(super) fn plain_free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let (start, _) = Self::span(Op::Free, addr, len, Violation::NotReserved { addr, len })?;
        let mut s = self.enter(Op::Free, addr, len)?;
        Self::check_not_busy(&s, Op::Free, addr, len)?;
        s.book.check_free(addr, len).refused(Op::Free, addr, len)?;
        if let Some(&phys) = s.placements.get(&addr) {
            // In relaxed mode, and not while a blocking stream captures: `cuMemFree` may
            // synchronize like a use of the legacy stream (fact 59), so it waits, transient.
            let _relaxed = self
                .relaxed()
                .map_err(|e| self.fail(Op::Free, addr, len, e))?;
            self.legacy_usable()
                .map_err(|e| self.fail(Op::Free, addr, len, e))?;
            // SAFETY: `s.placements` holds `addr` only as the start of a live `cuMemAlloc`
            // allocation this backend placed (the handle `plain_create` got), removed below
            // once freed, and `plain_release` frees no allocation it placed: so this frees it
            // once. Nothing is mapped in its reservation (checked above), so no token lends it:
            // the typed layer unmaps only after the token's fence.
            unsafe { self.driver.mem_free(start) }
                .map_err(|e| self.fail(Op::Free, addr, len, e))?;
            s.placements.remove(&addr);
            if s.placed.remove(&phys) {
                // Released with its memory: the typed layer makes no release of its own.
                s.book.apply_release(phys);
            }
        }
        s.free_reservation(addr);
        Ok(())
    }

    /// `cuMemAlloc` of `len` bytes: the allocation is its memory's address.
    #[cold]
    #[inline(never)]
    pub(super) fn plain_create(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let mut s = self.enter(Op::Create, 0, len)?;
        s.book.check_create(len).refused(Op::Create, 0, len)?;
        // A global-mode capture refuses an allocation (fact 42): relaxed, as the VMM calls.
        let _relaxed = self
            .relaxed()
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let handle = self
            .driver
            .mem_alloc(len)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let phys = CudaPhys {
            handle,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    /// Marks `phys` released: placed, its memory goes with its reservation; never placed,
    /// freed now (`cuMemFree`).
    #[cold]
    #[inline(never)]
    pub(super) fn plain_release(&self, phys: CudaPhys, len: usize) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Release, 0, len)?;
        s.book
            .check_release(phys, len)
            .refused(Op::Release, 0, len)?;
        if !s.placed.remove(&phys) {
            let _relaxed = self
                .relaxed()
                .map_err(|e| self.fail(Op::Release, 0, len, e))?;
            self.legacy_usable()
                .map_err(|e| self.fail(Op::Release, 0, len, e))?;
            // SAFETY: `s.book.check_release` above proved `phys` created by `plain_create`
            // (its handle the start of a live `cuMemAlloc` allocation) and not released; it
            // was never placed, so no reservation holds it and no work can use it.
            unsafe { self.driver.mem_free(phys.handle) }
                .map_err(|e| self.fail(Op::Release, 0, len, e))?;
        }
        s.book.apply_release(phys);
        Ok(())
    }

    /// The placement of a fresh allocation over a whole placeholder reservation; every other
    /// map is refused (see the module docs).
    #[cold]
    #[inline(never)]
    pub(super) fn plain_map(
        &self,
        addr: Addr,
        len: usize,
        phys: CudaPhys,
        access: Access,
    ) -> Result<(), BackendError> {
        Self::span(Op::Map, addr, len, Violation::NotReserved { addr, len })?;
        let mut s = self.enter(Op::Map, addr, len)?;
        Self::check_not_busy(&s, Op::Map, addr, len)?;
        let refuse = |ability: Ability| Err(ability.refused(Op::Map, addr, len, PLAIN));
        if access == Access::ReadOnly {
            return refuse(Ability::MapReadOnly);
        }
        if !self.peers.is_empty() {
            return refuse(Ability::PeerAccess);
        }
        s.book
            .check_map(addr, len, phys, 0)
            .refused(Op::Map, addr, len)?;
        if s.placed.contains(&phys) {
            return refuse(Ability::MapTwice);
        }
        // A placement covers exactly one placeholder reservation, nothing mapped in it.
        if addr < PLACEHOLDER_BASE || s.book.check_free(addr, len).is_err() {
            return refuse(Ability::MapAtReservedAddress);
        }
        let ptr = phys.handle as Addr;
        s.free_reservation(addr);
        s.book.apply_reserve(ptr, len);
        s.book.apply_map(ptr, len, phys, Access::ReadWrite);
        s.placements.insert(ptr, phys);
        s.placed.insert(phys);
        Ok(())
    }

    /// Takes the mapping off the record, after the VMM mechanism's checks; no driver call.
    #[cold]
    #[inline(never)]
    pub(super) fn plain_unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        Self::span(Op::Unmap, addr, len, Violation::NotMapped { addr, len })?;
        let mut s = self.enter(Op::Unmap, addr, len)?;
        Self::check_unmappable(&s, addr, len)?;
        s.book.apply_unmap(addr, len);
        Ok(())
    }
}
