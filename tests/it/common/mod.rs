//! Setup shared by the suites of this binary: devices over `Faulty`, the host backend, the
//! simulator and the driver model as the tests take them, a backend that stalls one call on
//! purpose ([`gate`]), reading an error's `source()` chain, and the smaller sizes the tests take
//! under Miri.

pub mod allocations;
pub mod gate;

use memtoken::backend::{
    HostBackend, Op,
    doubles::{SimBackend, SimConfig},
};
use memtoken::backend::{
    cuda::CudaBackend,
    doubles::{DriverModel, ModelConfig},
};
use std::error::Error;

/// A device over `Faulty<$backend>` bound to `$device`, and its fault handle to `$faults`.
macro_rules! setup {
    ($backend:expr, $device:ident, $faults:ident) => {
        memtoken::make_guard!(guard);
        let backend = memtoken::backend::doubles::Faulty::new($backend);
        let $faults = backend.handle();
        let $device = memtoken::Device::new(guard, backend);
    };
}
pub(crate) use setup;

/// A device over the driver model `$model` bound to `$device`, and a new stream of the model,
/// covered by the device's fences, bound to `$stream`.
macro_rules! covered_device {
    ($model:expr, $device:ident, $stream:ident) => {
        memtoken::make_guard!(guard);
        let $device = memtoken::Device::new(guard, crate::common::cuda(&$model));
        let $stream = $model.new_stream();
        // SAFETY: a stream of the model's only context, live as long as the model.
        unsafe { $device.cover_stream($stream) };
    };
}
pub(crate) use covered_device;

/// As [`covered_device!`], but the stream is only known to the device (views may be made for
/// it; a release fences it only where a view used the memory there).
macro_rules! known_device {
    ($model:expr, $device:ident, $stream:ident) => {
        memtoken::make_guard!(guard);
        let $device = memtoken::Device::new(guard, crate::common::cuda(&$model));
        let $stream = $model.new_stream();
        // SAFETY: a stream of the model's only context, destroyed only once forgotten.
        unsafe { $device.know_stream($stream) };
    };
}
pub(crate) use known_device;

/// Asserts that the model's context was lost (`CONTEXT_IS_DESTROYED`) and that nothing was
/// called after the loss (each such call would fail), naming the calls made if something was.
pub fn assert_lost_and_nothing_called_after(model: &DriverModel) {
    use memtoken::backend::cuda::CuError;
    assert_eq!(model.lost_with(), Some(CuError::CONTEXT_IS_DESTROYED));
    assert_eq!(
        model.calls_after_loss(),
        0,
        "a call followed the loss: {:?}",
        model.log()
    );
}

/// The host backend with its default settings.
pub fn host() -> HostBackend {
    let memory = host_memory();
    HostBackend::new(memtoken::backend::HostConfig {
        memory,
        ..Default::default()
    })
    .expect("the host backend's store")
}

/// The host store the tests run on: `MEMTOKEN_HOST_MEMORY=anonymous` runs them as where
/// `memfd_create` is refused (the anonymous store), `heap` on the heap store (no system call:
/// the store under Miri, which takes it when nothing is said), else a `memfd`.
pub fn host_memory() -> memtoken::backend::HostMemory {
    match std::env::var("MEMTOKEN_HOST_MEMORY").as_deref() {
        Ok("anonymous") => memtoken::backend::HostMemory::Anonymous,
        Ok("heap") => memtoken::backend::HostMemory::Heap,
        Err(_) if cfg!(miri) => memtoken::backend::HostMemory::Heap,
        Ok("memfd") | Err(_) => memtoken::backend::HostMemory::Memfd,
        Ok(other) => panic!("MEMTOKEN_HOST_MEMORY={other}: say anonymous, heap or memfd"),
    }
}

/// The simulator's default granularity, 2 MiB (under Miri too): the granule of the tests that
/// take the simulator's or the driver model's default settings.
pub const GRANULE: usize = 2 << 20;

/// The simulator with its default settings but `physical_capacity` bytes of physical memory.
pub fn sim(physical_capacity: u64) -> SimBackend {
    SimBackend::new(SimConfig {
        physical_capacity,
        ..SimConfig::default()
    })
    .unwrap()
}

/// Asserts that the simulator's unmaps and releases since its call number `start` were, in
/// order, the undo of a growth that took one granule from the device's cache and created one:
/// the created granule (on top) unmapped and released, then the cached one unmapped (back to
/// the cache, no release).
pub fn assert_created_released_then_cached_unmapped(sim: &SimBackend, start: usize) {
    let undone: Vec<Op> = sim.calls()[start..]
        .iter()
        .map(|c| c.op)
        .filter(|&op| matches!(op, Op::Unmap | Op::Release))
        .collect();
    assert_eq!(
        undone,
        [Op::Unmap, Op::Release, Op::Unmap],
        "the created granule (on top) released, then the cached one unmapped back to the cache"
    );
}

/// Asserts that `error`'s message starts with `summary`: a failure says what failed first.
pub fn says_first(error: &impl std::fmt::Display, summary: &str) {
    let message = error.to_string();
    assert!(message.starts_with(summary), "{message}");
}

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
/// A failed transition's message (what failed, why, what it hands back), then its cause's
/// chain.
pub fn transition_messages<T: std::fmt::Display, C: memtoken::errors::Failure>(
    err: &memtoken::TransitionError<T, C>,
) -> Vec<String> {
    let mut out = vec![err.to_string()];
    out.extend(messages(&err.cause));
    out
}

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

/// The seeds of a hand-rolled property test (a loop of whole random scenarios, one per seed):
/// [`unless_miri`]`(normal, miri)`, and no more than `PROPTEST_CASES` where that is set lower,
/// as for the proptest suites. The mutation runs set it to 32 (`scripts/mutants-shard`), so
/// that one such test does not take most of each mutant's test run.
pub fn seeds(normal: usize, miri: usize) -> u64 {
    let cases = std::env::var("PROPTEST_CASES").ok();
    let cap = cases
        .and_then(|c| c.parse::<usize>().ok())
        .unwrap_or(usize::MAX);
    unless_miri(normal, miri).min(cap.max(1)) as u64
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
/// workload of the `cuda_backend` suite takes less than half the time at 64 KiB).
pub const MODEL_GRANULARITY: usize = unless_miri(2 << 20, 64 << 10);

/// A kernel on `stream` writes all of `x` through a view of `capture` (the view dropped: the
/// capture holds what it lent).
pub fn write_through_view<'t, 'id>(
    model: &DriverModel,
    stream: memtoken::backend::cuda::Stream,
    capture: &memtoken::interop::Capture<'t, 'id, DriverModel>,
    x: &'t mut memtoken::Allocation<'_, 'id, CudaBackend<DriverModel>, memtoken::Committed>,
) {
    let len = x.len();
    let mut view = capture.view_mut::<u8>(x).unwrap();
    model.submit_work_touching(stream, &[(view.device_ptr_mut(), len)]);
}

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

/// The CUDA backend on device 0 of `model`.
pub fn cuda(model: &DriverModel) -> CudaBackend<DriverModel> {
    CudaBackend::new(model.clone(), 0).expect("the model opens device 0")
}

/// A driver model with [`model_config`] but 64 granules of device memory.
pub fn small_model() -> DriverModel {
    DriverModel::new(ModelConfig {
        total_mem: 64 * MODEL_GRANULARITY,
        ..model_config()
    })
    .unwrap()
}

/// A driver model with [`model_config`] whose events complete only when the test completes the
/// work (`complete_work`): a fence stays pending as long as the test wants.
pub fn held_fences() -> DriverModel {
    DriverModel::new(ModelConfig {
        events_complete_at_once: false,
        ..model_config()
    })
    .unwrap()
}

/// A region grown by some granules, for a test's setup: `reserve(..).into_region().grown(2)`.
pub trait Grown {
    /// Grows by `granules`, panicking if the growth is refused (a setup that cannot fail).
    fn grown(self, granules: usize) -> Self;
}

impl<B: memtoken::backend::Backend> Grown for memtoken::region::Region<'_, '_, B> {
    fn grown(mut self, granules: usize) -> Self {
        self.grow(granules).expect("setup: grow");
        self
    }
}

/// A small deterministic generator (xorshift), one per thread of a test.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
