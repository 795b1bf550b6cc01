// A prefix made by `commit_prefix` was created for this process alone: the handle kinds it may
// be exported as are chosen when its memory is created, so it has no `export` method.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(4096).unwrap().commit_prefix().unwrap();
    let export = prefix.export();
}
