// Each pool has its own brand: a page of pool A cannot be returned to pool B.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Page, PagePool};

fn give_back<'pa, 'pb, 'b, 'id>(
    page_of_a: Page<'_, 'pa, 'b, 'id, SimBackend>,
    pool_b: &PagePool<'pb, 'b, 'id, SimBackend>,
) {
    pool_b.free(page_of_a);
}

fn main() {}
