//! CUDA graphs through the seam: the captures memtoken makes (begin, end and instantiate,
//! launch, destroy), and the memory views lend to captures memtoken does not make, which is
//! then never unmapped.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaBackend;
use super::driver::{
    CaptureInfo, CaptureMode, CuError, Driver, GraphExec, PER_THREAD_STREAM, Stream,
};
use crate::backend::{Addr, Backend, BackendError, Op, Violation, lock};

/// What became of a memtoken capture as it ended ([`CudaBackend::end_capture`]).
pub(crate) enum Ended {
    /// Its graph's instance: the capture's memory is the graph's to let go.
    Graph(GraphExec),
    /// Ended by this call with no graph (invalidated, or not instantiated): no graph can use
    /// what it was lent.
    NoGraph(BackendError),
    /// Ended by someone else, who may hold its graph (the stream no longer captures, or
    /// captures under another id): what it was lent stays held for good.
    Elsewhere(BackendError),
    /// An invalidated capture ended by this call with no graph, which may not have been
    /// memtoken's (fact 60: no id to compare): what it was lent stays held for good.
    Unknown(BackendError),
    /// Still open (the end was refused, or the stream could not be asked): asked again.
    Open(BackendError),
}

impl<D: Driver> CudaBackend<D> {
    /// Whether every fence covers `stream` (see [`cover_stream`](Self::cover_stream)).
    pub fn covers(&self, stream: Stream) -> bool {
        lock(&self.state).covered.contains(&stream)
    }

    /// Whether views may be made for `stream`: covered, or known (see
    /// [`know_stream`](Self::know_stream)).
    pub fn knows(&self, stream: Stream) -> bool {
        lock(&self.state).holds(stream)
    }

    /// A view lends `[addr, addr + len)` to work on `stream`, outside memtoken's own capture.
    /// If `stream` captures now (or cannot say), that work becomes part of a graph memtoken
    /// does not know of, which may launch whenever its owner likes: the range is held for good
    /// — never unmapped, so its token's release quarantines it (facts 39, 41). Whether it
    /// captures. The legacy stream while a blocking stream captures answers 906: no graph can
    /// take work from it then (the use would invalidate that capture), so nothing is held.
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a stream of this backend's context, live for the call.
    pub(crate) unsafe fn note_use(&self, stream: Stream, addr: Addr, len: usize) -> bool {
        let range = (addr as u64, len);
        let hold = |s: &mut super::record::CudaState| {
            if !s.graph_held.contains(&range) {
                s.graph_held.push(range); // once, however often the view asks
            }
        };
        let mut s = match self.enter(Op::Graph, addr, len) {
            Ok(s) => s,
            Err(_) if self.context_lost() => return false, // nothing runs any more
            Err(_) => {
                // The context could not be made current, so the stream cannot be asked:
                // held, never unmapped under a graph that may launch.
                hold(&mut lock(&self.state));
                return true;
            }
        };
        // SAFETY: the caller's promise.
        let capturing = match unsafe { self.driver.stream_is_capturing(stream) } {
            Ok(capturing) => capturing,
            Err(e) if e.is_context_loss() => {
                let _ = self.fail(Op::Graph, addr, len, e);
                return false;
            }
            Err(e) if stream == 0 && e == CuError::STREAM_CAPTURE_IMPLICIT => return false,
            Err(_) => true, // cannot say: held, never unmapped under a graph that may launch
        };
        if capturing {
            hold(&mut s);
        }
        capturing
    }

    /// `stream`'s capture state (`cuStreamGetCaptureInfo`, fact 60): `None` where it cannot
    /// be had; once the context is lost, nothing captures any more.
    pub(crate) fn capture_state(&self, stream: Stream) -> Option<CaptureInfo> {
        let Ok(_s) = self.enter(Op::Graph, 0, 0) else {
            return self.context_lost().then_some(CaptureInfo::None);
        };
        if self.context_lost() {
            return Some(CaptureInfo::None);
        }
        // SAFETY: `stream` is lent to the caller's capture (live until forgotten, which no
        // lend allows).
        match unsafe { self.driver.stream_get_capture_info(stream) } {
            Ok(info) => Some(info),
            Err(e) if e.is_context_loss() => {
                let _ = self.fail(Op::Graph, 0, 0, e);
                Some(CaptureInfo::None)
            }
            Err(_) => None,
        }
    }

    /// Holds `[addr, addr + len)` for a memtoken capture that lends it (see
    /// [`CudaState::capture_held`](super::record::CudaState)): never unmapped until
    /// [`let_go`](Self::let_go).
    pub(crate) fn hold_for_capture(&self, addr: Addr, len: usize) {
        lock(&self.state).capture_held.push((addr as u64, len));
    }

    /// Lets go of ranges [`hold_for_capture`](Self::hold_for_capture) held, once each.
    pub(crate) fn let_go(&self, ranges: &[(Addr, usize)]) {
        let mut s = lock(&self.state);
        for &(addr, len) in ranges {
            let range = (addr as u64, len);
            if let Some(at) = s.capture_held.iter().position(|&r| r == range) {
                s.capture_held.swap_remove(at);
            }
        }
    }

    /// Whether part of `[addr, addr + len)` is held for a graph (a capture memtoken made or
    /// did not make): it must not be handed to a new owner while it is.
    pub fn held_by_graph(&self, addr: Addr, len: usize) -> bool {
        let s = lock(&self.state);
        Self::overlaps(&s.graph_held, addr, len) || Self::overlaps(&s.capture_held, addr, len)
    }

    /// `cuStreamBeginCapture` on a covered or known stream, lent (see
    /// [`lend_stream`](Self::lend_stream)) until the capture or its graph goes, unless this
    /// fails: the capture's id (fact 60), by which its end tells it from a capture begun later
    /// on the same stream. A capture whose id cannot be had at once is ended again (nothing
    /// was lent to it yet) and refused.
    pub(crate) fn begin_capture(
        &self,
        stream: Stream,
        mode: CaptureMode,
    ) -> Result<u64, BackendError> {
        let stream = self.lend_stream(stream)?;
        let begun = self.begin_capture_on(stream, mode).and_then(|()| {
            match self.capture_state(stream) {
                Some(CaptureInfo::Active { id }) => Ok(id),
                Some(CaptureInfo::None) => {
                    let v = Violation::CaptureEndedElsewhere(stream);
                    Err(BackendError::refused(Op::Graph, 0, 0, v))
                }
                _ => {
                    // Invalidated already, or the id cannot be had: ended with no graph
                    // (if it still captures), and refused.
                    let e = CuError::STREAM_CAPTURE_INVALIDATED;
                    if let Ok(exec) = self.end_captured(stream) {
                        // SAFETY: just instantiated by `end_captured`, never launched.
                        unsafe { self.destroy_exec(exec) };
                    }
                    Err(self.fail(Op::Graph, 0, 0, e))
                }
            }
        });
        if begun.is_err() {
            self.end_lend(stream);
        }
        begun
    }

    /// `cuStreamBeginCapture` on a lent stream.
    fn begin_capture_on(&self, stream: Stream, mode: CaptureMode) -> Result<(), BackendError> {
        let _s = self.enter(Op::Graph, 0, 0)?;
        // Not the legacy stream (capture cannot start there: fact 41), nor the per-thread
        // stream (one handle, a different stream on each thread: a launch on another thread
        // would run where no fence of this thread's records).
        if stream == 0 || stream == PER_THREAD_STREAM {
            let v = Violation::CaptureStream(stream);
            return Err(BackendError::refused(Op::Graph, 0, 0, v));
        }
        // SAFETY: a lent stream other than the legacy one: live until it is forgotten or the
        // backend drops (`know_stream`'s contract), and not forgotten while lent.
        unsafe { self.driver.stream_begin_capture(stream, mode) }
            .map_err(|e| self.fail(Op::Graph, 0, 0, e))
    }

    /// Ends the capture memtoken began on `stream` under `id` and instantiates its graph
    /// (the graph itself is destroyed at once: an executable graph does not depend on it) —
    /// only while the stream's capture is that one. What became of it:
    /// [`Ended`] says whether the memory it was lent may be let go.
    pub(crate) fn end_capture(&self, stream: Stream, id: u64) -> Ended {
        let elsewhere = || {
            let v = Violation::CaptureEndedElsewhere(stream);
            BackendError::refused(Op::Graph, 0, 0, v)
        };
        let invalidated = match self.capture_state(stream) {
            Some(CaptureInfo::Active { id: now }) if now == id => false,
            // Another id, or none: ended by someone else, who may hold its graph; a capture
            // begun since is not memtoken's to end.
            Some(CaptureInfo::Active { .. } | CaptureInfo::None) => {
                return Ended::Elsewhere(elsewhere());
            }
            // No id to compare (fact 60): ended (no graph comes of an invalidated capture), but
            // it may be one begun after memtoken's was ended elsewhere.
            Some(CaptureInfo::Invalidated) => true,
            None => {
                let e = self.fail(Op::Graph, 0, 0, CuError::STREAM_CAPTURE_UNSUPPORTED);
                return Ended::Open(e); // cannot ask now: asked again as the capture drops
            }
        };
        let ended = self.end_captured(stream);
        let still = self.capture_state(stream);
        match ended {
            // Invalidated when asked, yet a graph came of the end: the end took a capture
            // begun since (an invalidated capture yields none), not memtoken's — its graph is
            // destroyed, and what memtoken's lent stays held for good.
            Ok(exec) if invalidated => {
                // SAFETY: just returned by `end_captured`, destroyed once, here.
                unsafe { self.destroy_exec(exec) };
                Ended::Unknown(elsewhere())
            }
            Ok(exec) => Ended::Graph(exec),
            // Still capturing (another thread's capture, or the end was refused): open.
            Err((e, _)) if still.is_none_or(CaptureInfo::captures) => Ended::Open(e),
            Err((e, _)) if invalidated => Ended::Unknown(e),
            // The end itself failed, and the stream no longer captures, though it was
            // memtoken's valid capture when asked: ended with no graph (invalidated since, or
            // a stream left unjoined), or ended by another party in between (fact 60), who
            // may hold its graph — held for good then.
            Err((_, Some(code)))
                if code != CuError::STREAM_CAPTURE_INVALIDATED
                    && code != CuError::STREAM_CAPTURE_UNJOINED =>
            {
                Ended::Elsewhere(elsewhere())
            }
            Err((e, _)) => Ended::NoGraph(e),
        }
    }

    /// `cuStreamEndCapture` on `stream`, and its graph instantiated. An error comes with the
    /// end's own code where the end itself failed.
    fn end_captured(&self, stream: Stream) -> Result<GraphExec, (BackendError, Option<CuError>)> {
        let _s = self.enter(Op::Graph, 0, 0).map_err(|e| (e, None))?;
        let fail = |e| (self.fail(Op::Graph, 0, 0, e), None);
        // SAFETY: a lent stream (live until forgotten, which no lend allows) that captures:
        // its capture has the id `begin_capture` got, or is invalidated (`end_capture` asked).
        let graph = unsafe { self.driver.stream_end_capture(stream) }
            .map_err(|code| (self.fail(Op::Graph, 0, 0, code), Some(code)))?;
        // Instantiating and destroying may be potentially unsafe calls (fact 40, the strict
        // reading): in the relaxed mode, so no other capture refuses them or is invalidated.
        // If it cannot be relaxed, the graph is left to the driver (no instance is made).
        let _relaxed = self.relaxed().map_err(fail)?;
        // SAFETY: `graph` was just returned by the driver and is destroyed once, below.
        let exec = unsafe { self.driver.graph_instantiate(graph) };
        // SAFETY: as above; not used after.
        let destroyed = unsafe { self.driver.graph_destroy(graph) };
        let exec = exec.map_err(fail)?;
        if let Err(e) = destroyed {
            let _ = fail(e); // the graph's own resources are left to the driver
        }
        Ok(exec)
    }

    /// `cuGraphLaunch` of `exec` on `stream`.
    ///
    /// # Safety
    ///
    /// `exec` came from [`end_capture`](Self::end_capture) of this backend and is not yet
    /// destroyed; the memory it uses stays mapped until every launch has finished.
    pub(crate) unsafe fn launch(
        &self,
        exec: GraphExec,
        stream: Stream,
        held: &[(Addr, usize)],
    ) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Graph, 0, 0)?;
        // Launched into a capture, the graph would become part of another graph that borrows
        // nothing, and could launch after its memory is gone: refused.
        if self.capturing(stream) {
            let v = Violation::CapturingStream(stream);
            return Err(BackendError::refused(Op::Graph, 0, 0, v));
        }
        // SAFETY: the caller's promise for `exec` and its memory; `stream` is lent to the graph
        // and touched its memory, so the memory's fences wait for the launch.
        let launched = unsafe { self.driver.graph_launch(exec, stream) }
            .map_err(|e| self.fail(Op::Graph, 0, 0, e));
        // Asked again: a capture another thread began on `stream` between the question and
        // the launch took the graph's work into a graph memtoken does not know of, which may
        // launch whenever its owner likes — what the graph uses is held for good then, as for
        // a view's use while its stream captures.
        if self.capturing(stream) && !self.context_lost() {
            for &(addr, len) in held {
                let range = (addr as u64, len);
                if !s.graph_held.contains(&range) {
                    s.graph_held.push(range);
                }
            }
        }
        launched
    }

    /// `cuGraphExecDestroy`: launches in flight finish first. If the capture mode cannot be
    /// relaxed now, it is destroyed at the next destruction, or as the backend drops.
    ///
    /// # Safety
    ///
    /// `exec` came from [`end_capture`](Self::end_capture) of this backend, destroyed once.
    pub(crate) unsafe fn destroy_exec(&self, exec: GraphExec) {
        let Ok(mut s) = self.enter(Op::Graph, 0, 0) else {
            if !self.context_lost() {
                lock(&self.state).dead_execs.push(exec); // not current now: later
            }
            return; // lost: the driver freed it with the context
        };
        s.dead_execs.push(exec);
        self.destroy_dead_execs(&mut s);
    }

    /// Destroys the executable graphs waiting for it, in the relaxed mode; what cannot be
    /// destroyed now waits on. The record's lock is held and the context current.
    pub(super) fn destroy_dead_execs(&self, s: &mut super::record::CudaState) {
        if s.dead_execs.is_empty() || self.context_lost() {
            return;
        }
        let Ok(_relaxed) = self.relaxed() else {
            return; // destroyed later
        };
        while let Some(exec) = s.dead_execs.pop() {
            // SAFETY: every entry came from `end_capture` and is destroyed once: it leaves the
            // list before the call, and a failed destruction is left to the driver.
            if let Err(e) = unsafe { self.driver.graph_exec_destroy(exec) } {
                let _ = self.fail(Op::Graph, 0, 0, e); // left to the driver
                if self.context_lost() {
                    return;
                }
            }
        }
    }
}
