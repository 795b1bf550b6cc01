//! Sealed, zero-sized state markers of an [`Allocation`](crate::Allocation).
//!
//! ```text
//!   reserve(len)         commit                release (begin)         complete / poll
//! ───────────────▶ Reserved ──────────▶ Committed ───────────────▶ Releasing ──────────────▶ Released
//!                    │  ▲ error: the same                              │  error: Pending (same token)
//!                    │  └─ Reserved token back                         ▼  or a backend call failed
//!                    │ release                                     Quarantined ── retry ──▶ Released
//!                    └────────▶ Released  (or Quarantined VA)           └── discharge (context gone)
//! ```

use crate::backend::{Addr, Backend};
use crate::device::Generation;
use crate::residual::Residual;

pub(crate) mod sealed {
    use super::*;

    /// Only this crate can name this trait, so only it can add states.
    pub trait Sealed {
        /// What a token in this state owns beyond its VA range.
        type Parts<B: Backend>;

        /// What a dropped token in this state still holds, and the fence its release waits for.
        fn into_residual<B: Backend>(
            backend: &B,
            generation: Generation,
            addr: Addr,
            len: usize,
            parts: Self::Parts<B>,
        ) -> (Residual<B::Phys>, Option<B::Fence>);
    }
}

/// The state of an allocation token. Sealed: the set of states is fixed by this crate.
///
/// ```compile_fail,E0277
/// enum Borrowed {}
/// impl memtoken::State for Borrowed {
///     const NAME: &'static str = "Borrowed";
/// }
/// ```
pub trait State: sealed::Sealed {
    /// The state's name, for messages.
    const NAME: &'static str;
}

/// VA reserved, nothing mapped: the memory cannot be accessed.
#[derive(Debug)]
pub enum Reserved {}
/// Physical memory created, mapped read-write and accessible.
#[derive(Debug)]
pub enum Committed {}
/// Retired from use: a fence was recorded, and unmap / release / free wait for it.
#[derive(Debug)]
pub enum Releasing {}

impl sealed::Sealed for Reserved {
    type Parts<B: Backend> = ();

    fn into_residual<B: Backend>(
        _backend: &B,
        generation: Generation,
        addr: Addr,
        len: usize,
        (): (),
    ) -> (Residual<B::Phys>, Option<B::Fence>) {
        (Residual::va(generation, addr, len), None)
    }
}

impl sealed::Sealed for Committed {
    type Parts<B: Backend> = B::Phys;

    fn into_residual<B: Backend>(
        backend: &B,
        generation: Generation,
        addr: Addr,
        len: usize,
        phys: B::Phys,
    ) -> (Residual<B::Phys>, Option<B::Fence>) {
        // Work may still be in flight on the memory: its release waits for a fence.
        let fence = backend.fence();
        let residual = Residual::committed(generation, addr, len, phys);
        (residual, Some(fence))
    }
}

impl sealed::Sealed for Releasing {
    type Parts<B: Backend> = (B::Phys, B::Fence);

    fn into_residual<B: Backend>(
        _backend: &B,
        generation: Generation,
        addr: Addr,
        len: usize,
        (phys, fence): (B::Phys, B::Fence),
    ) -> (Residual<B::Phys>, Option<B::Fence>) {
        let residual = Residual::committed(generation, addr, len, phys);
        (residual, Some(fence))
    }
}

impl State for Reserved {
    const NAME: &'static str = "Reserved";
}

impl State for Committed {
    const NAME: &'static str = "Committed";
}

impl State for Releasing {
    const NAME: &'static str = "Releasing";
}
