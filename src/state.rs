//! Sealed, zero-sized state markers of an [`Allocation`](crate::Allocation).
//!
//! ```text
//!   reserve(len)         commit                release (begin)         complete / poll
//! ───────────────▶ Reserved ──────────▶ Committed ───────────────▶ Releasing ──────────────▶ Released
//!                    │  ▲ error: the same                              │  error: Pending (same token)
//!                    │  └─ Reserved token back                         ▼  or a backend call failed
//!                    │ release                                     Quarantined ── retry ──▶ Released
//!                    └────────▶ Releasing (no fence)                    └── discharge (context lost)
//! ```
//!
//! The shared-prefix states ([`Owner`](crate::sharing::Owner), [`Sharer`](crate::sharing::Sharer),
//! [`Diverged`](crate::sharing::Diverged)) live with the sharing policy that makes them.

use crate::backend::{Addr, Backend};
use crate::residual::{Held, SharedPhys};
use crate::unwind::Guarded;

/// What a release waits for.
#[derive(Debug)]
pub enum Wait<F> {
    /// Nothing: no work can still use the memory.
    Nothing,
    /// This fence.
    On(F),
    /// A fence that could not be recorded (the backend panicked): one recorded later covers
    /// the same work, and the release waits for that.
    Unrecorded,
}

impl<F> Wait<F> {
    /// Waits for a fence, if one was recorded: `None` from [`Guarded::fence`] is
    /// [`Unrecorded`](Self::Unrecorded).
    pub(crate) fn on(fence: Option<F>) -> Self {
        fence.map_or(Self::Unrecorded, Self::On)
    }

    /// [`Nothing`](Self::Nothing) if `idle`, else a fence recorded now.
    pub(crate) fn unless(idle: bool, fence: impl FnOnce() -> Option<F>) -> Self {
        if idle {
            Self::Nothing
        } else {
            Self::on(fence())
        }
    }
}

/// What a token holds when it leaves its owner (dropped, or its release started): its parts,
/// what its release waits for, and the owned bytes its binding is charged for it.
#[derive(Debug)]
pub struct Retired<B: Backend> {
    pub(crate) held: Held<B::Phys>,
    pub(crate) fence: Wait<B::Fence>,
    pub(crate) charged: usize,
    /// Granules of a region's mapped tail among what it held (0 for every other state).
    pub(crate) tail: usize,
}

/// What [`sealed::Repr::retire`] needs besides the parts: the backend and the token's length.
/// Only this crate can make one, so no code outside it can take a token's parts apart (or
/// record a fence) through it.
#[derive(Debug)]
pub struct Retiring<'a, B: Backend> {
    pub(crate) backend: &'a Guarded<B>,
    /// The token's address: its fence covers what may use its reservation.
    pub(crate) addr: Addr,
    pub(crate) len: usize,
}

pub(crate) mod sealed {
    use super::*;

    /// The seal: only this crate can name this trait, so only it can add states.
    pub trait Sealed {}

    /// A state's representation: what a token in it owns beyond its VA range (its
    /// [`Parts`](Repr::Parts)), and how that is taken apart when the token goes.
    pub trait Repr: Sealed {
        /// What a token in this state owns beyond its VA range.
        type Parts<B: Backend>;

        /// Takes a token of `at.len` bytes in this state apart into what it holds.
        fn retire<B: Backend>(parts: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B>;

        /// The reference on shared physical memory a mapping in this state holds.
        fn shared<B: Backend>(parts: &Self::Parts<B>) -> Option<&SharedPhys<B::Phys>> {
            let _ = parts;
            None
        }
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
pub trait State: sealed::Repr {
    /// The state's name, for messages.
    const NAME: &'static str;
}

/// A state a release can start from: every state but [`Releasing`].
pub trait Live: State {}

/// A state whose memory is mapped readable, so a host backend lends it as `&[u8]`.
pub trait Readable: State {}

/// VA reserved, nothing mapped: the memory cannot be accessed.
#[derive(Debug)]
pub enum Reserved {}
/// Physical memory created, mapped read-write and accessible.
#[derive(Debug)]
pub enum Committed {}
/// Retired from use: unmap / release / free wait for the fence recorded when the release began.
#[derive(Debug)]
pub enum Releasing {}

impl sealed::Sealed for Reserved {}

impl sealed::Repr for Reserved {
    type Parts<B: Backend> = ();

    fn retire<B: Backend>((): (), _: Retiring<'_, B>) -> Retired<B> {
        Retired {
            held: Held::va(),
            fence: Wait::Nothing,
            charged: 0,
            tail: 0,
        }
    }
}

impl sealed::Sealed for Committed {}

impl sealed::Repr for Committed {
    type Parts<B: Backend> = B::Phys;

    fn retire<B: Backend>(phys: B::Phys, at: Retiring<'_, B>) -> Retired<B> {
        let (backend, len) = (at.backend, at.len);
        Retired {
            held: Held::committed(len, phys),
            // Work may still be in flight on the memory: its release waits for a fence.
            fence: Wait::on(backend.fence_for(&[at.addr])),
            charged: len,
            tail: 0,
        }
    }
}

impl sealed::Sealed for Releasing {}

impl sealed::Repr for Releasing {
    type Parts<B: Backend> = (Held<B::Phys>, Wait<B::Fence>);

    fn retire<B: Backend>((held, fence): Self::Parts<B>, _: Retiring<'_, B>) -> Retired<B> {
        let charged = held.owned_bytes();
        Retired {
            held,
            fence,
            charged,
            tail: 0,
        }
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
impl Live for Reserved {}
impl Live for Committed {}
impl Readable for Committed {}
