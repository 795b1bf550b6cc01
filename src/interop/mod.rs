//! Tokens as memory other code uses: the byte traits every backend's tokens implement
//! ([`Bytes`], [`BytesMut`]), and for CUDA, graph captures that borrow the memory they use
//! ([`Capture`], [`CapturedGraph`], [`OwningGraph`]), typed views of CUDA tokens for work on a
//! raw stream ([`StreamView`], [`StreamViewMut`]) and as cudarc device memory
//! ([`DeviceView`], [`DeviceViewMut`], feature `cuda`). Host tokens lend `&[T]` / `&mut [T]` of plain-old-data types
//! through their own methods (`as_slice_of`). Guide: [`guide::cuda`](crate::guide::cuda).
//!
//! Copies name their direction from the host's side, always: `copy_from_host` writes the
//! token's memory from host bytes, `copy_to_host` reads it into them; a copy of a part names
//! the part (`copy_boundary_from_host`).

mod capture;
#[cfg(feature = "cuda")]
mod device;
mod host;
mod stream_view;
mod streams;

pub(crate) use capture::Awake;
pub use capture::{Capture, CaptureError, CapturedGraph, GraphTokens, OwningGraph};
#[cfg(feature = "cuda")]
pub use device::{DeviceView, DeviceViewMut};
pub use stream_view::{StreamView, StreamViewMut};

use crate::allocation::Allocation;
use crate::backend::cuda::{CudaBackend, Driver};
use crate::backend::{Addr, Backend, BackendError};
use crate::error::ViewError;
use crate::region::Elastic;
use crate::sharing::{Capability, Diverged, Owner};
use crate::state::{Committed, Readable, State};
use crate::unwind::Scope;

/// A token's bytes as the host reads them, the same way on every backend: a copy on the host,
/// a driver copy on CUDA (ordered like any use of the memory). Implemented by every readable
/// allocation (committed, a prefix's owner, sharer or diverged mapping, an import) and by a
/// region (its committed part), so code generic over the backend — and over what holds the
/// bytes — reads them with one call:
///
/// ```
/// use memtoken::{Bytes, BytesMut};
///
/// /// `dst[i] += src[i]` for every byte: a "kernel step" written once for every backend.
/// fn add(src: &impl Bytes, dst: &mut impl BytesMut) -> Result<(), memtoken::Error> {
///     let mut a = vec![0u8; src.byte_len()];
///     let mut b = vec![0u8; dst.byte_len()];
///     src.copy_to_host(0, &mut a)?;
///     dst.copy_to_host(0, &mut b)?;
///     b.iter_mut().zip(&a).for_each(|(b, a)| *b = b.wrapping_add(*a));
///     dst.copy_from_host(0, &b)?;
///     Ok(())
/// }
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults()?);
/// # let binding = device.bind(Budget::unlimited())?;
/// # let g = device.granularity();
/// # let mut x = binding.reserve(g)?.commit()?;
/// # x.as_mut_slice().fill(2);
/// # let mut y = binding.reserve(g)?.commit()?;
/// # y.as_mut_slice().fill(3);
/// add(&x, &mut y)?;
/// # assert!(y.as_slice().iter().all(|&b| b == 5));
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
///
/// A KV cache's blocks move through their table (`kv::BlockTable`'s `write` and `read`: a
/// plane and a position, then the offset).
pub trait Bytes {
    /// How many bytes [`copy_to_host`](Self::copy_to_host) reaches: the token's length, a
    /// region's committed part.
    fn byte_len(&self) -> usize;

    /// Copies `dst.len()` bytes at `offset` to the host.
    ///
    /// # Errors
    ///
    /// The backend's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in [`byte_len`](Self::byte_len).
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), BackendError>;
}

/// A token's bytes as the host writes them, the same way on every backend (see [`Bytes`]):
/// a committed allocation and a region's committed part. Not what others may read at the same
/// time — a prefix's owner ([`Owner`]) writes with a `copy_from_host` of its own, which
/// refuses while a sharer maps it; a sharer and an import never write.
pub trait BytesMut: Bytes {
    /// Copies `src` from the host to `offset`.
    ///
    /// # Errors
    ///
    /// The backend's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in [`byte_len`](Bytes::byte_len).
    fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), BackendError>;
}

impl<B: Backend, S: Readable> Bytes for Allocation<'_, '_, B, S> {
    fn byte_len(&self) -> usize {
        self.len()
    }

    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        self.copy_to_host(offset, dst)
    }
}

impl<B: Backend> BytesMut for Allocation<'_, '_, B, Committed> {
    fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        self.copy_from_host(offset, src)
    }
}

impl<B: Backend> Bytes for Allocation<'_, '_, B, Elastic> {
    fn byte_len(&self) -> usize {
        self.committed_len()
    }

    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        self.copy_to_host(offset, dst)
    }
}

impl<B: Backend> BytesMut for Allocation<'_, '_, B, Elastic> {
    fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        self.copy_from_host(offset, src)
    }
}

/// How many `T`s the `bytes` bytes at `addr` hold, or why they cannot be viewed as `T`s.
/// The alignment is checked first, as `bytemuck` does for the host views.
fn fit<T>(addr: Addr, bytes: usize) -> Result<usize, ViewError> {
    let align = align_of::<T>();
    if !addr.is_multiple_of(align) {
        return Err(ViewError::Alignment { addr, align });
    }
    let size = size_of::<T>();
    if size == 0 || !bytes.is_multiple_of(size) {
        return Err(ViewError::Length { bytes, size });
    }
    Ok(bytes / size)
}

/// `[offset, offset + len)` inside a region of `size` bytes at `base`, or a panic.
fn within(base: Addr, size: usize, offset: usize, len: usize) -> Addr {
    assert!(
        offset.checked_add(len).is_some_and(|end| end <= size),
        "{len} bytes at offset {offset} do not fit in {size}"
    );
    base + offset
}

impl<D: Driver, S: State> Allocation<'_, '_, CudaBackend<D>, S> {
    /// The peer devices (`CUdevice`s) that get access to this token's memory along with its
    /// own device, in the same `cuMemSetAccess` call, at every map and remap: when it is
    /// committed, grown, diverged or woken (see [`CudaBackend::with_peers`]). Read-only where
    /// the token's own access is (a prefix sharer's mapping). Empty unless the backend was
    /// given peers.
    pub fn peers(&self) -> &[i32] {
        self.binding().device().backend().raw().peers()
    }
}

impl<B: Backend, S: Readable> Allocation<'_, '_, B, S> {
    /// Copies `dst.len()` bytes at `offset` into the memory to the host — on any backend (the
    /// host: a copy; CUDA: a driver copy, ordered like any use of the memory), so code generic
    /// over the backend reads a token's bytes with it.
    ///
    /// # Errors
    ///
    /// The backend's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the token.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        Scope::run::<B, _>(move || {
            let at = within(self.addr(), self.len(), offset, dst.len());
            self.binding().device().backend().copy_to_host(dst, at)
        })
    }
}

impl<D: Driver> Allocation<'_, '_, CudaBackend<D>, Committed> {
    /// The device pointer (`CUdeviceptr`), to pass as a kernel argument or to `cudarc`'s raw
    /// copy functions. Valid while this token is borrowed. (Only a committed allocation gives
    /// one: a prefix's bytes must not change while shared, and a raw pointer cannot say so.)
    ///
    /// The raw path: the token's release waits only for the streams the backend covers (the
    /// legacy stream always; others once covered, e.g. by `CudaBackend::cover`). With
    /// `CudaBackend<SysDriver>`, prefer the typed views (`view`, `view_mut`), which cover their
    /// stream and order their uses for cudarc.
    ///
    /// **Graph captures.** memtoken cannot see where this address goes: used in work captured by
    /// a capture memtoken did not make (cudarc's safe `begin_capture`), it is the `unsafe`
    /// kernel launch's obligation to keep the token alive while that graph can launch — or to
    /// capture through memtoken's `Capture`, whose graph borrows the token.
    pub fn device_ptr(&self) -> u64 {
        self.addr() as u64
    }
}

impl<B: Backend> Allocation<'_, '_, B, Committed> {
    /// Copies `src` from the host into the memory, at `offset` — on any backend (the host: a
    /// copy; CUDA: a driver copy, ordered like any use of the memory).
    ///
    /// # Errors
    ///
    /// The backend's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the allocation.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        Scope::run::<B, _>(move || {
            let at = within(self.addr(), self.len(), offset, src.len());
            self.binding().device().backend().copy_from_host(at, src)
        })
    }
}

impl<B: Backend, K: Capability> Allocation<'_, '_, B, Owner<K>> {
    /// Copies `src` from the host into the prefix, at `offset` — only while no sharer maps it
    /// (`None` otherwise), so a sharer never sees a byte change; the owner fills its prefix
    /// before sharing it. Else the driver's result.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the prefix.
    pub fn copy_from_host(
        &mut self,
        offset: usize,
        src: &[u8],
    ) -> Option<Result<(), BackendError>> {
        Scope::run::<B, _>(move || {
            if !self.parts_mut().is_unique() {
                return None;
            }
            let at = within(self.addr(), self.len(), offset, src.len());
            Some(self.binding().device().backend().copy_from_host(at, src))
        })
    }
}

impl<D: Driver> Allocation<'_, '_, CudaBackend<D>, Elastic> {
    /// The device pointer of the region's start, for kernel arguments: valid over the committed
    /// part ([`committed_len`](Allocation::committed_len)) while this region is borrowed. The
    /// raw path, as for a committed allocation's `device_ptr`: its release waits only for the
    /// streams the backend covers.
    ///
    /// **Graph captures.** memtoken cannot see where this address goes: used in work captured by
    /// a capture memtoken did not make (cudarc's safe `begin_capture`), it is the `unsafe`
    /// kernel launch's obligation to keep the token alive while that graph can launch — or to
    /// capture through memtoken's `Capture`, whose graph borrows the token.
    pub fn device_ptr(&self) -> u64 {
        self.addr() as u64
    }
}

impl<B: Backend> Allocation<'_, '_, B, Elastic> {
    /// Copies `dst.len()` bytes of the committed part at `offset` to the host (any backend).
    ///
    /// # Errors
    ///
    /// The driver's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the committed part.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        Scope::run::<B, _>(move || {
            let at = within(self.addr(), self.committed_len(), offset, dst.len());
            self.binding().device().backend().copy_to_host(dst, at)
        })
    }

    /// Copies `src` from the host into the committed part, at `offset` (any backend).
    ///
    /// # Errors
    ///
    /// The driver's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the committed part.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        Scope::run::<B, _>(move || {
            let at = within(self.addr(), self.committed_len(), offset, src.len());
            self.binding().device().backend().copy_from_host(at, src)
        })
    }
}

impl<B: Backend> Allocation<'_, '_, B, Diverged> {
    /// Copies `src` from the host into the private last granule, at `offset` into it.
    ///
    /// # Errors
    ///
    /// The driver's error.
    ///
    /// # Panics
    ///
    /// If the range does not fit in the granule.
    pub fn copy_boundary_from_host(
        &mut self,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        Scope::run::<B, _>(move || {
            let boundary = self.boundary_offset();
            let at = within(
                self.addr() + boundary,
                self.len() - boundary,
                offset,
                src.len(),
            );
            self.binding().device().backend().copy_from_host(at, src)
        })
    }
}
