//! The driver model's test controls: planned failures, context loss, work on streams,
//! captures, and what the model holds and was asked.

use super::DriverModel;
use super::config::CaptureMode;
use super::state::StreamWork;
#[cfg(doc)]
use crate::backend::cuda::driver::ShareableHandle;
use crate::backend::cuda::driver::{AllocationProps, CuError, CuResult, DriverCall, Graph, Stream};
use crate::backend::{Access, Addr};

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

impl DriverModel {
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

    /// How many device-to-host copies read memory that unfinished work on another stream,
    /// which the copy was not ordered after, may still write: stale reads (see
    /// `cuMemcpyDtoH`'s rule in [`DriverModel`]).
    pub fn stale_reads(&self) -> u64 {
        self.state().stale_reads
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
        self.add_stream(false)
    }

    /// A new blocking stream of the model's context, standing for the per-thread stream
    /// (cudarc's `per_thread_stream()`, fact 2) in fact 41's rule: while it captures, any use
    /// of the legacy stream is refused with `STREAM_CAPTURE_IMPLICIT` and invalidates the
    /// capture. Its work is not ordered with the legacy stream's (the stricter reading: an
    /// event on one covers nothing on the other).
    pub fn new_blocking_stream(&self) -> Stream {
        self.add_stream(true)
    }

    fn add_stream(&self, blocking: bool) -> Stream {
        let mut s = self.state();
        let stream = s.next_stream;
        s.next_stream += 1;
        let work = StreamWork {
            blocking,
            ..StreamWork::default()
        };
        s.streams.insert(stream, work);
        stream
    }

    /// Destroys `stream`, as its owner's `cuStreamDestroy` does: work submitted there still
    /// completes, but any later driver call naming the stream is a misuse (the model panics),
    /// as is submitting more work on it.
    ///
    /// # Panics
    ///
    /// If `stream` is the legacy stream, not one of the model's, or destroyed already.
    pub fn destroy_stream(&self, stream: Stream) {
        let mut s = self.state();
        if stream == 0 || !s.live_stream(stream) {
            panic!("DriverModel: cannot destroy stream {stream:#x}");
        }
        s.streams.get_mut(&stream).expect("live").destroyed = true;
    }

    /// Whether `stream` was destroyed ([`destroy_stream`](Self::destroy_stream)).
    pub fn stream_destroyed(&self, stream: Stream) -> bool {
        self.state()
            .streams
            .get(&stream)
            .is_some_and(|w| w.destroyed)
    }

    /// Submits work on `stream` (a kernel still running there). It may touch any memory mapped
    /// with access now (fact 21).
    ///
    /// # Panics
    ///
    /// If `stream` is not one of the model's.
    pub fn submit_work_on(&self, stream: Stream) {
        let mut s = self.state();
        if !s.live_stream(stream) {
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
        if !s.live_stream(stream) {
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
        if s.capture_of(stream).is_some() {
            panic!("DriverModel: stream {stream:#x} is capturing already");
        }
        s.open_capture(stream, mode);
    }

    /// A test's hook between a check and an act: begins a capture on `stream` in `mode` (as
    /// [`begin_capture`](Self::begin_capture), on the calling thread, under a new id) just
    /// before the `n`th call of one of the kinds `calls` from now is carried out (`n = 1`:
    /// the next one) —
    /// so a call that asked whether `stream` captures, and then records, waits or synchronizes
    /// on it, meets a capture begun in between, as another thread's would be. Once; a new hook
    /// replaces the previous one. Nothing is begun if `stream` captures by then.
    ///
    /// # Panics
    ///
    /// If `n` is zero, or `stream` is not one of the model's or is the legacy stream.
    pub fn begin_capture_before(
        &self,
        calls: &[DriverCall],
        n: u64,
        stream: Stream,
        mode: CaptureMode,
    ) {
        assert!(n > 0, "DriverModel: begin_capture_before counts from 1");
        let mut s = self.state();
        if stream == 0 || !s.streams.contains_key(&stream) {
            panic!("DriverModel: cannot capture on stream {stream:#x}");
        }
        s.begin_before = Some((calls.to_vec(), n, stream, mode));
    }

    /// Ends the capture on `stream` (`cuStreamEndCapture`).
    ///
    /// # Errors
    ///
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` if a refused call invalidated it (the real call
    /// then returns a NULL graph), `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` if a stream that
    /// joined it was not joined back (fact 39).
    ///
    /// # Panics
    ///
    /// If no capture began on `stream`.
    pub fn end_capture(&self, stream: Stream) -> CuResult<()> {
        let Some(ended) = self.state().end_elsewhere(stream) else {
            panic!("DriverModel: stream {stream:#x} is not capturing");
        };
        ended.map(drop)
    }

    /// A test's hook between a check and an act: ends the capture on `stream` as another
    /// party would (as [`end_capture`](Self::end_capture), keeping its graph for
    /// [`hook_graph`](Self::hook_graph)) just before the `n`th call of one of the kinds
    /// `calls` from now is carried out (`n = 1`: the next one). Once; a new hook replaces the
    /// previous one. Nothing is ended if `stream` does not capture by then.
    ///
    /// # Panics
    ///
    /// If `n` is zero, or `stream` is not one of the model's.
    pub fn end_capture_before(&self, calls: &[DriverCall], n: u64, stream: Stream) {
        assert!(n > 0, "DriverModel: end_capture_before counts from 1");
        let mut s = self.state();
        if !s.streams.contains_key(&stream) {
            panic!("DriverModel: no stream {stream:#x}");
        }
        s.end_before = Some((calls.to_vec(), n, stream));
    }

    /// The graph of the capture [`end_capture_before`](Self::end_capture_before) ended, once
    /// (none if it was invalidated, or the hook has not run).
    pub fn hook_graph(&self) -> Option<Graph> {
        self.state().hook_graph.take()
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
}
