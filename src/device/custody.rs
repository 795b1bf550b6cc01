//! The device's custody and teardown: the quarantine, the deferred-release queue, and what a
//! poll or a retry is tearing down right now ([`Books`], under one lock), and the one teardown
//! of a residual that every release goes through.

use super::Device;
use super::report::{Progress, Queue};
use crate::backend::{Addr, Backend, BackendError, Cause, Op, lock};
use crate::error::ReleaseFailure;
use crate::ids::{ContextLost, Generation};
use crate::ledger::Axis;
use crate::residual::{Held, Holdings, Residual, SharedPhys};
use crate::state::Wait;
use crate::unwind::Scope;

/// A release waiting for its fence; `None`: recording the fence failed (the backend
/// panicked), so one is recorded before the release can go on.
type Deferred<B> = (
    Residual<<B as Backend>::Phys>,
    Option<<B as Backend>::Fence>,
);

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
pub(super) struct Books<B: Backend> {
    quarantine: Vec<Residual<B::Phys>>,
    /// Memory exposed to a peer that never said it was done with it: withheld for good, never
    /// retried, with the peer's name (see [`Device::withheld_for_peers`]).
    for_peers: Vec<(Residual<B::Phys>, String)>,
    deferred: Vec<Deferred<B>>,
    busy: Vec<Busy>,
}

impl<B: Backend> Books<B> {
    /// Empty books.
    pub(super) fn new() -> Self {
        Self {
            quarantine: Vec::new(),
            for_peers: Vec::new(),
            deferred: Vec::new(),
            busy: Vec::new(),
        }
    }

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

    /// Takes the oldest deferred release out of the queue (busy until it lands), if any.
    fn take_one_deferred(&mut self) -> Option<Deferred<B>> {
        if self.deferred.is_empty() {
            return None;
        }
        let taken = self.deferred.remove(0);
        self.busy.push(Busy::new(&taken.0, Queue::Deferred));
        Some(taken)
    }

    /// A busy residual has landed: it is counted where it is now, or nowhere.
    fn landed(&mut self, generation: Generation) {
        if let Some(i) = self.busy.iter().position(|b| b.generation == generation) {
            self.busy.swap_remove(i);
        }
    }

    /// How many residuals `queue` holds, those taken out of it and still busy among them.
    pub(super) fn count(&self, queue: Queue) -> usize {
        let busy = self.busy.iter().filter(|b| b.from == queue).count();
        busy + match queue {
            Queue::Quarantine => self.quarantine.len(),
            Queue::Deferred => self.deferred.len(),
        }
    }

    /// What `queue` holds, those taken out of it and still busy counted with what they held
    /// when they were taken out.
    pub(super) fn holdings(&self, queue: Queue) -> Holdings {
        let mut holdings = Holdings::default();
        match queue {
            Queue::Quarantine => self.quarantine.iter().for_each(|r| holdings.add(r)),
            Queue::Deferred => self.deferred.iter().for_each(|(r, _)| holdings.add(r)),
        }
        for b in self.busy.iter().filter(|b| b.from == queue) {
            holdings.absorb(&b.holdings);
        }
        holdings
    }
}

impl<'id, B: Backend> Device<'id, B> {
    /// The VA ranges the device withholds from reuse: quarantined residuals that still hold
    /// their VA, releases waiting for their fence, and those being torn down right now.
    pub fn withheld_ranges(&self) -> Vec<(Addr, usize)> {
        let books = lock(&self.books);
        let queued = books
            .quarantine
            .iter()
            .chain(books.for_peers.iter().map(|(r, _)| r))
            .chain(books.deferred.iter().map(|(r, _)| r));
        queued
            .filter(|r| r.holds_va())
            .map(|r| r.range())
            .chain(books.busy.iter().filter_map(|b| b.range))
            .collect()
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

    /// Releases everything waiting for a fence, first waiting — blocking the calling thread,
    /// outside every lock of memtoken's, so other threads' calls (and drops) go on — for each
    /// one's work to finish. One of the few documented places that wait (with
    /// [`Allocation::wait`](crate::Allocation::wait) and a device's drop).
    ///
    /// # Errors
    ///
    /// [`ReleaseFailure::Stuck`](crate::error::ReleaseFailure::Stuck) if some wait cannot progress
    /// (a stream the fences cover captures, or the backend cannot wait): those releases stay
    /// queued for a later flush or poll, the others are done; nothing blocks for ever.
    pub fn flush(&self) -> Result<Progress, crate::error::ReleaseFailure> {
        Scope::run::<B, _>(move || {
            // What is done already lands first, without waiting (and stays available to other
            // threads' polls while this one waits below, one release at a time).
            let mut released = self.poll().released;
            let mut stuck = Vec::new();
            loop {
                let Some((residual, fence)) = lock(&self.books).take_one_deferred() else {
                    break;
                };
                let fence = fence.or_else(|| self.backend.fence());
                let waited = fence.as_ref().is_some_and(|f| self.backend.wait_fence(f));
                if !waited && !self.backend.context_lost() {
                    // Busy (so counted) until it goes back in the queue, after this flush.
                    stuck.push((residual, fence));
                    continue;
                }
                if let Some(fence) = fence {
                    self.backend.retire_fence(fence);
                }
                released += usize::from(self.teardown_busy(residual, Queue::Deferred));
            }
            let progress = self.progress(released);
            if stuck.is_empty() {
                return Ok(progress);
            }
            let mut books = lock(&self.books);
            for (residual, fence) in stuck {
                books.landed(residual.generation);
                books.deferred.push((residual, fence));
            }
            Err(crate::error::ReleaseFailure::Stuck)
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

    /// Gives back, in order, what `residual` still holds: unmap, drop the shared reference,
    /// release owned memory, free the VA. Each part that goes is refunded once and cleared; the
    /// first failure stops, leaving the rest held. No backend call once the context is lost.
    pub(crate) fn teardown(&self, r: &mut Residual<B::Phys>) -> Result<(), ReleaseFailure> {
        let h = &mut r.held;
        if h.is_empty() {
            return Ok(());
        }
        if self.backend.context_lost() {
            let (op, addr, len) = next_call(r);
            let lost = BackendError::new(op, addr, len, Cause::ContextLost);
            return Err(ReleaseFailure::Backend(Box::new(lost)));
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
        if self.backend.places_at_commit() {
            self.free_first(r)?;
        }
        let h = &mut r.held;
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

    /// On a mechanism whose memory lives with its reservation (CUDA's plain one) the memory
    /// goes with the free, so [`teardown`](Self::teardown) frees first, and the free releases
    /// it: the owned bytes stay charged until it has succeeded, and go with it.
    #[cold]
    #[inline(never)]
    fn free_first(&self, r: &mut Residual<B::Phys>) -> Result<(), ReleaseFailure> {
        if r.held.reserved {
            self.backend.free(r.addr, r.len)?;
            r.held.reserved = false;
            self.refund(Axis::Reserved, r.len);
            // The memory placed there went with it, released by the same call (see
            // `Backend::placed`): no release of its own, which could fail after it was gone.
            if let Some((_, len)) = r.held.phys.take() {
                self.refund(Axis::Owned, len);
            }
        }
        Ok(())
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
    pub(super) fn release_orphan(&self, phys: B::Phys, len: usize) -> Result<(), ReleaseFailure> {
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
    pub(super) fn quarantine(&self, residual: Residual<B::Phys>) {
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

    /// Withholds a residual for good: memory exposed to `peer`, which never said it was done
    /// with it (a transfer engine's peer may still read or write it). Counted as quarantined,
    /// never retried nor discharged, its VA and physical memory kept (the backend never hands
    /// the range out again, not even after the device drops).
    pub(crate) fn withhold_for_peer(&self, residual: Residual<B::Phys>, peer: String) {
        let (addr, len) = residual.range();
        self.backend.keep_for_good(addr, len);
        self.ledger.charge(Axis::Quarantined, 1);
        lock(&self.books).for_peers.push((residual, peer));
    }

    /// The memory withheld for good because a peer it was exposed to never said it was done
    /// with it (see `memtoken::nixl`): each range, its allocation and the peer.
    pub fn withheld_for_peers(&self) -> Vec<WithheldForPeer> {
        lock(&self.books)
            .for_peers
            .iter()
            .map(|(r, peer)| WithheldForPeer {
                addr: r.range().0,
                len: r.range().1,
                generation: r.generation(),
                peer: peer.clone(),
            })
            .collect()
    }

    /// Adds an already-counted quarantined residual (a dropped `Quarantined` token) to the list.
    pub(crate) fn adopt_quarantined(&self, residual: Residual<B::Phys>) {
        lock(&self.books).quarantine.push(residual);
    }

    /// Refunds every part of a residual whose context is lost, without backend calls.
    pub(super) fn forget_residual(&self, r: Residual<B::Phys>) {
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

    /// Finishes, in order, every release still waiting for its fence, each once its work has
    /// completed (waiting for it); what is never known to have finished is left to the driver.
    /// Only as the device drops (see `Drop`). Returns what it left to the driver: the residuals whose work was never known to have
    /// finished, in a context that is not lost (a lost one freed everything).
    pub(super) fn finish_deferred(&self) -> Holdings {
        let mut left = Holdings::default();
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
            } else if !self.backend.context_lost() {
                left.add(&residual);
            }
        }
        left
    }
}

/// The call a teardown of `r` would make first, as an error names it: the unmap of what is
/// mapped, else the release of physical memory, else the free of the VA.
fn next_call<P: Copy>(r: &Residual<P>) -> (Op, Addr, usize) {
    let h = &r.held;
    if h.mapped > 0 {
        return (Op::Unmap, r.addr, h.mapped);
    }
    if let Some(g) = h.granules.iter().find(|g| g.mapped) {
        return (Op::Unmap, r.addr + g.offset, g.len);
    }
    if let Some(shared) = &h.shared {
        return (Op::Release, r.addr, shared.split().len());
    }
    if h.owned_bytes() > 0 {
        return (Op::Release, r.addr, h.owned_bytes());
    }
    if let Some(&(_, len)) = h.imported.last() {
        return (Op::Release, r.addr, len);
    }
    (Op::Free, r.addr, r.len)
}

/// Memory a device withholds for good because a peer it was exposed to (a transfer engine's
/// remote agent) never said it was done with it: never reused, never unmapped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WithheldForPeer {
    /// The range's start.
    pub addr: Addr,
    /// Its length in bytes.
    pub len: usize,
    /// The allocation it belonged to.
    pub generation: crate::ids::Generation,
    /// The peer that may still touch it.
    pub peer: String,
}

#[cfg(test)]
mod tests {
    use super::WithheldForPeer;
    use crate::backend::HostBackend;
    use crate::{Budget, Device, make_guard};

    /// A token withheld for a peer (as the NIXL module withholds memory a peer never said it
    /// was done with) is listed by `withheld_for_peers` with its range, allocation and peer, and
    /// so is it in the close report, which is not clean. Fails if the list is not kept: the
    /// main mutation run builds no NIXL module, whose tests check the list too.
    #[test]
    fn a_token_withheld_for_a_peer_is_listed_with_its_peer() {
        make_guard!(guard);
        let device = Device::new(guard, HostBackend::with_defaults().unwrap());
        let binding = device.bind(Budget::unlimited()).unwrap();
        let g = device.granularity();
        let token = binding.reserve(g).unwrap().commit().unwrap();
        let (addr, generation) = (token.addr(), token.generation());
        token.withhold_for_peer("decode-0".to_string());
        let expected = vec![WithheldForPeer {
            addr,
            len: g,
            generation,
            peer: "decode-0".to_string(),
        }];
        assert_eq!(device.withheld_for_peers(), expected);
        drop(binding);
        let report = device.close();
        assert_eq!(report.withheld_for_peers, expected);
        assert!(!report.is_clean());
    }
}
