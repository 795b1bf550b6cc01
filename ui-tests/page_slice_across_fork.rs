// A writable page slice cannot be kept across a fork, which shares the page: the fork would
// read bytes the slice still writes.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, PagePool, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    let bytes = table.page_mut(0).unwrap();
    let fork = pool.fork(&table);
    bytes[0] = 1;
    drop(fork);
}
