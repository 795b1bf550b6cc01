// A block table's ids change only through its cache (`push`, `clear`, `fork`, `share`,
// `copy_on_write`, a prefix-cache hit): code outside the crate cannot write one — the cache's
// counts per block, and its unchecked reads of them, rely on every id in a table being one it
// handed out.
use memtoken::backend::HostBackend;
use memtoken::kv::{KvCache, Layout};
use memtoken::{make_guard, Budget, Device};

fn main() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(4096)).unwrap();
    let mut table = cache.table();
    table.ids_mut().push(1 << 30); // error: `ids_mut` is private
}
