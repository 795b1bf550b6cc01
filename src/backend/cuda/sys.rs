//! `SysDriver`: the [`Driver`] seam forwarded one-to-one to `cudarc::driver::sys`.

use super::CudaError;
use super::driver::{
    AllocationProps, Context, CuError, CuResult, DeviceAttribute, Driver, Event,
    HANDLE_TYPE_POSIX_FD, ShareableHandle, Stream,
};
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

fn check(r: sys::CUresult) -> CuResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CuError(r as i32))
    }
}

/// `CUDA_ERROR_NOT_READY` as `Ok(false)`.
fn ready(r: sys::CUresult) -> CuResult<bool> {
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        Ok(false)
    } else {
        check(r).map(|()| true)
    }
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
        // SAFETY: see above.
        check(unsafe { sys::cuInit(0) })
    }

    fn device_get(&self, ordinal: i32) -> CuResult<i32> {
        let mut device = 0;
        // SAFETY: `device` outlives the call.
        check(unsafe { sys::cuDeviceGet(&mut device, ordinal) })?;
        Ok(device)
    }

    fn device_get_attribute(&self, attribute: DeviceAttribute, device: i32) -> CuResult<i32> {
        let attrib = match attribute {
            DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported => {
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
            }
        };
        let mut value = 0;
        // SAFETY: `value` outlives the call; the device is a plain ordinal the driver checks.
        check(unsafe { sys::cuDeviceGetAttribute(&mut value, attrib, device) })?;
        Ok(value)
    }

    fn device_total_mem(&self, device: i32) -> CuResult<usize> {
        let mut bytes = 0;
        // SAFETY: `bytes` outlives the call.
        check(unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, device) })?;
        Ok(bytes)
    }

    fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool> {
        let mut can = 0;
        // SAFETY: `can` outlives the call; the devices are plain ordinals the driver checks.
        check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) })?;
        Ok(can == 1)
    }

    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `ctx` outlives the call.
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) })?;
        Ok(ctx as Context)
    }

    unsafe fn primary_ctx_release(&self, device: i32) -> CuResult<()> {
        // SAFETY: the caller gives back a retain it took (`Driver`'s rules).
        check(unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) })
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> CuResult<()> {
        // SAFETY: the caller passes a context from `primary_ctx_retain` that is still retained.
        check(unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) })
    }

    fn mem_get_allocation_granularity(&self, props: AllocationProps) -> CuResult<usize> {
        let (mut granularity, prop) = (0, allocation_prop(props));
        let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
        // SAFETY: `granularity` and `prop` outlive the call.
        check(unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag) })?;
        Ok(granularity)
    }

    fn mem_address_reserve(&self, size: usize, alignment: usize, hint: u64) -> CuResult<u64> {
        let mut ptr = 0;
        // SAFETY: `ptr` outlives the call; the hint is a plain address the driver may ignore.
        check(unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, hint, 0) })?;
        Ok(ptr)
    }

    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller passes exactly one live reservation with nothing mapped in it.
        check(unsafe { sys::cuMemAddressFree(ptr, size) })
    }

    fn mem_create_with(&self, size: usize, props: AllocationProps) -> CuResult<u64> {
        let (mut handle, prop) = (0, allocation_prop(props));
        // SAFETY: `handle` and `prop` outlive the call; the driver checks the properties.
        check(unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
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
        check(exported)?;
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
        check(unsafe { sys::cuMemImportFromShareableHandle(&mut handle, os_handle, kind) })?;
        Ok(handle)
    }

    unsafe fn mem_release(&self, handle: u64) -> CuResult<()> {
        // SAFETY: the caller passes a live handle of this driver.
        check(unsafe { sys::cuMemRelease(handle) })
    }

    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()> {
        // SAFETY: the caller passes an unmapped range of a live reservation and a live handle
        // of exactly `size` bytes, mapped whole from `offset` 0 (the trait's contract).
        check(unsafe { sys::cuMemMap(ptr, size, offset, handle, 0) })
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
        check(unsafe { sys::cuMemSetAccess(ptr, size, desc.as_ptr(), desc.len()) })
    }

    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller passes a range exactly covered by live mappings.
        check(unsafe { sys::cuMemUnmap(ptr, size) })
    }

    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()> {
        // SAFETY: the caller keeps both ranges mapped with access until the copy is done.
        check(unsafe { sys::cuMemcpyDtoD_v2(dst, src, size) })
    }

    fn ctx_synchronize(&self) -> CuResult<()> {
        // SAFETY: see above.
        check(unsafe { sys::cuCtxSynchronize() })
    }

    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()> {
        // SAFETY: `src` is valid for `src.len()` bytes for the whole (synchronous) call; the
        // caller passes a destination mapped read-write.
        check(unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) })
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()> {
        // SAFETY: `dst` is valid for writes of `dst.len()` bytes for the whole (synchronous)
        // call; the caller passes a source mapped readable.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) })
    }

    fn event_create(&self) -> CuResult<Event> {
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `event` outlives the call.
        check(unsafe { sys::cuEventCreate(&mut event, flags) })?;
        Ok(event as Event)
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> CuResult<()> {
        // SAFETY: the caller passes an event from `event_create` that is not destroyed, and
        // stream 0 (the legacy default stream) or a live stream it owns.
        check(unsafe { sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream) })
    }

    unsafe fn event_query(&self, event: Event) -> CuResult<bool> {
        // SAFETY: as for `event_record`.
        ready(unsafe { sys::cuEventQuery(event as sys::CUevent) })
    }

    unsafe fn event_destroy(&self, event: Event) -> CuResult<()> {
        // SAFETY: as for `event_record`; the caller destroys each event once.
        check(unsafe { sys::cuEventDestroy_v2(event as sys::CUevent) })
    }

    unsafe fn event_synchronize(&self, event: Event) -> CuResult<()> {
        // SAFETY: the caller passes a live event of this driver (`Driver`'s rules).
        check(unsafe { sys::cuEventSynchronize(event as sys::CUevent) })
    }
}
