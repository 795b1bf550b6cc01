//! What every token holds — [`Core`]: its binding, its VA range, its identity — and the one
//! place where a mapped range becomes a host slice.

use crate::backend::{Addr, Backend};
use crate::binding::Binding;
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

/// `len` bytes of host memory at `addr`, read-only, for `'a`.
///
/// # Safety
///
/// For all of `'a`, `[addr, addr + len)` must be mapped readable by a
/// [`HostVisible`](crate::backend::HostVisible) backend — a token owns the mapping and the
/// borrow of the token lasts `'a`, so only consuming the token could unmap it — and no one may
/// write to it. [`host_slice_mut`] also needs it mapped writable and no other access at all.
pub(crate) unsafe fn host_slice<'a>(addr: Addr, len: usize) -> &'a [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// `len` bytes of host memory at `addr`, writable, for `'a`.
///
/// # Safety
///
/// As for [`host_slice`], with the range mapped writable and no other reference to it for `'a`
/// (the token is borrowed mutably).
pub(crate) unsafe fn host_slice_mut<'a>(addr: Addr, len: usize) -> &'a mut [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
