//! Sleep and wake of one 64 MiB allocation with its bytes saved to the host and restored — with
//! tokens (`suspend_saving`, `resume`) and by hand with the same backend calls: measured by
//! `benches/hot_paths.rs`, counted by `examples/sleep_wake.rs`.

use memtoken::backend::{Access, Addr, Backend, HostBackend, HostConfig};
use memtoken::{Allocation, Committed};
use std::hint::black_box;

/// The bytes parked and woken.
pub const LEN: usize = 64 << 20;

/// A host backend with room for the allocation (and its twin while it is woken).
pub fn backend() -> HostBackend {
    HostBackend::new(HostConfig {
        physical_capacity: 4 * LEN as u64,
        ..HostConfig::default()
    })
    .unwrap()
}

/// Suspends `a` with its bytes saved, and resumes it at the same address with its bytes.
#[inline(always)]
pub fn once_memtoken<'b, 'id, B: Backend>(
    a: Allocation<'b, 'id, B, Committed>,
) -> Allocation<'b, 'id, B, Committed> {
    let asleep = a.suspend_saving().unwrap();
    black_box(asleep.addr());
    asleep.resume().unwrap()
}

/// The same by hand: check that no work runs, save the bytes, unmap, release; then create,
/// map at the same address, restore the bytes.
#[inline(always)]
pub fn once_raw<B: Backend>(raw: &B, addr: Addr, phys: B::Phys) -> B::Phys {
    let fence = raw.fence();
    assert!(raw.fence_done(&fence));
    raw.retire_fence(fence);
    let mut saved = vec![0; LEN].into_boxed_slice();
    raw.copy_to_host(&mut saved, addr).unwrap();
    raw.unmap(addr, LEN).unwrap();
    raw.release(phys, LEN).unwrap();
    black_box(addr);
    let phys = raw.create(LEN).unwrap();
    raw.map(addr, LEN, phys, Access::ReadWrite).unwrap();
    raw.copy_from_host(addr, &saved).unwrap();
    phys
}

/// A committed range by hand, filled with `byte`: (address, physical memory).
pub fn raw_committed<B: Backend>(raw: &B, byte: u8) -> (Addr, B::Phys) {
    let addr = raw.reserve(LEN).unwrap();
    let phys = raw.create(LEN).unwrap();
    raw.map(addr, LEN, phys, Access::ReadWrite).unwrap();
    raw.copy_from_host(addr, &vec![byte; LEN]).unwrap();
    (addr, phys)
}
