//! Fences: one event per stream that may use the memory (covered streams, and those a view
//! used it on), recorded after the work submitted there so far; the streams the backend holds,
//! and letting them go (the cudarc streams it keeps alive: `kept.rs`; the order of uses per
//! memory: `order.rs`). Events are named by serials of the backend's, never by the
//! driver's values (a destroyed event's value may come back from a later `cuEventCreate`).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::{CuError, CuResult, Driver, PER_THREAD_STREAM, Stream};
use super::record::CudaState;
use super::{CudaBackend, next_serial};
use crate::backend::Addr;
use crate::backend::{Backend, Op, lock};
use crate::backend::{BackendError, Violation};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

/// A fence: one event per stream that may use the memory it is for (the legacy stream, every
/// covered stream, and each stream a view used that memory on), recorded after the work
/// submitted there so far. A mark whose event could not be created or recorded is recorded at the next query
/// (which covers at least as much work), never replaced by a weaker check. Marks name their
/// events by serial numbers of the backend's, which its record maps to the driver's events: a
/// destroyed event's value may come back from a later `cuEventCreate`, and must not be taken
/// for this fence's.
#[derive(Debug)]
pub struct CudaFence(pub(super) Mutex<Vec<Mark>>);

/// One stream's part of a fence.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mark {
    stream: Stream,
    /// The serial of its event, once created.
    event: Option<u64>,
    recorded: bool,
}

impl<D: Driver> CudaBackend<D> {
    /// Makes every fence recorded from now on cover `stream` too: a release waits for the work
    /// submitted there, whatever memory it used — the way for raw pointers, of which memtoken
    /// cannot tell what memory they reach. (`cover`, feature `cuda`, does this for cudarc
    /// streams.) Views may be made for it too. A stream known before is covered from now on.
    ///
    /// # Safety
    ///
    /// `stream` is 0 (the legacy stream) or a live stream of this backend's context, and stays
    /// live until [`forget_stream`](Self::forget_stream) answers `true` for it or the backend
    /// is dropped: fences record events on it until then.
    pub unsafe fn cover_stream(&self, stream: Stream) {
        let mut s = lock(&self.state);
        s.known.retain(|&k| k != stream);
        if !s.covered.contains(&stream) {
            s.covered.push(stream);
        }
    }

    /// Lets typed views ([`StreamView`](crate::interop::StreamView)) be made for `stream`: a release
    /// then waits for the work submitted there only if a view used the released memory there
    /// — unlike a covered stream, which every fence covers. Fences stay bounded by the streams
    /// that touched the memory, however many streams come and go. (Typed views of cudarc
    /// streams do this themselves, feature `cuda`.) A covered stream stays covered.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this backend's context, and stays live until
    /// [`forget_stream`](Self::forget_stream) answers `true` for it or the backend is dropped:
    /// fences and views record events on it and wait on it until then.
    pub unsafe fn know_stream(&self, stream: Stream) {
        let mut s = lock(&self.state);
        if !s.holds(stream) {
            s.known.push(stream);
        }
    }

    /// Lets `stream` (covered or known) go once the work submitted there so far has completed:
    /// no fence, view or wait uses it afterwards, and its owner may destroy it. Never waits:
    /// `false` while that work may still run, a view of the stream or a capture on it lives,
    /// or it captures — ask again later. `true` for a stream the backend does not hold, and
    /// for any once the context is lost (nothing runs any more); never for the legacy stream.
    pub fn forget_stream(&self, stream: Stream) -> bool {
        if stream == 0 {
            return false;
        }
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            if self.context_lost() {
                forget(&mut lock(&self.state), stream);
            }
            return self.context_lost();
        };
        if !s.holds(stream) {
            return true;
        }
        if s.views.get(&stream).is_some_and(|&n| n > 0) || self.capturing(stream) {
            return false;
        }
        let done = match self.record_now(&mut s, stream) {
            // Asked again: a capture begun between the question and the record took the
            // event, which is never asked while that capture is open (fact 39): destroyed with
            // the retired events, and the stream not let go now.
            Ok(serial) if self.capturing(stream) => {
                s.retired.push(serial);
                false
            }
            Ok(serial) => {
                // SAFETY: the event was created and recorded just above, and is destroyed just
                // below, by this call.
                let done = unsafe { self.driver.event_query(s.events[&serial]) };
                if let Err(e) = done
                    && e.is_context_loss()
                {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                } else {
                    self.destroy_event(&mut s, serial);
                }
                done == Ok(true)
            }
            Err(e) => {
                if e.is_context_loss() {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                }
                false
            }
        };
        let done = done || self.context_lost();
        if done {
            forget(&mut s, stream);
        }
        done
    }

    /// The streams every fence covers, the legacy stream first.
    pub fn covered_streams(&self) -> Vec<Stream> {
        lock(&self.state).covered.clone()
    }

    /// The streams views may be made for that are not covered (see
    /// [`know_stream`](Self::know_stream)).
    pub fn known_streams(&self) -> Vec<Stream> {
        lock(&self.state).known.clone()
    }

    /// Whether `stream` may be used by views: covered or known. A view made for it counts as
    /// lent until [`end_lend`](Self::end_lend): the stream is not forgotten meanwhile.
    pub(crate) fn lend_stream(&self, stream: Stream) -> Result<Stream, BackendError> {
        if stream == PER_THREAD_STREAM {
            let v = Violation::PerThreadStream;
            return Err(BackendError::refused(Op::Graph, 0, 0, v));
        }
        self.lend_held(stream)
    }

    /// Lends `stream` if the backend holds it (the per-thread stream included, for a covered
    /// one: the backend's own waits).
    fn lend_held(&self, stream: Stream) -> Result<Stream, BackendError> {
        let mut s = lock(&self.state);
        if !s.holds(stream) {
            let v = Violation::UncoveredStream(stream);
            return Err(BackendError::refused(Op::Graph, 0, 0, v));
        }
        *s.views.entry(stream).or_default() += 1;
        Ok(stream)
    }

    /// Notes that work on `stream` (covered or known) uses the memory of the reservation at
    /// `addr`, without ordering it: the reservation's release fences `stream` from now on.
    /// Whether it could (the stream held, the address reserved).
    pub(crate) fn touch(&self, stream: Stream, addr: Addr) -> bool {
        let mut s = lock(&self.state);
        if stream == PER_THREAD_STREAM || !s.holds(stream) {
            return false;
        }
        let Some(key) = s.uses_key_or_new(addr) else {
            return false;
        };
        let uses = s.uses.entry(key).or_default();
        if !uses.touched.contains(&stream) {
            uses.touched.push(stream);
        }
        true
    }

    /// A view lent by [`lend_stream`](Self::lend_stream) is gone.
    pub(crate) fn end_lend(&self, stream: Stream) {
        let mut s = lock(&self.state);
        if let Some(n) = s.views.get_mut(&stream) {
            *n -= 1;
            if *n == 0 {
                s.views.remove(&stream);
            }
        }
    }

    /// A fence over the streams that may use the memory of the reservations at `at` — every
    /// covered stream, and each stream a view used that memory on — or, for `None`, over every
    /// stream the backend holds. Its marks are recorded now where they can be (the rest at the
    /// next query).
    pub(super) fn record_fence_over(&self, at: Option<&[Addr]>) -> CudaFence {
        #[cfg(feature = "cuda")]
        self.let_go_streams();
        let streams = {
            let s = lock(&self.state);
            let mut streams = s.covered.clone();
            match at {
                None => streams.extend_from_slice(&s.known),
                Some(addrs) => {
                    for &addr in addrs {
                        let uses = s.uses_key(addr).and_then(|k| s.uses.get(&k));
                        for &t in uses.map_or(&[][..], |u| &u.touched[..]) {
                            if !streams.contains(&t) {
                                streams.push(t);
                            }
                        }
                    }
                }
            }
            streams
        };
        let mut marks: Vec<Mark> = streams
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

    /// Declares that work of a peer device (a kernel, a collective) may use this device's
    /// memory until the returned guard drops: meanwhile no fence is done, so every release
    /// waits — memtoken's fences record in this context only, and cannot see a peer's work.
    /// Declarations nest; a lost context ends them (nothing runs any more).
    pub fn peer_work(&self) -> PeerWork<'_, D> {
        self.peer_work.fetch_add(1, Ordering::AcqRel);
        PeerWork { backend: self }
    }

    /// Whether a [`peer_work`](Self::peer_work) declaration lives.
    fn peer_work_declared(&self) -> bool {
        self.peer_work.load(Ordering::Acquire) > 0
    }

    /// Whether every event of `fence` has completed, without waiting. Where a mark cannot be
    /// recorded or a query fails: whether the context is lost (nothing runs any more then).
    /// Never while peer work is declared.
    pub(super) fn poll_fence(&self, fence: &CudaFence) -> bool {
        if self.peer_work_declared() {
            return self.context_lost();
        }
        // Lost: nothing runs any more; the teardown that follows sees the loss and calls nothing.
        let mut marks = lock(&fence.0);
        if !self.record_marks(&mut marks) {
            return self.context_lost();
        }
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            return self.context_lost();
        };
        for m in marks.iter_mut() {
            if !s.holds(m.stream) {
                continue; // forgotten: its work up to then (this mark's) has completed
            }
            let Some(&event) = m.event.and_then(|serial| s.events.get(&serial)) else {
                continue; // not this backend's event: nothing of ours to wait for
            };
            // Asking an event captured by a capture begun since its record would invalidate
            // that capture (facts 39, 41): not while its stream captures.
            if self.capturing(m.stream) {
                return self.context_lost();
            }
            // SAFETY: `s.events` maps the serial to an event created by this driver and not yet
            // destroyed (an entry leaves when its event is destroyed; serials are never reused).
            match unsafe { self.driver.event_query(event) } {
                Ok(true) => {}
                Ok(false) => return false,
                Err(e) if e.is_context_loss() => {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    return self.context_lost();
                }
                // A captured event (907), or any other answer: recorded again once its stream
                // no longer captures, which covers at least as much work.
                Err(_) => {
                    m.recorded = false;
                    return false;
                }
            }
        }
        // Only an event of this backend's orders this backend's copies.
        if let Some(upto) = legacy_event(&marks)
            && s.events.contains_key(&upto)
        {
            self.settle_copies(&mut s, upto);
        }
        true
    }

    /// Waits for every event of `fence`, outside the record's lock (for the whole stream where
    /// an event's wait fails); whether it completed. Where a mark cannot be recorded or a wait
    /// fails: whether the context is lost.
    pub(super) fn block_on_fence(&self, fence: &CudaFence) -> bool {
        if self.peer_work_declared() {
            return self.context_lost(); // a peer's work cannot be waited for here
        }
        let mut marks = lock(&fence.0);
        if !self.record_marks(&mut marks) {
            return self.context_lost();
        }
        for m in marks.iter() {
            let Some(serial) = m.event else { continue };
            let event = {
                let Ok(s) = self.enter(Op::Fence, 0, 0) else {
                    return self.context_lost();
                };
                if !s.holds(m.stream) {
                    continue; // forgotten: its work up to then (this mark's) has completed
                }
                // Waiting on an event its stream's open capture took would invalidate it.
                if self.capturing(m.stream) {
                    return self.context_lost();
                }
                match s.events.get(&serial) {
                    Some(&event) => event,
                    None => continue,
                }
            };
            // Outside the lock. SAFETY: `s.events` just mapped the serial to a live event, and
            // it stays live: it belongs to `fence`, borrowed for this call, and an event is
            // destroyed only when its fence is retired (which takes the fence by value) or the
            // backend dropped.
            let waited = match unsafe { self.driver.event_synchronize(event) } {
                Ok(()) => Ok(true),
                Err(e) if e.is_context_loss() => Err(e),
                Err(_) => self.synchronize_lent(m.stream), // the whole stream: never less
            };
            match waited {
                Ok(true) => {}
                Ok(false) => return false, // it captures now: waited for once it no longer does
                Err(e) => {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    return self.context_lost();
                }
            }
        }
        if let Some(upto) = legacy_event(&marks)
            && let Ok(mut s) = self.enter(Op::Fence, 0, 0)
            && s.events.contains_key(&upto)
        {
            self.settle_copies(&mut s, upto);
        }
        true
    }

    /// Destroys the events of `fence` (and any whose destruction failed before).
    pub(super) fn destroy_fence(&self, fence: CudaFence) {
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

    /// Waits, outside the lock, for everything submitted so far on the legacy stream: for an
    /// event recorded there now, or for the whole legacy stream if no event can be recorded or
    /// the wait on it fails (never less than what was asked).
    pub(super) fn wait_legacy(&self) -> CuResult<()> {
        // What a synchronize of the legacy stream covers: the copies (which run there) that
        // failed before it began (one that fails on another thread meanwhile may still run).
        let mut synchronized = 0;
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
                    self.synchronize_legacy()
                }
            }),
            None => {
                synchronized = next_serial();
                self.synchronize_legacy()
            }
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
                Ok(mut s) => {
                    if waited.is_ok() {
                        self.settle_copies(&mut s, serial);
                    }
                    if !self.context_lost() {
                        self.destroy_event(&mut s, serial);
                    }
                }
                Err(_) => lock(&self.state).retired.push(serial),
            }
        } else if waited.is_ok()
            && let Ok(mut s) = self.enter(Op::Copy, 0, 0)
        {
            self.settle_copies(&mut s, synchronized);
        }
        waited
    }

    /// Waits for everything submitted on `stream` so far, where a wait on one of its events
    /// failed. On a stream other than the legacy stream, for an event recorded there now,
    /// after which the stream is asked again — a
    /// capture another thread began between the check and the record took the event (fact
    /// 39), which is then never waited on, and this answers `Ok(false)`: to be waited for
    /// later, the memory held meanwhile. Only where no event can be recorded or waited on, for
    /// the whole stream (`cuStreamSynchronize`, in the relaxed capture mode, so that another
    /// thread's global capture does not refuse it: fact 40) — a last resort with a window
    /// no probe closes: a capture begun between its check and the synchronize is refused it
    /// and invalidated (fact 41), and nothing is unmapped meanwhile. The legacy stream is
    /// synchronized whole: it never captures, and a record there would use it as much as a
    /// synchronize does (a blocking stream's capture begun since the check is invalidated by
    /// either: fact 41). Never for the whole
    /// context (`cuCtxSynchronize` would invalidate every capture open in it), and not while
    /// the stream captures: `Ok(false)`.
    fn synchronize_stream(&self, stream: Stream) -> CuResult<bool> {
        let capturing = || match self.context_lost() {
            true => Err(CuError::CONTEXT_IS_DESTROYED),
            false => Ok(false),
        };
        let event = match self.enter(Op::Fence, 0, 0) {
            // The legacy stream never captures, and a record there is as much a use of it as a
            // synchronize (fact 41): the synchronize, below.
            Ok(_) if stream == 0 => None,
            Ok(mut s) => {
                if self.capturing(stream) {
                    return capturing();
                }
                match self.record_now(&mut s, stream) {
                    // Asked again: captured, it is destroyed with the retired events, never
                    // waited on or asked.
                    Ok(serial) if self.capturing(stream) => {
                        s.retired.push(serial);
                        return capturing();
                    }
                    Ok(serial) => Some((serial, s.events[&serial])),
                    Err(e) if e.is_context_loss() => {
                        let _ = self.fail(Op::Fence, 0, 0, e);
                        return Err(e);
                    }
                    Err(_) => None,
                }
            }
            Err(_) if self.context_lost() => return Err(CuError::CONTEXT_IS_DESTROYED),
            Err(_) => None, // not current now: no event can be made
        };
        if let Some((serial, event)) = event {
            // Outside the lock. SAFETY: the event was created and recorded just above, and is
            // destroyed only below, by this call (its serial is known to no fence).
            let waited = unsafe { self.driver.event_synchronize(event) };
            if let Err(e) = waited
                && e.is_context_loss()
            {
                let _ = self.fail(Op::Fence, 0, 0, e); // no call after it
                return Err(e);
            }
            self.drop_event(serial);
            if waited.is_ok() {
                return Ok(true);
            } // else the whole stream, below: never less
        }
        if self.capturing(stream) {
            return capturing();
        }
        let _relaxed = self.relaxed()?;
        // SAFETY: `stream` is one the backend holds, with the record's lock held or lent (its
        // callers' duty): 0, or covered or known, whose owner promised it live until
        // `forget_stream` lets it go, which needs that lock and no lend.
        let waited = unsafe { self.driver.stream_synchronize(stream) };
        if let Err(e) = waited
            && e.is_context_loss()
        {
            let _ = self.fail(Op::Fence, 0, 0, e); // before the guard restores the mode
            return Err(e);
        }
        waited.map(|()| true)
    }

    /// Destroys one of this backend's events, named by its serial, under the record's lock;
    /// where the context cannot be made current now, at the next retirement (once lost,
    /// never: the driver freed it with the context).
    fn drop_event(&self, serial: u64) {
        match self.enter(Op::Fence, 0, 0) {
            Ok(mut s) => {
                if !self.context_lost() {
                    self.destroy_event(&mut s, serial);
                }
            }
            Err(_) => lock(&self.state).retired.push(serial),
        }
    }

    /// [`synchronize_stream`](Self::synchronize_stream) outside the record's lock, the stream
    /// lent meanwhile (see [`lend_stream`](Self::lend_stream)), so that it cannot be forgotten
    /// (and destroyed by its owner) during the wait; a stream forgotten already needs no wait
    /// (its work up to then has completed).
    pub(super) fn synchronize_lent(&self, stream: Stream) -> CuResult<bool> {
        if self.context_lost() {
            return Err(CuError::CONTEXT_IS_DESTROYED); // nothing runs, nothing is called
        }
        if stream != 0 && self.lend_held(stream).is_err() {
            return Ok(true); // not held: forgotten, its work up to then completed
        }
        let waited = self.synchronize_stream(stream);
        if stream != 0 {
            self.end_lend(stream);
        }
        waited
    }

    /// [`synchronize_stream`](Self::synchronize_stream) of the legacy stream, where copies
    /// run; while it may not be used (a blocking stream of the context captures), the error
    /// its probe answered (transient: the copies it waits for stay pending).
    fn synchronize_legacy(&self) -> CuResult<()> {
        match self.synchronize_stream(0)? {
            true => Ok(()),
            false => Err(CuError::STREAM_CAPTURE_IMPLICIT),
        }
    }

    /// Creates an event and records it on `stream` now; returns its serial. An event that
    /// cannot be recorded is destroyed again (or left to be retried with the retired ones).
    fn record_now(&self, s: &mut CudaState, stream: Stream) -> CuResult<u64> {
        let serial = self.create_event(s)?;
        // SAFETY: the event was created just above by this driver; `stream` is one the backend
        // holds, with the record's lock held (`s`): live until `forget_stream` lets it go.
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
    pub(super) fn create_event(&self, s: &mut CudaState) -> CuResult<u64> {
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
        let mut all = true;
        for m in marks.iter_mut().filter(|m| !m.recorded) {
            if !s.holds(m.stream) {
                // Forgotten since the fence was made: the work it was to cover has completed.
                m.recorded = true;
                continue;
            }
            // Never into a capture (a captured event is graph nodes, and asking it invalidates
            // the capture: facts 39, 41): recorded once the stream no longer captures.
            if self.capturing(m.stream) {
                if self.context_lost() {
                    return false; // the answer was a loss: nothing more is called
                }
                all = false;
                continue;
            }
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
            // destroyed (destroyed only when its fence is retired); `m.stream` is held (checked
            // above, under the lock `forget_stream` needs): 0, or covered or known, live until
            // forgotten (the `cover_stream` and `know_stream` contracts).
            match unsafe { self.driver.event_record(event, m.stream) } {
                // Asked again: a capture begun between the check and the record took the event
                // (fact 39), which is then never asked or waited on while that capture is
                // open — the mark is recorded again once it has ended.
                Ok(()) if self.capturing(m.stream) => {
                    if self.context_lost() {
                        return false;
                    }
                    all = false;
                }
                Ok(()) => m.recorded = true,
                Err(e) => {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                    return false;
                }
            }
        }
        all
    }

    /// Whether `stream` captures now, or may not be used (the legacy stream while a blocking
    /// stream of the context captures answers 906): then nothing is recorded on it and none of
    /// its events is asked (facts 39, 41). Asking invalidates nothing; a failed answer counts
    /// as capturing (asked again later), a loss is noted. Called with the context current
    /// (after [`enter`](Self::enter)).
    pub(super) fn capturing(&self, stream: Stream) -> bool {
        if self.context_lost() {
            return true; // nothing is called once the context is lost
        }
        // SAFETY: `stream` is one the backend holds, with the record's lock held or lent to a
        // live view or capture (its callers' duty): 0, or covered or known, live until
        // `forget_stream` lets it go, which needs that lock and no lend.
        match unsafe { self.driver.stream_is_capturing(stream) } {
            Ok(capturing) => capturing,
            Err(e) => {
                if e.is_context_loss() {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                }
                true
            }
        }
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
}

/// A declaration that a peer device's work may use this device's memory (see
/// [`CudaBackend::peer_work`]): releases wait until it drops.
#[must_use = "peer work is declared only while the guard lives"]
#[derive(Debug)]
pub struct PeerWork<'a, D: Driver> {
    backend: &'a CudaBackend<D>,
}

impl<D: Driver> Drop for PeerWork<'_, D> {
    fn drop(&mut self) {
        self.backend.peer_work.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The serial of `marks`' event on the legacy stream, where copies run: once it has completed,
/// every copy started before it was created has too.
fn legacy_event(marks: &[Mark]) -> Option<u64> {
    marks.iter().find(|m| m.stream == 0).and_then(|m| m.event)
}

/// Lets `stream` go from the record: no longer covered, known or lent, and no longer a use of
/// any memory (its work has completed, or nothing runs any more).
fn forget(s: &mut CudaState, stream: Stream) {
    s.covered.retain(|&c| c != stream);
    s.known.retain(|&k| k != stream);
    s.views.remove(&stream);
    for uses in s.uses.values_mut() {
        if uses.writer == Some(stream) {
            uses.writer = None;
        }
        uses.readers.retain(|&r| r != stream);
        uses.touched.retain(|&t| t != stream);
    }
}
