//! Stream covering (CUDA): a device's releases wait for the work on the streams it is told
//! about — raw `CUstream`s for raw pointers, cudarc streams for everything else. The typed
//! views (`DeviceView`, `DeviceViewMut`, feature `cuda`) cover their own streams; these are the
//! ways for raw users. The one place a [`Device`] meets a concrete backend.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

#[cfg(feature = "cuda")]
use crate::backend::BackendError;
#[cfg(feature = "cuda")]
use crate::backend::cuda::SysDriver;
use crate::backend::cuda::{CudaBackend, Driver, Stream};
use crate::device::Device;

impl<D: Driver> Device<'_, CudaBackend<D>> {
    /// Releases from now on wait for the work on `stream` too: every fence the device's
    /// backend records covers it (see [`CudaBackend::cover_stream`]) — the way for raw
    /// pointers, whose memory memtoken cannot tell. For typed views,
    /// [`know_stream`](Self::know_stream) is enough, and keeps fences small.
    ///
    /// # Safety
    ///
    /// As for [`CudaBackend::cover_stream`]: `stream` is 0 or a live stream of the device's
    /// context, and stays live until [`forget_stream`](Self::forget_stream) answers `true`
    /// for it or the device is dropped.
    pub unsafe fn cover_stream(&self, stream: Stream) {
        // SAFETY: the caller's promise is the one `cover_stream` asks for.
        unsafe { self.backend().raw().cover_stream(stream) }
    }

    /// Lets typed views ([`StreamView`](crate::interop::StreamView)) be made for `stream`, whose work
    /// a release then waits for only where a view used the released memory there (see
    /// [`CudaBackend::know_stream`]): fences stay as small as the streams that touched the
    /// memory. Give it back with [`forget_stream`](Self::forget_stream) before destroying it.
    ///
    /// # Safety
    ///
    /// As for [`CudaBackend::know_stream`]: `stream` is a live stream of the device's context,
    /// and stays live until `forget_stream(stream)` answers `true` or the device is dropped.
    pub unsafe fn know_stream(&self, stream: Stream) {
        // SAFETY: the caller's promise is the one `know_stream` asks for.
        unsafe { self.backend().raw().know_stream(stream) }
    }

    /// Lets a covered or known `stream` go once its work so far has completed; never waits
    /// (`false`: ask again later). See [`CudaBackend::forget_stream`].
    pub fn forget_stream(&self, stream: Stream) -> bool {
        self.backend().raw().forget_stream(stream)
    }

    /// The streams every fence covers, the legacy stream first, and the streams views may be
    /// made for that are not covered: what the device holds (and may still name in a driver
    /// call) now.
    pub fn streams(&self) -> (Vec<Stream>, Vec<Stream>) {
        let raw = self.backend().raw();
        (raw.covered_streams(), raw.known_streams())
    }

    /// Declares that work of a peer device may use this device's memory until the guard
    /// drops: meanwhile every release waits (see [`CudaBackend::peer_work`]).
    pub fn peer_work(&self) -> crate::backend::cuda::PeerWork<'_, D> {
        self.backend().raw().peer_work()
    }
}

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
impl Device<'_, CudaBackend<SysDriver>> {
    /// Releases from now on wait for the work on the cudarc `stream` too (see
    /// [`CudaBackend::cover`]); the device keeps the stream alive meanwhile.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`](crate::backend::Cause::Violation) if the stream belongs to another
    /// context.
    pub fn cover(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        self.backend().raw().cover(stream)
    }

    /// Lets views be made for the cudarc `stream`, fenced only for the memory they use there
    /// (see [`CudaBackend::know`]); the device keeps the stream alive meanwhile, and lets it
    /// go once its owner has and its work has completed. Views do this for their own stream;
    /// a view used on another stream needs that stream known (or covered) first.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`](crate::backend::Cause::Violation) if the stream belongs to another
    /// context.
    pub fn know(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        self.backend().raw().know(stream)
    }
}
