//! Device typed views (feature `cuda`): CUDA tokens as cudarc device memory of `T`, for
//! `CudaBackend<SysDriver>`, the backend whose streams are cudarc's.
#![allow(unsafe_code)] // the backend's probes, joins and orders, each with its `// SAFETY:` proof

use super::fit;
use crate::allocation::Allocation;
use crate::backend::Addr;
use crate::backend::cuda::{CudaBackend, Stream, SysDriver};
use crate::error::ViewError;
use crate::sharing::{Diverged, Owner};
use crate::state::{Committed, Readable};
use bytemuck::Pod;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

/// The backend whose tokens lend device views.
type Gpu = CudaBackend<SysDriver>;

/// What a view lends: `len` elements at `ptr`, and its home stream; and the backend, asked
/// at each use whether the stream captures.
struct Span<'a> {
    backend: &'a Gpu,
    ptr: CUdeviceptr,
    len: usize,
    home: Arc<CudaStream>,
}

/// `range` of `0..len` as `(start, end)`, or `None` if it is out of bounds (or its ends
/// overflow).
fn checked_bounds(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1)?,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then_some((start, end))
}

/// `range` of `0..len` as `(start, end)`.
///
/// # Panics
///
/// If it is out of bounds (or its ends overflow), as slice indexing does.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let (start, end) = (range.start_bound().cloned(), range.end_bound().cloned());
    checked_bounds((start, end), len).unwrap_or_else(|| {
        panic!("range {start:?}..{end:?} out of bounds of a view of {len} elements")
    })
}

impl<'a> Span<'a> {
    /// `bytes` bytes at `addr` as `T`s on `stream`, which the backend knows from now on, and
    /// which is lent to the span (not forgotten) until it drops. Not the per-thread stream.
    fn lend<T: Pod>(
        backend: &'a Gpu,
        addr: Addr,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Self, ViewError> {
        let len = fit::<T>(addr, bytes)?;
        let refused = |e| ViewError::Stream(Box::new(e));
        if stream.cu_stream() as Stream == crate::backend::cuda::PER_THREAD_STREAM {
            let v = crate::backend::Violation::PerThreadStream;
            let e = crate::backend::BackendError::refused(crate::backend::Op::Graph, 0, 0, v);
            return Err(refused(e)); // before `know` keeps it
        }
        backend.know(stream).map_err(refused)?;
        backend
            .lend_stream(stream.cu_stream() as Stream)
            .map_err(refused)?;
        Ok(Self {
            backend,
            ptr: addr as CUdeviceptr,
            len,
            home: Arc::clone(stream),
        })
    }

    /// Elements `range` of this span (of `T`s), on the same home stream.
    fn sub<T>(&self, range: impl RangeBounds<usize>) -> Self {
        let (start, end) = bounds(range, self.len);
        self.between::<T>(start, end)
    }

    /// Elements `range`, or `None` if it is out of bounds.
    fn get<T>(&self, range: impl RangeBounds<usize>) -> Option<Self> {
        let (start, end) = checked_bounds(range, self.len)?;
        Some(self.between::<T>(start, end))
    }

    /// Elements `start..end`, in bounds.
    fn between<T>(&self, start: usize, end: usize) -> Self {
        // Lent already to this span, so held: lent once more, to the new one.
        let lent = self.backend.lend_stream(self.home.cu_stream() as Stream);
        debug_assert!(lent.is_ok(), "a lent stream stays held");
        Self {
            backend: self.backend,
            ptr: self.ptr + (start * size_of::<T>()) as CUdeviceptr,
            len: end - start,
            home: Arc::clone(&self.home),
        }
    }

    /// Orders a use on `stream` after every earlier use through this view, and (through the
    /// returned guard) every later use after it. See [`DeviceView`]'s "Streams".
    ///
    /// # Panics
    ///
    /// If `stream` belongs to another context than the home stream.
    fn order<'s>(&'s self, stream: &'s CudaStream, bytes: usize, write: bool) -> SyncOnDrop<'s> {
        let home = &*self.home;
        let ctx = stream.context();
        assert!(
            ctx.cu_ctx() == home.context().cu_ctx(),
            "a memtoken device view was used on a stream of another CUDA context than its \
             memory's: the device's fences cannot cover that stream, so no pointer is lent for \
             it; make the view on a stream of the device's context"
        );
        // Used while its stream captures outside a memtoken capture, the memory goes to a
        // graph memtoken does not know of: it is never unmapped then.
        // SAFETY: `stream` is borrowed for this call and `home` held by the view, so both live,
        // and of the backend's context (asserted above: the home stream's context is the
        // backend's, `Span::lend` checked).
        let captures = |s: &CudaStream| unsafe {
            self.backend
                .note_use(s.cu_stream() as Stream, self.ptr as Addr, bytes)
        };
        // The home stream too, when it is another: joining a capturing home would pull
        // `stream` into that capture.
        if captures(stream) || (stream != home && captures(home)) {
            // Neither joined nor synchronized: either would invalidate the capture (a wait on
            // an uncaptured event, a synchronize of a capturing stream: facts 39, 41). The
            // memory is held for good instead.
            return SyncOnDrop::Record(None);
        }
        // Per memory, and for another stream its join of the home stream, each asked again
        // after its record (`CudaBackend::use_through_view`, tested on the driver model).
        // SAFETY: the home stream is lent to this view (held until the view drops); `stream`
        // is borrowed for this call, so live, and of the backend's context (asserted above).
        let held = unsafe {
            self.backend.use_through_view(
                home.cu_stream() as Stream,
                stream.cu_stream() as Stream,
                self.ptr as Addr,
                write,
            )
        };
        // Another stream: the memory's release fences it too, whatever becomes of the use —
        // so it must be one the backend keeps alive (known or covered), and not the per-thread
        // stream (a different stream on each thread, which no fence of another thread covers).
        assert!(
            held,
            "a memtoken device view was used on a stream the device does not know (or on the \
             per-thread stream): its memory's release could not wait for that use; call \
             `device.know(&stream)` (or `cover`) first, or make the view on that stream"
        );
        if stream != home {
            // Asked once more: a capture begun on `stream` since the probes above takes this
            // use into a graph memtoken does not know of — the memory is then held for good.
            captures(stream);
        }
        SyncOnDrop::Record(None)
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        self.backend.end_lend(self.home.cu_stream() as Stream);
    }
}

/// A typed, read-only view of a CUDA token's memory: `len()` elements of `T`, lent by
/// [`Allocation::view`] (a committed allocation, a [`Prefix`](crate::sharing::Prefix), a
/// [`PrefixMapping`](crate::sharing::PrefixMapping), a [`DivergedMapping`](crate::sharing::DivergedMapping)).
/// It is cudarc device memory: it implements
/// [`DeviceSlice`] and [`DevicePtr`], so it goes straight into `stream.memcpy_dtoh`,
/// `clone_dtoh`, `memcpy_dtod` (as the source), or any function that takes a `DevicePtr`; a
/// kernel takes its pointer as `let (x, _x) = view.device_ptr(&stream); launch.arg(&x)` (see
/// below why not `arg(&view)`).
///
/// **It borrows its token**, so the token cannot be released, dropped or written from the host
/// while the view lives:
///
/// ```compile_fail,E0505
/// use cudarc::driver::CudaContext;
/// use memtoken::backend::cuda::CudaBackend;
/// use memtoken::{make_guard, Budget, Device};
/// make_guard!(guard);
/// let ctx = CudaContext::new(0).unwrap();
/// let device = Device::new(guard, CudaBackend::from_context(ctx.clone()).unwrap());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let view = x.view::<f32>(&ctx.default_stream()).unwrap();
/// let releasing = x.release(); // error: `x` is borrowed by the view
/// println!("{}", view.len());
/// ```
///
/// **Only plain-old-data** (`bytemuck::Pod`) may be viewed: every bit pattern must be a value
/// of `T`, since the bytes come from the device.
///
/// ```compile_fail,E0277
/// use cudarc::driver::CudaContext;
/// use memtoken::backend::cuda::CudaBackend;
/// use memtoken::{make_guard, Budget, Device};
/// make_guard!(guard);
/// let ctx = CudaContext::new(0).unwrap();
/// let device = Device::new(guard, CudaBackend::from_context(ctx.clone()).unwrap());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let flags = x.view::<bool>(&ctx.default_stream()); // error: `bool` is not `Pod`
/// ```
///
/// # Streams
///
/// A view has one *home stream*, the one it is made for: the device knows it from then on
/// (`know`: the token's release waits for the work a view submitted there, and the device
/// keeps the stream alive until its owner has let it go and its work has completed; the view
/// is refused with [`ViewError::Stream`] for a stream of another context), and
/// [`DeviceSlice::stream`] returns it. Used on its home stream, the stream's own order puts
/// each use after every earlier read and write made through the view, and the order per
/// memory (below) after those made through other views.
/// Used on another stream of the same context, that stream first waits for everything
/// submitted to the home stream so far, the token's release waits for that stream too —
/// whatever becomes of the returned [`SyncOnDrop`], which records nothing — and later uses of
/// the memory through any view wait for that stream per memory (below); this honours
/// [`DevicePtr`]'s contract (wait for earlier writes) and [`DevicePtrMut`]'s (wait for earlier
/// reads and writes) whether or not cudarc manages stream synchronization, with no host wait.
/// Each such wait is an event recorded on one stream and waited on by the other, and both
/// streams are asked again after the record: a capture begun on either in between is never
/// joined (its work would be captured, not run) nor synchronized (it would be invalidated).
/// That other stream must be one the device knows or covers (`device.know(&stream)`): cudarc
/// lends it by reference, so memtoken could not keep it alive to fence it later — a view
/// used on a stream the device does not know **panics**, as does a stream of another context
/// (the memory is not that context's to use). The per-thread stream is never taken for the
/// home stream (it is a different stream on each thread), and a use on it is fenced by the
/// guard only.
///
/// **Order per memory.** Each use also orders the home stream after the memory's earlier uses
/// through other views (the token's reservation, or a KV cache's plane): a read after the last
/// write, a write after it and every read since (`cuStreamWaitEvent` on an event recorded on
/// each), so two views of one token on two home streams do not race, and a writer does not
/// overtake an earlier reader. The token's `copy_from_host`/`copy_to_host` are ordered too:
/// the legacy stream, where they run, first waits for every covered stream and every stream
/// a view used the memory on. A cross-device `memcpy_dtod` (peer copy) reads through the
/// source view on the *destination's* stream, which no fence of this device covers:
/// synchronize that stream before the token goes.
///
/// **Why no `launch_builder().arg(&view)`:** cudarc keeps a launch's stream and its lists of
/// events to wait for and to record private to cudarc, so an argument of another crate cannot
/// learn which stream the kernel runs on; a view passed so could be used, unfenced and
/// unordered, on any stream. `device_ptr(&stream)` names the stream.
pub struct DeviceView<'a, T> {
    span: Span<'a>,
    _lent: PhantomData<&'a [T]>,
}

/// A typed, writable view of a CUDA token's memory: as [`DeviceView`] (same streams, same
/// ordering), and [`DevicePtrMut`] too, so it is also the destination of `stream.memcpy_htod`,
/// `memcpy_dtod` and `memset_zeros`. Lent only by the tokens that may write their memory, each
/// borrowed mutably: [`Allocation::view_mut`] (committed), and
/// [`Allocation::boundary_view_mut`] (a diverged mapping's private granule).
///
/// ```compile_fail,E0505
/// use cudarc::driver::CudaContext;
/// use memtoken::backend::cuda::CudaBackend;
/// use memtoken::{make_guard, Budget, Device};
/// make_guard!(guard);
/// let ctx = CudaContext::new(0).unwrap();
/// let stream = ctx.new_stream().unwrap();
/// let device = Device::new(guard, CudaBackend::from_context(ctx.clone()).unwrap());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut y = binding.reserve(1 << 21).unwrap().commit().unwrap();
/// let mut view = y.view_mut::<f32>(&stream).unwrap();
/// drop(y); // error: `y` is borrowed by the view
/// stream.memcpy_htod(&[1.0f32], &mut view).unwrap();
/// ```
pub struct DeviceViewMut<'a, T> {
    /// What it shares with a read-only view (`len`, `stream`, `slice`, through `Deref`).
    view: DeviceView<'a, T>,
    _lent: PhantomData<&'a mut [T]>,
}

impl<'a, T> DeviceView<'a, T> {
    fn new(span: Span<'a>) -> Self {
        Self {
            span,
            _lent: PhantomData,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    /// The home stream (see "Streams" above).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.span.home
    }

    /// Elements `range` of this view, on the same home stream.
    ///
    /// # Panics
    ///
    /// If the range is out of bounds.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceView<'_, T> {
        DeviceView::new(self.span.sub::<T>(range))
    }

    /// Elements `range` of this view, or `None` if it is out of bounds: [`slice`](Self::slice)
    /// without the panic.
    pub fn get(&self, range: impl RangeBounds<usize>) -> Option<DeviceView<'_, T>> {
        self.span.get::<T>(range).map(DeviceView::new)
    }
}

impl<'a, T> DeviceViewMut<'a, T> {
    fn new(span: Span<'a>) -> Self {
        Self {
            view: DeviceView::new(span),
            _lent: PhantomData,
        }
    }

    /// Elements `range` of this view, writable, on the same home stream.
    ///
    /// # Panics
    ///
    /// If the range is out of bounds.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceViewMut<'_, T> {
        DeviceViewMut::new(self.view.span.sub::<T>(range))
    }

    /// Elements `range` of this view, writable, or `None` if it is out of bounds:
    /// [`slice_mut`](Self::slice_mut) without the panic.
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Option<DeviceViewMut<'_, T>> {
        self.view.span.get::<T>(range).map(DeviceViewMut::new)
    }
}

impl<'a, T> std::ops::Deref for DeviceViewMut<'a, T> {
    type Target = DeviceView<'a, T>;

    fn deref(&self) -> &DeviceView<'a, T> {
        &self.view
    }
}

impl<T> DeviceSlice<T> for DeviceView<'_, T> {
    fn len(&self) -> usize {
        self.span.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.span.home
    }
}

impl<T> DeviceSlice<T> for DeviceViewMut<'_, T> {
    fn len(&self) -> usize {
        self.view.span.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.view.span.home
    }
}

impl<T> DevicePtr<T> for DeviceView<'_, T> {
    /// The pointer, for a read on `stream`: see [`DeviceView`]'s "Streams".
    ///
    /// # Panics
    ///
    /// If `stream` belongs to another CUDA context than the view's memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        let bytes = self.span.len * size_of::<T>();
        (self.span.ptr, self.span.order(stream, bytes, false))
    }
}

impl<T> DevicePtr<T> for DeviceViewMut<'_, T> {
    /// The pointer, for a read on `stream`: see [`DeviceView`]'s "Streams".
    ///
    /// # Panics
    ///
    /// If `stream` belongs to another CUDA context than the view's memory.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.view.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for DeviceViewMut<'_, T> {
    /// The pointer, for a write on `stream`: see [`DeviceView`]'s "Streams".
    ///
    /// # Panics
    ///
    /// If `stream` belongs to another CUDA context than the view's memory.
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        let bytes = self.view.span.len * size_of::<T>();
        (
            self.view.span.ptr,
            self.view.span.order(stream, bytes, true),
        )
    }
}

impl<T> fmt::Debug for DeviceView<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceView")
            .field("ptr", &format_args!("{:#x}", self.span.ptr))
            .field("len", &self.span.len)
            .field("stream", &self.span.home.cu_stream())
            .finish()
    }
}

impl<T> fmt::Debug for DeviceViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DeviceViewMut").field(&self.view).finish()
    }
}

impl<S: Readable> Allocation<'_, '_, Gpu, S> {
    /// The memory as `len() / size_of::<T>()` elements of `T` on the device, read-only, for
    /// work on `stream` (its home stream: see [`DeviceView`]'s "Streams"). Borrows the token.
    ///
    /// ```no_run
    /// use cudarc::driver::CudaContext;
    /// use memtoken::backend::cuda::CudaBackend;
    /// use memtoken::{make_guard, Budget, Device};
    /// make_guard!(guard);
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.new_stream()?;
    /// let device = Device::new(guard, CudaBackend::from_context(ctx.clone())?);
    /// let binding = device.bind(Budget::unlimited())?;
    /// let mut x = binding.reserve(1 << 21)?.commit()?;
    /// stream.memcpy_htod(&[1.0f32, 2.0, 3.0], &mut x.view_mut::<f32>(&stream)?)?;
    /// let back = stream.clone_dtoh(&x.view::<f32>(&stream)?.slice(..3))?;
    /// assert_eq!(back, [1.0, 2.0, 3.0]);
    /// drop(x); // unmapped once the work on `stream` has finished
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ViewError::Length`] if the length is not a multiple of `T`'s size (or `T` is
    /// zero-sized), [`ViewError::Alignment`] if the memory is not aligned for `T`,
    /// [`ViewError::Stream`] if `stream` belongs to another context.
    pub fn view<T: Pod>(&self, stream: &Arc<CudaStream>) -> Result<DeviceView<'_, T>, ViewError> {
        let backend = self.binding().device().backend();
        Span::lend::<T>(backend.raw(), self.addr(), self.len(), stream).map(DeviceView::new)
    }
}

impl Allocation<'_, '_, Gpu, Owner> {
    /// The prefix as elements of `T` on the device, writable, for work on `stream` (see
    /// [`view`](Self::view)) — only while no sharer maps it (`None` otherwise), so the owner
    /// can compute its prefix on the device before sharing it. Borrows the prefix mutably, so
    /// no sharer maps it while the view lives. A sharer's mapping joins the owner's memory in
    /// the order per memory, so a sharer's view reads after the owner's last write through a
    /// view, and copy-on-write copies after it.
    ///
    /// # Errors
    ///
    /// As for [`view`](Self::view).
    pub fn view_mut<T: Pod>(
        &mut self,
        stream: &Arc<CudaStream>,
    ) -> Option<Result<DeviceViewMut<'_, T>, ViewError>> {
        if !self.parts_mut().is_unique() {
            return None;
        }
        let backend = self.binding().device().backend();
        let span = Span::lend::<T>(backend.raw(), self.addr(), self.len(), stream);
        Some(span.map(DeviceViewMut::new))
    }
}

impl Allocation<'_, '_, Gpu, Committed> {
    /// The memory as elements of `T` on the device, writable, for work on `stream` (see
    /// [`view`](Self::view)). Borrows the token mutably.
    ///
    /// # Errors
    ///
    /// As for [`view`](Self::view).
    pub fn view_mut<T: Pod>(
        &mut self,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceViewMut<'_, T>, ViewError> {
        let backend = self.binding().device().backend();
        Span::lend::<T>(backend.raw(), self.addr(), self.len(), stream).map(DeviceViewMut::new)
    }
}

impl Allocation<'_, '_, Gpu, Diverged> {
    /// The private last granule as elements of `T` on the device, writable, for work on
    /// `stream` (see [`view`](Self::view)). Borrows the mapping mutably.
    ///
    /// # Errors
    ///
    /// As for [`view`](Self::view).
    pub fn boundary_view_mut<T: Pod>(
        &mut self,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceViewMut<'_, T>, ViewError> {
        let at = self.boundary_offset();
        let backend = self.binding().device().backend();
        Span::lend::<T>(backend.raw(), self.addr() + at, self.len() - at, stream)
            .map(DeviceViewMut::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_holds_the_whole_number_of_elements_in_its_bytes() {
        assert_eq!(fit::<f32>(1 << 21, 1 << 21), Ok(1 << 19));
        assert_eq!(fit::<[f32; 3]>(0x1000, 12 * 7), Ok(7));
        assert_eq!(fit::<u8>(0x1001, 3), Ok(3));
    }

    #[test]
    fn a_length_that_is_no_multiple_of_the_element_is_refused() {
        assert_eq!(
            fit::<f32>(0x1000, 6),
            Err(ViewError::Length { bytes: 6, size: 4 })
        );
        assert_eq!(
            fit::<[u8; 3]>(0x1000, 1 << 21),
            Err(ViewError::Length {
                bytes: 1 << 21,
                size: 3
            })
        );
        assert_eq!(
            fit::<()>(0x1000, 8),
            Err(ViewError::Length { bytes: 8, size: 0 })
        );
    }

    #[test]
    fn a_misaligned_start_is_refused() {
        assert_eq!(
            fit::<u64>(0x1004, 8),
            Err(ViewError::Alignment {
                addr: 0x1004,
                align: 8
            })
        );
        // Both misfits: the alignment is named, as on the host.
        assert_eq!(
            fit::<f32>(0x1002, 6),
            Err(ViewError::Alignment {
                addr: 0x1002,
                align: 4
            })
        );
    }

    #[test]
    fn sub_ranges_are_bounded_like_slices() {
        assert_eq!(bounds(.., 10), (0, 10));
        assert_eq!(bounds(2..5, 10), (2, 5));
        assert_eq!(bounds(2..=5, 10), (2, 6));
        assert_eq!(bounds(..3, 10), (0, 3));
        assert_eq!(bounds(10.., 10), (10, 10));
        for bad in [
            std::panic::catch_unwind(|| bounds(5..11, 10)),
            std::panic::catch_unwind(|| bounds((Bound::Included(6), Bound::Excluded(5)), 10)),
            std::panic::catch_unwind(|| bounds(..=usize::MAX, 10)),
        ] {
            assert!(bad.is_err());
        }
        let excluded_max = (Bound::Excluded(usize::MAX), Bound::Unbounded);
        for bad in [
            checked_bounds(5..11, 10),
            checked_bounds((Bound::Included(6), Bound::Excluded(5)), 10),
            checked_bounds(..=usize::MAX, 10),
            checked_bounds(excluded_max, 10),
        ] {
            assert_eq!(bad, None, "no panic, no wrap: out of bounds");
        }
        assert_eq!(checked_bounds(2..=5, 10), Some((2, 6)));
    }
}
