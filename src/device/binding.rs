//! [`Binding`]: a consumer's pinned handle on a device, with a budget on owned bytes.

use super::Device;
use crate::backend::{Backend, BackendError, Op};
use crate::error::CommitFailure;
use crate::ledger::{Axis, Budget, try_add, try_sub};
use crate::residual::Residual;
use crate::state::Wait;
use crate::sync::{AtomicU64, Ordering};
use crate::unwind::Scope;

/// A consumer's pinned handle on a [`Device`] — a model session, a KV cache. It holds a context
/// pin (released when the binding is dropped) and a [`Budget`]. Tokens borrow their binding, so
/// a binding cannot be dropped while anything made through it lives:
///
/// ```compile_fail,E0505
/// use memtoken::{make_guard, Budget, Device};
/// use memtoken::backend::doubles::SimBackend;
/// make_guard!(guard);
/// let device = Device::new(guard, SimBackend::strict());
/// let binding = device.bind(Budget::unlimited()).unwrap();
/// let token = binding.reserve(1).unwrap();
/// drop(binding);
/// drop(token);
/// ```
pub struct Binding<'d, 'id, B: Backend> {
    device: &'d Device<'id, B>,
    limit: u64,
    used: AtomicU64,
    /// Requests for this binding's regions' tails back: its budget refused a charge.
    tail_requests: AtomicU64,
}

/// Where a residual goes when it leaves its token.
pub(crate) enum Custody<F> {
    /// To the device: released now if what it waits for is done, else queued.
    Fenced(Wait<F>),
    /// To the device's quarantine, where it is already counted.
    Quarantined,
    /// Withheld for good: exposed to this peer, which never said it was done with it (the
    /// fence, if any, is retired: nothing waits for it any more).
    ForPeer(Wait<F>, String),
}

impl<'id, B: Backend> Device<'id, B> {
    /// Pins the context and opens a [`Binding`] with `budget` on owned bytes.
    ///
    /// # Errors
    ///
    /// The backend's error if the context cannot be pinned.
    pub fn bind(&self, budget: Budget) -> Result<Binding<'_, 'id, B>, BackendError> {
        Scope::run::<B, _>(move || {
            self.ensure_live(Op::Pin, 0, 0)?;
            self.backend().pin()?;
            self.note_bound();
            Ok(Binding {
                device: self,
                limit: budget.limit(),
                used: AtomicU64::new(0),
                tail_requests: AtomicU64::new(0),
            })
        })
    }
}

impl<'d, 'id, B: Backend> Binding<'d, 'id, B> {
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

    /// Requests for the tails back that concern this binding's regions: the device's (see
    /// [`Device::ask_tails_back`]) and this budget's refusals, counted together (each count only
    /// grows, so their sum moves when either does).
    #[inline]
    pub(crate) fn tail_requests(&self) -> u64 {
        self.device
            .tail_requests()
            .wrapping_add(self.tail_requests.load(Ordering::Relaxed))
    }

    /// Charges `n` owned bytes to this binding's budget and the device's (and so to the
    /// ledger's owned axis), before the memory is created; or says which budget refuses.
    pub(super) fn charge(&self, n: usize) -> Result<(), CommitFailure> {
        self.charge_budget(n)?;
        // Cached granules count in the device's budget: trim them when they stand in the way.
        self.device
            .charge_owned_or_trim(n)
            .inspect_err(|_| self.refund(n))
    }

    /// Charges `n` bytes to this binding's budget alone: memory the device already owns (a
    /// cached granule) that one of its tokens takes over.
    pub(super) fn charge_budget(&self, n: usize) -> Result<(), CommitFailure> {
        let requested = n as u64;
        try_add(&self.used, requested, self.limit).map_err(|used| {
            // This binding's regions' mapped tails may hold what it needs: ask them back (only
            // its own: another binding's tail cannot make room in this budget).
            self.tail_requests.fetch_add(1, Ordering::Relaxed);
            CommitFailure::Budget {
                requested,
                used,
                limit: self.limit,
            }
        })
    }

    /// Undoes [`charge`](Self::charge) when the memory could not be created.
    pub(super) fn uncharge(&self, n: usize) {
        self.refund(n);
        self.device.refund(Axis::Owned, n);
    }

    /// Refunds `n` owned bytes to the budget.
    ///
    /// # Panics
    ///
    /// If the budget carries less: a double refund, a bug in this crate.
    pub(super) fn refund(&self, n: usize) {
        if let Err(used) = try_sub(&self.used, n as u64) {
            panic!("binding budget: refund of {n} exceeds the {used} charged (double refund)");
        }
    }

    /// Hands what a token leaves to the device: the `charged` bytes leave this binding's budget
    /// with it, and its `tail` granules (a region's mapped tail) the ledger's tail axis. The one path by which every token gives up its residual.
    pub(crate) fn hand_over(
        &self,
        residual: Residual<B::Phys>,
        charged: usize,
        tail: usize,
        custody: Custody<B::Fence>,
    ) {
        if charged > 0 {
            self.refund(charged);
        }
        self.device.tail_left(tail);
        match custody {
            Custody::Fenced(fence) => self.device.dispose(residual, fence),
            Custody::Quarantined => self.device.adopt_quarantined(residual),
            Custody::ForPeer(fence, peer) => {
                if let Wait::On(fence) = fence {
                    self.device.backend().retire_fence(fence);
                }
                self.device.withhold_for_peer(residual, peer);
            }
        }
    }
}

impl<B: Backend> Drop for Binding<'_, '_, B> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        self.device.note_unbound();
        let backend = self.device.backend();
        // A lost context took its pins with it: no call into it.
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
