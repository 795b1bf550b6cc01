//! The tests on a real GPU, under a runner of their own (`harness = false`, libtest-mimic) so
//! that a machine without one reports them as what they are: **ignored**, never passed.
//!
//! Every test is ignored by a plain `cargo test`. With `--include-ignored` (or `--ignored`) they
//! run only where a GPU answers — the runner opens device 0 first; where none does, it says why
//! and reports each one ignored, whatever the flags; on a device without virtual memory
//! management only the tests that need none run (`cases::NO_VMM`), the others reported ignored. `MEMTOKEN_REQUIRE_GPU=1` runs them all the
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
    if required && !cfg!(feature = "cuda") {
        eprintln!(
            "MEMTOKEN_REQUIRE_GPU=1, but this runner was built without feature `cuda`: no GPU test to run"
        );
        return ExitCode::FAILURE;
    }
    let wanted = args.include_ignored || args.ignored;
    // What runs: everything (a GPU with VMM, or required), only the tests that need no VMM (a
    // device without it), or nothing.
    let mut runs = Runs::All;
    if wanted && !required && !args.list {
        runs = match gpu_answers() {
            Answer::Vmm => Runs::All,
            Answer::NoVmm(why) => {
                eprintln!(
                    "{why}: only the GPU tests that need no VMM run; the others are reported \
                     ignored."
                );
                Runs::NoVmmOnly
            }
            Answer::None(why) => {
                // Said on stderr, before libtest's lines: why nothing below ran.
                eprintln!(
                    "no GPU: {why}. Every GPU test is reported ignored (`{RUN}` runs them, and \
                     fails without a GPU)."
                );
                Runs::Nothing
            }
        };
    }
    if runs != Runs::All {
        // The tests that cannot run stay ignored whatever the flags; those that can are not
        // ignored (libtest-mimic has no ignore decided while a test runs).
        args.include_ignored = false;
        args.ignored = false;
    }
    libtest_mimic::run(&args, trials(runs)).exit_code()
}

/// Which GPU tests this machine runs when they are asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Runs {
    All,
    NoVmmOnly,
    Nothing,
}

/// A module's tests: `(name, test)` pairs.
#[cfg(not(feature = "cuda"))]
type Tests = &'static [(&'static str, fn())];

/// What device 0 is.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Answer {
    /// It opens on the CUDA driver, with virtual memory management.
    Vmm,
    /// It opens, without virtual memory management (why, in words).
    NoVmm(String),
    /// It does not open (why, in words).
    None(String),
}

/// Every GPU test, ignored unless asked for — and, with `runs` other than [`Runs::All`], ignored
/// or not by what the machine can run. A panic is a failure (libtest-mimic catches it).
fn trials(runs: Runs) -> Vec<Trial> {
    #[cfg(feature = "cuda")]
    let tests = [
        ("", cases::TESTS),
        ("assumptions::", cases::assumptions::TESTS),
        ("captures::", cases::captures::TESTS),
        ("kv::", cases::kv::TESTS),
    ];
    #[cfg(not(feature = "cuda"))]
    let tests: [(&str, Tests); 0] = [];
    #[cfg(feature = "cuda")]
    let no_vmm = cases::NO_VMM;
    #[cfg(not(feature = "cuda"))]
    let no_vmm: &[&str] = &[];
    tests
        .into_iter()
        .flat_map(|(module, tests)| {
            tests.iter().map(move |&(name, test)| {
                let ignored = match runs {
                    Runs::All | Runs::Nothing => true,
                    Runs::NoVmmOnly => !no_vmm.contains(&name),
                };
                Trial::test(format!("{module}{name}"), move || {
                    test();
                    Ok::<(), Failed>(())
                })
                .with_ignored_flag(ignored)
            })
        })
        .collect()
}

/// What device 0 is, on the CUDA driver.
#[cfg(feature = "cuda")]
fn gpu_answers() -> Answer {
    use memtoken::backend::cuda::{CudaBackend, CudaError};
    match CudaBackend::open(0) {
        Ok(_) => Answer::Vmm,
        Err(e @ CudaError::NoVmm { .. }) => Answer::NoVmm(e.to_string()),
        Err(e) => Answer::None(e.to_string()),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_answers() -> Answer {
    Answer::None("built without feature `cuda`".into())
}
