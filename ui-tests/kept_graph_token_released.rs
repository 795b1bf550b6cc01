//! A token moved into a kept graph cannot be released (nor suspended, shrunk or read) while
//! the graph can launch: the graph owns it and lends nothing of it.
use memtoken::backend::cuda::{CaptureMode, CudaBackend};
use memtoken::backend::doubles::DriverModel;
use memtoken::{make_guard, Budget, Device, interop::OwningGraph};

fn main() {
    make_guard!(guard);
    let model = DriverModel::default();
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let stream = model.new_stream();
    // SAFETY: a stream of the model's only context, live as long as the model.
    unsafe { device.cover_stream(stream) };
    let binding = device.bind(Budget::unlimited()).unwrap();
    let x = binding.reserve(1 << 21).unwrap().commit().unwrap();
    let graph = OwningGraph::capture(&device, stream, CaptureMode::Global, x, |capture, x| {
        let mut view = capture.view_mut::<u8>(x)?;
        model.submit_work_touching(stream, &[(view.device_ptr_mut(), 1 << 21)]);
        Ok(())
    })
    .unwrap();
    let _releasing = x.release(); // error: `x` was moved into the graph
    graph.launch().unwrap();
}
