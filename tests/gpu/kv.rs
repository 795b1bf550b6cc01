//! The KV cache on a real GPU: a PTX kernel (`tests/kernels/kv_gather.ptx`) reads blocks by id
//! from the planes' base addresses — `base + id × stride`, the index function of the reference
//! decode in `tests/it/kv_attention.rs` — and gathers exactly the bytes written through the
//! block tables.

use super::shared;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use memtoken::kv::{KvCache, Layout};
use memtoken::{Budget, Device, make_guard};

const KV_GATHER: &str = include_str!("../kernels/kv_gather.ptx");

/// The bytes the test writes into block `position` of a table in plane `plane`.
fn pattern(plane: usize, position: usize, bytes: usize) -> Vec<u8> {
    (0..bytes / 4)
        .flat_map(|j| ((plane << 24 | position << 16) as u32 + j as u32).to_ne_bytes())
        .collect()
}

fn gpu_a_kernel_reads_kv_blocks_by_id_from_the_planes() {
    let test = "gpu_a_kernel_reads_kv_blocks_by_id_from_the_planes";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    // Two planes that differ: 64 KiB blocks, and 32 KiB blocks 64 KiB apart.
    let layout = Layout::new(512, 16)
        .plane(64 << 10)
        .plane_with_stride(32 << 10, 64 << 10);
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.set_watermarks(2, 4);
    cache.replenish().unwrap();
    // Two sequences taking blocks in turn: each table's ids are scattered.
    let (mut a, mut b) = (cache.table(), cache.table());
    for _ in 0..6 {
        cache.push(&mut a).unwrap();
        cache.push(&mut b).unwrap();
    }
    for (p, plane) in layout.planes().iter().enumerate() {
        for position in 0..a.len() {
            a.write(p, position, 0, &pattern(p, position, plane.block_bytes))
                .unwrap();
        }
    }
    let module = ctx.load_module(Ptx::from_src(KV_GATHER)).unwrap();
    let gather = module.load_function("kv_gather").unwrap();
    let stream = ctx.default_stream(); // the legacy stream, which the cache's fences cover
    let ids: Vec<u8> = a.ids_i32().iter().flat_map(|id| id.to_ne_bytes()).collect();
    let mut ids_dev = binding.reserve(ids.len()).unwrap().commit().unwrap();
    ids_dev.copy_from_host(0, &ids).unwrap();
    for (p, plane) in layout.planes().iter().enumerate() {
        let total = a.len() * plane.block_bytes;
        let out = binding.reserve(total).unwrap().commit().unwrap();
        let (base, idsp, stride) = (
            cache.base(p) as u64,
            ids_dev.device_ptr(),
            plane.stride as u64,
        );
        let (words, n, outp) = (
            (plane.block_bytes / 4) as u32,
            (total / 4) as u32,
            out.device_ptr(),
        );
        let mut launch = stream.launch_builder(&gather);
        launch
            .arg(&base)
            .arg(&idsp)
            .arg(&stride)
            .arg(&words)
            .arg(&n)
            .arg(&outp);
        // SAFETY: the kernel reads `a.len()` ids at `idsp` (a committed allocation of as many
        // i32), and for each one `block_bytes` bytes at `base + id × stride` — blocks the table
        // `a` holds, mapped while it holds them, beyond this launch's fence (the cache unmaps
        // nothing before `replenish`, and the table outlives the copy below, which waits on the
        // legacy stream) — and writes `total` bytes at `outp`, a committed allocation of `total`.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
        let mut got = vec![0; total];
        out.copy_to_host(0, &mut got).unwrap(); // synchronous on the legacy stream
        for (position, block) in got.chunks_exact(plane.block_bytes).enumerate() {
            assert!(
                block == pattern(p, position, plane.block_bytes),
                "plane {p}, position {position} (block {}): the kernel read other bytes",
                a.ids()[position]
            );
        }
    }
    drop((a, b));
    cache.replenish().unwrap();
    drop(ids_dev);
    drop(cache);
    while device.poll().deferred > 0 {
        std::thread::yield_now();
    }
    drop(binding);
    assert!(device.close().is_clean());
}

/// The tests of this file, by name.
pub(crate) const TESTS: &[(&str, fn())] =
    tests![gpu_a_kernel_reads_kv_blocks_by_id_from_the_planes];
