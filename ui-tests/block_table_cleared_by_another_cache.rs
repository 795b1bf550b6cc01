// Each KV cache has its own brand: a table of cache A cannot be cleared into cache B.
use memtoken::backend::doubles::SimBackend;
use memtoken::kv::{BlockTable, KvCache};

fn clear<'ca, 'cb, 'b, 'id>(
    table_of_a: &mut BlockTable<'_, 'ca, 'b, 'id, SimBackend>,
    cache_b: &KvCache<'cb, 'b, 'id, SimBackend>,
) {
    cache_b.clear(table_of_a);
}

fn main() {}
