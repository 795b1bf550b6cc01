//! [`Device`]: one backend instance with its brand, ledger and custody — the quarantine and
//! the deferred-release queue. It knows residuals and their parts, never which token or policy
//! they came from.
//!
//! It is also the one place where money moves: every charge and refund of a ledger axis or of a
//! binding's budget is made in this module (the methods are visible nowhere else), next to the
//! backend call it pays for. Tokens and policies call its steps and records instead.
//!
//! Here: the device itself — its brand, its counters, and the narrow hooks that tokens and
//! policies call. Its rooms: `binding` (a consumer's pin and budget), `steps` (each backend
//! call with its ledger and budget move), `build` (what a transition made so far, undone by
//! the ordinary teardown), `custody` (the quarantine, the deferred queue, and the teardown of
//! residuals), `quarantined` (quarantined remains as a token), `cache` (the granule cache),
//! `report` (what the device tells about itself). Nothing here names a concrete backend:
//! covering CUDA streams is interop's.

mod binding;
mod build;
mod cache;
mod custody;
#[cfg(test)]
#[cfg(loom)]
mod loom_tests;
mod quarantined;
mod report;
mod steps;

pub use binding::Binding;
pub(crate) use binding::Custody as Handover;
pub(crate) use build::{Build, Undone};
pub use custody::WithheldForPeer;
pub(crate) use quarantined::settle;
pub use quarantined::{QuarantineError, Quarantined};
pub use report::{CloseReport, Custody, DropReport, Forgotten, Progress};
pub(crate) use steps::{GiveBack, Growth};

use crate::backend::{Addr, Backend, BackendError, Cause, Op};
use crate::error::CommitFailure;
use crate::ids::{ContextLost, Generation};
use crate::ledger::{Axis, Budget, Ledger, LedgerSnapshot};
use crate::residual::SharedTotals;
use crate::unwind::{Guarded, Scope};
use cache::{DEFAULT_CACHE_GRANULES, GranuleCache, Tails};
use custody::Books;
use generativity::{Guard, Id};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// One backend instance — a CUDA context, or the host — owning the VA bookkeeping, the byte
/// ledger, the quarantine and the deferred-release queue.
///
/// A device carries a **brand** `'id`, a lifetime unique to it (from [`generativity`]): its
/// tokens carry the same brand, so the compiler rejects combining them with another device's.
///
/// **Dropping a device is the one place that may wait.** Its context can outlive it (cudarc
/// shares the primary context), so releases still waiting for their fence are finished as the
/// device drops, each once its work has completed, and its quarantine is retried. What is left
/// behind while the context lives is exactly what cannot be freed safely, and it is reported
/// ([`report_drop_to`](Self::report_drop_to), else one line on standard error): a release
/// whose wait failed for good or whose stream still captures a CUDA graph (never freed under
/// work that may still run), and a residual still quarantined (a teardown that keeps failing,
/// or memory a graph memtoken does not know of may use). The CUDA backend, as it drops, also
/// keeps the scratch range of a copy whose wait failed twice (a last wait for the legacy
/// stream failed too). Every other call returns at once.
///
/// ```
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::HostBackend;
///
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// let mut a = binding.reserve(10_000)?.commit()?;
/// a.as_mut_slice()[0] = 7;
/// a.release().complete()?;
/// drop(binding);
/// assert!(device.close().is_clean());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A device cannot be dropped (or closed) while a token made through it lives:
///
/// ```compile_fail,E0505
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::doubles::SimBackend;
/// make_guard!(guard);
/// let device = Device::new(guard, SimBackend::strict());
/// // Leaked, so that only the token keeps the device borrowed.
/// let binding: &_ = Box::leak(Box::new(device.bind(Budget::unlimited()).unwrap()));
/// let token = binding.reserve(1).unwrap();
/// drop(device);
/// drop(token);
/// ```
pub struct Device<'id, B: Backend> {
    brand: Id<'id>,
    backend: Guarded<B>,
    ledger: Ledger,
    failed_unpins: AtomicU64,
    /// Pins whose unpin failed (an error or a panic) and that the device gives back as it
    /// drops: a failed call is taken as not made, as for every other call.
    owed_pins: AtomicU64,
    /// Bindings alive (or forgotten).
    bindings: AtomicU64,
    /// Blocks of KV caches that dropped while a forgotten table or prefix cache held them.
    forgotten_blocks: AtomicU64,
    books: Mutex<Books<B>>,
    shared: SharedTotals,
    cache: GranuleCache<B::Phys>,
    tails: Tails,
    /// Cap on owned bytes across the whole device.
    limit: u64,
    closed: bool,
    /// Where the drop reports what it left behind ([`Device::report_drop_to`]).
    drop_sink: Mutex<Option<report::DropSink>>,
}

impl<'id, B: Backend> Device<'id, B> {
    /// A device over `backend`, branded by `guard` (from [`make_guard!`](crate::make_guard)).
    ///
    /// A brand is never `'static` but in an [`Engine`](crate::Engine), whose block tables are
    /// `Send` at `'static` brands (they move with the engine): unsafe code that makes a guard
    /// itself (`Guard::new`) must not make it `'static`.
    pub fn new(guard: Guard<'id>, backend: B) -> Self {
        Self::with_budget(guard, backend, Budget::unlimited())
    }

    /// A device whose owned bytes, over all its bindings and its shared physical memory, stay
    /// within `budget` — shared memory is counted once, whichever tokens still map it.
    /// Its granule cache holds at most 64 granules.
    pub fn with_budget(guard: Guard<'id>, backend: B, budget: Budget) -> Self {
        let backend = Guarded::new(backend);
        let cache = backend.granularity() as u64 * DEFAULT_CACHE_GRANULES;
        Self::assemble(guard, backend, budget, Budget::bytes(cache))
    }

    /// A device as [`with_budget`](Self::with_budget) makes it, whose cache of physical
    /// granules holds at most `cache` bytes (see [`set_cache_cap`](Self::set_cache_cap)).
    /// The cached bytes count in `budget`, and are trimmed when a commit needs them.
    pub fn with_cache(guard: Guard<'id>, backend: B, budget: Budget, cache: Budget) -> Self {
        Self::assemble(guard, Guarded::new(backend), budget, cache)
    }

    /// The device over `backend`, whose getters were read once by [`Guarded::new`].
    fn assemble(guard: Guard<'id>, backend: Guarded<B>, budget: Budget, cache: Budget) -> Self {
        Self {
            cache: GranuleCache::new(cache.limit()),
            tails: Tails::new(),
            brand: guard.into(),
            backend,
            ledger: Ledger::default(),
            failed_unpins: AtomicU64::new(0),
            owed_pins: AtomicU64::new(0),
            bindings: AtomicU64::new(0),
            forgotten_blocks: AtomicU64::new(0),
            books: Mutex::new(Books::new()),
            shared: SharedTotals::default(),
            limit: budget.limit(),
            closed: false,
            drop_sink: Mutex::new(None),
        }
    }

    /// The allocation granularity: every token's length is a multiple of it.
    pub fn granularity(&self) -> usize {
        self.backend.granularity()
    }

    /// The mechanism that lacks `ability` (its backend's [`lacks`](Backend::lacks), read when
    /// the device was made), or `None` where it has it: what a program checks before it
    /// plans on sharing, growth in place, suspend or export. A call that needs what is
    /// lacking is refused with [`Cause::Unsupported`](crate::backend::Cause::Unsupported).
    pub fn lacks(&self, ability: crate::backend::Ability) -> Option<&'static str> {
        self.backend.lacks(ability)
    }

    /// The ledger now.
    pub fn ledger(&self) -> LedgerSnapshot {
        self.ledger.snapshot()
    }

    /// How many times unpinning the context failed when a binding was dropped. Each such pin
    /// is tried again as the device drops (a failed call is taken as not made).
    pub fn failed_unpins(&self) -> u64 {
        self.failed_unpins.load(Ordering::Relaxed)
    }

    /// Proof that the context is lost, if the backend confirms it.
    pub fn confirm_context_lost(&self) -> Option<ContextLost<'id>> {
        self.backend
            .context_lost()
            .then(|| ContextLost::new(self.brand))
    }

    /// Closes the device after a last poll and quarantine retry, reporting what is left.
    /// Releases still waiting for their fence then wait for it as the device drops (see
    /// `Drop`): the one place where memtoken blocks on the device.
    pub fn close(mut self) -> CloseReport {
        self.closed = true;
        Scope::run::<B, _>(|| self.shutdown())
    }

    // ---- crate-internal: what tokens call ----

    /// The backend, every call contained (see [`crate::unwind`]).
    pub(crate) fn backend(&self) -> &Guarded<B> {
        &self.backend
    }

    /// Charges `n` owned bytes against the device's budget, trimming the cache once when cached
    /// granules stand in the way; or says why not.
    pub(in crate::device) fn charge_owned_or_trim(&self, n: usize) -> Result<(), CommitFailure> {
        self.charge_owned(n)
            .or_else(|e| match e {
                CommitFailure::DeviceBudget { .. } if self.make_room(n) => self.charge_owned(n),
                e => Err(e),
            })
            // The regions' mapped tails may hold what the budget needs: ask them back.
            .inspect_err(|_| self.ask_tails_back_if_held())
    }

    /// Charges `n` owned bytes against the device's budget, or says why not.
    pub(in crate::device) fn charge_owned(&self, n: usize) -> Result<(), CommitFailure> {
        self.ledger
            .try_charge(Axis::Owned, n as u64, self.limit)
            .map_err(|used| CommitFailure::DeviceBudget {
                requested: n as u64,
                used,
                limit: self.limit,
            })
    }

    pub(in crate::device) fn charge(&self, axis: Axis, n: usize) {
        self.ledger.charge(axis, n as u64);
    }

    pub(in crate::device) fn refund(&self, axis: Axis, n: usize) {
        self.ledger.refund(axis, n as u64);
    }

    pub(crate) fn next_generation(&self) -> Generation {
        Generation::next()
    }

    /// A binding's unpin failed: counted, and owed until the device drops.
    pub(crate) fn note_failed_unpin(&self) {
        self.failed_unpins.fetch_add(1, Ordering::Relaxed);
        self.owed_pins.fetch_add(1, Ordering::Relaxed);
    }

    /// A binding was opened (its pin taken).
    pub(crate) fn note_bound(&self) {
        self.bindings.fetch_add(1, Ordering::Relaxed);
    }

    /// A binding was dropped.
    pub(crate) fn note_unbound(&self) {
        self.bindings.fetch_sub(1, Ordering::Relaxed);
    }

    /// A KV cache dropped with `n` of its blocks never given back.
    pub(crate) fn note_forgotten_blocks(&self, n: u64) {
        self.forgotten_blocks.fetch_add(n, Ordering::Relaxed);
    }

    /// How many exports of this device's shared physical memory to other processes are
    /// outstanding: each holds a reference on the memory, so it lives until the export ends.
    pub fn outstanding_exports(&self) -> u64 {
        self.shared.exports()
    }

    /// The totals of this device's shared physical memory, through which every reference on it
    /// is made and given back.
    pub(in crate::device) fn shared(&self) -> &SharedTotals {
        &self.shared
    }

    /// Refuses a call into a context that is lost, without making it.
    pub(crate) fn ensure_live(&self, op: Op, addr: Addr, len: usize) -> Result<(), BackendError> {
        if self.backend.context_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Device<'_, B> {
    fn drop(&mut self) {
        // One scope for all of it: a backend panic contained in the last poll resumes only
        // once everything below has run.
        let _scope = Scope::open::<B>();
        if !self.closed {
            self.shutdown();
        }
        // The one place that waits: the context may live on after the device (cudarc shares
        // it), so what still waits for a fence is freed once its work has finished, in order —
        // unless the context is lost, when the driver freed it all. Taken out of the queue
        // first: no lock is held while waiting or calling the backend.
        let left_waiting = self.finish_deferred();
        if self.backend.context_lost() {
            self.forget_cache();
        } else {
            self.trim_cache();
            self.retry_quarantine();
            // A binding borrows the device: any still counted was forgotten, and its pin with
            // it; and a pin whose unpin failed is still held. The pins go back here, so that
            // neither keeps the context retained after its device.
            let owed = *self.bindings.get_mut() + *self.owed_pins.get_mut();
            for _ in 0..owed {
                // The last try: a failure now is left to the driver, as a forgotten
                // binding's pin would be.
                let _ = self.backend.unpin();
            }
        }
        // What is left stays with the driver: said, never silently left (a lost context
        // freed everything).
        let report = DropReport {
            left_waiting,
            quarantined: match self.backend.context_lost() {
                true => crate::residual::Holdings::default(),
                false => self.custody().quarantined,
            },
        };
        match self
            .drop_sink
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            Some(sink) => sink(&report),
            // `eprintln!`: a test harness captures it, a program shows it.
            None if !report.is_clean() => eprintln!("memtoken: a device dropped: {report}"),
            None => {}
        }
    }
}

impl<B: Backend> std::fmt::Debug for Device<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("granularity", &self.granularity())
            .field("ledger", &self.ledger())
            .finish_non_exhaustive()
    }
}
