//! CUDA VMM through a thin [`Driver`] seam: `cuMemAddressReserve`, `cuMemCreate` (pinned
//! device memory, GPUDirect-RDMA-capable where the device can), `cuMemMap` + `cuMemSetAccess`,
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree`, with the recommended granularity of the
//! memory's properties and events as fences.
//! Guide: [`guide::cuda`](crate::guide::cuda).
//!
//! The backend holds the logic (current context, rollback of a half-done map, loss detection); the
//! driver only forwards. With feature `cuda`, `SysDriver` forwards to `cudarc::driver::sys` (loaded
//! at run time: it builds with no CUDA toolkit, and `CudaBackend::open` returns an error, never
//! panics, when no driver is installed). On any machine,
//! [`DriverModel`](crate::backend::doubles::DriverModel) stands in for the driver with the VMM
//! rules, events, context loss and fault injection, so the whole state machine runs in `cargo
//! test`.
//!
//! After an error that means the context is lost (a sticky error such as
//! `CUDA_ERROR_ILLEGAL_ADDRESS`, or `CUDA_ERROR_CONTEXT_IS_DESTROYED`), the backend makes no driver
//! call at all: every call fails with [`Cause::ContextLost`](crate::backend::Cause::ContextLost)
//! and [`Backend::context_lost`](crate::backend::Backend::context_lost) is true, so the typed layer
//! quarantines instead of calling, and residuals can be discharged with the proof.
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
//! - Every VMM call needs the device's attribute 102
//!   (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`), whose support varies by
//!   device, driver and virtualization: the backend asks it first when opened and refuses a
//!   device without it ([`CudaError::NoVmm`]), before any VMM call. — VMM (fact 14).
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
//!   — VMM. (`gpu_rdma_attribute_and_granularity_by_properties` in `tests/gpu/cases.rs` prints what a
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
//! **Export and import** (POSIX descriptors only; [`Exportable`](crate::backend::Exportable) for
//! [`PosixFd`](crate::backend::PosixFd)).
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
//! **Capture** (facts 39–43). The VMM calls take no stream and are never captured; whether they
//! break another thread's global-mode capture is not documented (the model refuses them with
//! 900 then, and invalidates that capture), so every VMM call runs with the calling thread's
//! capture interaction mode exchanged to relaxed (`cuThreadExchangeStreamCaptureMode`,
//! restored after), as PyTorch does around its allocations. A fence mark is never recorded on
//! a stream that captures, nor its event asked (a captured event's query invalidates the
//! capture): `cuStreamIsCapturing` is asked first, and the mark is recorded once the capture
//! has ended; any non-loss error on a mark's event means "record it again". The legacy stream
//! is probed the same way before a mark or a host copy: while a *blocking* stream of the
//! context captures (the per-thread stream is one), it answers `STREAM_CAPTURE_IMPLICIT`
//! without invalidating anything, and is not used. memtoken never calls `cuCtxSynchronize`:
//! where an event's wait fails it synchronizes that one stream (`cuStreamSynchronize`), never
//! a capturing one. Captures made through [`Capture`](crate::interop::Capture) go through this seam
//! (`cuStreamBeginCapture`, `cuStreamEndCapture`, `cuGraphInstantiate`, `cuGraphLaunch`,
//! `cuGraphExecDestroy`), and their graphs borrow the memory they use; memory a view lends to
//! work on a stream while it captures outside memtoken is never unmapped. — STREAM;
//! PG §6.2.8.7.3; PT.
//!
//! # Assumptions not yet verified on a GPU
//!
//! What the backend relies on that no reference states. Each has a test in `tests/gpu/cases.rs`
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

// Where things are: `open` (opening, peers, the context's retains, drop), `record` (what the
// backend holds and the checks every call passes against it), `vmm` (reserve, free, create,
// release, map, unmap), `copy` (copies, scratch mappings), `fence` (events, streams, order per memory),
// `export` (POSIX descriptors); `driver` is the seam, `sys` the real driver (feature `cuda`),
// `model` the driver model.
mod copy;
mod driver;
mod export;
pub mod facts;
mod fence;
mod graph;
#[cfg(feature = "cuda")]
mod kept;
pub(crate) use graph::Ended;
pub(in crate::backend) mod model;
mod open;
mod order;
mod plain;
mod record;
#[cfg(feature = "cuda")]
mod sys;
#[cfg(test)]
mod tests;
mod vmm;

pub use driver::{
    AllocationProps, CaptureInfo, CaptureMode, Context, CuError, CuResult, DeviceAttribute, Driver,
    DriverCall, ErrorFate, Event, Graph, GraphExec, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD,
    PER_THREAD_STREAM, ShareableHandle, Stream,
};
pub use fence::{CudaFence, PeerWork};

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use open::open_context;
pub use open::{CudaError, CudaMechanism};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use sys::SysDriver;

use record::CudaState;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

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

/// A serial number never handed out before in this process: physical memory and fences of
/// every CUDA backend are keyed by one, never by a value the driver may hand out again.
fn next_serial() -> u64 {
    super::unique().get()
}

/// CUDA virtual memory management on one device, over driver `D`.
///
/// **What a fence covers.** A token's fence is one event per stream that may use its memory,
/// recorded when its release starts (or when it is dropped), after everything submitted there
/// so far: the legacy default stream (0, cudarc's `default_stream()`), which waits for every
/// *blocking* stream; every *covered* stream; and each stream a typed view used that memory
/// on (per reservation: a token's, or a KV cache's planes). The non-blocking streams cudarc's
/// `new_stream()` makes are seen once memtoken learns of them: *known* to views
/// ([`know_stream`](CudaBackend::know_stream); cudarc views know their own stream, `know`
/// takes another), fenced only for the memory they used — so a fence stays as small as the
/// streams that touched the memory, however many come and go — or *covered*
/// ([`cover_stream`](CudaBackend::cover_stream), `cover` for cudarc), fenced by every release:
/// the way for raw pointers, whose memory memtoken cannot tell. A stream is let go with
/// [`forget_stream`](CudaBackend::forget_stream) once its work has completed (a cudarc stream
/// the backend keeps alive, once its owner dropped it too). Memory used by a kernel on such a
/// stream is unmapped only after that kernel's work has finished.
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
/// through `device_ptr(&stream)`, kernel arguments; a view knows its stream. A committed
/// allocation also gives its raw `device_ptr()` (cover the stream yourself) and
/// `copy_from_host` / `copy_to_host`; prefixes, mappings and block tables have copies too.
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
/// use memtoken::backend::{cuda::CudaBackend, doubles::DriverModel};
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
    /// Whether this backend runs the plain mechanism (`cuMemAlloc`, fact 59) instead of VMM:
    /// see [`mechanism`](Self::mechanism).
    plain: bool,
    /// The device's attribute 102, as read when opened.
    vmm_supported: bool,
    /// The peer devices given access with this one: see [`with_peers`](Self::with_peers).
    peers: Vec<i32>,
    /// The access descriptors of every map, this device first, then each peer: read-write,
    /// and read-only.
    grant_rw: Vec<(i32, bool)>,
    grant_ro: Vec<(i32, bool)>,
    /// Whether `drop` gives back a retain of the primary context (one `new` took).
    owns_retain: bool,
    /// cudarc's handles on what this backend uses but does not own: the context it was opened
    /// on, and the streams it covers, kept alive as long as the backend records events there.
    #[cfg(feature = "cuda")]
    #[allow(dead_code)] // see `Kept`
    kept: Mutex<Kept>,
    lost: AtomicBool,
    /// Live [`PeerWork`] declarations: while any lives, no fence is done (see
    /// [`peer_work`](CudaBackend::peer_work)).
    peer_work: std::sync::atomic::AtomicUsize,
    /// What this backend handed out and the driver still holds: every call is checked against
    /// it before it reaches the driver, so no safe call can pass the driver a stale or foreign
    /// handle (which the driver does not promise to survive: see [`Driver`'s rules](Driver#safety)).
    state: Mutex<CudaState>,
}

/// What a backend keeps alive for cudarc (feature `cuda`): held, never read.
#[cfg(feature = "cuda")]
#[derive(Debug, Default)]
#[allow(dead_code)] // the handles are kept only so that cudarc does not destroy them
struct Kept {
    context: Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    streams: Vec<std::sync::Arc<cudarc::driver::CudaStream>>,
}
