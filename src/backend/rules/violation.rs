//! [`Violation`]: which rule of virtual memory management a call broke.

use crate::backend::Addr;

/// A broken VMM rule: the call was refused and nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A length or address is not a positive multiple of the granularity.
    #[error("{what} {value:#x} is not a positive multiple of the granularity ({granularity:#x})")]
    Unaligned {
        /// Which argument.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The granularity.
        granularity: usize,
    },
    /// `free` of a range that is not exactly one reservation, or `map` outside any reservation.
    #[error("[{addr:#x}, +{len:#x}) is not (inside) a reservation of this backend")]
    NotReserved {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// `free` of a reservation that still has mappings under it.
    #[error("reservation at {addr:#x} still has {mappings} mapping(s) under it")]
    StillMapped {
        /// Start of the reservation.
        addr: Addr,
        /// How many mappings remain.
        mappings: usize,
    },
    /// `map` over a range that is already (partly) mapped.
    #[error("[{addr:#x}, +{len:#x}) is already mapped")]
    AlreadyMapped {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// `unmap` of a range that is not exactly covered by whole mappings.
    #[error("[{addr:#x}, +{len:#x}) is not exactly covered by whole mappings")]
    NotMapped {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// A physical handle this backend never created, or already released.
    #[error("unknown or stale physical handle")]
    UnknownPhys,
    /// `release` with a length other than the one the handle was created with.
    #[error("physical handle has {actual:#x} bytes, call said {given:#x}")]
    PhysLength {
        /// The length it was created with.
        actual: usize,
        /// The length the call gave.
        given: usize,
    },
    /// `release` of physical memory that is still mapped, where the backend forbids it.
    #[error("physical memory is still mapped {mappings} time(s)")]
    PhysStillMapped {
        /// How many mappings remain.
        mappings: usize,
    },
    /// The range lies in a reservation whose state became unknown after a failed system call:
    /// it is never touched again (its VA is leaked rather than risk unmapping foreign memory).
    #[error(
        "[{addr:#x}, +{len:#x}) lies in a reservation poisoned by an earlier failed system call"
    )]
    Poisoned {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// A copy whose source is mapped from its own destination.
    #[error("copy source [{addr:#x}, +{len:#x}) maps the destination physical memory itself")]
    SelfCopy {
        /// Start of the source.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// A copy into memory that is mapped read-only.
    #[error("[{addr:#x}, +{len:#x}) is mapped read-only: it cannot be written")]
    ReadOnly {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// `unpin` with no pin of this backend held.
    #[error("no pin is held: every unpin must follow a pin")]
    NotPinned,
    /// A stream of another context than the backend's.
    #[error("the stream belongs to another context: fences can only cover this device's streams")]
    ForeignStream,
    /// A raw stream handle the backend neither knows nor covers.
    #[error(
        "stream {0:#x} is neither known to the device nor covered by its fences: make it known first (`know_stream`, or `know` for a cudarc stream; `cover_stream` for raw pointers)"
    )]
    UncoveredStream(usize),
    /// A copy within device memory whose source and destination overlap (`cuMemcpyDtoD` of
    /// overlapping ranges is undefined).
    #[error("a copy of {len} bytes from {src:#x} to {dst:#x}: the ranges overlap")]
    OverlappingCopy {
        /// The source.
        src: Addr,
        /// The destination.
        dst: Addr,
        /// The length.
        len: usize,
    },
    /// The per-thread default stream, for a view: one handle, a different stream on each
    /// thread, so a fence recorded on another thread would not cover the work.
    #[error(
        "the per-thread stream is a different stream on each thread: memtoken cannot fence work on it from another thread; make views on a stream of your own"
    )]
    PerThreadStream,
    /// A capture asked of the legacy stream (capture cannot begin there) or of the per-thread
    /// stream (a different stream on each thread: its graph's launches on another thread would
    /// run where no fence of this one records).
    #[error(
        "a capture cannot begin on stream {0:#x}: not on the legacy stream (the driver refuses it) nor on the per-thread stream (a different stream on each thread); capture on a stream of your own"
    )]
    CaptureStream(usize),
    /// A memtoken capture whose stream no longer captures: someone else ended it (cudarc's
    /// `end_capture` on the same stream), and may hold its graph.
    #[error(
        "the capture on stream {0:#x} was ended by someone else, who may hold its graph: the memory it lent stays held for good"
    )]
    CaptureEndedElsewhere(usize),
    /// A graph launch on a stream that captures: it would become part of a graph that borrows
    /// none of its memory.
    #[error(
        "stream {0:#x} captures: a memtoken graph is not launched into another capture (the outer graph would not borrow its memory)"
    )]
    CapturingStream(usize),
    /// A graph launched over memory that sleeps (a KV cache's planes): nothing is mapped
    /// there; the launch was refused.
    #[error(
        "the graph uses memory at {addr:#x} that sleeps (a KV cache asleep): wake it before launching"
    )]
    Asleep {
        /// The start of the sleeping memory's reservation.
        addr: Addr,
    },
    /// Memory a view lent to work on a stream while it captured outside memtoken's own
    /// capture: a graph memtoken does not know of may use it whenever it is launched.
    #[error(
        "[{addr:#x}, +{len:#x}) was used on a stream during a CUDA graph capture memtoken did not make: a graph may still launch with it, so it stays mapped (capture through `memtoken::interop::Capture` to release it)"
    )]
    HeldByGraph {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// The range is lent to a graph a memtoken [`Capture`](crate::interop::Capture) made, which may
    /// still launch: it stays mapped until that graph is dropped.
    #[error(
        "[{addr:#x}, +{len:#x}) is lent to a graph captured through memtoken, which may still launch: it stays mapped until the graph is dropped"
    )]
    HeldByCapture {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// The range is in use by a copy running outside the backend's lock: unmapping, freeing or
    /// mapping over it waits until the copy has finished.
    #[error(
        "[{addr:#x}, +{len:#x}) is in use by a copy in progress: try again once it has finished"
    )]
    Busy {
        /// Start of the range.
        addr: Addr,
        /// Its length.
        len: usize,
    },
    /// An imported handle the backend refuses to map: it names memory it cannot trust (not a
    /// sealed regular file, a misaligned offset, a length that is not whole granules).
    #[error("imported handle refused: {0}")]
    Import(&'static str),
    /// An imported handle whose file is smaller than the memory it claims.
    #[error(
        "imported handle claims {len:#x} bytes at offset {offset:#x} of a file of {size:#x} \
         bytes: refused, never mapped"
    )]
    ImportTooSmall {
        /// Offset the handle claims.
        offset: u64,
        /// Length the handle claims.
        len: usize,
        /// The file's real size.
        size: u64,
    },
    /// Exportable memory the kernel refuses to seal against writes (`F_SEAL_WRITE`): some
    /// mapping of it is writable, or its pages are pinned (an RDMA registration, `io_uring`
    /// buffers). It was not exported; every mapping of it is as it was.
    #[error(
        "the memory cannot be sealed against writes (errno {errno}: {}): it is pinned (an RDMA \
         registration, say) or mapped writable outside this backend; export it before registering \
         it with anything that pins pages",
        std::io::Error::from_raw_os_error(*errno)
    )]
    Unsealable {
        /// The raw `errno` of the refused seal (`EBUSY`).
        errno: i32,
    },
    /// Exportable memory on a device whose granularity (which sizes and places every
    /// allocation) is not a multiple of the granularity of the exportable memory's own
    /// properties: such memory would not fit its own rules, so none is created or imported.
    #[error(
        "exportable memory is refused: the device granularity {device:#x} is not a multiple of \
         the granularity {exportable:#x} of memory created exportable; use plain memory, or a \
         device whose granularities fit"
    )]
    GranularityMisfit {
        /// The device's granularity (of plain memory).
        device: usize,
        /// The granularity of memory created exportable.
        exportable: usize,
    },
    /// Memory created without the handle kind asked for: it cannot be exported as it.
    #[error("physical memory was not created exportable as this handle kind")]
    NotExportable,
    /// `map` (or a copy into physical memory) of anything but one whole physical allocation
    /// from offset 0: the CUDA driver maps only whole allocations (`cuMemMap`'s offset
    /// "currently must be zero"), and every backend keeps that rule so that the typed layer
    /// never depends on it being relaxed.
    #[error(
        "{len:#x} bytes at offset {offset:#x} of physical memory of {phys_len:#x} bytes: only a \
         whole physical allocation, from offset 0, may be mapped or copied into"
    )]
    PartialHandle {
        /// Offset into the physical memory.
        offset: usize,
        /// Bytes to map or copy.
        len: usize,
        /// Size of the physical memory.
        phys_len: usize,
    },
}
