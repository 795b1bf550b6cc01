// A block table borrows its KV cache: the cache cannot be dropped while the table lives.
use memtoken::backend::doubles::SimBackend;
use memtoken::kv::{KvCache, Layout};
use memtoken::{Budget, Device, make_guard};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::default());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(1024)).unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    drop(cache);
    println!("{:?}", table.ids());
}
