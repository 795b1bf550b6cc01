//! [`Allocation`]: a linear owning token for one VA range, its state in its type — and
//! [`Binding::reserve`], which makes one.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use crate::backend::{Access, Backend, HostVisible, Op};
use crate::device::{Binding, Build, Handover};
use crate::device::{Quarantined, settle};
use crate::error::{CommitFailure, ReleaseFailure, ReserveError, Returned, TransitionError};
use crate::ids::{Generation, Released};
use crate::state::{
    Committed, Live, Readable, Releasing, Reserved, Retired, Retiring, State, Wait, sealed::Repr,
};
use crate::token::{Core, host_slice, host_slice_mut};
use crate::unwind::Guarded;
use crate::unwind::Scope;
use std::fmt;
use std::mem::ManuallyDrop;

/// A failed [`commit`](Allocation::commit): the same reserved token, and why.
pub type CommitError<'b, 'id, B> = TransitionError<Allocation<'b, 'id, B, Reserved>, CommitFailure>;

/// A [`complete`](Allocation::complete) that could not finish: the same releasing token while
/// its fence is pending ([`ReleaseFailure::Pending`]), or the quarantined remains after a
/// backend call failed.
pub type CompleteError<'b, 'id, B> = TransitionError<
    Returned<Allocation<'b, 'id, B, Releasing>, Quarantined<'b, 'id, B>>,
    ReleaseFailure,
>;

/// A linear owning token for one VA range of `len` bytes, in state `S`.
///
/// The token is the only owner of its range and of the physical memory mapped there: it is
/// neither `Clone` nor `Copy`, every transition consumes it, and a fallible transition hands it
/// back inside its error. It borrows its [`Binding`] (and through it the [`Device`](crate::Device)),
/// so it cannot outlive either, and it carries the device's brand `'id`.
///
/// The shared-prefix tokens are allocations too, in states of their own:
/// [`Prefix`](crate::sharing::Prefix), [`PrefixMapping`](crate::sharing::PrefixMapping) and
/// [`DivergedMapping`](crate::sharing::DivergedMapping).
///
/// Dropping a token in any state tears it down: it never blocks on the device and never frees
/// VA that is still mapped; what must wait for a fence goes to the device's deferred queue, and
/// what fails goes to the device's quarantine (see [`Device::retry_quarantine`](crate::Device::retry_quarantine)).
///
/// Reserved memory has no access methods:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let reserved = binding.reserve(4096).unwrap();
/// let bytes = reserved.as_slice(); // only a Committed token lends its memory
/// ```
///
/// A released token is gone (use after release):
///
/// ```compile_fail,E0382
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let mut committed = binding.reserve(4096).unwrap().commit().unwrap();
/// let releasing = committed.release();
/// committed.as_mut_slice()[0] = 1;
/// ```
///
/// and cannot be released twice:
///
/// ```compile_fail,E0382
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let committed = binding.reserve(4096).unwrap().commit().unwrap();
/// let releasing = committed.release();
/// let again = committed.release();
/// ```
///
/// Tokens are not `Copy`: a second binding of the same token moves it.
///
/// ```compile_fail,E0382
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let reserved = binding.reserve(4096).unwrap();
/// let copy = reserved;
/// let other = reserved;
/// ```
///
/// Nor can they be cloned:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let committed = binding.reserve(4096).unwrap().commit().unwrap();
/// let twin = committed.clone();
/// ```
///
/// A releasing token lends no memory:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let releasing = binding.reserve(4096).unwrap().commit().unwrap().release();
/// let bytes = releasing.as_slice();
/// ```
///
/// A slice cannot be kept across a release:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let committed = binding.reserve(4096).unwrap().commit().unwrap();
/// let bytes = committed.as_slice();
/// let releasing = committed.release();
/// println!("{}", bytes[0]);
/// ```
///
/// The result of a fallible transition must be used:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # fn main() {
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// binding.reserve(4096).unwrap().commit();
/// # }
/// ```
pub struct Allocation<'b, 'id, B: Backend, S: State> {
    core: Core<'b, 'id, B>,
    parts: ManuallyDrop<<S as Repr>::Parts<B>>,
}

impl<'b, 'id, B: Backend> Binding<'b, 'id, B> {
    /// Reserves at least `len` bytes of VA (rounded up to the granularity). Nothing is mapped
    /// or charged to the budget; the range counts as reserved in the ledger. (On CUDA's plain
    /// mechanism a reservation is a claim on a length: see [`addr`](Allocation::addr).)
    ///
    /// # Errors
    ///
    /// [`ReserveError`] for a zero length, a length that overflows when rounded, one past the
    /// address space, or a backend failure. Nothing is changed or charged on error.
    pub fn reserve(&'b self, len: usize) -> Result<Allocation<'b, 'id, B, Reserved>, ReserveError> {
        let device = self.device();
        let backend = device.backend();
        let granularity = backend.granularity();
        if len == 0 {
            return Err(ReserveError::ZeroLength { granularity });
        }
        let rounded = len
            .checked_next_multiple_of(granularity)
            .ok_or(ReserveError::Overflow {
                requested: len,
                granularity,
            })?;
        let limit = backend.address_space();
        if rounded > limit {
            return Err(ReserveError::TooLarge {
                requested: len,
                rounded,
                limit,
            });
        }
        device.ensure_live(Op::Reserve, 0, rounded)?;
        Scope::run::<B, _>(move || {
            let addr = device.reserve_va(rounded)?;
            let core = Core {
                binding: self,
                addr,
                len: rounded,
                generation: device.next_generation(),
            };
            Ok(Allocation::from_core(core, ()))
        })
    }
}

impl<'b, 'id, B: Backend, S: State> Allocation<'b, 'id, B, S> {
    pub(crate) fn from_core(core: Core<'b, 'id, B>, parts: <S as Repr>::Parts<B>) -> Self {
        Self {
            core,
            parts: ManuallyDrop::new(parts),
        }
    }

    /// Takes the token apart without running its `Drop`.
    pub(crate) fn into_core(self) -> (Core<'b, 'id, B>, <S as Repr>::Parts<B>) {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped nor used again, so the parts are taken exactly once.
        let parts = unsafe { ManuallyDrop::take(&mut this.parts) };
        (this.core, parts)
    }

    pub(crate) fn core(&self) -> Core<'b, 'id, B> {
        self.core
    }

    pub(crate) fn parts(&self) -> &<S as Repr>::Parts<B> {
        &self.parts
    }

    pub(crate) fn parts_mut(&mut self) -> &mut <S as Repr>::Parts<B> {
        &mut self.parts
    }

    /// Start of the VA range. On a mechanism that cannot map at a reserved address (CUDA's
    /// plain one: [`Device::lacks`](crate::Device::lacks)`(Ability::MapAtReservedAddress)`), a
    /// reservation's address is a placeholder no memory is ever at: the committed token's is
    /// where the driver allocated the memory.
    ///
    /// On CUDA, the address used in work captured by a capture memtoken did not make is the
    /// `unsafe` kernel launch's obligation: the token (or KV plane) must outlive every launch of
    /// that graph (memtoken's `Capture` borrows it instead).
    pub fn addr(&self) -> crate::backend::Addr {
        self.core.addr
    }

    /// Length of the VA range in bytes (a multiple of the granularity).
    pub fn len(&self) -> usize {
        self.core.len
    }

    /// Never: a token covers at least one granule. (For symmetry with [`len`](Self::len).)
    pub fn is_empty(&self) -> bool {
        self.core.len == 0
    }

    /// This allocation's identity.
    pub fn generation(&self) -> Generation {
        self.core.generation
    }

    /// The binding this token was made through (and whose budget it is charged to).
    pub fn binding(&self) -> &'b Binding<'b, 'id, B> {
        self.core.binding
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    /// The checks and the charge before this reservation's memory is created: the context
    /// lives, the length fits the physical capacity, and the budgets take it (charged to
    /// `build`, which refunds what it does not make).
    pub(crate) fn admit(&self, build: &mut Build<'_, 'b, 'id, B>) -> Result<(), CommitFailure> {
        let len = self.core.len;
        let device = self.core.device();
        device
            .ensure_live(Op::Create, 0, len)
            .map_err(CommitFailure::Backend)?;
        let capacity = device.backend().physical_capacity();
        if len as u64 > capacity {
            return Err(CommitFailure::Capacity {
                requested: len as u64,
                capacity,
            });
        }
        build.budget(len)
    }

    /// Creates physical memory, maps it read-write and charges it: the memory becomes usable.
    ///
    /// # Errors
    ///
    /// [`CommitError`], with this same token inside, when the budget or the physical capacity
    /// would be exceeded or a backend call fails. Nothing stays mapped or charged, except when
    /// undoing a half-done commit fails too: then the orphaned physical memory is in the
    /// device's quarantine, charged as owned, and the cause says so.
    #[must_use = "a failed commit returns the reserved token inside the error"]
    pub fn commit(self) -> Result<Allocation<'b, 'id, B, Committed>, CommitError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            let core = self.core;
            let refuse = |token, cause| Err(TransitionError { token, cause });
            let mut build = core.binding.build(core.addr);
            if let Err(cause) = self.admit(&mut build) {
                return refuse(self, cause);
            }
            let made = build
                .create(0, core.len, Guarded::create)
                .and_then(|phys| build.map(0, Access::ReadWrite).map(|()| phys));
            match made {
                Ok(phys) => {
                    build.keep();
                    let (mut core, ()) = self.into_core();
                    // Where the memory is: the reservation's address, or (a mechanism without
                    // VMM) where its allocator placed it.
                    core.addr = core.device().backend().placed(core.addr, phys);
                    Ok(Allocation::from_core(core, phys))
                }
                Err(error) => refuse(self, CommitFailure::undone(error, build.undo().rollback())),
            }
        })
    }
}

impl<'b, 'id, B: Backend, S: Live> Allocation<'b, 'id, B, S> {
    /// Starts the release: retires the token from use and returns it in [`Releasing`], where it
    /// lends no memory. A token whose memory may still be used by work in flight records a
    /// fence after the work submitted so far; [`complete`](Allocation::complete) finishes once
    /// it has completed. Cannot fail.
    #[must_use = "dropping the Releasing token hands the release to the device; call complete()"]
    pub fn release(self) -> Allocation<'b, 'id, B, Releasing> {
        Scope::run::<B, _>(move || {
            let (core, parts) = self.into_core();
            let Retired {
                held,
                fence,
                charged,
                tail,
            } = retire::<B, S>(core, parts);
            // The binding stays charged for the memory the token still owns, until it is released;
            // the rest leaves its budget now (a prefix's bytes stay with its mappings).
            core.binding.retire(charged, tail, &held);
            Allocation::from_core(core, (held, fence))
        })
    }
}

/// Takes a token of state `S` apart into what it holds (see [`Repr::retire`]).
fn retire<B: Backend, S: State>(core: Core<'_, '_, B>, parts: S::Parts<B>) -> Retired<B> {
    let len = core.len;
    S::retire(
        parts,
        Retiring {
            backend: core.backend(),
            addr: core.addr,
            len,
        },
    )
}

impl<B: HostVisible, S: Readable> Allocation<'_, '_, B, S> {
    /// The memory, read-only, borrowed from the token: it cannot be released while borrowed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: a readable state keeps the whole range mapped readable until the token is
        // consumed, which this borrow prevents; its bytes are written only through `&mut` of
        // the one token that may write them (a committed allocation, a prefix with no sharer,
        // a diverged mapping's private granule).
        unsafe { host_slice(self.core.addr, self.core.len) }
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, Committed> {
    /// The memory, read-write, borrowed mutably from the token.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: a committed token exclusively owns a read-write mapping of its whole range,
        // kept until the token is consumed; `&mut self` makes this the only borrow of it.
        unsafe { host_slice_mut(self.core.addr, self.core.len) }
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Releasing> {
    /// Whether the fence has completed (or there is none), so [`complete`](Self::complete) can
    /// proceed. Never blocks.
    pub fn is_ready(&self) -> bool {
        match &self.parts.1 {
            Wait::Nothing => true,
            Wait::On(fence) => self.core.backend().fence_done(fence),
            Wait::Unrecorded => false,
        }
    }

    /// Finishes the release once the fence has completed: unmaps, gives back shared and owned
    /// physical memory, and frees the VA. Never blocks.
    ///
    /// # Errors
    ///
    /// [`CompleteError`]: with this same token, unchanged, and [`ReleaseFailure::Pending`] if
    /// the fence has not completed; with a [`Quarantined`] token holding exactly what could not
    /// be given back if a backend call fails.
    ///
    /// Shared physical memory is not this token's: when its last mapping goes, the memory is
    /// released, and if that fails it goes to the device's quarantine (counted there, retried by
    /// [`Device::retry_quarantine`](crate::Device::retry_quarantine)) while this token's own
    /// release still succeeds.
    #[must_use = "a pending or failed completion returns a token inside the error"]
    pub fn complete(mut self) -> Result<Released, CompleteError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            if let Wait::Unrecorded = self.parts.1 {
                // The fence the release began with could not be recorded: one recorded now covers
                // the same work.
                self.parts.1 = Wait::on(self.core.backend().fence_for(&[self.core.addr]));
            }
            if !self.is_ready() {
                return Err(TransitionError {
                    token: Returned::Unchanged(self),
                    cause: ReleaseFailure::Pending,
                });
            }
            let (core, (held, fence)) = self.into_core();
            if let Wait::On(fence) = fence {
                core.backend().retire_fence(fence);
            }
            settle(core.binding, core.residual(held))
                .map_err(|e| e.map_token(Returned::Quarantined))
        })
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Releasing> {
    /// [`complete`](Self::complete), first waiting — blocking the calling thread, outside
    /// every lock of memtoken's, so other threads' calls go on — for the work that may still
    /// use the memory to finish. One of the few documented places that wait (with
    /// [`Device::flush`](crate::Device::flush) and a device's drop).
    ///
    /// # Errors
    ///
    /// As for [`complete`](Self::complete); and, with this same token, unchanged,
    /// [`ReleaseFailure::Stuck`] where the wait cannot progress — a stream the fence covers
    /// captures (its work does not run until the capture ends), or the backend cannot wait at
    /// all — rather than blocking for ever.
    #[must_use = "a stuck or failed completion returns a token inside the error"]
    pub fn wait(mut self) -> Result<Released, CompleteError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            if let Wait::Unrecorded = self.parts.1 {
                self.parts.1 = Wait::on(self.core.backend().fence_for(&[self.core.addr]));
            }
            let waited = match &self.parts.1 {
                Wait::On(fence) => self.core.backend().wait_fence(fence),
                Wait::Nothing => true,
                Wait::Unrecorded => false, // recording panicked again: no wait is known
            };
            if !waited && !self.is_ready() && !self.core.backend().context_lost() {
                return Err(TransitionError {
                    token: Returned::Unchanged(self),
                    cause: ReleaseFailure::Stuck,
                });
            }
            // Waited for: done, whatever a capture begun since would answer a second query.
            if waited && let Wait::On(fence) = std::mem::replace(&mut self.parts.1, Wait::Nothing) {
                self.core.backend().retire_fence(fence);
            }
            self.complete()
        })
    }
}

impl<B: Backend, S: State> Allocation<'_, '_, B, S> {
    /// Gives the token up into the device's custody for good: its memory was exposed to
    /// `peer`, which never said it was done with it. Nothing is unmapped or released; the
    /// device withholds the range and reports the peer
    /// ([`Device::withheld_for_peers`](crate::Device::withheld_for_peers)).
    pub(crate) fn withhold_for_peer(self, peer: String) {
        let _scope = Scope::open::<B>();
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so its parts are taken once, here.
        unsafe { this.give_up(|fence| Handover::ForPeer(fence, peer)) };
    }

    /// Retires the token's parts and hands what is left to the device, which keeps it as
    /// `custody` says (given the token's fence): the one place a token gives up its residual.
    ///
    /// # Safety
    ///
    /// Called once; the token is not used after (its parts are taken).
    unsafe fn give_up(&mut self, custody: impl FnOnce(Wait<B::Fence>) -> Handover<B::Fence>) {
        // SAFETY: the caller's promise: taken once, never used after.
        let parts = unsafe { ManuallyDrop::take(&mut self.parts) };
        let core = self.core;
        let Retired {
            held,
            fence,
            charged,
            tail,
        } = retire::<B, S>(core, parts);
        core.binding
            .hand_over(core.residual(held), charged, tail, custody(fence));
    }
}

impl<B: Backend, S: State> Drop for Allocation<'_, '_, B, S> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        // SAFETY: `drop` runs once and nothing uses `self` after it.
        unsafe { self.give_up(Handover::Fenced) };
    }
}

impl<B: Backend, S: State> fmt::Display for Allocation<'_, '_, B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} allocation #{} of {} bytes at {:#x}",
            S::NAME,
            self.core.generation.get(),
            self.core.len,
            self.core.addr
        )
    }
}

impl<B: Backend, S: State> fmt::Debug for Allocation<'_, '_, B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("state", &S::NAME)
            .field("addr", &format_args!("{:#x}", self.core.addr))
            .field("len", &self.core.len)
            .field("generation", &self.core.generation.get())
            .finish()
    }
}
