// A prefix of device A cannot be mapped into a reservation of device B: the brands `'ida` and
// `'idb` differ, and a brand is invariant.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Allocation, sharing::Prefix, Reserved};

fn share<'pa, 'ida, 'rb, 'idb>(
    prefix_a: &Prefix<'pa, 'ida, SimBackend>,
    reserved_b: Allocation<'rb, 'idb, SimBackend, Reserved>,
) {
    let _ = reserved_b.map_prefix(prefix_a);
}

fn main() {}
