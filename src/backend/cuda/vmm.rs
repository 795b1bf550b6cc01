//! The [`Backend`](crate::backend::Backend) implementation of the CUDA backend: the VMM calls —
//! reserve, free, create, release, map, unmap — each checked against the record before it
//! reaches the driver; copies, fences and pins forward to their rooms.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::Driver;
use super::plain::PLAIN;
use super::{CudaBackend, CudaFence, CudaPhys, next_serial};
use crate::backend::Refuse;
use crate::backend::{
    Ability, Access, Addr, Backend, BackendError, Location, Op, Violation, check_address_space,
};
use std::sync::atomic::Ordering;

impl<D: Driver> Backend for CudaBackend<D> {
    type Phys = CudaPhys;
    type Fence = CudaFence;

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn address_space(&self) -> usize {
        // The driver refuses what it cannot reserve; this bounds requests to 48-bit VA.
        1 << 47
    }

    fn physical_capacity(&self) -> u64 {
        self.capacity
    }

    fn location(&self) -> Location {
        Location::Cuda {
            device: self.device,
        }
    }

    // The VMM calls, each checked against the record first.

    /// `cuMemAddressReserve` of `len` bytes, aligned to the granularity.
    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        if self.plain {
            return self.plain_reserve(len);
        }
        let (mut s, _relaxed) = self.enter_vmm(Op::Reserve, 0, len)?;
        s.book.check_reserve(len).refused(Op::Reserve, 0, len)?;
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
    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        if self.plain {
            return self.plain_free(addr, len);
        }
        let (start, end) = Self::span(Op::Free, addr, len, Violation::NotReserved { addr, len })?;
        let (mut s, _relaxed) = self.enter_vmm(Op::Free, addr, len)?;
        Self::check_not_busy(&s, Op::Free, addr, len)?;
        if Self::overlaps(&s.scratch, addr, len) {
            // The backend's own scratch range: not the caller's to free.
            let v = Violation::NotReserved { addr, len };
            return Err(BackendError::refused(Op::Free, addr, len, v));
        }
        self.unmap_inaccessible(&mut s, start, end)
            .map_err(|e| self.fail(Op::Free, addr, len, e))?;
        s.book.check_free(addr, len).refused(Op::Free, addr, len)?;
        // SAFETY: `s.book.check_free` above proved `[addr, addr + len)` exactly one live
        // reservation of this driver with nothing mapped in it (`unmap_inaccessible` unmapped what a failed
        // rollback had left there).
        unsafe { self.driver.mem_address_free(start, len) }
            .map_err(|e| self.fail(Op::Free, addr, len, e))?;
        s.free_reservation(addr);
        Ok(())
    }

    /// `cuMemCreate` of `len` bytes with the backend's plain properties.
    fn create(&self, len: usize) -> Result<CudaPhys, BackendError> {
        if self.plain {
            return self.plain_create(len);
        }
        let (mut s, _relaxed) = self.enter_vmm(Op::Create, 0, len)?;
        s.book.check_create(len).refused(Op::Create, 0, len)?;
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
    fn release(&self, phys: CudaPhys, len: usize) -> Result<(), BackendError> {
        if self.plain {
            return self.plain_release(phys, len);
        }
        let (mut s, _relaxed) = self.enter_vmm(Op::Release, 0, len)?;
        s.book
            .check_release(phys, len)
            .refused(Op::Release, 0, len)?;
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
    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: CudaPhys,
        access: Access,
    ) -> Result<(), BackendError> {
        if self.plain {
            return self.plain_map(addr, len, phys, access);
        }
        let (ptr, end) = Self::span(Op::Map, addr, len, Violation::NotReserved { addr, len })?;
        let (mut s, _relaxed) = self.enter_vmm(Op::Map, addr, len)?;
        Self::check_not_busy(&s, Op::Map, addr, len)?;
        let fail = |e| self.fail(Op::Map, addr, len, e);
        if Self::overlaps(&s.scratch, addr, len) {
            // The backend's own scratch range, waiting to be freed: not the caller's to map.
            let v = Violation::NotReserved { addr, len };
            return Err(BackendError::refused(Op::Map, addr, len, v));
        }
        self.unmap_inaccessible(&mut s, ptr, end).map_err(fail)?;
        s.book
            .check_map(addr, len, phys, 0)
            .refused(Op::Map, addr, len)?;
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
        s.link_mapping(addr, phys);
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
    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        if self.plain {
            return self.plain_unmap(addr, len);
        }
        let (start, end) = Self::span(Op::Unmap, addr, len, Violation::NotMapped { addr, len })?;
        let (mut s, _relaxed) = self.enter_vmm(Op::Unmap, addr, len)?;
        Self::check_unmappable(&s, addr, len)?;
        // SAFETY: `check_unmappable` above proved `[addr, addr + len)` exactly covered by
        // whole live mappings (`s.book.check_unmap`).
        unsafe { self.driver.mem_unmap(addr as u64, len) }
            .map_err(|e| self.fail(Op::Unmap, addr, len, e))?;
        s.book.apply_unmap(addr, len);
        s.inaccessible.retain(|&(p, _)| !(start <= p && p < end));
        Ok(())
    }

    // Copies on the legacy stream: `copy.rs`.

    #[inline]
    fn copy_into_phys(&self, phys: CudaPhys, src: Addr, len: usize) -> Result<(), BackendError> {
        if self.plain {
            // Only copy-on-write copies into unmapped memory: a prefix's, refused before.
            return Err(Ability::MapTwice.refused(Op::Map, src, len, PLAIN));
        }
        self.copy_via_scratch(phys, src, len)
    }

    #[inline]
    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        self.copy_host_to_device(dst, src)
    }

    #[inline]
    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        self.copy_device_to_host(dst, src)
    }

    #[inline]
    fn copy_within(&self, dst: Addr, src: Addr, len: usize) -> Result<(), BackendError> {
        self.copy_device_to_device(dst, src, len)
    }

    // Fences, one event per stream that may use the memory: `fence.rs`.

    #[inline]
    fn fence(&self) -> CudaFence {
        self.record_fence_over(None)
    }

    #[inline]
    fn fence_for(&self, at: &[Addr]) -> CudaFence {
        self.record_fence_over(Some(at))
    }

    #[inline]
    fn fence_done(&self, fence: &CudaFence) -> bool {
        self.poll_fence(fence)
    }

    #[inline]
    fn wait_fence(&self, fence: &CudaFence) -> bool {
        self.block_on_fence(fence)
    }

    #[inline]
    fn retire_fence(&self, fence: CudaFence) {
        self.destroy_fence(fence)
    }

    // The primary context's retains, taken and given back: `open.rs`.

    #[inline]
    fn pin(&self) -> Result<(), BackendError> {
        self.retain_pin()
    }

    #[inline]
    fn unpin(&self) -> Result<(), BackendError> {
        self.release_pin()
    }

    fn context_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// The plain mechanism lacks every ability (fact 59); the VMM one none.
    fn lacks(&self, _ability: Ability) -> Option<&'static str> {
        self.plain.then_some(PLAIN)
    }

    /// The plain mechanism's allocation is its address.
    fn placed(&self, reserved: Addr, phys: CudaPhys) -> Addr {
        if self.plain {
            phys.handle as Addr
        } else {
            reserved
        }
    }

    /// Memory lent to a capture (memtoken's, until its graph goes; another's, for good).
    #[inline]
    fn withheld(&self, addr: Addr, len: usize) -> bool {
        self.held_by_graph(addr, len)
    }
}
