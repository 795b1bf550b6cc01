//! [`Quarantined`]: what a failed release leaves, owned exactly, withheld, and retryable.

use crate::allocation::Released;
use crate::backend::Backend;
use crate::binding::Binding;
use crate::device::ContextGone;
use crate::error::{QuarantineError, ReleaseFailure};
use crate::ledger::Axis;
use crate::residual::Residual;
use std::fmt;
use std::mem::ManuallyDrop;

/// A token for what a failed release left behind: it owns exactly the parts still mapped,
/// still owned or still reserved (see [`Residual`]), keeps them charged, and withholds the VA
/// range from reuse. It is counted in the ledger until it is released by a [`retry`](Self::retry)
/// or discharged with proof that the context is gone. Dropping it moves it, still counted, into
/// the device's quarantine ([`Device::retry_quarantine`](crate::Device::retry_quarantine)).
///
/// A quarantined token of one device cannot be discharged with another device's proof:
///
/// ```compile_fail
/// use memtoken::{ContextGone, Quarantined};
/// use memtoken::backend::SimBackend;
/// fn mix<'a, 'b: 'a>(q: Quarantined<'_, 'a, SimBackend>, proof: &ContextGone<'b>) {
///     let _ = q.discharge(proof); // error: lifetime may not live long enough
/// }
/// ```
pub struct Quarantined<'b, 'id, B: Backend> {
    binding: &'b Binding<'b, 'id, B>,
    residual: Residual<B::Phys>,
}

impl<'b, 'id, B: Backend> Quarantined<'b, 'id, B> {
    /// Takes custody of `residual`, counting it as quarantined.
    pub(crate) fn new(binding: &'b Binding<'b, 'id, B>, residual: Residual<B::Phys>) -> Self {
        binding.device().charge(Axis::Quarantined, 1);
        Self { binding, residual }
    }

    fn into_parts(self) -> (&'b Binding<'b, 'id, B>, Residual<B::Phys>) {
        let this = ManuallyDrop::new(self);
        (this.binding, this.residual)
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
        let (binding, mut residual) = self.into_parts();
        match teardown_for(binding, &mut residual) {
            Ok(released) => {
                binding.device().refund(Axis::Quarantined, 1);
                Ok(released)
            }
            Err(cause) => Err(QuarantineError {
                token: Self { binding, residual },
                cause,
            }),
        }
    }

    /// Discharges the residual without backend calls: the context is gone, and with it
    /// everything the residual held. Refunds what was still charged.
    pub fn discharge(self, _proof: &ContextGone<'id>) -> Released {
        let (binding, residual) = self.into_parts();
        let device = binding.device();
        if residual.owned_bytes() > 0 {
            binding.refund(residual.owned_bytes());
        }
        let (generation, (_, len)) = (residual.generation(), residual.range());
        device.forget_residual(residual);
        device.refund(Axis::Quarantined, 1);
        Released { generation, len }
    }
}

/// Tears down what `residual` holds on behalf of `binding`'s token, refunding the binding once
/// the token's own physical memory is gone.
fn teardown_for<B: Backend>(
    binding: &Binding<'_, '_, B>,
    residual: &mut Residual<B::Phys>,
) -> Result<Released, ReleaseFailure> {
    let owned = residual.owned_bytes();
    let result = binding.device().teardown(residual);
    if owned > 0 && residual.owned_bytes() == 0 {
        binding.refund(owned);
    }
    result.map(|()| Released {
        generation: residual.generation(),
        len: residual.range().1,
    })
}

/// Releases a token's `residual` now; what fails is handed back as a [`Quarantined`] token.
pub(crate) fn settle<'b, 'id, B: Backend>(
    binding: &'b Binding<'b, 'id, B>,
    mut residual: Residual<B::Phys>,
) -> Result<Released, QuarantineError<'b, 'id, B>> {
    teardown_for(binding, &mut residual).map_err(|cause| QuarantineError {
        token: Quarantined::new(binding, residual),
        cause,
    })
}

impl<B: Backend> Drop for Quarantined<'_, '_, B> {
    fn drop(&mut self) {
        if self.residual.owned_bytes() > 0 {
            self.binding.refund(self.residual.owned_bytes());
        }
        self.binding.device().adopt_quarantined(self.residual);
    }
}

impl<B: Backend> fmt::Debug for Quarantined<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quarantined")
            .field("residual", &self.residual)
            .finish()
    }
}
