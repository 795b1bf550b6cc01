//! Shared prefixes — a policy on top of allocations: [`Prefix`] (the owner's read-write view),
//! [`PrefixMapping`] (a sharer's read-only view) and [`DivergedMapping`] (a sharer after
//! copy-on-write of its last granule). Each is an [`Allocation`] in a state of its own, with
//! the reference on the shared physical memory as its parts.
//!
//! Across processes, an exportable prefix ([`ExportablePrefix`]) is exported ([`Export`],
//! sent over a Unix socket), received as an [`Offer`] and imported read-only by
//! [`Binding::import`](crate::Binding::import) ([`ImportedPrefix`], in the state
//! [`Imported`]). Guide:
//! [`guide::sharing`](crate::guide::sharing).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use crate::allocation::Allocation;
use crate::backend::{
    Ability, Access, Backend, BackendError, Exportable, HandleKind, HostVisible, Op,
};
use crate::device::Quarantined;
use crate::device::{Build, Undone};
use crate::error::{
    CommitFailure, CowFailure, ReleaseFailure, Returned, ShareFailure, TransitionError,
};
mod ipc;

use crate::residual::{Held, SharedPhys, Split};
use crate::state::Wait;
use crate::state::{
    Live, Readable, Reserved, Retired, Retiring, State,
    sealed::{self, Repr},
};
use crate::token::host_slice_mut;
use crate::unwind::{Guarded, Scope};
pub use ipc::{
    Export, ImportError, Imported, ImportedPrefix, MESSAGE_LEN, Offer, PrefixMessage, WireError,
};
use std::convert::Infallible;
use std::marker::PhantomData;

/// A failed [`map_prefix`](Allocation::map_prefix): the same reservation, unchanged, or the
/// quarantined remains of a half-made mapping that could not be undone; and why.
pub type ShareError<'b, 'id, B> = TransitionError<
    Returned<Allocation<'b, 'id, B, Reserved>, Quarantined<'b, 'id, B>>,
    ShareFailure,
>;

/// A failed [`commit_prefix`](Allocation::commit_prefix): the same reservation, unchanged, or
/// the quarantined remains of a half-made prefix that could not be undone; and why.
pub type PrefixError<'b, 'id, B> = TransitionError<
    Returned<Allocation<'b, 'id, B, Reserved>, Quarantined<'b, 'id, B>>,
    CommitFailure,
>;

/// A failed [`diverge`](Allocation::diverge): the same mapping, unchanged and still shared, or
/// its quarantined remains when the boundary could be neither remapped nor restored; and why.
pub type CowError<'b, 'id, B> =
    TransitionError<Returned<PrefixMapping<'b, 'id, B>, Quarantined<'b, 'id, B>>, CowFailure>;

/// The owner's handle on a shared prefix: its read-write mapping of the prefix's physical
/// memory, from which sharers map it read-only ([`Allocation::map_prefix`]).
///
/// Its physical memory is charged once as owned whatever the number of sharers, and each of its
/// physical allocations (the body's and the boundary granule's) is released exactly once, when
/// its last mapping goes.
///
/// # Why counted, not borrowed
///
/// In a paged KV cache the sequences that share a system prompt finish in any order, the one
/// that computed the prompt often first. The physical memory must live as long as the *union*
/// of its mappings, which no static borrow can express, so a prefix's physical memory is
/// reference-counted: one reference per mapping, held by the mapping token, taken when it is made
/// and dropped only once the backend confirmed that mapping gone (a quarantined mapping keeps
/// its count). The count is touched only when a mapping is made or torn down, never on access.
///
/// What stays static is what can: every mapping token borrows the [`Binding`](crate::Binding)
/// it was made through (so it cannot outlive the binding's context pin, nor the device), carries the
/// device's brand (so a prefix of one device cannot be mapped into a reservation of another),
/// and has no way to write through a read-only mapping. While a prefix is shared its bytes are
/// immutable — the owner may write only while no sharer maps it — so every `&[u8]` lent by a
/// mapping stays valid. A sharer that must write inside the last, partially filled granule
/// takes a private copy of that granule with [`PrefixMapping::diverge`].
///
/// Made from a reservation by [`Allocation::commit_prefix`], which lays its physical memory out
/// for sharing (the boundary granule in an allocation of its own, so that every mapping maps
/// whole allocations); the owner fills it before sharing it. The owner's binding stays charged
/// for the prefix's bytes while this handle lives; after that the device holds them until the
/// last mapping goes.
///
/// A prefix of one device cannot be mapped into a reservation of another (each
/// `make_guard!` brands its device uniquely, so the second brand cannot be unified with the
/// first):
///
/// ```compile_fail,E0716
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::doubles::SimBackend;
/// make_guard!(ga);
/// make_guard!(gb);
/// let a = Device::new(ga, SimBackend::strict());
/// let b = Device::new(gb, SimBackend::strict());
/// let (ba, bb) = (a.bind(Budget::unlimited()).unwrap(), b.bind(Budget::unlimited()).unwrap());
/// let prefix = ba.reserve(1).unwrap().commit_prefix().unwrap();
/// let shared = bb.reserve(1).unwrap().map_prefix(&prefix);
/// ```
pub type Prefix<'b, 'id, B> = Allocation<'b, 'id, B, Owner>;

/// A [`Prefix`] whose physical memory was created exportable as handles of kind `K`
/// ([`commit_prefix_exportable`](Allocation::commit_prefix_exportable)), so that another
/// process can map it read-only ([`export`](Allocation::export)). Everything a prefix does, it
/// does; only it has `export`. A prefix made by [`commit_prefix`](Allocation::commit_prefix)
/// cannot be exported — the handle kinds are chosen when the memory is created (fact 26 of the
/// crate's CUDA facts, `docs/cuda-facts.md`):
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let prefix = binding.reserve(4096).unwrap().commit_prefix().unwrap();
/// let export = prefix.export();
/// ```
pub type ExportablePrefix<'b, 'id, B, K> = Allocation<'b, 'id, B, Owner<K>>;

/// A sharer's read-only mapping of a [`Prefix`]: zero additional physical bytes. It lends
/// `&[u8]` on the host, never `&mut [u8]`:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let prefix = binding.reserve(4096).unwrap().commit_prefix().unwrap();
/// let mut shared = binding.reserve(4096).unwrap().map_prefix(&prefix).unwrap();
/// shared.as_mut_slice()[0] = 1;
/// ```
///
/// and it cannot outlive the binding it was made through:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::doubles::SimBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, SimBackend::strict());
/// let owner = device.bind(Budget::unlimited()).unwrap();
/// let prefix = owner.reserve(1).unwrap().commit_prefix().unwrap();
/// let sharer = device.bind(Budget::unlimited()).unwrap();
/// let shared = sharer.reserve(1).unwrap().map_prefix(&prefix).unwrap();
/// drop(sharer);
/// drop(shared);
/// ```
///
/// nor the device:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::doubles::SimBackend;
/// # make_guard!(guard);
/// let device = Device::new(guard, SimBackend::strict());
/// // Leaked, so that only the mapping keeps the device borrowed.
/// let binding: &_ = Box::leak(Box::new(device.bind(Budget::unlimited()).unwrap()));
/// let prefix = binding.reserve(1).unwrap().commit_prefix().unwrap();
/// let shared = binding.reserve(1).unwrap().map_prefix(&prefix).unwrap();
/// drop(prefix);
/// drop(device);
/// drop(shared);
/// ```
pub type PrefixMapping<'b, 'id, B> = Allocation<'b, 'id, B, Sharer>;

/// A sharer's mapping after copy-on-write of the boundary granule: the prefix's body is still
/// shared read-only; the last granule is a private, writable copy.
pub type DivergedMapping<'b, 'id, B> = Allocation<'b, 'id, B, Diverged>;

/// State of a [`Prefix`]: the owner's read-write mapping of memory that sharers may map.
/// `K` is what its memory may be exported as: [`Local`] (nothing; the default), or a
/// [`HandleKind`] for an [`ExportablePrefix`].
#[derive(Debug)]
pub struct Owner<K = Local>(Infallible, PhantomData<K>);

/// The capability of a prefix that cannot be exported: its memory was created for this process
/// alone.
#[derive(Debug)]
pub enum Local {}

mod capability {
    /// Only this crate names this trait, so only it adds capabilities.
    pub trait Sealed {}
}

/// What a prefix's physical memory may be exported as (sealed): [`Local`] (nothing), or a
/// [`HandleKind`] ([`PosixFd`](crate::backend::PosixFd), [`Fabric`](crate::backend::Fabric)).
pub trait Capability: capability::Sealed + 'static {}
impl capability::Sealed for Local {}
impl<K: HandleKind> capability::Sealed for K {}
impl Capability for Local {}
impl<K: HandleKind> Capability for K {}
/// State of a [`PrefixMapping`]: a sharer's read-only mapping, owning no physical bytes.
#[derive(Debug)]
pub enum Sharer {}
/// State of a [`DivergedMapping`]: a sharer's mapping whose last granule is a private copy.
#[derive(Debug)]
pub enum Diverged {}

/// A state whose token maps shared physical memory (sealed).
pub trait Sharing: State {}

/// What a mapping of shared memory holds when it goes: its whole range mapped, its reference,
/// and `private` memory of its own; its binding is charged `charged` bytes for it.
fn retired<B: Backend>(
    at: Retiring<'_, B>,
    shared: SharedPhys<B::Phys>,
    private: Option<(B::Phys, usize)>,
    charged: usize,
) -> Retired<B> {
    let (backend, len) = (at.backend, at.len);
    Retired {
        held: Held {
            phys: private,
            shared: Some(shared),
            ..Held::mapped(len)
        },
        // Work may still read the mapping: its release waits for a fence.
        fence: Wait::on(backend.fence_for(&[at.addr])),
        charged,
        tail: 0,
    }
}

impl<K: Capability> sealed::Sealed for Owner<K> {}

impl<K: Capability> Repr for Owner<K> {
    type Parts<B: Backend> = SharedPhys<B::Phys>;

    fn retire<B: Backend>(shared: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        // The owner's binding carries the prefix's bytes while the owner's token lives.
        let len = at.len;
        retired(at, shared, None, len)
    }

    fn shared<B: Backend>(parts: &Self::Parts<B>) -> Option<&SharedPhys<B::Phys>> {
        Some(parts)
    }
}

impl sealed::Sealed for Sharer {}

impl Repr for Sharer {
    type Parts<B: Backend> = SharedPhys<B::Phys>;

    fn retire<B: Backend>(shared: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        retired(at, shared, None, 0)
    }

    fn shared<B: Backend>(parts: &Self::Parts<B>) -> Option<&SharedPhys<B::Phys>> {
        Some(parts)
    }
}

impl sealed::Sealed for Diverged {}

impl Repr for Diverged {
    /// The shared reference and the private last granule.
    type Parts<B: Backend> = (SharedPhys<B::Phys>, B::Phys);

    fn retire<B: Backend>((shared, private): Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let g = at.backend.granularity();
        retired(at, shared, Some((private, g)), g)
    }

    fn shared<B: Backend>(parts: &Self::Parts<B>) -> Option<&SharedPhys<B::Phys>> {
        Some(&parts.0)
    }
}

impl<K: Capability> State for Owner<K> {
    const NAME: &'static str = "Prefix";
}
impl State for Sharer {
    const NAME: &'static str = "PrefixMapping";
}
impl State for Diverged {
    const NAME: &'static str = "DivergedMapping";
}
impl<K: Capability> Live for Owner<K> {}
impl Live for Sharer {}
impl Live for Diverged {}
impl<K: Capability> Readable for Owner<K> {}
impl Readable for Sharer {}
impl Readable for Diverged {}
impl<K: Capability> Sharing for Owner<K> {}
impl Sharing for Sharer {}
impl Sharing for Diverged {}

impl<B: Backend, S: Sharing> Allocation<'_, '_, B, S> {
    /// How many mappings of this prefix's physical memory exist now, this one included.
    pub fn mappings(&self) -> usize {
        S::shared::<B>(self.parts()).map_or(0, SharedPhys::refs)
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    /// Commits this reservation as a shared prefix: creates its physical memory, maps it
    /// read-write for the owner and charges it, as [`commit`](Allocation::commit) does; sharers
    /// may then map it read-only ([`map_prefix`](Allocation::map_prefix)).
    ///
    /// The memory is laid out for sharing: a prefix longer than one granule keeps its last
    /// (boundary) granule in a physical allocation of its own, apart from the body. Every
    /// mapping of the prefix then maps whole allocations from offset 0 — the only mapping the
    /// CUDA driver documents — and a sharer's copy-on-write ([`diverge`](Allocation::diverge))
    /// swaps one whole allocation for another. (So a prefix of `n > 1` granules costs two
    /// create, map and release calls where a plain commit costs one.)
    ///
    /// # Errors
    ///
    /// [`PrefixError`]: the same reservation, unchanged, when the budget or the capacity
    /// refuses or a backend call fails (everything undone; a release that fails while undoing
    /// is quarantined, as for `commit`); or, when unmapping the half-made mapping fails too,
    /// its quarantined remains (reservation, mapping and memory together).
    ///
    /// The prefix borrows the owner's binding, so the owner cannot drop its binding (its
    /// context pin) while the prefix lives:
    ///
    /// ```compile_fail,E0505
    /// use memtoken::backend::doubles::SimBackend;
    /// use memtoken::{make_guard, Budget, Device};
    /// make_guard!(guard);
    /// let device = Device::new(guard, SimBackend::strict());
    /// let owner = device.bind(Budget::unlimited()).unwrap();
    /// let prefix = owner.reserve(1).unwrap().commit_prefix().unwrap();
    /// drop(owner);
    /// drop(prefix);
    /// ```
    #[must_use = "a failed commit returns the reservation inside the error"]
    pub fn commit_prefix(self) -> Result<Prefix<'b, 'id, B>, PrefixError<'b, 'id, B>> {
        self.commit_shared(Guarded::create, false)
    }

    /// Commits this reservation as a shared prefix whose physical memory is created exportable
    /// as handles of kind `K` (CUDA: `requestedHandleTypes` at `cuMemCreate`; host: each
    /// physical allocation in a sealed `memfd` of its own), so that it can be
    /// [`export`](Allocation::export)ed to another process. Otherwise exactly
    /// [`commit_prefix`](Allocation::commit_prefix).
    ///
    /// # Errors
    ///
    /// As for [`commit_prefix`](Allocation::commit_prefix).
    #[must_use = "a failed commit returns the reservation inside the error"]
    pub fn commit_prefix_exportable<K: HandleKind>(
        self,
    ) -> Result<ExportablePrefix<'b, 'id, B, K>, PrefixError<'b, 'id, B>>
    where
        B: Exportable<K>,
    {
        self.commit_shared(Guarded::create_exportable::<K>, true)
    }

    /// After a mapping could not be made and one already made could not be undone: the
    /// reservation goes to quarantine with what `stuck` holds (still mapped, still charged).
    fn quarantine_stuck<F>(
        self,
        stuck: Held<B::Phys>,
        cause: F,
    ) -> TransitionError<Returned<Self, Quarantined<'b, 'id, B>>, F> {
        let binding = self.core().binding;
        let (core, ()) = self.into_core();
        let held = Held {
            reserved: true,
            ..stuck
        };
        TransitionError {
            token: Returned::Quarantined(Quarantined::new(binding, core.residual(held))),
            cause,
        }
    }

    /// A prefix is made to be mapped at other addresses too (and exported, if `exportable`):
    /// refused up front by a mechanism that cannot, before anything is charged.
    fn can_share(&self, exportable: bool) -> Result<(), CommitFailure> {
        let core = self.core();
        let backend = core.device().backend();
        let needs = |ability, op| backend.needs(ability, op, core.addr, core.len);
        if exportable {
            needs(Ability::Export, Op::Create).map_err(CommitFailure::Unsupported)?;
        }
        needs(Ability::MapTwice, Op::Map).map_err(CommitFailure::Unsupported)
    }

    /// [`commit_prefix`](Allocation::commit_prefix), its memory made by `create`: the body
    /// (all but the last granule, when there is more than one) and the boundary granule, each
    /// an allocation of its own, mapped whole.
    fn commit_shared<K: Capability>(
        self,
        create: impl Fn(&Guarded<B>, usize) -> Result<B::Phys, BackendError>,
        exportable: bool,
    ) -> Result<Allocation<'b, 'id, B, Owner<K>>, PrefixError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            let core = self.core();
            let mut build = core.binding.build(core.addr);
            if let Err(cause) = self
                .can_share(exportable)
                .and_then(|()| self.admit(&mut build))
            {
                return Err(TransitionError {
                    token: Returned::Unchanged(self),
                    cause,
                });
            }
            let body = core.len - core.device().granularity();
            let mut made = || {
                if body > 0 {
                    build.create(0, body, &create)?;
                }
                build.create(body, core.len - body, &create)?;
                if body > 0 {
                    build.map(0, Access::ReadWrite)?;
                }
                build.map(usize::from(body > 0), Access::ReadWrite)
            };
            if let Err(error) = made() {
                return Err(match build.undo() {
                    Undone::Stuck(stuck, rollback) => {
                        let rollback = unmap_failure(rollback);
                        let error = Box::new(error);
                        self.quarantine_stuck(stuck, CommitFailure::UnmapFailed { error, rollback })
                    }
                    undone => TransitionError {
                        token: Returned::Unchanged(self),
                        cause: CommitFailure::undone(error, undone.rollback()),
                    },
                });
            }
            let split = match build.finish() {
                [Some(body), Some(boundary)] => Split {
                    body: Some((body.phys, body.len)),
                    boundary: (boundary.phys, boundary.len),
                },
                [Some(boundary), None] => Split {
                    body: None,
                    boundary: (boundary.phys, boundary.len),
                },
                _ => unreachable!("a prefix's memory was made"),
            };
            let (core, ()) = self.into_core();
            let shared = core.device().share(split);
            Ok(Allocation::from_core(core, shared))
        })
    }

    /// Maps `prefix` read-only into this reservation, which must be exactly as long. The sharer
    /// owns no physical bytes: nothing is charged to its budget; its mapped bytes are charged.
    ///
    /// The body and the boundary granule are two physical allocations, each mapped whole, so
    /// that the boundary can later be replaced by a private copy
    /// ([`diverge`](Allocation::diverge)).
    ///
    /// # Errors
    ///
    /// [`ShareError`]: the same reservation, unchanged, if the lengths differ or a backend
    /// call fails (everything undone); the quarantined remains if undoing a half-made mapping
    /// failed too.
    #[must_use = "a refused share returns the reservation inside the error"]
    pub fn map_prefix<K: Capability>(
        self,
        prefix: &Allocation<'_, 'id, B, Owner<K>>,
    ) -> Result<PrefixMapping<'b, 'id, B>, ShareError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            let refuse = |token, cause| {
                Err(TransitionError {
                    token: Returned::Unchanged(token),
                    cause,
                })
            };
            if self.len() != prefix.len() {
                let cause = ShareFailure::SizeMismatch {
                    reservation: self.len(),
                    prefix: prefix.len(),
                };
                return refuse(self, cause);
            }
            let core = self.core();
            let device = core.device();
            if let Err(e) = device.ensure_live(Op::Map, core.addr, core.len) {
                return refuse(self, ShareFailure::Backend(Box::new(e)));
            }
            let split = prefix.parts().split();
            let mut borrow = core.binding.borrow(core.addr, prefix.parts());
            let mut made = || {
                if let Some((phys, n)) = split.body {
                    borrow.map(n, phys, Access::ReadOnly)?;
                }
                let (boundary, g) = split.boundary;
                borrow.map(g, boundary, Access::ReadOnly)
            };
            if let Err(error) = made() {
                let error = Box::new(error);
                return match borrow.undo() {
                    // The half-made mapping stays, with its reference, in a quarantined token.
                    Undone::Stuck(stuck, rollback) => {
                        let rollback = unmap_failure(rollback);
                        let cause = ShareFailure::RollbackFailed { error, rollback };
                        Err(self.quarantine_stuck(stuck, cause))
                    }
                    // Giving back a reference that is not the last one releases nothing.
                    Undone::Clean | Undone::Quarantined(_) => {
                        refuse(self, ShareFailure::Backend(error))
                    }
                };
            }
            let shared = borrow.finish();
            let (core, ()) = self.into_core();
            Ok(Allocation::from_core(core, shared))
        })
    }
}

/// The failed unmap that left a mapping stuck: a teardown fails only at a backend call.
fn unmap_failure(failure: ReleaseFailure) -> Box<BackendError> {
    match failure {
        ReleaseFailure::Backend(e) => e,
        ReleaseFailure::Pending | ReleaseFailure::Stuck => {
            unreachable!("a teardown waits for no fence")
        }
    }
}

impl<B: HostVisible, K: Capability> Allocation<'_, '_, B, Owner<K>> {
    /// The prefix's bytes, writable — only while no sharer maps them (`None` otherwise), so a
    /// sharer's `&[u8]` never sees a byte change.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        if !self.parts_mut().is_unique() {
            return None;
        }
        // SAFETY: the owner's mapping is read-write and stays mapped while `self` is borrowed;
        // it is the only mapping of the memory (`is_unique` also orders every read through a
        // mapping that is gone before this write), and new ones need `&self`, which `&mut self`
        // excludes.
        Some(unsafe { host_slice_mut(self.addr(), self.len()) })
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Sharer> {
    /// Copy-on-write of the boundary granule: creates a private granule, copies the shared
    /// last granule into it, and remaps it read-write in its place. The shared original is
    /// untouched and still mapped by the others. Charges one granule to this sharer's budget.
    ///
    /// # Errors
    ///
    /// [`CowError`]: this same mapping, unchanged, if work that may read it is still running
    /// ([`CowFailure::Pending`]), the budget refuses or a backend call fails (everything
    /// undone); the mapping's quarantined remains if the boundary could be neither remapped nor
    /// restored.
    #[must_use = "a refused copy-on-write returns the mapping inside the error"]
    pub fn diverge(self) -> Result<DivergedMapping<'b, 'id, B>, CowError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            let core = self.core();
            let (binding, device) = (core.binding, core.device());
            let backend = device.backend();
            let g = device.granularity();
            let boundary = core.addr + core.len - g;
            let refuse = |token, cause| {
                Err(TransitionError {
                    token: Returned::Unchanged(token),
                    cause: CowFailure::Private(Box::new(cause)),
                })
            };
            if let Err(e) = device.ensure_live(Op::Create, 0, g) {
                return refuse(self, CommitFailure::Backend(e));
            }
            // The boundary is unmapped below: not while work that may read it still runs (on any
            // stream the backend's fences cover for it). The token is moved in, so no new work
            // can start.
            if !backend.idle(&[core.addr]) {
                return Err(TransitionError {
                    token: Returned::Unchanged(self),
                    cause: CowFailure::Pending,
                });
            }
            let mut build = binding.build(core.addr);
            if let Err(cause) = build.budget(g) {
                return refuse(self, cause);
            }
            let at = core.len - g;
            let undo = |build: Build<'_, 'b, 'id, B>, error| {
                CommitFailure::undone(error, build.undo().rollback())
            };
            let private = match build.create(at, g, Guarded::create) {
                Ok(p) => p,
                Err(e) => return refuse(self, undo(build, e)),
            };
            if let Err(e) = backend.copy_into_phys(private, boundary, g) {
                return refuse(self, undo(build, e));
            }
            if let Err(e) = device.unmap(boundary, g) {
                // Whether the boundary is still mapped is unknown: the mapping lends no memory any
                // more, its remains are quarantined.
                let _ = build.undo(); // a failure is quarantined
                let cause = CowFailure::Unmap(Box::new(e));
                return Err(self.quarantine_diverging(core.len, cause));
            }
            if let Err(error) = build.map(0, Access::ReadWrite) {
                // Not a teardown: the shared boundary is mapped again where it was, so that the
                // mapping comes back unchanged.
                let (shared, _) = self.parts().split().boundary;
                return match device.map(boundary, g, shared, Access::ReadOnly) {
                    Ok(()) => refuse(self, undo(build, error)),
                    // Neither the copy nor the original is mapped at the boundary.
                    Err(restore) => {
                        let _ = build.undo(); // a failure is quarantined
                        let (error, restore) = (Box::new(error), Box::new(restore));
                        let cause = CowFailure::Remap { error, restore };
                        Err(self.quarantine_diverging(core.len - g, cause))
                    }
                };
            }
            build.keep();
            let (core, shared) = self.into_core();
            Ok(Allocation::from_core(core, (shared, private)))
        })
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Sharer> {
    /// Quarantines the mapping (`mapped` bytes of it still mapped) when its state is uncertain
    /// after a copy-on-write failed half-way.
    fn quarantine_diverging(self, mapped: usize, cause: CowFailure) -> CowError<'b, 'id, B> {
        let binding = self.core().binding;
        let (core, shared) = self.into_core();
        let held = Held {
            shared: Some(shared),
            ..Held::mapped(mapped)
        };
        TransitionError {
            token: Returned::Quarantined(Quarantined::new(binding, core.residual(held))),
            cause,
        }
    }
}

impl<B: Backend> Allocation<'_, '_, B, Diverged> {
    /// Where the private granule starts, as an offset into the mapping.
    pub fn boundary_offset(&self) -> usize {
        self.len() - self.binding().device().granularity()
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, Diverged> {
    /// The private last granule, writable.
    pub fn boundary_mut(&mut self) -> &mut [u8] {
        let at = self.boundary_offset();
        // SAFETY: the last granule is this token's own physical memory, mapped read-write, and
        // `&mut self` makes this the only borrow of it.
        unsafe { host_slice_mut(self.addr() + at, self.len() - at) }
    }
}
