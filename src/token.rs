//! What every token holds — [`Core`]: its binding, its VA range, its identity — and the one
//! place where a mapped range becomes a host slice.

use crate::backend::{Addr, Backend};
pub(crate) use crate::backend::{host_slice, host_slice_mut};
use crate::device::Binding;
use crate::device::Device;
use crate::ids::Generation;
use crate::residual::{Held, Residual};
use crate::unwind::Guarded;

/// A token's binding, range and identity: all `Copy`, so a transition takes a token apart and
/// builds the next one from the same core.
pub(crate) struct Core<'b, 'id, B: Backend> {
    pub(crate) binding: &'b Binding<'b, 'id, B>,
    pub(crate) addr: Addr,
    pub(crate) len: usize,
    pub(crate) generation: Generation,
}

impl<B: Backend> Clone for Core<'_, '_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Core<'_, '_, B> {}

impl<'b, 'id, B: Backend> Core<'b, 'id, B> {
    pub(crate) fn device(&self) -> &'b Device<'id, B> {
        self.binding.device()
    }

    pub(crate) fn backend(&self) -> &'b Guarded<B> {
        self.device().backend()
    }

    /// What is left of this token when it holds `held`.
    pub(crate) fn residual(&self, held: Held<B::Phys>) -> Residual<B::Phys> {
        Residual {
            generation: self.generation,
            addr: self.addr,
            len: self.len,
            held,
        }
    }
}
