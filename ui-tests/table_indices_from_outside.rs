// A table's page indices are the pool's to change: `Table::pages_mut` takes an argument that
// only memtoken can make, so no caller can put an index its table does not hold in it.
use memtoken::backend::HostBackend;
use memtoken::{Budget, Device, PagePool, Table, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let mut table = pool.table();
    let inside = memtoken::page_pool::shared::sealed::Inside(());
    table.pages_mut(inside).push(u32::MAX);
}
