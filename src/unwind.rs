//! Unwind safety at the seam: a backend call that panics is **contained** — the typed layer
//! sees it as a failed call and takes the same path as for any failure (the token handed back,
//! what was made undone, what cannot be undone quarantined, queues left whole) — and the panic
//! then **resumes**, with its own payload, when the public call that made it returns.
//!
//! A public operation opens a [`Scope`] on its thread; every backend call goes through
//! [`Guarded`], which catches a panic only inside a scope (outside one it unwinds at once, as
//! it would without memtoken). The first panic caught in a scope is kept and resumed when the
//! outermost scope of the thread closes; a panic caught while the thread is already unwinding
//! is dropped (the panic hook has reported it), since a second unwind would abort the process.

use crate::backend::Shareable;
use crate::backend::{
    Ability, Access, Addr, Backend, BackendError, Cause, Exportable, HandleKind, Location, Op,
};
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::panic::{self, AssertUnwindSafe};

thread_local! {
    /// Scopes open on this thread.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Whether a panic was caught in the open scopes (so [`CAUGHT`] is looked at only then).
    static PENDING: Cell<bool> = const { Cell::new(false) };
    /// The panic kept for the outermost scope.
    static CAUGHT: RefCell<Option<Box<dyn Any + Send>>> = const { RefCell::new(None) };
}

/// A public operation in progress on this thread: backend panics inside it are contained, and
/// the first one resumes when the outermost scope closes (see the module docs).
pub(crate) struct Scope {
    /// Scopes are per thread.
    _not_send: PhantomData<*const ()>,
}

impl Scope {
    /// Opens a scope.
    #[inline(always)]
    fn enter() -> Self {
        DEPTH.with(|d| d.set(d.get() + 1));
        Self {
            _not_send: PhantomData,
        }
    }

    /// Opens a scope for calls into a `B` — none where `B` never panics (nothing to contain).
    #[inline(always)]
    pub(crate) fn open<B: Backend>() -> Option<Self> {
        B::MAY_PANIC.then(Self::enter)
    }
}

impl Scope {
    /// Runs `body` in a scope of its own, and returns what it returns — unless a backend
    /// panic was contained in it and this is the thread's outermost scope: then what it
    /// returned is dropped first (a token inside goes to the device's custody as any dropped
    /// token does), and the panic resumes.
    #[inline(always)]
    pub(crate) fn run<B: Backend, R>(body: impl FnOnce() -> R) -> R {
        if !B::MAY_PANIC {
            return body();
        }
        let scope = Self::enter();
        let out = body();
        scope.exit(out)
    }

    /// Closes the scope, handing `out` back (see [`run`](Self::run)). A panic resumed from
    /// a guard's `Drop` at a function's end would leak the function's return value, so
    /// functions that return one close their scope here instead.
    #[inline(always)]
    fn exit<R>(self, out: R) -> R {
        if DEPTH.with(Cell::get) == 1 && PENDING.with(Cell::get) && !std::thread::panicking() {
            drop(out);
            drop(self); // resumes the panic
            unreachable!("the kept panic resumed");
        }
        // Not the outermost scope, or nothing kept, or the thread unwinds already (dropping
        // the scope then drops the kept panic: a second unwind would abort the process).
        out
    }
}

/// Closing a scope by dropping it is for bodies that return nothing (`Drop` impls): the
/// outermost one resumes a kept panic, unless the thread is unwinding already.
impl Drop for Scope {
    #[inline(always)]
    fn drop(&mut self) {
        let depth = DEPTH.with(|d| {
            let n = d.get() - 1;
            d.set(n);
            n
        });
        if depth == 0 && PENDING.with(Cell::get) {
            resume();
        }
    }
}

/// Resumes the panic kept for this thread, unless the thread is unwinding already.
#[cold]
fn resume() {
    PENDING.with(|p| p.set(false));
    if let Some(payload) = CAUGHT.with(|c| c.borrow_mut().take())
        && !std::thread::panicking()
    {
        panic::resume_unwind(payload);
    }
}

/// Keeps `payload` for this thread's outermost scope, unless one is kept already.
#[cold]
fn keep(payload: Box<dyn Any + Send>) -> String {
    let message = message(payload.as_ref());
    if !PENDING.with(Cell::get) {
        PENDING.with(|p| p.set(true));
        CAUGHT.with(|c| *c.borrow_mut() = Some(payload));
    }
    message
}

/// A panic payload's message, where it has one.
fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Runs `call`; inside a scope, a panic is kept for the scope's end and `Err` gives its
/// message. Outside one, a panic unwinds at once.
#[inline(always)]
fn contain<R>(call: impl FnOnce() -> R) -> Result<R, String> {
    if DEPTH.with(Cell::get) == 0 {
        return Ok(call());
    }
    // The closure only makes one backend call: nothing of the typed layer's is touched in it,
    // so nothing of ours can be seen half-changed after a panic.
    panic::catch_unwind(AssertUnwindSafe(call)).map_err(keep)
}

/// A backend whose calls are contained: each one that panics inside a [`Scope`] returns
/// [`Cause::Panicked`] (or, for the calls that cannot fail, the answer that does no harm), and
/// the panic resumes when the scope closes. The one way the typed layer calls its backend.
///
/// Its sizes and location are read once, when it is made (before any token exists, so a getter
/// that panics there strands nothing), and kept: no getter runs in the middle of a transition,
/// where a panic could leave something half-done.
#[derive(Debug)]
pub struct Guarded<B> {
    backend: B,
    sizes: Sizes,
}

/// What the typed layer asks of a backend besides its calls, read once ([`Guarded::new`]).
#[derive(Clone, Copy, Debug)]
struct Sizes {
    granularity: usize,
    address_space: usize,
    physical_capacity: u64,
    location: Location,
    /// [`Backend::lacks`] for each ability, by [`Ability::index`].
    lacks: [Option<&'static str>; Ability::ALL.len()],
    /// Whether the backend lacks [`Ability::MapAtReservedAddress`]: a commit's memory is where
    /// [`Backend::placed`] says, and lives with its reservation.
    places: bool,
}

impl<B: Backend> Guarded<B> {
    pub(crate) fn new(backend: B) -> Self {
        let sizes = Sizes {
            granularity: backend.granularity(),
            address_space: backend.address_space(),
            physical_capacity: backend.physical_capacity(),
            location: backend.location(),
            lacks: Ability::ALL.map(|a| backend.lacks(a)),
            places: backend.lacks(Ability::MapAtReservedAddress).is_some(),
        };
        Self { backend, sizes }
    }

    /// The backend itself, uncontained, for what is not a VMM call: the CUDA backend's peers,
    /// covered streams and typed views. Only for calls made outside every transition and
    /// teardown — straight from a public method that changes no token, ledger or queue — so a
    /// panic there unwinds to the caller with nothing of the typed layer half-done (and
    /// outside a [`Scope`] no call is contained anyway).
    #[inline]
    pub(crate) fn raw(&self) -> &B {
        &self.backend
    }

    /// `call`, contained where `B` may panic (see [`Guarded::contain`]).
    #[inline(always)]
    fn contain<R>(call: impl FnOnce() -> R) -> Result<R, String> {
        if B::MAY_PANIC {
            contain(call)
        } else {
            Ok(call())
        }
    }

    /// `call`, with a panic turned into the error of `op` on `len` bytes at `addr`.
    #[inline(always)]
    fn run<R>(
        op: Op,
        addr: Addr,
        len: usize,
        call: impl FnOnce() -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        if !B::MAY_PANIC {
            // Nothing to contain: the call's own result, not rewrapped.
            return call();
        }
        Self::contain(call).unwrap_or_else(|message| {
            Err(BackendError::new(
                op,
                addr,
                len,
                Cause::Panicked { message },
            ))
        })
    }

    /// The granularity, as read when the device was made.
    #[inline]
    pub(crate) fn granularity(&self) -> usize {
        self.sizes.granularity
    }

    /// The largest reservation, as read when the device was made.
    #[inline]
    pub(crate) fn address_space(&self) -> usize {
        self.sizes.address_space
    }

    /// The physical capacity, as read when the device was made.
    #[inline]
    pub(crate) fn physical_capacity(&self) -> u64 {
        self.sizes.physical_capacity
    }

    /// Where the memory lives, as read when the device was made.
    #[inline]
    pub(crate) fn location(&self) -> Location {
        self.sizes.location
    }

    /// The mechanism that lacks `ability` (see [`Backend::lacks`]), as read when the device
    /// was made; `None` where it has it.
    #[inline]
    pub(crate) fn lacks(&self, ability: Ability) -> Option<&'static str> {
        self.sizes.lacks[ability.index()]
    }

    /// Refused with [`Cause::Unsupported`] if the mechanism lacks `ability`, before any memory call.
    #[inline]
    pub(crate) fn needs(
        &self,
        ability: Ability,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        match self.lacks(ability) {
            None => Ok(()),
            Some(mechanism) => Err(ability.refused(op, addr, len, mechanism)),
        }
    }

    /// Where a commit's memory lives: see [`Backend::placed`] (no call where the backend maps
    /// at reserved addresses).
    #[inline]
    pub(crate) fn placed(&self, reserved: Addr, phys: B::Phys) -> Addr {
        if self.sizes.places {
            self.backend.placed(reserved, phys)
        } else {
            reserved
        }
    }

    /// Whether the backend lacks [`Ability::MapAtReservedAddress`] (read when the device was
    /// made): a commit's memory is where [`placed`](Self::placed) says, and it lives with its
    /// reservation, so a teardown frees before it releases.
    #[inline]
    pub(crate) fn places_at_commit(&self) -> bool {
        self.sizes.places
    }

    #[inline]
    pub(crate) fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        Self::run(Op::Reserve, 0, len, || self.backend.reserve(len))
    }

    #[inline]
    pub(crate) fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        Self::run(Op::Free, addr, len, || self.backend.free(addr, len))
    }

    #[inline]
    pub(crate) fn create(&self, len: usize) -> Result<B::Phys, BackendError> {
        Self::run(Op::Create, 0, len, || self.backend.create(len))
    }

    #[inline]
    pub(crate) fn release(&self, phys: B::Phys, len: usize) -> Result<(), BackendError> {
        Self::run(Op::Release, 0, len, || self.backend.release(phys, len))
    }

    #[inline]
    pub(crate) fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: B::Phys,
        access: Access,
    ) -> Result<(), BackendError> {
        Self::run(Op::Map, addr, len, || {
            self.backend.map(addr, len, phys, access)
        })
    }

    #[inline]
    pub(crate) fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        Self::run(Op::Unmap, addr, len, || self.backend.unmap(addr, len))
    }

    #[inline]
    pub(crate) fn copy_into_phys(
        &self,
        phys: B::Phys,
        src: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        Self::run(Op::Copy, src, len, || {
            self.backend.copy_into_phys(phys, src, len)
        })
    }

    #[inline]
    pub(crate) fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let len = dst.len();
        Self::run(Op::Copy, src, len, || self.backend.copy_to_host(dst, src))
    }

    #[inline]
    pub(crate) fn copy_within(&self, dst: Addr, src: Addr, len: usize) -> Result<(), BackendError> {
        Self::run(Op::Copy, dst, len, || {
            self.backend.copy_within(dst, src, len)
        })
    }

    #[inline]
    pub(crate) fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        Self::run(Op::Copy, dst, src.len(), || {
            self.backend.copy_from_host(dst, src)
        })
    }

    /// A fence after the work submitted so far; `None` if recording one panicked (then no
    /// fence covers the work yet: record one later, before the memory goes).
    #[inline]
    pub(crate) fn fence(&self) -> Option<B::Fence> {
        Self::contain(|| self.backend.fence()).ok()
    }

    /// A fence over what may use the memory of the reservations holding `at` (see
    /// [`Backend::fence_for`]); `None` as for [`fence`](Self::fence).
    #[inline]
    pub(crate) fn fence_for(&self, at: &[Addr]) -> Option<B::Fence> {
        Self::contain(|| self.backend.fence_for(at)).ok()
    }

    /// Whether the fence is done; a panic answers "not yet", which never frees memory early.
    #[inline]
    pub(crate) fn fence_done(&self, fence: &B::Fence) -> bool {
        Self::contain(|| self.backend.fence_done(fence)).unwrap_or(false)
    }

    /// Waits for the fence where the backend can; a panic answers "not done".
    pub(crate) fn wait_fence(&self, fence: &B::Fence) -> bool {
        Self::contain(|| self.backend.wait_fence(fence)).unwrap_or(false)
    }

    /// Gives a fence back; a panic leaves it to the backend (at worst an event is not reused).
    #[inline]
    pub(crate) fn retire_fence(&self, fence: B::Fence) {
        let _ = Self::contain(|| self.backend.retire_fence(fence));
    }

    /// Whether no work that may use the memory of the reservations holding `at` may still
    /// run: a fence over it ([`fence_for`](Self::fence_for)) recorded now and already done.
    /// Any doubt (a panic) answers no.
    #[inline]
    pub(crate) fn idle(&self, at: &[Addr]) -> bool {
        let Some(fence) = self.fence_for(at) else {
            return false;
        };
        let done = self.fence_done(&fence);
        self.retire_fence(fence);
        done
    }

    #[inline]
    pub(crate) fn pin(&self) -> Result<(), BackendError> {
        Self::run(Op::Pin, 0, 0, || self.backend.pin())
    }

    #[inline]
    pub(crate) fn unpin(&self) -> Result<(), BackendError> {
        Self::run(Op::Unpin, 0, 0, || self.backend.unpin())
    }

    /// Whether the context is lost; a panic answers no (the calls that follow are contained
    /// too, and refused by a backend that knows better).
    #[inline]
    pub(crate) fn context_lost(&self) -> bool {
        Self::contain(|| self.backend.context_lost()).unwrap_or(false)
    }

    /// Keeps the range for good; a panic keeps it too, as far as this side goes (the residual
    /// stays withheld in the device whatever the backend did).
    pub(crate) fn keep_for_good(&self, addr: Addr, len: usize) {
        let _ = Self::contain(|| self.backend.keep_for_good(addr, len));
    }

    pub(crate) fn create_exportable<K: HandleKind>(
        &self,
        len: usize,
    ) -> Result<B::Phys, BackendError>
    where
        B: Exportable<K>,
    {
        Self::run(Op::Create, 0, len, || self.backend.create_exportable(len))
    }

    pub(crate) fn export<K: HandleKind>(
        &self,
        phys: B::Phys,
        len: usize,
    ) -> Result<Shareable, BackendError>
    where
        B: Exportable<K>,
    {
        Self::run(Op::Create, 0, len, || {
            <B as Exportable<K>>::export(&self.backend, phys, len)
        })
    }

    pub(crate) fn import<K: HandleKind>(&self, handle: Shareable) -> Result<B::Phys, BackendError>
    where
        B: Exportable<K>,
    {
        let len = handle.len;
        Self::run(Op::Create, 0, len, || {
            <B as Exportable<K>>::import(&self.backend, handle)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::doubles::SimBackend;
    use std::cell::Cell;
    use std::panic::catch_unwind;

    /// Panics quietly with `message` (the default hook would print every expected panic).
    fn boom(message: &'static str) -> u32 {
        panic::resume_unwind(Box::new(message))
    }

    /// The message of a caught panic.
    fn text(payload: Box<dyn Any + Send>) -> String {
        message(payload.as_ref())
    }

    /// Sets its flag when dropped.
    #[derive(Debug)]
    struct Dropped<'a>(&'a Cell<bool>);

    impl Drop for Dropped<'_> {
        fn drop(&mut self) {
            self.0.set(true);
        }
    }

    #[test]
    fn outside_a_scope_a_panic_unwinds_at_once() {
        let caught = catch_unwind(|| contain(|| boom("at once")));
        assert_eq!(text(caught.unwrap_err()), "at once");
        assert!(!PENDING.with(Cell::get), "nothing kept");
    }

    #[test]
    fn a_contained_panic_resumes_after_the_scope_returns_and_its_value_is_dropped() {
        let dropped = Cell::new(false);
        let after_the_call = Cell::new(false);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            Scope::run::<SimBackend, _>(|| {
                assert_eq!(contain(|| boom("later")), Err("later".to_owned()));
                after_the_call.set(true);
                Dropped(&dropped)
            })
        }));
        assert!(
            after_the_call.get(),
            "the body went on after the contained panic"
        );
        assert!(
            dropped.get(),
            "the scope's value was dropped before the panic resumed"
        );
        assert_eq!(text(caught.unwrap_err()), "later");
        assert!(!PENDING.with(Cell::get));
        assert_eq!(
            Scope::run::<SimBackend, _>(|| contain(|| 7)),
            Ok(7),
            "nothing left to resume"
        );
    }

    #[test]
    fn only_the_outermost_scope_resumes_and_it_resumes_the_first_panic() {
        let inner_returned = Cell::new(false);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            Scope::run::<SimBackend, _>(|| {
                let inner = Scope::run::<SimBackend, _>(|| contain(|| boom("first")));
                inner_returned.set(true);
                assert!(inner.is_err());
                assert!(contain(|| boom("second")).is_err());
            })
        }));
        assert!(inner_returned.get(), "an inner scope does not resume");
        assert_eq!(text(caught.unwrap_err()), "first");
    }

    #[test]
    fn a_scope_closed_by_drop_resumes_too() {
        let caught = catch_unwind(|| {
            let _scope = Scope::enter();
            let _ = contain(|| boom("dropped scope"));
        });
        assert_eq!(text(caught.unwrap_err()), "dropped scope");
        assert_eq!(DEPTH.with(Cell::get), 0);
    }

    /// Contains a panic inside a scope while the thread unwinds from another one.
    struct ContainsWhileUnwinding;

    impl Drop for ContainsWhileUnwinding {
        fn drop(&mut self) {
            let _scope = Scope::enter();
            assert!(contain(|| boom("while unwinding")).is_err());
        }
    }

    #[test]
    fn a_panic_contained_while_unwinding_is_dropped_not_resumed_later() {
        let caught = catch_unwind(|| {
            let _guard = ContainsWhileUnwinding;
            boom("the first panic");
        });
        assert_eq!(
            text(caught.unwrap_err()),
            "the first panic",
            "no abort, no swap"
        );
        assert!(!PENDING.with(Cell::get), "the second panic is not kept");
        assert_eq!(Scope::run::<SimBackend, _>(|| 1), 1);
        assert_eq!(DEPTH.with(Cell::get), 0);
    }

    #[test]
    fn messages_of_string_and_other_payloads() {
        assert_eq!(message(&String::from("owned")), "owned");
        assert_eq!(message(&"borrowed"), "borrowed");
        assert_eq!(message(&17_u8), "a panic without a message");
    }
}
