// An imported prefix is another process's memory, mapped read-only: it lends `&[u8]`, never
// `&mut [u8]`.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, sharing::Offer, make_guard};
use std::os::unix::net::UnixStream;

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (_peer, socket) = UnixStream::pair().unwrap();
    let mut imported = binding.import(Offer::recv(&socket).unwrap()).unwrap();
    imported.as_mut_slice()[0] = 1;
}
