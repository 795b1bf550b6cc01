// An export holds a reference on the prefix's memory, and borrows its binding like any token:
// the binding cannot be dropped while the export is outstanding.
use memtoken::backend::{HostBackend, PosixFd};
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding
        .reserve(4096)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    let export = prefix.export().unwrap();
    drop(prefix);
    drop(binding);
    drop(export);
}
