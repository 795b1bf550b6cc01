//! [`Device`]: one backend instance with its brand, ledger, quarantine and deferred-release queue.

use crate::backend::{Addr, Backend, BackendError, Cause, Op, lock};
use crate::binding::{Binding, Budget};
use crate::error::{CommitFailure, ReleaseFailure};
use crate::ledger::{Axis, Ledger, LedgerSnapshot};
use crate::residual::{Holdings, Residual, SharedKey};
use generativity::{Guard, Id};
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The identity of one allocation, from a per-device counter: never derived from an address, so
/// a reused VA range never makes a stale allocation look alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(NonZeroU64);

impl Generation {
    /// The number behind it.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

/// Proof that a device's context is gone: everything it held was freed by the driver, so
/// quarantined residuals may be discharged. Branded: it discharges only its own device's tokens.
#[derive(Debug)]
pub struct ContextGone<'id> {
    _brand: Id<'id>,
}

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
    /// Shared physical allocations (prefixes): `count` of them, their `owned_bytes` (each
    /// charged once, whatever the number of mappings), and the mapping references on them
    /// (`shared_refs`). One is released when its last reference goes.
    pub shared: Holdings,
}

/// A physical allocation mapped by several tokens (a shared prefix), released with its last
/// reference.
#[derive(Debug)]
struct SharedEntry<P> {
    phys: P,
    len: usize,
    refs: usize,
}

/// What a device held when it closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloseReport {
    /// The ledger after a last poll and retry. Non-zero bytes not explained by `progress`
    /// mean a token was forgotten (`mem::forget`): its bytes were never refunded.
    pub ledger: LedgerSnapshot,
    /// What the last poll and retry left.
    pub progress: Progress,
}

impl CloseReport {
    /// True when the device closed with nothing outstanding.
    pub fn is_clean(&self) -> bool {
        self.ledger.is_zero() && self.progress.deferred == 0
    }
}

type Deferred<B> = (Residual<<B as Backend>::Phys>, <B as Backend>::Fence);

/// One backend instance — a CUDA context, or the host — owning the VA bookkeeping, the byte
/// ledger, the quarantine and the deferred-release queue.
///
/// A device carries a **brand** `'id`, a lifetime unique to it (from [`generativity`]): its
/// tokens carry the same brand, so the compiler rejects combining them with another device's.
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
/// let device = Device::new(guard, SimBackend::default());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let token = binding.reserve(1).unwrap();
/// drop(device);
/// drop(token);
/// ```
pub struct Device<'id, B: Backend> {
    brand: Id<'id>,
    backend: B,
    ledger: Ledger,
    next_generation: AtomicU64,
    failed_unpins: AtomicU64,
    quarantine: Mutex<Vec<Residual<B::Phys>>>,
    deferred: Mutex<Vec<Deferred<B>>>,
    shared: Mutex<HashMap<SharedKey, SharedEntry<B::Phys>>>,
    /// Cap on owned bytes across the whole device.
    limit: u64,
    closed: bool,
}

impl<'id, B: Backend> Device<'id, B> {
    /// A device over `backend`, branded by `guard` (from [`make_guard!`](crate::make_guard)).
    pub fn new(guard: Guard<'id>, backend: B) -> Self {
        Self::with_budget(guard, backend, Budget::unlimited())
    }

    /// A device whose owned bytes, over all its bindings and shared prefixes, stay within
    /// `budget` — also after a prefix's owner has gone and its sharers keep the memory.
    pub fn with_budget(guard: Guard<'id>, backend: B, budget: Budget) -> Self {
        Self {
            brand: guard.into(),
            backend,
            ledger: Ledger::default(),
            next_generation: AtomicU64::new(1),
            failed_unpins: AtomicU64::new(0),
            quarantine: Mutex::new(Vec::new()),
            deferred: Mutex::new(Vec::new()),
            shared: Mutex::new(HashMap::new()),
            limit: budget.limit(),
            closed: false,
        }
    }

    /// Pins the context and opens a [`Binding`] with `budget` on owned bytes.
    ///
    /// # Errors
    ///
    /// The backend's error if the context cannot be pinned.
    pub fn bind(&self, budget: Budget) -> Result<Binding<'_, 'id, B>, BackendError> {
        self.ensure_live(Op::Pin, 0, 0)?;
        self.backend.pin()?;
        Ok(Binding::new(self, budget))
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
    /// token's teardown failed, and releases waiting for their fence.
    pub fn custody(&self) -> Custody {
        let mut custody = Custody::default();
        for r in lock(&self.quarantine).iter() {
            custody.quarantined.add(r);
        }
        for (r, _) in lock(&self.deferred).iter() {
            custody.deferred.add(r);
        }
        for entry in lock(&self.shared).values() {
            custody.shared.count += 1;
            custody.shared.owned_bytes += entry.len as u64;
            custody.shared.shared_refs += entry.refs as u64;
        }
        custody
    }

    /// The VA ranges the device withholds from reuse: quarantined residuals that still hold
    /// their VA, and releases waiting for their fence.
    pub fn withheld_ranges(&self) -> Vec<(Addr, usize)> {
        let quarantined = lock(&self.quarantine);
        let deferred = lock(&self.deferred);
        quarantined
            .iter()
            .chain(deferred.iter().map(|(r, _)| r))
            .filter(|r| r.reserved)
            .map(|r| (r.addr, r.len))
            .collect()
    }

    /// How many times unpinning the context failed when a binding was dropped.
    pub fn failed_unpins(&self) -> u64 {
        self.failed_unpins.load(Ordering::Relaxed)
    }

    /// Releases what waited for a fence that has now completed. Never blocks.
    pub fn poll(&self) -> Progress {
        // Fences are queried outside the lock: dropped tokens need it to queue themselves.
        let queued = std::mem::take(&mut *lock(&self.deferred));
        let (ready, waiting): (Vec<Deferred<B>>, Vec<Deferred<B>>) = queued
            .into_iter()
            .partition(|(_, fence)| self.backend.fence_done(fence));
        lock(&self.deferred).extend(waiting);
        let mut released = 0;
        for (residual, fence) in ready {
            self.backend.retire_fence(fence);
            released += usize::from(self.teardown_or_quarantine(residual));
        }
        self.progress(released)
    }

    /// Retries every residual in the device's quarantine; what fails again stays there.
    pub fn retry_quarantine(&self) -> Progress {
        let residuals = std::mem::take(&mut *lock(&self.quarantine));
        let mut released = 0;
        for mut residual in residuals {
            if self.teardown(&mut residual).is_ok() {
                self.ledger.refund(Axis::Quarantined, 1);
                released += 1;
            } else {
                lock(&self.quarantine).push(residual);
            }
        }
        self.progress(released)
    }

    /// Proof that the context is gone, if the backend confirms it.
    pub fn confirm_context_gone(&self) -> Option<ContextGone<'id>> {
        self.backend
            .context_lost()
            .then_some(ContextGone { _brand: self.brand })
    }

    /// Discharges the device's quarantine and deferred queue: with the context gone, the driver
    /// freed everything they held. Returns how many residuals were discharged.
    pub fn discharge_all(&self, _proof: &ContextGone<'id>) -> usize {
        let quarantined = std::mem::take(&mut *lock(&self.quarantine));
        let deferred = std::mem::take(&mut *lock(&self.deferred));
        let n = quarantined.len() + deferred.len();
        for residual in quarantined {
            self.ledger.refund(Axis::Quarantined, 1);
            self.forget_residual(residual);
        }
        for (residual, fence) in deferred {
            self.backend.retire_fence(fence);
            self.forget_residual(residual);
        }
        n
    }

    /// Closes the device after a last poll and quarantine retry, reporting what is left.
    pub fn close(mut self) -> CloseReport {
        self.closed = true;
        self.shutdown()
    }

    fn shutdown(&self) -> CloseReport {
        self.poll();
        let progress = self.retry_quarantine();
        CloseReport {
            ledger: self.ledger(),
            progress,
        }
    }

    fn progress(&self, released: usize) -> Progress {
        Progress {
            released,
            quarantined: lock(&self.quarantine).len(),
            deferred: lock(&self.deferred).len(),
        }
    }

    // ---- crate-internal: what tokens call ----

    pub(crate) fn backend(&self) -> &B {
        &self.backend
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
        let n = self.next_generation.fetch_add(1, Ordering::Relaxed);
        Generation(NonZeroU64::new(n).expect("generation counter starts at 1"))
    }

    pub(crate) fn note_failed_unpin(&self) {
        self.failed_unpins.fetch_add(1, Ordering::Relaxed);
    }

    /// Gives back, in order, what `residual` still holds: unmap, drop the shared reference,
    /// release owned memory, free the VA. Each part that goes is refunded once and cleared; the
    /// first failure stops, leaving the rest held. No backend call once the context is gone.
    pub(crate) fn teardown(&self, r: &mut Residual<B::Phys>) -> Result<(), ReleaseFailure> {
        if r.is_empty() {
            return Ok(());
        }
        if self.backend.context_lost() {
            return Err(ReleaseFailure::ContextGone);
        }
        if r.mapped > 0 {
            self.backend.unmap(r.addr, r.mapped)?;
            self.refund(Axis::Mapped, r.mapped);
            r.mapped = 0;
        }
        if let Some(key) = r.shared.take() {
            self.unshare(key);
        }
        if let Some((phys, len)) = r.phys {
            self.backend.release(phys, len)?;
            r.phys = None;
            self.refund(Axis::Owned, len);
        }
        if r.reserved {
            self.backend.free(r.addr, r.len)?;
            r.reserved = false;
            self.refund(Axis::Reserved, r.len);
        }
        Ok(())
    }

    /// Registers physical memory as shared, with one reference (its first mapping).
    pub(crate) fn share_new(&self, key: SharedKey, phys: B::Phys, len: usize) {
        let entry = SharedEntry { phys, len, refs: 1 };
        let fresh = lock(&self.shared).insert(key, entry).is_none();
        assert!(fresh, "shared key {key} registered twice");
    }

    /// Takes one more reference on shared memory, for a new mapping of it.
    pub(crate) fn share_ref(&self, key: SharedKey) -> (B::Phys, usize) {
        let mut shared = lock(&self.shared);
        let entry = shared.get_mut(&key).expect("a live prefix keeps its entry");
        entry.refs += 1;
        (entry.phys, entry.len)
    }

    /// The shared memory's handle and length, without taking a reference.
    pub(crate) fn share_get(&self, key: SharedKey) -> (B::Phys, usize) {
        let shared = lock(&self.shared);
        let entry = shared.get(&key).expect("a live mapping keeps its entry");
        (entry.phys, entry.len)
    }

    /// Releases physical memory no token owns any more; quarantines it if that fails, and
    /// says why.
    pub(crate) fn release_orphan(&self, phys: B::Phys, len: usize) -> Result<(), ReleaseFailure> {
        let mut orphan = Residual::phys(self.next_generation(), phys, len);
        let result = self.teardown(&mut orphan);
        if result.is_err() {
            self.quarantine(orphan);
        }
        result
    }

    /// Refuses a call into a context that is gone, without making it.
    pub(crate) fn ensure_live(&self, op: Op, addr: Addr, len: usize) -> Result<(), BackendError> {
        if self.backend.context_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        Ok(())
    }

    /// References on shared memory now.
    pub(crate) fn share_refs(&self, key: SharedKey) -> usize {
        lock(&self.shared).get(&key).map_or(0, |e| e.refs)
    }

    /// Drops one reference; the last one releases the memory (outside the lock). A failed
    /// release quarantines the memory, still charged as owned.
    pub(crate) fn unshare(&self, key: SharedKey) {
        let last = {
            let mut shared = lock(&self.shared);
            let entry = shared.get_mut(&key).expect("a reference keeps its entry");
            entry.refs -= 1;
            if entry.refs > 0 {
                return;
            }
            shared.remove(&key).expect("present")
        };
        let _ = self.release_orphan(last.phys, last.len); // a failure is quarantined
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
        lock(&self.quarantine).push(residual);
    }

    /// Takes a dropped token's residual: released now if its fence is done, else queued.
    pub(crate) fn dispose(&self, residual: Residual<B::Phys>, fence: Option<B::Fence>) {
        if let Some(fence) = fence {
            if !self.backend.fence_done(&fence) {
                lock(&self.deferred).push((residual, fence));
                return;
            }
            self.backend.retire_fence(fence);
        }
        self.teardown_or_quarantine(residual);
    }

    /// Adds an already-counted quarantined residual (a dropped `Quarantined` token) to the list.
    pub(crate) fn adopt_quarantined(&self, residual: Residual<B::Phys>) {
        lock(&self.quarantine).push(residual);
    }

    /// Refunds every part of a residual whose context is gone, without backend calls.
    pub(crate) fn forget_residual(&self, r: Residual<B::Phys>) {
        self.refund(Axis::Mapped, r.mapped);
        if let Some(key) = r.shared {
            let mut shared = lock(&self.shared);
            let entry = shared.get_mut(&key).expect("a reference keeps its entry");
            entry.refs -= 1;
            if entry.refs == 0 {
                let len = shared.remove(&key).expect("present").len;
                self.refund(Axis::Owned, len);
            }
        }
        self.refund(Axis::Owned, r.owned_bytes());
        if r.reserved {
            self.refund(Axis::Reserved, r.len);
        }
    }
}

impl<B: Backend> Drop for Device<'_, B> {
    fn drop(&mut self) {
        if !self.closed {
            self.shutdown();
        }
        // Releases still waiting for their fence are left to the backend's own teardown (on
        // CUDA, the context's); their fences are given back so that no event outlives it.
        for (_, fence) in std::mem::take(&mut *lock(&self.deferred)) {
            self.backend.retire_fence(fence);
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
