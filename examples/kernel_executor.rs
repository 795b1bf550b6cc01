//! A kernel executor written once, generic over the backend: it commits `x` and `y`, uploads
//! them and reads the result back the same way on every backend (`copy_from_host`,
//! `copy_to_host`), runs `y = a·x + y`, checks the result and releases everything — a CPU loop over the
//! tokens' memory seen as `f32`s on the host backend; on a CUDA device, a PTX kernel launched
//! through cudarc on a `new_stream()` stream, with the tokens lent as typed device views.
//!
//! ```text
//! cargo run --release --example kernel_executor            # host
//! cargo run --release --example kernel_executor -- --gpu   # CUDA device 0
//! cargo run --release --example kernel_executor -- --n N   # N elements (default 1048576)
//! ```

#[path = "common/cli.rs"]
mod cli;
mod common;

use cli::Arg;
use memtoken::backend::{Backend, HostBackend};
use memtoken::{Allocation, Budget, Committed, Device, Released, Releasing, make_guard};
use std::error::Error;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// What the executor needs from a backend: one kernel. Its bytes move the same way on every
/// backend (`copy_from_host`, `copy_to_host`: a copy on the host, a driver copy on CUDA,
/// ordered like any use of the memory).
trait Kernels<B: Backend> {
    /// Where it runs, for the report.
    fn name(&self) -> String;
    /// `y[i] = a * x[i] + y[i]` for `i < n`.
    fn axpy(
        &self,
        a: f32,
        x: &Allocation<'_, '_, B, Committed>,
        y: &mut Allocation<'_, '_, B, Committed>,
        n: usize,
    ) -> Result<()>;
}

/// The executor: the same code for every backend.
fn execute<B: Backend, K: Kernels<B>>(device: &Device<'_, B>, kernels: &K, n: usize) -> Result<()> {
    let binding = device.bind(Budget::unlimited())?;
    let bytes = n * size_of::<f32>();
    let mut x = binding.reserve(bytes)?.commit()?;
    let mut y = binding.reserve(bytes)?.commit()?;
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    x.copy_from_host(0, bytemuck::cast_slice(&xs))?;
    y.copy_from_host(0, bytemuck::cast_slice(&vec![1.0f32; n]))?;
    println!(
        "{}: committed x and y, {} bytes each ({} granules of {} bytes); ledger {:?}",
        kernels.name(),
        x.len(),
        x.len() / device.granularity(),
        device.granularity(),
        device.ledger()
    );

    let started = Instant::now();
    kernels.axpy(2.0, &x, &mut y, n)?;
    let mut out = vec![0.0f32; n];
    y.copy_to_host(0, bytemuck::cast_slice_mut(&mut out))?;
    let elapsed = started.elapsed();
    let wrong = (0..n).filter(|&i| out[i] != 2.0 * i as f32 + 1.0).count();
    println!(
        "ran y = 2·x + y on {n} elements in {:.3} ms: {}",
        elapsed.as_secs_f64() * 1e3,
        if wrong == 0 {
            "all correct".to_string()
        } else {
            format!("{wrong} wrong")
        }
    );
    if wrong != 0 {
        return Err(format!("{wrong} elements are wrong").into());
    }

    // Release: each token is consumed; on a GPU the release waits for the kernel's fence.
    for a in [x, y] {
        finish(a.release())?;
    }
    drop(binding);
    println!("released both; ledger {:?}", device.ledger());
    Ok(())
}

/// Finishes a release, waiting for its fence (`wait`: blocking, outside memtoken's locks; an
/// error rather than a hang where the wait cannot progress). A function that takes or returns
/// a token by value names the lifetimes it carries (`'b` of the binding, `'id` of the
/// device's brand); one that only borrows a token, like the `Kernels` methods above, elides
/// them with `'_`.
fn finish<'b, 'id, B: Backend>(releasing: Allocation<'b, 'id, B, Releasing>) -> Result<Released> {
    Ok(releasing.wait()?)
}

/// The host: a CPU loop over the committed memory, seen as `f32`s.
struct Cpu;

impl Kernels<HostBackend> for Cpu {
    fn name(&self) -> String {
        "host (CPU loop)".into()
    }

    fn axpy(
        &self,
        a: f32,
        x: &Allocation<'_, '_, HostBackend, Committed>,
        y: &mut Allocation<'_, '_, HostBackend, Committed>,
        n: usize,
    ) -> Result<()> {
        let x = x.as_slice_of::<f32>()?;
        for (yv, xv) in y.as_mut_slice_of::<f32>()?.iter_mut().zip(x).take(n) {
            *yv += a * xv;
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{Kernels, Result};
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
    };
    use cudarc::nvrtc::Ptx;
    use memtoken::backend::cuda::{CudaBackend, SysDriver};
    use memtoken::{Allocation, Committed};
    use std::sync::Arc;

    pub type Gpu = CudaBackend<SysDriver>;

    /// Device 0's primary context, shared by cudarc and memtoken's backend.
    pub fn open() -> Result<(Arc<CudaContext>, Gpu)> {
        // Opening by ordinal first says plainly when there is no driver (cudarc would panic);
        // kept open until the shared backend holds the context, so it is not torn down between.
        let probe = Gpu::open(0).map_err(|e| format!("--gpu: {e}"))?;
        let ctx = CudaContext::new(0)?;
        let backend = Gpu::from_context(ctx.clone())?;
        drop(probe);
        Ok((ctx, backend))
    }

    /// CUDA: an axpy PTX kernel, loaded as text (no NVRTC), and everything on one stream of
    /// cudarc's `new_stream()` (non-blocking: not ordered with the legacy stream). The typed
    /// views are made for that stream, so the device's fences cover it: a token released
    /// after a kernel there is unmapped only once the kernel has finished.
    pub struct Ptxs {
        stream: Arc<CudaStream>,
        axpy: CudaFunction,
    }

    impl Ptxs {
        pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
            let module = ctx.load_module(Ptx::from_src(include_str!("kernels/axpy.ptx")))?;
            Ok(Self {
                axpy: module.load_function("axpy")?,
                stream: ctx.new_stream()?,
            })
        }
    }

    impl Kernels<Gpu> for Ptxs {
        fn name(&self) -> String {
            "CUDA device 0 (PTX kernel on a new stream)".into()
        }

        fn axpy(
            &self,
            a: f32,
            x: &Allocation<'_, '_, Gpu, Committed>,
            y: &mut Allocation<'_, '_, Gpu, Committed>,
            n: usize,
        ) -> Result<()> {
            let stream = &self.stream;
            let (x, mut y) = (x.view::<f32>(stream)?, y.view_mut::<f32>(stream)?);
            if n > x.len() || n > y.len() {
                return Err(format!(
                    "{n} elements do not fit in x ({}) and y ({})",
                    x.len(),
                    y.len()
                )
                .into());
            }
            let len = u32::try_from(n)?;
            let (xp, _x) = x.device_ptr(stream);
            let (yp, _y) = y.device_ptr_mut(stream);
            let mut launch = stream.launch_builder(&self.axpy);
            launch.arg(&a).arg(&xp).arg(&yp).arg(&len);
            // SAFETY: axpy(a, x, y, n) reads n floats at `xp` and writes n at `yp`; both views
            // hold at least n (checked above). The pointers were lent for `stream`, the stream
            // the kernel runs on, and their guards (`_x`, `_y`) drop after the launch.
            unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }?;
            Ok(())
        }
    }
}

const USAGE: &str = "\
usage: kernel_executor [--gpu] [--n N]

y = a·x + y, written once, generic over memtoken's backend
(cargo run --release --example kernel_executor -- ARGS).

  --gpu        run on CUDA device 0 (a PTX kernel) instead of the host (a CPU loop)
  --n N        elements (default 1048576)
  -h, --help   print this usage";

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let (mut on_gpu, mut n) = (false, 1 << 20);
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        let Arg::Flag(flag) = arg else {
            cli.unknown(arg)
        };
        match flag.as_str() {
            "--gpu" => on_gpu = true,
            "--n" => n = cli.value(&flag),
            _ => cli.unknown(Arg::Flag(flag)),
        }
    }
    cli::exit(run(on_gpu, n))
}

/// The executor on the GPU or the host, and the device closed.
fn run(on_gpu: bool, n: usize) -> Result<()> {
    if on_gpu {
        #[cfg(feature = "cuda")]
        {
            make_guard!(guard);
            let (ctx, backend) = gpu::open()?;
            let device = Device::new(guard, backend);
            execute(&device, &gpu::Ptxs::load(&ctx)?, n)?;
            let report = device.close();
            return if report.is_clean() {
                Ok(())
            } else {
                Err(format!("the device closed with {report:?}").into())
            };
        }
        #[cfg(not(feature = "cuda"))]
        return Err("--gpu: built without the `cuda` feature".into());
    }
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    execute(&device, &Cpu, n)?;
    let report = device.close();
    if !report.is_clean() {
        return Err(format!("the device closed with {report:?}").into());
    }
    println!("device closed clean");
    Ok(())
}
