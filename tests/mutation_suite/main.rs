//! The mutation-testing suite: the integration tests that run without a GPU and without a
//! child process, compiled into one test binary, so that `cargo mutants` (see
//! `.cargo/mutants.toml`) relinks one binary per mutant instead of one per file.
//!
//! Not run by a plain `cargo test` (`test = false` in `Cargo.toml`): each file below is
//! already its own test target. `tests/ipc.rs`, `tests/unwind.rs`,
//! `tests/unwind_device_drop.rs` and `tests/unwind_while_unwinding.rs` stay their own targets:
//! they re-run the test binary as a child process by unqualified test name, or set a panic
//! hook for the whole process. `tests/gpu.rs` needs a GPU; `tests/ui.rs` (trybuild) and
//! `tests/static_asserts.rs` test types, which no mutant of a function body changes.
//! `tests/mutants_kill.rs`, the tests written to kill surviving mutants, is in it too.

// Several of the files include `tests/common` as their own module, as they do as targets.
#![allow(clippy::duplicate_mod)]

#[path = "../backend_input.rs"]
mod backend_input;
#[path = "../cuda_backend.rs"]
mod cuda_backend;
#[path = "../cuda_ipc.rs"]
mod cuda_ipc;
#[path = "../cuda_peers.rs"]
mod cuda_peers;
#[path = "../cuda_streams.rs"]
mod cuda_streams;
#[path = "../custody.rs"]
mod custody;
#[path = "../custody_discharge.rs"]
mod custody_discharge;
#[path = "../driver_model.rs"]
mod driver_model;
#[path = "../forgotten.rs"]
mod forgotten;
#[path = "../ipc_decoder.rs"]
mod ipc_decoder;
#[path = "../mutants_kill.rs"]
mod mutants_kill;
#[path = "../page_pool.rs"]
mod page_pool;
#[path = "../promises.rs"]
mod promises;
#[path = "../properties.rs"]
mod properties;
#[path = "../region.rs"]
mod region;
#[path = "../sharing.rs"]
mod sharing;
#[path = "../sleep.rs"]
mod sleep;
#[path = "../threads.rs"]
mod threads;
#[path = "../transfer.rs"]
mod transfer;
#[path = "../transitions.rs"]
mod transitions;
#[path = "../typed_views.rs"]
mod typed_views;
