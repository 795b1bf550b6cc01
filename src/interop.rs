//! CUDA interop: a committed CUDA allocation as device memory for `cudarc` and kernels.
//!
//! Host slices are for host memory only: a CUDA token has no `as_slice`.
//!
//! ```compile_fail,E0599
//! use memtoken::{make_guard, Budget, Device};
//! use memtoken::backend::cuda::{CudaBackend, DriverModel};
//! make_guard!(guard);
//! let device = Device::new(guard, CudaBackend::new(DriverModel::default(), 0).unwrap());
//! let binding = device.bind(Budget::unlimited()).unwrap();
//! let gpu = binding.reserve(1).unwrap().commit().unwrap();
//! let bytes: &[u8] = gpu.as_slice(); // device memory is not a host slice
//! ```

use crate::allocation::Allocation;
use crate::backend::BackendError;
use crate::backend::cuda::{CudaBackend, Driver};
use crate::state::Committed;

impl<D: Driver> Allocation<'_, '_, CudaBackend<D>, Committed> {
    /// The device pointer (`CUdeviceptr`), to pass as a kernel argument or to `cudarc`'s raw
    /// copy functions. Valid while this token is borrowed.
    pub fn device_ptr(&self) -> u64 {
        self.addr() as u64
    }

    /// Copies `src` from the host to the start of this allocation.
    ///
    /// # Errors
    ///
    /// The driver's error.
    ///
    /// # Panics
    ///
    /// If `src` is longer than the allocation.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<(), BackendError> {
        assert!(
            src.len() <= self.size(),
            "{} bytes do not fit in {}",
            src.len(),
            self.size()
        );
        let backend = self.binding().device().backend();
        backend.copy_from_host(self.addr(), src)
    }

    /// Copies the start of this allocation to `dst` on the host.
    ///
    /// # Errors
    ///
    /// The driver's error.
    ///
    /// # Panics
    ///
    /// If `dst` is longer than the allocation.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), BackendError> {
        assert!(
            dst.len() <= self.size(),
            "{} bytes do not fit in {}",
            dst.len(),
            self.size()
        );
        let backend = self.binding().device().backend();
        backend.copy_to_host(dst, self.addr())
    }
}
