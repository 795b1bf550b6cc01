// A graph captured through memtoken borrows the memory it uses: shrinking a region a live captured graph uses does not compile
// while the graph can still be launched.
use memtoken::backend::cuda::{CaptureMode, CudaBackend};
use memtoken::backend::doubles::DriverModel;
use memtoken::{Budget, interop::Capture, Device, make_guard};

fn main() {
    make_guard!(guard);
    let model = DriverModel::default();
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let stream = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(stream) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 << 21).unwrap().into_region();
    region.grow(2).unwrap();
    let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
    let mut view = capture.region_view_mut::<u8>(&mut region).unwrap();
    model.submit_work_touching(stream, &[(view.device_ptr_mut(), 2 << 21)]);
    drop(view);
    let graph = capture.end().unwrap();
    let _shrunk = region.shrink(1); // error: `region` is borrowed by the graph
    graph.launch().unwrap();
}
