//! The driver model's state: what the driver holds (reservations, allocations, mappings,
//! events, streams, captures, shareable handles), and the rules that move it.

use super::config::{CaptureMode, ModelConfig, Placement};
use super::misuse;
use crate::backend::cuda::driver::{AllocationProps, CuError, CuResult, DriverCall, Event, Stream};
use crate::backend::doubles::faults::FaultPlan;
use crate::backend::rules::Book;
use crate::backend::{Access, Addr};
use rustix::fd::OwnedFd;
use rustix::net::RecvFlags;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::thread::ThreadId;

/// The model's VA window: `[VA_BASE, VA_TOP)`, 16 TiB to 128 TiB.
const VA_BASE: Addr = 0x1000_0000_0000;
const VA_TOP: Addr = 0x8000_0000_0000;

/// How the context (or the process) is lost.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lost {
    /// What every affected call returns.
    pub(super) error: CuError,
    /// Every call fails (a sticky error, or the driver deinitialized), not only those into the
    /// context (a destroyed context: `CUDA_ERROR_CONTEXT_IS_DESTROYED`).
    pub(super) process_wide: bool,
}

/// One stream's work: how much was submitted and completed, the work not yet completed, and
/// the first of it that an unmap pulled memory from under.
#[derive(Debug, Default)]
pub(super) struct StreamWork {
    pub(super) submitted: u64,
    pub(super) completed: u64,
    /// Each unfinished piece, in order.
    pub(super) pending: VecDeque<Work>,
    /// The first unfinished piece that faults when it completes (fact 21).
    pub(super) doomed: Option<u64>,
    /// Whether it synchronizes with the legacy stream (a blocking stream, as the per-thread
    /// stream is: fact 2); cudarc's `new_stream()` streams do not (fact 4).
    pub(super) blocking: bool,
    /// Destroyed by its owner (`cuStreamDestroy`): no call may name it any more; work
    /// submitted before still completes (STREAM: its resources go once it has).
    pub(super) destroyed: bool,
}

/// A piece of work submitted on a stream.
#[derive(Debug)]
pub(super) struct Work {
    /// Its sequence number on its stream.
    pub(super) seq: u64,
    /// The global epoch at submission: it may touch mappings given access before it.
    pub(super) epoch: u64,
    /// The ranges it uses, if it named them (`submit_work_touching`); otherwise it may touch
    /// any memory mapped with access.
    pub(super) touches: Option<Vec<(Addr, usize)>>,
    /// The work of another stream it runs after (`cuStreamWaitEvent`): that stream and the
    /// sequence number its event stood for.
    pub(super) after: Option<(Stream, u64)>,
}

/// An open stream capture.
#[derive(Debug)]
pub(super) struct Capture {
    /// Its capture id, unique over the model's life (fact 60: `cuStreamGetCaptureInfo`).
    pub(super) id: u64,
    pub(super) mode: CaptureMode,
    pub(super) thread: ThreadId,
    pub(super) invalidated: bool,
    /// Streams that joined it by waiting on one of its captured events (fact 39): they
    /// capture into it until they are joined back into its origin stream; ended while one has
    /// not, it ends with `STREAM_CAPTURE_UNJOINED` and no graph.
    pub(super) joined: Vec<Stream>,
    /// The work submitted on the stream while it captures: graph nodes, each with the ranges
    /// it uses (`None`: any memory), run only when the graph is launched (fact 39).
    pub(super) nodes: Vec<Node>,
}

/// A graph node: the ranges the captured work uses (`None`: any memory mapped with access).
pub(super) type Node = Option<Vec<(Addr, usize)>>;

/// An open shareable handle.
#[derive(Debug)]
pub(super) struct Shared {
    /// The allocation it names, and its handle type.
    pub(super) allocation: u64,
    pub(super) kind: u32,
    /// A POSIX descriptor: a real one, one end of a Unix socket pair, handed to the exporter;
    /// the model keeps the other end (`watch`) and knows the handed-out end by its inode
    /// (`ino`, with its device). The handle is closed once every copy of the handed-out end is
    /// (the exporter's, one passed to another process or in flight to it): then `watch` reads
    /// end of file. `None` for an opaque value ([`DriverModel::close_shareable`](crate::backend::doubles::DriverModel::close_shareable) closes it).
    pub(super) fd: Option<Watched>,
}

/// A handed-out POSIX descriptor the model watches, and its identity.
#[derive(Debug)]
pub(super) struct Watched {
    pub(super) watch: OwnedFd,
    pub(super) ino: (u64, u64),
}

impl Watched {
    /// Whether every copy of the handed-out end is closed.
    pub(super) fn closed(&self) -> bool {
        let mut byte = [0u8; 1];
        // The handed-out end never writes: a read sees end of file once it is closed, else
        // would block.
        let flags = RecvFlags::DONTWAIT | RecvFlags::PEEK;
        matches!(rustix::net::recv(&self.watch, &mut byte, flags), Ok((0, _)))
    }
}

/// The inode (and its device) of the open descriptor numbered `fd` in this process, read
/// through `/proc/self/fd` so that no descriptor the model does not own is ever borrowed.
pub(super) fn inode_of(fd: u64) -> Option<(u64, u64)> {
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    let st = rustix::fs::stat(format!("/proc/self/fd/{fd}")).ok()?;
    Some(identity(&st))
}

/// A file's device and inode, which name it whatever descriptor refers to it.
#[allow(clippy::unnecessary_cast)] // their widths differ between targets
pub(super) fn identity(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// Everything the model holds, behind its one lock.
#[derive(Debug)]
pub(super) struct ModelState {
    pub(super) initialized: bool,
    pub(super) retains: u32,
    pub(super) current: bool,
    pub(super) lost: Option<Lost>,
    pub(super) calls_after_loss: u64,
    /// Reservations, allocations and mappings, allocations keyed by the model's own allocation
    /// number: a handle value names an allocation only until its release.
    pub(super) book: Book<u64>,
    /// Live reservations (start → length), for placing new ones.
    pub(super) placed: BTreeMap<Addr, usize>,
    /// The state of the [`Placement::Scattered`] draw.
    pub(super) draw: u64,
    /// Mappings (by start) made but not yet given access: unusable until `cuMemSetAccess`.
    pub(super) no_access: BTreeSet<Addr>,
    /// Mappings (by start) given access: their length, and the work epoch when they first
    /// got it (work submitted after that may touch them).
    pub(super) access_epoch: BTreeMap<Addr, (usize, u64)>,
    /// The device that owns each allocation (by allocation number).
    pub(super) owners: HashMap<u64, i32>,
    /// Access granted to each mapping (by start), per device: read-write or not. Gone with
    /// the mapping's unmap.
    pub(super) grants: BTreeMap<Addr, BTreeMap<i32, bool>>,
    /// Every device ever granted access to a mapping in each reservation (by start), until
    /// the reservation is freed: a new mapping there must be given access for all of them in
    /// its first `cuMemSetAccess` (no peer loses access across a remap).
    pub(super) granted_in: HashMap<Addr, BTreeSet<i32>>,
    /// Answers of `cuDeviceCanAccessPeer` given so far, by `(dev, peer)`.
    pub(super) peers_asked: HashMap<(i32, i32), bool>,
    /// Live (not released) handle values → allocation number.
    pub(super) handles: HashMap<u64, u64>,
    /// Released handle values, handed out again before new ones (the last released first).
    pub(super) free_handles: Vec<u64>,
    pub(super) next_handle: u64,
    pub(super) next_allocation: u64,
    /// Handle types each allocation may be exported as (by allocation number; 0: none).
    pub(super) handle_types: HashMap<u64, u32>,
    /// The granularity of each allocation's properties (by allocation number; an import has
    /// its exported allocation's): its mappings start at a multiple of it (facts 15, 16).
    pub(super) granules: HashMap<u64, usize>,
    /// The properties of every `cuMemCreate` and `cuMemGetAllocationGranularity` served, in
    /// order.
    pub(super) props_log: Vec<(DriverCall, AllocationProps)>,
    /// Open shareable handles (exported, not closed), by a number of the model's.
    pub(super) shareables: HashMap<u64, Shared>,
    pub(super) next_shareable: u64,
    /// Imported allocations (by allocation number) → the exported allocation they name.
    pub(super) aliases: HashMap<u64, u64>,
    /// How many open shareable handles and live imports hold each exported allocation: it
    /// lives while any does (fact 27).
    pub(super) holders: HashMap<u64, usize>,
    /// Exported allocations released and unmapped here, kept for their holders: their length.
    pub(super) held_over: HashMap<u64, usize>,
    pub(super) used: usize,
    /// Live `cuMemAlloc` allocations (fact 59), by start: their allocation number and length.
    /// Each is a reservation mapped whole, read-write, in `book` and `placed` as well; no VMM
    /// call may touch it.
    pub(super) plain: BTreeMap<Addr, (u64, usize)>,
    /// Bytes written, by allocation number.
    pub(super) contents: HashMap<u64, Vec<u8>>,
    /// Live events, and where each was last recorded: its stream and the work it covers.
    pub(super) events: HashMap<Event, Option<(Stream, u64)>>,
    /// Events last recorded on a capturing stream: captured events, graph nodes rather than
    /// work (fact 39), with the stream they were recorded on and the id of the capture that
    /// took them.
    pub(super) captured: HashMap<Event, (Stream, u64)>,
    /// Destroyed event values, handed out again before new ones (the last destroyed first).
    pub(super) free_events: Vec<Event>,
    pub(super) next_event: Event,
    /// Work per stream. Stream 0 is the legacy default stream; the others are non-blocking (as
    /// cudarc's `new_stream()` makes them), so an event on one stream covers nothing on another.
    pub(super) streams: HashMap<Stream, StreamWork>,
    pub(super) next_stream: Stream,
    /// Work submitted so far on all streams: each piece's epoch.
    pub(super) epoch: u64,
    /// Device-to-host copies that read memory work on another stream, not finished, may
    /// still write (a stale read): counted, for [`DriverModel::stale_reads`](super::DriverModel::stale_reads).
    pub(super) stale_reads: u64,
    /// Open stream captures, by origin stream (the one they began on).
    pub(super) captures: HashMap<Stream, Capture>,
    /// Streams that joined another stream's capture (fact 39), and that capture's origin.
    pub(super) joined: HashMap<Stream, Stream>,
    /// The next capture id to hand out.
    pub(super) next_capture_id: u64,
    /// A capture to begin just before a call (a test's hook): the calls it waits for, how many
    /// more of them to let through first, the stream and the mode.
    pub(super) begin_before: Option<(Vec<DriverCall>, u64, Stream, CaptureMode)>,
    /// A capture to end just before a call, as another party would (a test's hook): the calls
    /// it waits for, how many more to let through first, and the stream.
    pub(super) end_before: Option<(Vec<DriverCall>, u64, Stream)>,
    /// The graph the hook's end made, kept for the test (the other party's).
    pub(super) hook_graph: Option<usize>,
    /// Streams whose last capture a test ended as another party (the `end_capture` control or
    /// the hook): a `cuStreamEndCapture` there, before a new capture begins, answers
    /// `CUDA_ERROR_INVALID_VALUE` (fact 60) instead of being misuse.
    pub(super) ended_elsewhere: HashSet<Stream>,
    /// Live graphs (`cuStreamEndCapture`) and executable graphs (`cuGraphInstantiate`), each
    /// with its nodes, and the next value to hand out for either.
    pub(super) graphs: HashMap<usize, Vec<Node>>,
    pub(super) execs: HashMap<usize, Vec<Node>>,
    pub(super) next_graph: usize,
    /// Threads' capture interaction modes, where set (`cuThreadExchangeStreamCaptureMode`);
    /// a thread not listed is in the default, global mode (fact 40).
    pub(super) thread_modes: HashMap<ThreadId, CaptureMode>,
    pub(super) log: Vec<DriverCall>,
    /// Calls counted (not those after the loss) and planned failures.
    pub(super) faults: FaultPlan<DriverCall, CuError>,
}

impl ModelState {
    /// Whether `stream` is one of the model's and not destroyed: a call may name it.
    pub(super) fn live_stream(&self, stream: Stream) -> bool {
        self.streams.get(&stream).is_some_and(|w| !w.destroyed)
    }

    /// The state of a new model with `config`: nothing initialized, reserved, created or
    /// recorded; the legacy stream only.
    pub(super) fn new(config: &ModelConfig) -> Self {
        Self {
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
            plain: BTreeMap::new(),
            contents: HashMap::new(),
            events: HashMap::new(),
            captured: HashMap::new(),
            free_events: Vec::new(),
            next_event: 1,
            streams: HashMap::from([(0, StreamWork::default())]),
            next_stream: 0x5000,
            epoch: 0,
            stale_reads: 0,
            captures: HashMap::new(),
            joined: HashMap::new(),
            next_capture_id: 1,
            begin_before: None,
            end_before: None,
            hook_graph: None,
            ended_elsewhere: HashSet::new(),
            graphs: HashMap::new(),
            execs: HashMap::new(),
            next_graph: 0x9000,
            thread_modes: HashMap::new(),
            log: Vec::new(),
            faults: FaultPlan::default(),
        }
    }

    /// Closes the shareable handles whose descriptors are all closed: each gives its hold on
    /// the exported memory back (fact 27).
    pub(super) fn reap_shareables(&mut self) {
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
    /// A new allocation of `size` bytes, counted as used, if the device's `total` memory has
    /// room for it after memory whose last exported descriptor was closed meanwhile is gone; a
    /// size past the device's memory is out of memory, however large: not misuse.
    pub(super) fn new_allocation(&mut self, size: usize, total: usize) -> CuResult<u64> {
        self.reap_shareables();
        if self.used.checked_add(size).is_none_or(|n| n > total) {
            return Err(CuError::OUT_OF_MEMORY);
        }
        let allocation = self.next_allocation;
        self.next_allocation += 1;
        self.used += size;
        Ok(allocation)
    }

    /// Whether `[addr, addr + len)` overlaps a live `cuMemAlloc` allocation.
    pub(super) fn overlaps_plain(&self, addr: Addr, len: usize) -> bool {
        let end = addr.saturating_add(len);
        self.plain
            .range(..end)
            .next_back()
            .is_some_and(|(&start, &(_, n))| start.saturating_add(n) > addr)
    }

    pub(super) fn gone(&mut self, allocation: u64, len: usize) {
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
    pub(super) fn unhold(&mut self, allocation: u64) {
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
    pub(super) fn backing(&self, allocation: u64) -> u64 {
        self.aliases.get(&allocation).copied().unwrap_or(allocation)
    }

    pub(super) fn lose(&mut self, error: CuError, process_wide: bool) {
        if self.lost.is_none() {
            self.lost = Some(Lost {
                error,
                process_wide,
            });
        }
    }

    /// The error every call now returns, if a fault surfaced.
    pub(super) fn check_lost(&self) -> CuResult<()> {
        self.lost.map_or(Ok(()), |l| Err(l.error))
    }

    /// Submits one piece of work on `stream`, touching `touches` (`None`: anything mapped).
    /// On a capturing stream it becomes a node of the capture's graph instead (fact 39).
    pub(super) fn submit(&mut self, stream: Stream, touches: Option<Vec<(Addr, usize)>>) {
        if let Some(capture) = self.capture_mut(stream) {
            capture.nodes.push(touches);
            return;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        let work = self.streams.get_mut(&stream).expect("a known stream");
        work.submitted += 1;
        work.pending.push_back(Work {
            seq: work.submitted,
            epoch,
            touches,
            after: None,
        });
    }

    /// `stream` waits for the work of stream `on` up to sequence number `upto`: a piece of its
    /// own that touches nothing and runs after that work, so everything submitted on `stream`
    /// later runs after it too.
    pub(super) fn submit_wait(&mut self, stream: Stream, on: Stream, upto: u64) {
        self.submit(stream, Some(Vec::new()));
        let work = self.streams.get_mut(&stream).expect("a known stream");
        if let Some(w) = work.pending.back_mut() {
            w.after = Some((on, upto));
        }
    }

    /// Launches the graph of `nodes` on `stream`: each node is work submitted there now (or,
    /// on a capturing stream, a node of that capture). A node using memory that is not mapped
    /// with access now faults when it completes: the context takes the sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (fact 21's rule, for memory gone before the launch).
    pub(super) fn launch(&mut self, stream: Stream, nodes: &[Node]) {
        for node in nodes {
            self.submit(stream, node.clone());
            if self.capture_of(stream).is_some() {
                continue;
            }
            let unusable = node
                .as_ref()
                .is_some_and(|ranges| ranges.iter().any(|&(a, n)| !self.accessible(a, n)));
            if unusable {
                let work = self.streams.get_mut(&stream).expect("a known stream");
                let seq = work.submitted;
                work.doomed = Some(work.doomed.map_or(seq, |d| d.min(seq)));
            }
        }
    }

    /// Whether unfinished work on a stream other than the legacy one may use
    /// `[addr, addr + len)`.
    pub(super) fn busy_elsewhere(&self, addr: Addr, len: usize) -> bool {
        self.streams
            .iter()
            .filter(|&(&st, _)| st != 0)
            .any(|(_, w)| {
                w.pending.iter().any(|p| {
                    p.touches.as_ref().is_none_or(|ranges| {
                        ranges.iter().any(|&(a, n)| a < addr + len && addr < a + n)
                    })
                })
            })
    }

    /// Whether every byte of `[addr, addr + len)` lies in a mapping given access.
    pub(super) fn accessible(&self, addr: Addr, len: usize) -> bool {
        let end = addr.saturating_add(len);
        let mut at = addr;
        while at < end {
            match self.access_epoch.range(..=at).next_back() {
                Some((&start, &(n, _))) if at < start + n => at = start + n,
                _ => return false,
            }
        }
        true
    }

    /// Completes the work on `stream` up to sequence number `upto`. Work an unmap pulled memory
    /// from under faults as it completes: the context takes the sticky
    /// `CUDA_ERROR_ILLEGAL_ADDRESS` (fact 21).
    pub(super) fn complete(&mut self, stream: Stream, upto: u64) {
        // What its work waits for finishes first: the GPU cannot finish it sooner.
        let waits: Vec<(Stream, u64)> = self.streams.get(&stream).map_or(Vec::new(), |w| {
            w.pending
                .iter()
                .take_while(|p| p.seq <= upto)
                .filter_map(|p| p.after)
                .collect()
        });
        for (on, at) in waits {
            if on != stream {
                self.complete(on, at);
            }
        }
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

    pub(super) fn complete_all(&mut self) {
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
    pub(super) fn unmap_under_work(&mut self, addr: Addr, end: Addr) {
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

    /// Fact 41: any use of the legacy stream while a blocking stream of the context captures is
    /// refused with `STREAM_CAPTURE_IMPLICIT` and invalidates that capture.
    pub(super) fn legacy_refused(&mut self) -> CuResult<()> {
        let mut refused = false;
        for (stream, c) in &mut self.captures {
            if self.streams.get(stream).is_some_and(|w| w.blocking) {
                c.invalidated = true;
                refused = true;
            }
        }
        if refused {
            return Err(CuError::STREAM_CAPTURE_IMPLICIT);
        }
        Ok(())
    }

    /// Fact 41: asking the legacy stream's capture state while a blocking stream captures
    /// answers `STREAM_CAPTURE_IMPLICIT`, invalidating nothing.
    pub(super) fn legacy_probe(&self, stream: Stream) -> CuResult<()> {
        let blocking = |st: &Stream| self.streams.get(st).is_some_and(|w| w.blocking);
        if stream == 0 && self.captures.keys().any(blocking) {
            return Err(CuError::STREAM_CAPTURE_IMPLICIT);
        }
        Ok(())
    }

    /// A place for a reservation of `len` bytes aligned to `align`, by `placement`; `None`
    /// when the model's window has no room.
    pub(super) fn place(&mut self, placement: Placement, len: usize, align: usize) -> Option<Addr> {
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

    /// Submits a copy as work on the legacy stream (completed at once in the model's default
    /// mode, where recorded work completes at once).
    pub(super) fn enqueue_legacy(&mut self, at_once: bool, touches: Vec<(Addr, usize)>) {
        self.submit(0, Some(touches));
        if at_once {
            let upto = self.streams[&0].submitted;
            self.complete(0, upto);
        }
    }

    /// Whether the work an event recorded has completed (a never-recorded event counts as
    /// done, as in CUDA).
    pub(super) fn covered(&self, recorded: Option<(Stream, u64)>) -> bool {
        recorded
            .is_none_or(|(stream, at)| self.streams.get(&stream).is_none_or(|w| at <= w.completed))
    }

    /// A handle value: a released one first (the last released), else a new one.
    pub(super) fn new_handle(&mut self) -> u64 {
        match self.free_handles.pop() {
            Some(released) => released,
            None => {
                self.next_handle += 1;
                self.next_handle - 1
            }
        }
    }

    /// The bytes behind `[addr, addr + len)`, which must be mapped with access, as
    /// (allocation, offset, length) pieces.
    pub(super) fn pieces(
        &self,
        call: DriverCall,
        addr: u64,
        len: usize,
        write: bool,
    ) -> Vec<(u64, usize, usize)> {
        let mut out = Vec::new();
        let (mut at, mut left) = (addr as Addr, len);
        while left > 0 {
            let Some((allocation, offset, run, access)) = self.book.resolve(at) else {
                misuse(call, format_args!("{at:#x} is not mapped"));
            };
            let start = self.book.mapping_start(at).expect("resolved");
            if self.no_access.contains(&start) {
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
    pub(super) fn mappings_in(&self, addr: Addr, size: usize) -> Vec<(Addr, usize, u64)> {
        let mut out = Vec::new();
        let mut at = addr;
        while at < addr + size {
            let (allocation, _, run, _) = self.book.resolve(at).expect("checked: mapped");
            out.push((at, run, allocation));
            at += run;
        }
        out
    }

    /// The start of the reservation holding `addr` (which the caller found mapped).
    pub(super) fn reservation_of(&self, addr: Addr) -> Addr {
        let (&start, _) = self
            .placed
            .range(..=addr)
            .next_back()
            .expect("mapped: reserved");
        start
    }

    /// `n` bytes of `allocation` from `offset` (zeros where nothing was written).
    pub(super) fn read(&self, allocation: u64, offset: usize, n: usize) -> Vec<u8> {
        let allocation = self.backing(allocation);
        self.contents
            .get(&allocation)
            .map_or_else(|| vec![0; n], |b| b[offset..offset + n].to_vec())
    }

    /// Writes `bytes` into `allocation` (`len` bytes long) at `offset`.
    pub(super) fn write(&mut self, allocation: u64, len: usize, offset: usize, bytes: &[u8]) {
        let allocation = self.backing(allocation);
        let buf = self
            .contents
            .entry(allocation)
            .or_insert_with(|| vec![0; len]);
        buf[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}
