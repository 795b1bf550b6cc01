//! Typed views of CUDA tokens for work on a raw stream handle ([`StreamView`],
//! [`StreamViewMut`]) — on any driver, the driver model included — lent by a token and by a
//! [`Capture`](super::Capture).
#![allow(unsafe_code)] // the views make `unsafe` calls, each with its `// SAFETY:` proof

use super::fit;
use crate::allocation::Allocation;
use crate::backend::Addr;
use crate::backend::cuda::{CudaBackend, Driver, Stream};
use crate::error::ViewError;
use crate::region::Elastic;
use crate::sharing::{Capability, Owner};
use crate::state::{Committed, Readable};
use bytemuck::Pod;
use std::fmt;
use std::marker::PhantomData;

/// A typed, read-only view of a CUDA token's memory for work on one raw stream (a `CUstream`
/// the device knows or covers: [`Device::know_stream`](crate::Device::know_stream), [`Device::cover_stream`](crate::Device::cover_stream)): `len()` elements of `T` at [`device_ptr`](Self::device_ptr).
/// Lent by [`Allocation::stream_view`] (any readable token, and a region's committed part) and
/// by a [`Capture`](super::Capture). It borrows its token, so the token cannot be released while it lives.
///
/// **Ordering is per memory.** Taking the pointer orders the use after the memory's earlier
/// uses through views on other streams (its reservation: a token's, or a KV cache's plane): a read
/// ([`device_ptr`](Self::device_ptr)) after the last write, a write
/// ([`StreamViewMut::device_ptr_mut`]) after the last write and every read since — the
/// stream waits for an event recorded on each (`cuStreamWaitEvent`), as cudarc's `DevicePtr`
/// contract asks. The token's release waits for the work submitted on the view's stream from
/// then on, whatever becomes of the view (the view lends the stream: it is not forgotten
/// meanwhile).
///
/// **Graph captures.** A view made outside a memtoken [`Capture`](super::Capture) asks its stream whether it
/// captures (`cuStreamIsCapturing`) twice: when its pointer is taken (each `device_ptr`) and
/// as the view drops. If a capture memtoken did not make (cudarc's `begin_capture`, the raw
/// driver) is open at either, the memory may be in a graph memtoken does not know of, which
/// may launch at any time later: it is held for good — never unmapped, its token's release
/// quarantined ([`Violation::HeldByGraph`](crate::backend::Violation::HeldByGraph)), its
/// address never handed out again. **That is all that is promised:** a capture that begins
/// after the take and ends before the drop is open at neither probe, and no driver query
/// answers "was there a capture in between" — nothing is held, and the release unmaps. Keeping
/// the token alive while such a graph can launch is the `unsafe` kernel launch's obligation
/// (or capture through [`Capture`](super::Capture), whose graph borrows the token). **Limits:** the pointer is
/// for work on the view's stream while the view lives — memtoken cannot see a pointer kept
/// past the view, or used on another stream, and such a use is the caller's to keep out of a
/// capture memtoken does not make (as for the raw `device_ptr()` of a token).
/// A use that must wait for a stream which captures at that moment waits for none of that
/// stream's work (it cannot be waited for without invalidating the capture): end captures
/// before using their memory elsewhere. (A host copy is refused meanwhile instead.)
pub struct StreamView<'a, T, D: Driver> {
    backend: &'a CudaBackend<D>,
    addr: Addr,
    len: usize,
    stream: Stream,
    /// Lent by a memtoken capture, whose graph borrows the token: no probe.
    in_capture: bool,
    _lent: PhantomData<&'a [T]>,
}

/// A typed, writable view of a CUDA token's memory for work on one raw stream: as
/// [`StreamView`], lent only by tokens that may write their memory, each borrowed mutably
/// ([`Allocation::stream_view_mut`] of a committed allocation or a region, and a
/// [`Capture`](super::Capture)).
pub struct StreamViewMut<'a, T, D: Driver> {
    view: StreamView<'a, T, D>,
    _lent: PhantomData<&'a mut [T]>,
}

impl<'a, T, D: Driver> StreamView<'a, T, D> {
    /// `bytes` bytes at `addr` as `T`s for work on `stream`, which the fences must cover.
    pub(crate) fn lend(
        backend: &'a CudaBackend<D>,
        addr: Addr,
        bytes: usize,
        stream: Stream,
        in_capture: bool,
    ) -> Result<Self, ViewError> {
        let len = fit::<T>(addr, bytes)?;
        backend
            .lend_stream(stream)
            .map_err(|e| ViewError::Stream(Box::new(e)))?;
        Ok(Self {
            backend,
            addr,
            len,
            stream,
            in_capture,
            _lent: PhantomData,
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the view is for.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The device pointer (`CUdeviceptr`), for reading on [`stream`](Self::stream): a kernel
    /// argument. Outside a memtoken capture, first asks whether the stream captures (see
    /// "Graph captures" above: a capture open at neither this probe nor the view's drop is the
    /// `unsafe` launch's obligation).
    pub fn device_ptr(&self) -> u64 {
        self.use_for(false)
    }

    /// The pointer for a use: outside a memtoken capture, the stream is asked whether it
    /// captures, and the use is ordered after the memory's earlier uses on other streams
    /// (a read after the last write; a write after it and every read since).
    fn use_for(&self, write: bool) -> u64 {
        self.ask_stream();
        if !self.in_capture {
            // SAFETY: the stream is lent to this view (checked held when it was lent): live
            // until forgotten, which no lend allows (`know_stream`'s contract).
            unsafe { self.backend.order_use(self.stream, self.addr, write) };
        }
        self.addr as u64
    }

    /// Outside a memtoken capture: whether the stream captures now, holding the memory for
    /// good if it does (see "Graph captures" above).
    fn ask_stream(&self) {
        if !self.in_capture {
            let bytes = self.len * size_of::<T>();
            // SAFETY: the stream is lent to this view (checked held when it was lent): live
            // until forgotten, which no lend allows (`know_stream`'s contract).
            unsafe { self.backend.note_use(self.stream, self.addr, bytes) };
        }
    }
}

impl<T, D: Driver> Drop for StreamView<'_, T, D> {
    /// Asks its stream once more: a capture open now (begun after the pointer was taken) holds
    /// the memory too. One begun and ended since the take is not seen (see "Graph captures").
    fn drop(&mut self) {
        self.ask_stream();
        self.backend.end_lend(self.stream);
    }
}

impl<'a, T, D: Driver> StreamViewMut<'a, T, D> {
    pub(crate) fn new(view: StreamView<'a, T, D>) -> Self {
        Self {
            view,
            _lent: PhantomData,
        }
    }

    /// The device pointer, for writing on [`stream`](StreamView::stream) (see
    /// [`StreamView::device_ptr`]).
    pub fn device_ptr_mut(&mut self) -> u64 {
        self.view.use_for(true)
    }
}

impl<'a, T, D: Driver> std::ops::Deref for StreamViewMut<'a, T, D> {
    type Target = StreamView<'a, T, D>;

    fn deref(&self) -> &StreamView<'a, T, D> {
        &self.view
    }
}

impl<T, D: Driver> fmt::Debug for StreamView<'_, T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamView")
            .field("ptr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("stream", &format_args!("{:#x}", self.stream))
            .field("in_capture", &self.in_capture)
            .finish()
    }
}

impl<T, D: Driver> fmt::Debug for StreamViewMut<'_, T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("StreamViewMut").field(&self.view).finish()
    }
}

impl<D: Driver, S: Readable> Allocation<'_, '_, CudaBackend<D>, S> {
    /// The memory as `len() / size_of::<T>()` elements of `T`, read-only, for work on the raw
    /// `stream` (known to the device, [`Device::know_stream`](crate::Device::know_stream), or covered). Borrows the token.
    ///
    /// # Errors
    ///
    /// [`ViewError::Length`] or [`ViewError::Alignment`] if the memory is not whole `T`s,
    /// [`ViewError::Stream`] if the device neither knows nor covers `stream`.
    pub fn stream_view<T: Pod>(&self, stream: Stream) -> Result<StreamView<'_, T, D>, ViewError> {
        let backend = self.binding().device().backend().raw();
        StreamView::lend(backend, self.addr(), self.len(), stream, false)
    }
}

impl<D: Driver> Allocation<'_, '_, CudaBackend<D>, Committed> {
    /// The memory as elements of `T`, writable, for work on the raw `stream` (see
    /// [`stream_view`](Self::stream_view)). Borrows the token mutably.
    ///
    /// # Errors
    ///
    /// As for [`stream_view`](Self::stream_view).
    pub fn stream_view_mut<T: Pod>(
        &mut self,
        stream: Stream,
    ) -> Result<StreamViewMut<'_, T, D>, ViewError> {
        let backend = self.binding().device().backend().raw();
        StreamView::lend(backend, self.addr(), self.len(), stream, false).map(StreamViewMut::new)
    }
}

impl<D: Driver, K: Capability> Allocation<'_, '_, CudaBackend<D>, Owner<K>> {
    /// The prefix as elements of `T`, writable, for work on the raw `stream` — only while no
    /// sharer maps it (`None` otherwise), so the owner can compute its prefix on the device
    /// before sharing it (see [`stream_view`](Allocation::stream_view)). A sharer's mapping
    /// joins the prefix's memory in the order per memory: its views read after this view's
    /// last write. Borrows the prefix mutably.
    ///
    /// # Errors
    ///
    /// As for [`stream_view`](Allocation::stream_view).
    pub fn stream_view_mut<T: Pod>(
        &mut self,
        stream: Stream,
    ) -> Option<Result<StreamViewMut<'_, T, D>, ViewError>> {
        if !self.parts_mut().is_unique() {
            return None;
        }
        let backend = self.binding().device().backend().raw();
        let view = StreamView::lend(backend, self.addr(), self.len(), stream, false);
        Some(view.map(StreamViewMut::new))
    }
}

impl<D: Driver> Allocation<'_, '_, CudaBackend<D>, Elastic> {
    /// The region's committed part as elements of `T`, read-only, for work on the raw
    /// `stream` (see [`stream_view`](Allocation::stream_view)). Borrows the region, so it
    /// cannot shrink meanwhile.
    ///
    /// # Errors
    ///
    /// As for [`stream_view`](Allocation::stream_view).
    pub fn stream_view<T: Pod>(&self, stream: Stream) -> Result<StreamView<'_, T, D>, ViewError> {
        let backend = self.binding().device().backend().raw();
        StreamView::lend(backend, self.addr(), self.committed_len(), stream, false)
    }

    /// The region's committed part as elements of `T`, writable, for work on the raw
    /// `stream`. Borrows the region mutably.
    ///
    /// # Errors
    ///
    /// As for [`stream_view`](Allocation::stream_view).
    pub fn stream_view_mut<T: Pod>(
        &mut self,
        stream: Stream,
    ) -> Result<StreamViewMut<'_, T, D>, ViewError> {
        let backend = self.binding().device().backend().raw();
        StreamView::lend(backend, self.addr(), self.committed_len(), stream, false)
            .map(StreamViewMut::new)
    }
}
