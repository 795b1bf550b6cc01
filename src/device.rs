//! [`Device`]: one backend instance with its brand, ledger and custody — the quarantine and
//! the deferred-release queue. It knows residuals and their parts, never which token or policy
//! they came from.

#[cfg(feature = "cuda")]
use crate::backend::cuda::SysDriver;
use crate::backend::cuda::{CudaBackend, Driver, Stream};
use crate::backend::{Addr, Backend, BackendError, Cause, Op, lock};
use crate::error::{CommitFailure, ReleaseFailure};
use crate::ids::{ContextLost, Generation};
use crate::ledger::{Axis, Budget, Ledger, LedgerSnapshot};
use crate::residual::{Held, Holdings, Residual, SharedPhys, SharedTotals};
use crate::state::Wait;
use crate::unwind::{Guarded, Scope};
use generativity::{Guard, Id};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// What [`Device::retry_quarantine`] and [`Device::poll`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Residuals fully released by this call.
    pub released: usize,
    /// Residuals still quarantined in the device after it.
    pub quarantined: usize,
    /// Releases still waiting for their fence after it.
    pub deferred: usize,
}

/// What a device holds in its own custody (see [`Device::custody`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Custody {
    /// Residuals in the device's quarantine.
    pub quarantined: Holdings,
    /// Releases waiting for their fence.
    pub deferred: Holdings,
    /// Shared physical memory (mapped by several tokens): `count` prefixes, their
    /// `owned_bytes` (each charged once, whatever the number of mappings), and the references
    /// on them (`shared_refs`). A prefix's memory (one or two physical allocations) is released
    /// when its last reference goes.
    pub shared: Holdings,
}

/// What was forgotten (`mem::forget`, or leaked) and never given back to a device, beyond the
/// bytes its ledger shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// Bindings never dropped. Each still held its context pin, which the device releases as it
    /// drops (a binding borrows its device, so none can be alive by then).
    pub bindings: u64,
    /// Pages of a [`PagePool`](crate::PagePool) (alone, or in a page table) never given back
    /// before their pool dropped; their memory went with the pool's chunks.
    pub pages: u64,
}

impl Forgotten {
    /// True when nothing was forgotten.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// What a device held when it closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloseReport {
    /// The ledger after a last poll and retry. Non-zero bytes not explained by `progress`
    /// mean a token was forgotten (`mem::forget`): its bytes were never refunded.
    pub ledger: LedgerSnapshot,
    /// What the last poll and retry left.
    pub progress: Progress,
    /// Bindings and pages forgotten, which hold no bytes of the ledger.
    pub forgotten: Forgotten,
}

impl CloseReport {
    /// True when the device closed with nothing outstanding and nothing forgotten.
    pub fn is_clean(&self) -> bool {
        self.ledger.is_zero() && self.progress.deferred == 0 && self.forgotten.is_zero()
    }
}

/// A release waiting for its fence; `None`: recording the fence failed (the backend
/// panicked), so one is recorded before the release can go on.
type Deferred<B> = (
    Residual<<B as Backend>::Phys>,
    Option<<B as Backend>::Fence>,
);

/// Which queue a residual being torn down came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    Quarantine,
    Deferred,
}

/// A residual taken out of a queue by a poll or a retry and being torn down outside the lock:
/// still counted where it came from until it lands (released, quarantined or queued again),
/// so that no reading of the custody under-reports it.
#[derive(Debug)]
struct Busy {
    generation: Generation,
    from: Queue,
    holdings: Holdings,
    /// Its VA, while it still holds it.
    range: Option<(Addr, usize)>,
}

impl Busy {
    fn new<P>(residual: &Residual<P>, from: Queue) -> Self {
        let mut holdings = Holdings::default();
        holdings.add(residual);
        Self {
            generation: residual.generation,
            from,
            holdings,
            range: residual.holds_va().then(|| residual.range()),
        }
    }
}

/// The device's custody, under one lock so that a residual moving between its parts is always
/// seen in one of them: the quarantine, the deferred queue, and what is being torn down.
struct Books<B: Backend> {
    quarantine: Vec<Residual<B::Phys>>,
    deferred: Vec<Deferred<B>>,
    busy: Vec<Busy>,
}

impl<B: Backend> Books<B> {
    /// Takes every residual of `from` out, counting each as busy until it lands.
    fn take(&mut self, from: Queue) -> Vec<Deferred<B>> {
        let taken: Vec<Deferred<B>> = match from {
            Queue::Deferred => std::mem::take(&mut self.deferred),
            Queue::Quarantine => std::mem::take(&mut self.quarantine)
                .into_iter()
                .map(|r| (r, None))
                .collect(),
        };
        self.busy
            .extend(taken.iter().map(|(r, _)| Busy::new(r, from)));
        taken
    }

    /// A busy residual has landed: it is counted where it is now, or nowhere.
    fn landed(&mut self, generation: Generation) {
        if let Some(i) = self.busy.iter().position(|b| b.generation == generation) {
            self.busy.swap_remove(i);
        }
    }

    fn count(&self, queue: Queue) -> usize {
        let busy = self.busy.iter().filter(|b| b.from == queue).count();
        busy + match queue {
            Queue::Quarantine => self.quarantine.len(),
            Queue::Deferred => self.deferred.len(),
        }
    }
}

/// The default cap of a device's granule cache, in granules (see [`Device::set_cache_cap`]).
const DEFAULT_CACHE_GRANULES: u64 = 64;

/// One backend instance — a CUDA context, or the host — owning the VA bookkeeping, the byte
/// ledger, the quarantine and the deferred-release queue.
///
/// A device carries a **brand** `'id`, a lifetime unique to it (from [`generativity`]): its
/// tokens carry the same brand, so the compiler rejects combining them with another device's.
///
/// **Dropping a device is the one place that may wait.** Its context can outlive it (cudarc
/// shares the primary context), so releases still waiting for their fence are finished as the
/// device drops, each once its work has completed, and its quarantine is retried; nothing the
/// device holds is left behind while the context lives. Every other call returns at once.
///
/// ```
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::HostBackend;
///
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// let mut a = binding.reserve(10_000)?.commit().map_err(|e| e.cause)?;
/// a.as_mut_slice()[0] = 7;
/// a.release().complete().map_err(|e| e.to_string())?;
/// drop(binding);
/// assert!(device.close().is_clean());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A device cannot be dropped (or closed) while a token made through it lives:
///
/// ```compile_fail,E0505
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::SimBackend;
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
    /// Bindings alive (or forgotten).
    bindings: AtomicU64,
    /// Pages forgotten in pools that have dropped.
    forgotten_pages: AtomicU64,
    books: Mutex<Books<B>>,
    shared: SharedTotals,
    cache: Mutex<Vec<B::Phys>>,
    /// Cap on the cache's bytes.
    cache_cap: AtomicU64,
    /// Cap on owned bytes across the whole device.
    limit: u64,
    closed: bool,
}

impl<'id, B: Backend> Device<'id, B> {
    /// A device over `backend`, branded by `guard` (from [`make_guard!`](crate::make_guard)).
    pub fn new(guard: Guard<'id>, backend: B) -> Self {
        Self::with_budget(guard, backend, Budget::unlimited())
    }

    /// A device whose owned bytes, over all its bindings and its shared physical memory, stay
    /// within `budget` — shared memory is counted once, whichever tokens still map it.
    /// Its granule cache holds at most 64 granules.
    pub fn with_budget(guard: Guard<'id>, backend: B, budget: Budget) -> Self {
        let cache = backend.granularity() as u64 * DEFAULT_CACHE_GRANULES;
        Self::with_cache(guard, backend, budget, Budget::bytes(cache))
    }

    /// A device as [`with_budget`](Self::with_budget) makes it, whose cache of physical
    /// granules holds at most `cache` bytes (see [`set_cache_cap`](Self::set_cache_cap)).
    /// The cached bytes count in `budget`, and are trimmed when a commit needs them.
    pub fn with_cache(guard: Guard<'id>, backend: B, budget: Budget, cache: Budget) -> Self {
        Self {
            cache: Mutex::new(Vec::new()),
            cache_cap: AtomicU64::new(cache.limit()),
            brand: guard.into(),
            backend: Guarded::new(backend),
            ledger: Ledger::default(),
            failed_unpins: AtomicU64::new(0),
            bindings: AtomicU64::new(0),
            forgotten_pages: AtomicU64::new(0),
            books: Mutex::new(Books {
                quarantine: Vec::new(),
                deferred: Vec::new(),
                busy: Vec::new(),
            }),
            shared: SharedTotals::default(),
            limit: budget.limit(),
            closed: false,
        }
    }

    /// The allocation granularity: every token's length is a multiple of it.
    pub fn granularity(&self) -> usize {
        self.backend.granularity()
    }

    /// The ledger now.
    pub fn ledger(&self) -> LedgerSnapshot {
        self.ledger.snapshot()
    }

    /// What the device holds in its own custody: residuals quarantined after a dropped
    /// token's teardown failed, and releases waiting for their fence. A residual that a poll or
    /// a retry on another thread is tearing down right now is counted where it came from, with
    /// what it held when it was taken out: a reading never under-reports.
    pub fn custody(&self) -> Custody {
        let mut custody = Custody::default();
        {
            let books = lock(&self.books);
            for r in &books.quarantine {
                custody.quarantined.add(r);
            }
            for (r, _) in &books.deferred {
                custody.deferred.add(r);
            }
            for b in &books.busy {
                let into = match b.from {
                    Queue::Quarantine => &mut custody.quarantined,
                    Queue::Deferred => &mut custody.deferred,
                };
                into.absorb(&b.holdings);
            }
        }
        custody.shared = self.shared.holdings();
        custody
    }

    /// The VA ranges the device withholds from reuse: quarantined residuals that still hold
    /// their VA, releases waiting for their fence, and those being torn down right now.
    pub fn withheld_ranges(&self) -> Vec<(Addr, usize)> {
        let books = lock(&self.books);
        let queued = books
            .quarantine
            .iter()
            .chain(books.deferred.iter().map(|(r, _)| r));
        queued
            .filter(|r| r.holds_va())
            .map(|r| r.range())
            .chain(books.busy.iter().filter_map(|b| b.range))
            .collect()
    }

    /// How many times unpinning the context failed when a binding was dropped.
    pub fn failed_unpins(&self) -> u64 {
        self.failed_unpins.load(Ordering::Relaxed)
    }

    /// Releases what waited for a fence that has now completed. Never blocks.
    ///
    /// What it takes out of the queue stays counted in [`custody`](Self::custody) and in the
    /// `deferred` of every [`Progress`] until it has landed, so that a loop such as
    /// `while device.poll().deferred > 0` on another thread does not stop early.
    pub fn poll(&self) -> Progress {
        Scope::run::<B, _>(move || {
            // Fences are queried outside the lock: dropped tokens need it to queue themselves.
            let queued = lock(&self.books).take(Queue::Deferred);
            let mut released = 0;
            for (residual, fence) in queued {
                // A release whose fence could not be recorded gets one now: it covers the work
                // submitted before the release began.
                let fence = fence.or_else(|| self.backend.fence());
                if !fence.as_ref().is_some_and(|f| self.backend.fence_done(f)) {
                    let mut books = lock(&self.books);
                    books.landed(residual.generation);
                    books.deferred.push((residual, fence));
                    continue;
                }
                if let Some(fence) = fence {
                    self.backend.retire_fence(fence);
                }
                released += usize::from(self.teardown_busy(residual, Queue::Deferred));
            }
            self.progress(released)
        })
    }

    /// Retries every residual in the device's quarantine; what fails again stays there.
    pub fn retry_quarantine(&self) -> Progress {
        Scope::run::<B, _>(move || {
            let residuals = lock(&self.books).take(Queue::Quarantine);
            let mut released = 0;
            for (residual, _) in residuals {
                released += usize::from(self.teardown_busy(residual, Queue::Quarantine));
            }
            self.progress(released)
        })
    }

    /// Tears down a residual taken out of `from`: it lands released (refunded), or in the
    /// quarantine with what is left. Whether it was released.
    fn teardown_busy(&self, mut residual: Residual<B::Phys>, from: Queue) -> bool {
        let done = self.teardown(&mut residual).is_ok();
        let mut books = lock(&self.books);
        books.landed(residual.generation);
        // The quarantined count moves with the residual, under the same lock.
        if done && from == Queue::Quarantine {
            self.ledger.refund(Axis::Quarantined, 1);
        } else if !done {
            if from == Queue::Deferred {
                self.ledger.charge(Axis::Quarantined, 1);
            }
            books.quarantine.push(residual);
        }
        done
    }

    /// Proof that the context is lost, if the backend confirms it.
    pub fn confirm_context_lost(&self) -> Option<ContextLost<'id>> {
        self.backend
            .context_lost()
            .then(|| ContextLost::new(self.brand))
    }

    /// Discharges the device's quarantine and deferred queue: with the context lost, the driver
    /// freed everything they held. Returns how many residuals were discharged.
    pub fn discharge_all(&self, _proof: &ContextLost<'id>) -> usize {
        Scope::run::<B, _>(move || {
            // Counted as busy until each is forgotten, as a poll's would be.
            let (quarantined, deferred) = {
                let mut books = lock(&self.books);
                let quarantined = books.take(Queue::Quarantine);
                (quarantined, books.take(Queue::Deferred))
            };
            let n = quarantined.len() + deferred.len();
            self.forget_cache();
            for (residual, _) in quarantined {
                let generation = residual.generation;
                self.ledger.refund(Axis::Quarantined, 1);
                self.forget_residual(residual);
                lock(&self.books).landed(generation);
            }
            for (residual, fence) in deferred {
                let generation = residual.generation;
                self.forget_residual(residual);
                lock(&self.books).landed(generation);
                if let Some(fence) = fence {
                    self.backend.retire_fence(fence);
                }
            }
            n
        })
    }

    /// Closes the device after a last poll and quarantine retry, reporting what is left.
    /// Releases still waiting for their fence then wait for it as the device drops (see
    /// `Drop`): the one place where memtoken blocks on the device.
    pub fn close(mut self) -> CloseReport {
        self.closed = true;
        Scope::run::<B, _>(|| self.shutdown())
    }

    fn shutdown(&self) -> CloseReport {
        self.poll();
        self.trim_cache();
        let progress = self.retry_quarantine();
        CloseReport {
            ledger: self.ledger(),
            progress,
            forgotten: Forgotten {
                bindings: self.bindings.load(Ordering::Relaxed),
                pages: self.forgotten_pages.load(Ordering::Relaxed),
            },
        }
    }

    fn progress(&self, released: usize) -> Progress {
        let books = lock(&self.books);
        Progress {
            released,
            quarantined: books.count(Queue::Quarantine),
            deferred: books.count(Queue::Deferred),
        }
    }

    // ---- the cache of physical granules ----

    /// Bytes the cache may hold at most.
    pub fn cache_cap(&self) -> u64 {
        self.cache_cap.load(Ordering::Relaxed)
    }

    /// Sets the cache's cap to `bytes` (0: no cache, every granule an elastic region gives
    /// back is released at once), and trims the cache down to it. A region giving granules back
    /// at the same moment, on another thread, may still put them in under the old cap: they
    /// stay until the next trim.
    pub fn set_cache_cap(&self, bytes: u64) {
        let _scope = Scope::open::<B>();
        self.cache_cap.store(bytes, Ordering::Relaxed);
        self.trim_cache_to(bytes);
    }

    /// Bytes in the cache now (also [`LedgerSnapshot::cached_bytes`]).
    pub fn cached_bytes(&self) -> u64 {
        self.ledger.snapshot().cached_bytes
    }

    /// Releases every cached granule; returns the bytes released. A granule whose release fails
    /// goes to the device's quarantine, still owned.
    pub fn trim_cache(&self) -> u64 {
        self.trim_cache_to(0)
    }

    /// Takes a granule from the cache, if there is one: owned, mapped nowhere, and no work can
    /// still use it. It stays on the cached axis until the caller moves all it took off it at
    /// once ([`cache_taken`](Self::cache_taken)); the owned axis keeps it.
    #[inline]
    pub(crate) fn cache_pop(&self) -> Option<B::Phys> {
        lock(&self.cache).pop()
    }

    /// Moves `n` granules taken by [`cache_pop`](Self::cache_pop) off the cached axis.
    #[inline]
    pub(crate) fn cache_taken(&self, n: usize) {
        if n > 0 {
            self.refund(Axis::Cached, n * self.granularity());
        }
    }

    /// Makes room in the cache for up to `n` granules, as far as its cap allows (counted as
    /// cached from now on); returns how many. The caller puts that many there with
    /// [`cache_put`](Self::cache_put), and gives the room it does not use back with
    /// [`cache_taken`](Self::cache_taken).
    #[inline]
    pub(crate) fn cache_admit(&self, n: usize) -> usize {
        let g = self.granularity() as u64;
        let cap = self.cache_cap();
        self.ledger.charge_up_to(Axis::Cached, g, n as u64, cap) as usize
    }

    /// Puts an admitted granule into the cache. No work may still use it: it was unmapped only
    /// once no work covered by the backend's fences was pending (or mapped and unmapped within
    /// one call), so it is free for reuse at once — on CUDA, the fence of its last use has
    /// completed before it enters the cache.
    #[inline]
    pub(crate) fn cache_put(&self, phys: B::Phys) {
        lock(&self.cache).push(phys);
    }

    /// Releases cached granules until the cache holds at most `keep` bytes; returns the bytes
    /// that left the cache. No lock is held across a release.
    fn trim_cache_to(&self, keep: u64) -> u64 {
        Scope::run::<B, _>(move || {
            if self.backend.context_lost() {
                return 0;
            }
            let g = self.granularity();
            let mut trimmed = 0;
            while self.cached_bytes() > keep {
                let Some(phys) = lock(&self.cache).pop() else {
                    break;
                };
                self.refund(Axis::Cached, g);
                let _ = self.release_orphan(phys, g); // a failure is quarantined, still owned
                trimmed += g as u64;
            }
            trimmed
        })
    }

    /// Trims the cache so that `n` more owned bytes fit in the device's budget, if cached
    /// bytes stand in the way; whether any were trimmed.
    pub(crate) fn make_room(&self, n: usize) -> bool {
        let ledger = self.ledger.snapshot();
        let over = (ledger.owned_bytes + n as u64).saturating_sub(self.limit);
        over > 0
            && ledger.cached_bytes > 0
            && self.trim_cache_to(ledger.cached_bytes.saturating_sub(over)) > 0
    }

    /// Forgets the cache without backend calls (the context is lost, and the driver freed it).
    fn forget_cache(&self) {
        let n = std::mem::take(&mut *lock(&self.cache)).len() * self.granularity();
        self.refund(Axis::Cached, n);
        self.refund(Axis::Owned, n);
    }

    // ---- crate-internal: what tokens call ----

    /// The backend, every call contained (see [`crate::unwind`]).
    pub(crate) fn backend(&self) -> &Guarded<B> {
        &self.backend
    }

    /// Charges `n` owned bytes against the device's budget, trimming the cache once when cached
    /// granules stand in the way; or says why not.
    pub(crate) fn charge_owned_or_trim(&self, n: usize) -> Result<(), CommitFailure> {
        self.charge_owned(n).or_else(|e| match e {
            CommitFailure::DeviceBudget { .. } if self.make_room(n) => self.charge_owned(n),
            e => Err(e),
        })
    }

    /// Charges `n` owned bytes against the device's budget, or says why not.
    pub(crate) fn charge_owned(&self, n: usize) -> Result<(), CommitFailure> {
        self.ledger
            .try_charge(Axis::Owned, n as u64, self.limit)
            .map_err(|used| CommitFailure::DeviceBudget {
                requested: n as u64,
                used,
                limit: self.limit,
            })
    }

    pub(crate) fn charge(&self, axis: Axis, n: usize) {
        self.ledger.charge(axis, n as u64);
    }

    pub(crate) fn refund(&self, axis: Axis, n: usize) {
        self.ledger.refund(axis, n as u64);
    }

    pub(crate) fn next_generation(&self) -> Generation {
        Generation::next()
    }

    pub(crate) fn note_failed_unpin(&self) {
        self.failed_unpins.fetch_add(1, Ordering::Relaxed);
    }

    /// A binding was opened (its pin taken).
    pub(crate) fn note_bound(&self) {
        self.bindings.fetch_add(1, Ordering::Relaxed);
    }

    /// A binding was dropped.
    pub(crate) fn note_unbound(&self) {
        self.bindings.fetch_sub(1, Ordering::Relaxed);
    }

    /// A pool dropped with `n` of its pages never given back.
    pub(crate) fn note_forgotten_pages(&self, n: u64) {
        self.forgotten_pages.fetch_add(n, Ordering::Relaxed);
    }

    /// Gives back, in order, what `residual` still holds: unmap, drop the shared reference,
    /// release owned memory, free the VA. Each part that goes is refunded once and cleared; the
    /// first failure stops, leaving the rest held. No backend call once the context is lost.
    pub(crate) fn teardown(&self, r: &mut Residual<B::Phys>) -> Result<(), ReleaseFailure> {
        let h = &mut r.held;
        if h.is_empty() {
            return Ok(());
        }
        if self.backend.context_lost() {
            return Err(ReleaseFailure::ContextLost);
        }
        if h.mapped > 0 {
            self.backend.unmap(r.addr, h.mapped)?;
            self.refund(Axis::Mapped, h.mapped);
            h.mapped = 0;
        }
        for granule in h.granules.iter_mut().filter(|g| g.mapped) {
            self.backend.unmap(r.addr + granule.offset, granule.len)?;
            self.refund(Axis::Mapped, granule.len);
            granule.mapped = false;
        }
        if let Some(shared) = h.shared.take() {
            self.unshare(shared);
        }
        if let Some((phys, len)) = h.phys {
            self.backend.release(phys, len)?;
            h.phys = None;
            self.refund(Axis::Owned, len);
        }
        // Another process's memory: this process's handles on it go, nothing was owned here.
        while let Some(&(phys, len)) = h.imported.last() {
            self.backend.release(phys, len)?;
            h.imported.pop();
        }
        while let Some(&granule) = h.granules.last() {
            self.backend.release(granule.phys, granule.len)?;
            h.granules.pop();
            self.refund(Axis::Owned, granule.len);
        }
        if h.reserved {
            self.backend.free(r.addr, r.len)?;
            h.reserved = false;
            self.refund(Axis::Reserved, r.len);
        }
        Ok(())
    }

    /// How many exports of this device's shared physical memory to other processes are
    /// outstanding: each holds a reference on the memory, so it lives until the export ends.
    pub fn outstanding_exports(&self) -> u64 {
        self.shared.exports()
    }

    /// The totals of this device's shared physical memory, through which every reference on it
    /// is made and given back.
    pub(crate) fn shared(&self) -> &SharedTotals {
        &self.shared
    }

    /// Gives a reference back once its mapping is gone; the last one releases the memory. A
    /// failed release quarantines the memory, still charged as owned.
    pub(crate) fn unshare(&self, shared: SharedPhys<B::Phys>) {
        if let Some(split) = self.shared.give_back(shared) {
            // Failures are quarantined.
            if let Some((body, len)) = split.body {
                let _ = self.release_orphan(body, len);
            }
            let _ = self.release_orphan(split.boundary.0, split.boundary.1);
        }
    }

    /// Releases physical memory no token owns any more; quarantines it if that fails, and
    /// says why.
    pub(crate) fn release_orphan(&self, phys: B::Phys, len: usize) -> Result<(), ReleaseFailure> {
        let mut orphan = Residual {
            generation: self.next_generation(),
            addr: 0,
            len: 0,
            held: Held::orphan(phys, len),
        };
        let result = self.teardown(&mut orphan);
        if result.is_err() {
            self.quarantine(orphan);
        }
        result
    }

    /// Refuses a call into a context that is lost, without making it.
    pub(crate) fn ensure_live(&self, op: Op, addr: Addr, len: usize) -> Result<(), BackendError> {
        if self.backend.context_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        Ok(())
    }

    /// Teardown for a token that was dropped: its fence is done (or it has none). Whatever fails
    /// goes to the quarantine. Returns whether everything was released.
    pub(crate) fn teardown_or_quarantine(&self, mut residual: Residual<B::Phys>) -> bool {
        if self.teardown(&mut residual).is_ok() {
            return true;
        }
        self.quarantine(residual);
        false
    }

    /// Puts a residual into the device's quarantine, counting it.
    pub(crate) fn quarantine(&self, residual: Residual<B::Phys>) {
        self.ledger.charge(Axis::Quarantined, 1);
        lock(&self.books).quarantine.push(residual);
    }

    /// Takes a dropped token's residual: released now if its fence is done, else queued.
    pub(crate) fn dispose(&self, residual: Residual<B::Phys>, wait: Wait<B::Fence>) {
        match wait {
            Wait::Nothing => {}
            Wait::On(fence) if self.backend.fence_done(&fence) => {
                self.backend.retire_fence(fence);
            }
            Wait::On(fence) => return self.defer(residual, Some(fence)),
            Wait::Unrecorded => return self.defer(residual, None),
        }
        self.teardown_or_quarantine(residual);
    }

    /// Queues a release behind its fence (`None`: one is recorded at the next poll).
    fn defer(&self, residual: Residual<B::Phys>, fence: Option<B::Fence>) {
        lock(&self.books).deferred.push((residual, fence));
    }

    /// Adds an already-counted quarantined residual (a dropped `Quarantined` token) to the list.
    pub(crate) fn adopt_quarantined(&self, residual: Residual<B::Phys>) {
        lock(&self.books).quarantine.push(residual);
    }

    /// Refunds every part of a residual whose context is lost, without backend calls.
    pub(crate) fn forget_residual(&self, r: Residual<B::Phys>) {
        let h = r.held;
        self.refund(Axis::Mapped, h.mapped_bytes());
        self.refund(Axis::Owned, h.granules.iter().map(|g| g.len).sum());
        if let Some(split) = h.shared.and_then(|s| self.shared.give_back(s)) {
            self.refund(Axis::Owned, split.len());
        }
        self.refund(Axis::Owned, h.phys.map_or(0, |(_, len)| len));
        if h.reserved {
            self.refund(Axis::Reserved, r.len);
        }
    }
}

impl<D: Driver> Device<'_, CudaBackend<D>> {
    /// Releases from now on wait for the work on `stream` too: every fence the device's
    /// backend records covers it (see [`CudaBackend::cover_stream`]). Typed views do this for
    /// the streams they are used on; this is the way for raw pointers.
    ///
    /// # Safety
    ///
    /// As for [`CudaBackend::cover_stream`]: `stream` is 0 or a live stream of the device's
    /// context, and stays live until the device is dropped.
    pub unsafe fn cover_stream(&self, stream: Stream) {
        // SAFETY: the caller's promise is the one `cover_stream` asks for.
        unsafe { self.backend.raw().cover_stream(stream) }
    }
}

#[cfg(feature = "cuda")]
impl Device<'_, CudaBackend<SysDriver>> {
    /// Releases from now on wait for the work on the cudarc `stream` too (see
    /// [`CudaBackend::cover`]); the device keeps the stream alive meanwhile.
    ///
    /// # Errors
    ///
    /// [`Cause::Violation`] if the stream belongs to another context.
    pub fn cover(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Result<(), BackendError> {
        self.backend.raw().cover(stream)
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
        let deferred = std::mem::take(&mut lock(&self.books).deferred);
        for (residual, fence) in deferred {
            let fence = fence.or_else(|| self.backend.fence());
            let lost = self.backend.context_lost();
            let done = !lost && fence.as_ref().is_some_and(|f| self.backend.wait_fence(f));
            if let Some(fence) = fence {
                self.backend.retire_fence(fence);
            }
            // Work never known to have finished: its memory is left to the driver, never
            // freed under it.
            if done {
                self.teardown_or_quarantine(residual);
            }
        }
        if self.backend.context_lost() {
            self.forget_cache();
        } else {
            self.trim_cache();
            self.retry_quarantine();
            // A binding borrows the device: any still counted was forgotten, and its pin with
            // it. The pins go back here, so that a forgotten binding does not keep the context
            // retained after its device.
            for _ in 0..*self.bindings.get_mut() {
                if self.backend.unpin().is_err() {
                    self.note_failed_unpin();
                }
            }
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
