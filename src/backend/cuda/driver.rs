//! The driver seam: the CUDA driver calls the CUDA backend makes, one-to-one, with plain
//! integer handles so that a pure-Rust model can stand in for the real driver. No logic here:
//! an implementation forwards each call (see `SysDriver`, feature `cuda`) or models it
//! ([`DriverModel`](crate::backend::doubles::DriverModel)).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use rustix::fd::OwnedFd;
use std::fmt;

/// A `CUresult` other than `CUDA_SUCCESS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuError(pub i32);

/// Result of a driver call.
pub type CuResult<T> = Result<T, CuError>;

/// What a failed call means for the context, by the CUDA documentation's wording for its code
/// (see [`CuError::fate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorFate {
    /// A sticky error: the context is unusable for good, and every later call fails.
    Sticky,
    /// The context, or the driver itself, is already gone: no later call into it can succeed.
    ContextGone,
    /// Only this call failed: the context lives on, and later calls may succeed.
    Transient,
}

impl ErrorFate {
    /// Whether the context is lost: [`Sticky`](Self::Sticky) or
    /// [`ContextGone`](Self::ContextGone).
    pub fn is_context_loss(self) -> bool {
        !matches!(self, Self::Transient)
    }
}

/// The documentation's words for most sticky errors (`CUDA_ERROR_ILLEGAL_ADDRESS` and its
/// kin, and `CUDA_ERROR_MPS_CLIENT_TERMINATED`).
const STICKY_RELAUNCH: &str = "sticky: the CUDA documentation says that to continue using \
     CUDA the process must be terminated and relaunched (for all but 810 also: the process is \
     left in an inconsistent state, and any further CUDA work returns the same error)";
/// `CUDA_ERROR_ASSERT`.
const STICKY_ASSERT: &str = "sticky: the driver documentation says the context cannot be used \
     anymore and must be destroyed (the runtime's: the process must be terminated and \
     relaunched)";
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
const GONE_DESTROYED: &str = "context gone: the context was destroyed (or the primary context \
     is not initialized); not sticky (fact 35: the process may make a new context), but the \
     handles, mappings and reservations went with the destroyed one (fact 45), so the safe \
     reading is loss: no further call passes them on (a new primary context would not know \
     them), and what they held is gone";
/// `CUDA_ERROR_DEINITIALIZED`.
const GONE_DEINITIALIZED: &str = "context gone: the driver is shutting down (deinitialized), \
     so no further call can succeed";
/// Hardware and unknown errors the documentation does not call sticky.
const TRANSIENT_NOT_STICKY: &str = "transient: the CUDA documentation does not say that the \
     context or the process is unusable after it (whether it sticks in practice is not known)";
/// `CUDA_ERROR_NOT_READY`.
const TRANSIENT_NOT_READY: &str = "transient: not an error; the work has not completed yet";
/// The stream-capture errors.
const TRANSIENT_CAPTURE: &str = "transient: a stream-capture error; it invalidates the \
     capture, not the context";
/// Errors of the call's arguments or resources.
const TRANSIENT_REFUSED: &str = "transient: the call was refused or could not be served; the \
     context is intact";
/// Codes not in the table.
const TRANSIENT_UNLISTED: &str =
    "transient: not in the table, and no documented wording makes it sticky";

/// The `CUresult` codes this crate names, from one table: each becomes a constant of
/// [`CuError`], an arm of [`CuError::name`], and an arm of [`CuError::fate`] and
/// [`CuError::fate_reason`] with its fate and the documented reason for it. Codes not in the
/// table are [`ErrorFate::Transient`].
macro_rules! cu_errors {
    ($($name:ident = $code:literal => $fate:ident($reason:ident),)*) => {
        impl CuError {
            $(
                #[doc = concat!(
                    "`CUDA_ERROR_", stringify!($name), "` (", stringify!($code), "): ",
                    "[`", stringify!($fate), "`](ErrorFate::", stringify!($fate), ")"
                )]
                pub const $name: Self = Self($code);
            )*

            /// Every code in the table.
            #[cfg(test)]
            const LISTED: &'static [Self] = &[$(Self::$name,)*];

            /// The `CUresult` enumerator's name, where known.
            pub fn name(self) -> &'static str {
                match self.0 {
                    $($code => concat!("CUDA_ERROR_", stringify!($name)),)*
                    _ => "CUresult",
                }
            }

            /// What the error means for the context, from the documentation's wording for the
            /// code: sticky, context gone, or transient (codes not in the table included).
            pub fn fate(self) -> ErrorFate {
                match self.0 {
                    $($code => ErrorFate::$fate,)*
                    _ => ErrorFate::Transient,
                }
            }

            /// Why the error has its [`fate`](Self::fate), in the documentation's words where it
            /// has any.
            pub fn fate_reason(self) -> &'static str {
                match self.0 {
                    $($code => $reason,)*
                    _ => TRANSIENT_UNLISTED,
                }
            }
        }
    };
}

cu_errors! {
    INVALID_VALUE = 1 => Transient(TRANSIENT_REFUSED),
    OUT_OF_MEMORY = 2 => Transient(TRANSIENT_REFUSED),
    NOT_INITIALIZED = 3 => Transient(TRANSIENT_REFUSED),
    DEINITIALIZED = 4 => ContextGone(GONE_DEINITIALIZED),
    DEVICE_UNAVAILABLE = 46 => Transient(TRANSIENT_REFUSED),
    NO_DEVICE = 100 => Transient(TRANSIENT_REFUSED),
    INVALID_DEVICE = 101 => Transient(TRANSIENT_REFUSED),
    INVALID_CONTEXT = 201 => Transient(TRANSIENT_REFUSED),
    ECC_UNCORRECTABLE = 214 => Transient(TRANSIENT_NOT_STICKY),
    NVLINK_UNCORRECTABLE = 220 => Transient(TRANSIENT_NOT_STICKY),
    CONTAINED = 226 => Sticky(STICKY_RELAUNCH),
    INVALID_HANDLE = 400 => Transient(TRANSIENT_REFUSED),
    NOT_READY = 600 => Transient(TRANSIENT_NOT_READY),
    ILLEGAL_ADDRESS = 700 => Sticky(STICKY_RELAUNCH),
    LAUNCH_OUT_OF_RESOURCES = 701 => Transient(TRANSIENT_REFUSED),
    LAUNCH_TIMEOUT = 702 => Sticky(STICKY_RELAUNCH),
    CONTEXT_IS_DESTROYED = 709 => ContextGone(GONE_DESTROYED),
    ASSERT = 710 => Sticky(STICKY_ASSERT),
    HARDWARE_STACK_ERROR = 714 => Sticky(STICKY_RELAUNCH),
    ILLEGAL_INSTRUCTION = 715 => Sticky(STICKY_RELAUNCH),
    MISALIGNED_ADDRESS = 716 => Sticky(STICKY_RELAUNCH),
    INVALID_ADDRESS_SPACE = 717 => Sticky(STICKY_RELAUNCH),
    INVALID_PC = 718 => Sticky(STICKY_RELAUNCH),
    LAUNCH_FAILED = 719 => Sticky(STICKY_RELAUNCH),
    TENSOR_MEMORY_LEAK = 721 => Sticky(STICKY_RELAUNCH),
    NOT_SUPPORTED = 801 => Transient(TRANSIENT_REFUSED),
    MPS_CLIENT_TERMINATED = 810 => Sticky(STICKY_RELAUNCH),
    STREAM_CAPTURE_UNSUPPORTED = 900 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_INVALIDATED = 901 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_MERGE = 902 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_UNMATCHED = 903 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_UNJOINED = 904 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_ISOLATION = 905 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_IMPLICIT = 906 => Transient(TRANSIENT_CAPTURE),
    CAPTURED_EVENT = 907 => Transient(TRANSIENT_CAPTURE),
    STREAM_CAPTURE_WRONG_THREAD = 908 => Transient(TRANSIENT_CAPTURE),
    EXTERNAL_DEVICE = 911 => Sticky(STICKY_RELAUNCH),
    UNKNOWN = 999 => Transient(TRANSIENT_NOT_STICKY),
}

impl CuError {
    /// Whether the error means the context is lost for good: a sticky error, or a context (or
    /// driver) already gone. After it, no call into the context can succeed. Read from the
    /// table: see [`fate`](Self::fate).
    pub fn is_context_loss(self) -> bool {
        self.fate().is_context_loss()
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

listed! {
    /// The kinds of driver calls, to aim injected faults and to read a call log.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    #[allow(missing_docs)] // each is the driver function of the same name
    pub enum DriverCall {
        Init,
        DeviceGet,
        DeviceGetAttribute,
        DeviceTotalMem,
        DeviceCanAccessPeer,
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
        StreamSynchronize,
        MemcpyHtoD,
        MemcpyDtoH,
        EventCreate,
        EventRecord,
        EventQuery,
        EventDestroy,
        EventSynchronize,
        MemExportToShareableHandle,
        MemImportFromShareableHandle,
        StreamIsCapturing,
        ThreadExchangeStreamCaptureMode,
        StreamBeginCapture,
        StreamEndCapture,
        GraphInstantiate,
        GraphLaunch,
        GraphExecDestroy,
        GraphDestroy,
        StreamWaitEvent,
        MemAlloc,
        MemFree,
        StreamGetCaptureInfo,
    }
}

/// A stream capture's mode (`CUstreamCaptureMode`, fact 40): the mode a capture begins in, and
/// a thread's capture interaction mode (`cuThreadExchangeStreamCaptureMode`), which decides
/// which open captures refuse that thread's potentially unsafe calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL` (the default). A capture begun so refuses a potentially
    /// unsafe call from any thread in this mode; a thread in this mode is refused by its own
    /// capture unless that began relaxed, and by any other thread's global capture.
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: a capture begun so refuses only the capturing
    /// thread's unsafe calls; a thread in this mode is refused only by its own capture (unless
    /// that began relaxed).
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: a capture begun so refuses no call; a thread in this
    /// mode is refused by none.
    Relaxed,
}

/// A stream's capture state, as `cuStreamGetCaptureInfo` answers it (fact 60).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureInfo {
    /// `CU_STREAM_CAPTURE_STATUS_NONE`: the stream does not capture.
    None,
    /// `CU_STREAM_CAPTURE_STATUS_ACTIVE`, with the capture sequence's id, unique over the
    /// process's life: a capture ended and another begun on the same stream has another id.
    Active {
        /// The capture id.
        id: u64,
    },
    /// `CU_STREAM_CAPTURE_STATUS_INVALIDATED`: the stream captures into a capture that was
    /// invalidated and not yet ended. The driver returns a valid id only for an active
    /// capture, so this one has none (fact 60).
    Invalidated,
}

impl CaptureInfo {
    /// Whether the stream captures (an invalidated capture not yet ended counts).
    pub fn captures(self) -> bool {
        self != Self::None
    }
}

/// A shareable handle, as [`Driver::mem_export_to_shareable_handle`] hands it over.
#[derive(Debug)]
pub enum ShareableHandle {
    /// [`HANDLE_TYPE_POSIX_FD`]: the descriptor the driver wrote, owned by the caller (dropping
    /// it closes the handle).
    Fd(OwnedFd),
    /// Another type, as an opaque value: the model's stand-in for a fabric handle (the real
    /// 64-byte `CUmemFabricHandle` does not pass through this seam yet).
    Opaque(u64),
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a bit of `requestedHandleTypes`, and a
/// handle type to export as.
pub const HANDLE_TYPE_POSIX_FD: u32 = crate::backend::HandleType::PosixFd.code() as u32;
/// `CU_MEM_HANDLE_TYPE_FABRIC` (CUDA 12.4+; facts 27, 28 and 30 of
/// [`facts`](crate::backend::cuda::facts)).
pub const HANDLE_TYPE_FABRIC: u32 = crate::backend::HandleType::Fabric.code() as u32;

/// The fields of a `CUmemAllocationProp` the backend chooses, for `cuMemCreate` and
/// `cuMemGetAllocationGranularity` (fact 14 of [`facts`](crate::backend::cuda::facts)). The others are fixed:
/// `type` pinned, `location.type` a device, no compression, no usage flags, `reserved` 0.
/// Granularity depends on the properties (fact 15), so it is asked with the same properties
/// the memory is then created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocationProps {
    /// `location.id`: the device (ordinal's `CUdevice`) that holds the memory.
    pub device: i32,
    /// `requestedHandleTypes`: what the memory may be exported as, chosen here once (fact 26):
    /// 0 (nothing), [`HANDLE_TYPE_POSIX_FD`], [`HANDLE_TYPE_FABRIC`].
    pub handle_types: u32,
    /// `allocFlags.gpuDirectRDMACapable`: whether a NIC may register the memory for GPUDirect
    /// RDMA. Only on a device whose
    /// [`GpuDirectRdmaWithCudaVmmSupported`](DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported)
    /// attribute is 1 (fact 14: it "needs attribute 110").
    pub gpu_direct_rdma: bool,
}

impl AllocationProps {
    /// Pinned memory on `device`: not exportable, not RDMA-capable.
    pub const fn pinned(device: i32) -> Self {
        Self {
            device,
            handle_types: 0,
            gpu_direct_rdma: false,
        }
    }

    /// These properties with `requestedHandleTypes = handle_types`.
    pub const fn with_handle_types(self, handle_types: u32) -> Self {
        Self {
            handle_types,
            ..self
        }
    }

    /// These properties with `allocFlags.gpuDirectRDMACapable = gpu_direct_rdma`.
    pub const fn with_gpu_direct_rdma(self, gpu_direct_rdma: bool) -> Self {
        Self {
            gpu_direct_rdma,
            ..self
        }
    }
}

/// A device attribute this crate reads with [`Driver::device_get_attribute`]
/// (`CUdevice_attribute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceAttribute {
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` (110): 1 if the device
    /// supports GPUDirect RDMA on memory made by `cuMemCreate`, which
    /// `allocFlags.gpuDirectRDMACapable` needs (fact 14).
    GpuDirectRdmaWithCudaVmmSupported,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (102): 1 if the device supports
    /// the VMM calls (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, …), which every
    /// `cuMemCreate` needs (fact 14). Support varies by device, driver and virtualization.
    VirtualMemoryManagementSupported,
}

impl DeviceAttribute {
    /// The attribute's `CUdevice_attribute` value.
    pub fn code(self) -> i32 {
        match self {
            Self::GpuDirectRdmaWithCudaVmmSupported => 110,
            Self::VirtualMemoryManagementSupported => 102,
        }
    }
}

/// A `CUcontext`, as an integer.
pub type Context = usize;
/// A `CUevent`, as an integer.
pub type Event = usize;
/// A `CUstream`, as an integer (0: the legacy default stream).
pub type Stream = usize;
/// `CU_STREAM_PER_THREAD`: the calling thread's default stream — one handle, a different
/// stream on each thread (fact 2).
pub const PER_THREAD_STREAM: Stream = 0x2;
/// A `CUgraph` (a captured graph), as an integer.
pub type Graph = usize;
/// A `CUgraphExec` (an instantiated graph), as an integer.
pub type GraphExec = usize;

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
/// - an **allocation handle** returned by [`mem_create_with`](Driver::mem_create_with) (or
///   its shorthands) and not yet given to [`mem_release`](Driver::mem_release);
/// - a **device pointer range** inside one reservation of
///   [`mem_address_reserve`](Driver::mem_address_reserve) that has not been freed, and, as the
///   CUDA rules require for each call: not mapped yet (`mem_map`), exactly covered by whole
///   mappings (`mem_set_access`, `mem_unmap`), exactly one reservation with nothing mapped in it
///   (`mem_address_free`), or mapped with access, read-write for a destination (the copies;
///   a device-to-device copy may still run after the call returns, so its ranges stay mapped
///   until it has finished);
/// - an **event** returned by [`event_create`](Driver::event_create) and not yet destroyed;
/// - a **stream**: 0 (the legacy default stream), or one the caller created and has not
///   destroyed;
/// - a **graph** returned by [`stream_end_capture`](Driver::stream_end_capture), or an
///   **executable graph** returned by [`graph_instantiate`](Driver::graph_instantiate), not
///   yet destroyed.
///
/// The driver promises no unique values: a released handle's or destroyed event's value may be
/// returned again by a later `mem_create` or `event_create`, and then names the new one. A value
/// is live from the call that last returned it until its release; a caller that keeps values
/// past their release must not take them for the new ones.
///
/// Every such call is made with the context current on the calling thread. The methods that
/// take none of these values are safe: they only create, or read device properties.
pub trait Driver {
    /// `cuInit(0)`
    fn init(&self) -> CuResult<()>;
    /// `cuDeviceGet`
    fn device_get(&self, ordinal: i32) -> CuResult<i32>;
    /// `cuDeviceGetAttribute(&value, attribute, device)`: the attribute's value (a flag is 0
    /// or 1).
    fn device_get_attribute(&self, attribute: DeviceAttribute, device: i32) -> CuResult<i32>;
    /// `cuDeviceTotalMem`
    fn device_total_mem(&self, device: i32) -> CuResult<usize>;
    /// `cuDeviceCanAccessPeer(&can, dev, peer)`: whether `dev` can directly access memory
    /// on `peer` (`can == 1`). A `cuMemSetAccess` for a device other than the memory's own
    /// is made only for a pair this returned `true` for (fact 32 of [`facts`](crate::backend::cuda::facts)).
    fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool>;
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
    /// `cuMemGetAllocationGranularity(&granularity, props, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)`:
    /// the granularity of memory created with `props`, which depends on them (fact 15).
    fn mem_get_allocation_granularity(&self, props: AllocationProps) -> CuResult<usize>;
    /// `cuMemAddressReserve(size, alignment, hint, 0)`. A non-zero `hint` is only a hint: the
    /// driver may place the reservation anywhere (fact 12 of [`facts`](crate::backend::cuda::facts)), so the
    /// caller must use the address returned, never assume the hint was honoured.
    fn mem_address_reserve(&self, size: usize, alignment: usize, hint: u64) -> CuResult<u64>;
    /// `cuMemAddressFree`
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly one live reservation of this driver with nothing mapped
    /// in it ([the trait's rules](Driver#safety)).
    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()>;
    /// `cuMemCreate(&handle, size, props, 0)`: pinned device memory with `props` (fact 14).
    /// The handle types it may be exported as are chosen here, once (fact 26), and so is
    /// whether it is GPUDirect-RDMA-capable.
    fn mem_create_with(&self, size: usize, props: AllocationProps) -> CuResult<u64>;
    /// `cuMemCreate` of pinned device memory on `device`, neither exportable nor RDMA-capable:
    /// [`mem_create_with`](Driver::mem_create_with) with [`AllocationProps::pinned`].
    fn mem_create(&self, size: usize, device: i32) -> CuResult<u64> {
        self.mem_create_with(size, AllocationProps::pinned(device))
    }
    /// `cuMemCreate` of pinned device memory on `device` that may be exported as the handle
    /// types `handle_types` (`requestedHandleTypes`: [`HANDLE_TYPE_POSIX_FD`],
    /// [`HANDLE_TYPE_FABRIC`]), not RDMA-capable: [`mem_create_with`](Driver::mem_create_with)
    /// with those properties. The types are chosen here, once (fact 26 of the CUDA facts
    /// sheet).
    fn mem_create_exportable(&self, size: usize, device: i32, handle_types: u32) -> CuResult<u64> {
        let props = AllocationProps::pinned(device).with_handle_types(handle_types);
        self.mem_create_with(size, props)
    }
    /// `cuMemExportToShareableHandle(&shareable, handle, handle_type, 0)`: a new shareable
    /// handle. For [`HANDLE_TYPE_POSIX_FD`] the driver writes an `int` file descriptor (fact 27),
    /// which the implementation hands over as [`ShareableHandle::Fd`], owned: closing it closes
    /// the handle. The memory lives while a shareable handle is open (fact 27).
    /// `CUDA_ERROR_INVALID_VALUE` if the allocation was not created with `handle_type` requested
    /// (fact 26).
    ///
    /// # Safety
    ///
    /// `handle` is a live allocation handle of this driver ([the trait's rules](Driver#safety)).
    unsafe fn mem_export_to_shareable_handle(
        &self,
        handle: u64,
        handle_type: u32,
    ) -> CuResult<ShareableHandle> {
        let _ = (handle, handle_type);
        Err(CuError::NOT_SUPPORTED)
    }
    /// `cuMemImportFromShareableHandle(&handle, shareable, handle_type)`: a new allocation
    /// handle on memory another process (or this one) exported, released once with
    /// [`mem_release`](Driver::mem_release). A POSIX descriptor is passed by value,
    /// `(void*)(uintptr_t)fd`, and may be closed right after (fact 28). The driver checks the
    /// value: a descriptor that names no exported memory is an error, not misuse.
    fn mem_import_from_shareable_handle(&self, shareable: u64, handle_type: u32) -> CuResult<u64> {
        let _ = (shareable, handle_type);
        Err(CuError::NOT_SUPPORTED)
    }
    /// The size in bytes of the allocation `handle` names, where the driver can say it. Not a
    /// driver call: the real driver has none (`CUmemAllocationProp` carries no size), so
    /// `SysDriver` says `None` (the default), and the size of imported memory is then the
    /// exporter's word, checked by `cuMemMap` (assumption 7 of the backend's docs). The model
    /// knows every allocation's size and says it, so a backend over it refuses an import whose
    /// message claims another size before anything is mapped.
    ///
    /// # Safety
    ///
    /// `handle` is a live allocation handle of this driver ([the trait's rules](Driver#safety)).
    unsafe fn mem_allocation_size(&self, handle: u64) -> Option<usize> {
        let _ = handle;
        None
    }
    /// `cuMemAlloc(&ptr, size)`: `size` bytes of device memory, mapped read-write for this
    /// context at an address the driver chooses — the plain mechanism, which needs no virtual
    /// memory management (fact 59).
    fn mem_alloc(&self, size: usize) -> CuResult<u64>;
    /// `cuMemFree(ptr)`
    ///
    /// # Safety
    ///
    /// `ptr` is the start of a live [`mem_alloc`](Driver::mem_alloc) allocation of this
    /// driver, freed once, with no work in flight that may use it
    /// ([the trait's rules](Driver#safety)).
    unsafe fn mem_free(&self, ptr: u64) -> CuResult<()>;
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
    /// `handle` is a live allocation handle of exactly `size` bytes, with `offset` 0: the
    /// reference says the offset "currently must be zero", so only whole handles are mapped
    /// ([the trait's rules](Driver#safety)).
    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()>;
    /// `cuMemSetAccess(ptr, size, desc, count)` with one descriptor per `(device, read_write)`
    /// of `access`: read-write, or read-only. One call covers every device listed (fact 18),
    /// so a mapping is never left with some of its devices' access and not the others'. The
    /// list names at least one device and none twice; a device other than the memory's own is
    /// listed only after [`device_can_access_peer`](Driver::device_can_access_peer) said `true`
    /// for it (fact 32).
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + size)` is exactly covered by live mappings ([the trait's rules](Driver#safety)).
    unsafe fn mem_set_access(&self, ptr: u64, size: usize, access: &[(i32, bool)]) -> CuResult<()>;
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
    /// `cuStreamSynchronize`: blocks the calling thread until the work submitted on `stream`
    /// so far has completed. Never asked of a capturing stream (fact 41); memtoken never
    /// calls `cuCtxSynchronize`, which would invalidate any capture open in the context.
    ///
    /// # Safety
    ///
    /// `stream` is 0 (the legacy stream) or a live stream of this driver's context
    /// ([the trait's rules](Driver#safety)).
    unsafe fn stream_synchronize(&self, stream: Stream) -> CuResult<()>;
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
    /// `cuStreamIsCapturing`: whether `stream` captures now (a capture invalidated and not yet
    /// ended counts). Asked of the legacy stream while a blocking stream of the context
    /// captures, `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, an answer that invalidates nothing
    /// (fact 41).
    ///
    /// # Safety
    ///
    /// `stream` is 0 (the legacy stream) or a live stream of this driver's context
    /// ([the trait's rules](Driver#safety)).
    unsafe fn stream_is_capturing(&self, stream: Stream) -> CuResult<bool>;
    /// `cuStreamGetCaptureInfo` (`_v2` under CUDA 12): `stream`'s capture status and, while a
    /// capture is active, its id (fact 60) — how memtoken tells the capture it began from one
    /// begun later on the same stream. Asked of the legacy stream while a blocking stream of
    /// the context captures, `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, invalidating nothing (fact
    /// 41).
    ///
    /// # Safety
    ///
    /// As for [`stream_is_capturing`](Self::stream_is_capturing).
    unsafe fn stream_get_capture_info(&self, stream: Stream) -> CuResult<CaptureInfo>;
    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture interaction mode
    /// to `mode`; returns the mode it had (fact 40).
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> CuResult<CaptureMode>;
    /// `cuStreamBeginCapture`: work submitted on `stream` from now on is captured into a graph
    /// instead of running (fact 39).
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver's context, not the legacy stream (capture
    /// cannot start there: fact 41) ([the trait's rules](Driver#safety)).
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> CuResult<()>;
    /// `cuStreamEndCapture`: the graph captured on `stream`; an error (and no graph) if the
    /// capture was invalidated.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver's context that captures, begun on the calling
    /// thread ([the trait's rules](Driver#safety)).
    unsafe fn stream_end_capture(&self, stream: Stream) -> CuResult<Graph>;
    /// `cuGraphInstantiateWithFlags(…, 0)`: an executable graph of `graph`.
    ///
    /// # Safety
    ///
    /// `graph` is a live graph of this driver ([the trait's rules](Driver#safety)).
    unsafe fn graph_instantiate(&self, graph: Graph) -> CuResult<GraphExec>;
    /// `cuGraphLaunch`: runs `exec` on `stream`, after the work submitted there so far.
    ///
    /// # Safety
    ///
    /// `exec` is a live executable graph and `stream` a live stream of this driver; every
    /// address the graph uses is mapped with access until the launch has finished
    /// ([the trait's rules](Driver#safety)).
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> CuResult<()>;
    /// `cuGraphExecDestroy`: launches in flight finish first (the call does not wait).
    ///
    /// # Safety
    ///
    /// `exec` is a live executable graph of this driver, destroyed once
    /// ([the trait's rules](Driver#safety)).
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> CuResult<()>;
    /// `cuGraphDestroy`.
    ///
    /// # Safety
    ///
    /// `graph` is a live graph of this driver, destroyed once
    /// ([the trait's rules](Driver#safety)).
    unsafe fn graph_destroy(&self, graph: Graph) -> CuResult<()>;
    /// `cuStreamWaitEvent(stream, event, CU_EVENT_WAIT_DEFAULT)`: work submitted on `stream`
    /// from now on runs after the work `event` stands for (nothing, if it was never recorded).
    /// The event may be destroyed right after (fact 38).
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a live stream, and `event` a live event, of this driver
    /// ([the trait's rules](Driver#safety)).
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> CuResult<()>;
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

/// Every code of the table with the fate the CUDA documentation gives it, written out here
/// rather than read from the table (facts 33–35 and 52 of
/// [`facts`](crate::backend::cuda::facts)).
#[cfg(test)]
mod fates {
    use super::{CuError, ErrorFate};
    use ErrorFate::{ContextGone, Sticky, Transient};

    /// (code, name, fate, words its reason must contain)
    #[rustfmt::skip]
    const EXPECTED: &[(i32, &str, ErrorFate, &str)] = &[
        // "the process must be terminated and relaunched" (facts 33, 34)
        (700, "CUDA_ERROR_ILLEGAL_ADDRESS", Sticky, "terminated and relaunched"),
        (702, "CUDA_ERROR_LAUNCH_TIMEOUT", Sticky, "terminated and relaunched"),
        (714, "CUDA_ERROR_HARDWARE_STACK_ERROR", Sticky, "terminated and relaunched"),
        (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", Sticky, "terminated and relaunched"),
        (716, "CUDA_ERROR_MISALIGNED_ADDRESS", Sticky, "terminated and relaunched"),
        (717, "CUDA_ERROR_INVALID_ADDRESS_SPACE", Sticky, "terminated and relaunched"),
        (718, "CUDA_ERROR_INVALID_PC", Sticky, "terminated and relaunched"),
        (719, "CUDA_ERROR_LAUNCH_FAILED", Sticky, "terminated and relaunched"),
        (911, "CUDA_ERROR_EXTERNAL_DEVICE", Sticky, "terminated and relaunched"),
        (226, "CUDA_ERROR_CONTAINED", Sticky, "terminated and relaunched"),
        (721, "CUDA_ERROR_TENSOR_MEMORY_LEAK", Sticky, "terminated and relaunched"),
        (810, "CUDA_ERROR_MPS_CLIENT_TERMINATED", Sticky, "terminated and relaunched"),
        // "the context cannot be used anymore" (fact 34)
        (710, "CUDA_ERROR_ASSERT", Sticky, "context cannot be used anymore"),
        // The context or the driver is gone: no later call can succeed.
        (709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", ContextGone, "destroyed"),
        (4, "CUDA_ERROR_DEINITIALIZED", ContextGone, "deinitialized"),
        // No sticky wording (fact 35).
        (999, "CUDA_ERROR_UNKNOWN", Transient, "does not say"),
        (214, "CUDA_ERROR_ECC_UNCORRECTABLE", Transient, "does not say"),
        (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", Transient, "does not say"),
        (46, "CUDA_ERROR_DEVICE_UNAVAILABLE", Transient, "transient"),
        (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", Transient, "transient"),
        (2, "CUDA_ERROR_OUT_OF_MEMORY", Transient, "transient"),
        (600, "CUDA_ERROR_NOT_READY", Transient, "not an error"),
        (900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", Transient, "capture"),
        (901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", Transient, "capture"),
        (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", Transient, "capture"),
        (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", Transient, "capture"),
        (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", Transient, "capture"),
        (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", Transient, "capture"),
        (906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", Transient, "capture"),
        (907, "CUDA_ERROR_CAPTURED_EVENT", Transient, "capture"),
        (908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", Transient, "capture"),
        // The other codes this crate names: ordinary failures.
        (1, "CUDA_ERROR_INVALID_VALUE", Transient, "transient"),
        (3, "CUDA_ERROR_NOT_INITIALIZED", Transient, "transient"),
        (100, "CUDA_ERROR_NO_DEVICE", Transient, "transient"),
        (101, "CUDA_ERROR_INVALID_DEVICE", Transient, "transient"),
        (201, "CUDA_ERROR_INVALID_CONTEXT", Transient, "transient"),
        (400, "CUDA_ERROR_INVALID_HANDLE", Transient, "transient"),
        (801, "CUDA_ERROR_NOT_SUPPORTED", Transient, "transient"),
    ];

    #[test]
    fn every_code_in_the_table_has_its_documented_fate() {
        // Every code is checked, and every mismatch reported, before the test fails.
        let mut wrong = Vec::new();
        for &(code, name, fate, reason) in EXPECTED {
            let e = CuError(code);
            let got = (e.name(), e.fate(), e.is_context_loss());
            if got != (name, fate, fate != Transient) || !e.fate_reason().contains(reason) {
                wrong.push(format!(
                    "{code}: expected ({name}, {fate:?}, loss: {}, reason with {reason:?}), \
                     got {got:?} because {:?}",
                    fate != Transient,
                    e.fate_reason()
                ));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn the_table_has_exactly_the_codes_checked_here() {
        let mut listed: Vec<i32> = CuError::LISTED.iter().map(|e| e.0).collect();
        let mut expected: Vec<i32> = EXPECTED.iter().map(|&(code, ..)| code).collect();
        listed.sort_unstable();
        expected.sort_unstable();
        assert_eq!(listed, expected);
    }

    #[test]
    fn a_code_not_in_the_table_is_transient() {
        for code in [5, 300, 705, 720, 999_999] {
            assert_eq!(CuError(code).fate(), Transient, "{code}");
            assert!(!CuError(code).is_context_loss(), "{code}");
        }
    }
}
