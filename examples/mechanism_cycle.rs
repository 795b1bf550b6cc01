//! One granule reserved, committed and released, `N` times, on the CUDA backend over the driver
//! model — on its VMM mechanism or its plain one (`cuMemAlloc`) — for instruction counts
//!: both mechanisms are one backend type, so their tokens are one type and every
//! backend call dispatches on the mechanism; the VMM cycle's count before and after that
//! dispatch was added is its cost.
//!
//! ```text
//! cargo build --release --example mechanism_cycle
//! valgrind --tool=callgrind --toggle-collect='mechanism_cycle::cycles' \
//!     target/release/examples/mechanism_cycle [vmm|plain] [N]
//! ```
//!
//! Counted per cycle: the difference between N = 3000 and N = 1000, divided by 2000.

#[path = "common/cli.rs"]
mod cli;
mod common;

use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::{Budget, Device, make_guard};
use std::hint::black_box;

const USAGE: &str = "\
usage: mechanism_cycle [MODE] [N]

One granule reserved, committed and released N times on the CUDA backend over the driver
model, for instruction counts (callgrind; see the top of examples/mechanism_cycle.rs).

  MODE         vmm (the VMM mechanism, the default) or plain (cuMemAlloc)
  N            a whole number of cycles (default 1000)
  -h, --help   print this usage";

/// `n` reserve/commit/release cycles of one granule through `device`.
#[inline(never)]
fn cycles(device: &Device<'_, CudaBackend<DriverModel>>, n: usize) {
    let binding = device.bind(Budget::unlimited()).expect("bind");
    let g = device.granularity();
    for _ in 0..n {
        let token = binding
            .reserve(g)
            .expect("reserve")
            .commit()
            .expect("commit");
        black_box(token.addr());
        token
            .release()
            .complete()
            .expect("the model's events complete at once");
    }
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    let (which, n) = cli::mode_and_count(USAGE, &["vmm", "plain"], "N", ("vmm", 1000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Box<dyn std::error::Error>> {
    let model = DriverModel::new(ModelConfig::default())?;
    let backend = match which {
        "vmm" => CudaBackend::new(model, 0),
        "plain" => CudaBackend::new_plain(model, 0),
        _ => unreachable!("a mode of the command line"),
    }?;
    make_guard!(guard);
    let device = Device::new(guard, backend);
    cycles(&device, n as usize);
    assert!(device.ledger().is_zero());
    println!(
        "mechanism_cycle: {n} reserve/commit/release cycles of one granule on the {which} mechanism (driver model)"
    );
    Ok(())
}
