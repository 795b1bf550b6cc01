//! The cudarc streams the backend keeps alive (feature `cuda`): covered or known through
//! [`cover`](CudaBackend::cover) and [`know`](CudaBackend::know), and let go once their owners
//! have let go of theirs and their work has completed.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaBackend;
use super::driver::{Context, Driver, Stream};
use super::sys::SysDriver;
use crate::backend::{BackendError, Op, Violation, lock};

impl<D: Driver> CudaBackend<D> {
    /// Lets go the cudarc streams the backend keeps alive whose owners let theirs go (the
    /// backend's handle is the last) once the work submitted there has completed
    /// ([`forget_stream`](Self::forget_stream)); cudarc destroys each then.
    pub(super) fn let_go_streams(&self) {
        let orphans: Vec<Stream> = lock(&self.kept)
            .streams
            .iter()
            .filter(|k| std::sync::Arc::strong_count(k) == 1)
            .map(|k| k.cu_stream() as Stream)
            .collect();
        for handle in orphans {
            if self.forget_stream(handle) {
                lock(&self.kept)
                    .streams
                    .retain(|k| k.cu_stream() as Stream != handle);
            }
        }
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
impl CudaBackend<SysDriver> {
    /// Makes every fence recorded from now on cover the cudarc `stream` (see
    /// [`cover_stream`](Self::cover_stream)); the backend keeps the stream alive meanwhile,
    /// and lets it go once its owner has let go of it and its work has completed.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`](crate::backend::Cause::Violation) if the stream belongs to another context.
    pub fn cover(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        let handle = self.keep(stream)?;
        // SAFETY: the stream belongs to this backend's context (`keep` checked) and lives
        // until it is forgotten or the backend drops: the backend holds an `Arc` of it until
        // then (`let_go_streams` drops it only once `forget_stream` answered `true`).
        unsafe { self.cover_stream(handle) };
        Ok(())
    }

    /// Lets typed views be made for the cudarc `stream` (see
    /// [`know_stream`](Self::know_stream)): a release waits for the work there only where a
    /// view used the released memory on it. The backend keeps the stream alive meanwhile, and
    /// lets it go once its owner has let go of it and its work has completed.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`](crate::backend::Cause::Violation) if the stream belongs to another context.
    pub fn know(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        let handle = self.keep(stream)?;
        // SAFETY: as in `cover`.
        unsafe { self.know_stream(handle) };
        Ok(())
    }

    /// Keeps an `Arc` of `stream` (once), after checking it is of this backend's context; its
    /// handle.
    fn keep(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<Stream, BackendError> {
        if stream.context().cu_ctx() as Context != self.ctx {
            let v = Violation::ForeignStream;
            return Err(BackendError::refused(Op::Fence, 0, 0, v));
        }
        let handle = stream.cu_stream() as Stream;
        if handle != 0 {
            let mut kept = lock(&self.kept);
            if !kept
                .streams
                .iter()
                .any(|k| k.cu_stream() as Stream == handle)
            {
                kept.streams.push(std::sync::Arc::clone(stream));
            }
        }
        Ok(handle)
    }
}
