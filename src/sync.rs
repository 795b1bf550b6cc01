//! The synchronization types of the lock protocols that the library's loom models check: the
//! mechanism registry (its lock, its slots and its published selection), and the granule
//! cache's admit/cap race (the cache's lock and cap, the device's ledger, a binding's budget).
//!
//! They are `std`'s, except in the library's own tests built with `--cfg loom`
//! (`RUSTFLAGS="--cfg loom" cargo test --release --lib loom`), where they are
//! [loom](https://docs.rs/loom)'s: every lock, load and store of these protocols is then a
//! point where loom's scheduler may switch threads, and its models
//! (`src/mechanism/loom_tests.rs`, `src/device/loom_tests.rs`) run every interleaving. Only
//! there: loom is a dev-dependency (under `cfg(loom)` alone), so the library built for
//! anything else — an ordinary build, the integration tests, a `--cfg loom` build of the
//! library itself — uses `std`. Loom's types panic outside a model, so under `--cfg loom` only
//! the loom models may run (hence the `loom` filter).
//!
//! The loom side is gated by two attributes, `#[cfg(test)]` and `#[cfg(loom)]` (as the models'
//! modules are): `cargo mutants` skips what `cfg(test)` alone gates, and would otherwise mutate
//! code that its builds never compile.
//!
//! Everything else (the backends, the device's books, the process-wide counters) keeps `std`'s
//! types: loom does not see them, so a model must not block on them — none of them is held
//! across a call into these protocols.

#[cfg(not(all(loom, test)))]
pub(crate) use crate::backend::lock;
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(all(loom, test)))]
pub(crate) use std::sync::{Mutex, MutexGuard};

#[cfg(test)]
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

/// Locks `m`, and goes on through poison (as [`crate::backend::lock`] does for `std`'s).
#[cfg(test)]
#[cfg(loom)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `model` under loom in every interleaving of its threads: no preemption bound (the
/// models are small enough for loom to try them all), unless `LOOM_MAX_PREEMPTIONS` sets one.
/// Says how many executions it ran (seen with `--nocapture`).
#[cfg(test)]
#[cfg(loom)]
pub(crate) fn model(model: impl Fn() + Send + Sync + 'static) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    loom::model::Builder::new().check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        model();
    });
    let test = std::thread::current()
        .name()
        .unwrap_or("a model")
        .to_owned();
    eprintln!("loom: {test}: {} executions", runs.load(Ordering::Relaxed));
}
