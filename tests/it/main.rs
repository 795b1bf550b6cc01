//! The integration tests that can share one process, in one binary: a module per behaviour.
//!
//! `cargo test --test it` runs them all; `cargo test --test it region::` one suite. Shared setup
//! (devices over `Faulty`, the driver model at the tests' granularity, a backend that stalls
//! one call on purpose) is in [`common`].
//!
//! Apart, each its own target (see `Cargo.toml`), stay only the suites that cannot share this
//! process: `tests/ipc.rs` (re-runs its binary as a child process and counts the process's open
//! descriptors), `tests/unwind.rs` and `tests/unwind_while_unwinding.rs` (child processes that
//! re-run the binary by test name), `tests/unwind_device_drop.rs` (a panic hook for the whole
//! process), `ui-tests/tests/ui.rs` (trybuild, a workspace member) and `tests/gpu/cases.rs` (a CUDA driver). No module here sets a
//! panic hook or an environment variable, counts the process's descriptors or threads, or
//! re-runs this binary.

mod common;

/// Counts each thread's allocations ([`common::allocations`]), for the tests that promise none.
#[global_allocator]
static ALLOCATOR: common::allocations::Counting = common::allocations::Counting;

// The token layer: transitions, custody and teardown, what each kind of memory does.
mod capture_promises;
mod captures;
mod context_loss;
mod custody;
mod custody_discharge;
mod engine;
mod errors;
mod forgotten;
mod kv_attention;
mod kv_cache;
mod kv_failures;
mod kv_graph;
mod kv_held;
mod kv_shared;
mod kv_sleep;
mod mechanisms;
mod money;
mod plain_mechanism;
mod promises;
mod region;
mod sharing;
mod sleep;
mod static_asserts;
mod transitions;
mod typed_views;

// Across processes and to transfer engines, inside this process.
mod ipc_decoder;
mod transfer;

// The backends: the host, the simulator and its rule book, the CUDA backend on the driver
// model, and the model itself.
mod backend_input;
mod cuda_backend;
mod cuda_ipc;
mod cuda_peers;
mod cuda_streams;
mod driver_model;
mod host_backend;
mod simulator;

// Random workloads and many threads.
mod properties;
mod tails;
mod threads;

// The README and the guides: their links resolve off GitHub.
mod doc_links;
