//! The driver model's stream captures: what a capture records, and the calls it refuses.

use super::config::CaptureMode;
use super::state::{Capture, ModelState, Node};
use crate::backend::cuda::driver::{CuError, CuResult, Event, Stream};

impl ModelState {
    /// Facts 39 and 41: querying or synchronizing a captured event returns `CAPTURED_EVENT`,
    /// and invalidates its capture while that is open.
    pub(super) fn captured_event(&mut self, event: Event) -> CuResult<()> {
        let Some(&(_, id)) = self.captured.get(&event) else {
            return Ok(());
        };
        if let Some(c) = self.captures.values_mut().find(|c| c.id == id) {
            c.invalidated = true;
        }
        Err(CuError::CAPTURED_EVENT)
    }

    /// Fact 39: `stream` waits on an event captured on stream `on` by the capture `id`. Inside
    /// that capture the wait is a dependency (the origin waiting on a joined stream's event
    /// joins that stream back); from a stream that does not capture it joins the capture; from
    /// another capture's stream it is refused (902) and invalidates both; once the capture has
    /// ended, refused (907).
    pub(super) fn wait_captured(&mut self, stream: Stream, on: Stream, id: u64) -> CuResult<()> {
        let origin = self
            .captures
            .iter()
            .find(|(_, c)| c.id == id)
            .map(|(&o, _)| o);
        let Some(origin) = origin else {
            return Err(CuError::CAPTURED_EVENT); // its capture has ended
        };
        match self.capture_of(stream) {
            Some(mine) if mine == origin => {
                if stream == origin && on != origin {
                    self.joined.remove(&on);
                    let c = self.captures.get_mut(&origin).expect("found above");
                    c.joined.retain(|&j| j != on);
                }
                Ok(())
            }
            Some(other) => {
                for o in [origin, other] {
                    if let Some(c) = self.captures.get_mut(&o) {
                        c.invalidated = true;
                    }
                }
                Err(CuError::STREAM_CAPTURE_MERGE)
            }
            None => {
                self.joined.insert(stream, origin);
                let c = self.captures.get_mut(&origin).expect("found above");
                c.joined.push(stream);
                Ok(())
            }
        }
    }

    /// The origin stream of the capture `stream` captures into: its own, or the one it joined
    /// (fact 39).
    pub(super) fn capture_of(&self, stream: Stream) -> Option<Stream> {
        if self.captures.contains_key(&stream) {
            return Some(stream);
        }
        self.joined.get(&stream).copied()
    }

    /// The capture `stream` captures into, if any.
    pub(super) fn capture_mut(&mut self, stream: Stream) -> Option<&mut Capture> {
        let origin = self.capture_of(stream)?;
        self.captures.get_mut(&origin)
    }

    /// Opens a capture on `stream` in `mode`, begun by the calling thread, under a new id.
    pub(super) fn open_capture(&mut self, stream: Stream, mode: CaptureMode) {
        let id = self.next_capture_id;
        self.next_capture_id += 1;
        let capture = Capture {
            id,
            mode,
            thread: std::thread::current().id(),
            invalidated: false,
            joined: Vec::new(),
            nodes: Vec::new(),
        };
        self.captures.insert(stream, capture);
        self.ended_elsewhere.remove(&stream);
    }

    /// Ends the capture on `stream` as another party would, keeping its graph (if any) for
    /// the test: memtoken's `cuStreamEndCapture` there then fails (fact 60).
    pub(super) fn end_elsewhere(&mut self, stream: Stream) -> Option<CuResult<usize>> {
        let nodes = self.close_capture(stream)?;
        self.ended_elsewhere.insert(stream);
        Some(nodes.map(|nodes| {
            let graph = self.next_graph;
            self.next_graph += 1;
            self.graphs.insert(graph, nodes);
            graph
        }))
    }

    /// Ends the capture begun on `origin`: its nodes, or why there is no graph — invalidated
    /// (`STREAM_CAPTURE_INVALIDATED`), or a stream that joined it was not joined back
    /// (`STREAM_CAPTURE_UNJOINED`, fact 39). Every joined stream leaves it either way.
    pub(super) fn close_capture(&mut self, origin: Stream) -> Option<CuResult<Vec<Node>>> {
        let capture = self.captures.remove(&origin)?;
        for joined in &capture.joined {
            self.joined.remove(joined);
        }
        Some(if capture.invalidated {
            Err(CuError::STREAM_CAPTURE_INVALIDATED)
        } else if !capture.joined.is_empty() {
            Err(CuError::STREAM_CAPTURE_UNJOINED)
        } else {
            Ok(capture.nodes)
        })
    }

    /// Facts 40–43: whether a potentially unsafe call (the VMM calls) from this thread is
    /// refused by an open capture — any thread's GLOBAL capture, or this thread's own
    /// non-relaxed one — and if so, invalidates those captures (fact 42: a call refused under
    /// GLOBAL mode invalidates another thread's capture too).
    pub(super) fn refused_by_capture(&mut self) -> CuResult<()> {
        let me = std::thread::current().id();
        let mine = self
            .thread_modes
            .get(&me)
            .copied()
            .unwrap_or(CaptureMode::Global);
        let mut refused = false;
        for c in self.captures.values_mut() {
            // The thread's own capture bars it unless begun relaxed; another thread's, only a
            // global one, and only for a thread in the global mode (fact 40).
            let own = c.thread == me && c.mode != CaptureMode::Relaxed;
            let other = c.thread != me && c.mode == CaptureMode::Global;
            let bars = match mine {
                CaptureMode::Global => own || other,
                CaptureMode::ThreadLocal => own,
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
}
