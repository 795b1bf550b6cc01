//! A backend that stalls one chosen call until the test lets it go on: for proving that the
//! device holds none of its locks while the backend works. It can also move the offsets of the
//! handles it exports, as a backend exporting pieces of one larger file would say.

use memtoken::backend::{
    Access, Addr, Backend, BackendError, Exportable, HandleKind, Location, Op, Shareable,
    doubles::{SimBackend, SimConfig},
};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Long enough for any bookkeeping call on a loaded machine; reached only when one is stalled.
pub const STALL: Duration = Duration::from_secs(20);

/// Where a [`Gate`] stands: armed (the next call of that kind stops at it), entered (one has),
/// open (it may go on).
#[derive(Default)]
struct GateState {
    armed: Option<Op>,
    entered: bool,
    open: bool,
    /// Added to the offset of every handle exported, taken off every handle imported.
    shift: u64,
}

/// A handle on a [`Gate`]'s state, shared with the test.
#[derive(Clone, Default)]
pub struct GateHandle(Arc<(Mutex<GateState>, Condvar)>);

impl GateHandle {
    /// The next call of kind `op` (`Op::Unmap`, `Op::Create`, or `Op::Fence` for
    /// `retire_fence`) stops at the gate until [`open`](Self::open).
    pub fn arm(&self, op: Op) {
        self.0.0.lock().unwrap().armed = Some(op);
    }

    /// Stops here, if armed for `op`, until the gate opens.
    fn pass(&self, op: Op) {
        let (state, changed) = &*self.0;
        let mut s = state.lock().unwrap();
        if s.armed == Some(op) {
            s.armed = None;
            s.entered = true;
            changed.notify_all();
            let _open = changed.wait_while(s, |s| !s.open).unwrap();
        }
    }

    /// Waits (bounded) until a call has stopped at the gate; whether one has.
    pub fn wait_entered(&self) -> bool {
        let (state, changed) = &*self.0;
        let state = state.lock().unwrap();
        let (state, _) = changed
            .wait_timeout_while(state, STALL, |s| !s.entered)
            .unwrap();
        state.entered
    }

    /// From now on, exported handles name an offset `shift` bytes further into their file than
    /// the inner backend said: for checking what reaches an export's message (no receiver
    /// takes such a handle, the file holds nothing there).
    pub fn shift_exports(&self, shift: u64) {
        self.0.0.lock().unwrap().shift = shift;
    }

    fn shift(&self) -> u64 {
        self.0.0.lock().unwrap().shift
    }

    /// Lets the stopped call go on.
    pub fn open(&self) {
        let (state, changed) = &*self.0;
        state.lock().unwrap().open = true;
        changed.notify_all();
    }
}

/// A backend whose next call of the armed kind blocks (outside the inner backend) until the
/// test opens the gate: a slow driver call, made on purpose.
pub struct Gate<B> {
    /// The backend that makes the calls.
    pub inner: B,
    /// The gate's handle.
    pub gate: GateHandle,
}

impl<B: Backend> Backend for Gate<B> {
    type Phys = B::Phys;
    type Fence = B::Fence;
    const IMMEDIATE: bool = B::IMMEDIATE;
    const MAY_PANIC: bool = B::MAY_PANIC;

    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn address_space(&self) -> usize {
        self.inner.address_space()
    }
    fn physical_capacity(&self) -> u64 {
        self.inner.physical_capacity()
    }
    fn location(&self) -> Location {
        self.inner.location()
    }
    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        self.inner.reserve(len)
    }
    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.inner.free(addr, len)
    }
    fn create(&self, len: usize) -> Result<B::Phys, BackendError> {
        self.gate.pass(Op::Create);
        self.inner.create(len)
    }
    fn release(&self, phys: B::Phys, len: usize) -> Result<(), BackendError> {
        self.inner.release(phys, len)
    }
    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: B::Phys,
        access: Access,
    ) -> Result<(), BackendError> {
        self.inner.map(addr, len, phys, access)
    }
    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        self.gate.pass(Op::Unmap);
        self.inner.unmap(addr, len)
    }
    fn copy_into_phys(&self, phys: B::Phys, src: Addr, len: usize) -> Result<(), BackendError> {
        self.inner.copy_into_phys(phys, src, len)
    }
    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        self.inner.copy_to_host(dst, src)
    }
    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        self.inner.copy_from_host(dst, src)
    }
    fn fence(&self) -> B::Fence {
        self.inner.fence()
    }
    fn fence_done(&self, fence: &B::Fence) -> bool {
        self.inner.fence_done(fence)
    }
    fn wait_fence(&self, fence: &B::Fence) -> bool {
        self.inner.wait_fence(fence)
    }
    fn retire_fence(&self, fence: B::Fence) {
        self.gate.pass(Op::Fence);
        self.inner.retire_fence(fence)
    }
    fn pin(&self) -> Result<(), BackendError> {
        self.inner.pin()
    }
    fn unpin(&self) -> Result<(), BackendError> {
        self.inner.unpin()
    }
    fn context_lost(&self) -> bool {
        self.inner.context_lost()
    }

    fn lacks(&self, ability: memtoken::backend::Ability) -> Option<&'static str> {
        self.inner.lacks(ability)
    }

    fn placed(&self, reserved: memtoken::backend::Addr, phys: B::Phys) -> memtoken::backend::Addr {
        self.inner.placed(reserved, phys)
    }
}

/// Exports and imports go to the inner backend; exported offsets are moved by
/// [`GateHandle::shift_exports`].
impl<K: HandleKind, B: Exportable<K>> Exportable<K> for Gate<B> {
    fn create_exportable(&self, len: usize) -> Result<B::Phys, BackendError> {
        self.inner.create_exportable(len)
    }
    fn export(&self, phys: B::Phys, len: usize) -> Result<Shareable, BackendError> {
        let mut handle = self.inner.export(phys, len)?;
        handle.offset += self.gate.shift();
        Ok(handle)
    }
    fn import(&self, handle: Shareable) -> Result<B::Phys, BackendError> {
        self.inner.import(handle)
    }
}

/// The strict simulator with fences that complete only when told (`complete_fences`).
pub fn manual_sim() -> SimBackend {
    SimBackend::new(SimConfig {
        fences_complete_at_once: false,
        ..SimConfig::strict()
    })
    .unwrap()
}

/// The strict simulator with fences that complete only when told, behind a gate: the simulator
/// (to complete fences), the gate's handle, and the backend to make a device of.
pub fn gated_sim() -> (SimBackend, GateHandle, Gate<SimBackend>) {
    let sim = manual_sim();
    let gate = GateHandle::default();
    let backend = Gate {
        inner: sim.clone(),
        gate: gate.clone(),
    };
    (sim, gate, backend)
}
