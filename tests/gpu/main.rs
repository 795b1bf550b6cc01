//! The tests on a real GPU, under a runner of their own (`harness = false`, libtest-mimic) so
//! that a machine without one reports them as what they are: **ignored**, never passed.
//!
//! Every test is ignored by a plain `cargo test`. With `--include-ignored` (or `--ignored`) they
//! run only where a GPU answers — the runner opens device 0 first; where none does, it says why
//! and reports each one ignored, whatever the flags. `MEMTOKEN_REQUIRE_GPU=1` runs them all the
//! same, so each fails loudly without a GPU:
//!
//! ```text
//! MEMTOKEN_REQUIRE_GPU=1 cargo test -p memtoken-gpu-tests -- --include-ignored
//! ```
//!
//! The arguments are libtest's (`--exact`, `--test-threads`, a name filter, `--list`...).

use libtest_mimic::{Arguments, Failed, Trial};
use std::process::ExitCode;

#[cfg(feature = "cuda")]
mod cases;

/// The command that runs the GPU tests, for the messages.
const RUN: &str = "MEMTOKEN_REQUIRE_GPU=1 cargo test -p memtoken-gpu-tests -- --include-ignored";

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    let required = std::env::var("MEMTOKEN_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let wanted = args.include_ignored || args.ignored;
    if wanted
        && !required
        && !args.list
        && let Err(why) = gpu_answers()
    {
        // Said on stderr, before libtest's lines: why nothing below ran.
        eprintln!(
            "no GPU: {why}. Every GPU test is reported ignored (`{RUN}` runs them, and \
             fails without a GPU)."
        );
        args.include_ignored = false;
        args.ignored = false;
    }
    libtest_mimic::run(&args, trials()).exit_code()
}

/// Every GPU test, ignored unless asked for. A panic is a failure (libtest-mimic catches it).
fn trials() -> Vec<Trial> {
    #[cfg(feature = "cuda")]
    let tests = [
        ("", cases::TESTS),
        ("assumptions::", cases::assumptions::TESTS),
        ("captures::", cases::captures::TESTS),
    ];
    #[cfg(not(feature = "cuda"))]
    let tests: [(&str, &[(&str, fn())]); 0] = [];
    tests
        .into_iter()
        .flat_map(|(module, tests)| {
            tests.iter().map(move |&(name, test)| {
                Trial::test(format!("{module}{name}"), move || {
                    test();
                    Ok::<(), Failed>(())
                })
                .with_ignored_flag(true)
            })
        })
        .collect()
}

/// `Ok` where device 0 opens on the CUDA driver; why not otherwise.
#[cfg(feature = "cuda")]
fn gpu_answers() -> Result<(), String> {
    memtoken::backend::cuda::CudaBackend::open(0)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpu_answers() -> Result<(), String> {
    Err("built without feature `cuda`".into())
}
