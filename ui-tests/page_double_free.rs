// Freeing a page consumes it: it cannot be freed twice.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, PagePool, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let page = pool.alloc().unwrap();
    pool.free(page);
    pool.free(page);
}
