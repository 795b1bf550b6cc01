// A shared page borrows its pool: the pool cannot be dropped while the page lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, PagePool, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    let page = pool.share(&table, 0);
    drop(table);
    drop(pool);
    drop(page);
}
