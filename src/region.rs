//! Elastic regions — a policy on top of allocations: [`Region`], one reserved range whose
//! committed part grows and shrinks by granules at its tail. Each granule is a physical
//! allocation of its own (every mapping maps one whole allocation from offset 0), so granules
//! come and go one by one, through the device's cache of physical granules.
//!
//! Guide: [`guide::regions`](crate::guide::regions).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use crate::allocation::Allocation;
use crate::backend::{Ability, Backend, BackendError, HostVisible, Op};
use crate::device::{GiveBack, Growth};
use crate::error::{CommitFailure, GrowError, ShrinkError};
use crate::residual::{Granule, Held};
use crate::state::Wait;
use crate::state::{
    Live, Reserved, Retired, Retiring, State,
    sealed::{self, Repr},
};
use crate::token::{Core, host_slice, host_slice_mut};
use crate::unwind::Scope;

/// An elastic region: one reserved range whose committed part — from its start to its
/// [`committed_len`](Allocation::committed_len) — grows and shrinks by granules at its tail.
/// Made from a reservation by [`Allocation::into_region`].
///
/// - [`grow`](Allocation::grow) is all-or-nothing: on failure every granule the call mapped is
///   unmapped and given back, and the region comes back inside the error; a granule that
///   cannot be unmapped stays in the region, owned and withheld (the region cannot grow over
///   it) until [`reclaim`](Allocation::reclaim) frees it.
/// - [`shrink`](Allocation::shrink) unmaps granules at the tail and gives them to the device's
///   cache of physical granules (released instead once the cache is full), from which the next
///   growth takes them before it creates anything. A granule that cannot be unmapped stays
///   withheld, as above.
/// - Budgets and the ledger move granule by granule: a committed granule is charged as owned and
///   mapped, and to the region's binding; a cached one is owned by the device alone.
/// - Nothing is unmapped while work that may use the region still runs:
///   [`shrink`](Allocation::shrink) and [`reclaim`](Allocation::reclaim) refuse with
///   [`ShrinkError::Pending`] then.
/// - Memory a growth maps is uninitialised: a granule from the cache keeps the bytes of its
///   last use, by any region of the device.
///
/// Host slices cover the committed part only and borrow the region, so it cannot shrink while
/// one lives:
///
/// ```compile_fail,E0502
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut region = binding.reserve(4 * 4096).unwrap().into_region();
/// region.grow(2).unwrap();
/// let bytes = region.as_slice();
/// region.shrink(1).unwrap();
/// println!("{}", bytes[4096]);
/// ```
///
/// and a released region is gone:
///
/// ```compile_fail,E0382
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut region = binding.reserve(4 * 4096).unwrap().into_region();
/// region.grow(2).unwrap();
/// let releasing = region.release();
/// region.grow(1).unwrap();
/// ```
///
/// ```
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::HostBackend;
///
/// make_guard!(guard);
/// let device = Device::new(guard, HostBackend::with_defaults()?);
/// let binding = device.bind(Budget::unlimited())?;
/// let g = device.granularity();
/// let mut region = binding.reserve(8 * g)?.into_region();
/// region.grow(2)?;
/// region.as_mut_slice()[2 * g - 1] = 7;
/// region.shrink(1)?; // the last granule goes to the device's cache
/// assert_eq!((region.committed_len(), device.ledger().cached_bytes), (g, g as u64));
/// region.grow(3)?; // takes it back: no new memory; a refused growth leaves it as it was
/// assert_eq!(device.ledger().cached_bytes, 0);
/// region.release().complete()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type Region<'b, 'id, B> = Allocation<'b, 'id, B, Elastic>;

/// State of a [`Region`]: a reservation whose committed part grows and shrinks at its tail.
#[derive(Debug)]
pub enum Elastic {}

/// What a [`Region`] owns beyond its VA range: its mapped granules, in order from the start
/// of the range — the first `live` of them committed (lent), the rest its mapped tail — and the
/// granules withheld after a failed unmap.
#[doc(hidden)] // a state's parts: named by no public signature
#[derive(Debug)]
pub struct Granules<P> {
    /// Every mapped granule: the committed ones, then the tail's.
    pub(crate) committed: Vec<P>,
    /// How many of `committed` are committed; the others are the tail, mapped but lent to
    /// nothing.
    pub(crate) live: usize,
    /// The most granules the tail keeps (see [`Allocation::set_tail_cap`]).
    pub(crate) tail_cap: usize,
    /// The device's count of requests for the tails back when this region last answered one
    /// (see [`Device::ask_tails_back`](crate::Device::ask_tails_back)).
    pub(crate) seen: u64,
    pub(crate) withheld: Vec<Granule<P>>,
}

impl sealed::Sealed for Elastic {}

impl Repr for Elastic {
    type Parts<B: Backend> = Granules<B::Phys>;

    fn retire<B: Backend>(parts: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let backend = at.backend;
        let g = backend.granularity();
        let Granules {
            committed,
            live,
            mut withheld,
            ..
        } = parts;
        let tail = committed.len() - live;
        let mapped = committed.len() * g;
        // The committed granules are mapped from the start of the range: one unmap covers them.
        withheld.extend(committed.into_iter().enumerate().map(|(i, phys)| Granule {
            offset: i * g,
            len: g,
            phys,
            mapped: false,
        }));
        let charged = withheld.len() * g;
        Retired {
            // Work may still use the memory: its release waits for a fence.
            fence: Wait::unless(withheld.is_empty(), || backend.fence_for(&[at.addr])),
            held: Held {
                granules: withheld,
                ..Held::mapped(mapped)
            },
            charged,
            tail,
        }
    }
}

impl State for Elastic {
    const NAME: &'static str = "Region";
}
impl Live for Elastic {}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    /// Turns this reservation into an elastic [`Region`] with nothing committed yet. Makes no
    /// backend call and cannot fail.
    pub fn into_region(self) -> Region<'b, 'id, B> {
        let (core, ()) = self.into_core();
        let granules = Granules {
            committed: Vec::new(),
            live: 0,
            tail_cap: 0,
            seen: core.binding.tail_requests(),
            withheld: Vec::new(),
        };
        Allocation::from_core(core, granules)
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Elastic> {
    /// Bytes committed: mapped read-write from the start of the range, and lent (its slices
    /// and views cover them).
    pub fn committed_len(&self) -> usize {
        self.parts().live * self.granularity()
    }

    /// Granules committed.
    pub fn committed_granules(&self) -> usize {
        self.parts().live
    }

    /// Granules of the mapped tail: past the committed end, still mapped, owned and charged
    /// (as committed granules are), lent to nothing (no slice or view reaches them); the next
    /// growth takes them back with no backend call. At most [`tail_cap`](Self::tail_cap), but
    /// after a [`set_tail_cap`](Self::set_tail_cap) that could not give the excess back yet;
    /// all regions' tails together stay within the device's
    /// [`tail_cap`](crate::Device::tail_cap) as they grow. Counted apart on the ledger
    /// ([`LedgerSnapshot::tail_bytes`](crate::report::LedgerSnapshot::tail_bytes)).
    ///
    /// Asked for the tails back — by [`Device::ask_tails_back`](crate::Device::ask_tails_back)
    /// (by hand, by [`trim_cache`](crate::Device::trim_cache), by a lower device
    /// [`tail_cap`](crate::Device::set_tail_cap), by the device's budget refusing a commit or
    /// a growth while tails held bytes) or by this region's binding's budget refusing one — the
    /// region keeps no tail at its next [`shrink`](Self::shrink) that can unmap (no work may
    /// still use the memory, the context lives; else it keeps its tail as its cap allows and
    /// answers later): the tail is given back like any shrink's granules. Only the region gives
    /// its tail back — no other thread can unmap it under a growth — and a growth before that
    /// takes the tail first, as always. [`set_tail_cap`](Self::set_tail_cap) and
    /// [`trim_tail`](Self::trim_tail) answer the requests so far.
    /// Within the tail, a growth and a shrink make no call at all — not even the context-loss
    /// query — so they succeed after a loss too, moving only the committed length (the memory
    /// goes with the context, and the release discharges it as any).
    pub fn tail_granules(&self) -> usize {
        self.parts().committed.len() - self.parts().live
    }

    /// The most granules the mapped tail keeps (0 unless set: every shrink unmaps).
    pub fn tail_cap(&self) -> usize {
        self.parts().tail_cap
    }

    /// Granules mapped: the committed ones and the tail's.
    fn mapped_granules(&self) -> usize {
        self.parts().committed.len()
    }

    /// Sets the most granules the mapped tail keeps: a [`shrink`](Self::shrink) keeps up to
    /// that many mapped past the committed end (as far as the device's
    /// [`tail_cap`](crate::Device::tail_cap) allows too), and a [`grow`](Self::grow) takes them back
    /// before anything else — neither makes a backend call for them, nor waits for work that
    /// may still use them (they stay mapped; the region's fences cover them as the rest). A
    /// tail over the new cap is unmapped and given back now, as a shrink would.
    ///
    /// # Errors
    ///
    /// As for [`shrink`](Self::shrink) (nothing done but the cap, for
    /// [`ShrinkError::Pending`] and [`ShrinkError::Backend`]: the tail stays over it until
    /// [`trim_tail`](Self::trim_tail)).
    pub fn set_tail_cap(&mut self, granules: usize) -> Result<(), ShrinkError> {
        self.parts_mut().tail_cap = granules;
        let over = self.tail_granules().saturating_sub(granules);
        self.give_back_tail(over)?;
        // A cap set now answers the requests for the tails so far.
        self.parts_mut().seen = self.core().binding.tail_requests();
        Ok(())
    }

    /// Unmaps the whole mapped tail and gives it back (to the device's cache, or released), as
    /// a shrink would.
    ///
    /// # Errors
    ///
    /// As for [`shrink`](Self::shrink).
    pub fn trim_tail(&mut self) -> Result<(), ShrinkError> {
        let all = self.tail_granules();
        self.give_back_tail(all)?;
        // An empty tail answers every request for it so far.
        self.parts_mut().seen = self.core().binding.tail_requests();
        Ok(())
    }

    /// Unmaps the top `granules` of the tail and gives them back, once no work may use them.
    fn give_back_tail(&mut self, granules: usize) -> Result<(), ShrinkError> {
        if granules == 0 {
            return Ok(());
        }
        Scope::run::<B, _>(move || {
            let core = self.core();
            let device = core.device();
            let g = device.granularity();
            let end = core.addr + self.mapped_granules() * g;
            device
                .ensure_live(Op::Unmap, end - granules * g, granules * g)
                .map_err(|e| ShrinkError::Backend(Box::new(e)))?;
            if !idle(core) {
                return Err(ShrinkError::Pending);
            }
            // Unmapped or withheld, the top `granules` leave the tail either way.
            let done = self.shrink_now(granules);
            device.tail_left(granules);
            done
        })
    }

    /// Granules withheld after a failed unmap: owned and charged, inside the range past the
    /// committed part, which cannot grow over them until [`reclaim`](Self::reclaim) frees them.
    pub fn withheld_granules(&self) -> usize {
        self.parts().withheld.len()
    }

    /// Granules the committed part can grow to now: up to the end of the range, or to the
    /// first withheld granule.
    pub fn room_granules(&self) -> usize {
        let g = self.granularity();
        let withheld = self.parts().withheld.iter().map(|s| s.offset / g).min();
        withheld.unwrap_or(self.len() / g)
    }

    fn granularity(&self) -> usize {
        self.binding().device().granularity()
    }

    /// Grows the committed part by `granules` granules at its tail: each one taken from the
    /// device's cache of physical granules while it has one ready, else created (charged to
    /// the budgets first, which trim the cache when it stands in the way); then mapped
    /// read-write and charged as mapped.
    ///
    /// # Errors
    ///
    /// [`GrowError`], with this region and its committed length unchanged: when the growth
    /// does not fit ([`GrowError::Full`], nothing done), or when a budget, the capacity or a
    /// backend call refuses a granule ([`GrowError::Undone`]): every granule this call mapped
    /// is unmapped and given back where it came from, and the binding is charged nothing. When
    /// unmapping one of them fails too ([`GrowError::Withheld`]), it stays in the region, owned
    /// and withheld. [`GrowError::Unsupported`] where the device's mechanism cannot grow a
    /// region in place (CUDA's plain one), before anything is done.
    pub fn grow(&mut self, granules: usize) -> Result<(), GrowError> {
        // One scope for all of it: a backend panic contained while mapping resumes only once
        // the tail granules taken are back in the tail.
        Scope::run::<B, _>(move || {
            let room = self.room_granules();
            let live = self.committed_granules();
            // A region grows in place: refused up front by a mechanism that cannot map at a
            // reserved address (nothing was done).
            let (addr, len) = (self.addr(), self.len());
            let needs = self.core().device().backend().needs(
                Ability::MapAtReservedAddress,
                Op::Map,
                addr,
                len,
            );
            if let Err(e) = needs {
                return Err(GrowError::Unsupported(e));
            }
            if granules > room - live {
                return Err(GrowError::Full {
                    requested: granules,
                    committed: live,
                    room,
                });
            }
            // The tail first: mapped, owned and charged already — no backend call.
            let from_tail = granules.min(self.tail_granules());
            self.parts_mut().live += from_tail;
            let device = self.core().device();
            device.tail_left(from_tail);
            if from_tail == granules {
                return Ok(());
            }
            self.grow_mapping(granules - from_tail).map_err(|mut e| {
                // All or nothing: the tail granules go back to the tail, and the granule that
                // stopped the growth is counted from the call's first.
                self.parts_mut().live -= from_tail;
                if from_tail > 0 {
                    device.tail_returned(from_tail);
                }
                if let GrowError::Undone { at, .. } | GrowError::Withheld { at, .. } = &mut e {
                    *at += from_tail;
                }
                e
            })
        })
    }

    /// Grows by `granules` granules past every mapped one (the tail is empty), in the caller's
    /// scope.
    fn grow_mapping(&mut self, granules: usize) -> Result<(), GrowError> {
        {
            let core = self.core();
            let (binding, device) = (core.binding, core.device());
            let g = device.granularity();
            let start = self.mapped_granules();
            debug_assert_eq!(start, self.committed_granules(), "the tail is taken first");
            if let Err(e) = device.ensure_live(Op::Map, core.addr + start * g, granules * g) {
                return Err(self.undo_grow(start, 0, 0, CommitFailure::Backend(e)));
            }
            // The binding's budget takes the whole growth at once, or none of it; the granules
            // the cache has ready join the region's list at once (taken under one lock), each
            // mapped below before anything is created. Until then they sit past the mapped
            // ones: a failure puts those back before the list is used again, and nothing
            // between can unwind (backend panics are contained as errors).
            let Granules {
                committed, live, ..
            } = self.parts_mut();
            let mut growth = match binding.grow(granules, committed) {
                Ok(growth) => growth,
                Err(cause) => {
                    let free = binding.limit().saturating_sub(binding.used()) / g as u64;
                    let cause = GrowError::Undone {
                        at: granules.min(free as usize),
                        cause: Box::new(cause),
                        quarantined: 0,
                    };
                    return Err(cause);
                }
            };
            let taken = growth.taken();
            for at in 0..taken {
                let addr = core.addr + (start + at) * g;
                if let Err(e) = growth.map_cached(addr, committed[start + at]) {
                    growth.put_back(committed, start + at);
                    return Err(self.stop_grow(
                        growth,
                        start,
                        at,
                        CommitFailure::Backend(e),
                        false,
                    ));
                }
            }
            // Once the cache has none, granules are created.
            for at in taken..granules {
                let addr = core.addr + (start + at) * g;
                match growth.map_new(addr) {
                    Ok(phys) => committed.push(phys),
                    Err((cause, q)) => return Err(self.stop_grow(growth, start, at, cause, q)),
                }
            }
            *live += granules;
            // The cached and mapped axes move once for the whole growth.
            growth.finish();
            Ok(())
        }
    }

    /// Stops a growth at granule `at` (the region's list holds the granules it mapped, and no
    /// more): settles its axes for what was mapped, then undoes it. `quarantined`: whether the
    /// granule that failed could not be released.
    #[cold]
    fn stop_grow(
        &mut self,
        growth: Growth<'_, 'b, 'id, B>,
        start: usize,
        at: usize,
        cause: CommitFailure,
        quarantined: bool,
    ) -> GrowError {
        let from_cache = growth.cached();
        growth.finish();
        let mut e = self.undo_grow(start, from_cache, at, cause);
        add_quarantined(&mut e, usize::from(quarantined));
        e
    }

    /// Unmaps and gives back the granules this growth mapped past `start` (the first
    /// `from_cache` of them came from the cache and go back there), and says why it stopped at
    /// granule `at`. The same give-back a shrink makes ([`GiveBack`]): a granule that cannot be
    /// unmapped stays withheld in the region, as after a failed shrink.
    fn undo_grow(
        &mut self,
        start: usize,
        from_cache: usize,
        at: usize,
        cause: CommitFailure,
    ) -> GrowError {
        let binding = self.core().binding;
        let g = binding.device().granularity();
        let mut back = binding.give_back(from_cache);
        let mut failed = None;
        while self.mapped_granules() > start {
            match self.unmap_last(&mut back) {
                Ok((i, phys)) if i - start < from_cache => back.give(phys),
                Ok((_, phys)) => back.release(phys, g),
                Err(e) => failed = Some((failed.map_or(0, |(n, _)| n) + 1, e)),
            }
        }
        let quarantined = back.finish();
        match failed {
            None => GrowError::Undone {
                at,
                cause: Box::new(cause),
                quarantined,
            },
            Some((granules, rollback)) => GrowError::Withheld {
                at,
                cause: Box::new(cause),
                granules,
                rollback: Box::new(rollback),
            },
        }
    }

    /// Shrinks the committed part by `granules` granules at its tail. As many as the mapped
    /// tail has room for (its [`tail_cap`](Self::tail_cap), and the device's) stay mapped in
    /// it — no backend call, no wait — unless the tails were asked back (see
    /// [`tail_granules`](Self::tail_granules)) and the region can unmap now. The others, the
    /// tail's top first, are unmapped and given to the device's cache of physical granules, or
    /// released when the cache is full; each one leaves the binding's budget and the mapped
    /// bytes. Nothing is unmapped while work that may use the region still runs (the driver's
    /// unmap does not wait for it), so a cached granule is free for reuse at once: the fence of
    /// its last use has completed.
    ///
    /// A granule whose release fails goes to the device's quarantine, still owned (see
    /// [`Device::retry_quarantine`](crate::Device::retry_quarantine)); the shrink succeeds.
    ///
    /// # Errors
    ///
    /// [`ShrinkError::TooMany`] (nothing done) when fewer granules are committed;
    /// [`ShrinkError::Pending`] (nothing done) while work covered by the backend's fences
    /// may still use memory it must unmap; [`ShrinkError::Backend`] (nothing done) when the
    /// context is lost and it must unmap (within the tail it makes no call at all); [`ShrinkError::Withheld`] when some granules could not be unmapped: the committed part
    /// shrank all the same, and those granules stay owned and withheld in the region until
    /// [`reclaim`](Self::reclaim) frees them.
    pub fn shrink(&mut self, granules: usize) -> Result<(), ShrinkError> {
        Scope::run::<B, _>(move || self.shrink_in_scope(granules))
    }

    /// [`shrink`](Self::shrink), in the caller's scope.
    fn shrink_in_scope(&mut self, granules: usize) -> Result<(), ShrinkError> {
        let committed = self.committed_granules();
        if granules > committed {
            return Err(ShrinkError::TooMany {
                requested: granules,
                committed,
            });
        }
        if granules == 0 {
            return Ok(());
        }
        // Into the tail as far as its cap and the device's allow: they stay mapped — no
        // backend call, no wait — and what goes over (the top of the tail) is unmapped, as
        // without a tail. Asked for the tails back, the region keeps none — if it can unmap
        // now; else it keeps its tail as its cap allows and answers at a later shrink.
        let core = self.core();
        let asked = core.binding.tail_requests();
        if asked != self.parts().seen {
            // If it cannot unmap now, it goes on as if not asked.
            if let Ok(over) = self.shrink_keeping(granules, 0) {
                self.parts_mut().seen = asked;
                return self.shrink_over(granules, over, 0);
            }
        }
        let cap = self.tail_cap();
        let over = self.shrink_keeping(granules, cap)?;
        let kept = self.tail_granules() + granules - over;
        self.shrink_over(granules, over, kept)
    }

    /// The first half of a shrink by `granules` whose tail keeps at most `cap`: charges the
    /// tail's new room (as far as the device's cap allows) and says how many granules must be
    /// unmapped — once it checked that they can be (the context lives, no work may still use
    /// them); else nothing is done or charged.
    fn shrink_keeping(&mut self, granules: usize, cap: usize) -> Result<usize, ShrinkError> {
        let core = self.core();
        let device = core.device();
        let tail = self.tail_granules();
        let target = (tail + granules).min(cap);
        let kept = if target > tail {
            tail + device.tail_keep(target - tail)
        } else {
            target
        };
        let over = tail + granules - kept;
        if over > 0 {
            let g = device.granularity();
            let end = core.addr + self.mapped_granules() * g;
            let refused = match device.ensure_live(Op::Unmap, end - over * g, over * g) {
                Err(e) => Some(ShrinkError::Backend(Box::new(e))),
                Ok(()) if !idle(core) => Some(ShrinkError::Pending),
                Ok(()) => None,
            };
            if let Some(e) = refused {
                // Nothing done: the tail's new room goes back.
                device.tail_left(kept.saturating_sub(tail));
                return Err(e);
            }
        }
        Ok(over)
    }

    /// The second half: the committed end moves down by `granules`, and the top `over` mapped
    /// granules are unmapped and given back, leaving a tail of `kept`.
    fn shrink_over(
        &mut self,
        granules: usize,
        over: usize,
        kept: usize,
    ) -> Result<(), ShrinkError> {
        let tail = self.tail_granules();
        self.parts_mut().live -= granules;
        if over == 0 {
            return Ok(());
        }
        let done = self.shrink_now(over);
        // The tail went from `tail` to `kept` granules (its growth is charged already).
        self.core().device().tail_left(tail.saturating_sub(kept));
        done
    }

    /// Pops the last committed granule and unmaps it through `back`: its index and memory
    /// once unmapped, or the unmap's error, the granule then withheld (still mapped as far as
    /// anyone knows).
    #[inline(always)]
    fn unmap_last(
        &mut self,
        back: &mut GiveBack<'_, 'b, 'id, B>,
    ) -> Result<(usize, B::Phys), BackendError> {
        let core = self.core();
        let g = core.device().granularity();
        let i = self.mapped_granules() - 1;
        let parts = self.parts_mut();
        let phys = parts.committed.pop().expect("a mapped granule");
        parts.live = parts.live.min(parts.committed.len());
        let offset = i * g;
        match back.unmap(core.addr + offset) {
            Ok(()) => Ok((i, phys)),
            Err(e) => {
                self.parts_mut().withheld.push(Granule {
                    offset,
                    len: g,
                    phys,
                    mapped: true,
                });
                Err(e)
            }
        }
    }

    /// Unmaps the last `granules` mapped granules — the tail's first, then committed ones (no
    /// more than are mapped) — and gives them back: those the cache has room for go there
    /// under one lock. No work may still use them: the caller checked [`idle`], or mapped them
    /// within the current call.
    pub(crate) fn shrink_now(&mut self, granules: usize) -> Result<(), ShrinkError> {
        let core = self.core();
        let g = core.device().granularity();
        let mut back = core.binding.give_back(granules);
        let Granules {
            committed,
            live,
            withheld,
            ..
        } = self.parts_mut();
        let keep = committed.len().saturating_sub(granules);
        *live = (*live).min(keep);
        // From the top down; the list keeps every granule until all are unmapped, and one
        // whose unmap fails leaves it for the withheld ones (those above it are unmapped).
        let mut failed = None;
        for i in (keep..committed.len()).rev() {
            let offset = i * g;
            if let Err(e) = back.unmap(core.addr + offset) {
                let phys = committed.remove(i);
                withheld.push(Granule {
                    offset,
                    len: g,
                    phys,
                    mapped: true,
                });
                failed = Some(e);
            }
        }
        back.give_all(&committed[keep..]);
        committed.truncate(keep);
        back.finish();
        withheld_after(failed, withheld.len())
    }

    /// Tries again to unmap the granules withheld after a failed unmap, and gives back those
    /// it can (to the cache, or released), so the region can grow over them again.
    ///
    /// # Errors
    ///
    /// [`ShrinkError::Withheld`] with the granules still withheld; [`ShrinkError::Pending`]
    /// (nothing done) while work may still use the memory; [`ShrinkError::Backend`]
    /// (nothing done) when the context is lost — its granules then go with the region's
    /// release, discharged with the device's quarantine.
    pub fn reclaim(&mut self) -> Result<(), ShrinkError> {
        Scope::run::<B, _>(move || {
            let core = self.core();
            reclaim_withheld(core, &mut self.parts_mut().withheld)
        })
    }
}

/// Whether no work that may use `core`'s memory still runs (on a stream the backend's fences
/// cover for it): before an unmap, which does not wait for it.
pub(crate) fn idle<B: Backend>(core: Core<'_, '_, B>) -> bool {
    core.backend().idle(&[core.addr])
}

/// Unmaps the granules of `core`'s range withheld in `withheld` after a failed unmap, and gives back
/// those it can (to the cache, or released); the others stay in `withheld`.
pub(crate) fn reclaim_withheld<B: Backend>(
    core: Core<'_, '_, B>,
    withheld: &mut Vec<Granule<B::Phys>>,
) -> Result<(), ShrinkError> {
    if withheld.is_empty() {
        return Ok(());
    }
    let (binding, device) = (core.binding, core.device());
    device
        .ensure_live(Op::Unmap, core.addr, core.len)
        .map_err(|e| ShrinkError::Backend(Box::new(e)))?;
    // Withheld granules lie past the committed part, but work may reach them all the same.
    if !idle(core) {
        return Err(ShrinkError::Pending);
    }
    let mut back = binding.give_back(withheld.len());
    let mut failed = None;
    for mut granule in std::mem::take(withheld) {
        if granule.mapped {
            if let Err(e) = device.unmap(core.addr + granule.offset, granule.len) {
                withheld.push(granule);
                failed = Some(e);
                continue;
            }
            granule.mapped = false;
        }
        if granule.len == device.granularity() {
            back.give(granule.phys);
        } else {
            // A suspended allocation's whole mapping: not a granule the cache could hand out.
            back.release(granule.phys, granule.len);
        }
    }
    back.finish();
    withheld_after(failed, withheld.len())
}

/// What an unmap of granules ended in: done, or the first failure with the `granules` left
/// withheld. Inlined: a call of its own costs the region cycle 49 instructions (callgrind).
#[inline(always)]
fn withheld_after(failed: Option<BackendError>, granules: usize) -> Result<(), ShrinkError> {
    match failed {
        None => Ok(()),
        Some(error) => Err(ShrinkError::Withheld {
            granules,
            error: Box::new(error),
        }),
    }
}

/// Counts `n` more granules quarantined while undoing a growth.
fn add_quarantined(cause: &mut GrowError, n: usize) {
    match cause {
        GrowError::Undone { quarantined, .. } => *quarantined += n,
        GrowError::Withheld { .. } | GrowError::Full { .. } | GrowError::Unsupported(_) => {}
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, Elastic> {
    /// The committed part, read-only, borrowed from the region: it cannot shrink (or be
    /// released) while borrowed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the committed granules are mapped read-write from the start of the range and
        // stay mapped until `shrink` (`&mut self`) or a release (by value) — both excluded by
        // this borrow; the region is their only owner, so only its `&mut` writes them.
        unsafe { host_slice(self.addr(), self.committed_len()) }
    }

    /// The committed part, read-write, borrowed mutably from the region.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` makes this the only borrow of the memory.
        unsafe { host_slice_mut(self.addr(), self.committed_len()) }
    }
}
