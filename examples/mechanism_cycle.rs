//! One granule reserved, committed and released, `N` times, on the CUDA backend over the driver
//! model — on its VMM mechanism or its plain one (`cuMemAlloc`) — for instruction counts
//! (issue 29): both mechanisms are one backend type, so their tokens are one type and every
//! backend call dispatches on the mechanism; the VMM cycle's count before and after that
//! dispatch was added is its cost.
//!
//! ```text
//! cargo build --release --example mechanism_cycle
//! valgrind --tool=callgrind --toggle-collect='mechanism_cycle::cycles' \
//!     target/release/examples/mechanism_cycle <vmm|plain> N
//! ```
//!
//! Counted per cycle: the difference between N = 3000 and N = 1000, divided by 2000.

use memtoken::backend::cuda::CudaBackend;
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::{Budget, Device, make_guard};
use std::hint::black_box;

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

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "vmm".into());
    let n: usize = match args.next().map(|n| n.parse()) {
        None => 1000,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("mechanism_cycle: N: {e}; usage: mechanism_cycle <vmm|plain> [N]");
            std::process::exit(2);
        }
    };
    let model = DriverModel::new(ModelConfig::default()).expect("the default model");
    let backend = match which.as_str() {
        "vmm" => CudaBackend::new(model, 0),
        "plain" => CudaBackend::new_plain(model, 0),
        other => {
            eprintln!("mechanism_cycle: {other:?}: usage: mechanism_cycle <vmm|plain> [N]");
            std::process::exit(2);
        }
    }
    .expect("the model opens device 0");
    make_guard!(guard);
    let device = Device::new(guard, backend);
    cycles(&device, n);
    assert!(device.ledger().is_zero());
    println!(
        "mechanism_cycle: {n} reserve/commit/release cycles of one granule on the {which} mechanism (driver model)"
    );
}
