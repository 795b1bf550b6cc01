//! [`Allocation`]: a linear owning token for one VA range, its state in its type.

use crate::backend::{Access, Addr, Backend, HostVisible, Op};
use crate::binding::Binding;
use crate::device::Generation;
use crate::error::{CommitError, CommitFailure, CompleteError, QuarantineError};
use crate::ledger::Axis;
use crate::quarantine::settle;
use crate::residual::Residual;
use crate::state::{Committed, Releasing, Reserved, State, sealed::Sealed};
use std::fmt;
use std::mem::ManuallyDrop;

/// A linear owning token for one VA range of `len` bytes, in state `S`.
///
/// The token is the only owner of its range and of the physical memory mapped there: it is
/// neither `Clone` nor `Copy`, every transition consumes it, and a fallible transition hands it
/// back inside its error. It borrows its [`Binding`] (and through it the [`Device`](crate::Device)),
/// so it cannot outlive either, and it carries the device's brand `'id`.
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
    binding: &'b Binding<'b, 'id, B>,
    addr: Addr,
    len: usize,
    generation: Generation,
    parts: ManuallyDrop<<S as Sealed>::Parts<B>>,
}

/// A token's fields without its parts: all `Copy`.
struct Head<'b, 'id, B: Backend> {
    binding: &'b Binding<'b, 'id, B>,
    addr: Addr,
    len: usize,
    generation: Generation,
}

impl<B: Backend> Clone for Head<'_, '_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Head<'_, '_, B> {}

/// Proof that an allocation was released: its mapping is gone, its physical memory released,
/// its VA freed. A plain receipt, not a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// Which allocation.
    pub generation: Generation,
    /// Its length in bytes.
    pub len: usize,
}

impl<'b, 'id, B: Backend, S: State> Allocation<'b, 'id, B, S> {
    fn from_head(h: Head<'b, 'id, B>, parts: <S as Sealed>::Parts<B>) -> Self {
        Self {
            binding: h.binding,
            addr: h.addr,
            len: h.len,
            generation: h.generation,
            parts: ManuallyDrop::new(parts),
        }
    }

    /// Takes the token apart without running its `Drop`.
    fn into_head(self) -> (Head<'b, 'id, B>, <S as Sealed>::Parts<B>) {
        let mut this = ManuallyDrop::new(self);
        let head = Head {
            binding: this.binding,
            addr: this.addr,
            len: this.len,
            generation: this.generation,
        };
        // SAFETY: `this` is never dropped nor used again, so the parts are taken exactly once.
        let parts = unsafe { ManuallyDrop::take(&mut this.parts) };
        (head, parts)
    }

    /// Takes the token apart into its binding, range, identity and parts, without its `Drop`.
    pub(crate) fn into_raw(
        self,
    ) -> (
        &'b Binding<'b, 'id, B>,
        Addr,
        usize,
        Generation,
        <S as Sealed>::Parts<B>,
    ) {
        let (h, parts) = self.into_head();
        (h.binding, h.addr, h.len, h.generation, parts)
    }

    /// Start of the VA range.
    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// Length of the VA range in bytes (a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.len
    }

    /// This allocation's identity.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// The binding this token was made through.
    pub fn binding(&self) -> &'b Binding<'b, 'id, B> {
        self.binding
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    pub(crate) fn reserved(
        binding: &'b Binding<'b, 'id, B>,
        addr: Addr,
        len: usize,
        generation: Generation,
    ) -> Self {
        Self::from_head(
            Head {
                binding,
                addr,
                len,
                generation,
            },
            (),
        )
    }

    /// Creates physical memory, maps it read-write and charges it: the memory becomes usable.
    ///
    /// # Errors
    ///
    /// [`CommitError`], with this same token inside, when the budget or the physical capacity
    /// would be exceeded or a backend call fails. Nothing stays mapped or charged, except when
    /// undoing a half-done commit fails too: then the orphaned physical memory is in the
    /// device's quarantine, charged as owned, and the error says so.
    #[must_use = "a failed commit returns the reserved token inside the error"]
    pub fn commit(self) -> Result<Allocation<'b, 'id, B, Committed>, CommitError<'b, 'id, B>> {
        let (binding, len) = (self.binding, self.len);
        let device = binding.device();
        let backend = device.backend();
        if let Err(e) = device.ensure_live(Op::Create, 0, len) {
            let cause = CommitFailure::Backend(e);
            return Err(CommitError { token: self, cause });
        }
        let capacity = backend.physical_capacity();
        if len as u64 > capacity {
            let cause = CommitFailure::Capacity {
                requested: len as u64,
                capacity,
            };
            return Err(CommitError { token: self, cause });
        }
        if let Err(cause) = binding.charge(len) {
            return Err(CommitError { token: self, cause });
        }
        let phys = match backend.create(len) {
            Ok(phys) => phys,
            Err(e) => {
                binding.uncharge(len);
                let cause = CommitFailure::Backend(e);
                return Err(CommitError { token: self, cause });
            }
        };
        if let Err(error) = backend.map(self.addr, len, phys, 0, Access::ReadWrite) {
            binding.refund(len);
            let cause = match device.release_orphan(phys, len) {
                Ok(()) => CommitFailure::Backend(error),
                Err(rollback) => CommitFailure::RollbackFailed { error, rollback },
            };
            return Err(CommitError { token: self, cause });
        }
        device.charge(Axis::Mapped, len);
        let (head, ()) = self.into_head();
        Ok(Allocation::from_head(head, phys))
    }

    /// Frees the VA range.
    ///
    /// # Errors
    ///
    /// [`QuarantineError`] if the backend refuses: the range stays reserved and withheld, in a
    /// [`Quarantined`](crate::Quarantined) token inside the error.
    #[must_use = "a failed release returns a quarantined token inside the error"]
    pub fn release(self) -> Result<Released, QuarantineError<'b, 'id, B>> {
        let (h, ()) = self.into_head();
        settle(h.binding, Residual::va(h.generation, h.addr, h.len))
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Committed> {
    /// Retires the memory from use: records a fence after the work submitted so far, and
    /// returns the token in [`Releasing`], where it lends no memory. Cannot fail.
    #[must_use = "dropping the Releasing token defers the release to the device; call complete()"]
    pub fn release(self) -> Allocation<'b, 'id, B, Releasing> {
        let fence = self.binding.device().backend().fence();
        let (head, phys) = self.into_head();
        Allocation::from_head(head, (phys, fence))
    }
}

impl<B: HostVisible> Allocation<'_, '_, B, Committed> {
    /// The memory, read-only, borrowed from the token: it cannot be released while borrowed.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: a Committed token exclusively owns a read-write mapping of `len` bytes at
        // `addr` (HostVisible makes it host memory); the mapping outlives this borrow of the
        // token, since only consuming the token can unmap it.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The memory, read-write, borrowed mutably from the token.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only borrow of the memory.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Releasing> {
    /// Whether the fence has completed, so [`complete`](Self::complete) can proceed. Never blocks.
    pub fn is_ready(&self) -> bool {
        self.binding.device().backend().fence_done(&self.parts.1)
    }

    /// Unmaps, releases the physical memory and frees the VA, once the fence has completed.
    ///
    /// # Errors
    ///
    /// [`CompleteError::Pending`] with this same token if the fence has not completed;
    /// [`CompleteError::Failed`] with a [`Quarantined`](crate::Quarantined) token holding exactly what could not be
    /// given back if a backend call fails.
    #[must_use = "a pending or failed completion returns a token inside the error"]
    pub fn complete(self) -> Result<Released, CompleteError<'b, 'id, B>> {
        if !self.is_ready() {
            return Err(CompleteError::Pending(self));
        }
        let (h, (phys, fence)) = self.into_head();
        h.binding.device().backend().retire_fence(fence);
        let residual = Residual::committed(h.generation, h.addr, h.len, phys);
        settle(h.binding, residual).map_err(CompleteError::Failed)
    }
}

impl<B: Backend, S: State> Drop for Allocation<'_, '_, B, S> {
    fn drop(&mut self) {
        // SAFETY: `drop` runs once and nothing uses `self.parts` after it.
        let parts = unsafe { ManuallyDrop::take(&mut self.parts) };
        let device = self.binding.device();
        let (residual, fence) = S::into_residual(
            device.backend(),
            self.generation,
            self.addr,
            self.len,
            parts,
        );
        // The residual leaves this binding's custody: its budget no longer carries it.
        if residual.owned_bytes() > 0 {
            self.binding.refund(residual.owned_bytes());
        }
        device.dispose(residual, fence);
    }
}

impl<B: Backend, S: State> fmt::Debug for Allocation<'_, '_, B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("state", &S::NAME)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("generation", &self.generation.get())
            .finish()
    }
}
