// Each KV cache has its own brand: a table of cache A cannot take blocks of cache B.
use memtoken::backend::doubles::SimBackend;
use memtoken::kv::{BlockTable, KvCache};

fn push<'ca, 'cb, 'b, 'id>(
    table_of_a: &mut BlockTable<'_, 'ca, 'b, 'id, SimBackend>,
    cache_b: &KvCache<'cb, 'b, 'id, SimBackend>,
) {
    cache_b.push(table_of_a).unwrap();
}

fn main() {}
