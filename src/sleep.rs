//! Sleep and wake — a policy on top of allocations and regions: committed memory is
//! [suspended](Allocation::suspend) (unmapped and its physical memory given back, its bytes
//! optionally saved to the host first) while its VA stays reserved, and
//! [resumed](Allocation::resume) at the same addresses, all or nothing. A suspended token is an
//! [`Allocation`] in the state [`Suspended<S>`], `S` the state it comes back to.
//!
//! Guide: [`guide::sleep_wake`](crate::guide::sleep_wake).

use crate::allocation::Allocation;
use crate::backend::{Ability, Backend, Op};
use crate::error::{ResumeFailure, ShrinkError, SuspendFailure, TransitionError};
use crate::region::{Elastic, Granules, idle, reclaim_withheld};
use crate::residual::{Granule, Held};
use crate::state::Wait;
use crate::state::{
    Committed, Live, Reserved, Retired, Retiring, State,
    sealed::{self, Repr},
};
use crate::token::Core;
use crate::unwind::Scope;
use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;

/// A failed suspend: the same token, unchanged and usable; and why.
pub type SuspendError<'b, 'id, B, S> = TransitionError<Allocation<'b, 'id, B, S>, SuspendFailure>;

/// A failed resume: the same suspended token, with its addresses and saved bytes (and what a
/// failed unmap withheld, if anything); and why.
pub type ResumeError<'b, 'id, B, S> =
    TransitionError<Allocation<'b, 'id, B, Suspended<S>>, ResumeFailure>;

/// A suspended [`Allocation`]: its VA is reserved at the same address, nothing is mapped, it
/// owns no physical memory. [`resume`](Allocation::resume) gives the committed allocation back.
pub type SuspendedAllocation<'b, 'id, B> = Allocation<'b, 'id, B, Suspended<Committed>>;

/// A suspended [`Region`](crate::region::Region): its VA is reserved, nothing committed;
/// [`resume`](Allocation::resume) grows it back to the committed length it had.
pub type SuspendedRegion<'b, 'id, B> = Allocation<'b, 'id, B, Suspended<Elastic>>;

/// State of a suspended token that resumes into state `S` ([`Committed`] or [`Elastic`]). It has
/// no access methods — the memory is not mapped:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let asleep = binding.reserve(4096).unwrap().commit().unwrap().suspend().unwrap();
/// let bytes = asleep.as_slice();
/// ```
///
/// a suspended token cannot be suspended again:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let asleep = binding.reserve(4096).unwrap().commit().unwrap().suspend().unwrap();
/// let twice = asleep.suspend();
/// ```
///
/// only a suspended token resumes:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let awake = binding.reserve(4096).unwrap().commit().unwrap();
/// let again = awake.resume();
/// ```
///
/// and no slice of the memory outlives its suspend:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut region = binding.reserve(4 * 4096).unwrap().into_region();
/// region.grow(2).unwrap();
/// let bytes = region.as_slice();
/// let asleep = region.suspend_saving().unwrap();
/// println!("{}", bytes[0]);
/// ```
///
/// Releasing a suspended token frees its VA, once, like any other release.
pub struct Suspended<S>(Infallible, PhantomData<S>);

impl<S> fmt::Debug for Suspended<S> {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {}
    }
}

/// What a suspended token holds beyond its VA: the committed length to come back, the bytes
/// saved from it, and (a region's) granules withheld after a failed unmap.
#[doc(hidden)] // a state's parts: named by no public signature
#[derive(Debug)]
pub struct Asleep<P> {
    len: usize,
    saved: Option<Box<[u8]>>,
    withheld: Vec<Granule<P>>,
    /// A region's mapped-tail cap, which it has again when it resumes (0 for an allocation).
    tail_cap: usize,
}

/// A state that can be suspended and resumed (sealed): [`Committed`] and [`Elastic`].
pub trait Suspendable: Live {}
impl Suspendable for Committed {}
impl Suspendable for Elastic {}

impl<S: Suspendable> sealed::Sealed for Suspended<S> {}

impl<S: Suspendable> Repr for Suspended<S> {
    type Parts<B: Backend> = Asleep<B::Phys>;

    fn retire<B: Backend>(parts: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let backend = at.backend;
        let charged = parts.withheld.iter().map(|s| s.len).sum();
        Retired {
            // Withheld granules may still be mapped from before: their release waits for work.
            fence: Wait::unless(parts.withheld.is_empty(), || backend.fence_for(&[at.addr])),
            held: Held {
                granules: parts.withheld,
                ..Held::va()
            },
            charged,
            tail: 0,
        }
    }
}

impl<S: Suspendable> State for Suspended<S> {
    const NAME: &'static str = "Suspended";
}
impl<S: Suspendable> Live for Suspended<S> {}

impl<B: Backend, S: Suspendable> Allocation<'_, '_, B, Suspended<S>> {
    /// Bytes that come back mapped on resume (the committed length when suspended).
    pub fn suspended_len(&self) -> usize {
        self.parts().len
    }

    /// Whether the bytes were saved, so that resume restores them.
    pub fn is_saved(&self) -> bool {
        self.parts().saved.is_some()
    }

    /// Bytes withheld after a failed unmap: still mapped (as far as anyone knows), owned and
    /// charged, until [`reclaim`](Self::reclaim) frees them; `resume` reclaims them first.
    pub fn withheld_bytes(&self) -> usize {
        self.parts().withheld.iter().map(|s| s.len).sum()
    }

    /// Tries again to unmap and give back what is withheld after a failed unmap.
    ///
    /// # Errors
    ///
    /// As for [`Region::reclaim`](Allocation::reclaim): [`ShrinkError::Withheld`] with what is
    /// still withheld, [`ShrinkError::Pending`] while work may still use it,
    /// [`ShrinkError::Backend`] once the context is lost.
    pub fn reclaim(&mut self) -> Result<(), ShrinkError> {
        Scope::run::<B, _>(move || {
            let core = self.core();
            reclaim_withheld(core, &mut self.parts_mut().withheld)
        })
    }
}

/// The checks before a suspend of `len` committed bytes: the context lives, no work runs; then
/// the bytes saved, if asked.
fn prepare<B: Backend>(
    core: Core<'_, '_, B>,
    len: usize,
    save: bool,
) -> Result<Option<Box<[u8]>>, SuspendFailure> {
    let device = core.device();
    device
        .backend()
        .needs(Ability::SuspendInPlace, Op::Unmap, core.addr, core.len)
        .map_err(|e| SuspendFailure::Backend(Box::new(e)))?;
    device
        .ensure_live(Op::Unmap, core.addr, core.len)
        .map_err(|e| SuspendFailure::Backend(Box::new(e)))?;
    if !idle(core) {
        return Err(SuspendFailure::Pending);
    }
    if !save {
        return Ok(None);
    }
    let mut bytes = vec![0; len].into_boxed_slice();
    device
        .backend()
        .copy_to_host(&mut bytes, core.addr)
        .map_err(|e| SuspendFailure::Save(Box::new(e)))?;
    Ok(Some(bytes))
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Committed> {
    /// Suspends this allocation without saving its bytes: unmaps and releases its physical
    /// memory (refunded to the budgets and the ledger) while its VA stays reserved. A resume
    /// maps fresh memory at the same addresses.
    ///
    /// # Errors
    ///
    /// [`SuspendError`]: this allocation, unchanged, while work may still use it
    /// ([`SuspendFailure::Pending`]) or once the context is lost. When the unmap fails, the
    /// suspend succeeds and the mapping stays withheld in the suspended token, charged
    /// ([`withheld_bytes`](Allocation::withheld_bytes)), until a reclaim or the resume frees
    /// it; a release that fails after the unmap is quarantined in the device.
    #[must_use = "a failed suspend returns the allocation inside the error"]
    pub fn suspend(
        self,
    ) -> Result<SuspendedAllocation<'b, 'id, B>, SuspendError<'b, 'id, B, Committed>> {
        Scope::run::<B, _>(move || self.suspend_with(false))
    }

    /// Suspends this allocation as [`suspend`](Self::suspend) does, after saving its bytes to
    /// host memory; a resume restores them.
    ///
    /// # Errors
    ///
    /// As for [`suspend`](Self::suspend); also the allocation, unchanged, when saving fails.
    #[must_use = "a failed suspend returns the allocation inside the error"]
    pub fn suspend_saving(
        self,
    ) -> Result<SuspendedAllocation<'b, 'id, B>, SuspendError<'b, 'id, B, Committed>> {
        Scope::run::<B, _>(move || self.suspend_with(true))
    }

    fn suspend_with(
        self,
        save: bool,
    ) -> Result<SuspendedAllocation<'b, 'id, B>, SuspendError<'b, 'id, B, Committed>> {
        let core = self.core();
        let (binding, device, len) = (core.binding, core.device(), core.len);
        let saved = match prepare(core, len, save) {
            Ok(saved) => saved,
            Err(cause) => {
                let token = self;
                return Err(TransitionError { token, cause });
            }
        };
        let (core, phys) = self.into_core();
        let mut withheld = Vec::new();
        if device.unmap(core.addr, len).is_err() {
            // Whether it is still mapped is unknown: the mapping stays withheld in the suspended
            // token, owned and charged, until a reclaim (or the resume) frees it.
            withheld.push(Granule {
                offset: 0,
                len,
                phys,
                mapped: true,
            });
        } else {
            let _ = binding.discard(phys, len); // a failure is quarantined, still counted
        }
        let asleep = Asleep {
            len,
            saved,
            withheld,
            tail_cap: 0,
        };
        Ok(Allocation::from_core(core, asleep))
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Suspended<Committed>> {
    /// Resumes this allocation: commits physical memory at the same addresses and restores the
    /// saved bytes, if any — all or nothing.
    ///
    /// # Errors
    ///
    /// [`ResumeError`]: this suspended allocation, with its saved bytes, when the commit or the
    /// restore fails (nothing stays mapped or charged), or when memory withheld by an earlier
    /// failed unmap cannot be reclaimed first; if undoing a failed restore fails too, that
    /// memory stays withheld in the suspended token, charged.
    #[must_use = "a failed resume returns the suspended allocation inside the error"]
    pub fn resume(
        self,
    ) -> Result<Allocation<'b, 'id, B, Committed>, ResumeError<'b, 'id, B, Committed>> {
        Scope::run::<B, _>(move || {
            let (core, mut asleep) = self.into_core();
            let back = |core, asleep, cause| {
                let token = Allocation::from_core(core, asleep);
                Err(TransitionError { token, cause })
            };
            if let Err(e) = reclaim_withheld(core, &mut asleep.withheld) {
                return back(core, asleep, ResumeFailure::Withheld(Box::new(e)));
            }
            let reserved = Allocation::<'b, 'id, B, Reserved>::from_core(core, ());
            let committed = match reserved.commit() {
                Ok(committed) => committed,
                Err(e) => {
                    let (core, ()) = e.token.into_core();
                    return back(core, asleep, ResumeFailure::Commit(Box::new(e.cause)));
                }
            };
            let Some(bytes) = &asleep.saved else {
                return Ok(committed);
            };
            let device = core.device();
            let Err(error) = device.backend().copy_from_host(core.addr, bytes) else {
                return Ok(committed);
            };
            // Undo the commit: nothing can have used the memory mapped just now. Not the
            // teardown of a release: the token stays suspended, with its VA and its saved
            // bytes, so the mapping goes (`unmap`) and its memory with it (`discard`, the
            // orphan teardown); a mapping that cannot go stays withheld in the suspended
            // token, charged, rather than quarantining the token.
            let (core, phys) = committed.into_core();
            let (binding, len) = (core.binding, core.len);
            if let Err(rollback) = device.unmap(core.addr, len) {
                // Still suspended, with its saved bytes; the mapping stays withheld, charged.
                asleep.withheld.push(Granule {
                    offset: 0,
                    len,
                    phys,
                    mapped: true,
                });
                let cause = ResumeFailure::RestoreUndo {
                    error: Box::new(error),
                    rollback: Box::new(rollback),
                };
                return back(core, asleep, cause);
            }
            let _ = binding.discard(phys, len); // a failure is quarantined, still counted
            back(core, asleep, ResumeFailure::Restore(Box::new(error)))
        })
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Elastic> {
    /// Suspends this region without saving its bytes: shrinks its committed part to nothing
    /// (each granule to the device's cache, or released) while its VA stays reserved. A resume
    /// grows it back at the same addresses.
    ///
    /// A granule whose unmap fails stays withheld in the suspended region, as after a failed
    /// shrink (see [`reclaim`](Allocation::reclaim) on the suspended region).
    ///
    /// # Errors
    ///
    /// [`SuspendError`]: this region, unchanged, while work may still use it
    /// ([`SuspendFailure::Pending`]) or once the context is lost.
    #[must_use = "a failed suspend returns the region inside the error"]
    pub fn suspend(self) -> Result<SuspendedRegion<'b, 'id, B>, SuspendError<'b, 'id, B, Elastic>> {
        Scope::run::<B, _>(move || self.suspend_with(false))
    }

    /// Suspends this region as [`suspend`](Self::suspend) does, after saving its committed
    /// bytes to host memory; a resume restores them.
    ///
    /// # Errors
    ///
    /// As for [`suspend`](Self::suspend); also the region, unchanged, when saving fails.
    #[must_use = "a failed suspend returns the region inside the error"]
    pub fn suspend_saving(
        self,
    ) -> Result<SuspendedRegion<'b, 'id, B>, SuspendError<'b, 'id, B, Elastic>> {
        Scope::run::<B, _>(move || self.suspend_with(true))
    }

    fn suspend_with(
        mut self,
        save: bool,
    ) -> Result<SuspendedRegion<'b, 'id, B>, SuspendError<'b, 'id, B, Elastic>> {
        let (core, len) = (self.core(), self.committed_len());
        let saved = match prepare(core, len, save) {
            Ok(saved) => saved,
            Err(cause) => {
                let token = self;
                return Err(TransitionError { token, cause });
            }
        };
        // Granules whose unmap fails are withheld in the region: they stay with it. The mapped
        // tail goes too.
        let tail = self.tail_granules();
        let _ = self.shrink_now(self.committed_granules() + tail);
        core.device().tail_left(tail);
        let (core, granules) = self.into_core();
        let asleep = Asleep {
            len,
            saved,
            withheld: granules.withheld,
            tail_cap: granules.tail_cap,
        };
        Ok(Allocation::from_core(core, asleep))
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Suspended<Elastic>> {
    /// Granules withheld after a failed unmap (see [`Region::withheld_granules`]).
    ///
    /// [`Region::withheld_granules`]: Allocation::withheld_granules
    pub fn withheld_granules(&self) -> usize {
        self.parts().withheld.len()
    }

    /// Resumes this region: grows it back to its suspended length at the same addresses (from
    /// the device's cache of granules first) and restores the saved bytes, if any — all or
    /// nothing.
    ///
    /// # Errors
    ///
    /// [`ResumeError`]: this suspended region, with its saved bytes, when the growth or the
    /// restore fails (every granule mapped for it given back, nothing charged); granules whose
    /// unmap fails meanwhile stay withheld in it.
    #[must_use = "a failed resume returns the suspended region inside the error"]
    pub fn resume(
        self,
    ) -> Result<Allocation<'b, 'id, B, Elastic>, ResumeError<'b, 'id, B, Elastic>> {
        Scope::run::<B, _>(move || {
            let g = self.binding().device().granularity();
            let (core, mut asleep) = self.into_core();
            if let Err(e) = reclaim_withheld(core, &mut asleep.withheld) {
                let token = Allocation::from_core(core, asleep);
                let cause = ResumeFailure::Withheld(Box::new(e));
                return Err(TransitionError { token, cause });
            }
            let Asleep {
                len,
                saved,
                withheld,
                tail_cap,
            } = asleep;
            let asleep_again = |region: Allocation<'b, 'id, B, Elastic>, saved, cause| {
                let (core, granules) = region.into_core();
                debug_assert!(
                    granules.committed.is_empty(),
                    "a failed growth maps nothing"
                );
                let asleep = Asleep {
                    len,
                    saved,
                    withheld: granules.withheld,
                    tail_cap,
                };
                let token = Allocation::from_core(core, asleep);
                Err(TransitionError { token, cause })
            };
            let granules = Granules {
                committed: Vec::with_capacity(len / g),
                live: 0,
                tail_cap,
                seen: core.binding.tail_requests(),
                withheld,
            };
            let mut region = Allocation::<'b, 'id, B, Elastic>::from_core(core, granules);
            if let Err(e) = region.grow(len / g) {
                return asleep_again(region, saved, ResumeFailure::Grow(Box::new(e)));
            }
            let Some(bytes) = &saved else {
                return Ok(region);
            };
            let Err(error) = core.backend().copy_from_host(core.addr, bytes) else {
                return Ok(region);
            };
            // Nothing can have used the memory mapped just now: shrink it back (a granule whose
            // unmap fails stays withheld).
            let _ = region.shrink_now(len / g);
            asleep_again(region, saved, ResumeFailure::Restore(Box::new(error)))
        })
    }
}
