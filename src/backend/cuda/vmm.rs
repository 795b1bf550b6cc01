//! The VMM calls — reserve, free, create, release, map, unmap — each checked against the
//! record before it reaches the driver ([`Backend`](crate::backend::Backend)'s methods of the
//! same names forward here).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::Driver;
use super::{CudaBackend, CudaPhys, next_serial};
use crate::backend::{Access, Addr, Backend, BackendError, Op, Violation, check_address_space};

impl<D: Driver> CudaBackend<D> {
    /// `cuMemAddressReserve` of `len` bytes, aligned to the granularity.
    pub(super) fn reserve_va(&self, len: usize) -> Result<Addr, BackendError> {
        let mut s = self.enter(Op::Reserve, 0, len)?;
        s.book
            .check_reserve(len)
            .map_err(|v| BackendError::refused(Op::Reserve, 0, len, v))?;
        check_address_space(len, self.address_space())?;
        let ptr = self
            .driver
            .mem_address_reserve(len, self.granularity, 0)
            .map_err(|e| self.fail(Op::Reserve, 0, len, e))?;
        s.book.apply_reserve(ptr as Addr, len);
        Ok(ptr as Addr)
    }

    /// `cuMemAddressFree` of exactly one reservation with nothing mapped in it, after
    /// unmapping what a failed rollback left there.
    pub(super) fn free_va(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let (start, end) = Self::span(Op::Free, addr, len, Violation::NotReserved { addr, len })?;
        let mut s = self.enter(Op::Free, addr, len)?;
        Self::check_not_busy(&s, Op::Free, addr, len)?;
        if Self::overlaps(&s.scratch, addr, len) {
            // The backend's own scratch range: not the caller's to free.
            let v = Violation::NotReserved { addr, len };
            return Err(BackendError::refused(Op::Free, addr, len, v));
        }
        self.unstick(&mut s, start, end)
            .map_err(|e| self.fail(Op::Free, addr, len, e))?;
        s.book
            .check_free(addr, len)
            .map_err(|v| BackendError::refused(Op::Free, addr, len, v))?;
        // SAFETY: `s.book.check_free` above proved `[addr, addr + len)` exactly one live
        // reservation of this driver with nothing mapped in it (`unstick` unmapped what a failed
        // rollback had left there).
        unsafe { self.driver.mem_address_free(start, len) }
            .map_err(|e| self.fail(Op::Free, addr, len, e))?;
        s.book.apply_free(addr);
        Ok(())
    }

    /// `cuMemCreate` of `len` bytes with the backend's plain properties.
    pub(super) fn create_memory(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let mut s = self.enter(Op::Create, 0, len)?;
        s.book
            .check_create(len)
            .map_err(|v| BackendError::refused(Op::Create, 0, len, v))?;
        let handle = self
            .driver
            .mem_create_with(len, self.props)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let phys = CudaPhys {
            handle,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    /// `cuMemRelease` of memory this backend created or imported and has not released.
    pub(super) fn release_memory(&self, phys: CudaPhys, len: usize) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Release, 0, len)?;
        s.book
            .check_release(phys, len)
            .map_err(|v| BackendError::refused(Op::Release, 0, len, v))?;
        // SAFETY: `s.book.check_release` above proved `phys` created by this backend through
        // this driver and not released, so its handle is live: the record marks `phys` released
        // once its handle is, and a value the driver hands out again gets a new serial.
        unsafe { self.driver.mem_release(phys.handle) }
            .map_err(|e| self.fail(Op::Release, 0, len, e))?;
        s.book.apply_release(phys);
        s.exportable.remove(&phys);
        s.imported.remove(&phys);
        Ok(())
    }

    /// `cuMemMap` of the whole handle at `addr`, then `cuMemSetAccess` for this device and
    /// every peer in one call; a map whose access cannot be set is rolled back.
    pub(super) fn map_memory(
        &self,
        addr: Addr,
        len: usize,
        phys: CudaPhys,
        access: Access,
    ) -> Result<(), BackendError> {
        let (ptr, end) = Self::span(Op::Map, addr, len, Violation::NotReserved { addr, len })?;
        let mut s = self.enter(Op::Map, addr, len)?;
        Self::check_not_busy(&s, Op::Map, addr, len)?;
        let fail = |e| self.fail(Op::Map, addr, len, e);
        if Self::overlaps(&s.scratch, addr, len) {
            // The backend's own scratch range, waiting to be freed: not the caller's to map.
            let v = Violation::NotReserved { addr, len };
            return Err(BackendError::refused(Op::Map, addr, len, v));
        }
        self.unstick(&mut s, ptr, end).map_err(fail)?;
        s.book
            .check_map(addr, len, phys, 0)
            .map_err(|v| BackendError::refused(Op::Map, addr, len, v))?;
        if access == Access::ReadWrite && s.imported.contains(&phys) {
            let v = Violation::Import("imported memory is mapped read-only only");
            return Err(BackendError::refused(Op::Map, addr, len, v));
        }
        // SAFETY: `s.book.check_map` above proved `[addr, addr + len)` inside a live
        // reservation with nothing mapped there, and `phys` live (so its handle is: see
        // `release`) with exactly `len` bytes, all mapped from offset 0 — for an imported
        // handle, `len` is what the import was checked to hold where the driver can say
        // (`mem_allocation_size`), and otherwise what the peer's message claims, which the
        // driver refuses at the map if it is wrong (assumptions 7 and 8 in the module docs).
        unsafe { self.driver.mem_map(ptr, len, 0, phys.handle) }.map_err(fail)?;
        s.book.apply_map(addr, len, phys, access);
        // This device and every peer, in one call: no mapping has one's access without all.
        let grants = match access {
            Access::ReadWrite => &self.grant_rw,
            Access::ReadOnly => &self.grant_ro,
        };
        // SAFETY: the range was mapped, exactly, just above.
        let Err(e) = (unsafe { self.driver.mem_set_access(ptr, len, grants) }) else {
            return Ok(());
        };
        if e.is_context_loss() {
            return Err(fail(e));
        }
        // Roll the map back: nothing stays mapped without its access. If even that fails, the
        // mapping is remembered and unmapped before its range is mapped again or freed.
        // SAFETY: the range was mapped, exactly, just above.
        match unsafe { self.driver.mem_unmap(ptr, len) } {
            Ok(()) => s.book.apply_unmap(addr, len),
            Err(rollback) => {
                s.inaccessible.push((ptr, len));
                if rollback.is_context_loss() {
                    return Err(fail(rollback));
                }
            }
        }
        Err(fail(e))
    }

    /// `cuMemUnmap` of whole mappings exactly covering `[addr, addr + len)`.
    pub(super) fn unmap_va(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let (start, end) = Self::span(Op::Unmap, addr, len, Violation::NotMapped { addr, len })?;
        let mut s = self.enter(Op::Unmap, addr, len)?;
        Self::check_not_busy(&s, Op::Unmap, addr, len)?;
        s.book
            .check_unmap(addr, len)
            .map_err(|v| BackendError::refused(Op::Unmap, addr, len, v))?;
        // SAFETY: `s.book.check_unmap` above proved `[addr, addr + len)` exactly covered by
        // whole live mappings.
        unsafe { self.driver.mem_unmap(addr as u64, len) }
            .map_err(|e| self.fail(Op::Unmap, addr, len, e))?;
        s.book.apply_unmap(addr, len);
        s.inaccessible.retain(|&(p, _)| !(start <= p && p < end));
        Ok(())
    }
}
