//! CUDA graphs through the seam: the captures memtoken makes (begin, end and instantiate,
//! launch, destroy), and the memory views lend to captures memtoken does not make, which is
//! then never unmapped.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaBackend;
use super::driver::{CaptureMode, Driver, GraphExec, Stream};
use crate::backend::{Addr, Backend, BackendError, Op, Violation, lock};

impl<D: Driver> CudaBackend<D> {
    /// Whether the fences cover `stream` (see [`cover_stream`](Self::cover_stream)).
    pub fn covers(&self, stream: Stream) -> bool {
        lock(&self.covered).contains(&stream)
    }

    /// `stream` if the fences cover it, else why not.
    pub(crate) fn covered(&self, stream: Stream) -> Result<Stream, BackendError> {
        if self.covers(stream) {
            return Ok(stream);
        }
        let v = Violation::UncoveredStream(stream);
        Err(BackendError::refused(Op::Graph, 0, 0, v))
    }

    /// A view lends `[addr, addr + len)` to work on `stream`, outside memtoken's own capture.
    /// If `stream` captures now (or cannot say), that work becomes part of a graph memtoken
    /// does not know of, which may launch whenever its owner likes: the range is held for good
    /// — never unmapped, so its token's release quarantines it (facts 39, 41).
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a stream of this backend's context, live for the call.
    pub(crate) unsafe fn note_use(&self, stream: Stream, addr: Addr, len: usize) {
        let Ok(mut s) = self.enter(Op::Graph, addr, len) else {
            return; // lost: nothing runs any more
        };
        // SAFETY: the caller's promise (all `capturing` asks of the stream).
        if self.capturing(stream) && !self.context_lost() {
            s.graph_held.push((addr as u64, len));
        }
    }

    /// `cuStreamBeginCapture` on a covered stream.
    pub(crate) fn begin_capture(
        &self,
        stream: Stream,
        mode: CaptureMode,
    ) -> Result<(), BackendError> {
        let stream = self.covered(stream)?;
        let _s = self.enter(Op::Graph, 0, 0)?;
        if stream == 0 {
            let v = Violation::UncoveredStream(0); // capture cannot start there (fact 41)
            return Err(BackendError::refused(Op::Graph, 0, 0, v));
        }
        // SAFETY: a covered stream other than the legacy one: live until the backend drops
        // (`cover_stream`'s contract).
        unsafe { self.driver.stream_begin_capture(stream, mode) }
            .map_err(|e| self.fail(Op::Graph, 0, 0, e))
    }

    /// Ends the capture on `stream` and instantiates its graph (the graph itself is destroyed
    /// at once: an executable graph does not depend on it).
    pub(crate) fn end_capture(&self, stream: Stream) -> Result<GraphExec, BackendError> {
        let _s = self.enter(Op::Graph, 0, 0)?;
        let fail = |e| self.fail(Op::Graph, 0, 0, e);
        // SAFETY: a covered stream whose capture `begin_capture` began.
        let graph = unsafe { self.driver.stream_end_capture(stream) }.map_err(fail)?;
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
    ) -> Result<(), BackendError> {
        let _s = self.enter(Op::Graph, 0, 0)?;
        // SAFETY: the caller's promise for `exec` and its memory; `stream` is covered, so the
        // memory's fences wait for the launch.
        unsafe { self.driver.graph_launch(exec, stream) }.map_err(|e| self.fail(Op::Graph, 0, 0, e))
    }

    /// `cuGraphExecDestroy`: launches in flight finish first.
    ///
    /// # Safety
    ///
    /// `exec` came from [`end_capture`](Self::end_capture) of this backend, destroyed once.
    pub(crate) unsafe fn destroy_exec(&self, exec: GraphExec) {
        let Ok(_s) = self.enter(Op::Graph, 0, 0) else {
            return; // lost: the driver freed it with the context
        };
        // SAFETY: the caller's promise.
        if let Err(e) = unsafe { self.driver.graph_exec_destroy(exec) } {
            let _ = self.fail(Op::Graph, 0, 0, e); // left to the driver
        }
    }
}
