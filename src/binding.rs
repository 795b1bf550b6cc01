//! [`Binding`]: a consumer's pinned handle on a device, with a budget on owned bytes.

use crate::allocation::Allocation;
use crate::backend::{Backend, Op};
use crate::device::Device;
use crate::error::{CommitFailure, ReserveError};
use crate::ledger::Axis;
use crate::state::Reserved;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cap on the physical bytes a binding's tokens may own at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget(u64);

impl Budget {
    /// No cap beyond the device's physical capacity.
    pub fn unlimited() -> Self {
        Self(u64::MAX)
    }

    /// At most `limit` bytes owned at once.
    pub fn bytes(limit: u64) -> Self {
        Self(limit)
    }

    /// The cap in bytes (`u64::MAX` when unlimited).
    pub fn limit(self) -> u64 {
        self.0
    }
}

/// A consumer's pinned handle on a [`Device`] — a model session, a KV cache. It holds a context
/// pin (released when the binding is dropped) and a [`Budget`]. Tokens borrow their binding, so
/// a binding cannot be dropped while anything made through it lives:
///
/// ```compile_fail,E0505
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::SimBackend;
/// make_guard!(guard);
/// let device = Device::new(guard, SimBackend::default());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let token = binding.reserve(1).unwrap();
/// drop(binding);
/// drop(token);
/// ```
pub struct Binding<'d, 'id, B: Backend> {
    device: &'d Device<'id, B>,
    limit: u64,
    used: AtomicU64,
}

impl<'d, 'id, B: Backend> Binding<'d, 'id, B> {
    pub(crate) fn new(device: &'d Device<'id, B>, budget: Budget) -> Self {
        Self {
            device,
            limit: budget.limit(),
            used: AtomicU64::new(0),
        }
    }

    /// The device this binding pins.
    pub fn device(&self) -> &'d Device<'id, B> {
        self.device
    }

    /// Physical bytes this binding's tokens own now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// The budget's cap in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Reserves at least `len` bytes of VA (rounded up to the granularity). Nothing is mapped
    /// or charged to the budget; the range counts as reserved in the ledger.
    ///
    /// # Errors
    ///
    /// [`ReserveError`] for a zero length, a length that overflows when rounded, one past the
    /// address space, or a backend failure. Nothing is changed or charged on error.
    pub fn reserve<'b>(
        &'b self,
        len: usize,
    ) -> Result<Allocation<'b, 'id, B, Reserved>, ReserveError>
    where
        'd: 'b,
    {
        let backend = self.device.backend();
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
        self.device.ensure_live(Op::Reserve, 0, rounded)?;
        let addr = backend.reserve(rounded)?;
        self.device.charge(Axis::Reserved, rounded);
        let generation = self.device.next_generation();
        Ok(Allocation::reserved(self, addr, rounded, generation))
    }

    /// Charges `n` owned bytes to this binding's budget and the device's (and so to the
    /// ledger's owned axis), before the memory is created; or says which budget refuses.
    pub(crate) fn charge(&self, n: usize) -> Result<(), CommitFailure> {
        let bytes = n as u64;
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map_err(|used| CommitFailure::Budget {
                requested: bytes,
                used,
                limit: self.limit,
            })?;
        self.device.charge_owned(n).inspect_err(|_| self.refund(n))
    }

    /// Undoes [`charge`](Self::charge) when the memory could not be created.
    pub(crate) fn uncharge(&self, n: usize) {
        self.refund(n);
        self.device.refund(Axis::Owned, n);
    }

    /// Refunds `n` owned bytes to the budget.
    pub(crate) fn refund(&self, n: usize) {
        let before = self.used.fetch_sub(n as u64, Ordering::Relaxed);
        assert!(before >= n as u64, "binding budget refunded twice");
    }
}

impl<B: Backend> Drop for Binding<'_, '_, B> {
    fn drop(&mut self) {
        let backend = self.device.backend();
        // A context that is gone took its pins with it: no call into it.
        if !backend.context_lost() && backend.unpin().is_err() {
            self.device.note_failed_unpin();
        }
    }
}

impl<B: Backend> std::fmt::Debug for Binding<'_, '_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binding")
            .field("used", &self.used())
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}
