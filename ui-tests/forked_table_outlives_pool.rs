// A fork borrows its pool: the pool cannot be dropped while the fork lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, PagePool, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let table = pool.shared_table();
    let fork = pool.fork(&table);
    drop(table);
    drop(pool);
    drop(fork);
}
