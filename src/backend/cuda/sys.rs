//! `SysDriver`: the [`Driver`] seam forwarded one-to-one to the real driver through cudarc:
//! cudarc's own `result` wrappers (`cudarc::driver::result`) wherever cudarc has one, and
//! otherwise the raw `cudarc::driver::sys` call checked with cudarc's `CUresult::result`.
//!
//! Raw calls, because cudarc 0.19.10's `result` module has no wrapper for them: the VMM calls
//! (`cuMemGetAllocationGranularity`, `cuMemAddressReserve`, `cuMemAddressFree`, `cuMemCreate`,
//! `cuMemExportToShareableHandle`, `cuMemImportFromShareableHandle`, `cuMemRelease`,
//! `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`) and `cuDeviceCanAccessPeer`.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaError;
use super::driver::{
    AllocationProps, CaptureInfo, CaptureMode, Context, CuError, CuResult, DeviceAttribute, Driver,
    Event, Graph, GraphExec, HANDLE_TYPE_POSIX_FD, ShareableHandle, Stream,
};
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use rustix::fd::{FromRawFd, OwnedFd};

/// The real CUDA driver, loaded at run time by `cudarc`. [`SysDriver::load`] makes one after
/// checking that the library is present (calling into a missing one panics);
/// [`CudaBackend::open`](super::CudaBackend::open) uses it, and so do the GPU tests that check
/// the driver's behaviour below the backend.
/// The driver does not promise to survive a stale or foreign handle, so every method that takes
/// one is an `unsafe fn` whose contract is [`Driver`'s](Driver#safety); the backend upholds it
/// by checking each handle against its record before the call.
#[derive(Debug)]
pub struct SysDriver(());

/// cudarc's error as the seam's: the same `CUresult` code.
fn cu(e: DriverError) -> CuError {
    CuError(e.0 as i32)
}

fn location(device: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    }
}

/// The `CUmemAllocationProp` of `props`: pinned memory on a device (fact 14), with the handle
/// types and the GPUDirect RDMA flag `props` asks for; everything else 0.
fn allocation_prop(props: AllocationProps) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(props.handle_types),
        location: location(props.device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(props.gpu_direct_rdma),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

impl SysDriver {
    /// The real driver, if its library can be loaded on this machine. Nothing is initialized:
    /// call [`Driver::init`] first, and make a context current before the calls that need one.
    ///
    /// # Errors
    ///
    /// [`CudaError::NoDriver`] when it cannot.
    pub fn load() -> Result<Self, CudaError> {
        // SAFETY: `is_culib_present` only tries to open the driver library by its usual names.
        if unsafe { sys::is_culib_present() } {
            Ok(Self(()))
        } else {
            Err(CudaError::NoDriver(
                "libcuda.so is not installed or not on the loader's path".into(),
            ))
        }
    }
}

// Every call below passes plain values, or pointers to locals that live across the call, to a
// driver library that `load` proved present. Handles, pointers, events and streams are passed
// only by the `unsafe fn`s, whose callers promise `Driver`'s rules: each value comes from this
// driver and is still live, each range is inside a live reservation or mapping as the call
// requires.
impl Driver for SysDriver {
    fn init(&self) -> CuResult<()> {
        result::init().map_err(cu)
    }

    fn device_get(&self, ordinal: i32) -> CuResult<i32> {
        result::device::get(ordinal).map_err(cu)
    }

    fn device_get_attribute(&self, attribute: DeviceAttribute, device: i32) -> CuResult<i32> {
        let attrib = match attribute {
            DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported => {
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
            }
            DeviceAttribute::VirtualMemoryManagementSupported => {
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            }
        };
        // SAFETY: the device is a plain ordinal the driver checks (cudarc asks for one from
        // `device::get`; an unknown one is `CUDA_ERROR_INVALID_DEVICE`, not misuse), and the
        // wrapper writes the value into a local of its own.
        unsafe { result::device::get_attribute(device, attrib) }.map_err(cu)
    }

    fn device_total_mem(&self, device: i32) -> CuResult<usize> {
        // SAFETY: as for `device_get_attribute`.
        unsafe { result::device::total_mem(device) }.map_err(cu)
    }

    fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool> {
        // Raw: cudarc's `result` has no wrapper for `cuDeviceCanAccessPeer`.
        let mut can = 0;
        // SAFETY: `can` outlives the call; the devices are plain ordinals the driver checks.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) }
            .result()
            .map_err(cu)?;
        Ok(can == 1)
    }

    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context> {
        // SAFETY: as for `device_get_attribute`; the retain is the caller's to give back.
        let ctx = unsafe { result::primary_ctx::retain(device) }.map_err(cu)?;
        Ok(ctx as Context)
    }

    unsafe fn primary_ctx_release(&self, device: i32) -> CuResult<()> {
        // SAFETY: the caller gives back a retain it took (`Driver`'s rules).
        unsafe { result::primary_ctx::release(device) }.map_err(cu)
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> CuResult<()> {
        // SAFETY: the caller passes a context from `primary_ctx_retain` that is still retained.
        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.map_err(cu)
    }

    fn mem_get_allocation_granularity(&self, props: AllocationProps) -> CuResult<usize> {
        // Raw, as every VMM call below: cudarc's `result` wraps none of them (module docs).
        let (mut granularity, prop) = (0, allocation_prop(props));
        let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
        // SAFETY: `granularity` and `prop` outlive the call.
        unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag) }
            .result()
            .map_err(cu)?;
        Ok(granularity)
    }

    fn mem_address_reserve(&self, size: usize, alignment: usize, hint: u64) -> CuResult<u64> {
        let mut ptr = 0;
        // SAFETY: `ptr` outlives the call; the hint is a plain address the driver may ignore.
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, hint, 0) }
            .result()
            .map_err(cu)?;
        Ok(ptr)
    }

    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller passes exactly one live reservation with nothing mapped in it.
        unsafe { sys::cuMemAddressFree(ptr, size) }
            .result()
            .map_err(cu)
    }

    fn mem_create_with(&self, size: usize, props: AllocationProps) -> CuResult<u64> {
        let (mut handle, prop) = (0, allocation_prop(props));
        // SAFETY: `handle` and `prop` outlive the call; the driver checks the properties.
        unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }
            .result()
            .map_err(cu)?;
        Ok(handle)
    }

    unsafe fn mem_export_to_shareable_handle(
        &self,
        handle: u64,
        handle_type: u32,
    ) -> CuResult<ShareableHandle> {
        // Only a descriptor passes through this seam: a fabric handle is 64 bytes of its own.
        if handle_type != HANDLE_TYPE_POSIX_FD {
            return Err(CuError::NOT_SUPPORTED);
        }
        let mut fd: std::ffi::c_int = -1;
        let kind = sys::CUmemAllocationHandleType(handle_type);
        // SAFETY: for a POSIX descriptor the driver writes one `int` (fact 27) into `fd`, which
        // outlives the call; the caller passes a live handle of this driver.
        let exported =
            unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), handle, kind, 0) };
        exported.result().map_err(cu)?;
        if fd < 0 {
            return Err(CuError::UNKNOWN);
        }
        // SAFETY: the call succeeded, so `fd` is a descriptor the driver opened for this call
        // and handed to the caller (who closes it: fact 27); nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Not inherited by a child started later, which would keep the memory alive (fact 27):
        // the driver does not document close-on-exec (assumption 9 in the backend's docs).
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC).map_err(|_| CuError::UNKNOWN)?;
        Ok(ShareableHandle::Fd(fd))
    }

    fn mem_import_from_shareable_handle(&self, shareable: u64, handle_type: u32) -> CuResult<u64> {
        if handle_type != HANDLE_TYPE_POSIX_FD {
            return Err(CuError::NOT_SUPPORTED);
        }
        // A descriptor travels by value, `(void*)(uintptr_t)fd` (fact 28).
        let fd = std::ffi::c_int::try_from(shareable).map_err(|_| CuError::INVALID_VALUE)?;
        let os_handle = fd as usize as *mut std::ffi::c_void;
        let (mut handle, kind) = (0, sys::CUmemAllocationHandleType(handle_type));
        // SAFETY: `handle` outlives the call; `os_handle` is a plain integer, never dereferenced
        // for a POSIX descriptor (fact 28), which the driver checks (an error, not misuse).
        unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind) }
            .result()
            .map_err(cu)?;
        Ok(handle)
    }

    fn mem_alloc(&self, size: usize) -> CuResult<u64> {
        let mut ptr = 0;
        // SAFETY: `ptr` outlives the call; the driver checks the size.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, size) }
            .result()
            .map_err(cu)?;
        Ok(ptr)
    }

    unsafe fn mem_free(&self, ptr: u64) -> CuResult<()> {
        // SAFETY: the caller passes the start of a live `cuMemAlloc` allocation of this driver,
        // freed once.
        unsafe { sys::cuMemFree_v2(ptr) }.result().map_err(cu)
    }

    unsafe fn mem_release(&self, handle: u64) -> CuResult<()> {
        // SAFETY: the caller passes a live handle of this driver.
        unsafe { sys::cuMemRelease(handle) }.result().map_err(cu)
    }

    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()> {
        // SAFETY: the caller passes an unmapped range of a live reservation and a live handle
        // of exactly `size` bytes, mapped whole from `offset` 0 (the trait's contract).
        unsafe { sys::cuMemMap(ptr, size, offset, handle, 0) }
            .result()
            .map_err(cu)
    }

    unsafe fn mem_set_access(&self, ptr: u64, size: usize, access: &[(i32, bool)]) -> CuResult<()> {
        let desc: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|&(device, read_write)| sys::CUmemAccessDesc {
                location: location(device),
                flags: if read_write {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                } else {
                    sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ
                },
            })
            .collect();
        // SAFETY: `desc` holds `desc.len()` descriptors and outlives the call, which only reads
        // them; the caller passes a range exactly covered by live mappings.
        unsafe { sys::cuMemSetAccess(ptr, size, desc.as_ptr(), desc.len()) }
            .result()
            .map_err(cu)
    }

    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller passes a range exactly covered by live mappings.
        unsafe { sys::cuMemUnmap(ptr, size) }.result().map_err(cu)
    }

    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller keeps both ranges mapped with access until the copy is done.
        unsafe { result::memcpy_dtod_sync(dst, src, size) }.map_err(cu)
    }

    unsafe fn stream_synchronize(&self, stream: Stream) -> CuResult<()> {
        // SAFETY: the caller passes 0 (the legacy stream) or a live stream of this context.
        unsafe { result::stream::synchronize(stream as sys::CUstream) }.map_err(cu)
    }

    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()> {
        // SAFETY: `src` is valid for `src.len()` bytes for the whole (synchronous) call (the
        // wrapper copies `size_of_val(src)` bytes, its length); the caller passes a destination
        // mapped read-write.
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(cu)
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()> {
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes for the whole (synchronous)
        // call; the caller passes a source mapped readable.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(cu)
    }

    fn event_create(&self) -> CuResult<Event> {
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let event = result::event::create(flags).map_err(cu)?;
        Ok(event as Event)
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> CuResult<()> {
        // SAFETY: the caller passes an event from `event_create` that is not destroyed, and
        // stream 0 (the legacy default stream) or a live stream it owns.
        unsafe { result::event::record(event as sys::CUevent, stream as sys::CUstream) }.map_err(cu)
    }

    /// `CUDA_ERROR_NOT_READY` is `Ok(false)`.
    unsafe fn event_query(&self, event: Event) -> CuResult<bool> {
        // SAFETY: as for `event_record`.
        match unsafe { result::event::query(event as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(cu(e)),
        }
    }

    unsafe fn event_destroy(&self, event: Event) -> CuResult<()> {
        // SAFETY: as for `event_record`; the caller destroys each event once.
        unsafe { result::event::destroy(event as sys::CUevent) }.map_err(cu)
    }

    unsafe fn event_synchronize(&self, event: Event) -> CuResult<()> {
        // SAFETY: the caller passes a live event of this driver (`Driver`'s rules).
        unsafe { result::event::synchronize(event as sys::CUevent) }.map_err(cu)
    }

    unsafe fn stream_is_capturing(&self, stream: Stream) -> CuResult<bool> {
        // Raw: cudarc's `result` has no wrapper for `cuStreamIsCapturing`.
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` outlives the call; the caller passes 0 (the legacy stream) or a live
        // stream of this context.
        unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) }
            .result()
            .map_err(cu)?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    unsafe fn stream_get_capture_info(&self, stream: Stream) -> CuResult<CaptureInfo> {
        // Raw: cudarc's `result` has no wrapper; with `cuda-12080` the `_v2` call is the one
        // compiled (the unsuffixed one is not, under 12.x).
        use sys::CUstreamCaptureStatus as S;
        let mut status = S::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: `status` and `id` outlive the call; the graph, dependency and count outputs
        // are optional (null: not asked); the caller passes 0 (the legacy stream) or a live
        // stream of this context.
        unsafe {
            sys::cuStreamGetCaptureInfo_v2(
                stream as sys::CUstream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(cu)?;
        Ok(match status {
            S::CU_STREAM_CAPTURE_STATUS_NONE => CaptureInfo::None,
            S::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureInfo::Active { id },
            _ => CaptureInfo::Invalidated,
        })
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> CuResult<CaptureMode> {
        use sys::CUstreamCaptureMode as M;
        let mut raw = raw_mode(mode);
        // SAFETY: `raw` outlives the call, which reads the new mode from it and writes the old.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut raw) }
            .result()
            .map_err(cu)?;
        Ok(match raw {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            M::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        })
    }

    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> CuResult<()> {
        // SAFETY: the caller passes a live stream of this context, not the legacy stream.
        unsafe { result::stream::begin_capture(stream as sys::CUstream, raw_mode(mode)) }
            .map_err(cu)
    }

    unsafe fn stream_end_capture(&self, stream: Stream) -> CuResult<Graph> {
        // SAFETY: the caller passes a live stream of this context that captures.
        let graph = unsafe { result::stream::end_capture(stream as sys::CUstream) }.map_err(cu)?;
        Ok(graph as Graph)
    }

    unsafe fn graph_instantiate(&self, graph: Graph) -> CuResult<GraphExec> {
        let flags = sys::CUgraphInstantiate_flags(0);
        // SAFETY: the caller passes a live graph of this driver.
        let exec =
            unsafe { result::graph::instantiate(graph as sys::CUgraph, flags) }.map_err(cu)?;
        Ok(exec as GraphExec)
    }

    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> CuResult<()> {
        // SAFETY: the caller passes a live executable graph and a live stream, and keeps the
        // graph's memory mapped until the launch has finished.
        unsafe { result::graph::launch(exec as sys::CUgraphExec, stream as sys::CUstream) }
            .map_err(cu)
    }

    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> CuResult<()> {
        // SAFETY: the caller passes a live executable graph, destroyed once.
        unsafe { result::graph::exec_destroy(exec as sys::CUgraphExec) }.map_err(cu)
    }

    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> CuResult<()> {
        let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
        // SAFETY: the caller passes a live stream (or 0) and a live event of this driver.
        unsafe { result::stream::wait_event(stream as sys::CUstream, event as sys::CUevent, flags) }
            .map_err(cu)
    }

    unsafe fn graph_destroy(&self, graph: Graph) -> CuResult<()> {
        // SAFETY: the caller passes a live graph, destroyed once.
        unsafe { result::graph::destroy(graph as sys::CUgraph) }.map_err(cu)
    }
}

/// A capture mode as the driver spells it.
fn raw_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    use sys::CUstreamCaptureMode as M;
    match mode {
        CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}
