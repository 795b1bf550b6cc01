//! One elastic region's cycle — grow by [`GRANULES`] granules, shrink back to none — with a
//! `memtoken::region::Region` and by hand ([`RawRegion`]: the same backend calls, with a hand-written
//! free list of physical granules in place of the device's cache, and no tokens, ledger or
//! budgets): measured by `benches/hot_paths.rs`, counted by `examples/region_cycle.rs`.
//!
//! In steady state both sides reuse their cached granules: a cycle makes `GRANULES` maps and
//! `GRANULES` unmaps and no create or release ([`check_steady_state`] checks this).
#![allow(dead_code)]

use memtoken::backend::{Access, Addr, Backend, BackendError, HostBackend, Op, doubles::Faulty};
use memtoken::{Binding, Budget, Device, make_guard, region::Region};
use std::hint::black_box;

/// Granules a cycle grows the region by, and shrinks it by.
pub const GRANULES: usize = 16;

/// Granules the hand-written free list keeps at most: the device cache's default cap.
pub const RAW_CACHE_GRANULES: usize = 64;

/// An elastic region by hand: one reserved range whose committed part grows and shrinks by
/// granules at its tail, each granule a physical allocation of its own, taken from (and given
/// back to) a free list of physical granules before any is created (or released).
pub struct RawRegion<'a, B: Backend> {
    backend: &'a B,
    granule: usize,
    addr: Addr,
    len: usize,
    /// The committed granules, from the start of the range.
    committed: Vec<B::Phys>,
    /// Physical granules mapped nowhere, ready for reuse.
    free: Vec<B::Phys>,
    free_cap: usize,
}

impl<'a, B: Backend> RawRegion<'a, B> {
    /// Reserves `granules` granules of VA, nothing committed; the free list keeps at most
    /// `free_cap` granules.
    pub fn new(backend: &'a B, granules: usize, free_cap: usize) -> Result<Self, BackendError> {
        let granule = backend.granularity();
        let len = granules * granule;
        let addr = backend.reserve(len)?;
        Ok(Self {
            backend,
            granule,
            addr,
            len,
            committed: Vec::with_capacity(granules),
            free: Vec::with_capacity(free_cap),
            free_cap,
        })
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    pub fn committed_granules(&self) -> usize {
        self.committed.len()
    }

    pub fn free_granules(&self) -> usize {
        self.free.len()
    }

    /// Maps `n` more granules at the tail, each from the free list if it has one, else created.
    /// Not all-or-nothing: on an error the granules mapped so far stay committed.
    #[inline]
    pub fn grow(&mut self, n: usize) -> Result<(), BackendError> {
        let g = self.granule;
        assert!(n <= self.len / g - self.committed.len(), "past the range");
        for _ in 0..n {
            let phys = match self.free.pop() {
                Some(phys) => phys,
                None => self.backend.create(g)?,
            };
            let at = self.addr + self.committed.len() * g;
            if let Err(e) = self.backend.map(at, g, phys, Access::ReadWrite) {
                self.free.push(phys);
                return Err(e);
            }
            self.committed.push(phys);
        }
        Ok(())
    }

    /// Unmaps `n` granules at the tail — not while work may still use them (the fence memtoken
    /// checks too) — and puts them on the free list, or releases them once it is full.
    #[inline]
    pub fn shrink(&mut self, n: usize) -> Result<(), BackendError> {
        assert!(n <= self.committed.len(), "more than committed");
        let fence = self.backend.fence();
        let idle = self.backend.fence_done(&fence);
        self.backend.retire_fence(fence);
        assert!(idle, "work still running");
        let g = self.granule;
        for _ in 0..n {
            let phys = *self.committed.last().expect("a committed granule");
            let at = self.addr + (self.committed.len() - 1) * g;
            self.backend.unmap(at, g)?;
            self.committed.pop();
            if self.free.len() < self.free_cap {
                self.free.push(phys);
            } else {
                self.backend.release(phys, g)?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> Drop for RawRegion<'_, B> {
    fn drop(&mut self) {
        let g = self.granule;
        let _ = self.shrink(self.committed.len());
        for phys in self.free.drain(..) {
            let _ = self.backend.release(phys, g);
        }
        let _ = self.backend.free(self.addr, self.len);
    }
}

/// One cycle with tokens: grow by `n` granules, shrink back.
#[inline(always)]
pub fn once_memtoken<B: Backend>(region: &mut Region<'_, '_, B>, n: usize) {
    let n = black_box(n);
    region.grow(n).unwrap();
    black_box(region.addr());
    region.shrink(n).unwrap();
}

/// One cycle by hand: the same backend calls.
#[inline(always)]
pub fn once_raw<B: Backend>(raw: &mut RawRegion<'_, B>, n: usize) {
    let n = black_box(n);
    raw.grow(n).unwrap();
    black_box(raw.addr());
    raw.shrink(n).unwrap();
}

/// A region of [`GRANULES`] granules on `binding`, warmed up: after one cycle the device's
/// cache holds its granules, and further cycles create and release nothing.
pub fn warm_region<'b, 'id, B: Backend>(binding: &'b Binding<'b, 'id, B>) -> Region<'b, 'id, B> {
    let device = binding.device();
    let g = device.granularity();
    assert!(
        device.cache_cap() >= (GRANULES * g) as u64,
        "the cache holds a cycle"
    );
    let mut region = binding.reserve(GRANULES * g).unwrap().into_region();
    once_memtoken(&mut region, GRANULES);
    let owned = device.ledger().owned_bytes;
    once_memtoken(&mut region, GRANULES);
    assert_eq!(
        device.cached_bytes(),
        (GRANULES * g) as u64,
        "granules cached"
    );
    assert_eq!(device.ledger().owned_bytes, owned, "nothing created");
    region
}

/// A hand-written region of [`GRANULES`] granules on `backend`, warmed up likewise.
pub fn warm_raw<B: Backend>(backend: &B) -> RawRegion<'_, B> {
    let mut raw = RawRegion::new(backend, GRANULES, RAW_CACHE_GRANULES).unwrap();
    once_raw(&mut raw, GRANULES);
    once_raw(&mut raw, GRANULES);
    assert_eq!(raw.free_granules(), GRANULES, "granules on the free list");
    raw
}

/// Checks, on `Faulty` host backends' call counters, that both sides' cycles after warm-up
/// make no create or release call, and the same maps and unmaps (`GRANULES` each per cycle).
/// Run before measuring, never while.
pub fn check_steady_state() {
    const CYCLES: u64 = 50;
    let calls = |h: &memtoken::backend::doubles::FaultHandle| {
        [Op::Create, Op::Release, Op::Map, Op::Unmap].map(|op| h.calls(op))
    };
    let delta = |a: [u64; 4], b: [u64; 4]| [0, 1, 2, 3].map(|i| b[i] - a[i]);
    let expected = [0, 0, CYCLES * GRANULES as u64, CYCLES * GRANULES as u64];

    make_guard!(guard);
    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
    let handle = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = warm_region(&binding);
    let before = calls(&handle);
    for _ in 0..CYCLES {
        once_memtoken(&mut region, GRANULES);
    }
    assert_eq!(
        delta(before, calls(&handle)),
        expected,
        "memtoken: create, release, map, unmap"
    );
    region.release().complete().unwrap();

    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
    let handle = backend.handle();
    let mut raw = warm_raw(&backend);
    let before = calls(&handle);
    for _ in 0..CYCLES {
        once_raw(&mut raw, GRANULES);
    }
    assert_eq!(
        delta(before, calls(&handle)),
        expected,
        "raw: create, release, map, unmap"
    );
    drop(raw);
    assert!(handle.outstanding().is_zero(), "{:?}", handle.outstanding());
}
