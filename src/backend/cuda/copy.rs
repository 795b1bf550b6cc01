//! Copies: host to device and device to host through the mapped range, and device to device
//! into physical memory through a scratch mapping of the whole handle. Each copy marks the
//! ranges it uses busy and runs outside the record's lock; the legacy stream is waited on
//! before a range is free again (`cuMemcpyHtoD` from pageable memory and `cuMemcpyDtoD` may
//! return before the bytes have landed).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::{CuError, CuResult, Driver};
use super::record::{CudaState, Unsettled};
use super::{CudaBackend, CudaPhys, next_serial};
use crate::backend::Refuse;
use crate::backend::{Access, Addr, Backend, BackendError, Cause, Op, Violation, lock};

impl<D: Driver> CudaBackend<D> {
    /// Copies `len` bytes at `src` into `phys`: maps the whole handle at a scratch range,
    /// starts the copy, and waits for it outside the lock (the source and the scratch range are
    /// busy meanwhile); then takes the scratch range down again.
    pub(super) fn copy_via_scratch(
        &self,
        phys: CudaPhys,
        src: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        let fail = |e| self.fail(Op::Copy, src, len, e);
        let Started {
            scratch,
            copied,
            marks,
        } = self.start_copy(phys, src, len)?;
        // The copy runs on the legacy stream: wait for it there, outside the lock, so that
        // drops, fences and polls on other threads go on meanwhile.
        let waited = match copied {
            Ok(()) => self.wait_legacy(),
            Err(_) => Ok(()), // nothing was started
        };
        if let Err(e) = waited
            && e.is_context_loss()
        {
            return Err(fail(e)); // no call after it: the driver freed everything
        }
        // Under the lock before the context is made current: whatever happens next, the
        // record stays true.
        let mut s = lock(&self.state);
        if let Err(e) = waited {
            // The copy is not known to have finished: its ranges stay busy and the scratch range
            // stays mapped — never reused, never freed under a copy that may still run — until
            // an event recorded on the legacy stream after it has completed.
            s.unsettled.push(Unsettled {
                after: next_serial(),
                marks: vec![marks.0, marks.1],
                scratch: Some((scratch, len)),
            });
            return Err(fail(e));
        }
        s.busy.retain(|&(id, _, _)| id != marks.0 && id != marks.1);
        // The scratch range's teardown (fact 40); if the mode cannot be relaxed, a later sweep
        // takes it down (never left in no list).
        let _relaxed = match self.relaxed() {
            Ok(relaxed) => relaxed,
            Err(e) => {
                if !self.context_lost() {
                    s.inaccessible.push((scratch, len));
                    s.scratch.push((scratch, len));
                }
                return Err(fail(e));
            }
        };
        if self.context_lost() {
            return Err(BackendError::new(Op::Copy, src, len, Cause::ContextLost));
        }
        self.take_down_scratch(&mut s, scratch, len).map_err(fail)?;
        copied.map_err(fail)
    }

    /// The part of [`copy_via_scratch`](Self::copy_via_scratch) under the lock: checks the
    /// copy, maps `phys` at a new scratch range with access, starts the copy and marks the
    /// source and the scratch range busy.
    fn start_copy(&self, phys: CudaPhys, src: Addr, len: usize) -> Result<Started, BackendError> {
        let fail = |e| self.fail(Op::Copy, src, len, e);
        let (span, d) = (len, &self.driver);
        let mut s = self.enter(Op::Copy, src, len)?;
        self.legacy_usable().map_err(fail)?;
        let _relaxed = self.relaxed().map_err(fail)?; // the scratch range's VMM calls (fact 40)
        self.sweep_scratch(&mut s).map_err(fail)?;
        s.book
            .check_copy(phys, src, len)
            .refused(Op::Copy, src, len)?;
        if s.imported.contains(&phys) {
            let v = Violation::Import("imported memory is written never");
            return Err(BackendError::refused(Op::Copy, src, len, v));
        }
        if Self::overlaps(&s.inaccessible, src, len) {
            let v = Violation::NotMapped { addr: src, len };
            return Err(BackendError::refused(Op::Copy, src, len, v));
        }
        // The copy runs on the legacy stream: after the work that may write the source (its
        // memory's streams, an owner's among them for a sharer's mapping).
        self.order_legacy_after(&mut s, src).map_err(fail)?;
        // SAFETY: `s.book.check_copy` above proved `phys` live with exactly `span` bytes, under
        // the lock `s` still holds.
        let scratch = unsafe { self.map_scratch(&mut s, phys, span) }.map_err(fail)?;
        // The scratch range is the backend's own, for this copy only: no peer gets access.
        // SAFETY: the scratch range was mapped, exactly, just above, and is given
        // read-write access before the copy writes to it; `s.book.check_copy` above proved
        // every byte of the source mapped, and the `s.inaccessible` check that it has access. Both
        // stay mapped until the copy has finished: the source and the scratch range are
        // marked busy below (unmap, free and map refuse busy ranges) until the wait in
        // `copy_via_scratch`.
        let copied = unsafe {
            d.mem_set_access(scratch, span, &[(self.device, true)])
                .and_then(|()| d.memcpy_dtod(scratch, src as u64, len))
        };
        if let Err(e) = copied
            && e.is_context_loss()
        {
            return Err(fail(e));
        }
        let marks = (
            Self::mark_busy(&mut s, src as u64, len),
            Self::mark_busy(&mut s, scratch, span),
        );
        Ok(Started {
            scratch,
            copied,
            marks,
        })
    }

    /// Reserves a scratch range of `span` bytes and maps the whole of `phys` there (without
    /// access yet); returns its address. A failed map frees the reservation again, or leaves it
    /// to the next sweep.
    ///
    /// # Safety
    ///
    /// `s.book.check_copy` proved `phys` live (so its handle is: see `release_memory`) with
    /// exactly `span` bytes, under the lock `s` holds.
    unsafe fn map_scratch(&self, s: &mut CudaState, phys: CudaPhys, span: usize) -> CuResult<u64> {
        let d = &self.driver;
        let scratch = d.mem_address_reserve(span, self.granularity, 0)?;
        s.book.apply_reserve(scratch as Addr, span);
        // SAFETY: `scratch` is a reservation of `span` bytes made just above, nothing
        // mapped in it; the caller proved `phys` live (so its handle is: see
        // `release_memory`) with exactly `span` bytes, all mapped from offset 0.
        if let Err(e) = unsafe { d.mem_map(scratch, span, 0, phys.handle) } {
            if e.is_context_loss() {
                return Err(e);
            }
            // SAFETY: the fresh scratch reservation, exactly, with nothing mapped in it.
            match unsafe { d.mem_address_free(scratch, span) } {
                Ok(()) => s.free_reservation(scratch as Addr),
                Err(freed) if freed.is_context_loss() => return Err(freed),
                Err(_) => s.scratch.push((scratch, span)),
            }
            return Err(e);
        }
        s.book
            .apply_map(scratch as Addr, span, phys, Access::ReadWrite);
        Ok(scratch)
    }

    /// Takes a finished copy's scratch range down: unmaps and frees it, under the lock `s`
    /// holds; what cannot be taken down now is left to a later sweep. An error is what the
    /// copy fails with.
    fn take_down_scratch(&self, s: &mut CudaState, scratch: u64, span: usize) -> CuResult<()> {
        let d = &self.driver;
        // SAFETY: `self.ctx` is live until the backend is dropped (see `enter`).
        if let Err(e) = unsafe { d.ctx_set_current(self.ctx) } {
            // Not current: the scratch range is taken down by a later sweep.
            s.inaccessible.push((scratch, span));
            s.scratch.push((scratch, span));
            return Err(e);
        }
        // SAFETY: the scratch range was mapped, exactly, above, and nothing else unmapped it
        // (it was busy, and is the backend's own).
        match unsafe { d.mem_unmap(scratch, span) } {
            Ok(()) => {
                s.book.apply_unmap(scratch as Addr, span);
                // SAFETY: the scratch reservation, exactly, its one mapping just unmapped.
                match unsafe { d.mem_address_free(scratch, span) } {
                    Ok(()) => s.free_reservation(scratch as Addr),
                    Err(e) if e.is_context_loss() => return Err(e),
                    Err(_) => s.scratch.push((scratch, span)),
                }
            }
            Err(e) if e.is_context_loss() => return Err(e),
            Err(_) => {
                // Still mapped: unmapped (and then freed) before anything reuses the range.
                s.inaccessible.push((scratch, span));
                s.scratch.push((scratch, span));
            }
        }
        Ok(())
    }

    /// Copies `src` to the device memory at `dst`, and waits for it to land.
    pub(super) fn copy_host_to_device(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let len = src.len();
        let fail = |e| self.fail(Op::Copy, dst, len, e);
        let busy = self.hold(dst, len, true)?;
        if len == 0 {
            return Ok(()); // nothing to copy: no driver call with an address that may be none
        }
        self.legacy_usable().map_err(fail)?;
        self.ordered_after_uses(dst).map_err(fail)?;
        // SAFETY: `hold` proved every byte of the destination mapped read-write with access in
        // the record, and keeps the range from being unmapped, freed or mapped over until
        // `busy` is released, once the copy has landed (below).
        unsafe { self.driver.memcpy_htod(dst as u64, src) }.map_err(fail)?;
        // From pageable memory the call returns once the bytes are staged; the DMA to the
        // destination may still run on the legacy stream: wait for it before the range is free.
        self.land(vec![busy.id], busy, fail)
    }

    /// Copies `len` bytes of device memory at `src` to `dst` (`cuMemcpyDtoD` on the legacy
    /// stream, after the work that may use either range), and waits for it to land.
    pub(super) fn copy_device_to_device(
        &self,
        dst: Addr,
        src: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        let fail = |e| self.fail(Op::Copy, dst, len, e);
        if src < dst.saturating_add(len) && dst < src.saturating_add(len) {
            // `cuMemcpyDtoD` of overlapping ranges is undefined.
            let v = Violation::OverlappingCopy { src, dst, len };
            return Err(BackendError::refused(Op::Copy, dst, len, v));
        }
        let from = self.hold(src, len, false)?;
        let to = self.hold(dst, len, true)?;
        if len == 0 {
            return Ok(()); // nothing to copy: no driver call with an address that may be none
        }
        self.legacy_usable().map_err(fail)?;
        self.ordered_after_uses(src).map_err(fail)?;
        self.ordered_after_uses(dst).map_err(fail)?;
        // SAFETY: `hold` proved every byte of the source mapped with access and of the
        // destination mapped read-write with access in the record, and keeps both from being
        // unmapped, freed or mapped over until the copy has landed (below).
        unsafe { self.driver.memcpy_dtod(dst as u64, src as u64, len) }.map_err(fail)?;
        // Device to device: the call returns before the copy ran. Wait for it.
        self.land(vec![from.id, to.id], (from, to), fail)
    }

    /// Copies the device memory at `src` to `dst` (synchronous).
    pub(super) fn copy_device_to_host(
        &self,
        dst: &mut [u8],
        src: Addr,
    ) -> Result<(), BackendError> {
        let len = dst.len();
        let _busy = self.hold(src, len, false)?;
        if len == 0 {
            return Ok(()); // nothing to copy: no driver call with an address that may be none
        }
        self.legacy_usable()
            .map_err(|e| self.fail(Op::Copy, src, len, e))?;
        self.ordered_after_uses(src)
            .map_err(|e| self.fail(Op::Copy, src, len, e))?;
        // SAFETY: `hold` proved every byte of the source mapped with access in the record, and
        // keeps the range from being unmapped, freed or mapped over until `_busy` is dropped,
        // after the (synchronous) copy.
        unsafe { self.driver.memcpy_dtoh(dst, src as u64) }
            .map_err(|e| self.fail(Op::Copy, src, len, e))
    }

    /// [`order_legacy_after`](Self::order_legacy_after) under the record's lock, for a host
    /// copy of the memory at `addr` about to start.
    fn ordered_after_uses(&self, addr: Addr) -> CuResult<()> {
        let Ok(mut s) = self.enter(Op::Copy, addr, 0) else {
            return Err(CuError::CONTEXT_IS_DESTROYED);
        };
        self.order_legacy_after(&mut s, addr)
    }

    /// Checks that `[addr, addr + len)` is mapped with access (read-write if `write`) and marks
    /// it busy until the returned guard drops, so that a copy can use it outside the lock.
    fn hold(&self, addr: Addr, len: usize, write: bool) -> Result<Busy<'_, D>, BackendError> {
        let mut s = self.enter(Op::Copy, addr, len)?;
        Self::check_mapped(&s, Op::Copy, addr, len, write)?;
        Ok(Busy {
            backend: self,
            id: Self::mark_busy(&mut s, addr as u64, len),
        })
    }

    /// Marks `[addr, addr + len)` busy; returns the mark's serial, to unmark exactly it.
    fn mark_busy(s: &mut CudaState, addr: u64, len: usize) -> u64 {
        let id = next_serial();
        s.busy.push((id, addr, len));
        id
    }

    /// Whether the legacy stream, where copies run, may be used now: not while a blocking stream
    /// of the context captures, which the probe answers with 906 and a use would invalidate
    /// (fact 41). The copy is then refused before anything starts (a transient error).
    pub(super) fn legacy_usable(&self) -> CuResult<()> {
        // SAFETY: 0 is the legacy stream, always live.
        unsafe { self.driver.stream_is_capturing(0) }.map(drop)
    }

    /// Settles the copies whose wait failed before the serial `upto` was taken, now that what
    /// it stands for has completed: an event of this backend's on the legacy stream created
    /// then, or a synchronize of the legacy stream begun then. Their busy marks go, their
    /// scratch ranges are taken down.
    pub(super) fn settle_copies(&self, s: &mut CudaState, upto: u64) {
        if s.unsettled.iter().all(|u| u.after >= upto) {
            return;
        }
        let Ok(_relaxed) = self.relaxed() else {
            return; // lost: nothing more is called
        };
        let (done, kept) = std::mem::take(&mut s.unsettled)
            .into_iter()
            .partition(|u| u.after < upto);
        s.unsettled = kept;
        for u in done {
            s.busy.retain(|&(id, _, _)| !u.marks.contains(&id));
            // A failure leaves the range to a later sweep; a loss is noted, and nothing more
            // is called (the driver freed the rest).
            if let Some((scratch, span)) = u.scratch
                && let Err(e) = self.take_down_scratch(s, scratch, span)
                && e.is_context_loss()
            {
                let _ = self.fail(Op::Copy, 0, 0, e);
                return;
            }
        }
    }

    /// Frees scratch reservations left by failed copies, unmapping them first if needed.
    pub(super) fn sweep_scratch(&self, s: &mut CudaState) -> CuResult<()> {
        for (addr, span) in std::mem::take(&mut s.scratch) {
            let freed = self
                .unmap_inaccessible(s, addr, addr + span as u64)
                .and_then(|()| {
                    if s.book.check_free(addr as Addr, span).is_err() {
                        // Not expected (`map` refuses scratch ranges): kept, and tried again later.
                        return Err(CuError::INVALID_VALUE);
                    }
                    // SAFETY: `check_free` just proved `[addr, addr + span)` exactly one live
                    // reservation of the record with nothing mapped in it (`unmap_inaccessible` unmapped the
                    // copy's mapping, if the copy left one).
                    unsafe { self.driver.mem_address_free(addr, span) }
                });
            match freed {
                Ok(()) => s.free_reservation(addr as Addr),
                Err(e) => {
                    s.scratch.push((addr, span));
                    if e.is_context_loss() {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits for a copy on the legacy stream to land. Where that is not known (the wait
    /// failed, the context not lost), the copy's ranges stay busy — `held` forgotten, its
    /// `marks` kept — until an event recorded on the legacy stream after it has completed.
    fn land<H>(
        &self,
        marks: Vec<u64>,
        held: H,
        fail: impl FnOnce(CuError) -> BackendError,
    ) -> Result<(), BackendError> {
        let Err(e) = self.wait_legacy() else {
            return Ok(());
        };
        if !e.is_context_loss() {
            std::mem::forget(held);
            let after = next_serial();
            lock(&self.state).unsettled.push(Unsettled {
                after,
                marks,
                scratch: None,
            });
        }
        Err(fail(e))
    }
}

/// A copy [`start_copy`](CudaBackend::start_copy) started.
struct Started {
    /// The scratch range `phys` is mapped at, to be taken down once the copy has finished.
    scratch: u64,
    /// What starting the copy returned: an error here is not a loss (nothing was started, and
    /// the scratch range is still to be taken down).
    copied: CuResult<()>,
    /// The busy marks of the source and of the scratch range.
    marks: (u64, u64),
}

/// A range marked busy by a copy running outside the lock; unmarked when dropped (and only
/// this mark: another copy may hold the same range).
struct Busy<'a, D: Driver> {
    backend: &'a CudaBackend<D>,
    id: u64,
}

impl<D: Driver> Drop for Busy<'_, D> {
    fn drop(&mut self) {
        lock(&self.backend.state)
            .busy
            .retain(|&(id, _, _)| id != self.id);
    }
}
