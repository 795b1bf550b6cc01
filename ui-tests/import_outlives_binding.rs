// An imported prefix borrows the binding it was imported through, like any token: the binding
// cannot be dropped while the import lives.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, sharing::Offer, make_guard};
use std::os::unix::net::UnixStream;

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (_peer, socket) = UnixStream::pair().unwrap();
    let imported = binding.import(Offer::recv(&socket).unwrap()).unwrap();
    drop(binding);
    drop(imported);
}
