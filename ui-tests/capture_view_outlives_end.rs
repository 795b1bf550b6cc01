// A view a capture lends borrows the capture: none is left once the capture ends, so its
// pointer cannot be taken (unchecked) for a capture memtoken did not make.
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
    let mut x = binding.reserve(1 << 21).unwrap().commit().unwrap();
    let capture = Capture::begin(&device, stream, CaptureMode::Global).unwrap();
    let mut view = capture.view_mut::<f32>(&mut x).unwrap();
    let graph = capture.end().unwrap(); // error: `capture` is borrowed by the view
    let _later = view.device_ptr_mut();
    drop(graph);
}
