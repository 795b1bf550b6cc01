//! CUDA VMM through a thin [`Driver`] seam: `cuMemAddressReserve`, `cuMemCreate` (pinned
//! device memory), `cuMemMap` + `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemAddressFree`, with the recommended granularity and events as fences.
//!
//! The backend holds the logic (current context, rollback of a half-done map, loss detection);
//! the driver only forwards. With feature `cuda`, `SysDriver` forwards to
//! `cudarc::driver::sys` (loaded at run time: it builds with no CUDA toolkit, and
//! [`CudaBackend::open`] returns an error, never panics, when no driver is installed). On any
//! machine, [`DriverModel`] stands in for the driver with the VMM rules, events, context loss
//! and fault injection, so the whole state machine runs in `cargo test`.
//!
//! After an error that means the context is lost (a sticky error such as
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, or `CUDA_ERROR_CONTEXT_IS_DESTROYED`), the backend makes no
//! driver call at all: every call fails with [`Cause::ContextLost`] and
//! [`Backend::context_lost`] is true, so the typed layer quarantines instead of calling, and
//! residuals can be discharged with the proof.

mod driver;
mod model;
#[cfg(feature = "cuda")]
mod sys;

pub use driver::{Context, CuError, CuResult, Driver, DriverCall, ErrorFate, Event, Stream};
pub use model::{DriverModel, ModelConfig, ModelOutstanding};
#[cfg(feature = "cuda")]
pub use sys::SysDriver;

use super::rules::Book;
use super::{Access, Addr, Backend, BackendError, Cause, Op, Violation, check_address_space, lock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A CUDA physical allocation: the driver's handle (`CUmemGenericAllocationHandle`) and a
/// serial number of the backend's. The driver promises no unique handle values (a released
/// handle's value may come back from a later `cuMemCreate`, even while the old memory is still
/// mapped), so the backend keys its record by the pair: a stale `CudaPhys` is refused even when
/// its handle's value has come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaPhys {
    handle: u64,
    serial: u64,
}

impl CudaPhys {
    /// The raw handle.
    pub fn handle(self) -> u64 {
        self.handle
    }
}

/// A fence: an event recorded on the backend's stream, or, when none could be recorded, the
/// stream itself (done once the stream is idle). It names its event by a serial number of the
/// backend's, which the backend's record maps to the driver's event: a destroyed event's value
/// may come back from a later `cuEventCreate`, and must not be taken for this fence's.
#[derive(Debug)]
pub struct CudaFence(Option<u64>);

/// A serial number never handed out before in this process: physical memory and fences of
/// every CUDA backend are keyed by one, never by a value the driver may hand out again.
fn next_serial() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Why a CUDA backend could not be opened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library could be loaded on this machine.
    #[error("no CUDA driver found (libcuda could not be loaded): {0}")]
    NoDriver(String),
    /// A driver call failed while opening the device.
    #[error("opening the CUDA device failed: {call:?} returned {error}")]
    Driver {
        /// The call that failed.
        call: DriverCall,
        /// What it returned.
        error: CuError,
    },
}

/// CUDA virtual memory management on one device, over driver `D`.
///
/// **What a fence covers.** Fences are events recorded on the legacy default stream (stream 0,
/// cudarc's `default_stream()`), which waits for all *blocking* streams. Work on a stream made
/// with `CU_STREAM_NON_BLOCKING` (cudarc's `new_stream()`) is not covered: make the legacy
/// stream wait for such a stream (an event, or a synchronize) before releasing memory it uses.
///
/// **Other driver facts to know.** Every call makes this device's primary context current on
/// the calling thread (and leaves it so). `cuMemUnmap` synchronizes with the device; the typed
/// layer unmaps only after the memory's fence completed, so nothing is left to wait for, but a
/// drop still makes that call. After a sticky error no call is made at all — so the primary
/// context's retains are not released either; a process that wants the device back must reset
/// it (`cuDevicePrimaryCtxReset`) itself.
///
/// A committed allocation on it gives its `device_ptr()` for kernel arguments and
/// `copy_from_host` / `copy_to_host` for copies; prefixes, mappings and page tables have copies
/// too.
///
/// Host slices are for host memory only: a CUDA token has no `as_slice`.
///
/// ```compile_fail,E0599
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::cuda::{CudaBackend, DriverModel};
/// make_guard!(guard);
/// let device = Device::new(guard, CudaBackend::new(DriverModel::default(), 0).unwrap());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let gpu = binding.reserve(1).unwrap().commit().unwrap();
/// let bytes: &[u8] = gpu.as_slice(); // device memory is not a host slice
/// ```
#[derive(Debug)]
pub struct CudaBackend<D: Driver> {
    driver: D,
    device: i32,
    ctx: Context,
    granularity: usize,
    capacity: u64,
    stream: Stream,
    lost: AtomicBool,
    /// What this backend handed out and the driver still holds: every call is checked against
    /// it before it reaches the driver, so no safe call can pass the driver a stale or foreign
    /// handle (which the driver does not promise to survive: see [`Driver`'s rules](Driver#safety)).
    state: Mutex<CudaState>,
}

#[derive(Debug)]
struct CudaState {
    /// Physical memory keyed by [`CudaPhys`] (handle and serial), never by the handle alone.
    book: Book<CudaPhys>,
    /// Live events this backend created, by the serial their fence names.
    events: HashMap<u64, Event>,
    /// Serials of events no fence refers to any more whose destruction failed: retried later.
    retired: Vec<u64>,
    /// Mappings whose access could not be set and whose rollback unmap failed too: unmapped
    /// before their range is mapped again or freed, and on drop.
    stuck: Vec<(u64, usize)>,
    /// Scratch reservations of copy-on-write whose teardown failed: (address, length).
    /// Retried by the next copy and on drop.
    scratch: Vec<(u64, usize)>,
    /// Context retains taken by [`Backend::pin`] and not yet given back by [`Backend::unpin`]
    /// (the retain taken when opening is not counted: it is given back on drop).
    pins: u64,
}

impl<D: Driver> CudaBackend<D> {
    /// Opens device `ordinal` through `driver`: initializes the driver, retains the device's
    /// primary context (released on drop) and reads the recommended granularity.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] with the call that failed.
    pub fn new(driver: D, ordinal: i32) -> Result<Self, CudaError> {
        let at = |call| move |error| CudaError::Driver { call, error };
        driver.init().map_err(at(DriverCall::Init))?;
        let device = driver
            .device_get(ordinal)
            .map_err(at(DriverCall::DeviceGet))?;
        let ctx = driver
            .primary_ctx_retain(device)
            .map_err(at(DriverCall::PrimaryCtxRetain))?;
        let opened = (|| {
            // SAFETY: `ctx` was retained just above from this driver and is not released.
            unsafe { driver.ctx_set_current(ctx) }.map_err(at(DriverCall::CtxSetCurrent))?;
            let granularity = driver
                .mem_get_allocation_granularity(device)
                .map_err(at(DriverCall::MemGetAllocationGranularity))?;
            let capacity = driver
                .device_total_mem(device)
                .map_err(at(DriverCall::DeviceTotalMem))?;
            Ok((granularity, capacity as u64))
        })();
        let (granularity, capacity) = match opened {
            Ok(v) => v,
            Err(e) => {
                // No call into a context a sticky error took down.
                if !matches!(e, CudaError::Driver { error, .. } if error.is_context_loss()) {
                    // SAFETY: gives back the one retain taken just above, once.
                    let _ = unsafe { driver.primary_ctx_release(device) };
                }
                return Err(e);
            }
        };
        Ok(Self {
            driver,
            device,
            ctx,
            granularity,
            capacity,
            stream: 0,
            lost: AtomicBool::new(false),
            state: Mutex::new(CudaState {
                book: Book::new(granularity, true),
                events: HashMap::new(),
                retired: Vec::new(),
                stuck: Vec::new(),
                scratch: Vec::new(),
                pins: 0,
            }),
        })
    }

    /// The device ordinal's `CUdevice`.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Locks the record and makes the context current, unless the context is lost. Calls hold
    /// the lock across the driver call, so a check and its call cannot be separated by another.
    fn enter(
        &self,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<MutexGuard<'_, CudaState>, BackendError> {
        if self.context_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        let state = lock(&self.state);
        if self.context_lost() {
            // Another thread found the loss while this one waited for the record.
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        // SAFETY: `self.ctx` was retained from this driver in `new` and is given back only in
        // `drop`, so it is live.
        unsafe { self.driver.ctx_set_current(self.ctx) }
            .map_err(|e| self.fail(op, addr, len, e))?;
        Ok(state)
    }

    fn fail(&self, op: Op, addr: Addr, len: usize, e: CuError) -> BackendError {
        if e.is_context_loss() {
            self.lost.store(true, Ordering::Release);
        }
        let cause = Cause::Driver {
            code: e.0,
            name: e.name(),
        };
        BackendError::new(op, addr, len, cause)
    }

    /// Checks that `[addr, addr + len)` is mapped with access (read-write if `write`). A
    /// mapping left by a failed rollback has no access.
    fn check_mapped(
        s: &CudaState,
        op: Op,
        addr: Addr,
        len: usize,
        write: bool,
    ) -> Result<(), BackendError> {
        let book = &s.book;
        let not_mapped =
            || BackendError::refused(op, addr, len, Violation::NotMapped { addr, len });
        let (mut at, end) = (addr, addr.checked_add(len).ok_or_else(not_mapped)?);
        if Self::overlaps(&s.stuck, addr, len) {
            return Err(not_mapped());
        }
        while at < end {
            let (_, _, run, access) = book.resolve(at).ok_or_else(not_mapped)?;
            if write && access != Access::ReadWrite {
                return Err(not_mapped());
            }
            at += run;
        }
        Ok(())
    }

    /// Copies `src` from the host to device memory at `dst`, which must be mapped read-write.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`] if it is not; the driver's error.
    pub fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let s = self.enter(Op::Copy, dst, src.len())?;
        Self::check_mapped(&s, Op::Copy, dst, src.len(), true)?;
        // SAFETY: `check_mapped` above proved every byte of the destination mapped read-write
        // with access in the record, and the record's lock, held across the call, keeps it so.
        unsafe { self.driver.memcpy_htod(dst as u64, src) }
            .map_err(|e| self.fail(Op::Copy, dst, src.len(), e))
    }

    /// Copies device memory at `src`, which must be mapped, to the host.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`] if it is not; the driver's error.
    pub fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let len = dst.len();
        let s = self.enter(Op::Copy, src, len)?;
        Self::check_mapped(&s, Op::Copy, src, len, false)?;
        // SAFETY: `check_mapped` above proved every byte of the source mapped with access in
        // the record, and the record's lock, held across the call, keeps it so.
        unsafe { self.driver.memcpy_dtoh(dst, src as u64) }
            .map_err(|e| self.fail(Op::Copy, src, len, e))
    }

    /// Whether any listed range overlaps `[addr, addr + len)`.
    fn overlaps(ranges: &[(u64, usize)], addr: Addr, len: usize) -> bool {
        let (start, end) = (addr as u64, (addr + len) as u64);
        ranges.iter().any(|&(p, n)| p < end && start < p + n as u64)
    }

    /// Unmaps what a failed rollback left mapped in `[start, end)`; what still fails stays.
    fn unstick(&self, s: &mut CudaState, start: u64, end: u64) -> CuResult<()> {
        let (inside, outside): (Vec<_>, Vec<_>) =
            s.stuck.drain(..).partition(|&(p, _)| start <= p && p < end);
        s.stuck = outside;
        let mut result = Ok(());
        for (ptr, size) in inside {
            // SAFETY: a range is in `s.stuck` only while the driver still holds it mapped
            // exactly (a map whose rollback unmap failed, still in the book as mapped), and it
            // leaves the list when unmapped; the record's lock is held.
            match unsafe { self.driver.mem_unmap(ptr, size) } {
                Ok(()) => s.book.apply_unmap(ptr as Addr, size),
                Err(e) => {
                    s.stuck.push((ptr, size));
                    if e.is_context_loss() {
                        return Err(e);
                    }
                    result = result.and(Err(e));
                }
            }
        }
        result
    }

    /// Frees scratch reservations left by failed copies, unmapping them first if needed.
    fn sweep_scratch(&self, s: &mut CudaState) -> CuResult<()> {
        for (addr, span) in std::mem::take(&mut s.scratch) {
            let freed = self.unstick(s, addr, addr + span as u64).and_then(|()| {
                if s.book.check_free(addr as Addr, span).is_err() {
                    // Not expected (`map` refuses scratch ranges): kept, and tried again later.
                    return Err(CuError::INVALID_VALUE);
                }
                // SAFETY: `check_free` just proved `[addr, addr + span)` exactly one live
                // reservation of the record with nothing mapped in it (`unstick` unmapped the
                // copy's mapping, if the copy left one).
                unsafe { self.driver.mem_address_free(addr, span) }
            });
            match freed {
                Ok(()) => s.book.apply_free(addr as Addr),
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
}

#[cfg(feature = "cuda")]
impl CudaBackend<SysDriver> {
    /// Opens device `ordinal` through the real driver, loaded at run time.
    ///
    /// # Errors
    ///
    /// [`CudaError::NoDriver`] when no CUDA driver is installed (checked before any call, so
    /// this never panics), [`CudaError::Driver`] when a call fails.
    pub fn open(ordinal: i32) -> Result<Self, CudaError> {
        Self::new(SysDriver::load()?, ordinal)
    }
}

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

    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        let mut s = self.enter(Op::Reserve, 0, len)?;
        s.book
            .check_reserve(len)
            .map_err(|v| BackendError::refused(Op::Reserve, 0, len, v))?;
        check_address_space(len, self.address_space())?;
        let ptr = self
            .driver
            .mem_address_reserve(len, self.granularity)
            .map_err(|e| self.fail(Op::Reserve, 0, len, e))?;
        s.book.apply_reserve(ptr as Addr, len);
        Ok(ptr as Addr)
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Free, addr, len)?;
        let (start, end) = (addr as u64, (addr + len) as u64);
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

    fn create(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let mut s = self.enter(Op::Create, 0, len)?;
        s.book
            .check_create(len)
            .map_err(|v| BackendError::refused(Op::Create, 0, len, v))?;
        let handle = self
            .driver
            .mem_create(len, self.device)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let phys = CudaPhys {
            handle,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    fn release(&self, phys: CudaPhys, len: usize) -> Result<(), BackendError> {
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
        Ok(())
    }

    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: CudaPhys,
        offset: usize,
        access: Access,
    ) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Map, addr, len)?;
        let (ptr, fail) = (addr as u64, |e| self.fail(Op::Map, addr, len, e));
        if Self::overlaps(&s.scratch, addr, len) {
            // The backend's own scratch range, waiting to be freed: not the caller's to map.
            let v = Violation::NotReserved { addr, len };
            return Err(BackendError::refused(Op::Map, addr, len, v));
        }
        self.unstick(&mut s, ptr, ptr + len as u64).map_err(fail)?;
        s.book
            .check_map(addr, len, phys, offset)
            .map_err(|v| BackendError::refused(Op::Map, addr, len, v))?;
        // SAFETY: `s.book.check_map` above proved `[addr, addr + len)` inside a live
        // reservation with nothing mapped there, and `phys` live (so its handle is: see
        // `release`) with at least `offset + len` bytes.
        unsafe { self.driver.mem_map(ptr, len, offset, phys.handle) }.map_err(fail)?;
        s.book.apply_map(addr, len, phys, offset, access);
        let rw = access == Access::ReadWrite;
        // SAFETY: the range was mapped, exactly, just above.
        let Err(e) = (unsafe { self.driver.mem_set_access(ptr, len, self.device, rw) }) else {
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
                s.stuck.push((ptr, len));
                if rollback.is_context_loss() {
                    return Err(fail(rollback));
                }
            }
        }
        Err(fail(e))
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Unmap, addr, len)?;
        s.book
            .check_unmap(addr, len)
            .map_err(|v| BackendError::refused(Op::Unmap, addr, len, v))?;
        // SAFETY: `s.book.check_unmap` above proved `[addr, addr + len)` exactly covered by
        // whole live mappings.
        unsafe { self.driver.mem_unmap(addr as u64, len) }
            .map_err(|e| self.fail(Op::Unmap, addr, len, e))?;
        s.book.apply_unmap(addr, len);
        let (start, end) = (addr as u64, (addr + len) as u64);
        s.stuck.retain(|&(p, _)| !(start <= p && p < end));
        Ok(())
    }

    fn copy_into_phys(
        &self,
        phys: CudaPhys,
        offset: usize,
        src: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Copy, src, len)?;
        let fail = |e| self.fail(Op::Copy, src, len, e);
        self.sweep_scratch(&mut s).map_err(fail)?;
        s.book
            .check_copy(phys, offset, src, len)
            .map_err(|v| BackendError::refused(Op::Copy, src, len, v))?;
        if Self::overlaps(&s.stuck, src, len) {
            let v = Violation::NotMapped { addr: src, len };
            return Err(BackendError::refused(Op::Copy, src, len, v));
        }
        // Map `offset + len` bytes of the handle from its start at a scratch range, copy, and
        // take the scratch range down again.
        let span = offset + len;
        let d = &self.driver;
        let scratch = d
            .mem_address_reserve(span, self.granularity)
            .map_err(fail)?;
        s.book.apply_reserve(scratch as Addr, span);
        // SAFETY: `scratch` is a reservation of `span` bytes made just above, nothing mapped in
        // it; `s.book.check_copy` above proved `phys` live (so its handle is: see `release`)
        // with at least `offset + len` bytes.
        if let Err(e) = unsafe { d.mem_map(scratch, span, 0, phys.handle) } {
            if e.is_context_loss() {
                return Err(fail(e));
            }
            // SAFETY: the fresh scratch reservation, exactly, with nothing mapped in it.
            match unsafe { d.mem_address_free(scratch, span) } {
                Ok(()) => s.book.apply_free(scratch as Addr),
                Err(freed) if freed.is_context_loss() => return Err(fail(freed)),
                Err(_) => s.scratch.push((scratch, span)),
            }
            return Err(fail(e));
        }
        s.book
            .apply_map(scratch as Addr, span, phys, 0, Access::ReadWrite);
        // The copy is asynchronous: wait for it before the scratch mapping goes.
        // SAFETY: the scratch range was mapped, exactly, just above, and is given read-write
        // access before the copy writes to it; `s.book.check_copy` above proved every byte of
        // the source mapped, and the `s.stuck` check that it has access; the lock keeps both
        // mapped, and `ctx_synchronize` waits for the copy before the scratch range is unmapped.
        let copied = unsafe {
            d.mem_set_access(scratch, span, self.device, true)
                .and_then(|()| d.memcpy_dtod(scratch + offset as u64, src as u64, len))
        }
        .and_then(|()| d.ctx_synchronize());
        if let Err(e) = copied
            && e.is_context_loss()
        {
            return Err(fail(e));
        }
        // SAFETY: the scratch range was mapped, exactly, above, and nothing else unmapped it.
        match unsafe { d.mem_unmap(scratch, span) } {
            Ok(()) => {
                s.book.apply_unmap(scratch as Addr, span);
                // SAFETY: the scratch reservation, exactly, its one mapping just unmapped.
                match unsafe { d.mem_address_free(scratch, span) } {
                    Ok(()) => s.book.apply_free(scratch as Addr),
                    Err(e) if e.is_context_loss() => return Err(fail(e)),
                    Err(_) => s.scratch.push((scratch, span)),
                }
            }
            Err(e) if e.is_context_loss() => return Err(fail(e)),
            Err(_) => {
                // Still mapped: unmapped (and then freed) before anything reuses the range.
                s.stuck.push((scratch, span));
                s.scratch.push((scratch, span));
            }
        }
        copied.map_err(fail)
    }

    fn fence(&self) -> CudaFence {
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            return CudaFence(None);
        };
        let event = match self.driver.event_create() {
            Ok(event) => event,
            Err(e) => {
                let _ = self.fail(Op::Fence, 0, 0, e);
                return CudaFence(None);
            }
        };
        let serial = next_serial();
        s.events.insert(serial, event);
        // SAFETY: `event` was created just above by this driver; `self.stream` is 0, the
        // legacy default stream, which always exists.
        match unsafe { self.driver.event_record(event, self.stream) } {
            Ok(()) => CudaFence(Some(serial)),
            Err(e) => {
                let _ = self.fail(Op::Fence, 0, 0, e);
                if !self.context_lost() {
                    // SAFETY: `event` was created just above and is destroyed here once (its
                    // entry leaves `s.events` when it is destroyed, or its serial goes to
                    // `s.retired` to be tried again, never both).
                    match unsafe { self.driver.event_destroy(event) } {
                        Ok(()) => {
                            s.events.remove(&serial);
                        }
                        Err(destroy) => {
                            let _ = self.fail(Op::Fence, 0, 0, destroy);
                            s.retired.push(serial); // retried at the next retirement
                        }
                    }
                }
                CudaFence(None)
            }
        }
    }

    fn fence_done(&self, fence: &CudaFence) -> bool {
        // Lost: nothing runs any more; the teardown that follows sees the loss and calls nothing.
        let Ok(s) = self.enter(Op::Fence, 0, 0) else {
            return self.context_lost();
        };
        let done = match fence.0.map(|serial| s.events.get(&serial).copied()) {
            // SAFETY: `s.events` maps the fence's serial to an event created by this driver and
            // not yet destroyed (an entry leaves when its event is destroyed; serials are never
            // reused, so an event value the driver hands out again is another entry's).
            Some(Some(event)) => unsafe { self.driver.event_query(event) },
            // Not this backend's fence, or its event is destroyed: nothing of ours to wait for.
            Some(None) => Ok(true),
            // SAFETY: `self.stream` is 0, the legacy default stream, which always exists.
            None => unsafe { self.driver.stream_query(self.stream) },
        };
        // A failed query is asked again at the next poll, unless it revealed the loss.
        done.unwrap_or_else(|e| {
            let _ = self.fail(Op::Fence, 0, 0, e);
            self.context_lost()
        })
    }

    fn retire_fence(&self, fence: CudaFence) {
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            return; // lost: the driver freed the events with the context
        };
        // This fence's event (if it is one of ours), and any whose destruction failed before.
        let mut retiring = std::mem::take(&mut s.retired);
        retiring.extend(fence.0);
        for serial in retiring {
            let Some(&event) = s.events.get(&serial) else {
                continue; // not this backend's event, or already destroyed
            };
            // SAFETY: `s.events` just mapped `serial` to an event created by this driver and not
            // yet destroyed (the entry leaves as soon as it is, so a serial named twice, as a
            // foreign fence could, is destroyed once; serials are never reused, so a stale one
            // never names an event value the driver handed out again).
            match unsafe { self.driver.event_destroy(event) } {
                Ok(()) => {
                    s.events.remove(&serial);
                }
                Err(e) => {
                    s.retired.push(serial);
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    if self.context_lost() {
                        return;
                    }
                }
            }
        }
    }

    fn pin(&self) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Pin, 0, 0)?;
        self.driver
            .primary_ctx_retain(self.device)
            .map_err(|e| self.fail(Op::Pin, 0, 0, e))?;
        s.pins += 1;
        Ok(())
    }

    fn unpin(&self) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Unpin, 0, 0)?;
        if s.pins == 0 {
            return Err(BackendError::refused(Op::Unpin, 0, 0, Violation::NotPinned));
        }
        // SAFETY: `s.pins` above proved a retain taken by `pin` not yet given back; this gives
        // back that one (the retain taken when opening is not counted in it).
        unsafe { self.driver.primary_ctx_release(self.device) }
            .map_err(|e| self.fail(Op::Unpin, 0, 0, e))?;
        s.pins -= 1;
        Ok(())
    }

    fn context_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

impl<D: Driver> Drop for CudaBackend<D> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.enter(Op::Free, 0, 0) {
            // Each step stops at a sticky error: nothing more may be called then.
            let swept = self
                .unstick(&mut s, 0, u64::MAX)
                .and_then(|()| self.sweep_scratch(&mut s));
            if let Err(e) = swept {
                let _ = self.fail(Op::Free, 0, 0, e);
            }
            let events: Vec<Event> = s.events.drain().map(|(_, event)| event).collect();
            for event in events {
                if self.context_lost() {
                    break;
                }
                // SAFETY: `s.events` held exactly the events this driver created for this
                // backend and that are not destroyed; draining it destroys each once.
                if let Err(e) = unsafe { self.driver.event_destroy(event) } {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                }
            }
        }
        if !self.context_lost() {
            // SAFETY: gives back the retain `new` took, once: `drop` runs once, and `unpin`
            // gives back only the retains `pin` took.
            let _ = unsafe { self.driver.primary_ctx_release(self.device) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(model: &DriverModel) -> CudaBackend<DriverModel> {
        CudaBackend::new(model.clone(), 0).unwrap()
    }

    #[test]
    fn an_unpin_without_a_pin_is_refused_and_keeps_the_backends_own_retain() {
        let model = DriverModel::default();
        let backend = open(&model);
        let e = backend.unpin().unwrap_err();
        assert_eq!(e.cause, Cause::Violation(Violation::NotPinned));
        assert_eq!(model.outstanding().retains, 1);
        backend.pin().unwrap();
        backend.unpin().unwrap();
        assert_eq!(model.outstanding().retains, 1);
        drop(backend);
        assert_eq!(model.outstanding().retains, 0);
    }

    #[test]
    fn a_reservation_past_the_address_space_is_exhausted_before_the_driver() {
        let model = DriverModel::default();
        let backend = open(&model);
        let g = backend.granularity();
        let len = (backend.address_space() + g) & !(g - 1);
        let e = backend.reserve(len).unwrap_err();
        assert!(matches!(e.cause, Cause::AddressSpace { .. }), "{e}");
        assert_eq!(model.count(DriverCall::MemAddressReserve), 0);
    }

    #[test]
    fn an_event_named_twice_at_retirement_is_destroyed_once() {
        let model = DriverModel::default();
        let backend = open(&model);
        let fence = backend.fence();
        let serial = fence.0.expect("recorded");
        model.fail_nth(DriverCall::EventDestroy, 1, CuError::INVALID_VALUE);
        backend.retire_fence(fence); // fails: the event waits in `retired`
        assert_eq!(model.outstanding().events, 1);
        // A fence naming the same event (as a foreign one could) retires it once, not twice.
        backend.retire_fence(CudaFence(Some(serial)));
        assert_eq!(model.outstanding().events, 0);
        assert_eq!(model.count(DriverCall::EventDestroy), 2);
    }

    #[test]
    fn a_scratch_range_waiting_to_be_freed_is_not_the_callers_to_map() {
        let model = DriverModel::default();
        let backend = open(&model);
        let g = backend.granularity();
        let (addr, src) = (backend.reserve(g).unwrap(), backend.create(g).unwrap());
        backend.map(addr, g, src, 0, Access::ReadWrite).unwrap();
        let dst = backend.create(g).unwrap();
        model.fail_nth(DriverCall::MemAddressFree, 1, CuError::INVALID_VALUE);
        backend.copy_into_phys(dst, 0, addr, g).unwrap();
        let (scratch, span) = lock(&backend.state).scratch[0];
        let e = backend
            .map(scratch as Addr, span, dst, 0, Access::ReadWrite)
            .unwrap_err();
        assert!(
            matches!(e.cause, Cause::Violation(Violation::NotReserved { .. })),
            "{e}"
        );
        // The next copy frees the scratch range.
        backend.copy_into_phys(dst, 0, addr, g).unwrap();
        assert!(lock(&backend.state).scratch.is_empty());
        assert_eq!(model.outstanding().reservations, 1);
    }
}
