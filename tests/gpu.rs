//! Tests on a real GPU. Each has `gpu` in its name. Without a CUDA driver they print why they
//! skip and pass; with `MEMTOKEN_REQUIRE_GPU=1` they must run, and fail if there is no GPU.
#![cfg(feature = "cuda")]

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use memtoken::backend::Backend;
use memtoken::backend::cuda::{CudaBackend, SysDriver};
use memtoken::{
    Allocation, Budget, Device, ReleaseFailure, Released, Releasing, Returned, TransitionError,
    make_guard,
};
use std::io::Write;

const AXPY: &str = include_str!("../examples/kernels/axpy.ptx");

/// The real device, or `None` (with the reason printed) when this machine has none.
///
/// # Panics
///
/// When `MEMTOKEN_REQUIRE_GPU=1` and there is no usable GPU.
fn gpu_or_skip(test: &str) -> Option<CudaBackend<SysDriver>> {
    let required = std::env::var("MEMTOKEN_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaBackend::open(0) {
        Ok(backend) => Some(backend),
        Err(e) if required => panic!("{test}: MEMTOKEN_REQUIRE_GPU=1 but no GPU is usable: {e}"),
        Err(e) => {
            // Written to the stderr handle, not through `eprintln!`, so the test harness does not
            // swallow it: a skip is always visible.
            let _ = writeln!(
                std::io::stderr(),
                "{test}: SKIPPED, no GPU: {e} (MEMTOKEN_REQUIRE_GPU=1 makes this a failure)"
            );
            None
        }
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

#[test]
fn gpu_commit_copy_and_release() {
    let Some(backend) = gpu_or_skip("gpu_commit_copy_and_release") else {
        return;
    };
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

#[test]
fn gpu_kernel_runs_on_committed_memory_and_drop_defers_behind_it() {
    let test = "gpu_kernel_runs_on_committed_memory_and_drop_defers_behind_it";
    let Some(backend) = gpu_or_skip(test) else {
        return;
    };
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

#[test]
fn gpu_shared_prefix_and_copy_on_write() {
    let Some(backend) = gpu_or_skip("gpu_shared_prefix_and_copy_on_write") else {
        return;
    };
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut owner = binding.reserve(2 * g).unwrap().commit().unwrap();
    owner.copy_from_host(0, &vec![7; 2 * g]).unwrap();
    let prefix = owner.into_prefix();
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
    a.copy_to_boundary(128, &[9; 64]).unwrap();
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
