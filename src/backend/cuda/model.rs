//! [`DriverModel`]: the CUDA driver's VMM rules in pure Rust, so the CUDA backend's whole state
//! machine runs in `cargo test` on any machine.
//!
//! Where the CUDA documentation is silent, the model takes the strictest reading the CUDA facts
//! sheet (`CUDA-FACTS.md`) gives; each such rule names its fact number.

use super::driver::{
    AllocationProps, Context, CuError, CuResult, DeviceAttribute, Driver, DriverCall, Event,
    HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD, ShareableHandle, Stream,
};
use crate::backend::faults::FaultPlan;
use crate::backend::rules::Book;
use crate::backend::{Access, Addr, ConfigError, lock};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{AddressFamily, RecvFlags, SocketFlags, SocketType};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;

/// Where the model places a reservation. A non-zero address passed to `cuMemAddressReserve` is
/// only a hint, and the driver documents no placement (fact 12): the model ignores hints, and
/// the backend must work wherever a reservation lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The lowest gap above the model's base: addresses rise, and a freed gap is filled first.
    LowestFirst,
    /// The highest gap below the top of the model's window: addresses fall.
    TopDown,
    /// Pseudo-random aligned places in the model's window, drawn from `seed` (the highest gap
    /// when a few draws all collide).
    Scattered {
        /// The same seed gives the same places for the same calls.
        seed: u64,
    },
}

/// A stream capture's mode (`CUstreamCaptureMode`, fact 40), for
/// [`DriverModel::begin_capture`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL` (the default): while it is open, a potentially unsafe
    /// call from any thread is refused.
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: only the capturing thread's own unsafe calls are
    /// refused.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: no call is refused for it.
    Relaxed,
}

/// Settings of a [`DriverModel`].
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Recommended allocation granularity of pinned memory that is not exportable: a power of
    /// two. Default: 2 MiB.
    pub granularity: usize,
    /// Recommended granularity of exportable memory (`requestedHandleTypes` not 0): a power
    /// of two, or `None` for the same as [`granularity`](Self::granularity) (the default).
    /// Granularity depends on the allocation properties (fact 15): the model answers
    /// `cuMemGetAllocationGranularity` by them, and refuses a `cuMemCreate` or `cuMemMap`
    /// that does not fit the granularity of the memory's own properties.
    pub exportable_granularity: Option<usize>,
    /// The device attribute `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`
    /// (110) of every device: whether memory may be created GPUDirect-RDMA-capable
    /// (`allocFlags.gpuDirectRDMACapable`, which "needs attribute 110": fact 14). Default:
    /// true, as on the data-centre GPUs memtoken serves.
    pub rdma_with_vmm: bool,
    /// Device memory: not zero. Default: 16 GiB (modelled: bytes are kept only where written).
    pub total_mem: usize,
    /// Whether recorded events complete at once. Default: true.
    pub events_complete_at_once: bool,
    /// Whether `cuEventSynchronize` and `cuCtxSynchronize` block the calling thread until
    /// another thread completes the work (`complete_work`, `complete_work_on`), as a real wait
    /// does. Default: false — the wait returns with the work complete, as if the GPU finished
    /// it meanwhile (so a test that never completes its work does not hang).
    pub synchronize_blocks: bool,
    /// Where reservations land (fact 12). Default: [`Placement::Scattered`], so that nothing
    /// comes to depend on where the driver places a reservation.
    pub placement: Placement,
    /// Devices: ordinals `0..devices`, not zero. Default: 2, peers of each other (as two GPUs
    /// of one NVLink pair).
    /// Only device 0 has a (primary) context in the model; the others can own memory
    /// (`cuMemCreate`) and be granted access (`cuMemSetAccess`), which
    /// [`DriverModel::access_of`] reads back per device.
    pub devices: i32,
    /// The pairs `(dev, peer)` for which `cuDeviceCanAccessPeer(dev, peer)` says 1: `dev` can
    /// access memory on `peer` (fact 32). Default: `(0, 1)` and `(1, 0)`.
    pub peer_access: Vec<(i32, i32)>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            granularity: 2 << 20,
            exportable_granularity: None,
            rdma_with_vmm: true,
            total_mem: 16 << 30,
            events_complete_at_once: true,
            synchronize_blocks: false,
            placement: Placement::Scattered { seed: 0x5eed },
            devices: 2,
            peer_access: vec![(0, 1), (1, 0)],
        }
    }
}

/// What the driver model holds right now (see [`DriverModel::outstanding`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelOutstanding {
    /// Live reservations.
    pub reservations: usize,
    /// Bytes of physical memory not yet given back (released handles still mapped included).
    pub physical_bytes: usize,
    /// Live mappings.
    pub mappings: usize,
    /// Live events.
    pub events: usize,
    /// Retains of the primary context not yet released.
    pub retains: u32,
}

impl ModelOutstanding {
    /// True when the model holds nothing at all.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// The codes after which, by facts 33–34, "any further CUDA work will return the same error"
/// (the documentation: the process must be terminated and relaunched; 710: the context cannot
/// be used anymore). Exactly these are sticky in the model; it keeps its own list, so that it
/// checks [`CuError::fate`] rather than agreeing with it by construction.
const STICKY: [i32; 13] = [
    700, 702, 714, 715, 716, 717, 718, 719, 911, 226, 721, // fact 33
    710, 810, // fact 34
];

/// How the context (or the process) is lost.
#[derive(Clone, Copy, Debug)]
struct Lost {
    /// What every affected call returns.
    error: CuError,
    /// Every call fails (a sticky error, or the driver deinitialized), not only those into the
    /// context (a destroyed context: `CUDA_ERROR_CONTEXT_IS_DESTROYED`).
    process_wide: bool,
}

/// One stream's work: how much was submitted and completed, the work not yet completed, and
/// the first of it that an unmap pulled memory from under.
#[derive(Debug, Default)]
struct StreamWork {
    submitted: u64,
    completed: u64,
    /// Each unfinished piece, in order.
    pending: VecDeque<Work>,
    /// The first unfinished piece that faults when it completes (fact 21).
    doomed: Option<u64>,
}

/// A piece of work submitted on a stream.
#[derive(Debug)]
struct Work {
    /// Its sequence number on its stream.
    seq: u64,
    /// The global epoch at submission: it may touch mappings given access before it.
    epoch: u64,
    /// The ranges it uses, if it named them (`submit_work_touching`); otherwise it may touch
    /// any memory mapped with access.
    touches: Option<Vec<(Addr, usize)>>,
}

/// An open stream capture.
#[derive(Debug)]
struct Capture {
    mode: CaptureMode,
    thread: ThreadId,
    invalidated: bool,
}

/// An open shareable handle.
#[derive(Debug)]
struct Shared {
    /// The allocation it names, and its handle type.
    allocation: u64,
    kind: u32,
    /// A POSIX descriptor: a real one, one end of a Unix socket pair, handed to the exporter;
    /// the model keeps the other end (`watch`) and knows the handed-out end by its inode
    /// (`ino`, with its device). The handle is closed once every copy of the handed-out end is
    /// (the exporter's, one passed to another process or in flight to it): then `watch` reads
    /// end of file. `None` for an opaque value ([`DriverModel::close_shareable`] closes it).
    fd: Option<Watched>,
}

#[derive(Debug)]
struct Watched {
    watch: OwnedFd,
    ino: (u64, u64),
}

impl Watched {
    /// Whether every copy of the handed-out end is closed.
    fn closed(&self) -> bool {
        let mut byte = [0u8; 1];
        // The handed-out end never writes: a read sees end of file once it is closed, else
        // would block.
        let flags = RecvFlags::DONTWAIT | RecvFlags::PEEK;
        matches!(rustix::net::recv(&self.watch, &mut byte, flags), Ok((0, _)))
    }
}

/// The inode (and its device) of the open descriptor numbered `fd` in this process, read
/// through `/proc/self/fd` so that no descriptor the model does not own is ever borrowed.
fn inode_of(fd: u64) -> Option<(u64, u64)> {
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    let st = rustix::fs::stat(format!("/proc/self/fd/{fd}")).ok()?;
    Some(identity(&st))
}

/// A file's device and inode, which name it whatever descriptor refers to it.
#[allow(clippy::unnecessary_cast)] // their widths differ between targets
fn identity(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

#[derive(Debug)]
struct ModelState {
    initialized: bool,
    retains: u32,
    current: bool,
    lost: Option<Lost>,
    calls_after_loss: u64,
    /// Reservations, allocations and mappings, allocations keyed by the model's own allocation
    /// number: a handle value names an allocation only until its release.
    book: Book<u64>,
    /// Live reservations (start → length), for placing new ones.
    placed: BTreeMap<Addr, usize>,
    /// The state of the [`Placement::Scattered`] draw.
    draw: u64,
    /// Mappings (by start) made but not yet given access: unusable until `cuMemSetAccess`.
    no_access: BTreeSet<Addr>,
    /// Mappings (by start) given access: their length, and the work epoch when they first
    /// got it (work submitted after that may touch them).
    access_epoch: BTreeMap<Addr, (usize, u64)>,
    /// The device that owns each allocation (by allocation number).
    owners: HashMap<u64, i32>,
    /// Access granted to each mapping (by start), per device: read-write or not. Gone with
    /// the mapping's unmap.
    grants: BTreeMap<Addr, BTreeMap<i32, bool>>,
    /// Every device ever granted access to a mapping in each reservation (by start), until
    /// the reservation is freed: a new mapping there must be given access for all of them in
    /// its first `cuMemSetAccess` (no peer loses access across a remap).
    granted_in: HashMap<Addr, BTreeSet<i32>>,
    /// Answers of `cuDeviceCanAccessPeer` given so far, by `(dev, peer)`.
    peers_asked: HashMap<(i32, i32), bool>,
    /// Live (not released) handle values → allocation number.
    handles: HashMap<u64, u64>,
    /// Released handle values, handed out again before new ones (the last released first).
    free_handles: Vec<u64>,
    next_handle: u64,
    next_allocation: u64,
    /// Handle types each allocation may be exported as (by allocation number; 0: none).
    handle_types: HashMap<u64, u32>,
    /// The granularity of each allocation's properties (by allocation number; an import has
    /// its exported allocation's): its mappings start at a multiple of it (facts 15, 16).
    granules: HashMap<u64, usize>,
    /// The properties of every `cuMemCreate` and `cuMemGetAllocationGranularity` served, in
    /// order.
    props_log: Vec<(DriverCall, AllocationProps)>,
    /// Open shareable handles (exported, not closed), by a number of the model's.
    shareables: HashMap<u64, Shared>,
    next_shareable: u64,
    /// Imported allocations (by allocation number) → the exported allocation they name.
    aliases: HashMap<u64, u64>,
    /// How many open shareable handles and live imports hold each exported allocation: it
    /// lives while any does (fact 27).
    holders: HashMap<u64, usize>,
    /// Exported allocations released and unmapped here, kept for their holders: their length.
    held_over: HashMap<u64, usize>,
    used: usize,
    /// Bytes written, by allocation number.
    contents: HashMap<u64, Vec<u8>>,
    /// Live events, and where each was last recorded: its stream and the work it covers.
    events: HashMap<Event, Option<(Stream, u64)>>,
    /// Destroyed event values, handed out again before new ones (the last destroyed first).
    free_events: Vec<Event>,
    next_event: Event,
    /// Work per stream. Stream 0 is the legacy default stream; the others are non-blocking (as
    /// cudarc's `new_stream()` makes them), so an event on one stream covers nothing on another.
    streams: HashMap<Stream, StreamWork>,
    next_stream: Stream,
    /// Work submitted so far on all streams: each piece's epoch.
    epoch: u64,
    /// Open stream captures, by stream.
    captures: HashMap<Stream, Capture>,
    log: Vec<DriverCall>,
    /// Calls counted (not those after the loss) and planned failures.
    faults: FaultPlan<DriverCall, CuError>,
}

impl ModelState {
    /// Closes the shareable handles whose descriptors are all closed: each gives its hold on
    /// the exported memory back (fact 27).
    fn reap_shareables(&mut self) {
        let closed: Vec<u64> = self
            .shareables
            .iter()
            .filter(|(_, sh)| sh.fd.as_ref().is_some_and(Watched::closed))
            .map(|(&k, _)| k)
            .collect();
        for k in closed {
            if let Some(sh) = self.shareables.remove(&k) {
                self.unhold(sh.allocation);
            }
        }
    }

    /// `allocation` (`len` bytes) has no handle and no mapping left: an import gives its hold
    /// on the exported memory back; exported memory still held stays (fact 27); else it goes.
    fn gone(&mut self, allocation: u64, len: usize) {
        self.owners.remove(&allocation);
        self.handle_types.remove(&allocation);
        self.granules.remove(&allocation);
        if let Some(source) = self.aliases.remove(&allocation) {
            self.unhold(source);
        } else if self.holders.get(&allocation).is_some_and(|&n| n > 0) {
            self.held_over.insert(allocation, len);
        } else {
            self.used -= len;
            self.contents.remove(&allocation);
        }
    }

    /// One holder of exported `allocation` went; the last one frees it if it was released.
    fn unhold(&mut self, allocation: u64) {
        let n = self.holders.entry(allocation).or_insert(1);
        *n -= 1;
        if *n == 0 {
            self.holders.remove(&allocation);
            if let Some(len) = self.held_over.remove(&allocation) {
                self.used -= len;
                self.contents.remove(&allocation);
            }
        }
    }

    /// The allocation whose bytes `allocation` names (an import names the exported one's).
    fn backing(&self, allocation: u64) -> u64 {
        self.aliases.get(&allocation).copied().unwrap_or(allocation)
    }

    fn lose(&mut self, error: CuError, process_wide: bool) {
        if self.lost.is_none() {
            self.lost = Some(Lost {
                error,
                process_wide,
            });
        }
    }

    /// The error every call now returns, if a fault surfaced.
    fn check_lost(&self) -> CuResult<()> {
        self.lost.map_or(Ok(()), |l| Err(l.error))
    }

    /// Submits one piece of work on `stream`, touching `touches` (`None`: anything mapped).
    fn submit(&mut self, stream: Stream, touches: Option<Vec<(Addr, usize)>>) {
        self.epoch += 1;
        let epoch = self.epoch;
        let work = self.streams.get_mut(&stream).expect("a known stream");
        work.submitted += 1;
        work.pending.push_back(Work {
            seq: work.submitted,
            epoch,
            touches,
        });
    }

    /// Completes the work on `stream` up to sequence number `upto`. Work an unmap pulled memory
    /// from under faults as it completes: the context takes the sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (fact 21).
    fn complete(&mut self, stream: Stream, upto: u64) {
        let Some(work) = self.streams.get_mut(&stream) else {
            return;
        };
        let upto = upto.min(work.submitted);
        if upto <= work.completed {
            return;
        }
        work.completed = upto;
        while work.pending.front().is_some_and(|w| w.seq <= upto) {
            work.pending.pop_front();
        }
        if work.doomed.is_some_and(|seq| seq <= upto) {
            work.doomed = None;
            self.lose(CuError::ILLEGAL_ADDRESS, true);
        }
    }

    fn complete_all(&mut self) {
        let all: Vec<(Stream, u64)> = self
            .streams
            .iter()
            .map(|(&k, w)| (k, w.submitted))
            .collect();
        for (stream, upto) in all {
            self.complete(stream, upto);
        }
    }

    /// Fact 21: `cuMemUnmap` does not wait for work in flight. Work submitted on any stream
    /// may touch any memory mapped with access when it was submitted (or, if it named its
    /// ranges, those); each unfinished piece that may touch a mapping in `[addr, end)` faults
    /// when it completes.
    fn unmap_under_work(&mut self, addr: Addr, end: Addr) {
        let granted: Vec<Addr> = self
            .access_epoch
            .range(addr..end)
            .map(|(&a, _)| a)
            .collect();
        for start in granted {
            let (len, since) = self.access_epoch.remove(&start).expect("listed");
            let touched = |w: &Work| {
                w.epoch > since
                    && w.touches.as_ref().is_none_or(|ranges| {
                        ranges
                            .iter()
                            .any(|&(a, n)| a < start + len && start < a + n)
                    })
            };
            for work in self.streams.values_mut() {
                if let Some(seq) = work.pending.iter().find(|w| touched(w)).map(|w| w.seq) {
                    work.doomed = Some(work.doomed.map_or(seq, |d| d.min(seq)));
                }
            }
        }
    }

    /// Facts 40–43: whether a potentially unsafe call (the VMM calls) from this thread is
    /// refused by an open capture — any thread's GLOBAL capture, or this thread's own
    /// non-relaxed one — and if so, invalidates those captures (fact 42: a call refused under
    /// GLOBAL mode invalidates another thread's capture too).
    fn refused_by_capture(&mut self) -> CuResult<()> {
        let me = std::thread::current().id();
        let mut refused = false;
        for c in self.captures.values_mut() {
            let bars = match c.mode {
                CaptureMode::Global => true,
                CaptureMode::ThreadLocal => c.thread == me,
                CaptureMode::Relaxed => false,
            };
            if bars {
                c.invalidated = true;
                refused = true;
            }
        }
        if refused {
            Err(CuError::STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// A place for a reservation of `len` bytes aligned to `align`, by `placement`; `None`
    /// when the model's window has no room.
    fn place(&mut self, placement: Placement, len: usize, align: usize) -> Option<Addr> {
        if len > VA_TOP - VA_BASE {
            return None;
        }
        let fits = |placed: &BTreeMap<Addr, usize>, at: Addr| {
            let before = placed.range(..at + len).next_back();
            before.is_none_or(|(&start, &n)| start + n <= at)
        };
        let top_down = |placed: &BTreeMap<Addr, usize>| {
            let mut candidate = (VA_TOP - len) & !(align - 1);
            for (&start, &n) in placed.range(..VA_TOP).rev() {
                if start >= candidate + len {
                    continue;
                }
                if start + n <= candidate {
                    break;
                }
                candidate = start.checked_sub(len)? & !(align - 1);
            }
            (candidate >= VA_BASE).then_some(candidate)
        };
        match placement {
            Placement::LowestFirst => {
                let mut candidate = VA_BASE;
                for (&start, &n) in self.placed.range(VA_BASE..) {
                    if start >= candidate + len {
                        break;
                    }
                    candidate = (start + n).next_multiple_of(align);
                }
                (candidate + len <= VA_TOP).then_some(candidate)
            }
            Placement::TopDown => top_down(&self.placed),
            Placement::Scattered { seed } => {
                let slots = ((VA_TOP - VA_BASE - len) / align) as u64;
                for _ in 0..16 {
                    // SplitMix64.
                    self.draw = self.draw.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = (self.draw ^ seed).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    z ^= z >> 31;
                    let at = VA_BASE + (z % (slots + 1)) as Addr * align;
                    if fits(&self.placed, at) {
                        return Some(at);
                    }
                }
                top_down(&self.placed)
            }
        }
    }
}

/// A strict model of the CUDA driver's VMM rules, events and context.
///
/// It **panics** on a call the real driver would reject as misuse — a VMM call without a
/// current context, a reservation or mapping not aligned to the granularity, a free of
/// anything but exactly a reservation or with mappings under it, a map over a mapping, an
/// unmap of something not exactly mapped, an access change or copy on unmapped memory, a copy
/// through memory without access, an unknown handle or event, access for a peer device never
/// asked about — because the CUDA backend must never make one. Releasing a handle while mapped
/// is allowed, as in CUDA: the memory goes with its last unmap.
///
/// Where the documentation is silent it takes the strictest reading of the CUDA facts sheet:
///
/// - **Unmap under running work faults** (fact 21): `cuMemUnmap` does not wait. Work submitted
///   on any stream ([`submit_work_on`](Self::submit_work_on), or a copy) may touch any memory
///   mapped with access when it was submitted; if such a mapping is unmapped before the work
///   completes, the context takes the sticky `CUDA_ERROR_ILLEGAL_ADDRESS` (700) when that work
///   completes (or is synchronized). A mapping made after the work was submitted may be
///   unmapped freely.
/// - **Address hints are ignored** (fact 12): `cuMemAddressReserve` places a reservation by
///   [`ModelConfig::placement`], never at the hint.
/// - **Values come back** (fact 25): a released handle's value comes back from the next
///   `cuMemCreate`, and a destroyed event's from the next `cuEventCreate`, the last given back
///   first. A handle's value may come back while its old memory is still mapped: nothing in
///   the documentation keeps it reserved until the last unmap, so it is free as soon as
///   `cuMemRelease` returned.
/// - **Exactly the sticky codes stick** (facts 33–35): after an injected 700, 702, 714–719,
///   911, 226, 721, 710 or 810 every call returns that same code; after 4
///   (`DEINITIALIZED`) every call returns 4; after 709 (`CONTEXT_IS_DESTROYED`, not sticky
///   in the sheet's sense: the process could make a new context) the context is destroyed, and
///   every call into it returns 709, while calls that need no context (`cuInit`,
///   `cuDeviceGet`, `cuDeviceTotalMem`, `cuDeviceCanAccessPeer`) still succeed; every other
///   code fails only its call.
/// - **Captures refuse VMM calls** (facts 40–43): while a GLOBAL capture is open on any thread
///   (or a THREAD_LOCAL one on the calling thread), `cuMemAddressReserve`,
///   `cuMemAddressFree`, `cuMemCreate`, `cuMemRelease`, `cuMemMap`, `cuMemSetAccess`,
///   `cuMemUnmap` and `cuCtxSynchronize` return `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900)
///   with nothing changed, and invalidate that capture ([`end_capture`](Self::end_capture)
///   then says so). RELAXED captures refuse nothing.
/// - **GPUDirect RDMA only where attribute 110 says so** (fact 14): `cuMemCreate` or
///   `cuMemGetAllocationGranularity` with `gpuDirectRDMACapable` on a device whose
///   `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` ([`ModelConfig::rdma_with_vmm`],
///   read by `cuDeviceGetAttribute`) is 0 panics: the backend asks it only where the attribute
///   is 1. [`props_log`](Self::props_log) lists the properties of every such call.
/// - **Granularity depends on the properties** (fact 15): `cuMemGetAllocationGranularity`
///   answers [`ModelConfig::exportable_granularity`] for exportable properties and
///   [`ModelConfig::granularity`] for the others; a `cuMemCreate` whose size, or a `cuMemMap`
///   whose address, is not a multiple of the granularity of the memory's own properties panics
///   (facts 14, 16).
/// - **Peer access only after asking** (fact 32): `cuMemSetAccess` for a device other than
///   the one owning the memory panics unless `cuDeviceCanAccessPeer(device, owner)` was
///   called, and returns `CUDA_ERROR_INVALID_DEVICE` (101) if that said 0. A descriptor list
///   that is empty, or names a device twice or a device the model does not have, panics.
/// - **No peer loses access across a remap** (facts 18, 31): the model remembers every device
///   given access to any mapping of a reservation, until the reservation is freed. A new
///   mapping there (a region's regrown granule, a copy-on-write boundary, memory woken at the
///   same address) whose first `cuMemSetAccess` leaves one of them out panics: the real driver
///   would accept it, and the peer's next access would fault or hang (NCCL deadlocked for
///   56 minutes on such a remap, openxla/xla#40852). [`access_of`](Self::access_of) reads the
///   access each device has.
///
/// It fails on purpose where asked ([`fail_nth`](Self::fail_nth) with any `CUresult`), loses
/// the context where asked ([`lose_context`](Self::lose_context): from then on every call into
/// the context returns `CUDA_ERROR_CONTEXT_IS_DESTROYED` and is counted in
/// [`calls_after_loss`](Self::calls_after_loss)), and runs streams whose recorded events
/// complete when told ([`complete_work`](Self::complete_work)). Clones share one model.
#[derive(Clone, Debug)]
pub struct DriverModel {
    config: Arc<ModelConfig>,
    state: Arc<Mutex<ModelState>>,
    /// Signalled when work completes or the context is lost: `cuEventSynchronize` waits on it.
    done: Arc<Condvar>,
}

/// The model's VA window: `[VA_BASE, VA_TOP)`, 16 TiB to 128 TiB.
const VA_BASE: Addr = 0x1000_0000_0000;
const VA_TOP: Addr = 0x8000_0000_0000;

fn misuse(call: DriverCall, what: impl std::fmt::Display) -> ! {
    panic!("DriverModel: illegal {call:?}: {what}")
}

impl DriverModel {
    /// A model with `config`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the setting if a granularity (plain or exportable) is not a
    /// power of two, or the device memory or the number of devices is zero.
    pub fn new(config: ModelConfig) -> Result<Self, ConfigError> {
        ConfigError::check_granularity(config.granularity)?;
        if let Some(exportable) = config.exportable_granularity {
            ConfigError::check_granularity(exportable)?;
        }
        ConfigError::check_positive("device memory", config.total_mem as u64)?;
        ConfigError::check_positive("devices", config.devices.max(0) as u64)?;
        let state = ModelState {
            initialized: false,
            retains: 0,
            current: false,
            lost: None,
            calls_after_loss: 0,
            book: Book::new(config.granularity, true),
            placed: BTreeMap::new(),
            draw: 0,
            no_access: BTreeSet::new(),
            access_epoch: BTreeMap::new(),
            owners: HashMap::new(),
            grants: BTreeMap::new(),
            granted_in: HashMap::new(),
            peers_asked: HashMap::new(),
            handles: HashMap::new(),
            handle_types: HashMap::new(),
            granules: HashMap::new(),
            props_log: Vec::new(),
            shareables: HashMap::new(),
            next_shareable: 1 << 20,
            aliases: HashMap::new(),
            holders: HashMap::new(),
            held_over: HashMap::new(),
            free_handles: Vec::new(),
            next_handle: 1,
            next_allocation: 1,
            used: 0,
            contents: HashMap::new(),
            events: HashMap::new(),
            free_events: Vec::new(),
            next_event: 1,
            streams: HashMap::from([(0, StreamWork::default())]),
            next_stream: 0x5000,
            epoch: 0,
            captures: HashMap::new(),
            log: Vec::new(),
            faults: FaultPlan::default(),
        };
        Ok(Self {
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
            done: Arc::new(Condvar::new()),
        })
    }

    fn state(&self) -> MutexGuard<'_, ModelState> {
        lock(&self.state)
    }

    /// Submits a copy as work on the legacy stream (completed at once in the model's default
    /// mode, where recorded work completes at once).
    fn enqueue_legacy(s: &mut ModelState, at_once: bool) {
        s.submit(0, None);
        if at_once {
            let upto = s.streams[&0].submitted;
            s.complete(0, upto);
        }
    }

    /// Whether the work an event recorded has completed (a never-recorded event counts as
    /// done, as in CUDA).
    fn covered(s: &ModelState, recorded: Option<(Stream, u64)>) -> bool {
        recorded.is_none_or(|(stream, at)| s.streams.get(&stream).is_none_or(|w| at <= w.completed))
    }

    /// Fails the `n`th call of kind `call` from now (`n = 1`: the next one) with `error`, once.
    /// Each kind has one plan at a time: a new plan for the same kind replaces the previous one.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn fail_nth(&self, call: DriverCall, n: u64, error: CuError) {
        self.state().faults.plan(call, n, error, false);
    }

    /// Fails the `n`th call of kind `call` from now and all later ones, until [`clear`](Self::clear).
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn fail_from(&self, call: DriverCall, n: u64, error: CuError) {
        self.state().faults.plan(call, n, error, true);
    }

    /// Removes every planned failure.
    pub fn clear(&self) {
        self.state().faults.clear();
    }

    /// The context is destroyed: from now on every call into it returns
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
    pub fn lose_context(&self) {
        self.state().lose(CuError::CONTEXT_IS_DESTROYED, false);
        self.done.notify_all();
    }

    /// Calls made after the context was lost (each one into the context fails).
    pub fn calls_after_loss(&self) -> u64 {
        self.state().calls_after_loss
    }

    /// The error that lost the context (or the process), if any: what calls into it return.
    pub fn lost_with(&self) -> Option<CuError> {
        self.state().lost.map(|l| l.error)
    }

    /// Submits work on the legacy default stream: events recorded on it from now on complete
    /// only after it.
    pub fn submit_work(&self) {
        self.submit_work_on(0);
    }

    /// Completes all work submitted on every stream. Work whose memory was unmapped under it
    /// faults (fact 21: see [`DriverModel`]).
    pub fn complete_work(&self) {
        self.state().complete_all();
        self.done.notify_all();
    }

    /// A new non-blocking stream (as cudarc's `new_stream()` makes): it is not ordered with the
    /// legacy stream nor with any other.
    pub fn new_stream(&self) -> Stream {
        let mut s = self.state();
        let stream = s.next_stream;
        s.next_stream += 1;
        s.streams.insert(stream, StreamWork::default());
        stream
    }

    /// Submits work on `stream` (a kernel still running there). It may touch any memory mapped
    /// with access now (fact 21).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn submit_work_on(&self, stream: Stream) {
        let mut s = self.state();
        if !s.streams.contains_key(&stream) {
            panic!("DriverModel: no stream {stream:#x}");
        }
        s.submit(stream, None);
    }

    /// Submits work on `stream` that uses only the ranges `touches` (a kernel given those
    /// pointers): an unmap elsewhere does not fault it (fact 21).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn submit_work_touching(&self, stream: Stream, touches: &[(u64, usize)]) {
        let mut s = self.state();
        if !s.streams.contains_key(&stream) {
            panic!("DriverModel: no stream {stream:#x}");
        }
        let touches = touches.iter().map(|&(a, n)| (a as Addr, n)).collect();
        s.submit(stream, Some(touches));
    }

    /// Completes the work submitted on `stream` so far. Work whose memory was unmapped under it
    /// faults (fact 21: see [`DriverModel`]).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn complete_work_on(&self, stream: Stream) {
        let mut s = self.state();
        let Some(work) = s.streams.get(&stream) else {
            panic!("DriverModel: no stream {stream:#x}");
        };
        let upto = work.submitted;
        s.complete(stream, upto);
        self.done.notify_all();
    }

    /// Begins a stream capture on `stream` in `mode` on the calling thread
    /// (`cuStreamBeginCapture`; facts 40–43).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's, is the legacy stream (capture cannot start
    /// there, fact 41), or is capturing already.
    pub fn begin_capture(&self, stream: Stream, mode: CaptureMode) {
        let mut s = self.state();
        if stream == 0 || !s.streams.contains_key(&stream) {
            panic!("DriverModel: cannot capture on stream {stream:#x}");
        }
        let capture = Capture {
            mode,
            thread: std::thread::current().id(),
            invalidated: false,
        };
        if s.captures.insert(stream, capture).is_some() {
            panic!("DriverModel: stream {stream:#x} is capturing already");
        }
    }

    /// Ends the capture on `stream` (`cuStreamEndCapture`).
    ///
    /// # Errors
    ///
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` if a refused call invalidated it (the real call
    /// then returns a NULL graph).
    ///
    /// # Panics
    ///
    /// If `stream` is not capturing.
    pub fn end_capture(&self, stream: Stream) -> CuResult<()> {
        let Some(capture) = self.state().captures.remove(&stream) else {
            panic!("DriverModel: stream {stream:#x} is not capturing");
        };
        if capture.invalidated {
            Err(CuError::STREAM_CAPTURE_INVALIDATED)
        } else {
            Ok(())
        }
    }

    /// The access `device` has to the memory mapped at `addr`, as granted by
    /// `cuMemSetAccess`: `None` where nothing is mapped or `device` was given no access there.
    pub fn access_of(&self, addr: u64, device: i32) -> Option<Access> {
        let s = self.state();
        let start = s.book.mapping_start(addr as Addr)?;
        let read_write = *s.grants.get(&start)?.get(&device)?;
        Some(if read_write {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        })
    }

    /// Every call received, in order.
    pub fn log(&self) -> Vec<DriverCall> {
        self.state().log.clone()
    }

    /// The properties of every `cuMemCreate` ([`DriverCall::MemCreate`]) and
    /// `cuMemGetAllocationGranularity` ([`DriverCall::MemGetAllocationGranularity`]) received
    /// (not failed on purpose, nor after the context was lost), in order.
    pub fn props_log(&self) -> Vec<(DriverCall, AllocationProps)> {
        self.state().props_log.clone()
    }

    /// The mapped range that holds `addr`, as `cuMemGetAddressRange` resolves it on VMM memory:
    /// one mapping, of one physical allocation (fact 24: "only one mapped segment"), even where
    /// the mappings beside it continue the same token's range. `None` where nothing is mapped.
    /// (Not a driver call: the backend makes none; it shows what a transfer engine sees.)
    pub fn address_range(&self, addr: u64) -> Option<(u64, usize)> {
        let s = self.state();
        let start = s.book.mapping_start(addr as Addr)?;
        let (_, into, run, _) = s.book.resolve(addr as Addr)?;
        Some((start as u64, into + run))
    }

    /// Calls of kind `call` received so far (not counting those after the context was lost).
    pub fn count(&self, call: DriverCall) -> u64 {
        self.state().faults.calls(call)
    }

    /// The granularity of memory with `props` (fact 15: it depends on the properties), for
    /// `call`. Misuse: an unknown device, or GPUDirect RDMA asked of a device whose attribute
    /// 110 is 0 (fact 14). `CUDA_ERROR_INVALID_VALUE`: a handle type the model does not know
    /// (fact 14 lists the flags).
    fn granularity_for(&self, call: DriverCall, props: AllocationProps) -> CuResult<usize> {
        self.check_device(call, props.device);
        if props.gpu_direct_rdma && !self.config.rdma_with_vmm {
            misuse(
                call,
                format_args!(
                    "gpuDirectRDMACapable asked on device {}, whose attribute 110 \
                     (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) is 0",
                    props.device
                ),
            );
        }
        if props.handle_types & !(HANDLE_TYPE_POSIX_FD | HANDLE_TYPE_FABRIC) != 0 {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(match self.config.exportable_granularity {
            Some(g) if props.handle_types != 0 => g,
            _ => self.config.granularity,
        })
    }

    /// `cuMemCreate` with `props`. Fact 14: RDMA-capable only where attribute 110 is 1, a
    /// size that is a multiple of the granularity of `props` (fact 15), else misuse.
    fn create(&self, size: usize, props: AllocationProps) -> CuResult<u64> {
        let call = DriverCall::MemCreate;
        let mut s = self.enter(call, true)?;
        s.props_log.push((call, props));
        Self::check(call, s.book.check_create(size));
        let granule = self.granularity_for(call, props)?;
        if !size.is_multiple_of(granule) {
            misuse(
                call,
                format_args!(
                    "size {size:#x} is not a multiple of the granularity {granule:#x} of its \
                     properties {props:?}"
                ),
            );
        }
        s.refused_by_capture()?;
        // Memory whose last exported descriptor was closed meanwhile is gone by now.
        s.reap_shareables();
        // A size past the device's memory is out of memory, however large: not misuse.
        if s.used
            .checked_add(size)
            .is_none_or(|n| n > self.config.total_mem)
        {
            return Err(CuError::OUT_OF_MEMORY);
        }
        let handle = Self::new_handle(&mut s);
        let allocation = s.next_allocation;
        s.next_allocation += 1;
        s.used += size;
        s.handles.insert(handle, allocation);
        s.owners.insert(allocation, props.device);
        s.granules.insert(allocation, granule);
        if props.handle_types != 0 {
            s.handle_types.insert(allocation, props.handle_types);
        }
        s.book.apply_create(allocation, size);
        Ok(handle)
    }

    /// A handle value: a released one first (the last released), else a new one.
    fn new_handle(s: &mut ModelState) -> u64 {
        match s.free_handles.pop() {
            Some(released) => released,
            None => {
                s.next_handle += 1;
                s.next_handle - 1
            }
        }
    }

    /// Closes an exported shareable handle given as an opaque value
    /// ([`ShareableHandle::Opaque`]; no driver call): the exported memory loses one holder
    /// (fact 27). A POSIX descriptor is closed by dropping it, as in a process.
    ///
    /// # Errors
    ///
    /// `CUDA_ERROR_INVALID_VALUE` for a value that names no open opaque shareable handle.
    pub fn close_shareable(&self, shareable: u64) -> CuResult<()> {
        let mut s = self.state();
        if s.shareables
            .get(&shareable)
            .is_none_or(|sh| sh.fd.is_some())
        {
            return Err(CuError::INVALID_VALUE);
        }
        let sh = s.shareables.remove(&shareable).expect("checked above");
        s.unhold(sh.allocation);
        Ok(())
    }

    /// How many exported shareable handles are open (a descriptor is, while any copy of it is).
    pub fn open_shareables(&self) -> usize {
        let mut s = self.state();
        s.reap_shareables();
        s.shareables.len()
    }

    /// What the model holds right now: reservations, physical bytes, mappings, events and
    /// context retains.
    pub fn outstanding(&self) -> ModelOutstanding {
        let mut s = self.state();
        // Exported memory is held while a descriptor of it is open anywhere (fact 27).
        s.reap_shareables();
        ModelOutstanding {
            reservations: s.book.reservations(),
            physical_bytes: s.used,
            mappings: s.book.mappings(),
            events: s.events.len(),
            retains: s.retains,
        }
    }

    /// Logs a call, fails it if planned or if the context is lost, and checks that a context is
    /// current for calls that need one.
    fn enter(&self, call: DriverCall, needs_ctx: bool) -> CuResult<MutexGuard<'_, ModelState>> {
        let mut s = self.state();
        if let Some(lost) = s.lost {
            s.calls_after_loss += 1;
            let into_ctx = needs_ctx
                || matches!(
                    call,
                    DriverCall::PrimaryCtxRetain
                        | DriverCall::PrimaryCtxRelease
                        | DriverCall::CtxSetCurrent
                );
            if lost.process_wide || into_ctx {
                return Err(lost.error);
            }
        }
        s.log.push(call);
        if let Err(fault) = s.faults.enter(call) {
            // Facts 33–35: exactly the sticky codes stick.
            let e = fault.error;
            if STICKY.contains(&e.0) || e == CuError::DEINITIALIZED {
                s.lose(e, true);
            } else if e == CuError::CONTEXT_IS_DESTROYED {
                s.lose(e, false);
            }
            return Err(e);
        }
        if call != DriverCall::Init && !s.initialized {
            misuse(call, "cuInit was not called");
        }
        if needs_ctx && !(s.current && s.retains > 0) {
            misuse(call, "no current context");
        }
        Ok(s)
    }

    fn check<T>(call: DriverCall, r: Result<T, crate::backend::Violation>) -> T {
        r.unwrap_or_else(|v| misuse(call, v))
    }

    fn check_device(&self, call: DriverCall, device: i32) {
        if !(0..self.config.devices).contains(&device) {
            misuse(call, format_args!("unknown device {device}"));
        }
    }

    /// The bytes behind `[addr, addr + len)`, which must be mapped with access, as
    /// (allocation, offset, length) pieces.
    fn pieces(
        s: &ModelState,
        call: DriverCall,
        addr: u64,
        len: usize,
        write: bool,
    ) -> Vec<(u64, usize, usize)> {
        let mut out = Vec::new();
        let (mut at, mut left) = (addr as Addr, len);
        while left > 0 {
            let Some((allocation, offset, run, access)) = s.book.resolve(at) else {
                misuse(call, format_args!("{at:#x} is not mapped"));
            };
            let start = s.book.mapping_start(at).expect("resolved");
            if s.no_access.contains(&start) {
                misuse(call, format_args!("{at:#x} is mapped without access"));
            }
            if write && access != Access::ReadWrite {
                misuse(call, format_args!("{at:#x} is mapped read-only"));
            }
            let n = run.min(left);
            out.push((allocation, offset, n));
            at += n;
            left -= n;
        }
        out
    }

    /// The mappings exactly covering `[addr, addr + size)` (checked by the caller): (start,
    /// length, allocation) each.
    fn mappings_in(s: &ModelState, addr: Addr, size: usize) -> Vec<(Addr, usize, u64)> {
        let mut out = Vec::new();
        let mut at = addr;
        while at < addr + size {
            let (allocation, _, run, _) = s.book.resolve(at).expect("checked: mapped");
            out.push((at, run, allocation));
            at += run;
        }
        out
    }

    /// The start of the reservation holding `addr` (which the caller found mapped).
    fn reservation_of(s: &ModelState, addr: Addr) -> Addr {
        let (&start, _) = s
            .placed
            .range(..=addr)
            .next_back()
            .expect("mapped: reserved");
        start
    }

    fn read(s: &ModelState, allocation: u64, offset: usize, n: usize) -> Vec<u8> {
        let allocation = s.backing(allocation);
        s.contents
            .get(&allocation)
            .map_or_else(|| vec![0; n], |b| b[offset..offset + n].to_vec())
    }

    fn write(s: &mut ModelState, allocation: u64, len: usize, offset: usize, bytes: &[u8]) {
        let allocation = s.backing(allocation);
        let buf = s.contents.entry(allocation).or_insert_with(|| vec![0; len]);
        buf[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

impl Default for DriverModel {
    fn default() -> Self {
        Self::new(ModelConfig::default()).expect("the default settings are valid")
    }
}

/// The model's only context (device 0's primary context).
const CTX: Context = 0xc0de;

// The `unsafe fn`s need no `unsafe` here: the model checks every value it is given and panics on
// one the real driver would not survive.
impl Driver for DriverModel {
    fn init(&self) -> CuResult<()> {
        self.enter(DriverCall::Init, false)?.initialized = true;
        Ok(())
    }

    fn device_get(&self, ordinal: i32) -> CuResult<i32> {
        let _s = self.enter(DriverCall::DeviceGet, false)?;
        if (0..self.config.devices).contains(&ordinal) {
            Ok(ordinal)
        } else {
            Err(CuError::INVALID_DEVICE)
        }
    }

    /// Attribute 110 is [`ModelConfig::rdma_with_vmm`] for every device (fact 14); an unknown
    /// device is `CUDA_ERROR_INVALID_DEVICE`, as for `cuDeviceGet`.
    fn device_get_attribute(&self, attribute: DeviceAttribute, device: i32) -> CuResult<i32> {
        let _s = self.enter(DriverCall::DeviceGetAttribute, false)?;
        if !(0..self.config.devices).contains(&device) {
            return Err(CuError::INVALID_DEVICE);
        }
        match attribute {
            DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported => {
                Ok(i32::from(self.config.rdma_with_vmm))
            }
        }
    }

    fn device_total_mem(&self, device: i32) -> CuResult<usize> {
        let _s = self.enter(DriverCall::DeviceTotalMem, false)?;
        self.check_device(DriverCall::DeviceTotalMem, device);
        Ok(self.config.total_mem)
    }

    /// Fact 32: says what [`ModelConfig::peer_access`] lists, and remembers that it was asked;
    /// a device and itself are not peers (0).
    fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool> {
        let call = DriverCall::DeviceCanAccessPeer;
        let mut s = self.enter(call, false)?;
        let devices = 0..self.config.devices;
        if !devices.contains(&dev) || !devices.contains(&peer) {
            return Err(CuError::INVALID_DEVICE);
        }
        let can = dev != peer && self.config.peer_access.contains(&(dev, peer));
        s.peers_asked.insert((dev, peer), can);
        Ok(can)
    }

    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context> {
        let mut s = self.enter(DriverCall::PrimaryCtxRetain, false)?;
        if device != 0 {
            misuse(
                DriverCall::PrimaryCtxRetain,
                "only device 0 has a context in the model",
            );
        }
        s.retains += 1;
        Ok(CTX)
    }

    unsafe fn primary_ctx_release(&self, _device: i32) -> CuResult<()> {
        let mut s = self.enter(DriverCall::PrimaryCtxRelease, false)?;
        if s.retains == 0 {
            misuse(
                DriverCall::PrimaryCtxRelease,
                "released more often than retained",
            );
        }
        s.retains -= 1;
        if s.retains == 0 {
            s.current = false;
        }
        Ok(())
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> CuResult<()> {
        let mut s = self.enter(DriverCall::CtxSetCurrent, false)?;
        if ctx != CTX || s.retains == 0 {
            misuse(DriverCall::CtxSetCurrent, "not a live context");
        }
        s.current = true;
        Ok(())
    }

    /// Fact 15: by the properties ([`ModelConfig::exportable_granularity`] for exportable
    /// ones); fact 14: RDMA-capable properties on a device without attribute 110 are misuse.
    fn mem_get_allocation_granularity(&self, props: AllocationProps) -> CuResult<usize> {
        let call = DriverCall::MemGetAllocationGranularity;
        let mut s = self.enter(call, true)?;
        s.props_log.push((call, props));
        self.granularity_for(call, props)
    }

    /// Fact 12: the hint is ignored; the reservation lands where
    /// [`ModelConfig::placement`] puts it. Fact 43: refused during a global capture.
    fn mem_address_reserve(&self, size: usize, alignment: usize, hint: u64) -> CuResult<u64> {
        let call = DriverCall::MemAddressReserve;
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_reserve(size));
        let g = self.config.granularity;
        if !alignment.is_multiple_of(g) {
            misuse(call, "alignment is not a multiple of the granularity");
        }
        if !(hint as Addr).is_multiple_of(g) {
            misuse(
                call,
                "the address hint is not a multiple of the granularity",
            );
        }
        s.refused_by_capture()?;
        let Some(addr) = s.place(self.config.placement, size, alignment.max(g)) else {
            return Err(CuError::OUT_OF_MEMORY);
        };
        s.book.apply_reserve(addr, size);
        s.placed.insert(addr, size);
        Ok(addr as u64)
    }

    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemAddressFree;
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_free(ptr as Addr, size));
        s.refused_by_capture()?;
        s.book.apply_free(ptr as Addr);
        s.placed.remove(&(ptr as Addr));
        s.granted_in.remove(&(ptr as Addr));
        Ok(())
    }

    fn mem_create_with(&self, size: usize, props: AllocationProps) -> CuResult<u64> {
        self.create(size, props)
    }

    unsafe fn mem_export_to_shareable_handle(
        &self,
        handle: u64,
        handle_type: u32,
    ) -> CuResult<ShareableHandle> {
        let call = DriverCall::MemExportToShareableHandle;
        let mut s = self.enter(call, true)?;
        let Some(&allocation) = s.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        // Fact 26: only a type requested at creation (the error is the model's choice).
        let requested = s.handle_types.get(&allocation).copied().unwrap_or(0);
        if handle_type.count_ones() != 1 || requested & handle_type == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let key = s.next_shareable;
        s.next_shareable += 1;
        let (fd, out) = if handle_type == HANDLE_TYPE_POSIX_FD {
            // A real descriptor, as the driver writes one (fact 27): one end of a socket pair,
            // known by its inode; the model keeps the other end to learn when it is closed.
            let flags = SocketFlags::CLOEXEC;
            let pair =
                rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, flags, None);
            let Ok((watch, handed)) = pair else {
                return Err(CuError::OUT_OF_MEMORY);
            };
            let Ok(st) = rustix::fs::fstat(handed.as_fd()) else {
                return Err(CuError::OUT_OF_MEMORY);
            };
            let ino = identity(&st);
            (Some(Watched { watch, ino }), ShareableHandle::Fd(handed))
        } else {
            (None, ShareableHandle::Opaque(key))
        };
        let kind = handle_type;
        s.shareables.insert(
            key,
            Shared {
                allocation,
                kind,
                fd,
            },
        );
        *s.holders.entry(allocation).or_insert(0) += 1;
        Ok(out)
    }

    fn mem_import_from_shareable_handle(&self, shareable: u64, handle_type: u32) -> CuResult<u64> {
        let call = DriverCall::MemImportFromShareableHandle;
        let mut s = self.enter(call, true)?;
        s.reap_shareables();
        // A value that names no open shareable handle of that type: refused, as the driver
        // refuses a descriptor it cannot use. A POSIX descriptor is known by its inode (any
        // copy of it, whatever its number), an opaque value by itself.
        let found = if handle_type == HANDLE_TYPE_POSIX_FD {
            let ino = inode_of(shareable);
            s.shareables
                .values()
                .find(|sh| ino.is_some() && sh.fd.as_ref().map(|w| w.ino) == ino)
        } else {
            s.shareables.get(&shareable).filter(|sh| sh.fd.is_none())
        };
        let Some(&Shared {
            allocation: source,
            kind,
            ..
        }) = found
        else {
            return Err(CuError::INVALID_VALUE);
        };
        if kind != handle_type {
            return Err(CuError::INVALID_VALUE);
        }
        let len = s.book.phys_len_any(source);
        let device = s.owners.get(&source).copied().unwrap_or(0);
        let granule = s.granules.get(&source).copied();
        let handle = Self::new_handle(&mut s);
        let allocation = s.next_allocation;
        s.next_allocation += 1;
        s.handles.insert(handle, allocation);
        s.owners.insert(allocation, device);
        s.aliases.insert(allocation, source);
        if let Some(granule) = granule {
            s.granules.insert(allocation, granule);
        }
        *s.holders.entry(source).or_insert(0) += 1;
        s.book.apply_create(allocation, len);
        Ok(handle)
    }

    unsafe fn mem_allocation_size(&self, handle: u64) -> Option<usize> {
        let s = self.state();
        let &allocation = s.handles.get(&handle)?;
        s.book.phys_len(allocation)
    }

    unsafe fn mem_release(&self, handle: u64) -> CuResult<()> {
        let call = DriverCall::MemRelease;
        let mut s = self.enter(call, true)?;
        let Some(&allocation) = s.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        let len = s
            .book
            .phys_len(allocation)
            .expect("a live handle's allocation");
        Self::check(call, s.book.check_release(allocation, len));
        s.refused_by_capture()?;
        s.handles.remove(&handle);
        let mapped = s.book.is_mapped(allocation);
        s.book.apply_release(allocation);
        if !mapped {
            s.gone(allocation, len);
        }
        // The value is free from now on, even while the memory stays mapped.
        s.free_handles.push(handle);
        Ok(())
    }

    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()> {
        let call = DriverCall::MemMap;
        let mut s = self.enter(call, true)?;
        let Some(&allocation) = s.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        Self::check(
            call,
            s.book.check_map(ptr as Addr, size, allocation, offset),
        );
        // Facts 15, 16: `ptr` is a multiple of the granularity of the memory's properties.
        let granule = s.granules.get(&allocation).copied().unwrap_or(1);
        if !ptr.is_multiple_of(granule as u64) {
            misuse(
                call,
                format_args!(
                    "{ptr:#x} is not a multiple of the granularity {granule:#x} of the memory's \
                     properties"
                ),
            );
        }
        s.refused_by_capture()?;
        s.book
            .apply_map(ptr as Addr, size, allocation, Access::ReadOnly);
        s.no_access.insert(ptr as Addr);
        Ok(())
    }

    /// One descriptor per device (fact 18): none, a device twice or an unknown device is
    /// misuse. Fact 32: access for a device other than the memory's owner needs a
    /// `cuDeviceCanAccessPeer(device, owner)` asked before (else misuse) that said 1 (else
    /// `CUDA_ERROR_INVALID_DEVICE`, and nothing changes). A new mapping's first access must
    /// name every device given access in its reservation before (else misuse: see
    /// [`DriverModel`]). Fact 21: a mapping's first access starts the work that may touch it.
    /// Fact 43: refused during a global capture.
    unsafe fn mem_set_access(&self, ptr: u64, size: usize, access: &[(i32, bool)]) -> CuResult<()> {
        let call = DriverCall::MemSetAccess;
        let mut s = self.enter(call, true)?;
        if access.is_empty() {
            misuse(call, "no access descriptor");
        }
        for (i, &(device, _)) in access.iter().enumerate() {
            self.check_device(call, device);
            if access[..i].iter().any(|&(d, _)| d == device) {
                misuse(
                    call,
                    format_args!("device {device} is named twice in one descriptor list"),
                );
            }
        }
        let named = |device: i32| access.iter().any(|&(d, _)| d == device);
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.check_unmap(addr, size));
        let mappings = Self::mappings_in(&s, addr, size);
        let mut refused = false;
        for &(start, _, allocation) in &mappings {
            let owner = s.owners[&allocation];
            for &(device, _) in access.iter().filter(|&&(d, _)| d != owner) {
                match s.peers_asked.get(&(device, owner)) {
                    None => misuse(
                        call,
                        format_args!(
                            "access for device {device} to memory on device {owner} without \
                             asking cuDeviceCanAccessPeer({device}, {owner}) first"
                        ),
                    ),
                    Some(false) => refused = true,
                    Some(true) => {}
                }
            }
            if s.grants.contains_key(&start) {
                continue; // not a new mapping: devices not named keep what they have
            }
            let reservation = Self::reservation_of(&s, start);
            let had = s.granted_in.get(&reservation);
            if let Some(lost) = had.and_then(|had| had.iter().find(|&&d| !named(d))) {
                misuse(
                    call,
                    format_args!(
                        "the new mapping at {start:#x} is given access without device {lost}, \
                         which had access in its reservation at {reservation:#x}: a peer lost \
                         access across a remap (openxla/xla#40852)"
                    ),
                );
            }
        }
        if refused {
            return Err(CuError::INVALID_DEVICE);
        }
        s.refused_by_capture()?;
        // The context's own device (0) is the one whose copies the model checks: its access is
        // what the record and `no_access` hold. A peer's grant changes neither.
        if let Some(&(_, read_write)) = access.iter().find(|&&(d, _)| d == 0) {
            let access = if read_write {
                Access::ReadWrite
            } else {
                Access::ReadOnly
            };
            Self::check(call, s.book.set_access(addr, size, access));
            let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
            for start in starts {
                s.no_access.remove(&start);
            }
        }
        let epoch = s.epoch;
        for (start, len, _) in mappings {
            s.access_epoch.entry(start).or_insert((len, epoch));
            s.grants
                .entry(start)
                .or_default()
                .extend(access.iter().copied());
            let reservation = Self::reservation_of(&s, start);
            let devices = access.iter().map(|&(d, _)| d);
            s.granted_in.entry(reservation).or_default().extend(devices);
        }
        Ok(())
    }

    /// Fact 21: does not wait for work in flight; work that may touch the range faults when it
    /// completes. Fact 43: refused during a global capture.
    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemUnmap;
        let mut s = self.enter(call, true)?;
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.check_unmap(addr, size));
        s.refused_by_capture()?;
        for (allocation, len) in s.book.handles_in(addr, size) {
            // Memory released while mapped goes with its last mapping.
            s.gone(allocation, len);
        }
        s.book.apply_unmap(addr, size);
        let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
        for start in starts {
            s.no_access.remove(&start);
        }
        let granted: Vec<Addr> = s.grants.range(addr..end).map(|(&a, _)| a).collect();
        for start in granted {
            s.grants.remove(&start);
        }
        s.unmap_under_work(addr, end);
        Ok(())
    }

    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemcpyDtoD;
        let mut s = self.enter(call, true)?;
        let mut bytes = Vec::with_capacity(size);
        for (h, off, n) in Self::pieces(&s, call, src, size, false) {
            bytes.extend(Self::read(&s, h, off, n));
        }
        let mut at = 0;
        for (h, off, n) in Self::pieces(&s, call, dst, size, true) {
            let len = s.book.phys_len_any(h);
            Self::write(&mut s, h, len, off, &bytes[at..at + n]);
            at += n;
        }
        // The copy may run after the call returns: work on the legacy stream until completed.
        Self::enqueue_legacy(&mut s, self.config.events_complete_at_once);
        s.check_lost()
    }

    /// Fact 41: synchronizing the context of a capturing stream is refused (and invalidates
    /// the capture).
    fn ctx_synchronize(&self) -> CuResult<()> {
        let mut s = self.enter(DriverCall::CtxSynchronize, true)?;
        if !s.captures.is_empty() {
            for c in s.captures.values_mut() {
                c.invalidated = true;
            }
            return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
        }
        let idle = |s: &ModelState| s.streams.values().all(|w| w.completed >= w.submitted);
        while self.config.synchronize_blocks && !idle(&s) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
            s.check_lost()?;
        }
        s.complete_all();
        s.check_lost()
    }

    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()> {
        let call = DriverCall::MemcpyHtoD;
        let mut s = self.enter(call, true)?;
        let mut at = 0;
        for (h, off, n) in Self::pieces(&s, call, dst, src.len(), true) {
            let len = s.book.phys_len_any(h);
            Self::write(&mut s, h, len, off, &src[at..at + n]);
            at += n;
        }
        // From pageable memory the DMA may still run after the call returns (the bytes are
        // staged): work on the legacy stream until completed.
        Self::enqueue_legacy(&mut s, self.config.events_complete_at_once);
        s.check_lost()
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()> {
        let call = DriverCall::MemcpyDtoH;
        let s = self.enter(call, true)?;
        let mut at = 0;
        for (h, off, n) in Self::pieces(&s, call, src, dst.len(), false) {
            dst[at..at + n].copy_from_slice(&Self::read(&s, h, off, n));
            at += n;
        }
        Ok(())
    }

    fn event_create(&self) -> CuResult<Event> {
        let mut s = self.enter(DriverCall::EventCreate, true)?;
        let event = match s.free_events.pop() {
            Some(destroyed) => destroyed,
            None => {
                s.next_event += 1;
                s.next_event - 1
            }
        };
        s.events.insert(event, None);
        Ok(event)
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> CuResult<()> {
        let call = DriverCall::EventRecord;
        let mut s = self.enter(call, true)?;
        let Some(submitted) = s.streams.get(&stream).map(|w| w.submitted) else {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        };
        let Some(slot) = s.events.get_mut(&event) else {
            misuse(call, "unknown event");
        };
        *slot = Some((stream, submitted));
        if self.config.events_complete_at_once {
            s.complete(stream, submitted);
            self.done.notify_all();
        }
        s.check_lost()
    }

    unsafe fn event_query(&self, event: Event) -> CuResult<bool> {
        let call = DriverCall::EventQuery;
        let s = self.enter(call, true)?;
        match s.events.get(&event) {
            None => misuse(call, "unknown event"),
            Some(recorded) => Ok(Self::covered(&s, *recorded)),
        }
    }

    unsafe fn event_synchronize(&self, event: Event) -> CuResult<()> {
        let call = DriverCall::EventSynchronize;
        let mut s = self.enter(call, true)?;
        let Some(&recorded) = s.events.get(&event) else {
            misuse(call, "unknown event");
        };
        // With `synchronize_blocks`, blocks the calling thread, as the driver does, until
        // another thread completes the work; every other call goes on meanwhile. Otherwise the
        // work completes now, as if the GPU had finished it during the wait.
        while self.config.synchronize_blocks && !Self::covered(&s, recorded) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
            s.check_lost()?;
        }
        if let Some((stream, at)) = recorded {
            s.complete(stream, at);
        }
        s.check_lost()
    }

    unsafe fn event_destroy(&self, event: Event) -> CuResult<()> {
        let call = DriverCall::EventDestroy;
        let mut s = self.enter(call, true)?;
        if s.events.remove(&event).is_none() {
            misuse(call, "unknown event");
        }
        s.free_events.push(event);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_configuration_is_an_error_not_a_panic() {
        let e = DriverModel::new(ModelConfig {
            granularity: 3 << 20,
            ..ModelConfig::default()
        })
        .unwrap_err();
        assert!(
            matches!(e, ConfigError::GranularityNotPowerOfTwo { .. }),
            "{e}"
        );
        let e = DriverModel::new(ModelConfig {
            total_mem: 0,
            ..ModelConfig::default()
        })
        .unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::Zero {
                    what: "device memory"
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("device memory is zero"), "{e}");
        let e = DriverModel::new(ModelConfig {
            exportable_granularity: Some(3 << 20),
            ..ModelConfig::default()
        })
        .unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::GranularityNotPowerOfTwo {
                    granularity: 0x30_0000
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn outstanding_names_what_the_model_holds() {
        let model = DriverModel::default();
        model.init().unwrap();
        let ctx = model.primary_ctx_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this model.
        unsafe { model.ctx_set_current(ctx) }.unwrap();
        let g = model.config.granularity;
        let ptr = model.mem_address_reserve(2 * g, g, 0).unwrap();
        let handle = model.mem_create(g, 0).unwrap();
        // SAFETY: the first granule of the fresh reservation is unmapped; `handle` is live and
        // one granule long.
        unsafe { model.mem_map(ptr, g, 0, handle) }.unwrap();
        let event = model.event_create().unwrap();
        let held = model.outstanding();
        assert_eq!(
            held,
            ModelOutstanding {
                reservations: 1,
                physical_bytes: g,
                mappings: 1,
                events: 1,
                retains: 1,
            }
        );
        // SAFETY: each value was made above by this model and is given back once, the mapping
        // before its handle's memory and reservation, the retain last.
        unsafe {
            model.event_destroy(event).unwrap();
            model.mem_release(handle).unwrap();
            assert_eq!(
                model.outstanding().physical_bytes,
                g,
                "released while mapped"
            );
            model.mem_unmap(ptr, g).unwrap();
            model.mem_address_free(ptr, 2 * g).unwrap();
            model.primary_ctx_release(0).unwrap();
        }
        assert!(model.outstanding().is_zero());
    }

    #[test]
    fn released_handles_and_destroyed_events_come_back() {
        let model = DriverModel::default();
        model.init().unwrap();
        let ctx = model.primary_ctx_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this model.
        unsafe { model.ctx_set_current(ctx) }.unwrap();
        let g = model.config.granularity;
        let ptr = model.mem_address_reserve(g, g, 0).unwrap();
        let old = model.mem_create(g, 0).unwrap();
        let event = model.event_create().unwrap();
        // SAFETY: the fresh reservation is unmapped and `old` live; each value is given back
        // once, and the reissued ones are new live values.
        unsafe {
            model.mem_map(ptr, g, 0, old).unwrap();
            model.mem_release(old).unwrap();
            let new = model.mem_create(g, 0).unwrap();
            assert_eq!(
                new, old,
                "released while mapped, the value comes back at once"
            );
            assert_eq!(model.outstanding().physical_bytes, 2 * g);
            model.mem_unmap(ptr, g).unwrap();
            assert_eq!(model.outstanding().physical_bytes, g, "the old memory went");
            model.mem_release(new).unwrap();
            model.event_destroy(event).unwrap();
            assert_eq!(model.event_create().unwrap(), event);
            model.event_destroy(event).unwrap();
            model.mem_address_free(ptr, g).unwrap();
            model.primary_ctx_release(0).unwrap();
        }
        assert!(model.outstanding().is_zero());
    }
}
