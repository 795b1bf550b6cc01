//! The driver seam: the CUDA driver calls the CUDA backend makes, one-to-one, with plain
//! integer handles so that a pure-Rust model can stand in for the real driver. No logic here:
//! an implementation forwards each call (see `SysDriver`, feature `cuda`) or models it
//! ([`DriverModel`](super::DriverModel)).

use std::fmt;

/// A `CUresult` other than `CUDA_SUCCESS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuError(pub i32);

/// Result of a driver call.
pub type CuResult<T> = Result<T, CuError>;

impl CuError {
    /// `CUDA_ERROR_INVALID_VALUE`
    pub const INVALID_VALUE: Self = Self(1);
    /// `CUDA_ERROR_OUT_OF_MEMORY`
    pub const OUT_OF_MEMORY: Self = Self(2);
    /// `CUDA_ERROR_DEINITIALIZED`
    pub const DEINITIALIZED: Self = Self(4);
    /// `CUDA_ERROR_NO_DEVICE`
    pub const NO_DEVICE: Self = Self(100);
    /// `CUDA_ERROR_INVALID_DEVICE`
    pub const INVALID_DEVICE: Self = Self(101);
    /// `CUDA_ERROR_NOT_READY`
    pub const NOT_READY: Self = Self(600);
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`
    pub const ILLEGAL_ADDRESS: Self = Self(700);
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED`
    pub const CONTEXT_IS_DESTROYED: Self = Self(709);
    /// `CUDA_ERROR_LAUNCH_FAILED`
    pub const LAUNCH_FAILED: Self = Self(719);
    /// `CUDA_ERROR_LAUNCH_TIMEOUT`
    pub const LAUNCH_TIMEOUT: Self = Self(702);
    /// `CUDA_ERROR_ASSERT`
    pub const ASSERT: Self = Self(710);
    /// `CUDA_ERROR_HARDWARE_STACK_ERROR`
    pub const HARDWARE_STACK_ERROR: Self = Self(714);
    /// `CUDA_ERROR_ILLEGAL_INSTRUCTION`
    pub const ILLEGAL_INSTRUCTION: Self = Self(715);
    /// `CUDA_ERROR_MISALIGNED_ADDRESS`
    pub const MISALIGNED_ADDRESS: Self = Self(716);
    /// `CUDA_ERROR_INVALID_ADDRESS_SPACE`
    pub const INVALID_ADDRESS_SPACE: Self = Self(717);
    /// `CUDA_ERROR_INVALID_PC`
    pub const INVALID_PC: Self = Self(718);
    /// `CUDA_ERROR_UNKNOWN`
    pub const UNKNOWN: Self = Self(999);
    /// `CUDA_ERROR_NOT_SUPPORTED`
    pub const NOT_SUPPORTED: Self = Self(801);

    /// Whether the error means the context is gone for good (a sticky error): after it, no
    /// call into the context can succeed.
    pub fn is_context_loss(self) -> bool {
        // The sticky errors: after a kernel faults, the context is unusable until reset.
        matches!(
            self,
            Self::DEINITIALIZED
                | Self::ILLEGAL_ADDRESS
                | Self::LAUNCH_TIMEOUT
                | Self::CONTEXT_IS_DESTROYED
                | Self::ASSERT
                | Self::HARDWARE_STACK_ERROR
                | Self::ILLEGAL_INSTRUCTION
                | Self::MISALIGNED_ADDRESS
                | Self::INVALID_ADDRESS_SPACE
                | Self::INVALID_PC
                | Self::LAUNCH_FAILED
                | Self::UNKNOWN
        )
    }

    /// The `CUresult` enumerator's name, where known.
    pub fn name(self) -> &'static str {
        match self.0 {
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            201 => "CUDA_ERROR_INVALID_CONTEXT",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            600 => "CUDA_ERROR_NOT_READY",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
            710 => "CUDA_ERROR_ASSERT",
            714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
            715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
            717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
            718 => "CUDA_ERROR_INVALID_PC",
            999 => "CUDA_ERROR_UNKNOWN",
            709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
            719 => "CUDA_ERROR_LAUNCH_FAILED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            _ => "CUresult",
        }
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

/// The kinds of driver calls, to aim injected faults and to read a call log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // each is the driver function of the same name
pub enum DriverCall {
    Init,
    DeviceGet,
    DeviceTotalMem,
    PrimaryCtxRetain,
    PrimaryCtxRelease,
    CtxSetCurrent,
    MemGetAllocationGranularity,
    MemAddressReserve,
    MemAddressFree,
    MemCreate,
    MemRelease,
    MemMap,
    MemSetAccess,
    MemUnmap,
    MemcpyDtoD,
    CtxSynchronize,
    MemcpyHtoD,
    MemcpyDtoH,
    EventCreate,
    EventRecord,
    EventQuery,
    EventDestroy,
    StreamQuery,
}

impl DriverCall {
    /// Every kind, in a fixed order.
    pub const ALL: [DriverCall; 23] = [
        Self::Init,
        Self::DeviceGet,
        Self::DeviceTotalMem,
        Self::PrimaryCtxRetain,
        Self::PrimaryCtxRelease,
        Self::CtxSetCurrent,
        Self::MemGetAllocationGranularity,
        Self::MemAddressReserve,
        Self::MemAddressFree,
        Self::MemCreate,
        Self::MemRelease,
        Self::MemMap,
        Self::MemSetAccess,
        Self::MemUnmap,
        Self::MemcpyDtoD,
        Self::CtxSynchronize,
        Self::MemcpyHtoD,
        Self::MemcpyDtoH,
        Self::EventCreate,
        Self::EventRecord,
        Self::EventQuery,
        Self::EventDestroy,
        Self::StreamQuery,
    ];
}

/// A `CUcontext`, as an integer.
pub type Context = usize;
/// A `CUevent`, as an integer.
pub type Event = usize;
/// A `CUstream`, as an integer (0: the legacy default stream).
pub type Stream = usize;

/// The CUDA driver calls of the VMM path, one-to-one. Device pointers and allocation handles
/// are `u64`, as in the driver.
pub trait Driver {
    /// `cuInit(0)`
    fn init(&self) -> CuResult<()>;
    /// `cuDeviceGet`
    fn device_get(&self, ordinal: i32) -> CuResult<i32>;
    /// `cuDeviceTotalMem`
    fn device_total_mem(&self, device: i32) -> CuResult<usize>;
    /// `cuDevicePrimaryCtxRetain`
    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context>;
    /// `cuDevicePrimaryCtxRelease`
    fn primary_ctx_release(&self, device: i32) -> CuResult<()>;
    /// `cuCtxSetCurrent`
    fn ctx_set_current(&self, ctx: Context) -> CuResult<()>;
    /// `cuMemGetAllocationGranularity` for pinned device memory on `device`
    /// (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`).
    fn mem_get_allocation_granularity(&self, device: i32) -> CuResult<usize>;
    /// `cuMemAddressReserve(size, alignment, 0, 0)`
    fn mem_address_reserve(&self, size: usize, alignment: usize) -> CuResult<u64>;
    /// `cuMemAddressFree`
    fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()>;
    /// `cuMemCreate` of pinned device memory on `device`
    fn mem_create(&self, size: usize, device: i32) -> CuResult<u64>;
    /// `cuMemRelease`
    fn mem_release(&self, handle: u64) -> CuResult<()>;
    /// `cuMemMap(ptr, size, offset, handle, 0)`
    fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()>;
    /// `cuMemSetAccess` for `device`: read-write, or read-only
    fn mem_set_access(&self, ptr: u64, size: usize, device: i32, read_write: bool) -> CuResult<()>;
    /// `cuMemUnmap`
    fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()>;
    /// `cuMemcpyDtoD`
    fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()>;
    /// `cuCtxSynchronize`
    fn ctx_synchronize(&self) -> CuResult<()>;
    /// `cuMemcpyHtoD`
    fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()>;
    /// `cuMemcpyDtoH`
    fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()>;
    /// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`
    fn event_create(&self) -> CuResult<Event>;
    /// `cuEventRecord`
    fn event_record(&self, event: Event, stream: Stream) -> CuResult<()>;
    /// `cuEventQuery`: `Ok(true)` done, `Ok(false)` for `CUDA_ERROR_NOT_READY`.
    fn event_query(&self, event: Event) -> CuResult<bool>;
    /// `cuEventDestroy`
    fn event_destroy(&self, event: Event) -> CuResult<()>;
    /// `cuStreamQuery`: `Ok(true)` idle, `Ok(false)` for `CUDA_ERROR_NOT_READY`.
    fn stream_query(&self, stream: Stream) -> CuResult<bool>;
}
