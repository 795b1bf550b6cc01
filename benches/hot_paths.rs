//! Hot paths, each measured side by side in one run against the hand-written equivalent on the
//! same backend: the zero-cost claim is the ratio `memtoken / raw`.
//!
//! `granule_cycle`: reserve, commit (create + map read-write), release (unmap + release + free)
//! one 4 KiB granule on the host backend — with tokens, and as the same backend calls by hand.

use criterion::{Criterion, criterion_group, criterion_main};
use memtoken::backend::{Access, Backend, HostBackend};
use memtoken::{Budget, Device, make_guard};
use std::hint::black_box;

const GRANULE: usize = 4096;

fn granule_cycle(c: &mut Criterion) {
    let mut group = c.benchmark_group("granule_cycle");

    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().expect("memfd"));
    let binding = device.bind(Budget::unlimited()).expect("pin");
    group.bench_function("memtoken", |b| {
        b.iter(|| {
            let a = binding.reserve(black_box(GRANULE)).unwrap();
            let a = a.commit().unwrap();
            black_box(a.addr());
            black_box(a.release().complete().unwrap());
        })
    });

    let raw = HostBackend::with_defaults().expect("memfd");
    group.bench_function("raw", |b| {
        b.iter(|| {
            let len = black_box(GRANULE);
            let addr = raw.reserve(len).unwrap();
            let phys = raw.create(len).unwrap();
            raw.map(addr, len, phys, 0, Access::ReadWrite).unwrap();
            black_box(addr);
            raw.unmap(addr, len).unwrap();
            raw.release(phys, len).unwrap();
            raw.free(addr, len).unwrap();
        })
    });
    group.finish();
}

criterion_group!(benches, granule_cycle);
criterion_main!(benches);
