//! The GPU tests: each checks memtoken, or a driver rule it relies on, on a real CUDA device.
//! `main.rs` runs them, and only where a GPU answers (or `MEMTOKEN_REQUIRE_GPU=1` asks for
//! them); each opens the device itself and fails if it cannot.

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use memtoken::backend::Backend;
use memtoken::backend::cuda::{CudaBackend, CudaError, SysDriver};
use memtoken::{
    Allocation, Budget, Committed, Device, Released, Releasing, TransitionError,
    errors::ReleaseFailure, errors::Returned, errors::ViewError, make_guard,
};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

const AXPY: &str = include_str!("../../examples/kernels/axpy.ptx");
/// `axpy` that first spins for a given number of nanoseconds in every thread.
const SPIN_AXPY: &str = include_str!("../kernels/spin_axpy.ptx");

/// The tests that run on a device without virtual memory management too (the plain
/// mechanism's); every other one needs VMM.
pub(crate) const NO_VMM: &[&str] = &["gpu_plain_mechanism_commits_copies_and_frees"];

/// `(name, test)` pairs, the name as written.
macro_rules! tests {
    ($($test:ident),* $(,)?) => {
        &[$((stringify!($test), $test as fn())),*]
    };
}

/// The driver rules the backend relies on without a documented rule, each checked on the real
/// driver below the backend.
#[path = "assumptions.rs"]
pub(crate) mod assumptions;

/// The KV cache read by a kernel, by block id.
#[path = "kv.rs"]
pub(crate) mod kv;

/// The CUDA graph-capture rules the backend relies on, each checked on the real driver.
#[path = "captures.rs"]
pub(crate) mod captures;

/// The real device.
///
/// # Panics
///
/// When it cannot be opened (the runner runs these tests only where a GPU answered).
fn gpu(test: &str) -> CudaBackend<SysDriver> {
    usable(test, CudaBackend::open(0))
}

/// What `opened` opened.
///
/// # Panics
///
/// When `opened` failed: the runner found a GPU (or `MEMTOKEN_REQUIRE_GPU=1` asked for one),
/// so a test that cannot open it fails.
fn usable<T>(test: &str, opened: Result<T, CudaError>) -> T {
    opened.unwrap_or_else(|e| panic!("{test}: no usable GPU: {e}"))
}

/// Device 0's primary context and a backend sharing it ([`CudaBackend::from_context`]).
///
/// # Panics
///
/// As [`gpu`]; and if the context cannot be shared.
fn shared(test: &str) -> (Arc<CudaContext>, CudaBackend<SysDriver>) {
    // Opened by ordinal first: it says when there is no driver, where cudarc would panic. Kept
    // until the shared backend holds the context, so the context is not torn down between.
    let probe = gpu(test);
    let ctx = CudaContext::new(0).expect("cudarc opens device 0");
    let backend = CudaBackend::from_context(ctx.clone()).expect("the backend shares the context");
    drop(probe);
    (ctx, backend)
}

/// The `spin_axpy` kernel of [`SPIN_AXPY`], loaded into `ctx`. Kept by the test until its
/// kernels have finished: unloading a module while its kernel runs is not something to test.
fn spin_axpy(ctx: &Arc<CudaContext>) -> CudaFunction {
    let module = ctx.load_module(Ptx::from_src(SPIN_AXPY)).unwrap();
    module.load_function("spin_axpy").unwrap()
}

/// Launches `spin_axpy` on `stream`: after spinning for `spin`, each of the first `n` threads
/// does `y[i] = a * x[i] + y[i]`. The views' pointers are taken for `stream`, the stream the
/// kernel runs on.
fn launch_spin_axpy(
    f: &CudaFunction,
    stream: &Arc<CudaStream>,
    a: f32,
    x: &Allocation<'_, '_, CudaBackend<SysDriver>, Committed>,
    y: &mut Allocation<'_, '_, CudaBackend<SysDriver>, Committed>,
    n: usize,
    spin: Duration,
) {
    let xv = x.view::<f32>(stream).unwrap();
    let mut yv = y.view_mut::<f32>(stream).unwrap();
    assert!(n <= xv.len() && n <= yv.len());
    let (len, ns) = (n as u32, spin.as_nanos() as u64);
    let (xp, _x) = xv.device_ptr(stream);
    let (yp, _y) = yv.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(f);
    launch.arg(&a).arg(&xp).arg(&yp).arg(&len).arg(&ns);
    // SAFETY: spin_axpy(a, x, y, n, ns) reads n floats at `xp` and writes n at `yp`; both views
    // hold at least n (asserted above), lent for `stream`, where the kernel runs; the guards
    // drop after the launch.
    unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();
}

/// Polls `device` until nothing waits in its deferred queue.
///
/// # Panics
///
/// After 60 s.
fn poll_until_released<B: Backend>(device: &Device<'_, B>) {
    let start = Instant::now();
    while device.poll().deferred > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "a release still waits after 60 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Completes a started release, waiting (without blocking in the driver) for its fence.
///
/// # Panics
///
/// If a backend call fails.
fn complete_when_ready<B: Backend>(mut releasing: Allocation<'_, '_, B, Releasing>) -> Released {
    loop {
        match releasing.complete() {
            Ok(released) => return released,
            Err(TransitionError {
                token: Returned::Unchanged(pending),
                cause: ReleaseFailure::Pending,
            }) => {
                releasing = pending;
                std::thread::yield_now();
            }
            Err(e) => panic!("{e}: {}", e.cause),
        }
    }
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

/// On a GPU: a region grows and shrinks through the granule cache, then a region and
/// an allocation sleep with their bytes saved and wake at the same addresses with every byte.
fn gpu_region_grow_shrink_and_sleep_wake() {
    let backend = gpu("gpu_region_grow_shrink_and_sleep_wake");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut region = binding.reserve(8 * g).unwrap().into_region();
    region.grow(3).unwrap();
    let data: Vec<u8> = (0..3 * g).map(|i| (i % 239) as u8).collect();
    region.copy_from_host(0, &data).unwrap();
    region.shrink(1).unwrap();
    assert_eq!(
        device.ledger().cached_bytes,
        g as u64,
        "the granule is cached"
    );
    region.grow(2).unwrap();
    assert_eq!(
        (region.committed_len(), device.ledger().cached_bytes),
        (4 * g, 0)
    );
    region.copy_from_host(2 * g, &data[2 * g..]).unwrap();
    let mut a = binding.reserve(2 * g).unwrap().commit().unwrap();
    a.copy_from_host(0, &data[..2 * g]).unwrap();
    let (region_addr, a_addr) = (region.addr(), a.addr());

    let asleep_region = region.suspend_saving().unwrap();
    let asleep = a.suspend_saving().unwrap();
    let ledger = device.ledger();
    assert_eq!(ledger.mapped_bytes, 0);
    assert_eq!(
        ledger.owned_bytes, ledger.cached_bytes,
        "owned by the cache alone"
    );
    device.trim_cache();
    assert_eq!(device.ledger().owned_bytes, 0, "nothing owned while asleep");

    let region = asleep_region.resume().unwrap();
    let a = asleep.resume().unwrap();
    assert_eq!(
        (region.addr(), a.addr()),
        (region_addr, a_addr),
        "every address kept"
    );
    let mut seen = vec![0; 3 * g];
    region.copy_to_host(0, &mut seen).unwrap();
    assert_eq!(seen, data, "the region's bytes restored");
    let mut seen = vec![0; 2 * g];
    a.copy_to_host(0, &mut seen).unwrap();
    assert_eq!(seen, data[..2 * g], "the allocation's bytes restored");
    drop((region, a));
    drop(binding);
    assert!(device.close().is_clean());
}

fn gpu_commit_copy_and_release() {
    let backend = gpu("gpu_commit_copy_and_release");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut a = binding.reserve(g + 1).unwrap().commit().unwrap();
    assert_eq!(a.len(), 2 * g);
    let data: Vec<u8> = (0..a.len()).map(|i| (i % 241) as u8).collect();
    a.copy_from_host(0, &data).unwrap();
    let mut back = vec![0; a.len()];
    a.copy_to_host(0, &mut back).unwrap();
    assert!(back == data, "device memory did not round-trip");
    let len = a.len();
    let released = complete_when_ready(a.release());
    assert_eq!(released.len, len);
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

/// The plain mechanism (fact 59: `cuMemAlloc`, `cuMemFree`) on a real device, VMM or not: a
/// commit's token is at the driver's address, the bytes round-trip, a KV cache (allocated whole)
/// works, growth
/// in place is refused by name, and everything is freed (a clean close).
fn gpu_plain_mechanism_commits_copies_and_frees() {
    let test = "gpu_plain_mechanism_commits_copies_and_frees";
    let backend = usable(test, CudaBackend::open_plain(0));
    assert_eq!(
        backend.mechanism(),
        memtoken::backend::cuda::CudaMechanism::Plain
    );
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let reserved = binding.reserve(2 * g).unwrap();
    let placeholder = reserved.addr();
    let mut a = reserved.commit().unwrap();
    assert_ne!(
        a.addr(),
        placeholder,
        "the token is where cuMemAlloc put the memory"
    );
    let data: Vec<u8> = (0..a.len()).map(|i| (i % 251) as u8).collect();
    a.copy_from_host(0, &data).unwrap();
    let mut back = vec![0; a.len()];
    a.copy_to_host(0, &mut back).unwrap();
    assert!(back == data, "device memory did not round-trip");
    complete_when_ready(a.release());
    make_guard!(cache_guard);
    let layout = memtoken::kv::Layout::new(64, 16).plane(4096);
    let cache = memtoken::kv::KvCache::new(cache_guard, &binding, &layout).unwrap();
    assert!(
        !cache.maps_on_demand(),
        "allocated whole on the plain mechanism"
    );
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    table.write(0, 0, 8, &[5; 8]).unwrap();
    let mut block = [0; 8];
    table.read(0, 0, 8, &mut block).unwrap();
    assert_eq!(block, [5; 8]);
    drop(table);
    drop(cache);
    let mut region = binding.reserve(2 * g).unwrap().into_region();
    assert!(matches!(
        region.grow(1),
        Err(memtoken::errors::GrowError::Unsupported(_))
    ));
    complete_when_ready(region.release());
    drop(binding);
    device.poll();
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

fn gpu_kernel_runs_on_committed_memory_and_drop_defers_behind_it() {
    let test = "gpu_kernel_runs_on_committed_memory_and_drop_defers_behind_it";
    let backend = gpu(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let n = 1 << 20;
    let mut x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    x.copy_from_host(0, &bytes(&xs)).unwrap();
    y.copy_from_host(0, &bytes(&vec![1.0; n])).unwrap();

    let ctx = CudaContext::new(0).unwrap();
    let module = ctx.load_module(Ptx::from_src(AXPY)).unwrap();
    let axpy = module.load_function("axpy").unwrap();
    let stream = ctx.default_stream(); // the legacy stream, where fences are recorded
    let (a, xp, yp, len) = (2.0f32, x.device_ptr(), y.device_ptr(), n as u32);
    let mut launch = stream.launch_builder(&axpy);
    launch.arg(&a).arg(&xp).arg(&yp).arg(&len);
    // SAFETY: the kernel reads `n` floats at `xp` and writes `n` at `yp`, both committed
    // allocations of `n * 4` bytes that outlive the launch's fence (released only after it).
    unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();

    let mut out = vec![0; n * 4];
    y.copy_to_host(0, &mut out).unwrap(); // synchronous on the legacy stream
    let ys = floats(&out);
    assert!(
        (0..n).all(|i| ys[i] == 2.0 * i as f32 + 1.0),
        "axpy computed wrong values"
    );

    // Launch again and drop both inputs at once: nothing blocks, the release waits for the fence.
    // SAFETY: as for the first launch: the same kernel, arguments and live buffers.
    unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();
    drop(x);
    drop(y);
    while device.poll().deferred > 0 {
        std::thread::yield_now();
    }
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
}

fn gpu_shared_prefix_and_copy_on_write() {
    let backend = gpu("gpu_shared_prefix_and_copy_on_write");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let filled = prefix.copy_from_host(0, &vec![7; 2 * g]);
    filled.expect("no sharer yet").unwrap();
    let a = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    let b = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    assert_eq!(
        device.ledger().owned_bytes,
        2 * g as u64,
        "sharers own nothing"
    );
    let mut seen = vec![0u8; 64];
    b.copy_to_host(g + 128, &mut seen).unwrap();
    assert_eq!(
        seen,
        vec![7; 64],
        "a read-only sharer reads the owner's bytes"
    );
    let mut a = a.diverge().unwrap();
    assert_eq!(
        device.ledger().owned_bytes,
        3 * g as u64,
        "one private granule"
    );
    a.copy_boundary_from_host(128, &[9; 64]).unwrap();
    a.copy_to_host(g + 128, &mut seen).unwrap();
    assert_eq!(
        seen,
        vec![9; 64],
        "the private copy takes the sharer's write"
    );
    a.copy_to_host(g + 256, &mut seen).unwrap();
    assert_eq!(seen, vec![7; 64], "the private copy holds the old bytes");
    b.copy_to_host(g + 128, &mut seen).unwrap();
    assert_eq!(
        seen,
        vec![7; 64],
        "the other sharer still sees the original"
    );
    drop((a, b, prefix));
    while device.poll().deferred > 0 {
        std::thread::yield_now();
    }
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

fn gpu_a_token_dropped_while_a_kernel_on_a_new_stream_reads_it_is_unmapped_after_the_kernel() {
    let test =
        "gpu_a_token_dropped_while_a_kernel_on_a_new_stream_reads_it_is_unmapped_after_the_kernel";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    // A non-blocking stream: the legacy stream, where fences were once the only ones, does not
    // wait for it.
    let stream = ctx.new_stream().unwrap();
    let n = 1 << 16; // 64 blocks: all resident at once, so the kernel lasts about one spin
    let mut x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    stream
        .memcpy_htod(&xs, &mut x.view_mut::<f32>(&stream).unwrap())
        .unwrap();
    stream
        .memcpy_htod(&vec![1.0f32; n], &mut y.view_mut::<f32>(&stream).unwrap())
        .unwrap();

    let spin = spin_axpy(&ctx);
    launch_spin_axpy(
        &spin,
        &stream,
        2.0,
        &x,
        &mut y,
        n,
        Duration::from_millis(500),
    );
    let kernel_done = stream.record_event(None).unwrap();
    drop(x); // the kernel spins, then reads x: its release must wait
    // Looked at before polling: a poll that wrongly unmaps would wait in `cuMemUnmap` for the
    // kernel, and then the failure below must name the early release, not a short spin.
    let still_running = !kernel_done.try_is_complete().unwrap();
    let progress = device.poll();
    assert!(
        still_running,
        "the kernel ended before the test could look: lengthen its spin"
    );
    assert_eq!(
        progress.deferred, 1,
        "x was released while a kernel on a covered stream still ran"
    );

    poll_until_released(&device);
    assert!(
        kernel_done.try_is_complete().unwrap(),
        "x was unmapped before the kernel reading it had finished"
    );
    let ys = stream
        .clone_dtoh(&y.view::<f32>(&stream).unwrap().slice(..n))
        .unwrap();
    let wrong = (0..n).filter(|&i| ys[i] != 2.0 * i as f32 + 1.0).count();
    assert_eq!(
        wrong, 0,
        "the kernel read x wrong after its token was dropped"
    );

    // No sticky error: the context still works and reported nothing.
    stream.synchronize().unwrap();
    ctx.check_err().unwrap();
    assert!(device.confirm_context_lost().is_none());
    drop(y);
    poll_until_released(&device);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

fn gpu_memcpy_and_launch_through_typed_views() {
    let (ctx, backend) = shared("gpu_memcpy_and_launch_through_typed_views");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let stream = ctx.new_stream().unwrap();
    let module = ctx.load_module(Ptx::from_src(AXPY)).unwrap();
    let axpy = module.load_function("axpy").unwrap();

    // A committed allocation: memcpy in, a kernel, memcpy out, all through the views.
    let n = 1 << 20;
    let mut x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    assert_eq!(x.view::<f32>(&stream).unwrap().len(), x.len() / 4);
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    stream
        .memcpy_htod(&xs, &mut x.view_mut::<f32>(&stream).unwrap())
        .unwrap();
    stream
        .memset_zeros(&mut y.view_mut::<f32>(&stream).unwrap())
        .unwrap();
    stream
        .memcpy_htod(&vec![1.0f32; n], &mut y.view_mut::<f32>(&stream).unwrap())
        .unwrap();
    {
        let xv = x.view::<f32>(&stream).unwrap();
        let mut yv = y.view_mut::<f32>(&stream).unwrap();
        let (a, len) = (2.0f32, n as u32);
        let (xp, _x) = xv.device_ptr(&stream);
        let (yp, _y) = yv.device_ptr_mut(&stream);
        let mut launch = stream.launch_builder(&axpy);
        launch.arg(&a).arg(&xp).arg(&yp).arg(&len);
        // SAFETY: axpy reads n floats at `xp` and writes n at `yp`, views of n floats each, lent
        // for `stream`, where it runs; the guards drop after the launch.
        unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();
    }
    let ys = stream.clone_dtoh(&y.view::<f32>(&stream).unwrap()).unwrap();
    assert_eq!(ys.len(), n);
    assert!(
        (0..n).all(|i| ys[i] == 2.0 * i as f32 + 1.0),
        "axpy through views"
    );
    // Sub-views, and a device-to-device copy between two views.
    let mut head = vec![0.0f32; 4];
    stream
        .memcpy_dtoh(&y.view::<f32>(&stream).unwrap().slice(1..5), &mut head)
        .unwrap();
    stream.synchronize().unwrap();
    assert_eq!(head, [3.0, 5.0, 7.0, 9.0]);
    stream
        .memcpy_dtod(
            &y.view::<f32>(&stream).unwrap().slice(..n / 2),
            &mut x.view_mut::<f32>(&stream).unwrap().slice_mut(n / 2..),
        )
        .unwrap();
    let back = stream
        .clone_dtoh(&x.view::<f32>(&stream).unwrap().slice(n / 2..n / 2 + 2))
        .unwrap();
    assert_eq!(back, [1.0, 3.0]);

    // The views' misfits are errors, not pointers.
    assert_eq!(
        x.view::<[u8; 3]>(&stream).unwrap_err(),
        ViewError::Length {
            bytes: x.len(),
            size: 3
        }
    );

    // A prefix and its mappings lend views too.
    let mut prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let mut whole = prefix
        .view_mut::<u8>(&stream)
        .expect("no sharer yet")
        .unwrap();
    stream.memset_zeros(&mut whole).unwrap();
    drop(whole);
    // Copy-on-write copies on the legacy stream, which does not wait for `stream`.
    stream.synchronize().unwrap();
    let shared = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    let mut diverged = shared.diverge().unwrap();
    stream
        .memcpy_htod(
            &[9u8; 4],
            &mut diverged.boundary_view_mut::<u8>(&stream).unwrap(),
        )
        .unwrap();
    let tail = stream
        .clone_dtoh(&diverged.view::<u8>(&stream).unwrap().slice(g - 2..g + 6))
        .unwrap();
    assert_eq!(
        tail,
        [0, 0, 9, 9, 9, 9, 0, 0],
        "body shared, boundary private"
    );
    let original = stream
        .clone_dtoh(&prefix.view::<u8>(&stream).unwrap().slice(g..g + 4))
        .unwrap();
    assert_eq!(original, [0; 4], "the prefix keeps its bytes");

    stream.synchronize().unwrap();
    ctx.check_err().unwrap();
    assert!(device.confirm_context_lost().is_none());
    drop((x, y, diverged, prefix));
    poll_until_released(&device);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

fn gpu_a_view_used_on_another_stream_waits_for_its_home_stream() {
    let test = "gpu_a_view_used_on_another_stream_waits_for_its_home_stream";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (home, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let n = 1 << 10;
    let mut x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    home.memcpy_htod(&vec![1.0f32; n], &mut x.view_mut::<f32>(&home).unwrap())
        .unwrap();
    home.memcpy_htod(&vec![1.0f32; n], &mut y.view_mut::<f32>(&home).unwrap())
        .unwrap();
    let spin = spin_axpy(&ctx);
    launch_spin_axpy(&spin, &home, 2.0, &x, &mut y, n, Duration::from_millis(200));
    // Read on `other` through a view whose home is `home`: it must see the kernel's writes.
    // (A view is used only on streams the device knows: its memory's release fences them.)
    device.know(&other).unwrap();
    let view = y.view::<f32>(&home).unwrap();
    let ys = other.clone_dtoh(&view.slice(..n)).unwrap();
    assert!(
        ys.iter().all(|&v| v == 3.0),
        "a read on another stream did not wait for the kernel on the view's home stream"
    );
    drop(view);
    home.synchronize().unwrap();
    ctx.check_err().unwrap();
    drop((x, y));
    poll_until_released(&device);
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

/// On a GPU: a view used on another stream, its guard dropped at once (before the
/// kernel is even launched), the view dropped and the token released while the kernel on that
/// stream still runs: the release waits for the kernel — the memory's fence covers every
/// stream a view used it on, whatever becomes of the guard — and no sticky error follows.
fn gpu_a_view_used_on_another_stream_with_its_guard_dropped_at_once_is_still_fenced() {
    let test = "gpu_a_view_used_on_another_stream_with_its_guard_dropped_at_once_is_still_fenced";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (home, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    device.know(&other).unwrap();
    let n = 1 << 16;
    let x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    home.memcpy_htod(&vec![1.0f32; n], &mut y.view_mut::<f32>(&home).unwrap())
        .unwrap();
    let spin = spin_axpy(&ctx);
    // Pointers for `other` through views homed on `home`, guards dropped at once.
    let (xp, yp) = {
        let xv = x.view::<f32>(&home).unwrap();
        let mut yv = y.view_mut::<f32>(&home).unwrap();
        let (xp, _) = xv.device_ptr(&other);
        let (yp, _) = yv.device_ptr_mut(&other);
        let handle = home.cu_stream() as memtoken::backend::cuda::Stream;
        assert!(!device.forget_stream(handle), "views of `home` live");
        (xp, yp)
    };
    let (len, ns) = (n as u32, Duration::from_millis(500).as_nanos() as u64);
    let mut launch = other.launch_builder(&spin);
    launch.arg(&2.0f32).arg(&xp).arg(&yp).arg(&len).arg(&ns);
    // SAFETY: spin_axpy(a, x, y, n, ns) reads n floats at `xp` and writes n at `yp`, both
    // tokens' memory of n floats, mapped until their releases — which this test checks wait.
    unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();
    let kernel_done = other.record_event(None).unwrap();
    drop(x);
    let still_running = !kernel_done.try_is_complete().unwrap();
    let progress = device.poll();
    assert!(
        still_running,
        "the kernel ended before the test could look: lengthen its spin"
    );
    assert_eq!(
        progress.deferred, 1,
        "x was released under a kernel on a stream a view lent it to"
    );
    poll_until_released(&device);
    assert!(kernel_done.try_is_complete().unwrap());
    other.synchronize().unwrap();
    ctx.check_err().unwrap();
    assert!(device.confirm_context_lost().is_none());
    drop(y);
    poll_until_released(&device);
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
}

/// On a GPU: order per memory. A kernel writes `y` through a view homed on stream
/// `a`; a read through *another* view of `y`, homed on stream `b`, must see its writes (the
/// home `b` waits for the last write on `a`); then a write through a view homed on `a` after a
/// read on `b` must not overtake it.
fn gpu_views_on_two_streams_are_ordered_per_memory() {
    let test = "gpu_views_on_two_streams_are_ordered_per_memory";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let (a, b) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let n = 1 << 10;
    let mut x = binding.reserve(n * 4).unwrap().commit().unwrap();
    let mut y = binding.reserve(n * 4).unwrap().commit().unwrap();
    a.memcpy_htod(&vec![1.0f32; n], &mut x.view_mut::<f32>(&a).unwrap())
        .unwrap();
    a.memcpy_htod(&vec![1.0f32; n], &mut y.view_mut::<f32>(&a).unwrap())
        .unwrap();
    let spin = spin_axpy(&ctx);
    launch_spin_axpy(&spin, &a, 2.0, &x, &mut y, n, Duration::from_millis(200));
    // Another view, homed on `b`: its read waits for the write on `a`.
    let ys = b
        .clone_dtoh(&y.view::<f32>(&b).unwrap().slice(..n))
        .unwrap();
    assert!(
        ys.iter().all(|&v| v == 3.0),
        "a read through another view on another stream did not wait for the write"
    );
    // A write on `a` after a read on `b`: the read sees the old bytes, never the new.
    let yb = y.view::<f32>(&b).unwrap();
    let mut seen = vec![0.0f32; n];
    b.memcpy_dtoh(&yb.slice(..n), &mut seen).unwrap();
    drop(yb);
    launch_spin_axpy(&spin, &a, 1.0, &x, &mut y, n, Duration::from_millis(1));
    b.synchronize().unwrap();
    assert!(
        seen.iter().all(|&v| v == 3.0),
        "the write overtook the read"
    );
    a.synchronize().unwrap();
    ctx.check_err().unwrap();
    drop((x, y));
    poll_until_released(&device);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The child's role in [`gpu_export_import_in_a_child_process`]: the path of the socket it
/// connects to.
const IPC_CHILD_ENV: &str = "MEMTOKEN_GPU_IPC_CHILD";

/// The byte at `i` of the exported prefix.
fn ipc_pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ 0x3c
}

/// The child of [`gpu_export_import_in_a_child_process`]: opens the GPU, imports the prefix
/// offered on the socket at `path`, checks every byte, and reports on the socket.
fn gpu_ipc_child(path: &str) {
    use std::os::unix::net::UnixStream;
    let mut socket = UnixStream::connect(path).expect("connect to the parent");
    let backend = CudaBackend::open(0).expect("the child opens the GPU the parent opened");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::bytes(0)).unwrap(); // an importer owns nothing
    let offer = memtoken::sharing::Offer::recv(&socket).expect("a valid offer");
    let imported = binding.import(offer).expect("imported");
    let mut bytes = vec![0u8; imported.len()];
    imported.copy_to_host(0, &mut bytes).unwrap();
    let wrong = bytes
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != ipc_pattern(i))
        .count();
    assert_eq!(wrong, 0, "every byte as the exporter wrote it");
    let owned = device.ledger().owned_bytes;
    writeln!(socket, "ok owned={owned} len={}", imported.len()).unwrap();
    imported.release().complete().unwrap();
    drop(binding);
    assert!(device.close().is_clean());
}

/// A prefix exported as POSIX descriptors (`cuMemExportToShareableHandle`), sent over a Unix
/// socket to this test binary run again, imported there (`cuMemImportFromShareableHandle`),
/// read back byte for byte; the parent releases after the child exits.
fn gpu_export_import_in_a_child_process() {
    use memtoken::backend::PosixFd;
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    if let Ok(path) = std::env::var(IPC_CHILD_ENV) {
        return gpu_ipc_child(&path);
    }
    let test = "gpu_export_import_in_a_child_process";
    let backend = gpu(test);
    let g = backend.granularity();
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let owner = device.bind(Budget::unlimited()).unwrap();
    let len = 3 * g; // a body and a boundary granule: two descriptors
    let bytes: Vec<u8> = (0..len).map(ipc_pattern).collect();
    let mut prefix = owner
        .reserve(len)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    prefix.copy_from_host(0, &bytes).unwrap().unwrap();
    let export = prefix.export().unwrap();
    assert_eq!(device.outstanding_exports(), 1);

    let path = std::env::temp_dir().join(format!("memtoken-gpu-ipc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            test,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IPC_CHILD_ENV, &path)
        // Its own run's lines would mix into this one's: kept, and shown only if it fails.
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The child connects, or the test fails (never hangs) once it exited without connecting.
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut socket = loop {
        match listener.accept() {
            Ok((socket, _)) => break socket,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if child.try_wait().unwrap().is_some() {
                    let out = child.wait_with_output().unwrap();
                    panic!(
                        "the child exited ({}) without connecting:\n{}{}",
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the child never connected"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    socket.set_nonblocking(false).unwrap();
    let _ = std::fs::remove_file(&path);
    export.send(&socket).unwrap();
    let mut report = String::new();
    socket.read_to_string(&mut report).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the child's checks failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(report.trim(), format!("ok owned=0 len={len}"));

    // The child is gone: the parent releases.
    export.end();
    assert_eq!(device.outstanding_exports(), 0);
    prefix.release().complete().unwrap();
    drop(owner);
    assert!(device.close().is_clean());
}

/// Facts 14 and 15 on the real driver: prints attribute 110
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`) and the recommended and
/// minimum granularity for plain and exportable (POSIX descriptor) properties, each with and
/// without `gpuDirectRDMACapable` (with it only asked where the attribute is 1); checks that
/// the backend chose RDMA-capable memory exactly where the attribute is 1, that its
/// granularities are the driver's for the properties it creates with, and that memory created
/// with those properties — plain, and an exportable prefix of body and boundary — commits,
/// round-trips its bytes, registers one segment per physical allocation, and releases.
///
/// Run it with `MEMTOKEN_REQUIRE_GPU=1 cargo test -p memtoken-gpu-tests -- --include-ignored gpu_rdma --nocapture`.
fn gpu_rdma_attribute_and_granularity_by_properties() {
    use memtoken::backend::PosixFd;
    use memtoken::backend::cuda::{AllocationProps, DeviceAttribute, Driver, HANDLE_TYPE_POSIX_FD};
    let test = "gpu_rdma_attribute_and_granularity_by_properties";
    let backend = gpu(test);
    // The backend initialized the driver and made its context current on this thread.
    let driver = SysDriver::load().expect("the backend loaded it");
    let device_id = backend.device();
    let attribute = driver
        .device_get_attribute(
            DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported,
            device_id,
        )
        .expect("cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)");
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "{test}: device {device_id}: attribute 110 (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) = \
         {attribute}"
    );
    for rdma in [false, true] {
        for handle_types in [0, HANDLE_TYPE_POSIX_FD] {
            let props = AllocationProps::pinned(device_id)
                .with_handle_types(handle_types)
                .with_gpu_direct_rdma(rdma);
            if rdma && attribute != 1 {
                let _ = writeln!(err, "{test}: {props:?}: not asked (attribute 110 is not 1)");
                continue;
            }
            let recommended = driver.mem_get_allocation_granularity(props);
            let minimum = assumptions::minimum_granularity(props);
            let _ = writeln!(
                err,
                "{test}: {props:?}: RECOMMENDED {recommended:?}, MINIMUM {minimum:?}"
            );
            let recommended = recommended.expect("the granularity of valid properties");
            assert!(recommended.is_power_of_two(), "{recommended:#x}");
        }
    }

    // The backend's choice: RDMA-capable exactly where attribute 110 is 1, and each
    // granularity asked with the properties that memory is created with.
    let props = backend.allocation_props();
    assert_eq!(backend.gpu_direct_rdma(), attribute == 1);
    assert_eq!(props.gpu_direct_rdma, attribute == 1);
    assert_eq!(
        Ok(backend.granularity()),
        driver.mem_get_allocation_granularity(props)
    );
    let exportable = props.with_handle_types(HANDLE_TYPE_POSIX_FD);
    assert_eq!(
        backend.exportable_granularity(),
        driver.mem_get_allocation_granularity(exportable)
    );
    let _ = writeln!(
        err,
        "{test}: the backend creates {props:?} (granularity {:#x}) and exportable memory with \
         granularity {:?}",
        backend.granularity(),
        backend.exportable_granularity()
    );

    let g = backend.granularity();
    let fits = backend
        .exportable_granularity()
        .is_ok_and(|e| g.is_multiple_of(e));
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut plain = binding.reserve(g).unwrap().commit().expect("plain memory");
    let data: Vec<u8> = (0..g).map(|i| (i % 239) as u8).collect();
    plain.copy_from_host(0, &data).unwrap();
    let mut back = vec![0; g];
    plain.copy_to_host(0, &mut back).unwrap();
    assert!(back == data, "plain memory did not round-trip");
    assert_eq!(plain.register().segments().count(), 1);
    let reserved = binding.reserve(3 * g).unwrap();
    match reserved.commit_prefix_exportable::<PosixFd>() {
        Ok(mut prefix) => {
            assert!(
                fits,
                "exportable memory was made though its granularity does not fit"
            );
            let bytes: Vec<u8> = (0..3 * g).map(|i| (i % 233) as u8).collect();
            prefix.copy_from_host(0, &bytes).unwrap().unwrap();
            let mut back = vec![0; 3 * g];
            prefix.copy_to_host(0, &mut back).unwrap();
            assert!(back == bytes, "exportable memory did not round-trip");
            let registration = prefix.register();
            let segments: Vec<_> = registration.segments().collect();
            assert_eq!(
                segments.iter().map(|d| d.len).collect::<Vec<_>>(),
                [2 * g, g],
                "body and boundary"
            );
            complete_when_ready(prefix.release());
        }
        Err(e) => {
            assert!(
                !fits,
                "exportable memory with the chosen properties failed: {e}"
            );
            let _ = writeln!(err, "{test}: exportable memory refused: {e}");
            drop(e.into_token());
        }
    }
    complete_when_ready(plain.release());
    drop(binding);
    assert!(device.close().is_clean());
}

/// On a GPU: a graph captured through memtoken (a memset of the token's memory),
/// launched three times, then dropped; the token's release waits for the last launch and the
/// bytes are the graph's. Then the bypass: a capture made with cudarc's own safe API takes a
/// memtoken view's pointer (`memset_zeros`); the view drops and the token is released — the
/// release is quarantined (the memory stays mapped), and cudarc's graph launched afterwards
/// runs on mapped memory: no sticky error.
fn gpu_graph_through_memtoken_borrows_and_a_foreign_capture_holds_its_memory() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use memtoken::backend::cuda::CaptureMode;
    use memtoken::{errors::Returned, interop::Capture};
    let test = "gpu_graph_through_memtoken_borrows_and_a_foreign_capture_holds_its_memory";
    let (ctx, backend) = shared(test);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let stream = ctx.new_stream().unwrap(); // before any capture: its first use synchronizes
    device.cover(&stream).unwrap();
    let raw = stream.cu_stream() as usize;
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut x = binding.reserve(g).unwrap().commit().unwrap();

    let capture = Capture::begin(&device, raw, CaptureMode::Global).unwrap();
    let mut view = capture.view_mut::<u8>(&mut x).unwrap();
    // SAFETY: the view holds `g` bytes for work on `stream`, which captures the memset.
    unsafe {
        cudarc::driver::result::memset_d8_async(view.device_ptr_mut(), 0xab, g, stream.cu_stream())
    }
    .unwrap();
    drop(view);
    let graph = capture.end().unwrap();
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    drop(graph);
    stream.synchronize().unwrap();
    let mut back = vec![0; g];
    x.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0xab), "the graph wrote the token");
    complete_when_ready(x.release());

    let mut y = binding.reserve(g).unwrap().commit().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    {
        let mut view = y.view_mut::<u8>(&stream).unwrap();
        stream.memset_zeros(&mut view).unwrap();
    }
    let foreign = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("the foreign capture ends valid");
    let mut releasing = y.release();
    loop {
        match releasing.complete() {
            Err(TransitionError {
                token: Returned::Unchanged(pending),
                cause: ReleaseFailure::Pending,
            }) => releasing = pending,
            Err(TransitionError {
                token: Returned::Quarantined(q),
                cause,
            }) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "{test}: quarantined as expected: {cause}"
                );
                drop(q);
                break;
            }
            Err(e) => panic!("{test}: expected quarantine, got {}", e.cause),
            Ok(_) => panic!("{test}: memory a foreign graph uses was unmapped"),
        }
    }
    foreign.launch().unwrap();
    stream.synchronize().unwrap();
    assert!(
        device.confirm_context_lost().is_none(),
        "the foreign graph ran on mapped memory"
    );
}

/// The tests of this file, by name (those of `assumptions` and `captures` are in theirs): what the runner (`main.rs`) runs. A test left out of the list is dead code, which the
/// lints refuse.
pub(crate) const TESTS: &[(&str, fn())] = tests![
    gpu_region_grow_shrink_and_sleep_wake,
    gpu_commit_copy_and_release,
    gpu_plain_mechanism_commits_copies_and_frees,
    gpu_kernel_runs_on_committed_memory_and_drop_defers_behind_it,
    gpu_shared_prefix_and_copy_on_write,
    gpu_a_token_dropped_while_a_kernel_on_a_new_stream_reads_it_is_unmapped_after_the_kernel,
    gpu_memcpy_and_launch_through_typed_views,
    gpu_a_view_used_on_another_stream_waits_for_its_home_stream,
    gpu_a_view_used_on_another_stream_with_its_guard_dropped_at_once_is_still_fenced,
    gpu_views_on_two_streams_are_ordered_per_memory,
    gpu_export_import_in_a_child_process,
    gpu_rdma_attribute_and_granularity_by_properties,
    gpu_graph_through_memtoken_borrows_and_a_foreign_capture_holds_its_memory,
];
