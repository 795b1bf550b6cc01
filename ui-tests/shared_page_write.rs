// A shared page is read-only by type: another holder may read it, so it lends no `&mut`.
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
    let mut page = pool.share(&table, 0);
    page.as_mut_slice()[0] = 1;
}
