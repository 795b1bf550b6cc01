//! CUDA graph captures that borrow the memory they use ([`Capture`], [`CapturedGraph`]) — on
//! any driver, the driver model included, so that everything here runs in `cargo test`. Their
//! views are the stream views ([`StreamView`], [`StreamViewMut`]); cudarc's `DevicePtr` views,
//! [`DeviceView`](super::DeviceView), stay on the real driver.
#![allow(unsafe_code)] // `Capture` and `CapturedGraph` make `unsafe` calls, each with its `// SAFETY:` proof

use super::stream_view::{StreamView, StreamViewMut};
use crate::allocation::Allocation;
use crate::backend::cuda::{CaptureMode, CudaBackend, Driver, Ended, GraphExec, Stream};
use crate::backend::{Addr, BackendError, Cause, Op, Violation};
use crate::device::Device;
use crate::error::ViewError;
use crate::region::Elastic;
use crate::state::{Committed, Readable};
use bytemuck::Pod;
use std::fmt;
use std::marker::PhantomData;

/// Whether a KV cache is awake, shared by the cache with the graphs captured over its planes
/// (which refuse to launch while it sleeps).
#[derive(Clone, Debug)]
pub(crate) struct Awake(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Awake {
    /// Awake, to begin with.
    pub(crate) fn new() -> Self {
        Self(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(
            true,
        )))
    }

    pub(crate) fn is_awake(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Says the cache is awake, or asleep.
    pub(crate) fn set(&self, awake: bool) {
        self.0.store(awake, std::sync::atomic::Ordering::Release);
    }
}

/// Neither `Send` nor `Sync`: a capture in the global or thread-local mode is ended on the
/// thread that began it (`cuStreamEndCapture` from another answers `STREAM_CAPTURE_WRONG_THREAD`
/// and the stream goes on capturing), and a graph launches from the thread it was made on.
type OnItsThread = PhantomData<*const ()>;

/// `'t` exactly: neither shortened (a token borrowed for less than the graph lives would be
/// released under it) nor lengthened.
type Invariant<'t> = PhantomData<fn(&'t ()) -> &'t ()>;

/// A CUDA stream capture made through memtoken: the tokens whose views it lends are borrowed
/// by it and then by the [`CapturedGraph`] it ends in, so none of them can be released,
/// suspended or shrunk while the graph can still be launched:
///
/// ```compile_fail,E0505
/// use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// use memtoken::backend::doubles::DriverModel;
/// use memtoken::{make_guard, Budget, interop::Capture, Device};
/// make_guard!(guard);
/// let model = DriverModel::default();
/// let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
/// let stream = model.new_stream();
/// // SAFETY: a stream of the model's only context, live as long as the model.
/// unsafe { device.cover_stream(stream) };
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
/// let view = capture.view_mut::<f32>(&mut x).unwrap();
/// model.submit_work_touching(stream, &[(view.device_ptr(), 1 << 21)]); // a kernel
/// drop(view);
/// let graph = capture.end().unwrap();
/// let releasing = x.release(); // error: `x` is borrowed by the graph
/// graph.launch().unwrap();
/// ```
///
/// Inside a capture, views record and wait on nothing (no fence mark is recorded on a
/// capturing stream; a view's pointer asks nothing). The views borrow the capture, so none is
/// left when it ends. What they lend is also held by the backend from the lend (never
/// unmapped) until the graph is dropped, or until the capture ends with no graph: a capture
/// forgotten (`mem::forget`) or ended by someone else (cudarc's safe `end_capture` on the same
/// stream, whose caller then holds the graph) keeps it held for good. **Identity:** a capture
/// records its capture id as it begins (`cuStreamGetCaptureInfo`) and ends, or takes the
/// graph of, only the capture with that id — one begun later on the same stream, after this
/// one was ended elsewhere, is never touched. An invalidated capture has no id (the driver
/// gives one only while a capture is active), so it cannot be told from such a later one:
/// memtoken ends it (no graph comes of an invalidated capture) and keeps what it lent held for
/// good. A capture, and its graph, stay on the thread that began it (neither is
/// `Send`), and cannot begin on the legacy stream or the per-thread stream. A capture left without
/// [`end`](Self::end) (an early return, a panic) is ended as it drops, its graph discarded.
///
/// **Which stream.** A capture is made on a stream the device knows or covers, and its graph
/// launches there (its *home*, as for views; the stream is not forgotten while the capture or
/// its graph lives): each launch runs after the work submitted there before it, and after the
/// memory's earlier uses through views on other streams (per memory, as a view's use: a read
/// after the last write, a write after it and every read since), and a token's release waits
/// for every launch made before it.
pub struct Capture<'t, 'id, D: Driver> {
    backend: &'t CudaBackend<D>,
    stream: Stream,
    /// Its capture id (fact 60): it ends only the capture with this id.
    id: u64,
    /// Still capturing: ended as it drops unless [`end`](Self::end) took it.
    open: bool,
    /// Whether the stream is lent to it (until the capture goes, or its graph does).
    lent: bool,
    /// The ranges its views lent, held by the backend until the graph goes (or for good if
    /// the capture is forgotten or ended by someone else).
    held: std::cell::RefCell<Vec<(Addr, usize)>>,
    /// What its views lent, and whether for writing: each launch of its graph is ordered per
    /// memory as a use through a view would be.
    lends: std::cell::RefCell<Vec<(Addr, bool)>>,
    /// Memory lent without being held (a KV cache's planes), with the flag that says whether
    /// it is awake: a launch is refused while any sleeps.
    awake: std::cell::RefCell<Vec<(Addr, usize, Awake)>>,
    _uses: Invariant<'t>,
    _device: PhantomData<&'t Device<'id, CudaBackend<D>>>,
    _thread: OnItsThread,
}

impl<'t, 'id, D: Driver> Capture<'t, 'id, D> {
    /// Begins a capture (`cuStreamBeginCapture` in `mode`) on `stream`, which the device knows
    /// or covers and which is neither the legacy nor the per-thread stream.
    ///
    /// In [`CaptureMode::Relaxed`] another thread may end the capture (the driver refuses it
    /// that in the other modes): memtoken then keeps what it lent held for good, except in one
    /// window no driver call closes — that thread ends it *and* begins a relaxed capture of its
    /// own on the stream between memtoken's question and its end, and memtoken ends that one
    /// instead (see `docs/cuda-facts.md`, fact 60). Prefer the global or thread-local mode
    /// where other threads capture.
    ///
    /// # Errors
    ///
    /// [`Violation::UncoveredStream`](crate::backend::Violation::UncoveredStream) for a stream
    /// the fences do not cover (or the legacy stream, where capture cannot start); the
    /// driver's error (the stream captures already).
    pub fn begin(
        device: &'t Device<'id, CudaBackend<D>>,
        stream: Stream,
        mode: CaptureMode,
    ) -> Result<Self, BackendError> {
        let backend = device.backend().raw();
        let id = backend.begin_capture(stream, mode)?;
        Ok(Self {
            backend,
            stream,
            id,
            open: true,
            lent: true,
            held: std::cell::RefCell::new(Vec::new()),
            lends: std::cell::RefCell::new(Vec::new()),
            awake: std::cell::RefCell::new(Vec::new()),
            _uses: PhantomData,
            _device: PhantomData,
            _thread: PhantomData,
        })
    }

    /// The stream it captures on, where its graph launches.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// `token`'s memory as elements of `T`, read-only, for the captured work; the token is
    /// borrowed by the capture and its graph.
    ///
    /// # Errors
    ///
    /// As for [`Allocation::stream_view`].
    pub fn view<'c, T: Pod, S: Readable>(
        &'c self,
        token: &'t Allocation<'_, 'id, CudaBackend<D>, S>,
    ) -> Result<StreamView<'c, T, D>, ViewError> {
        self.lend(token.addr(), token.len(), false)
    }

    /// `token`'s memory as elements of `T`, writable, for the captured work; the token is
    /// borrowed mutably by the capture and its graph.
    ///
    /// # Errors
    ///
    /// As for [`Allocation::stream_view`].
    pub fn view_mut<'c, T: Pod>(
        &'c self,
        token: &'t mut Allocation<'_, 'id, CudaBackend<D>, Committed>,
    ) -> Result<StreamViewMut<'c, T, D>, ViewError> {
        self.lend(token.addr(), token.len(), true)
            .map(StreamViewMut::new)
    }

    /// A region's committed part as elements of `T`, writable, for the captured work; the
    /// region is borrowed mutably by the capture and its graph, so it cannot shrink (nor
    /// grow) while the graph lives.
    ///
    /// # Errors
    ///
    /// As for [`Allocation::stream_view`].
    pub fn region_view_mut<'c, T: Pod>(
        &'c self,
        region: &'t mut Allocation<'_, 'id, CudaBackend<D>, Elastic>,
    ) -> Result<StreamViewMut<'c, T, D>, ViewError> {
        self.lend(region.addr(), region.committed_len(), true)
            .map(StreamViewMut::new)
    }

    /// A view of `len` bytes at `addr` for the captured work, the range held from now on:
    /// the captured work may use it whenever the graph is launched, even if the capture is
    /// forgotten and ended by someone else.
    fn lend<T: Pod>(
        &self,
        addr: Addr,
        len: usize,
        write: bool,
    ) -> Result<StreamView<'_, T, D>, ViewError> {
        let view = StreamView::lend(self.backend, addr, len, self.stream, true)?;
        self.backend.hold_for_capture(addr, len);
        // Its launches run on the stream: the memory's release fences it, and each launch is
        // ordered after the memory's earlier uses.
        self.backend.touch(self.stream, addr);
        self.lends.borrow_mut().push((addr, write));
        self.held.borrow_mut().push((addr, len));
        Ok(view)
    }

    /// Lends the reservation of `len` bytes at `addr` to the captured work, held only while the
    /// capture is open: once it ends in memtoken's graph the owner maps and unmaps inside it
    /// while the graph lives, fenced (the launches run on the capture's stream, which its fences
    /// cover from now on), and `awake` refuses a launch while it sleeps. Should the graph escape
    /// memtoken (the capture ended by someone else, never ended, forgotten, or a launch taken
    /// into a capture memtoken did not make), the reservation is held for good.
    pub(crate) fn lend_unheld(&self, addr: Addr, len: usize, awake: Awake) {
        // Held while the capture is open, as what a view lends (so a capture forgotten, or
        // ended elsewhere, keeps it held for good); let go when the capture ends in memtoken's
        // graph, which holds it no longer.
        self.backend.hold_for_capture(addr, len);
        self.held.borrow_mut().push((addr, len));
        self.backend.touch(self.stream, addr);
        self.lends.borrow_mut().push((addr, true));
        self.awake.borrow_mut().push((addr, len, awake));
    }

    /// What was lent without being held for the graph, let go now that the capture ended in
    /// memtoken's graph: it checks, at each launch, that the memory is awake instead.
    fn let_go_unheld(&mut self) {
        let unheld: Vec<(Addr, usize)> = self
            .awake
            .get_mut()
            .iter()
            .map(|&(addr, len, _)| (addr, len))
            .collect();
        self.backend.let_go(&unheld);
        let held = self.held.get_mut();
        for range in unheld {
            if let Some(at) = held.iter().position(|&r| r == range) {
                held.swap_remove(at);
            }
        }
    }

    /// Ends the capture through the backend, if its stream still captures under this
    /// capture's id: the graph's instance, or why not. The ranges held are let go where no
    /// graph can use them (this capture ended with none), and kept for good where one may
    /// (ended by someone else — the stream no longer captures, or captures under another id,
    /// which is never ended here — or an invalidated capture that cannot be told from one
    /// begun after this one was ended elsewhere: an invalidated capture has no id, fact 60).
    fn finish(&mut self) -> Result<GraphExec, BackendError> {
        match self.backend.end_capture(self.stream, self.id) {
            Ended::Graph(exec) => {
                self.open = false;
                Ok(exec)
            }
            Ended::NoGraph(e) => {
                self.open = false;
                self.backend.let_go(&std::mem::take(self.held.get_mut()));
                Err(e)
            }
            Ended::Elsewhere(e) | Ended::Unknown(e) => {
                self.open = false;
                self.held.get_mut().clear(); // held for good
                Err(e)
            }
            Ended::Open(e) => Err(e),
        }
    }

    /// Ends the capture and instantiates its graph.
    ///
    /// # Errors
    ///
    /// The driver's error: the capture was invalidated (`STREAM_CAPTURE_INVALIDATED`), or the
    /// graph could not be instantiated. The tokens are free again once the error is dropped.
    pub fn end(mut self) -> Result<CapturedGraph<'t, 'id, D>, BackendError> {
        // Still capturing after a failure: ended as it drops.
        let exec = self.finish()?;
        self.let_go_unheld();
        self.lent = false; // the graph's now, which launches on the stream
        Ok(CapturedGraph {
            backend: self.backend,
            exec,
            held: std::mem::take(self.held.get_mut()),
            lends: std::mem::take(self.lends.get_mut()),
            awake: std::mem::take(self.awake.get_mut()),
            stream: self.stream,
            _uses: PhantomData,
            _device: PhantomData,
            _thread: PhantomData,
        })
    }
}

impl<D: Driver> Drop for Capture<'_, '_, D> {
    fn drop(&mut self) {
        if self.open
            && let Ok(exec) = self.finish()
        {
            // SAFETY: `exec` was just returned by `end_capture` and is never launched.
            unsafe { self.backend.destroy_exec(exec) };
            self.backend.let_go(&std::mem::take(self.held.get_mut()));
        }
        // Still capturing (its end failed twice), or ended by someone else: what it lent
        // stays held for good. The stream is let go once it no longer captures here.
        if self.lent && !self.open {
            self.backend.end_lend(self.stream);
        }
    }
}

impl<D: Driver> fmt::Debug for Capture<'_, '_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capture")
            .field("stream", &format_args!("{:#x}", self.stream))
            .field("open", &self.open)
            .finish()
    }
}

/// An instantiated graph a memtoken [`Capture`] ended in (`CUgraphExec`). It borrows every
/// token whose view the capture lent, for as long as it lives: releasing, suspending or
/// shrinking one does not compile (see [`Capture`] for a release):
///
/// ```compile_fail,E0505
/// use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// use memtoken::backend::doubles::DriverModel;
/// use memtoken::{make_guard, Budget, interop::Capture, Device};
/// make_guard!(guard);
/// let model = DriverModel::default();
/// let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
/// let stream = model.new_stream();
/// // SAFETY: a stream of the model's only context, live as long as the model.
/// unsafe { device.cover_stream(stream) };
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
/// let view = capture.view::<u32, _>(&x).unwrap();
/// model.submit_work_touching(stream, &[(view.device_ptr(), 1 << 21)]);
/// drop(view);
/// let graph = capture.end().unwrap();
/// let asleep = x.suspend(); // error: `x` is borrowed by the graph
/// graph.launch().unwrap();
/// ```
///
/// ```compile_fail,E0499
/// use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// use memtoken::backend::doubles::DriverModel;
/// use memtoken::{make_guard, Budget, interop::Capture, Device};
/// make_guard!(guard);
/// let model = DriverModel::default();
/// let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
/// let stream = model.new_stream();
/// // SAFETY: a stream of the model's only context, live as long as the model.
/// unsafe { device.cover_stream(stream) };
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut region = binding.reserve(2 << 21).unwrap().into_region();
/// region.grow(2).unwrap();
/// let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
/// let mut view = capture.region_view_mut::<u8>(&mut region).unwrap();
/// model.submit_work_touching(stream, &[(view.device_ptr_mut(), 2 << 21)]);
/// drop(view);
/// let graph = capture.end().unwrap();
/// region.shrink(1).unwrap(); // error: `region` is borrowed by the graph
/// graph.launch().unwrap();
/// ```
///
/// Once the graph is dropped the tokens are free again, and a release waits for the last
/// launch:
///
/// ```
/// use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// use memtoken::backend::doubles::DriverModel;
/// use memtoken::{make_guard, Budget, interop::Capture, Device};
/// make_guard!(guard);
/// let model = DriverModel::default();
/// let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
/// let stream = model.new_stream();
/// // SAFETY: a stream of the model's only context, live as long as the model.
/// unsafe { device.cover_stream(stream) };
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
/// let mut view = capture.view_mut::<f32>(&mut x).unwrap();
/// model.submit_work_touching(stream, &[(view.device_ptr_mut(), 1 << 21)]); // a kernel
/// drop(view);
/// let graph = capture.end().unwrap();
/// for _ in 0..3 {
///     graph.launch().unwrap();
/// }
/// drop(graph);
/// let released = x.release().complete().map_err(memtoken::Error::from).unwrap();
/// ```
///
/// Each [`launch`](Self::launch) runs on the
/// capture's stream, after the work submitted there before it; dropping it destroys the
/// executable graph (`cuGraphExecDestroy`, which lets launches in flight finish), and a
/// token's release after that still waits for the last launch — the stream is covered by the
/// device's fences.
///
/// **Kept in a struct:** the graph borrows its tokens, so it cannot live in the same struct as
/// they do; [`OwningGraph`] is the stored form, which owns them. **Limit:** suspending the
/// memory of a kept graph (vLLM's sleep mode keeps graphs because the addresses stay) does not
/// compile, since a suspend takes the token by value.
pub struct CapturedGraph<'t, 'id, D: Driver> {
    backend: &'t CudaBackend<D>,
    exec: GraphExec,
    /// The ranges the capture lent, let go once the graph is destroyed.
    held: Vec<(Addr, usize)>,
    /// What its capture's views lent, and whether for writing.
    lends: Vec<(Addr, bool)>,
    /// Memory lent without being held, and whether it is awake.
    awake: Vec<(Addr, usize, Awake)>,
    stream: Stream,
    _uses: Invariant<'t>,
    _device: PhantomData<&'t Device<'id, CudaBackend<D>>>,
    _thread: OnItsThread,
}

impl<D: Driver> CapturedGraph<'_, '_, D> {
    /// The stream it launches on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// Launches the graph on its stream (`cuGraphLaunch`).
    ///
    /// # Errors
    ///
    /// [`Violation::CapturingStream`](crate::backend::Violation::CapturingStream) while its
    /// stream captures (the launch would be captured into a graph that borrows nothing); the
    /// driver's error.
    pub fn launch(&self) -> Result<(), BackendError> {
        // Memory it uses that sleeps (a KV cache's planes): nothing is mapped there.
        if let Some(&(addr, ..)) = self.awake.iter().find(|(.., awake)| !awake.is_awake()) {
            let asleep = Cause::Violation(Violation::Asleep { addr });
            return Err(BackendError::new(Op::Graph, addr, 0, asleep));
        }
        // Per memory, as a view's use: after the last write through another view (and, for a
        // write, every read since) on another stream.
        for &(addr, write) in &self.lends {
            // SAFETY: the stream is lent to this graph (never forgotten while it lives).
            unsafe { self.backend.order_use(self.stream, addr, write) };
        }
        // SAFETY: `exec` came from this backend's `end_capture` and is destroyed only as this
        // graph drops; the memory it uses belongs to tokens this graph borrows, which stay
        // mapped while it lives, and their releases wait for its launches afterwards (its
        // stream touched their memory). Taken into a capture begun meanwhile, its memory is
        // held for good.
        unsafe { self.backend.launch(self.exec, self.stream, &self.uses()) }
    }
}

impl<D: Driver> CapturedGraph<'_, '_, D> {
    /// Everything the graph uses: what its capture held, and what it lent without holding
    /// (held for good too, should a launch be taken into a capture memtoken did not make).
    fn uses(&self) -> std::borrow::Cow<'_, [(Addr, usize)]> {
        if self.awake.is_empty() {
            return std::borrow::Cow::Borrowed(&self.held);
        }
        let unheld = self.awake.iter().map(|&(addr, len, _)| (addr, len));
        std::borrow::Cow::Owned(self.held.iter().copied().chain(unheld).collect())
    }
}

impl<D: Driver> Drop for CapturedGraph<'_, '_, D> {
    fn drop(&mut self) {
        // SAFETY: `exec` came from this backend's `end_capture`; destroyed once, here.
        unsafe { self.backend.destroy_exec(self.exec) };
        // No launch can be made any more; those in flight are covered by the fences of the
        // memory it used (each touched by its stream).
        self.backend.let_go(&self.held);
        self.backend.end_lend(self.stream);
    }
}

impl<D: Driver> fmt::Debug for CapturedGraph<'_, '_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("exec", &format_args!("{:#x}", self.exec))
            .field("stream", &format_args!("{:#x}", self.stream))
            .finish()
    }
}

impl<'t, 'id, D: Driver> CapturedGraph<'t, 'id, D> {
    /// The same graph, for `'d`: for an [`OwningGraph`], which owns the tokens the graph
    /// borrowed, so they outlive it however long `'d` is.
    fn rebrand<'d>(self, backend: &'d CudaBackend<D>) -> CapturedGraph<'d, 'id, D> {
        debug_assert!(std::ptr::eq(self.backend, backend), "the same backend");
        let mut this = std::mem::ManuallyDrop::new(self);
        CapturedGraph {
            backend,
            exec: this.exec,
            held: std::mem::take(&mut this.held),
            lends: std::mem::take(&mut this.lends),
            awake: std::mem::take(&mut this.awake),
            stream: this.stream,
            _uses: PhantomData,
            _device: PhantomData,
            _thread: PhantomData,
        }
    }
}

/// A captured graph kept together with the tokens it uses — the stored form of a
/// [`CapturedGraph`], for an engine that keeps its graphs beside its tokens (in an
/// [`Engine`](crate::Engine)'s kept value, or any struct): the tokens are moved in, lent to
/// the capture while it records, and owned by the graph from then on, so none of them can be
/// released, suspended, shrunk or even read while it can launch — they are not reachable at
/// all until [`into_tokens`](Self::into_tokens) destroys the graph and hands them back. As it
/// drops, the graph is destroyed first, then the tokens (each release waits for the last
/// launch, as after a [`CapturedGraph`]).
///
/// ```
/// use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// use memtoken::backend::doubles::DriverModel;
/// use memtoken::{make_guard, Budget, Device, interop::OwningGraph};
/// make_guard!(guard);
/// let model = DriverModel::default();
/// let device = Device::new(guard, CudaBackend::new(model.clone(), 0)?);
/// let stream = model.new_stream();
/// // SAFETY: a stream of the model's only context, live as long as the model.
/// unsafe { device.cover_stream(stream) };
/// let binding = device.bind(Budget::unlimited())?;
/// let weights = binding.reserve(1 << 21)?.commit()?;
/// let logits = binding.reserve(1 << 21)?.commit()?;
/// let step = OwningGraph::capture(&device, stream, CaptureMode::Global, (weights, logits),
///     |capture, (weights, logits)| {
///         let w = capture.view::<f32, _>(weights)?;
///         let mut out = capture.view_mut::<f32>(logits)?;
///         // a kernel reading `w` and writing `out`, captured: a node of the graph
///         model.submit_work_touching(stream, &[(w.device_ptr(), 1 << 21), (out.device_ptr_mut(), 1 << 21)]);
///         Ok(())
///     })?;
/// for _ in 0..3 {
///     step.launch()?; // the graph and its tokens live on together, in one value
/// }
/// let (weights, logits) = step.into_tokens(); // the graph is destroyed: free again
/// drop((weights, logits)); // each release waits for the last launch
/// # drop(binding);
/// # model.complete_work();
/// # assert!(device.close().is_clean());
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
///
/// No `&T` is lent while the graph lives: a read view taken then would not be ordered after
/// launches made while it lives, and interior mutability in `T` (a `RefCell`) would hand a
/// token out. The tokens moved in are the graph's (`ui-tests/kept_graph_token_released.rs`):
///
/// ```compile_fail,E0382
/// # use memtoken::backend::cuda::{CaptureMode, CudaBackend};
/// # use memtoken::backend::doubles::DriverModel;
/// # use memtoken::{make_guard, Budget, Device, interop::OwningGraph};
/// # make_guard!(guard);
/// # let model = DriverModel::default();
/// # let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
/// # let stream = model.new_stream();
/// # // SAFETY: a stream of the model's only context, live as long as the model.
/// # unsafe { device.cover_stream(stream) };
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let graph = OwningGraph::capture(&device, stream, CaptureMode::Global, x, |capture, x| {
///     let mut view = capture.view_mut::<u8>(x)?;
///     model.submit_work_touching(stream, &[(view.device_ptr_mut(), 1 << 21)]);
///     Ok(())
/// })
/// .unwrap();
/// let releasing = x.release(); // error: `x` was moved into the graph
/// graph.launch().unwrap();
/// ```
/// Neither `Send` nor `Sync`, as a [`CapturedGraph`].
pub struct OwningGraph<'d, 'id, T, D: Driver> {
    /// Declared first: destroyed before the tokens it uses are dropped.
    graph: CapturedGraph<'d, 'id, D>,
    tokens: T,
}

/// The tokens an [`OwningGraph`]'s capture was given, handed back by its error.
pub struct GraphTokens<T>(pub T);

impl<T> GraphTokens<T> {
    /// The tokens.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> fmt::Display for GraphTokens<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the tokens given to the capture")
    }
}

/// Why an [`OwningGraph`] could not be captured.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The capture could not begin (see [`Capture::begin`]).
    #[error("the capture could not begin")]
    Begin(#[source] Box<BackendError>),
    /// The recording closure failed; the capture was ended and its graph discarded.
    #[error("recording the captured work failed")]
    Record(#[source] crate::Error),
    /// The capture could not end in a graph (see [`Capture::end`]).
    #[error("the capture could not end in a graph")]
    End(#[source] Box<BackendError>),
}

impl crate::error::sealed::Sealed for CaptureError {}

impl crate::error::Failure for CaptureError {
    fn summary(&self) -> &'static str {
        "no graph was captured"
    }

    fn is_context_lost(&self) -> bool {
        match self {
            Self::Begin(e) | Self::End(e) => e.is_context_lost(),
            Self::Record(e) => e.is_context_lost(),
        }
    }
}

impl<'d, 'id, T, D: Driver> OwningGraph<'d, 'id, T, D> {
    /// Captures a graph on `stream` (as [`Capture::begin`] in `mode`) whose work `record`
    /// submits, through views the capture lends of `tokens`; the graph then owns the tokens.
    ///
    /// # Errors
    ///
    /// The capture could not begin or end, or `record` failed: the error hands the tokens
    /// back, with no graph left that uses them.
    pub fn capture(
        device: &'d Device<'id, CudaBackend<D>>,
        stream: Stream,
        mode: CaptureMode,
        mut tokens: T,
        record: impl for<'t> FnOnce(&Capture<'t, 'id, D>, &'t mut T) -> Result<(), crate::Error>,
    ) -> Result<Self, crate::TransitionError<GraphTokens<T>, CaptureError>> {
        let fail = |tokens, cause| crate::TransitionError {
            token: GraphTokens(tokens),
            cause,
        };
        let capture = match Capture::begin(device, stream, mode) {
            Ok(capture) => capture,
            Err(e) => return Err(fail(tokens, CaptureError::Begin(Box::new(e)))),
        };
        if let Err(e) = record(&capture, &mut tokens) {
            drop(capture); // ended as it drops, its graph discarded: the tokens are free
            return Err(fail(tokens, CaptureError::Record(e)));
        }
        // The graph, for `'d`: no longer a borrow of `tokens`, which it owns from now on.
        let backend = device.backend().raw();
        let graph = match capture.end().map(|graph| graph.rebrand(backend)) {
            Ok(graph) => graph,
            Err(e) => return Err(fail(tokens, CaptureError::End(Box::new(e)))),
        };
        Ok(Self { graph, tokens })
    }

    /// Launches the graph on its stream (see [`CapturedGraph::launch`]).
    ///
    /// # Errors
    ///
    /// As for [`CapturedGraph::launch`].
    pub fn launch(&self) -> Result<(), BackendError> {
        self.graph.launch()
    }

    /// The stream it launches on.
    pub fn stream(&self) -> Stream {
        self.graph.stream()
    }

    /// Destroys the graph (`cuGraphExecDestroy`) and hands its tokens back, free again; a
    /// release waits for the last launch.
    pub fn into_tokens(self) -> T {
        let Self { graph, tokens } = self;
        drop(graph);
        tokens
    }
}

impl<T, D: Driver> fmt::Debug for OwningGraph<'_, '_, T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwningGraph")
            .field("stream", &format_args!("{:#x}", self.graph.stream))
            .finish_non_exhaustive()
    }
}
