// A page's slice cannot be kept across the copy-on-write that replaces the page.
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
    let fork = pool.fork(&table);
    let old = table.page(0);
    pool.copy_on_write(&mut table, 0).unwrap();
    println!("{} {}", old[0], fork.len());
}
