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
//! After an error that means the context is gone (a sticky error such as
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, or `CUDA_ERROR_CONTEXT_IS_DESTROYED`), the backend makes no
//! driver call at all: every call fails with [`Cause::ContextLost`] and
//! [`Backend::context_gone`] is true, so the typed layer quarantines instead of calling, and
//! residuals can be discharged with the proof.

mod driver;
mod model;
#[cfg(feature = "cuda")]
mod sys;

pub use driver::{Context, CuError, CuResult, Driver, DriverCall, Event, Stream};
pub use model::{DriverModel, ModelConfig};
#[cfg(feature = "cuda")]
pub use sys::SysDriver;

use super::{Access, Addr, Backend, BackendError, Cause, Op};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// A CUDA physical allocation handle (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaPhys(u64);

impl CudaPhys {
    /// The raw handle.
    pub fn handle(self) -> u64 {
        self.0
    }
}

/// A fence: an event recorded on the backend's stream, or, when none could be recorded, the
/// stream itself (done once the stream is idle).
#[derive(Debug)]
pub struct CudaFence(Option<Event>);

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
/// A committed allocation on it gives its `device_ptr()` for kernel arguments and
/// `copy_from_host` / `copy_to_host` for copies; prefixes, mappings and page tables have copies
/// too.///
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
    /// Scratch ranges of copy-on-write whose teardown failed: (address, length, still mapped).
    /// Retried by the next copy and on drop, so the driver is left holding nothing.
    scratch: Mutex<Vec<(u64, usize, bool)>>,
    /// Events whose destruction failed, retried by the next retirement and on drop.
    events: Mutex<Vec<Event>>,
    /// Mappings whose access could not be set and whose rollback unmap failed too: unmapped
    /// before their reservation may be freed (a free waits for them), and on drop.
    stuck: Mutex<Vec<(u64, usize)>>,
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
            driver
                .ctx_set_current(ctx)
                .map_err(at(DriverCall::CtxSetCurrent))?;
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
                let _ = driver.primary_ctx_release(device);
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
            scratch: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
            stuck: Mutex::new(Vec::new()),
        })
    }

    /// The driver (for inspection, e.g. a [`DriverModel`]'s call log).
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The device ordinal's `CUdevice`.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Whether the context was found lost: no driver call is made any more.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Makes one driver call (after making the context current), unless the context is lost.
    fn call<T>(
        &self,
        op: Op,
        addr: Addr,
        len: usize,
        f: impl FnOnce(&D) -> CuResult<T>,
    ) -> Result<T, BackendError> {
        if self.is_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        let result = self
            .driver
            .ctx_set_current(self.ctx)
            .and_then(|()| f(&self.driver));
        result.map_err(|e| self.fail(op, addr, len, e))
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

    /// Copies `src` from the host to device memory at `dst` (which must be mapped read-write).
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        self.call(Op::Copy, dst, src.len(), |d| d.memcpy_htod(dst as u64, src))
    }

    /// Copies device memory at `src` (which must be mapped) to the host.
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let len = dst.len();
        self.call(Op::Copy, src, len, |d| d.memcpy_dtoh(dst, src as u64))
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
        let g = self.granularity;
        self.call(Op::Reserve, 0, len, |d| d.mem_address_reserve(len, g))
            .map(|p| p as Addr)
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let (start, end) = (addr as u64, (addr + len) as u64);
        self.call(Op::Free, addr, len, |d| {
            self.unstick(d, start, end)?;
            d.mem_address_free(start, len)
        })
    }

    fn create(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let device = self.device;
        self.call(Op::Create, 0, len, |d| d.mem_create(len, device))
            .map(CudaPhys)
    }

    fn release(&self, phys: CudaPhys, len: usize) -> Result<(), BackendError> {
        self.call(Op::Release, 0, len, |d| d.mem_release(phys.0))
    }

    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: CudaPhys,
        offset: usize,
        access: Access,
    ) -> Result<(), BackendError> {
        let (device, rw) = (self.device, access == Access::ReadWrite);
        let ptr = addr as u64;
        self.call(Op::Map, addr, len, |d| {
            self.unstick(d, ptr, ptr + len as u64)?;
            d.mem_map(ptr, len, offset, phys.0)?;
            if let Err(e) = d.mem_set_access(ptr, len, device, rw) {
                // Roll the map back: nothing stays mapped without its access. If even that
                // fails, the mapping is remembered and unmapped before its VA can be freed.
                if let Err(rollback) = d.mem_unmap(ptr, len) {
                    lock(&self.stuck).push((ptr, len));
                    if rollback.is_context_loss() {
                        return Err(rollback);
                    }
                }
                return Err(e);
            }
            Ok(())
        })
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.call(Op::Unmap, addr, len, |d| d.mem_unmap(addr as u64, len))
    }

    fn copy_into_phys(
        &self,
        phys: CudaPhys,
        offset: usize,
        src: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        // Map `offset + len` bytes of the handle from its start at a scratch range, copy, and
        // take the scratch range down again.
        self.sweep_scratch();
        let (g, device) = (self.granularity, self.device);
        let span = offset + len;
        self.call(Op::Copy, src, len, |d| {
            let scratch = d.mem_address_reserve(span, g)?;
            if let Err(e) = d.mem_map(scratch, span, 0, phys.0) {
                self.scratch_left(d.mem_address_free(scratch, span), scratch, span, false);
                return Err(e);
            }
            // The copy is asynchronous: wait for it before the scratch mapping goes.
            let copied = d
                .mem_set_access(scratch, span, device, true)
                .and_then(|()| d.memcpy_dtod(scratch + offset as u64, src as u64, len))
                .and_then(|()| d.ctx_synchronize());
            match d.mem_unmap(scratch, span) {
                Ok(()) => {
                    self.scratch_left(d.mem_address_free(scratch, span), scratch, span, false)
                }
                Err(_) => self.scratch_left(Err(CuError::INVALID_VALUE), scratch, span, true),
            }
            copied
        })
    }

    fn fence(&self) -> CudaFence {
        let stream = self.stream;
        let event = self
            .call(Op::Fence, 0, 0, |d| {
                let event = d.event_create()?;
                if let Err(e) = d.event_record(event, stream) {
                    if d.event_destroy(event).is_err() {
                        lock(&self.events).push(event); // retried at the next retirement
                    }
                    return Err(e);
                }
                Ok(event)
            })
            .ok();
        CudaFence(event)
    }

    fn fence_done(&self, fence: &CudaFence) -> bool {
        if self.is_lost() {
            // Nothing runs any more; the teardown that follows sees the loss and calls nothing.
            return true;
        }
        let stream = self.stream;
        let done = match fence.0 {
            Some(event) => self.call(Op::Fence, 0, 0, |d| d.event_query(event)),
            None => self.call(Op::Fence, 0, 0, |d| d.stream_query(stream)),
        };
        // A failed query is asked again at the next poll, unless it revealed the loss.
        done.unwrap_or_else(|_| self.is_lost())
    }

    fn retire_fence(&self, fence: CudaFence) {
        let mut events =
            std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()));
        events.extend(fence.0);
        for event in events {
            if self
                .call(Op::Fence, 0, 0, |d| d.event_destroy(event))
                .is_err()
                && !self.is_lost()
            {
                self.events
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(event);
            }
        }
    }

    fn pin(&self) -> Result<(), BackendError> {
        let device = self.device;
        self.call(Op::Pin, 0, 0, |d| d.primary_ctx_retain(device).map(drop))
    }

    fn unpin(&self) -> Result<(), BackendError> {
        let device = self.device;
        self.call(Op::Unpin, 0, 0, |d| d.primary_ctx_release(device))
    }

    fn context_gone(&self) -> bool {
        self.is_lost()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<D: Driver> CudaBackend<D> {
    /// Unmaps what a failed rollback left mapped in `[start, end)`, before that range is
    /// mapped again or freed; what still fails stays remembered, and the error is returned.
    fn unstick(&self, d: &D, start: u64, end: u64) -> CuResult<()> {
        let stuck: Vec<(u64, usize)> = {
            let mut all = lock(&self.stuck);
            let (inside, outside) = all.drain(..).partition(|&(p, _)| start <= p && p < end);
            *all = outside;
            inside
        };
        let mut first_error = Ok(());
        for (ptr, size) in stuck {
            if let Err(e) = d.mem_unmap(ptr, size) {
                lock(&self.stuck).push((ptr, size));
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }

    /// Remembers a scratch range whose teardown failed.
    fn scratch_left(&self, freed: CuResult<()>, addr: u64, span: usize, mapped: bool) {
        if freed.is_err() {
            self.scratch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((addr, span, mapped));
        }
    }

    /// Tries again to take down scratch ranges left by failed copies.
    fn sweep_scratch(&self) {
        let left = std::mem::take(&mut *self.scratch.lock().unwrap_or_else(|e| e.into_inner()));
        for (addr, span, mapped) in left {
            let done = self.call(Op::Copy, addr as Addr, span, |d| {
                if mapped {
                    d.mem_unmap(addr, span)?;
                }
                d.mem_address_free(addr, span)
            });
            if done.is_err() {
                let still_mapped = mapped && !self.is_lost();
                self.scratch_left(Err(CuError::INVALID_VALUE), addr, span, still_mapped);
            }
        }
    }
}

impl<D: Driver> Drop for CudaBackend<D> {
    fn drop(&mut self) {
        for (ptr, size) in std::mem::take(&mut *lock(&self.stuck)) {
            let _ = self.call(Op::Unmap, ptr as Addr, size, |d| d.mem_unmap(ptr, size));
        }
        self.sweep_scratch();
        self.retire_fence(CudaFence(None));
        if !self.is_lost() {
            let _ = self.driver.primary_ctx_release(self.device);
        }
    }
}
