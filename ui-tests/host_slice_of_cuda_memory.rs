// Device memory is not host memory: a CUDA token lends no `&[u8]` (only `HostVisible`
// backends do); its bytes are reached through copies or typed device views.
use memtoken::backend::{cuda::CudaBackend, doubles::DriverModel};
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(DriverModel::default(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let gpu = binding.reserve(1).unwrap().commit().unwrap();
    let bytes: &[u8] = gpu.as_slice();
    let _ = bytes;
}
