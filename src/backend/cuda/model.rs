//! [`DriverModel`]: the CUDA driver's VMM rules in pure Rust, so the CUDA backend's whole state
//! machine runs in `cargo test` on any machine.

use super::driver::{Context, CuError, CuResult, Driver, DriverCall, Event, Stream};
use crate::backend::faults::FaultPlan;
use crate::backend::rules::Book;
use crate::backend::{Access, Addr, ConfigError, lock};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Settings of a [`DriverModel`].
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Recommended allocation granularity: a power of two. Default: 2 MiB.
    pub granularity: usize,
    /// Device memory: not zero. Default: 16 GiB (modelled: bytes are kept only where written).
    pub total_mem: usize,
    /// Whether recorded events complete at once. Default: true.
    pub events_complete_at_once: bool,
    /// Whether `cuEventSynchronize` and `cuCtxSynchronize` block the calling thread until
    /// another thread completes the work (`complete_work`, `complete_work_on`), as a real wait
    /// does. Default: false — the wait returns with the work complete, as if the GPU finished
    /// it meanwhile (so a test that never completes its work does not hang).
    pub synchronize_blocks: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            granularity: 2 << 20,
            total_mem: 16 << 30,
            events_complete_at_once: true,
            synchronize_blocks: false,
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

#[derive(Debug)]
struct ModelState {
    initialized: bool,
    retains: u32,
    current: bool,
    lost: bool,
    calls_after_loss: u64,
    /// Reservations, allocations and mappings, allocations keyed by the model's own allocation
    /// number: a handle value names an allocation only until its release.
    book: Book<u64>,
    /// Mappings (by start) made but not yet given access: unusable until `cuMemSetAccess`.
    no_access: BTreeSet<Addr>,
    /// Live (not released) handle values → allocation number.
    handles: HashMap<u64, u64>,
    /// Released handle values, handed out again before new ones (the last released first).
    free_handles: Vec<u64>,
    next_handle: u64,
    next_allocation: u64,
    used: usize,
    /// Bytes written, by allocation number.
    contents: HashMap<u64, Vec<u8>>,
    /// Live events, and where each was last recorded: its stream and the work it covers.
    events: HashMap<Event, Option<(Stream, u64)>>,
    /// Destroyed event values, handed out again before new ones (the last destroyed first).
    free_events: Vec<Event>,
    next_event: Event,
    /// Work per stream: (submitted, completed). Stream 0 is the legacy default stream; the
    /// others are non-blocking (as cudarc's `new_stream()` makes them), so an event on one
    /// stream covers nothing on another.
    streams: HashMap<Stream, (u64, u64)>,
    next_stream: Stream,
    log: Vec<DriverCall>,
    /// Calls counted (not those after the loss) and planned failures.
    faults: FaultPlan<DriverCall, CuError>,
}

/// A strict model of the CUDA driver's VMM rules, events and context.
///
/// It **panics** on a call the real driver would reject as misuse — a VMM call without a
/// current context, a reservation or mapping not aligned to the granularity, a free of
/// anything but exactly a reservation or with mappings under it, a map over a mapping, an
/// unmap of something not exactly mapped, an access change or copy on unmapped memory, a copy
/// through memory without access, an unknown handle or event — because the CUDA backend must
/// never make one. Releasing a handle while mapped is allowed, as in CUDA: the memory goes
/// with its last unmap.
///
/// It hands values out again on purpose, as the driver may (it promises no unique values): a
/// released handle's value comes back from the next `cuMemCreate`, and a destroyed event's from
/// the next `cuEventCreate`, the last given back first. A handle's value may come back while
/// its old memory is still mapped: `cuMemRelease` may run while mapped, and nothing in the
/// documentation keeps the value reserved until the last unmap, so the strictest reading is
/// that it is free as soon as `cuMemRelease` returned.
///
/// It fails on purpose where asked ([`fail_nth`](Self::fail_nth) with any `CUresult`), loses
/// the context where asked ([`lose_context`](Self::lose_context): from then on every call
/// returns `CUDA_ERROR_CONTEXT_IS_DESTROYED` and is counted in
/// [`calls_after_loss`](Self::calls_after_loss)), and runs a stream whose recorded events
/// complete when told ([`complete_work`](Self::complete_work)). Clones share one model.
#[derive(Clone, Debug)]
pub struct DriverModel {
    config: Arc<ModelConfig>,
    state: Arc<Mutex<ModelState>>,
    /// Signalled when work completes or the context is lost: `cuEventSynchronize` waits on it.
    done: Arc<Condvar>,
}

const VA_BASE: Addr = 0x7f00_0000_0000;

fn misuse(call: DriverCall, what: impl std::fmt::Display) -> ! {
    panic!("DriverModel: illegal {call:?}: {what}")
}

impl DriverModel {
    /// A model with `config`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the setting if the granularity is not a power of two or the
    /// device memory is zero.
    pub fn new(config: ModelConfig) -> Result<Self, ConfigError> {
        ConfigError::check_granularity(config.granularity)?;
        ConfigError::check_positive("device memory", config.total_mem as u64)?;
        let state = ModelState {
            initialized: false,
            retains: 0,
            current: false,
            lost: false,
            calls_after_loss: 0,
            book: Book::new(config.granularity, true),
            no_access: BTreeSet::new(),
            handles: HashMap::new(),
            free_handles: Vec::new(),
            next_handle: 1,
            next_allocation: 1,
            used: 0,
            contents: HashMap::new(),
            events: HashMap::new(),
            free_events: Vec::new(),
            next_event: 1,
            streams: HashMap::from([(0, (0, 0))]),
            next_stream: 0x5000,
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
        let work = s.streams.get_mut(&0).expect("the legacy stream exists");
        work.0 += 1;
        if at_once {
            work.1 = work.0;
        }
    }

    /// Whether the work an event recorded has completed (a never-recorded event counts as
    /// done, as in CUDA).
    fn covered(s: &ModelState, recorded: Option<(Stream, u64)>) -> bool {
        recorded.is_none_or(|(stream, at)| s.streams.get(&stream).is_none_or(|w| at <= w.1))
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

    /// The context is lost (as after an illegal address in a kernel).
    pub fn lose_context(&self) {
        self.state().lost = true;
        self.done.notify_all();
    }

    /// Calls made after the context was lost (each one fails).
    pub fn calls_after_loss(&self) -> u64 {
        self.state().calls_after_loss
    }

    /// Submits work on the legacy default stream: events recorded on it from now on complete
    /// only after it.
    pub fn submit_work(&self) {
        self.submit_work_on(0);
    }

    /// Completes all work submitted on every stream.
    pub fn complete_work(&self) {
        let mut s = self.state();
        for (submitted, completed) in s.streams.values_mut() {
            *completed = *submitted;
        }
        self.done.notify_all();
    }

    /// A new non-blocking stream (as cudarc's `new_stream()` makes): it is not ordered with the
    /// legacy stream nor with any other.
    pub fn new_stream(&self) -> Stream {
        let mut s = self.state();
        let stream = s.next_stream;
        s.next_stream += 1;
        s.streams.insert(stream, (0, 0));
        stream
    }

    /// Submits work on `stream` (a kernel still running there).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn submit_work_on(&self, stream: Stream) {
        let mut s = self.state();
        let Some(work) = s.streams.get_mut(&stream) else {
            panic!("DriverModel: no stream {stream:#x}");
        };
        work.0 += 1;
    }

    /// Completes the work submitted on `stream` so far.
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn complete_work_on(&self, stream: Stream) {
        let mut s = self.state();
        let Some(work) = s.streams.get_mut(&stream) else {
            panic!("DriverModel: no stream {stream:#x}");
        };
        work.1 = work.0;
        self.done.notify_all();
    }

    /// Every call received, in order.
    pub fn log(&self) -> Vec<DriverCall> {
        self.state().log.clone()
    }

    /// Calls of kind `call` received so far (not counting those after the context was lost).
    pub fn count(&self, call: DriverCall) -> u64 {
        self.state().faults.calls(call)
    }

    /// What the model holds right now: reservations, physical bytes, mappings, events and
    /// context retains.
    pub fn outstanding(&self) -> ModelOutstanding {
        let s = self.state();
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
        if s.lost {
            s.calls_after_loss += 1;
            return Err(CuError::CONTEXT_IS_DESTROYED);
        }
        s.log.push(call);
        if let Err(fault) = s.faults.enter(call) {
            if fault.error.is_context_loss() {
                s.lost = true; // a sticky error: the context is lost from this call on
            }
            return Err(fault.error);
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

    fn read(s: &ModelState, allocation: u64, offset: usize, n: usize) -> Vec<u8> {
        s.contents
            .get(&allocation)
            .map_or_else(|| vec![0; n], |b| b[offset..offset + n].to_vec())
    }

    fn write(s: &mut ModelState, allocation: u64, len: usize, offset: usize, bytes: &[u8]) {
        let buf = s.contents.entry(allocation).or_insert_with(|| vec![0; len]);
        buf[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
}

impl Default for DriverModel {
    fn default() -> Self {
        Self::new(ModelConfig::default()).expect("the default settings are valid")
    }
}

/// The model's only context.
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
        if ordinal == 0 {
            Ok(0)
        } else {
            Err(CuError::INVALID_DEVICE)
        }
    }

    fn device_total_mem(&self, _device: i32) -> CuResult<usize> {
        let _s = self.enter(DriverCall::DeviceTotalMem, false)?;
        Ok(self.config.total_mem)
    }

    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context> {
        let mut s = self.enter(DriverCall::PrimaryCtxRetain, false)?;
        if device != 0 {
            misuse(DriverCall::PrimaryCtxRetain, "unknown device");
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

    fn mem_get_allocation_granularity(&self, _device: i32) -> CuResult<usize> {
        let _s = self.enter(DriverCall::MemGetAllocationGranularity, true)?;
        Ok(self.config.granularity)
    }

    fn mem_address_reserve(&self, size: usize, alignment: usize) -> CuResult<u64> {
        let call = DriverCall::MemAddressReserve;
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_reserve(size));
        if !alignment.is_multiple_of(self.config.granularity) {
            misuse(call, "alignment is not a multiple of the granularity");
        }
        let addr = s.book.lowest_gap(VA_BASE, size);
        s.book.apply_reserve(addr, size);
        Ok(addr as u64)
    }

    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemAddressFree;
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_free(ptr as Addr, size));
        s.book.apply_free(ptr as Addr);
        Ok(())
    }

    fn mem_create(&self, size: usize, device: i32) -> CuResult<u64> {
        let call = DriverCall::MemCreate;
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_create(size));
        if device != 0 {
            misuse(call, "unknown device");
        }
        if s.used + size > self.config.total_mem {
            return Err(CuError::OUT_OF_MEMORY);
        }
        let handle = match s.free_handles.pop() {
            Some(released) => released,
            None => {
                s.next_handle += 1;
                s.next_handle - 1
            }
        };
        let allocation = s.next_allocation;
        s.next_allocation += 1;
        s.used += size;
        s.handles.insert(handle, allocation);
        s.book.apply_create(allocation, size);
        Ok(handle)
    }

    unsafe fn mem_release(&self, handle: u64) -> CuResult<()> {
        let call = DriverCall::MemRelease;
        let mut s = self.enter(call, true)?;
        let Some(allocation) = s.handles.remove(&handle) else {
            misuse(call, "unknown or released handle");
        };
        let len = s
            .book
            .phys_len(allocation)
            .expect("a live handle's allocation");
        Self::check(call, s.book.check_release(allocation, len));
        let mapped = s.book.is_mapped(allocation);
        s.book.apply_release(allocation);
        if !mapped {
            s.used -= len;
            s.contents.remove(&allocation);
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
        s.book
            .apply_map(ptr as Addr, size, allocation, Access::ReadOnly);
        s.no_access.insert(ptr as Addr);
        Ok(())
    }

    unsafe fn mem_set_access(
        &self,
        ptr: u64,
        size: usize,
        device: i32,
        read_write: bool,
    ) -> CuResult<()> {
        let call = DriverCall::MemSetAccess;
        let mut s = self.enter(call, true)?;
        if device != 0 {
            misuse(call, "unknown device");
        }
        let access = if read_write {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.set_access(addr, size, access));
        let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
        for start in starts {
            s.no_access.remove(&start);
        }
        Ok(())
    }

    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemUnmap;
        let mut s = self.enter(call, true)?;
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.check_unmap(addr, size));
        for (allocation, len) in s.book.handles_in(addr, size) {
            // Memory released while mapped goes with its last mapping.
            s.used -= len;
            s.contents.remove(&allocation);
        }
        s.book.apply_unmap(addr, size);
        let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
        for start in starts {
            s.no_access.remove(&start);
        }
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
        Ok(())
    }

    fn ctx_synchronize(&self) -> CuResult<()> {
        let mut s = self.enter(DriverCall::CtxSynchronize, true)?;
        let idle = |s: &ModelState| s.streams.values().all(|&(sub, done)| done >= sub);
        while self.config.synchronize_blocks && !idle(&s) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
            if s.lost {
                return Err(CuError::CONTEXT_IS_DESTROYED);
            }
        }
        for (submitted, completed) in s.streams.values_mut() {
            *completed = *submitted;
        }
        Ok(())
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
        Ok(())
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
        let Some(&(submitted, _)) = s.streams.get(&stream) else {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        };
        let Some(slot) = s.events.get_mut(&event) else {
            misuse(call, "unknown event");
        };
        *slot = Some((stream, submitted));
        if self.config.events_complete_at_once {
            s.streams.get_mut(&stream).expect("checked").1 = submitted;
        }
        Ok(())
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
            if s.lost {
                return Err(CuError::CONTEXT_IS_DESTROYED);
            }
        }
        if let Some((stream, at)) = recorded
            && let Some(work) = s.streams.get_mut(&stream)
        {
            work.1 = work.1.max(at);
        }
        Ok(())
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
    }

    #[test]
    fn outstanding_names_what_the_model_holds() {
        let model = DriverModel::default();
        model.init().unwrap();
        let ctx = model.primary_ctx_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this model.
        unsafe { model.ctx_set_current(ctx) }.unwrap();
        let g = model.config.granularity;
        let ptr = model.mem_address_reserve(2 * g, g).unwrap();
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
        let ptr = model.mem_address_reserve(g, g).unwrap();
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
