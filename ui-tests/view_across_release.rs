// A typed device view borrows its token: the token cannot be released while the view is used.
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
    let view = x.view::<f32>(&stream).unwrap();
    let _releasing = x.release();
    let _back = stream.clone_dtoh(&view);
}
