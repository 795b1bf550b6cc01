//! Fault injection and outstanding-resource counting around any backend.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::faults::{Fault, FaultPlan};
use crate::backend::export::{Exportable, HandleKind, Shareable};
use crate::backend::{
    Ability, Access, Addr, Backend, BackendError, Cause, HostVisible, Location, Op, lock,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a backend holds right now, as seen through [`Faulty`]: everything that was handed out
/// successfully and not yet given back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outstanding {
    /// Live reservations.
    pub reservations: u64,
    /// Bytes of VA reserved.
    pub reserved_bytes: u64,
    /// Live physical allocations.
    pub physical: u64,
    /// Bytes of physical memory created and not released.
    pub physical_bytes: u64,
    /// Live mappings.
    pub mappings: u64,
    /// Bytes mapped.
    pub mapped_bytes: u64,
    /// Context pins held.
    pub pins: u64,
}

impl Outstanding {
    /// True when nothing at all is outstanding.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// What a planned fault does to its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    /// The call returns [`Cause::Injected`].
    Fail,
    /// The call panics, as a buggy backend or driver binding might.
    Panic,
}

#[derive(Debug, Default)]
struct FaultState {
    /// Calls counted since the wrapper was made, and the planned faults.
    plans: Mutex<FaultPlan<Op, Effect>>,
    outstanding: Mutex<Outstanding>,
    mappings: Mutex<BTreeMap<Addr, usize>>,
    /// Memory a placing backend put where a commit's reservation now is (see
    /// [`Backend::placed`]): its length, by address. Its reservation's free releases it.
    placed: Mutex<BTreeMap<Addr, usize>>,
    /// Whether the getters (granularity, address space, capacity, location) panic.
    getters_panic: AtomicBool,
    /// Getter calls made so far.
    getter_calls: AtomicU64,
    /// Calls of every kind made so far: VMM calls, copies, fences, pins, getters, and the
    /// context-loss query.
    any_calls: AtomicU64,
    /// The number (in `any_calls`) of the call planned to panic; 0: none.
    panic_at: AtomicU64,
}

/// A handle to steer and inspect a [`Faulty`] backend after a [`Device`](crate::Device) took it.
#[derive(Clone, Debug, Default)]
pub struct FaultHandle(Arc<FaultState>);

impl FaultHandle {
    /// Counts a getter call, and panics if getters are set to ([`panic_getters`](Self::panic_getters)).
    fn getter(&self, name: &str) {
        self.0.getter_calls.fetch_add(1, Ordering::Relaxed);
        self.any(&name);
        if self.0.getters_panic.load(Ordering::Relaxed) {
            panic!("Faulty: panic injected into the getter {name}");
        }
    }

    /// Counts a call of any kind, and panics if it is the one planned by
    /// [`panic_at_call`](Self::panic_at_call).
    fn any(&self, name: &dyn std::fmt::Debug) {
        let nth = self.0.any_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self
            .0
            .panic_at
            .compare_exchange(nth, 0, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            panic!("Faulty: panic injected into call #{nth} of any kind ({name:?})");
        }
    }
}

impl FaultHandle {
    /// Fails the `n`th call of kind `op` from now (`n = 1`: the next one), once. Each kind has
    /// one plan at a time: a new plan for the same kind replaces the previous one.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn fail_nth(&self, op: Op, n: u64) {
        lock(&self.0.plans).plan(op, n, Effect::Fail, false);
    }

    /// Makes the `n`th call of kind `op` from now panic, once, before it reaches the wrapped
    /// backend (which is left untouched, as with [`fail_nth`](Self::fail_nth)). The panic's
    /// message names the call: `Faulty: panic injected into Map call #3`. For testing that a
    /// panicking backend leaves the typed layer consistent. It replaces the kind's plan.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn panic_nth(&self, op: Op, n: u64) {
        lock(&self.0.plans).plan(op, n, Effect::Panic, false);
    }

    /// Fails the `n`th call of kind `op` from now and every one after it, until [`clear`](Self::clear).
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn fail_from(&self, op: Op, n: u64) {
        lock(&self.0.plans).plan(op, n, Effect::Fail, true);
    }

    /// Makes every later getter call (`granularity`, `address_space`, `physical_capacity`,
    /// `location`) panic while `on`, and counts them either way
    /// ([`getter_calls`](Self::getter_calls)): the typed layer reads them once, when the device
    /// is made, so none should run after.
    pub fn panic_getters(&self, on: bool) {
        self.0.getters_panic.store(on, Ordering::Relaxed);
    }

    /// Makes the `n`th call from now panic, once, whatever its kind: a VMM call, a copy, a
    /// fence's, a pin's, a getter or the context-loss query (`n = 1`: the next one). The panic's
    /// message starts `Faulty: panic injected into call #` and names the kind. Independent of
    /// the per-kind plans; a later call replaces it, [`clear`](Self::clear) removes it.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub fn panic_at_call(&self, n: u64) {
        assert!(
            n >= 1,
            "calls are counted from 1: n = 1 panics the next call"
        );
        let at = self.any_calls() + n;
        self.0.panic_at.store(at, Ordering::Relaxed);
    }

    /// Calls of every kind made so far (see [`panic_at_call`](Self::panic_at_call)).
    pub fn any_calls(&self) -> u64 {
        self.0.any_calls.load(Ordering::Relaxed)
    }

    /// Getter calls made so far.
    pub fn getter_calls(&self) -> u64 {
        self.0.getter_calls.load(Ordering::Relaxed)
    }

    /// Removes every planned fault.
    pub fn clear(&self) {
        self.0.panic_at.store(0, Ordering::Relaxed);
        lock(&self.0.plans).clear();
    }

    /// Calls of kind `op` made so far, failed ones included.
    pub fn calls(&self, op: Op) -> u64 {
        lock(&self.0.plans).calls(op)
    }

    /// What the wrapped backend holds right now.
    pub fn outstanding(&self) -> Outstanding {
        *lock(&self.0.outstanding)
    }

    /// Counts a call; returns the injected error if this call is planned to fail, and panics
    /// (with no lock held) if it is planned to panic.
    fn enter(&self, op: Op, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.any(&op);
        let planned = lock(&self.0.plans).enter(op);
        match planned {
            Ok(()) => Ok(()),
            Err(Fault {
                nth,
                error: Effect::Fail,
            }) => Err(BackendError::new(op, addr, len, Cause::Injected { nth })),
            Err(Fault {
                nth,
                error: Effect::Panic,
            }) => panic!("Faulty: panic injected into {op:?} call #{nth}"),
        }
    }

    /// Counts a call that cannot fail (a fence's): only a planned panic applies to it; a
    /// planned failure is used up without effect.
    fn enter_infallible(&self, op: Op) {
        let _ = self.enter(op, 0, 0);
    }

    fn count(&self, f: impl FnOnce(&mut Outstanding)) {
        f(&mut lock(&self.0.outstanding));
    }
}

/// Wraps a backend: fails chosen calls (the call is then not forwarded, so the wrapped backend
/// is untouched) and counts what the backend holds, so a test can assert that nothing was lost.
///
/// ```
/// use memtoken::backend::{Backend, Op, doubles::{Faulty, SimBackend}};
/// let faulty = Faulty::new(SimBackend::strict());
/// let faults = faulty.handle();
/// faults.fail_nth(Op::Reserve, 1);
/// assert!(faulty.reserve(2 << 20).unwrap_err().is_injected());
/// let addr = faulty.reserve(2 << 20).unwrap();
/// assert_eq!(faults.outstanding().reservations, 1);
/// faulty.free(addr, 2 << 20).unwrap();
/// assert!(faults.outstanding().is_zero());
/// ```
#[derive(Debug)]
pub struct Faulty<B> {
    inner: B,
    handle: FaultHandle,
}

impl<B: Backend> Faulty<B> {
    /// Wraps `inner` with no fault planned.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            handle: FaultHandle::default(),
        }
    }

    /// A handle to plan faults and read the outstanding counts.
    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }
}

impl<B: Backend> Backend for Faulty<B> {
    type Phys = B::Phys;
    type Fence = B::Fence;
    const IMMEDIATE: bool = B::IMMEDIATE;
    /// It panics where planned ([`FaultHandle::panic_nth`]), whatever the backend inside.
    const MAY_PANIC: bool = true;

    fn granularity(&self) -> usize {
        self.handle.getter("granularity");
        self.inner.granularity()
    }

    fn address_space(&self) -> usize {
        self.handle.getter("address_space");
        self.inner.address_space()
    }

    fn physical_capacity(&self) -> u64 {
        self.handle.getter("physical_capacity");
        self.inner.physical_capacity()
    }

    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        self.handle.enter(Op::Reserve, 0, len)?;
        let addr = self.inner.reserve(len)?;
        self.handle.count(|o| {
            o.reservations += 1;
            o.reserved_bytes += len as u64;
        });
        Ok(addr)
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.handle.enter(Op::Free, addr, len)?;
        self.inner.free(addr, len)?;
        // Memory placed there went with it (see `Backend::placed`).
        let placed = lock(&self.handle.0.placed).remove(&addr);
        self.handle.count(|o| {
            o.reservations -= 1;
            o.reserved_bytes -= len as u64;
            if let Some(len) = placed {
                o.physical -= 1;
                o.physical_bytes -= len as u64;
            }
        });
        Ok(())
    }

    fn create(&self, len: usize) -> Result<B::Phys, BackendError> {
        self.handle.enter(Op::Create, 0, len)?;
        let phys = self.inner.create(len)?;
        self.handle.count(|o| {
            o.physical += 1;
            o.physical_bytes += len as u64;
        });
        Ok(phys)
    }

    fn release(&self, phys: B::Phys, len: usize) -> Result<(), BackendError> {
        self.handle.enter(Op::Release, 0, len)?;
        self.inner.release(phys, len)?;
        // Released while still placed: its reservation's free no longer counts it.
        let at = self.inner.placed(0, phys);
        if at != 0 {
            lock(&self.handle.0.placed).remove(&at);
        }
        self.handle.count(|o| {
            o.physical -= 1;
            o.physical_bytes -= len as u64;
        });
        Ok(())
    }

    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: B::Phys,
        access: Access,
    ) -> Result<(), BackendError> {
        self.handle.enter(Op::Map, addr, len)?;
        self.inner.map(addr, len, phys, access)?;
        lock(&self.handle.0.mappings).insert(addr, len);
        self.handle.count(|o| {
            o.mappings += 1;
            o.mapped_bytes += len as u64;
        });
        Ok(())
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.handle.enter(Op::Unmap, addr, len)?;
        self.inner.unmap(addr, len)?;
        let removed = {
            let mut maps = lock(&self.handle.0.mappings);
            let starts: Vec<Addr> = maps.range(addr..addr + len).map(|(&a, _)| a).collect();
            starts.iter().filter_map(|a| maps.remove(a)).count() as u64
        };
        self.handle.count(|o| {
            o.mappings -= removed;
            o.mapped_bytes -= len as u64;
        });
        Ok(())
    }

    fn copy_into_phys(&self, phys: B::Phys, src: Addr, len: usize) -> Result<(), BackendError> {
        self.handle.enter(Op::Copy, src, len)?;
        self.inner.copy_into_phys(phys, src, len)
    }

    fn location(&self) -> Location {
        self.handle.getter("location");
        self.inner.location()
    }

    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        self.handle.enter(Op::Copy, src, dst.len())?;
        self.inner.copy_to_host(dst, src)
    }

    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        self.handle.enter(Op::Copy, dst, src.len())?;
        self.inner.copy_from_host(dst, src)
    }

    fn copy_within(&self, dst: Addr, src: Addr, len: usize) -> Result<(), BackendError> {
        self.handle.enter(Op::Copy, dst, len)?;
        self.inner.copy_within(dst, src, len)
    }

    fn fence(&self) -> B::Fence {
        self.handle.enter_infallible(Op::Fence);
        self.inner.fence()
    }

    fn fence_for(&self, at: &[Addr]) -> B::Fence {
        self.handle.enter_infallible(Op::Fence);
        self.inner.fence_for(at)
    }

    fn fence_done(&self, fence: &B::Fence) -> bool {
        self.handle.enter_infallible(Op::Fence);
        self.inner.fence_done(fence)
    }

    fn wait_fence(&self, fence: &B::Fence) -> bool {
        self.handle.enter_infallible(Op::Fence);
        self.inner.wait_fence(fence)
    }

    fn retire_fence(&self, fence: B::Fence) {
        self.handle.enter_infallible(Op::Fence);
        self.inner.retire_fence(fence);
    }

    fn pin(&self) -> Result<(), BackendError> {
        self.handle.enter(Op::Pin, 0, 0)?;
        self.inner.pin()?;
        self.handle.count(|o| o.pins += 1);
        Ok(())
    }

    fn unpin(&self) -> Result<(), BackendError> {
        self.handle.enter(Op::Unpin, 0, 0)?;
        self.inner.unpin()?;
        self.handle.count(|o| o.pins -= 1);
        Ok(())
    }

    fn context_lost(&self) -> bool {
        self.handle.any(&"context_lost");
        self.inner.context_lost()
    }

    fn withheld(&self, addr: Addr, len: usize) -> bool {
        self.handle.any(&"withheld");
        self.inner.withheld(addr, len)
    }

    fn keep_for_good(&self, addr: Addr, len: usize) {
        self.handle.any(&"keep_for_good");
        self.inner.keep_for_good(addr, len)
    }

    // Neither is counted nor can fail: `lacks` is read as the device is made, and `placed`
    // must not panic (a commit calls it after its memory is made and kept).
    fn lacks(&self, ability: Ability) -> Option<&'static str> {
        self.inner.lacks(ability)
    }

    fn placed(&self, reserved: Addr, phys: B::Phys) -> Addr {
        let placed = self.inner.placed(reserved, phys);
        // The mapping made at `reserved` lives at `placed`: its unmap will name that address.
        let mut maps = lock(&self.handle.0.mappings);
        if let Some(len) = maps.remove(&reserved) {
            maps.insert(placed, len);
            // A placing backend's memory lives with its reservation: released by its free.
            if placed != reserved {
                lock(&self.handle.0.placed).insert(placed, len);
            }
        }
        placed
    }
}

// SAFETY: every call is forwarded unchanged to `B` or not made at all, so `B`'s guarantee holds.
unsafe impl<B: HostVisible> HostVisible for Faulty<B> {}

/// Exports and imports are made as [`Op::Create`] calls (each makes a handle): a fault aimed at
/// the Nth create may hit one. Memory created exportable and imported handles count as physical
/// allocations until released; an exported handle is the caller's and is not counted.
impl<K: HandleKind, B: Exportable<K>> Exportable<K> for Faulty<B> {
    fn create_exportable(&self, len: usize) -> Result<B::Phys, BackendError> {
        self.handle.enter(Op::Create, 0, len)?;
        let phys = self.inner.create_exportable(len)?;
        self.handle.count(|o| {
            o.physical += 1;
            o.physical_bytes += len as u64;
        });
        Ok(phys)
    }

    fn export(&self, phys: B::Phys, len: usize) -> Result<Shareable, BackendError> {
        self.handle.enter(Op::Create, 0, len)?;
        self.inner.export(phys, len)
    }

    fn import(&self, handle: Shareable) -> Result<B::Phys, BackendError> {
        let len = handle.len;
        self.handle.enter(Op::Create, 0, len)?;
        let phys = self.inner.import(handle)?;
        self.handle.count(|o| {
            o.physical += 1;
            o.physical_bytes += len as u64;
        });
        Ok(phys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::CudaBackend;
    use crate::backend::doubles::{DriverModel, ModelConfig, ModelOutstanding};
    use crate::backend::{HostBackend, Violation};

    /// Memory a placing backend (the CUDA plain mechanism) put elsewhere, released before its
    /// reservation's free, is counted once: the release takes it out of the placements, so
    /// the free does not count it off again. Fails if `release` leaves the placement (the
    /// free would take a second allocation off, wrapping the counts).
    #[test]
    fn placed_memory_released_before_its_free_is_counted_off_once() {
        let model = DriverModel::new(ModelConfig {
            vmm: false,
            ..ModelConfig::default()
        })
        .unwrap();
        let faulty = Faulty::new(CudaBackend::new_plain(model.clone(), 0).unwrap());
        let faults = faulty.handle();
        let g = faulty.granularity();
        let reserved = faulty.reserve(g).unwrap();
        let phys = faulty.create(g).unwrap();
        faulty.map(reserved, g, phys, Access::ReadWrite).unwrap();
        let placed = faulty.placed(reserved, phys);
        assert_ne!(placed, reserved, "the plain mechanism places memory");
        faulty.release(phys, g).unwrap();
        assert_eq!(faults.outstanding().physical, 0, "released");
        faulty.unmap(placed, g).unwrap();
        faulty.free(placed, g).unwrap();
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
        drop(faulty); // its context's retain
        assert_eq!(model.outstanding(), ModelOutstanding::default());
    }

    /// `withheld` answers what the wrapped backend answers — a range a CUDA capture holds is
    /// withheld, the range beside it not — and is counted as a call of any kind. Fails if the
    /// wrapper answers for itself.
    #[test]
    fn withheld_is_the_wrapped_backends_answer() {
        let model = DriverModel::default();
        let faulty = Faulty::new(CudaBackend::new(model.clone(), 0).unwrap());
        let faults = faulty.handle();
        let (at, len) = (0x10_0000, 0x1000);
        faulty.inner.hold_for_capture(at, len);
        let calls = faults.any_calls();
        assert!(faulty.withheld(at, len), "held for a capture");
        assert!(!faulty.withheld(at + len, len), "the range beside it");
        assert_eq!(faults.any_calls(), calls + 2, "counted");
        faulty.inner.let_go(&[(at, len)]);
        drop(faulty); // its context's retain
        assert_eq!(model.outstanding(), ModelOutstanding::default());
    }

    /// `keep_for_good` reaches the wrapped backend (the host then refuses to free the range)
    /// and is counted as a call of any kind. Fails if the wrapper drops it.
    #[test]
    fn keep_for_good_is_forwarded_and_counted() {
        let faulty = Faulty::new(HostBackend::with_defaults().unwrap());
        let faults = faulty.handle();
        let g = faulty.granularity();
        let kept = faulty.reserve(g).unwrap();
        let calls = faults.any_calls();
        faulty.keep_for_good(kept, g);
        assert_eq!(faults.any_calls(), calls + 1, "counted");
        let e = faulty.free(kept, g).expect_err("kept for good");
        assert!(
            matches!(e.cause, Cause::Violation(Violation::Poisoned { .. })),
            "{e}"
        );
    }
}
