//! The order of uses per memory: a use through a view (or a graph's launch) on one stream
//! after the earlier uses of the same memory on others, a view's use on another stream than
//! its home, and the legacy stream (where host copies run) after the covered streams — each by
//! an event recorded on the earlier stream and waited on by the later one, asked again after
//! the record so that a capture another thread begins meanwhile is never joined (fact 39).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaBackend;
use super::driver::{CuError, CuResult, Driver, Stream};
use super::record::CudaState;
use crate::backend::{Addr, Backend, Op};

impl<D: Driver> CudaBackend<D> {
    /// Orders a use, through a view, of the memory at `addr` on `stream` after the earlier
    /// uses of the same memory (its reservation) on other streams — a read after the last
    /// write, a write after the last write and every read since — as cudarc's `DevicePtr` and
    /// `DevicePtrMut` promise: `stream` waits (`cuStreamWaitEvent`) for an event recorded now
    /// on each. Where that cannot be done, the calling thread waits for each such stream
    /// instead; never while a stream involved captures (captured work does not run now, and a
    /// capturing stream may not wait on an uncaptured event: fact 39).
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a live stream of this backend's context, covered or known, and not
    /// forgotten while the caller uses it (a view lends it, or holds an `Arc` of it). The
    /// earlier uses' streams are held by the record (checked under its lock).
    pub(crate) unsafe fn order_use(&self, stream: Stream, addr: Addr, write: bool) {
        let mut s = match self.enter(Op::Fence, addr, 0) {
            Ok(s) => s,
            Err(_) if self.context_lost() => return, // nothing runs any more
            Err(_) => {
                // The context could not be made current, so nothing can be ordered: the use is
                // still noted, so that the memory's release fences its stream.
                self.touch(stream, addr);
                return;
            }
        };
        if !s.holds(stream) {
            return;
        }
        let Some(key) = s.uses_key_or_new(addr) else {
            return;
        };
        let uses = s.uses.entry(key).or_default();
        if !uses.touched.contains(&stream) {
            uses.touched.push(stream); // its release fences `stream`
        }
        // Captured work does not run now: it is ordered when its graph launches.
        if self.capturing(stream) {
            return;
        }
        let uses = s.uses.entry(key).or_default();
        let mut earlier: Vec<Stream> = uses.writer.into_iter().collect();
        if write {
            earlier.extend(uses.readers.iter().copied());
            uses.writer = Some(stream);
            uses.readers.clear();
        } else if uses.writer != Some(stream) && !uses.readers.contains(&stream) {
            // The writer is never also a reader (a wait for it covers its reads since), as in
            // a merge of groups (`CudaState::join`): each earlier stream is listed once.
            uses.readers.push(stream);
        }
        earlier.retain(|&other| other != stream);
        let mut host_waits = Vec::new();
        for other in earlier {
            if !s.holds(other) {
                continue; // forgotten: its work up to then has completed
            }
            if self.capturing(other) {
                // Its captured work is not this use's to wait for; its work from before the
                // capture cannot be waited on without invalidating the capture (facts 39, 41):
                // a known limit, documented on the views.
                continue;
            }
            match self.wait_for(&mut s, stream, other) {
                Ok(true) => {}
                // A capture begun on either stream since the check: not joined, as above.
                Ok(false) if self.context_lost() => return,
                Ok(false) => {}
                Err(e) if e.is_context_loss() => {
                    let _ = self.fail(Op::Fence, addr, 0, e);
                    return; // nothing runs any more
                }
                Err(_) => host_waits.push(other),
            }
        }
        drop(s);
        // The host waits instead, outside the lock (each stream lent meanwhile).
        for other in host_waits {
            if self.synchronize_lent(other).is_err() && self.context_lost() {
                return; // nothing more is called
            }
        }
    }

    /// A use of the memory at `addr`, through a device view whose home stream is `home`, on
    /// `stream` (the home stream or another): the home stream waits for the memory's earlier
    /// uses (see [`order_use`](Self::order_use)); another stream is noted as a use of the
    /// memory (its release fences it), joins the home stream
    /// ([`join_stream`](Self::join_stream)) and is ordered after the memory's earlier uses in
    /// turn, whether or not the join was made — each record asked again after it, so a
    /// capture another thread begins meanwhile is never joined. `false`, with nothing done on
    /// `stream`, where the backend does not hold it (or it is the per-thread stream): the
    /// caller refuses such a use.
    ///
    /// # Safety
    ///
    /// `home` is held by the backend and lent to the caller's view; `stream` is 0 or a live
    /// stream of this backend's context, borrowed by the caller for the call.
    // Called by the device views (feature `cuda`) and the model's tests.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) unsafe fn use_through_view(
        &self,
        home: Stream,
        stream: Stream,
        addr: Addr,
        write: bool,
    ) -> bool {
        // SAFETY: `home` is lent to the view (the caller's promise): held, not forgotten.
        unsafe { self.order_use(home, addr, write) };
        if stream == home {
            return true; // the stream's own order is enough
        }
        if !self.touch(stream, addr) {
            return false; // not held: nothing is done on it
        }
        // SAFETY: `stream` is held (`touch` checked it) and borrowed for the call; `home` is
        // lent to the view.
        unsafe { self.join_stream(stream, home) };
        // Later uses wait for this one per memory (an event recorded on `stream` when they are
        // ordered), never by a synchronize of `stream`, which would invalidate a capture begun
        // on it meanwhile.
        // SAFETY: as above.
        unsafe { self.order_use(stream, addr, write) };
        true
    }

    /// `stream` waits for everything submitted on `home` so far — a device view's use on
    /// another stream than its home (`cudarc`'s `join`, made here so that both streams are
    /// asked again after the record: see [`wait_for`](Self::wait_for)). Whether it joined:
    /// `false` while either stream captures (asked first, and again after the record), the
    /// use then left unordered, as a use on a capturing stream is. Where the wait cannot be
    /// made, the calling thread waits for `home` instead.
    ///
    /// # Safety
    ///
    /// Both streams are held by the backend (covered or known) and not forgotten during the
    /// call (a view lends `home`; the caller borrows `stream`).
    // Called by the device views (feature `cuda`) and the model's tests.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) unsafe fn join_stream(&self, stream: Stream, home: Stream) -> bool {
        let Ok(mut s) = self.enter(Op::Fence, 0, 0) else {
            // Not current now: the calling thread waits for `home` instead (lost: nothing runs).
            return !self.context_lost() && self.synchronize_lent(home) == Ok(true);
        };
        if self.capturing(stream) || self.capturing(home) {
            return false;
        }
        match self.wait_for(&mut s, stream, home) {
            Ok(joined) => joined,
            Err(e) if e.is_context_loss() => {
                let _ = self.fail(Op::Fence, 0, 0, e);
                false
            }
            Err(_) => {
                drop(s);
                self.synchronize_lent(home) == Ok(true)
            }
        }
    }

    /// `stream` waits for the work submitted on `other` so far (the handoff event): `Ok(true)`.
    /// The callers asked first that neither stream captures; after the record both are asked
    /// again, and if either captures now — a capture begun in between, which took the event
    /// (fact 39) — there is no wait: `Ok(false)`. A wait on a captured event would join
    /// `stream` to that capture (its later work captured, not run, and the capture unable to
    /// end: 904), and one from a capturing `stream` on an uncaptured event would invalidate it.
    fn wait_for(&self, s: &mut CudaState, stream: Stream, other: Stream) -> CuResult<bool> {
        let serial = match s.handoff {
            Some(serial) => serial,
            None => {
                let serial = self.create_event(s)?;
                s.handoff = Some(serial);
                serial
            }
        };
        let event = s.events[&serial];
        // SAFETY: `event` is this backend's live event (the handoff leaves the record only as
        // the backend drops); both streams are live (see `order_use`). A wait takes the state
        // the event had when it was made, so recording it again for the next is sound.
        unsafe { self.driver.event_record(event, other)? };
        if self.capturing(other) || self.capturing(stream) {
            return Ok(false);
        }
        // SAFETY: as above.
        unsafe { self.driver.stream_wait_event(stream, event) }.map(|()| true)
    }

    /// Orders the legacy stream, where host copies run, after the work submitted so far on
    /// every other covered stream and every stream a view used the memory at `addr` on (its
    /// reservation): one event, recorded on each and waited on by the legacy stream
    /// (`cuStreamWaitEvent`), so a host copy reads what a kernel on a non-blocking stream
    /// wrote, and writes only after it. While such a stream captures, the copy is refused
    /// with `STREAM_CAPTURE_UNSUPPORTED` (transient): its work from before the capture cannot
    /// be waited for without invalidating the capture (facts 39, 41). The record's lock is
    /// held and the context current.
    pub(super) fn order_legacy_after(&self, s: &mut CudaState, addr: Addr) -> CuResult<()> {
        let mut others: Vec<Stream> = s.covered.iter().copied().filter(|&st| st != 0).collect();
        let uses = s.uses_key(addr).and_then(|k| s.uses.get(&k));
        for &t in uses.map_or(&[][..], |u| &u.touched[..]) {
            if t != 0 && !others.contains(&t) {
                others.push(t);
            }
        }
        for stream in others {
            if self.capturing(stream) {
                if self.context_lost() {
                    return Err(CuError::CONTEXT_IS_DESTROYED);
                }
                // Its work from before the capture cannot be waited for without invalidating
                // the capture (facts 39, 41): the copy is refused until the capture has ended.
                return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
            }
            if !self.wait_for(s, 0, stream)? {
                // A capture begun on it since the check: refused as above.
                if self.context_lost() {
                    return Err(CuError::CONTEXT_IS_DESTROYED);
                }
                return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
            }
        }
        Ok(())
    }
}
