//! One granule's cycle — reserve, commit, release, complete — with tokens and by hand with the
//! same backend calls: measured by `benches/hot_paths.rs`, counted by `examples/granule_cycle.rs`.

use memtoken::Binding;
use memtoken::backend::{Access, Backend};
use std::hint::black_box;

#[inline(always)]
pub fn once_memtoken<B: Backend>(binding: &Binding<'_, '_, B>, len: usize) {
    let a = binding.reserve(black_box(len)).unwrap();
    let a = a.commit().unwrap();
    black_box(a.addr());
    black_box(a.release().complete().unwrap());
}

#[inline(always)]
pub fn once_raw<B: Backend>(raw: &B, len: usize) {
    let len = black_box(len);
    let addr = raw.reserve(len).unwrap();
    let phys = raw.create(len).unwrap();
    raw.map(addr, len, phys, Access::ReadWrite).unwrap();
    black_box(addr);
    let fence = raw.fence();
    assert!(raw.fence_done(&fence));
    raw.retire_fence(fence);
    raw.unmap(addr, len).unwrap();
    raw.release(phys, len).unwrap();
    raw.free(addr, len).unwrap();
}
