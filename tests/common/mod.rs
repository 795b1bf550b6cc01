//! Helpers shared by the integration tests: reading an error's `source()` chain, and the smaller
//! sizes the tests take under Miri.
#![allow(
    dead_code,
    reason = "each test crate uses its own part of these helpers"
)]

use memtoken::backend::cuda::{DriverModel, ModelConfig};
use std::error::Error;

/// The messages along `err`'s `source()` chain, `err`'s own first.
pub fn messages(err: &dyn Error) -> Vec<String> {
    let mut out = vec![err.to_string()];
    let mut next = err.source();
    while let Some(e) = next {
        out.push(e.to_string());
        next = e.source();
    }
    out
}

/// Each message says its own part: none repeats the text of a cause further down the chain.
pub fn assert_no_cause_repeated(err: &dyn Error) {
    let all = messages(err);
    for (i, message) in all.iter().enumerate() {
        for cause in &all[i + 1..] {
            assert!(
                !message.contains(cause.as_str()),
                "{message:?} repeats {cause:?}"
            );
        }
    }
}

/// `len` bytes of a pattern: byte `i` is `(i % 251) as u8 ^ seed`. Built by copies of one
/// period, not byte by byte, so that whole granules of it are cheap under Miri too.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let period: Vec<u8> = (0..251).map(|i| i as u8 ^ seed).collect();
    let mut bytes = period.repeat(len.div_ceil(period.len()));
    bytes.truncate(len);
    bytes
}

/// `normal`, or `miri` when the test runs under Miri (`cargo +nightly miri test`), which
/// interprets every step: a size or a count small enough to finish there in seconds.
pub const fn unless_miri(normal: usize, miri: usize) -> usize {
    if cfg!(miri) { miri } else { normal }
}

/// All of `items`, or under Miri every `n`th of them (the first included): an exhaustive loop
/// over fault plans keeps its variety there at a fraction of the cost.
pub fn every_nth_under_miri<T>(
    items: impl IntoIterator<Item = T>,
    n: usize,
) -> impl Iterator<Item = T> {
    items.into_iter().step_by(unless_miri(1, n))
}

/// The driver model's granularity in the tests: its default, 2 MiB, or 64 KiB under Miri, where
/// every granule the model creates, copies or compares is interpreted (a fault-injection
/// workload of `tests/cuda_backend.rs` takes less than half the time at 64 KiB).
pub const MODEL_GRANULARITY: usize = unless_miri(2 << 20, 64 << 10);

/// The driver model's default settings, at [`MODEL_GRANULARITY`] (so, outside Miri, exactly
/// `ModelConfig::default()`).
pub fn model_config() -> ModelConfig {
    ModelConfig {
        granularity: MODEL_GRANULARITY,
        ..ModelConfig::default()
    }
}

/// The number of property-test cases: `PROPTEST_CASES` if set, else `default`, or 4 under Miri.
pub fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(unless_miri(default as usize, 4) as u32)
}

/// A driver model with [`model_config`] (so, outside Miri, exactly `DriverModel::default()`).
pub fn model() -> DriverModel {
    DriverModel::new(model_config()).expect("the default settings are valid")
}
