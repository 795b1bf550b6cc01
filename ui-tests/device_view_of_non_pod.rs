// A device view reinterprets device bytes as `T`: only plain-old-data types, for which every
// bit pattern is a value, may be viewed (a `bool` view of arbitrary bytes would be undefined
// behaviour once copied to the host).
use cudarc::driver::CudaContext;
use memtoken::backend::cuda::CudaBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let device = Device::new(guard, CudaBackend::from_context(ctx.clone()).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
    let _flags = x.view::<bool>(&stream);
}
