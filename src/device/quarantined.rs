//! [`Quarantined`]: what a failed release leaves, owned exactly, withheld, and retryable.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::binding::{Binding, Custody};
use crate::backend::Backend;
use crate::error::{ReleaseFailure, TransitionError};
use crate::ids::{ContextLost, Released};
use crate::ledger::Axis;
use crate::residual::Residual;
use crate::unwind::Scope;
use std::fmt;
use std::mem::ManuallyDrop;

/// A failed release or retry: the [`Quarantined`] token holding exactly what is left, and why.
pub type QuarantineError<'b, 'id, B> = TransitionError<Quarantined<'b, 'id, B>, ReleaseFailure>;

/// A token for what a failed release left behind: it owns exactly the parts still mapped,
/// still owned or still reserved (see [`Residual`]), keeps them charged, and withholds the VA
/// range from reuse. It is counted in the ledger until it is released by a [`retry`](Self::retry)
/// or discharged with proof that the context is lost. Dropping it moves it, still counted, into
/// the device's quarantine ([`Device::retry_quarantine`](crate::Device::retry_quarantine)).
///
/// A quarantined token of one device cannot be discharged with another device's proof:
///
/// ```compile_fail
/// use memtoken::{report::ContextLost, report::Quarantined};
/// use memtoken::backend::doubles::SimBackend;
/// fn mix<'a, 'b: 'a>(q: Quarantined<'_, 'a, SimBackend>, proof: &ContextLost<'b>) {
///     let _ = q.discharge(proof); // error: lifetime may not live long enough
/// }
/// ```
pub struct Quarantined<'b, 'id, B: Backend> {
    binding: &'b Binding<'b, 'id, B>,
    /// Boxed: quarantine is the rare path, and errors that may hand back either a token or its
    /// quarantined remains stay small.
    residual: ManuallyDrop<Box<Residual<B::Phys>>>,
}

impl<'b, 'id, B: Backend> Quarantined<'b, 'id, B> {
    /// Takes custody of `residual`, counting it as quarantined.
    pub(crate) fn new(binding: &'b Binding<'b, 'id, B>, residual: Residual<B::Phys>) -> Self {
        binding.device().charge(Axis::Quarantined, 1);
        Self {
            binding,
            residual: ManuallyDrop::new(Box::new(residual)),
        }
    }

    fn into_parts(self) -> (&'b Binding<'b, 'id, B>, Residual<B::Phys>) {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped nor used again, so the residual is taken once.
        let residual = unsafe { ManuallyDrop::take(&mut this.residual) };
        (this.binding, *residual)
    }

    /// The binding whose budget still carries what this token owns.
    pub fn binding(&self) -> &'b Binding<'b, 'id, B> {
        self.binding
    }

    /// Exactly what is still held.
    pub fn residual(&self) -> &Residual<B::Phys> {
        &self.residual
    }

    /// Tries again to give back what is held, in order: unmap, drop the shared reference,
    /// release, free.
    ///
    /// # Errors
    ///
    /// [`QuarantineError`] with the token, holding whatever is still left, if a call fails again.
    #[must_use = "a failed retry returns the quarantined token inside the error"]
    pub fn retry(self) -> Result<Released, QuarantineError<'b, 'id, B>> {
        Scope::run::<B, _>(move || {
            let (binding, residual) = self.into_parts();
            let result = settle(binding, residual);
            // This token's count goes; remains that failed again were counted anew by `settle`.
            binding.device().refund(Axis::Quarantined, 1);
            result
        })
    }

    /// Discharges the residual without backend calls: the context is lost, and with it
    /// everything the residual held. Refunds what was still charged.
    pub fn discharge(self, _proof: &ContextLost<'id>) -> Released {
        let (binding, residual) = self.into_parts();
        let device = binding.device();
        binding.refund(residual.owned_bytes());
        let (generation, len) = (residual.generation, residual.len);
        device.forget_residual(residual);
        device.refund(Axis::Quarantined, 1);
        Released { generation, len }
    }
}

/// Releases a token's `residual` now, refunding `binding` for each part of the token's own
/// physical memory once it is gone; what fails is handed back as a [`Quarantined`] token.
pub(crate) fn settle<'b, 'id, B: Backend>(
    binding: &'b Binding<'b, 'id, B>,
    mut residual: Residual<B::Phys>,
) -> Result<Released, QuarantineError<'b, 'id, B>> {
    let owned = residual.owned_bytes();
    let result = binding.device().teardown(&mut residual);
    // A region's granules go one by one: what went leaves the budget, what is left stays.
    let gone = owned - residual.owned_bytes();
    if gone > 0 {
        binding.refund(gone);
    }
    match result {
        Ok(()) => Ok(Released {
            generation: residual.generation,
            len: residual.len,
        }),
        Err(cause) => Err(TransitionError {
            token: Quarantined::new(binding, residual),
            cause,
        }),
    }
}

impl<B: Backend> Drop for Quarantined<'_, '_, B> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        // SAFETY: `drop` runs once and nothing uses `self.residual` after it.
        let residual = unsafe { ManuallyDrop::take(&mut self.residual) };
        let owned = residual.owned_bytes();
        self.binding
            .hand_over(*residual, owned, 0, Custody::Quarantined);
    }
}

impl<B: Backend> fmt::Display for Quarantined<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.residual;
        write!(
            f,
            "the quarantined remains of allocation #{} ({} bytes at {:#x}: {} still mapped, {} owned, VA {}); retry the token, or discharge it once the context is lost",
            r.generation.get(),
            r.len,
            r.addr,
            r.mapped_bytes(),
            r.owned_bytes(),
            if r.holds_va() { "withheld" } else { "freed" },
        )
    }
}

impl<B: Backend> fmt::Debug for Quarantined<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quarantined")
            .field("residual", &**self.residual)
            .finish()
    }
}
