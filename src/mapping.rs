//! Shared prefixes: [`Prefix`], [`PrefixMapping`] and [`DivergedMapping`] (copy-on-write).

use crate::allocation::{Allocation, Released};
use crate::backend::{Access, Addr, Backend, BackendError, HostVisible, Op};
use crate::binding::Binding;
use crate::device::{Device, Generation};
use crate::error::{CommitFailure, CowError, QuarantineError, ShareError, ShareFailure};
use crate::ledger::Axis;
use crate::quarantine::{Quarantined, settle};
use crate::residual::{Residual, SharedKey};
use crate::state::{Committed, Reserved};
use std::fmt;
use std::mem::ManuallyDrop;

/// The owner's handle on a shared prefix: its read-write mapping of the prefix's physical
/// memory, from which sharers map it read-only ([`Allocation::map_prefix`]).
////// number of sharers, released exactly once, when its last mapping goes.
///
/// # Why counted, not borrowed
///
/// In a paged KV cache the sequences that share a system prompt finish in any order, the one
/// that computed the prompt often first. The physical memory must live as long as the *union*
/// of its mappings, which no static borrow can express, so a prefix's physical memory is
/// reference-counted in its device's table: one count per mapping, taken when a mapping is made
/// and dropped only once the backend confirmed that mapping gone (a quarantined mapping keeps
/// its count). The count is touched only when a mapping is made or torn down, never on access.
///
/// What stays static is what can: every mapping token borrows the [`Binding`] it was made
/// through (so it cannot outlive the binding's context pin, nor the device), carries the
/// device's brand (so a prefix of one device cannot be mapped into a reservation of another),
/// and has no way to write through a read-only mapping. While a prefix is shared its bytes are
/// immutable — the owner may write only while no sharer maps it — so every `&[u8]` lent by a
/// mapping stays valid. A sharer that must write inside the last, partially filled granule
/// takes a private copy of that granule with [`PrefixMapping::diverge`].
///
/// Made from a committed allocation by [`Allocation::into_prefix`], with no backend call. The
/// owner's binding stays charged for the prefix's bytes while this handle lives; after that the
/// device holds them until the last mapping goes.
///
/// A prefix of one device cannot be mapped into a reservation of another (each
/// `make_guard!` brands its device uniquely, so the second brand cannot be unified with the
/// first):
///
/// ```compile_fail,E0716
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::SimBackend;
/// make_guard!(ga);
/// make_guard!(gb);
/// let a = Device::new(ga, SimBackend::default());
/// let b = Device::new(gb, SimBackend::default());
/// let (ba, bb) = (a.bind(Budget::unlimited()).unwrap(), b.bind(Budget::unlimited()).unwrap());
/// let prefix = ba.reserve(1).unwrap().commit().unwrap().into_prefix();
/// let shared = bb.reserve(1).unwrap().map_prefix(&prefix);
/// ```
pub struct Prefix<'b, 'id, B: Backend> {
    core: Core<'b, 'id, B>,
}

/// A sharer's read-only mapping of a [`Prefix`]: zero additional physical bytes. It lends
/// `&[u8]` on the host, never `&mut [u8]`:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let prefix = binding.reserve(4096).unwrap().commit().unwrap().into_prefix();
/// let mut shared = binding.reserve(4096).unwrap().map_prefix(&prefix).unwrap();
/// shared.as_mut_slice()[0] = 1;
/// ```
///
/// and it cannot outlive the binding it was made through:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::SimBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, SimBackend::default());
/// let owner = device.bind(Budget::unlimited()).unwrap();
/// let prefix = owner.reserve(1).unwrap().commit().unwrap().into_prefix();
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
/// # use memtoken::backend::SimBackend;
/// # make_guard!(guard);
/// let device = Device::new(guard, SimBackend::default());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let prefix = binding.reserve(1).unwrap().commit().unwrap().into_prefix();
/// let shared = binding.reserve(1).unwrap().map_prefix(&prefix).unwrap();
/// drop(prefix);
/// drop(device);
/// drop(shared);
/// ```
pub struct PrefixMapping<'b, 'id, B: Backend> {
    core: Core<'b, 'id, B>,
}

/// A sharer's mapping after copy-on-write of the boundary granule: the prefix's body is still
/// shared read-only; the last granule is a private, writable copy.
pub struct DivergedMapping<'b, 'id, B: Backend> {
    core: Core<'b, 'id, B>,
    private: B::Phys,
}

/// What every mapping token holds: its binding, its VA range, its identity, and its reference
/// on the shared physical memory.
struct Core<'b, 'id, B: Backend> {
    binding: &'b Binding<'b, 'id, B>,
    addr: Addr,
    len: usize,
    generation: Generation,
    key: SharedKey,
}

impl<B: Backend> Clone for Core<'_, '_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Core<'_, '_, B> {}

impl<'b, 'id, B: Backend> Core<'b, 'id, B> {
    fn device(&self) -> &'b Device<'id, B> {
        self.binding.device()
    }

    fn granularity(&self) -> usize {
        self.device().granularity()
    }

    /// What the token holds: its reservation, mapped whole, and its shared reference.
    fn residual(&self) -> Residual<B::Phys> {
        Residual {
            mapped: self.len,
            shared: Some(self.key),
            ..Residual::va(self.generation, self.addr, self.len)
        }
    }

    /// Gives `residual` back now if no work may still use it, else to the device's deferred
    /// queue. `owned` is what the binding is charged for and hands over with the token.
    fn retire(
        self,
        residual: Residual<B::Phys>,
        owned: usize,
    ) -> Result<Option<Released>, QuarantineError<'b, 'id, B>> {
        let backend = self.device().backend();
        let fence = backend.fence();
        if backend.fence_done(&fence) {
            backend.retire_fence(fence);
            return settle(self.binding, residual).map(Some);
        }
        self.binding.refund(owned);
        self.device().dispose(residual, Some(fence));
        Ok(None)
    }

    /// What a dropped token does: hands everything to the device.
    fn dispose(self, residual: Residual<B::Phys>, owned: usize) {
        self.binding.refund(owned);
        let fence = self.device().backend().fence();
        self.device().dispose(residual, Some(fence));
    }

    /// # Safety
    ///
    /// The range must be mapped readable by a [`HostVisible`] backend for as long as the
    /// returned borrow lives, and no one may write it meanwhile.
    unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

macro_rules! accessors {
    ($($t:ident),*) => {$(
        impl<'b, 'id, B: Backend> $t<'b, 'id, B> {
            /// Start of the mapped VA range.
            pub fn addr(&self) -> Addr {
                self.core.addr
            }

            /// Length of the mapping in bytes (the whole prefix).
            pub fn size(&self) -> usize {
                self.core.len
            }

            /// This mapping's identity.
            pub fn generation(&self) -> Generation {
                self.core.generation
            }

            /// How many mappings of this prefix's physical memory exist now, this one included.
            pub fn mappings(&self) -> usize {
                self.core.device().share_refs(self.core.key)
            }

            /// The binding this mapping was made through (and whose budget it is charged to).
            pub fn binding(&self) -> &'b Binding<'b, 'id, B> {
                self.core.binding
            }

            /// The backend, for interop.
            pub(crate) fn backend(&self) -> &B {
                self.core.device().backend()
            }
        }

        impl<B: HostVisible> $t<'_, '_, B> {
            /// The prefix's bytes, read-only.
            pub fn as_slice(&self) -> &[u8] {
                // SAFETY: the token keeps its whole range mapped readable until it is consumed;
                // shared bytes are written only through a prefix with no other mapping (see
                // `Prefix::as_mut_slice`), and a private granule only through `&mut self`.
                unsafe { self.core.bytes() }
            }
        }

        impl<B: Backend> fmt::Debug for $t<'_, '_, B> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($t))
                    .field("addr", &format_args!("{:#x}", self.core.addr))
                    .field("len", &self.core.len)
                    .field("generation", &self.core.generation.get())
                    .finish()
            }
        }
    )*};
}
accessors!(Prefix, PrefixMapping, DivergedMapping);

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Committed> {
    /// Turns this allocation into a shared prefix: its mapping stays read-write for the owner,
    /// and sharers may now map its physical memory read-only. No backend call.
    pub fn into_prefix(self) -> Prefix<'b, 'id, B> {
        let (binding, addr, len, generation, phys) = self.into_raw();
        let device = binding.device();
        device.share_new(generation.get(), phys, len);
        Prefix {
            core: Core {
                binding,
                addr,
                len,
                generation,
                key: generation.get(),
            },
        }
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    /// Maps `prefix` read-only into this reservation, which must be exactly as long. The sharer
    /// owns no physical bytes: nothing is charged to its budget; its mapped bytes are charged.
    ///
    /// The body and the last granule are mapped separately, so that the last one can later be
    /// replaced by a private copy ([`PrefixMapping::diverge`]).
    ///
    /// # Errors
    ///
    /// [`ShareError::Refused`] with this same reservation if the sizes differ or a backend call
    /// fails (everything undone); [`ShareError::Quarantined`] if undoing a half-made mapping
    /// failed too.
    #[must_use = "a refused share returns the reservation inside the error"]
    pub fn map_prefix(
        self,
        prefix: &Prefix<'_, 'id, B>,
    ) -> Result<PrefixMapping<'b, 'id, B>, ShareError<'b, 'id, B>> {
        if self.size() != prefix.size() {
            let cause = ShareFailure::SizeMismatch {
                reservation: self.size(),
                prefix: prefix.size(),
            };
            return Err(ShareError::Refused { token: self, cause });
        }
        let (binding, addr, len) = (self.binding(), self.addr(), self.size());
        let device = binding.device();
        let backend = device.backend();
        let key = prefix.core.key;
        if let Err(e) = device.ensure_live(Op::Map, addr, len) {
            let cause = ShareFailure::Backend(e);
            return Err(ShareError::Refused { token: self, cause });
        }
        let body = len - device.granularity();
        let (phys, _) = device.share_ref(key);
        if body > 0 {
            if let Err(e) = backend.map(addr, body, phys, 0, Access::ReadOnly) {
                device.unshare(key);
                let cause = ShareFailure::Backend(e);
                return Err(ShareError::Refused { token: self, cause });
            }
            device.charge(Axis::Mapped, body);
        }
        if let Err(e) = backend.map(addr + body, len - body, phys, body, Access::ReadOnly) {
            if body > 0 {
                if let Err(cause) = backend.unmap(addr, body) {
                    // The half-made mapping stays, with its reference, in a quarantined token.
                    let (binding, addr, len, generation, ()) = self.into_raw();
                    let residual = Residual {
                        mapped: body,
                        shared: Some(key),
                        ..Residual::va(generation, addr, len)
                    };
                    let token = Quarantined::new(binding, residual);
                    let cause = cause.into();
                    return Err(ShareError::Quarantined(QuarantineError { token, cause }));
                }
                device.refund(Axis::Mapped, body);
            }
            device.unshare(key);
            let cause = ShareFailure::Backend(e);
            return Err(ShareError::Refused { token: self, cause });
        }
        device.charge(Axis::Mapped, len - body);
        let (binding, addr, len, generation, ()) = self.into_raw();
        Ok(PrefixMapping {
            core: Core {
                binding,
                addr,
                len,
                generation,
                key,
            },
        })
    }
}

impl<'b, 'id, B: Backend> Prefix<'b, 'id, B> {
    /// Unmaps the owner's view and frees its VA; the physical memory stays while sharers map
    /// it. `Ok(None)`: work may still use the memory, so the device finishes the release at a
    /// later [`poll`](Device::poll).
    ///
    /// # Errors
    ///
    /// [`QuarantineError`] with what could not be given back.
    #[must_use = "a failed release returns a quarantined token inside the error"]
    pub fn release(self) -> Result<Option<Released>, QuarantineError<'b, 'id, B>> {
        let core = ManuallyDrop::new(self).core;
        // The prefix's bytes leave the owner's budget: the device holds them until the last
        // mapping goes.
        core.binding.refund(core.len);
        core.retire(core.residual(), 0)
    }
}

impl<B: HostVisible> Prefix<'_, '_, B> {
    /// The prefix's bytes, writable — only while no sharer maps them (`None` otherwise), so a
    /// sharer's `&[u8]` never sees a byte change.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        if self.mappings() != 1 {
            return None;
        }
        // SAFETY: the owner's mapping is read-write and stays mapped while `self` is borrowed;
        // it is the only mapping of the memory, and new ones need `&self`, which `&mut self`
        // excludes.
        Some(unsafe { std::slice::from_raw_parts_mut(self.core.addr as *mut u8, self.core.len) })
    }
}

impl<'b, 'id, B: Backend> PrefixMapping<'b, 'id, B> {
    /// Unmaps this sharer's view and frees its VA; the last mapping of the prefix releases its
    /// physical memory. `Ok(None)`: deferred to the device's next [`poll`](Device::poll).
    ///
    /// # Errors
    ///
    /// [`QuarantineError`] with what could not be given back (this sharer's range only).
    #[must_use = "a failed release returns a quarantined token inside the error"]
    pub fn release(self) -> Result<Option<Released>, QuarantineError<'b, 'id, B>> {
        let core = ManuallyDrop::new(self).core;
        core.retire(core.residual(), 0)
    }

    /// Copy-on-write of the boundary granule: creates a private granule, copies the shared
    /// last granule into it, and remaps it read-write in its place. The shared original is
    /// untouched and still mapped by the others. Charges one granule to this sharer's budget.
    ///
    /// # Errors
    ///
    /// [`CowError::Refused`] with this same mapping, unchanged, if the budget refuses or a
    /// backend call fails (everything undone); [`CowError::Quarantined`] if the boundary could
    /// be neither remapped nor restored: the mapping's remains are quarantined.
    #[must_use = "a refused copy-on-write returns the mapping inside the error"]
    pub fn diverge(self) -> Result<DivergedMapping<'b, 'id, B>, CowError<'b, 'id, B>> {
        let core = self.core;
        let device = core.device();
        let backend = device.backend();
        let g = core.granularity();
        let boundary = core.addr + core.len - g;
        if let Err(e) = device.ensure_live(Op::Create, 0, g) {
            let cause = CommitFailure::Backend(e);
            return Err(CowError::Refused { token: self, cause });
        }
        if let Err(cause) = core.binding.charge(g) {
            return Err(CowError::Refused { token: self, cause });
        }
        // Undoes the private granule and hands the mapping back unchanged.
        let refused = |token, error, private: Option<B::Phys>| {
            let rollback = match private {
                None => {
                    core.binding.uncharge(g);
                    Ok(())
                }
                Some(p) => {
                    core.binding.refund(g);
                    device.release_orphan(p, g)
                }
            };
            let cause = match rollback {
                Ok(()) => CommitFailure::Backend(error),
                Err(rollback) => CommitFailure::RollbackFailed { error, rollback },
            };
            CowError::Refused { token, cause }
        };
        // Quarantines what the mapping holds (`mapped` bytes of it) when its state is uncertain.
        let quarantine = |token: Self, mapped: usize, error: BackendError, private| {
            let core = ManuallyDrop::new(token).core;
            core.binding.refund(g);
            let _ = device.release_orphan(private, g); // a failure is quarantined
            let residual = Residual {
                mapped,
                ..core.residual()
            };
            let token = Quarantined::new(core.binding, residual);
            CowError::Quarantined(QuarantineError {
                token,
                cause: error.into(),
            })
        };
        let private = match backend.create(g) {
            Ok(p) => p,
            Err(e) => return Err(refused(self, e, None)),
        };
        if let Err(e) = backend.copy_into_phys(private, 0, boundary, g) {
            return Err(refused(self, e, Some(private)));
        }
        if let Err(e) = backend.unmap(boundary, g) {
            // Whether the boundary is still mapped is unknown: the mapping lends no memory any
            // more, its remains are quarantined.
            return Err(quarantine(self, core.len, e, private));
        }
        device.refund(Axis::Mapped, g);
        if let Err(e) = backend.map(boundary, g, private, 0, Access::ReadWrite) {
            let (shared, _) = device.share_get(core.key);
            if backend
                .map(boundary, g, shared, core.len - g, Access::ReadOnly)
                .is_ok()
            {
                device.charge(Axis::Mapped, g);
                return Err(refused(self, e, Some(private)));
            }
            // Neither the copy nor the original is mapped at the boundary.
            return Err(quarantine(self, core.len - g, e, private));
        }
        device.charge(Axis::Mapped, g);
        let core = ManuallyDrop::new(self).core;
        Ok(DivergedMapping { core, private })
    }
}

impl<'b, 'id, B: Backend> DivergedMapping<'b, 'id, B> {
    /// Where the private granule starts, as an offset into the mapping.
    pub fn boundary_offset(&self) -> usize {
        self.core.len - self.core.granularity()
    }

    fn residual(&self) -> Residual<B::Phys> {
        Residual {
            phys: Some((self.private, self.core.granularity())),
            ..self.core.residual()
        }
    }

    /// Unmaps, releases the private granule, drops the shared reference and frees the VA.
    /// `Ok(None)`: deferred to the device's next [`poll`](Device::poll).
    ///
    /// # Errors
    ///
    /// [`QuarantineError`] with what could not be given back.
    #[must_use = "a failed release returns a quarantined token inside the error"]
    pub fn release(self) -> Result<Option<Released>, QuarantineError<'b, 'id, B>> {
        let this = ManuallyDrop::new(self);
        this.core.retire(this.residual(), this.core.granularity())
    }
}

impl<B: HostVisible> DivergedMapping<'_, '_, B> {
    /// The private last granule, writable.
    pub fn boundary_mut(&mut self) -> &mut [u8] {
        let g = self.core.granularity();
        let at = self.core.addr + self.core.len - g;
        // SAFETY: the last granule is this token's own physical memory, mapped read-write, and
        // `&mut self` makes this the only borrow of it.
        unsafe { std::slice::from_raw_parts_mut(at as *mut u8, g) }
    }
}

impl<B: Backend> Drop for Prefix<'_, '_, B> {
    fn drop(&mut self) {
        self.core.dispose(self.core.residual(), self.core.len);
    }
}

impl<B: Backend> Drop for PrefixMapping<'_, '_, B> {
    fn drop(&mut self) {
        self.core.dispose(self.core.residual(), 0);
    }
}

impl<B: Backend> Drop for DivergedMapping<'_, '_, B> {
    fn drop(&mut self) {
        let g = self.core.granularity();
        self.core.dispose(self.residual(), g);
    }
}
