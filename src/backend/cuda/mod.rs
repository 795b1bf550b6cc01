//! CUDA VMM through a thin [`Driver`] seam: `cuMemAddressReserve`, `cuMemCreate` (pinned
//! device memory, GPUDirect-RDMA-capable where the device can), `cuMemMap` + `cuMemSetAccess`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`, with the recommended granularity of the
//! memory's properties and events as fences.
//!
//! The backend holds the logic (current context, rollback of a half-done map, loss detection);
//! the driver only forwards. With feature `cuda`, `SysDriver` forwards to
//! `cudarc::driver::sys` (loaded at run time: it builds with no CUDA toolkit, and
//! `CudaBackend::open` returns an error, never panics, when no driver is installed). On any
//! machine, [`DriverModel`] stands in for the driver with the VMM rules, events, context loss
//! and fault injection, so the whole state machine runs in `cargo test`.
//!
//! After an error that means the context is lost (a sticky error such as
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, or `CUDA_ERROR_CONTEXT_IS_DESTROYED`), the backend makes no
//! driver call at all: every call fails with [`Cause::ContextLost`] and
//! [`Backend::context_lost`] is true, so the typed layer quarantines instead of calling, and
//! residuals can be discharged with the proof.
//!
//! # The driver facts it relies on
//!
//! Each with its source (listed at the end). This section changes whenever a GPU run teaches
//! something new: a GPU test that fails here means the backend, the model and this text are
//! fixed together.
//!
//! **Streams and events.**
//! - Fences record on stream 0, the *legacy* default stream: cudarc loads the plain driver
//!   symbols, not the `_ptsz` ones, so 0 is never the per-thread stream. — `cuda.h`; cudarc
//!   `driver/sys/mod.rs`.
//! - The legacy stream waits for every *blocking* stream of its context, not for
//!   `CU_STREAM_NON_BLOCKING` ones, and cudarc's `new_stream()` and `fork()` make non-blocking
//!   streams. So a fence covers such a stream only once the backend learns of it (a view,
//!   `cover`, [`cover_stream`](CudaBackend::cover_stream)). — SYNC; cudarc `core.rs`.
//! - An event stands for the work its stream held when it was recorded; a never-recorded event
//!   queries as complete. So a fence mark is recorded before it is ever queried. — EVENT.
//! - Events are made with `CU_EVENT_DISABLE_TIMING`, the cheapest to query; destroying one
//!   whose work is unfinished does not block. — EVENT.
//! - `cuMemcpyHtoD` from pageable memory returns once the bytes are staged, and `cuMemcpyDtoD`
//!   may return before it has copied: both run on the legacy stream, so the backend waits there
//!   before a range they touch is free again. — API-SYNC.
//!
//! **VMM call rules.**
//! - `cuMemAddressReserve`: size a multiple of the host page, alignment 0 or a power of two.
//!   The backend always passes the granularity as the alignment, so it does not depend on the
//!   undocumented default alignment. — VMM; PT (default in practice ≥ 2 MiB).
//! - `cuMemCreate`: size a multiple of the *minimum* granularity; it maps nothing. The backend
//!   sizes everything by the *recommended* granularity ("for best performance"), which must be
//!   a multiple of the minimum (assumption 5 below). — VMM.
//! - `CUmemAllocationProp`: pinned memory on the device, `reserved` 0; `requestedHandleTypes`
//!   chosen at creation (POSIX descriptor for exportable memory, nothing otherwise);
//!   `allocFlags.gpuDirectRDMACapable` "needs attribute 110"
//!   (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`). The backend reads that
//!   attribute once, when opened, and every `cuMemCreate`, plain and exportable, asks
//!   RDMA-capable memory exactly when it is 1, so a NIC can register what memtoken hands out
//!   where the device allows it ([`gpu_direct_rdma`](CudaBackend::gpu_direct_rdma)). — VMM;
//!   `cuda.h`; PG §14.3.
//! - Granularity "depends on the allocation properties": the backend asks it, when opened,
//!   with the properties each kind of memory is created with — plain, and exportable (the
//!   same with a POSIX descriptor requested). The device keeps one granularity, the plain
//!   one; where the exportable one does not divide it, exportable memory would not fit, and
//!   creating or importing it is refused before any call, naming both numbers
//!   ([`exportable_granularity`](CudaBackend::exportable_granularity)); plain memory works on.
//!   — VMM. (`gpu_rdma_attribute_and_granularity_by_properties` in `tests/gpu.rs` prints what a
//!   GPU answers for both properties, with and without the RDMA flag.)
//! - `cuMemMap`: an unmapped range inside one reservation; it grants no access. One handle may
//!   be mapped at several addresses. The reference says the offset "currently must be zero",
//!   and PyTorch finds mapped memory "cannot be split up": so **every map is a whole handle at
//!   offset 0** (the strict reading). A shared prefix longer than one granule keeps its
//!   boundary granule in a handle of its own: body and tail handles, mapped side by side. —
//!   VMM; PG §14.5; PT.
//! - `cuMemSetAccess` after every map (a new mapping has no access), over a fully mapped range,
//!   with one descriptor per device in one call: this device's and every peer's
//!   ([`with_peers`](CudaBackend::with_peers)), read-write or read-only. So a remap (a regrown
//!   granule, a copy-on-write boundary, a wake) gives every peer its access back, and no
//!   mapping has this device's access without its peers'. — VMM.
//! - Peer access: VMM memory is shared per allocation by `cuMemSetAccess` descriptors, not by
//!   `cuCtxEnablePeerAccess` (which covers `cudaMalloc` memory only), and a peer is named only
//!   once `cuDeviceCanAccessPeer(peer, device)` said 1, checked when the backend is opened.
//!   — PG §14.1, §14.7; PEER; Samples.
//! - `cuMemUnmap` takes whole mappings, never a part, and leaves the range reserved. It does
//!   not reliably wait for device work (PyTorch syncs first): the typed layer unmaps only after
//!   the memory's fence has completed. — VMM; PT.
//! - `cuMemGetAddressRange` on VMM memory reports one mapped segment, the mapping of one
//!   physical allocation: a transfer engine that resolves a prefix's range with it sees its
//!   body only. So a registration lists one descriptor per physical allocation
//!   (`Registration::segments`). — VMM; libfabric PR #12473.
//! - `cuMemRelease` is allowed while mapped; the memory goes with the last mapping and
//!   reference. Releasing a stale handle is undefined behaviour, not an error: every handle is
//!   checked against the backend's record first, and keyed by a serial, since the driver does
//!   not promise fresh handle values. — VMM.
//! - `cuMemAddressFree` takes exactly one reservation, with nothing mapped in it. — VMM;
//!   PG §14.4.
//!
//! **Export and import** (POSIX descriptors only; [`Exportable`] for [`PosixFd`]).
//! - The handle type must be requested at `cuMemCreate` (`requestedHandleTypes`): exportable
//!   memory is created so, and only it is exported (the model refuses others with
//!   `INVALID_VALUE`, the error being unknown). — VMM (attribute 103); Samples.
//! - `cuMemExportToShareableHandle` writes an `int` descriptor, which the exporter owns and
//!   closes; the memory is freed only once every shareable handle is closed and the allocation
//!   released. — VMM.
//! - `cuMemImportFromShareableHandle` takes the descriptor by value, `(void*)(uintptr_t)fd`, and
//!   the importer may close it right after. — Samples; PT.
//! - The importer imports, reserves, maps and sets access, and releases each imported handle
//!   once. — VMM; PG §14.6.
//! - No call says an imported allocation's size (`CUmemAllocationProp` has no size field): the
//!   backend maps the length the message claims, and relies on `cuMemMap` refusing a size past
//!   the allocation ("offset + size must be less than the size of the memory allocation"):
//!   assumption 7 below. The driver model knows the size ([`Driver::mem_allocation_size`]),
//!   and the backend refuses a mismatch before mapping.
//!
//! **Errors and fates** ([`CuError::fate`] holds the table).
//! - Sticky — 700, 702, 714–719, 721, 226, 911, 810 ("the process must be terminated and
//!   relaunched") and 710 ("the context cannot be used anymore"): the context is lost, and the
//!   backend calls nothing more. — TYPES.
//! - Gone — 709 `CONTEXT_IS_DESTROYED`, 4 `DEINITIALIZED`: no sticky wording, but no later call
//!   can succeed; treated as loss. — TYPES.
//! - Everything else is transient, 214 `ECC_UNCORRECTABLE`, 999 `UNKNOWN` and the capture
//!   errors 900–908 included (whether 214 and 999 stick in practice is not documented).
//!   — TYPES.
//!
//! **Primary context.** The backend retains the device's primary context and gives the retain back
//! when dropped, or shares cudarc's (whose `CudaContext` retains and releases it); every call
//! makes it current on the calling thread. A reset destroys all the device's resources in the
//! process; whether VMM handles survive it is not documented, so the model drops them. After a
//! sticky error the backend keeps its retain (it calls nothing). — PCTX; cudarc `core.rs`.
//!
//! **Capture.** The VMM calls take no stream and are never captured; whether they break another
//! thread's global-mode capture is not documented (the model refuses them with 900 then).
//! Recording a fence on the legacy stream is invalid while a *blocking* stream of the context
//! captures (906, and that capture is invalidated); cudarc's streams are non-blocking. — STREAM;
//! PG §6.2.8.7.3.
//!
//! # Assumptions not yet verified on a GPU
//!
//! What the backend relies on that no reference states. Each has a test in `tests/gpu.rs`
//! (module `assumptions`), run against the real driver below the backend; none has run on a GPU
//! yet.
//!
//! 1. Read-only access (`PROT_READ`) for the *owning* device works, for host and
//!    device-to-device copies. Used by: prefix sharers, and copy-on-write copies from them.
//!    Test: `gpu_read_only_access_for_the_owning_device`.
//! 2. One `cuMemUnmap` covers several adjacent mappings (the samples do it). Used by: every
//!    mapping of a prefix longer than one granule — the owner's, each sharer's, a diverged
//!    one's — whose body and boundary are unmapped in one call (if a GPU refuses it, each of
//!    their releases is quarantined). Test: `gpu_one_unmap_covers_adjacent_mappings`.
//! 3. One `cuMemSetAccess` covers several adjacent mappings (the samples do it). Used by:
//!    nothing yet, `map` grants access per mapping. Test:
//!    `gpu_one_set_access_covers_adjacent_mappings`.
//! 4. One copy may span adjacent mappings of different handles. Used by: copies and views over
//!    a prefix's body and boundary. Test: `gpu_one_copy_spans_adjacent_mappings`.
//! 5. The recommended granularity is a power of two and a multiple of the minimum granularity
//!    and of the host page. Used by: every size, address and alignment. Test:
//!    `gpu_recommended_granularity_is_a_power_of_two_multiple_of_the_minimum`.
//! 6. A failed `cuMemSetAccess` is transient and leaves its mapping, without access, for a
//!    rollback `cuMemUnmap`. Used by: `map`'s rollback. Test:
//!    `gpu_a_failed_set_access_leaves_the_mapping_to_unmap`.
//!
//! 7. `cuMemMap` of an imported handle refuses (with a transient error) a size past the
//!    allocation's end, as its reference requires of the caller. Used by: every import on the
//!    real driver, which cannot ask the size of what it imported; a message claiming more than
//!    the exporter's allocation is then refused at the map, not mapped. Test:
//!    `gpu_a_map_past_an_imported_allocation_is_refused`. A message claiming *less* than the
//!    allocation would map part of the handle from offset 0, which fact 17 leaves unknown
//!    (the model refuses it up front, since it knows the size): same test, second case.
//! 8. `cuMemImportFromShareableHandle` given a descriptor that names no exported memory (a
//!    device node, a socket, a memfd, a closed number) returns an error, and does nothing
//!    else to the descriptor. Used by: every import on the real driver, whose descriptors
//!    come from another process. Test: `gpu_importing_a_foreign_descriptor_is_an_error`.
//! 9. The descriptor `cuMemExportToShareableHandle` writes may not be close-on-exec; the
//!    backend sets `FD_CLOEXEC` on it at once, so a child started later does not inherit it
//!    (and keep the memory alive, fact 27). Not relied on beyond that call.
//!
//! Not relied on, so not tested: the default reservation alignment, access on part of a
//! mapping, and a map at a non-zero offset.
//!
//! # Sources
//!
//! - VMM: CUDA Driver API, "Virtual Memory Management" (`cuMem*`), checked against `cuda.h`
//!   12.6.3.
//! - STREAM, EVENT, PCTX, PEER: CUDA Driver API, Stream, Event, Primary Context and Peer
//!   Context Memory Access.
//! - SYNC: CUDA Driver API, "Stream synchronization behavior"; API-SYNC: "API synchronization
//!   behavior".
//! - TYPES: the `CUresult` comments in `cuda.h` 12.6.3 (226 and 721 from 12.8).
//! - PG: CUDA C++ Programming Guide (13.1, legacy edition), §6.2.8.7.3 (capture), §14 (VMM).
//! - cudarc 0.19.10: `src/driver/safe/core.rs`, `src/driver/sys/mod.rs`.
//! - PT: PyTorch, `c10/cuda/CUDACachingAllocator.cpp`.
//! - libfabric PR #12473 (ofiwg/libfabric): `cuMemGetAddressRange` on VMM memory.
//! - Samples: NVIDIA `cuda-samples`, `vectorAddMMAP` and `memMapIPCDrv`.

mod driver;
mod model;
#[cfg(feature = "cuda")]
mod sys;

pub use driver::{
    AllocationProps, Context, CuError, CuResult, DeviceAttribute, Driver, DriverCall, ErrorFate,
    Event, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD, ShareableHandle, Stream,
};
pub use model::{CaptureMode, DriverModel, ModelConfig, ModelOutstanding, Placement};
#[cfg(feature = "cuda")]
pub use sys::SysDriver;

use super::rules::Book;
use super::{
    Access, Addr, Backend, BackendError, Cause, Exportable, Location, Op, PosixFd, Shareable,
    Violation, check_address_space, lock,
};
use rustix::fd::AsRawFd;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
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

/// A fence: one event per stream the backend covers, recorded after the work submitted there
/// so far. A mark whose event could not be created or recorded is recorded at the next query
/// (which covers at least as much work), never replaced by a weaker check. Marks name their
/// events by serial numbers of the backend's, which its record maps to the driver's events: a
/// destroyed event's value may come back from a later `cuEventCreate`, and must not be taken
/// for this fence's.
#[derive(Debug)]
pub struct CudaFence(Mutex<Vec<Mark>>);

/// One stream's part of a fence.
#[derive(Clone, Copy, Debug)]
struct Mark {
    stream: Stream,
    /// The serial of its event, once created.
    event: Option<u64>,
    recorded: bool,
}

/// A serial number never handed out before in this process: physical memory and fences of
/// every CUDA backend are keyed by one, never by a value the driver may hand out again.
fn next_serial() -> u64 {
    super::unique().get()
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
    /// A peer given to [`CudaBackend::with_peers`] cannot access the device's memory:
    /// `cuDeviceCanAccessPeer(peer, device)` said 0.
    #[error(
        "device {peer} cannot access memory on device {device}: \
         cuDeviceCanAccessPeer({peer}, {device}) said 0"
    )]
    NoPeerAccess {
        /// The backend's device.
        device: i32,
        /// The peer that cannot access it.
        peer: i32,
    },
    /// A peer list given to [`CudaBackend::with_peers`] names the backend's own device or a
    /// device twice, or comes after memory was mapped.
    #[error("bad peer list: {0}")]
    BadPeers(String),
}

/// CUDA virtual memory management on one device, over driver `D`.
///
/// **What a fence covers.** A fence is one event per *covered* stream, recorded when a token's
/// release starts (or when it is dropped), after everything submitted on that stream so far.
/// The legacy default stream (0, cudarc's `default_stream()`) is always covered; it waits for
/// every *blocking* stream, but not for the non-blocking streams that cudarc's `new_stream()`
/// makes — those are covered once memtoken learns of them: through a typed view (which covers
/// the stream it is made for), `cover` (feature `cuda`) for a cudarc stream, or
/// [`cover_stream`](CudaBackend::cover_stream) for a raw handle. Memory used by a kernel on a
/// covered stream is unmapped only after that kernel's work has finished.
///
/// **Other driver facts to know.** Every call makes this device's primary context current on
/// the calling thread (and leaves it so). `cuMemUnmap` does not wait for work in flight (a
/// kernel still using the range faults with the sticky `CUDA_ERROR_ILLEGAL_ADDRESS`), so the
/// typed layer unmaps only after the memory's fence completed: work on a stream the fence does
/// not cover is the caller's to finish first. After a sticky error no call is made at all — so
/// the primary context's retains are not released either; a process that wants the device back
/// must reset it (`cuDevicePrimaryCtxReset`) itself.
///
/// Its tokens lend typed views (feature `cuda`: `view::<T>(&stream)`, `view_mut`) that are
/// cudarc device memory — `DeviceSlice`, `DevicePtr`, `DevicePtrMut` — for cudarc's copies and,
/// through `device_ptr(&stream)`, kernel arguments; a view covers its stream. A committed
/// allocation also gives its raw `device_ptr()` (cover the stream yourself) and
/// `copy_from_host` / `copy_to_host`; prefixes, mappings and page tables have copies too.
///
/// **Peers.** [`with_peers`](Self::with_peers) names the devices that may access this device's
/// memory along with it (each checked with `cuDeviceCanAccessPeer` first). Every map gives them
/// all access in the same `cuMemSetAccess` call as this device, with the mapping's own access
/// (read-only for a prefix sharer), so no remap leaves a peer out; tokens say so with `peers()`.
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
    /// The properties every plain `cuMemCreate` is made with (and the granularity was asked
    /// with): pinned memory on `device`, RDMA-capable where the device says it can be.
    props: AllocationProps,
    /// The granularity of exportable memory's properties (`props` with a POSIX descriptor
    /// requested), or the error that query returned.
    exportable_granularity: Result<usize, CuError>,
    capacity: u64,
    /// The peer devices given access with this one: see [`with_peers`](Self::with_peers).
    peers: Vec<i32>,
    /// The access descriptors of every map, this device first, then each peer: read-write,
    /// and read-only.
    grant_rw: Vec<(i32, bool)>,
    grant_ro: Vec<(i32, bool)>,
    /// Whether `drop` gives back a retain of the primary context (one `new` took).
    owns_retain: bool,
    /// Streams every fence covers (the legacy stream first). Its own lock, never held across a
    /// driver call.
    covered: Mutex<Vec<Stream>>,
    /// cudarc's handles on what this backend uses but does not own: the context it was opened
    /// on, and the streams it covers, kept alive as long as the backend records events there.
    #[cfg(feature = "cuda")]
    #[allow(dead_code)] // see `Kept`
    kept: Mutex<Kept>,
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
    /// Ranges a copy is using while it runs outside the lock, each under a serial of its own:
    /// unmap, free and map refuse them.
    busy: Vec<(u64, u64, usize)>,
    /// Live physical memory created exportable as a POSIX descriptor.
    exportable: HashSet<CudaPhys>,
    /// Live physical memory imported from a descriptor: mapped read-only, written never.
    imported: HashSet<CudaPhys>,
}

/// What a backend keeps alive for cudarc (feature `cuda`): held, never read.
#[cfg(feature = "cuda")]
#[derive(Debug, Default)]
#[allow(dead_code)] // the handles are kept only so that cudarc does not destroy them
struct Kept {
    context: Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    streams: Vec<std::sync::Arc<cudarc::driver::CudaStream>>,
}

impl<D: Driver> CudaBackend<D> {
    /// Opens device `ordinal` through `driver`: initializes the driver, retains the device's
    /// primary context (released on drop), reads whether memory can be made
    /// GPUDirect-RDMA-capable (attribute 110), and reads the recommended granularity for the
    /// properties of plain and of exportable memory (see
    /// [`exportable_granularity`](Self::exportable_granularity)).
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
        // SAFETY: `ctx` was retained just above from this driver; the backend gives that
        // retain back when it drops (`owns_retain`), and not before.
        unsafe { Self::open_on(driver, device, ctx, true) }
    }

    /// Opens the backend on context `ctx` of `device`.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context of `device` from `driver`, and stays live until the backend is
    /// dropped: retained by the caller and given back by the backend when `owns_retain`, or
    /// kept alive by its owner otherwise.
    unsafe fn open_on(
        driver: D,
        device: i32,
        ctx: Context,
        owns_retain: bool,
    ) -> Result<Self, CudaError> {
        let at = |call| move |error| CudaError::Driver { call, error };
        let opened = (|| {
            // SAFETY: the caller promises `ctx` live.
            unsafe { driver.ctx_set_current(ctx) }.map_err(at(DriverCall::CtxSetCurrent))?;
            // Fact 14: `gpuDirectRDMACapable` needs attribute 110; asked once, here.
            let rdma = driver
                .device_get_attribute(DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported, device)
                .map_err(at(DriverCall::DeviceGetAttribute))?;
            let props = AllocationProps::pinned(device).with_gpu_direct_rdma(rdma == 1);
            // Fact 15: granularity depends on the properties, so each kind of memory has its
            // own query, made with the properties it is created with.
            let granularity = driver
                .mem_get_allocation_granularity(props)
                .map_err(at(DriverCall::MemGetAllocationGranularity))?;
            let exportable = props.with_handle_types(HANDLE_TYPE_POSIX_FD);
            let exportable_granularity = match driver.mem_get_allocation_granularity(exportable) {
                Err(e) if e.is_context_loss() => {
                    return Err(at(DriverCall::MemGetAllocationGranularity)(e));
                }
                // Plain memory still works: only exportable memory is refused, with this.
                answer => answer,
            };
            let capacity = driver
                .device_total_mem(device)
                .map_err(at(DriverCall::DeviceTotalMem))?;
            Ok((granularity, props, exportable_granularity, capacity as u64))
        })();
        let (granularity, props, exportable_granularity, capacity) = match opened {
            Ok(v) => v,
            Err(e) => {
                // No call into a context a sticky error took down.
                let lost = matches!(e, CudaError::Driver { error, .. } if error.is_context_loss());
                if owns_retain && !lost {
                    // SAFETY: gives back the retain the caller handed over, once.
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
            props,
            exportable_granularity,
            capacity,
            peers: Vec::new(),
            grant_rw: vec![(device, true)],
            grant_ro: vec![(device, false)],
            owns_retain,
            covered: Mutex::new(vec![0]),
            #[cfg(feature = "cuda")]
            kept: Mutex::new(Kept::default()),
            lost: AtomicBool::new(false),
            state: Mutex::new(CudaState {
                book: Book::new(granularity, true),
                events: HashMap::new(),
                retired: Vec::new(),
                stuck: Vec::new(),
                scratch: Vec::new(),
                pins: 0,
                busy: Vec::new(),
                exportable: HashSet::new(),
                imported: HashSet::new(),
            }),
        })
    }

    /// The device ordinal's `CUdevice`.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Whether the memory this backend creates is GPUDirect-RDMA-capable
    /// (`allocFlags.gpuDirectRDMACapable`), so that a NIC can register it: true where the
    /// device's attribute `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` (110),
    /// read when the backend was opened, is 1 (fact 14). Every `cuMemCreate`, plain and
    /// exportable, asks it then, and none otherwise.
    pub fn gpu_direct_rdma(&self) -> bool {
        self.props.gpu_direct_rdma
    }

    /// The properties every plain `cuMemCreate` of this backend is made with, and the
    /// [`granularity`](Backend::granularity) was asked with: pinned memory on its device,
    /// [RDMA-capable](Self::gpu_direct_rdma) where the device can. Exportable memory adds a
    /// POSIX descriptor to `handle_types`.
    pub fn allocation_props(&self) -> AllocationProps {
        self.props
    }

    /// The recommended granularity of exportable memory's properties
    /// ([`allocation_props`](Self::allocation_props) with a POSIX descriptor requested), read
    /// when the backend was opened: granularity depends on the properties (fact 15), and every
    /// allocation is sized by the device's one [`granularity`](Backend::granularity). Where
    /// the device's granularity is not a multiple of this one, exportable memory would not fit
    /// it, so creating or importing it is refused ([`Violation::Unaligned`], naming both);
    /// plain memory is not affected.
    ///
    /// # Errors
    ///
    /// What the driver returned for the query (then exportable memory is refused with it).
    pub fn exportable_granularity(&self) -> Result<usize, CuError> {
        self.exportable_granularity
    }

    /// Refuses exportable memory (created or imported) of `len` bytes for `op` unless its
    /// properties' granularity is known and fits the device granularity (fact 15): no call is
    /// made then.
    fn check_exportable_fits(&self, op: Op, len: usize) -> Result<(), BackendError> {
        let exportable = self
            .exportable_granularity
            .map_err(|e| self.fail(op, 0, len, e))?;
        if self.granularity.is_multiple_of(exportable) {
            return Ok(());
        }
        let v = Violation::GranularityMisfit {
            device: self.granularity,
            exportable,
        };
        Err(BackendError::refused(op, 0, len, v))
    }

    /// Gives the devices `peers` (ordinals) access to every mapping this backend makes, along
    /// with its own device: each map's one `cuMemSetAccess` names them all (fact 18), with the
    /// mapping's access, so every remap — a region's regrown granule, a copy-on-write boundary,
    /// memory woken at the same address — gives each peer its access back. Each peer is
    /// checked first with `cuDeviceCanAccessPeer(peer, device)` (fact 32), and is never dropped
    /// silently: a peer that cannot access is an error.
    ///
    /// ```
    /// use memtoken::backend::cuda::{CudaBackend, DriverModel, ModelConfig};
    /// let model = DriverModel::new(ModelConfig {
    ///     devices: 2,
    ///     peer_access: vec![(1, 0)],
    ///     ..ModelConfig::default()
    /// })
    /// .unwrap();
    /// let backend = CudaBackend::new(model, 0).unwrap().with_peers(&[1]).unwrap();
    /// assert_eq!(backend.peers(), &[1]);
    /// ```
    ///
    /// # Errors
    ///
    /// [`CudaError::NoPeerAccess`] for a peer that cannot access this device's memory;
    /// [`CudaError::BadPeers`] if `peers` names this device or a device twice, or if the
    /// backend has mapped memory already (it would lack the peers' access);
    /// [`CudaError::Driver`] if `cuDeviceGet` or `cuDeviceCanAccessPeer` fails. The backend is
    /// dropped then.
    pub fn with_peers(mut self, peers: &[i32]) -> Result<Self, CudaError> {
        if lock(&self.state).book.mappings() > 0 {
            let why = "peers must be set before anything is mapped".to_string();
            return Err(CudaError::BadPeers(why));
        }
        let mut devices = Vec::with_capacity(peers.len());
        let lost = &self.lost;
        let at = |call| {
            move |error: CuError| {
                if error.is_context_loss() {
                    lost.store(true, Ordering::Release); // no call into it on drop
                }
                CudaError::Driver { call, error }
            }
        };
        for &ordinal in peers {
            let peer = self
                .driver
                .device_get(ordinal)
                .map_err(at(DriverCall::DeviceGet))?;
            if peer == self.device {
                let why = format!("device {ordinal} is the backend's own device");
                return Err(CudaError::BadPeers(why));
            }
            if devices.contains(&peer) {
                return Err(CudaError::BadPeers(format!(
                    "device {ordinal} is named twice"
                )));
            }
            let can = self
                .driver
                .device_can_access_peer(peer, self.device)
                .map_err(at(DriverCall::DeviceCanAccessPeer))?;
            if !can {
                let device = self.device;
                return Err(CudaError::NoPeerAccess { device, peer });
            }
            devices.push(peer);
        }
        let grants = |rw| {
            let peers = devices.iter().map(move |&peer| (peer, rw));
            std::iter::once((self.device, rw)).chain(peers).collect()
        };
        (self.grant_rw, self.grant_ro) = (grants(true), grants(false));
        self.peers = devices;
        Ok(self)
    }

    /// The peer devices (`CUdevice`s) given access to every mapping along with this device
    /// (see [`with_peers`](Self::with_peers)); empty unless set.
    pub fn peers(&self) -> &[i32] {
        &self.peers
    }

    /// Makes every fence recorded from now on cover `stream` too: a release waits for the work
    /// submitted there. (Typed views and `cover`, feature `cuda`, do this for cudarc streams.)
    ///
    /// # Safety
    ///
    /// `stream` is 0 (the legacy stream) or a live stream of this backend's context, and stays
    /// live until the backend is dropped: fences record events on it until then.
    pub unsafe fn cover_stream(&self, stream: Stream) {
        let mut covered = lock(&self.covered);
        if !covered.contains(&stream) {
            covered.push(stream);
        }
    }

    /// The streams fences cover now, the legacy stream first.
    pub fn covered_streams(&self) -> Vec<Stream> {
        lock(&self.covered).clone()
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

    /// Waits, outside the lock, for everything submitted so far on the legacy stream: for an
    /// event recorded there now, or for the whole context if no event can be recorded or the
    /// wait on it fails (never less than what was asked).
    fn wait_legacy(&self) -> CuResult<()> {
        let event = {
            let Ok(mut s) = self.enter(Op::Copy, 0, 0) else {
                return Err(CuError::CONTEXT_IS_DESTROYED);
            };
            match self.record_now(&mut s, 0) {
                Ok(serial) => Some((serial, s.events[&serial])),
                Err(e) if e.is_context_loss() || self.context_lost() => return Err(e),
                Err(_) => None,
            }
        };
        let waited = match event {
            // SAFETY: the event was created and recorded just above, and is destroyed only
            // below, by this call (its serial is known to no fence).
            Some((_, ev)) => unsafe { self.driver.event_synchronize(ev) }.or_else(|e| {
                if e.is_context_loss() {
                    Err(e)
                } else {
                    self.driver.ctx_synchronize()
                }
            }),
            None => self.driver.ctx_synchronize(),
        };
        if let Err(e) = waited
            && e.is_context_loss()
        {
            let _ = self.fail(Op::Copy, 0, 0, e); // no call after it
            return Err(e);
        }
        if let Some((serial, _)) = event {
            // Destroyed under the lock; if the context cannot be made current now, it is left
            // to the next retirement.
            match self.enter(Op::Copy, 0, 0) {
                Ok(mut s) => self.destroy_event(&mut s, serial),
                Err(_) => lock(&self.state).retired.push(serial),
            }
        }
        waited
    }

    /// `[addr, addr + len)` as driver pointers, or `refusal` if its end overflows: the first
    /// check of every call that takes a range, before anything adds `len` to `addr`.
    fn span(
        op: Op,
        addr: Addr,
        len: usize,
        refusal: Violation,
    ) -> Result<(u64, u64), BackendError> {
        match addr.checked_add(len) {
            Some(end) => Ok((addr as u64, end as u64)),
            None => Err(BackendError::refused(op, addr, len, refusal)),
        }
    }

    /// Refuses a call on a range a copy is using. The range's end does not overflow (checked
    /// by [`span`](Self::span) first).
    fn check_not_busy(s: &CudaState, op: Op, addr: Addr, len: usize) -> Result<(), BackendError> {
        let (start, end) = (addr as u64, addr.saturating_add(len) as u64);
        if s.busy
            .iter()
            .any(|&(_, p, n)| p < end && start < p + n as u64)
        {
            return Err(BackendError::refused(
                op,
                addr,
                len,
                Violation::Busy { addr, len },
            ));
        }
        Ok(())
    }

    /// Whether any listed range overlaps `[addr, addr + len)` (its end saturating at the top of
    /// the address space).
    fn overlaps(ranges: &[(u64, usize)], addr: Addr, len: usize) -> bool {
        let (start, end) = (addr as u64, addr.saturating_add(len) as u64);
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

    /// Creates an event and records it on `stream` now; returns its serial. An event that
    /// cannot be recorded is destroyed again (or left to be retried with the retired ones).
    fn record_now(&self, s: &mut CudaState, stream: Stream) -> CuResult<u64> {
        let serial = self.create_event(s)?;
        // SAFETY: the event was created just above by this driver; `stream` is a covered
        // stream: 0, or one whose owner promised it live until this backend is dropped.
        match unsafe { self.driver.event_record(s.events[&serial], stream) } {
            Ok(()) => Ok(serial),
            Err(e) => {
                if !e.is_context_loss() {
                    self.destroy_event(s, serial);
                }
                Err(e)
            }
        }
    }

    /// Creates an event and enters it in the record under a new serial.
    fn create_event(&self, s: &mut CudaState) -> CuResult<u64> {
        let event = self.driver.event_create()?;
        let serial = next_serial();
        s.events.insert(serial, event);
        Ok(serial)
    }

    /// Records every mark of a fence not yet recorded; whether all are.
    fn record_marks(&self, marks: &mut [Mark]) -> bool {
        if marks.iter().all(|m| m.recorded) {
            return true;
        }
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            return false;
        };
        for m in marks.iter_mut().filter(|m| !m.recorded) {
            let serial = match m.event {
                Some(serial) => serial,
                None => match self.create_event(&mut s) {
                    Ok(serial) => {
                        m.event = Some(serial);
                        serial
                    }
                    Err(e) => {
                        let _ = self.fail(Op::Fence, 0, 0, e);
                        return false;
                    }
                },
            };
            let Some(&event) = s.events.get(&serial) else {
                m.recorded = true; // not this backend's event: nothing of ours to record
                continue;
            };
            // SAFETY: `s.events` maps the serial to an event created by this driver and not yet
            // destroyed (destroyed only when its fence is retired); `m.stream` is a covered
            // stream, live until this backend is dropped (`cover_stream`'s contract; 0 always
            // is).
            match unsafe { self.driver.event_record(event, m.stream) } {
                Ok(()) => m.recorded = true,
                Err(e) => {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    return false;
                }
            }
        }
        true
    }

    /// Destroys one of this backend's events, named by its serial, once; a failed
    /// destruction is retried later.
    fn destroy_event(&self, s: &mut CudaState, serial: u64) {
        let Some(&event) = s.events.get(&serial) else {
            return; // not this backend's event, or already destroyed
        };
        // SAFETY: `s.events` just mapped `serial` to an event created by this driver and not
        // yet destroyed (the entry leaves as soon as it is, so a serial named twice is
        // destroyed once; serials are never reused, so a stale one names nothing).
        match unsafe { self.driver.event_destroy(event) } {
            Ok(()) => {
                s.events.remove(&serial);
            }
            Err(e) => {
                s.retired.push(serial);
                let _ = self.fail(Op::Fence, 0, 0, e);
            }
        }
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

    /// Opens the backend on the context of a cudarc `CudaContext` the caller already uses,
    /// sharing it instead of retaining the context behind cudarc's back: the backend keeps the
    /// `Arc` (so the context lives as long as the backend) and makes that context current for
    /// its calls.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] when a call fails while opening.
    pub fn from_context(
        context: std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<Self, CudaError> {
        let driver = SysDriver::load()?;
        let (device, ctx) = (context.cu_device(), context.cu_ctx() as Context);
        // SAFETY: `ctx` is the live context of `context`, which the backend keeps (below) until
        // it is dropped; the backend takes no retain of its own (`owns_retain` false).
        let backend = unsafe { Self::open_on(driver, device, ctx, false) }?;
        lock(&backend.kept).context = Some(context);
        Ok(backend)
    }

    /// Makes every fence recorded from now on cover the cudarc `stream` (see
    /// [`cover_stream`](Self::cover_stream)); the backend keeps the stream alive meanwhile.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`] if the stream belongs to another context.
    pub fn cover(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        if stream.context().cu_ctx() as Context != self.ctx {
            let v = Violation::ForeignStream;
            return Err(BackendError::refused(Op::Fence, 0, 0, v));
        }
        let handle = stream.cu_stream() as Stream;
        if lock(&self.covered).contains(&handle) {
            return Ok(());
        }
        lock(&self.kept).streams.push(std::sync::Arc::clone(stream));
        // SAFETY: the stream belongs to this backend's context (checked above) and lives until
        // the backend drops: the backend holds an `Arc` of it (just above).
        unsafe { self.cover_stream(handle) };
        Ok(())
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

    fn location(&self) -> Location {
        Location::Cuda {
            device: self.device,
        }
    }

    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
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

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
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

    fn create(&self, len: usize) -> Result<CudaPhys, BackendError> {
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
        s.exportable.remove(&phys);
        s.imported.remove(&phys);
        Ok(())
    }

    fn map(
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
                s.stuck.push((ptr, len));
                if rollback.is_context_loss() {
                    return Err(fail(rollback));
                }
            }
        }
        Err(fail(e))
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
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
        s.stuck.retain(|&(p, _)| !(start <= p && p < end));
        Ok(())
    }

    fn copy_into_phys(&self, phys: CudaPhys, src: Addr, len: usize) -> Result<(), BackendError> {
        let fail = |e| self.fail(Op::Copy, src, len, e);
        // Map the whole handle at a scratch range, start the copy, and wait for it outside the
        // lock (the source and the scratch range are busy meanwhile); then take the scratch
        // range down again.
        let span = len;
        let d = &self.driver;
        let (scratch, copied, marks) = {
            let mut s = self.enter(Op::Copy, src, len)?;
            self.sweep_scratch(&mut s).map_err(fail)?;
            s.book
                .check_copy(phys, src, len)
                .map_err(|v| BackendError::refused(Op::Copy, src, len, v))?;
            if s.imported.contains(&phys) {
                let v = Violation::Import("imported memory is written never");
                return Err(BackendError::refused(Op::Copy, src, len, v));
            }
            if Self::overlaps(&s.stuck, src, len) {
                let v = Violation::NotMapped { addr: src, len };
                return Err(BackendError::refused(Op::Copy, src, len, v));
            }
            let scratch = d
                .mem_address_reserve(span, self.granularity, 0)
                .map_err(fail)?;
            s.book.apply_reserve(scratch as Addr, span);
            // SAFETY: `scratch` is a reservation of `span` bytes made just above, nothing
            // mapped in it; `s.book.check_copy` above proved `phys` live (so its handle is: see
            // `release`) with exactly `span` bytes, all mapped from offset 0.
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
                .apply_map(scratch as Addr, span, phys, Access::ReadWrite);
            // The scratch range is the backend's own, for this copy only: no peer gets access.
            // SAFETY: the scratch range was mapped, exactly, just above, and is given
            // read-write access before the copy writes to it; `s.book.check_copy` above proved
            // every byte of the source mapped, and the `s.stuck` check that it has access. Both
            // stay mapped until the copy has finished: the source and the scratch range are
            // marked busy below (unmap, free and map refuse busy ranges) until the wait below.
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
            (scratch, copied, marks)
        };
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
            // stays mapped — never reused, never freed under a copy that may still run.
            return Err(fail(e));
        }
        s.busy.retain(|&(id, _, _)| id != marks.0 && id != marks.1);
        if self.context_lost() {
            return Err(BackendError::new(Op::Copy, src, len, Cause::ContextLost));
        }
        // SAFETY: `self.ctx` is live until the backend is dropped (see `enter`).
        if let Err(e) = unsafe { d.ctx_set_current(self.ctx) } {
            // Not current: the scratch range is taken down by a later sweep.
            s.stuck.push((scratch, span));
            s.scratch.push((scratch, span));
            return Err(fail(e));
        }
        // SAFETY: the scratch range was mapped, exactly, above, and nothing else unmapped it
        // (it was busy, and is the backend's own).
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

    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let len = src.len();
        let fail = |e| self.fail(Op::Copy, dst, len, e);
        let busy = self.hold(dst, len, true)?;
        if len == 0 {
            return Ok(()); // nothing to copy: no driver call with an address that may be none
        }
        // SAFETY: `hold` proved every byte of the destination mapped read-write with access in
        // the record, and keeps the range from being unmapped, freed or mapped over until
        // `busy` is released, once the copy has landed (below).
        unsafe { self.driver.memcpy_htod(dst as u64, src) }.map_err(fail)?;
        // From pageable memory the call returns once the bytes are staged; the DMA to the
        // destination may still run on the legacy stream: wait for it before the range is free.
        match self.wait_legacy() {
            Ok(()) => Ok(()),
            Err(e) => {
                if !e.is_context_loss() {
                    std::mem::forget(busy); // not known to have landed: the range stays busy
                }
                Err(fail(e))
            }
        }
    }

    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let len = dst.len();
        let _busy = self.hold(src, len, false)?;
        if len == 0 {
            return Ok(()); // nothing to copy: no driver call with an address that may be none
        }
        // SAFETY: `hold` proved every byte of the source mapped with access in the record, and
        // keeps the range from being unmapped, freed or mapped over until `_busy` is dropped,
        // after the (synchronous) copy.
        unsafe { self.driver.memcpy_dtoh(dst, src as u64) }
            .map_err(|e| self.fail(Op::Copy, src, len, e))
    }

    fn fence(&self) -> CudaFence {
        let mut marks: Vec<Mark> = self
            .covered_streams()
            .into_iter()
            .map(|stream| Mark {
                stream,
                event: None,
                recorded: false,
            })
            .collect();
        // What cannot be recorded now is recorded at the next query.
        let _ = self.record_marks(&mut marks);
        CudaFence(Mutex::new(marks))
    }

    fn fence_done(&self, fence: &CudaFence) -> bool {
        // Lost: nothing runs any more; the teardown that follows sees the loss and calls nothing.
        let mut marks = lock(&fence.0);
        if !self.record_marks(&mut marks) {
            return self.context_lost();
        }
        let Ok(s) = self.enter(Op::Fence, 0, 0) else {
            return self.context_lost();
        };
        for serial in marks.iter().filter_map(|m| m.event) {
            let Some(&event) = s.events.get(&serial) else {
                continue; // not this backend's event: nothing of ours to wait for
            };
            // SAFETY: `s.events` maps the serial to an event created by this driver and not yet
            // destroyed (an entry leaves when its event is destroyed; serials are never reused).
            match unsafe { self.driver.event_query(event) } {
                Ok(true) => {}
                Ok(false) => return false,
                // A failed query is asked again at the next poll, unless it revealed the loss.
                Err(e) => {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    return self.context_lost();
                }
            }
        }
        true
    }

    fn wait_fence(&self, fence: &CudaFence) -> bool {
        let mut marks = lock(&fence.0);
        if !self.record_marks(&mut marks) {
            return self.context_lost();
        }
        for serial in marks.iter().filter_map(|m| m.event) {
            let event = {
                let Ok(s) = self.enter(Op::Fence, 0, 0) else {
                    return self.context_lost();
                };
                match s.events.get(&serial) {
                    Some(&event) => event,
                    None => continue,
                }
            };
            // Outside the lock. SAFETY: `s.events` just mapped the serial to a live event, and
            // it stays live: it belongs to `fence`, borrowed for this call, and an event is
            // destroyed only when its fence is retired (which takes the fence by value) or the
            // backend dropped.
            let waited = unsafe { self.driver.event_synchronize(event) }.or_else(|e| {
                if e.is_context_loss() {
                    Err(e)
                } else {
                    self.driver.ctx_synchronize() // the whole context: never less
                }
            });
            if let Err(e) = waited {
                let _ = self.fail(Op::Fence, 0, 0, e);
                return self.context_lost();
            }
        }
        true
    }

    fn retire_fence(&self, fence: CudaFence) {
        let marks = fence.0.into_inner().unwrap_or_else(|e| e.into_inner());
        let serials = marks.iter().filter_map(|m| m.event);
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            if !self.context_lost() {
                // Not current now: destroyed at the next retirement.
                lock(&self.state).retired.extend(serials);
            }
            return; // lost: the driver freed the events with the context
        };
        // This fence's events (those that are ours), and any whose destruction failed before.
        let mut retiring = std::mem::take(&mut s.retired);
        retiring.extend(serials);
        for event in retiring {
            self.destroy_event(&mut s, event);
            if self.context_lost() {
                return;
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

/// Export as a POSIX descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, facts 26–29).
/// Fabric handles are declared ([`Fabric`](super::Fabric)) but not exported by this backend.
impl<D: Driver> Exportable<PosixFd> for CudaBackend<D> {
    /// `cuMemCreate` with `requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
    /// (the handle type is chosen here, once: fact 26) and the backend's other properties
    /// ([`allocation_props`](CudaBackend::allocation_props): RDMA-capable where the device
    /// can). Refused before the call where the granularity of these properties does not fit
    /// the device's ([`exportable_granularity`](CudaBackend::exportable_granularity)).
    fn create_exportable(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let mut s = self.enter(Op::Create, 0, len)?;
        s.book
            .check_create(len)
            .map_err(|v| BackendError::refused(Op::Create, 0, len, v))?;
        self.check_exportable_fits(Op::Create, len)?;
        let props = self.props.with_handle_types(HANDLE_TYPE_POSIX_FD);
        let handle = self
            .driver
            .mem_create_with(len, props)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let phys = CudaPhys {
            handle,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        s.exportable.insert(phys);
        Ok(phys)
    }

    /// `cuMemExportToShareableHandle`: a new descriptor of the whole allocation (offset 0),
    /// owned by the caller. The memory lives while it is open, whatever this process releases
    /// (fact 27).
    fn export(&self, phys: CudaPhys, len: usize) -> Result<Shareable, BackendError> {
        let s = self.enter(Op::Create, 0, len)?;
        let refuse = |v| BackendError::refused(Op::Create, 0, len, v);
        s.book
            .check_release(phys, len)
            .or_else(|v| match v {
                Violation::PhysStillMapped { .. } => Ok(()),
                v => Err(v),
            })
            .map_err(refuse)?;
        if !s.exportable.contains(&phys) {
            return Err(refuse(Violation::NotExportable));
        }
        // SAFETY: `check_release` above proved `phys` created by this backend through this
        // driver and not released, so its handle is live (see `release`).
        let shared = unsafe {
            self.driver
                .mem_export_to_shareable_handle(phys.handle, HANDLE_TYPE_POSIX_FD)
        }
        .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        match shared {
            ShareableHandle::Fd(fd) => Ok(Shareable { fd, offset: 0, len }),
            ShareableHandle::Opaque(_) => Err(refuse(Violation::Import(
                "the driver exported something other than a descriptor",
            ))),
        }
    }

    /// `cuMemImportFromShareableHandle` with the descriptor by value (fact 28); the descriptor
    /// is closed right after. A CUDA handle is a whole allocation: an offset other than 0 is
    /// refused before the call. Where the driver says the allocation's size (the model), a size
    /// other than the message's is refused and the import released at once; the real driver
    /// does not say it, and then `cuMemMap` of the claimed length is what checks it
    /// (assumption 7). The handle is released once, by [`Backend::release`] (fact 29).
    fn import(&self, handle: Shareable) -> Result<CudaPhys, BackendError> {
        let Shareable { fd, offset, len } = handle;
        let mut s = self.enter(Op::Create, 0, len)?;
        let refuse = |v| BackendError::refused(Op::Create, 0, len, v);
        s.book.check_create(len).map_err(refuse)?;
        // Imported memory was made with exportable properties: it is mapped as the device
        // granularity sizes it only where theirs fits (fact 15).
        self.check_exportable_fits(Op::Create, len)?;
        if offset != 0 {
            return Err(refuse(Violation::Import(
                "an offset into a CUDA allocation: handles are mapped whole, from 0",
            )));
        }
        let raw = fd.as_raw_fd() as u64;
        let imported = self
            .driver
            .mem_import_from_shareable_handle(raw, HANDLE_TYPE_POSIX_FD)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        drop(fd); // fact 28: the importer may close its descriptor right after the import
        // SAFETY: `imported` was returned just above by this driver and is not released.
        let size = unsafe { self.driver.mem_allocation_size(imported) };
        if let Some(size) = size.filter(|&size| size != len) {
            // SAFETY: as above; released once, here, and never recorded.
            if let Err(e) = unsafe { self.driver.mem_release(imported) } {
                return Err(self.fail(Op::Release, 0, len, e));
            }
            return Err(refuse(if size < len {
                Violation::ImportTooSmall {
                    offset,
                    len,
                    size: size as u64,
                }
            } else {
                Violation::Import("the allocation is longer than the message claims")
            }));
        }
        let phys = CudaPhys {
            handle: imported,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        s.imported.insert(phys);
        Ok(phys)
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
        if self.owns_retain && !self.context_lost() {
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
    fn a_range_whose_end_overflows_is_refused_before_the_driver() {
        let model = DriverModel::default();
        let backend = open(&model);
        let g = backend.granularity();
        let phys = backend.create(g).unwrap();
        let top = usize::MAX - g + 1;
        let refused = [
            backend.free(top, 2 * g).unwrap_err(),
            backend
                .map(top, 2 * g, phys, Access::ReadWrite)
                .unwrap_err(),
            backend.unmap(top, 2 * g).unwrap_err(),
            backend.unmap(g, usize::MAX).unwrap_err(),
            backend.copy_into_phys(phys, top, 2 * g).unwrap_err(),
            backend.copy_from_host(usize::MAX, &[1, 2]).unwrap_err(),
            backend.copy_to_host(&mut [0; 2], usize::MAX).unwrap_err(),
        ];
        for e in &refused {
            assert!(matches!(e.cause, Cause::Violation(_)), "{e}");
        }
        for call in [
            DriverCall::MemAddressFree,
            DriverCall::MemMap,
            DriverCall::MemUnmap,
            DriverCall::MemcpyHtoD,
            DriverCall::MemcpyDtoH,
            DriverCall::MemcpyDtoD,
        ] {
            assert_eq!(model.count(call), 0, "{call:?}");
        }
        // An empty copy copies nothing, wherever: no driver call sees its address.
        backend.copy_from_host(0, &[]).unwrap();
        backend.copy_to_host(&mut [], usize::MAX).unwrap();
        assert_eq!(model.count(DriverCall::MemcpyHtoD), 0);
        backend.release(phys, g).unwrap();
    }

    #[test]
    fn a_create_past_the_device_memory_is_out_of_memory() {
        let model = DriverModel::default();
        let backend = open(&model);
        let g = backend.granularity();
        let e = backend.create(usize::MAX & !(g - 1)).unwrap_err();
        assert!(matches!(e.cause, Cause::Driver { .. }), "{e}");
        assert_eq!(model.outstanding().physical_bytes, 0);
    }

    #[test]
    fn an_event_named_twice_at_retirement_is_destroyed_once() {
        let model = DriverModel::default();
        let backend = open(&model);
        let fence = backend.fence();
        let marks = lock(&fence.0).clone();
        model.fail_nth(DriverCall::EventDestroy, 1, CuError::INVALID_VALUE);
        backend.retire_fence(fence); // fails: the event waits in `retired`
        assert_eq!(model.outstanding().events, 1);
        // A fence naming the same event (as a foreign one could) retires it once, not twice.
        backend.retire_fence(CudaFence(Mutex::new(marks)));
        assert_eq!(model.outstanding().events, 0);
        assert_eq!(model.count(DriverCall::EventDestroy), 2);
    }

    #[test]
    fn a_scratch_range_waiting_to_be_freed_is_not_the_callers_to_map() {
        let model = DriverModel::default();
        let backend = open(&model);
        let g = backend.granularity();
        let (addr, src) = (backend.reserve(g).unwrap(), backend.create(g).unwrap());
        backend.map(addr, g, src, Access::ReadWrite).unwrap();
        let dst = backend.create(g).unwrap();
        model.fail_nth(DriverCall::MemAddressFree, 1, CuError::INVALID_VALUE);
        backend.copy_into_phys(dst, addr, g).unwrap();
        let (scratch, span) = lock(&backend.state).scratch[0];
        let e = backend
            .map(scratch as Addr, span, dst, Access::ReadWrite)
            .unwrap_err();
        assert!(
            matches!(e.cause, Cause::Violation(Violation::NotReserved { .. })),
            "{e}"
        );
        // The next copy frees the scratch range.
        backend.copy_into_phys(dst, addr, g).unwrap();
        assert!(lock(&backend.state).scratch.is_empty());
        assert_eq!(model.outstanding().reservations, 1);
    }
}
