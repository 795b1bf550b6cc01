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
    /// backend records covers it (see [`CudaBackend::cover_stream`]). Typed views do this for
    /// the streams they are used on; this is the way for raw pointers.
    ///
    /// # Safety
    ///
    /// As for [`CudaBackend::cover_stream`]: `stream` is 0 or a live stream of the device's
    /// context, and stays live until the device is dropped.
    pub unsafe fn cover_stream(&self, stream: Stream) {
        // SAFETY: the caller's promise is the one `cover_stream` asks for.
        unsafe { self.backend().raw().cover_stream(stream) }
    }

    /// Declares that work of a peer device may use this device's memory until the guard
    /// drops: meanwhile every release waits (see [`CudaBackend::peer_work`]).
    pub fn peer_work(&self) -> crate::backend::cuda::PeerWork<'_, D> {
        self.backend().raw().peer_work()
    }
}

#[cfg(feature = "cuda")]
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
}
