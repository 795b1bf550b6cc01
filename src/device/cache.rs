//! The device's cache of physical granules: what an elastic region gives back (a shrink, a
//! suspend) waits here, owned and mapped nowhere, and is reused before anything new is
//! created. [`GranuleCache`] holds the granules and the cap; the device's methods below move
//! the ledger's cached axis with them and release what leaves the cache.

use super::Device;
use crate::backend::Backend;
use crate::ledger::{Axis, Ledger};
use crate::sync::{AtomicU64, Mutex, Ordering, lock};
use crate::unwind::Scope;

/// The default cap of a device's granule cache, in granules (see [`Device::set_cache_cap`]).
pub(super) const DEFAULT_CACHE_GRANULES: u64 = 64;

/// Physical granules, each owned, mapped nowhere, and free for reuse at once, with a cap on
/// their bytes. Its bytes are counted on the cached axis of the device's ledger (and, as every
/// owned granule, on the owned axis); [`admit`](Self::admit) is the one place that charges
/// the cached axis, within the cap.
pub(super) struct GranuleCache<P> {
    granules: Mutex<Vec<P>>,
    /// Cap on the cache's bytes.
    cap: AtomicU64,
}

impl<P> GranuleCache<P> {
    /// An empty cache holding at most `cap` bytes.
    pub(super) fn new(cap: u64) -> Self {
        Self {
            granules: Mutex::new(Vec::new()),
            cap: AtomicU64::new(cap),
        }
    }

    /// Bytes the cache may hold at most.
    #[inline]
    pub(super) fn cap(&self) -> u64 {
        self.cap.load(Ordering::Relaxed)
    }

    /// Sets the cap to `bytes`; trimming down to it is the device's.
    pub(super) fn set_cap(&self, bytes: u64) {
        self.cap.store(bytes, Ordering::Relaxed);
    }

    /// Charges room for up to `n` granules of `unit` bytes on the cached axis of `ledger`, as
    /// far as the cap allows; returns how many.
    #[inline]
    pub(super) fn admit(&self, ledger: &Ledger, unit: u64, n: usize) -> usize {
        ledger.charge_up_to(Axis::Cached, unit, n as u64, self.cap()) as usize
    }

    /// Takes a granule out, if there is one.
    #[inline]
    pub(super) fn pop(&self) -> Option<P> {
        lock(&self.granules).pop()
    }

    /// Moves up to `n` granules out, to the end of `into`, under one lock; how many.
    #[inline]
    pub(super) fn take_into(&self, n: usize, into: &mut Vec<P>) -> usize
    where
        P: Copy,
    {
        let mut granules = lock(&self.granules);
        let at = granules.len().saturating_sub(n);
        into.extend_from_slice(&granules[at..]);
        let taken = granules.len() - at;
        granules.truncate(at);
        taken
    }

    /// Puts `from` in (their room admitted) under one lock.
    #[inline]
    pub(super) fn put(&self, from: &[P])
    where
        P: Copy,
    {
        lock(&self.granules).extend_from_slice(from);
    }

    /// Takes every granule out.
    pub(super) fn take_all(&self) -> Vec<P> {
        std::mem::take(&mut *lock(&self.granules))
    }
}

/// The mapped tails of the device's elastic regions: a cap on their bytes (on the ledger's
/// tail axis), and the requests to give them back, counted: a region that sees the count move
/// gives its tail back at its next shrink.
pub(super) struct Tails {
    cap: AtomicU64,
    requests: AtomicU64,
}

impl Tails {
    /// No cap of the device's own (each region's cap governs), and no request yet.
    pub(super) fn new() -> Self {
        Self {
            cap: AtomicU64::new(u64::MAX),
            requests: AtomicU64::new(0),
        }
    }
}

impl<B: Backend> Device<'_, B> {
    /// The most bytes the mapped tails of all this device's regions keep together (no cap of
    /// the device's own unless set: each region's [`tail_cap`](crate::region::Region::tail_cap) governs).
    pub fn tail_cap(&self) -> u64 {
        self.tails.cap.load(Ordering::Relaxed)
    }

    /// Sets the most bytes the mapped tails of all this device's regions keep together: a
    /// shrink keeps granules mapped in its region's tail only while they fit under this cap
    /// and the region's own (the others are unmapped and given back, as without a tail). A
    /// lower cap asks the tails back ([`ask_tails_back`](Self::ask_tails_back)).
    pub fn set_tail_cap(&self, bytes: u64) {
        let old = self.tails.cap.swap(bytes, Ordering::SeqCst);
        // Lowered: ask, whatever the tails hold now — a shrink charging under the old cap at
        // this moment answers at its next shrink.
        if bytes < old {
            self.ask_tails_back();
        }
    }

    /// Bytes in the mapped tails of this device's regions now (also
    /// [`LedgerSnapshot::tail_bytes`](crate::report::LedgerSnapshot::tail_bytes)).
    pub fn tail_bytes(&self) -> u64 {
        self.ledger.snapshot().tail_bytes
    }

    /// Asks every region of this device to give its mapped tail back. A tail belongs to its
    /// region, which only its owner's `&mut` changes: no other thread can unmap it under a
    /// growth. So the region answers itself, at its next [`shrink`](crate::region::Region::shrink) —
    /// it keeps no tail then, and its tail is given back as any shrink's granules (to the
    /// granule cache while its cap allows, else released) — or as it is suspended or released;
    /// a growth before that takes the tail first, as always. The request is advice: a shrink
    /// that cannot unmap now (work may still use the memory, or the context is lost) keeps its
    /// tail as its cap allows and answers at a later shrink. [`trim_cache`](Self::trim_cache)
    /// asks too, and so do a commit or a growth that the device's budget refuses while tails
    /// hold bytes, and a lower [`set_tail_cap`](Self::set_tail_cap); a binding's own budget
    /// asks its own regions only.
    pub fn ask_tails_back(&self) {
        self.tails.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// How many times the tails were asked back (see [`ask_tails_back`](Self::ask_tails_back)).
    #[inline]
    pub(crate) fn tail_requests(&self) -> u64 {
        self.tails.requests.load(Ordering::Relaxed)
    }

    /// Charges up to `n` granules that a shrink keeps mapped in its region's tail, as far as
    /// the device's tail cap allows; returns how many.
    #[inline]
    pub(crate) fn tail_keep(&self, n: usize) -> usize {
        let g = self.granularity() as u64;
        self.ledger
            .charge_up_to(Axis::Tail, g, n as u64, self.tail_cap()) as usize
    }

    /// `n` granules left a region's tail: taken back by a growth, unmapped, or gone with the
    /// region.
    #[inline]
    pub(crate) fn tail_left(&self, n: usize) {
        if n > 0 {
            self.refund(Axis::Tail, n * self.granularity());
        }
    }

    /// `n` granules a failed growth took from its region's tail are back in it (whatever the
    /// cap: they were there before); if the tails are over the cap now (others took the room
    /// meanwhile), they are asked back.
    #[cold]
    pub(crate) fn tail_returned(&self, n: usize) {
        self.charge(Axis::Tail, n * self.granularity());
        if self.ledger.snapshot().tail_bytes > self.tail_cap() {
            self.ask_tails_back();
        }
    }

    /// Asks the tails back if a budget's refusal could be theirs.
    #[cold]
    pub(crate) fn ask_tails_back_if_held(&self) {
        if self.ledger.snapshot().tail_bytes > 0 {
            self.ask_tails_back();
        }
    }

    /// Bytes the cache may hold at most.
    pub fn cache_cap(&self) -> u64 {
        self.cache.cap()
    }

    /// Sets the cache's cap to `bytes` (0: no cache, every granule an elastic region gives
    /// back is released at once), and trims the cache down to it. A region giving granules back
    /// at the same moment, on another thread, may still put them in under the old cap: they
    /// stay until the next trim.
    pub fn set_cache_cap(&self, bytes: u64) {
        self.set_cache_cap_trimmed(bytes);
    }

    /// [`set_cache_cap`](Self::set_cache_cap), which returns the bytes its trim took out of the
    /// cache (for the loom model of a growth racing it).
    pub(super) fn set_cache_cap_trimmed(&self, bytes: u64) -> u64 {
        let _scope = Scope::open::<B>();
        self.cache.set_cap(bytes);
        self.trim_cache_to(bytes)
    }

    /// Bytes in the cache now (also
    /// [`LedgerSnapshot::cached_bytes`](crate::report::LedgerSnapshot::cached_bytes)).
    pub fn cached_bytes(&self) -> u64 {
        self.ledger.snapshot().cached_bytes
    }

    /// Releases every cached granule; returns the bytes released. A granule whose release fails
    /// goes to the device's quarantine, still owned. Asks the regions' mapped tails back too
    /// ([`ask_tails_back`](Self::ask_tails_back)): each comes back, through the cache, at its
    /// region's next shrink.
    pub fn trim_cache(&self) -> u64 {
        self.ask_tails_back_if_held();
        self.trim_cache_to(0)
    }

    /// Takes up to `n` granules from the cache, to the end of `into` (one lock); how many. Each
    /// is owned, mapped nowhere, and no work can still use it. They stay on the cached axis
    /// until the caller moves those it keeps off it at once ([`cache_taken`](Self::cache_taken))
    /// and puts the others back ([`cache_put`](Self::cache_put)); the owned axis keeps them.
    #[inline]
    pub(super) fn cache_take(&self, n: usize, into: &mut Vec<B::Phys>) -> usize {
        if n == 0 {
            return 0;
        }
        self.cache.take_into(n, into)
    }

    /// Moves `n` granules taken by [`cache_pop`](Self::cache_pop) off the cached axis.
    #[inline]
    pub(super) fn cache_taken(&self, n: usize) {
        if n > 0 {
            self.refund(Axis::Cached, n * self.granularity());
        }
    }

    /// Makes room in the cache for up to `n` granules, as far as its cap allows (counted as
    /// cached from now on); returns how many. The caller puts that many there with
    /// [`cache_put`](Self::cache_put), and gives the room it does not use back with
    /// [`cache_taken`](Self::cache_taken).
    #[inline]
    pub(super) fn cache_admit(&self, n: usize) -> usize {
        let g = self.granularity() as u64;
        self.cache.admit(&self.ledger, g, n)
    }

    /// Puts admitted granules (or granules [`cache_take`](Self::cache_take)n and not mapped)
    /// into the cache, under one lock. No work may still use them: each was unmapped only once
    /// no work covered by the backend's fences was pending (or mapped and unmapped within one
    /// call), so it is free for reuse at once — on CUDA, the fence of its last use has completed
    /// before it enters the cache.
    #[inline]
    pub(super) fn cache_put(&self, granules: &[B::Phys]) {
        self.cache.put(granules);
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
                let Some(phys) = self.cache.pop() else {
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
    pub(super) fn forget_cache(&self) {
        let n = self.cache.take_all().len() * self.granularity();
        self.refund(Axis::Cached, n);
        self.refund(Axis::Owned, n);
    }
}
