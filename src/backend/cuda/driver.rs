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

/// The `CUresult` codes this crate names, from one table: each becomes a constant of
/// [`CuError`] and an arm of [`CuError::name`].
macro_rules! cu_errors {
    ($($name:ident = $code:literal,)*) => {
        impl CuError {
            $(
                #[doc = concat!("`CUDA_ERROR_", stringify!($name), "`")]
                pub const $name: Self = Self($code);
            )*

            /// The `CUresult` enumerator's name, where known.
            pub fn name(self) -> &'static str {
                match self.0 {
                    $($code => concat!("CUDA_ERROR_", stringify!($name)),)*
                    _ => "CUresult",
                }
            }
        }
    };
}

cu_errors! {
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    DEINITIALIZED = 4,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    INVALID_HANDLE = 400,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_TIMEOUT = 702,
    CONTEXT_IS_DESTROYED = 709,
    ASSERT = 710,
    HARDWARE_STACK_ERROR = 714,
    ILLEGAL_INSTRUCTION = 715,
    MISALIGNED_ADDRESS = 716,
    INVALID_ADDRESS_SPACE = 717,
    INVALID_PC = 718,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    UNKNOWN = 999,
}

impl CuError {
    /// Whether the error means the context is lost for good (a sticky error): after it, no
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
    EventSynchronize,
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
        Self::EventSynchronize,
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
///
/// # Safety
///
/// The real driver does not promise to survive a stale or foreign handle, an unmapped pointer or
/// a range that breaks the VMM rules: such a call may corrupt the process. So every method that
/// takes a context, allocation handle, device pointer, event or stream is an `unsafe fn`, and
/// its caller must pass only values that come from **this same driver** and are still live:
///
/// - a **context** returned by [`primary_ctx_retain`](Driver::primary_ctx_retain) whose retain
///   has not been released; each [`primary_ctx_release`](Driver::primary_ctx_release) gives
///   back one retain this caller took, never more;
/// - an **allocation handle** returned by [`mem_create`](Driver::mem_create) and not yet given
///   to [`mem_release`](Driver::mem_release);
/// - a **device pointer range** inside one reservation of
///   [`mem_address_reserve`](Driver::mem_address_reserve) that has not been freed, and, as the
///   CUDA rules require for each call: not mapped yet (`mem_map`), exactly covered by whole
///   mappings (`mem_set_access`, `mem_unmap`), exactly one reservation with nothing mapped in it
///   (`mem_address_free`), or mapped with access, read-write for a destination (the copies;
///   a device-to-device copy may still run after the call returns, so its ranges stay mapped
///   until it has finished);
/// - an **event** returned by [`event_create`](Driver::event_create) and not yet destroyed;
/// - a **stream**: 0 (the legacy default stream), or one the caller created and has not
///   destroyed.
///
/// Every such call is made with the context current on the calling thread. The methods that
/// take none of these values are safe: they only create, or read device properties.
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
    ///
    /// # Safety
    ///
    /// Gives back one retain of `device`'s primary context that the caller took with
    /// [`primary_ctx_retain`](Driver::primary_ctx_retain) and has not given back (see
    /// [the trait's rules](Driver#safety)): releasing a retain someone else holds may destroy
    /// the context under them.
    unsafe fn primary_ctx_release(&self, device: i32) -> CuResult<()>;
    /// `cuCtxSetCurrent`
    ///
    /// # Safety
    ///
    /// `ctx` is a live context of this driver ([the trait's rules](Driver#safety)).
    unsafe fn ctx_set_current(&self, ctx: Context) -> CuResult<()>;
    /// `cuMemGetAllocationGranularity` for pinned device memory on `device`
    /// (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`).
    fn mem_get_allocation_granularity(&self, device: i32) -> CuResult<usize>;
    /// `cuMemAddressReserve(size, alignment, 0, 0)`
    fn mem_address_reserve(&self, size: usize, alignment: usize) -> CuResult<u64>;
    /// `cuMemAddressFree`
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly one live reservation of this driver with nothing mapped
    /// in it ([the trait's rules](Driver#safety)).
    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()>;
    /// `cuMemCreate` of pinned device memory on `device`
    fn mem_create(&self, size: usize, device: i32) -> CuResult<u64>;
    /// `cuMemRelease`
    ///
    /// # Safety
    ///
    /// `handle` is a live allocation handle of this driver, released once
    /// ([the trait's rules](Driver#safety)).
    unsafe fn mem_release(&self, handle: u64) -> CuResult<()>;
    /// `cuMemMap(ptr, size, offset, handle, 0)`
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` lies inside a live reservation with nothing mapped there, and
    /// `handle` is a live allocation handle with at least `offset + size` bytes
    /// ([the trait's rules](Driver#safety)).
    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()>;
    /// `cuMemSetAccess` for `device`: read-write, or read-only
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly covered by live mappings ([the trait's rules](Driver#safety)).
    unsafe fn mem_set_access(
        &self,
        ptr: u64,
        size: usize,
        device: i32,
        read_write: bool,
    ) -> CuResult<()>;
    /// `cuMemUnmap`
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly covered by live mappings ([the trait's rules](Driver#safety)).
    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()>;
    /// `cuMemcpyDtoD`
    ///
    /// # Safety
    ///
    /// `[src, src + size)` is mapped readable and `[dst, dst + size)` mapped read-write, both
    /// until the copy has finished: it may run after the call returns
    /// ([the trait's rules](Driver#safety)).
    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()>;
    /// `cuCtxSynchronize`
    fn ctx_synchronize(&self) -> CuResult<()>;
    /// `cuMemcpyHtoD`
    ///
    /// # Safety
    ///
    /// `[dst, dst + src.len())` is mapped read-write ([the trait's rules](Driver#safety)).
    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()>;
    /// `cuMemcpyDtoH`
    ///
    /// # Safety
    ///
    /// `[src, src + dst.len())` is mapped readable for the whole call
    /// ([the trait's rules](Driver#safety)).
    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()>;
    /// `cuEventCreate(CU_EVENT_DISABLE_TIMING)`
    fn event_create(&self) -> CuResult<Event>;
    /// `cuEventRecord`
    ///
    /// # Safety
    ///
    /// `event` is a live event and `stream` a live stream of this driver
    /// ([the trait's rules](Driver#safety)).
    unsafe fn event_record(&self, event: Event, stream: Stream) -> CuResult<()>;
    /// `cuEventQuery`: `Ok(true)` done, `Ok(false)` for `CUDA_ERROR_NOT_READY`.
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver ([the trait's rules](Driver#safety)).
    unsafe fn event_query(&self, event: Event) -> CuResult<bool>;
    /// `cuEventDestroy`
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver, destroyed once
    /// ([the trait's rules](Driver#safety)).
    unsafe fn event_destroy(&self, event: Event) -> CuResult<()>;
    /// `cuEventSynchronize`: blocks the calling thread until the event's work has completed.
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver ([the trait's rules](Driver#safety)).
    unsafe fn event_synchronize(&self, event: Event) -> CuResult<()>;
}

#[cfg(test)]
mod tests {
    use super::CuError;

    #[test]
    fn names_come_from_the_same_table_as_the_codes() {
        assert_eq!(CuError::ILLEGAL_ADDRESS.0, 700);
        assert_eq!(
            CuError::ILLEGAL_ADDRESS.name(),
            "CUDA_ERROR_ILLEGAL_ADDRESS"
        );
        assert_eq!(CuError::NOT_SUPPORTED.name(), "CUDA_ERROR_NOT_SUPPORTED");
        assert_eq!(CuError(3).name(), "CUDA_ERROR_NOT_INITIALIZED");
        assert_eq!(CuError(12345).name(), "CUresult");
        assert_eq!(
            CuError::OUT_OF_MEMORY.to_string(),
            "CUDA_ERROR_OUT_OF_MEMORY (2)"
        );
    }
}
