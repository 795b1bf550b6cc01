//! Regression test (found in review, fixed): `Device::discharge_all` takes the quarantine and the deferred queue out of the books
//! without counting them as busy, then makes backend calls (`retire_fence`) before it refunds
//! the ledger: while it runs, another thread sees `custody()` / `Progress` report nothing
//! deferred while the ledger still holds the bytes (the under-report `Books::busy` was made to
//! prevent for poll and retry_quarantine).

use memtoken::backend::{Access, Addr, Backend, BackendError, Location, SimBackend, SimConfig};
use memtoken::{Budget, Device, make_guard};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

const STALL: Duration = Duration::from_secs(20);

/// Where a [`Gate`] stands: armed (the next retire_fence stops at it), entered (one has), open (it may
/// go on).
#[derive(Default)]
struct GateState {
    armed: bool,
    entered: bool,
    open: bool,
}

/// A handle on a [`Gate`]'s state, shared with the test.
#[derive(Clone, Default)]
struct GateHandle(Arc<(Mutex<GateState>, Condvar)>);

impl GateHandle {
    /// The next unmap stops at the gate until [`open`](Self::open).
    fn arm(&self) {
        self.0.0.lock().unwrap().armed = true;
    }

    /// Waits (bounded) until an unmap has stopped at the gate; whether one has.
    fn wait_entered(&self) -> bool {
        let (state, changed) = &*self.0;
        let state = state.lock().unwrap();
        let (state, _) = changed
            .wait_timeout_while(state, STALL, |s| !s.entered)
            .unwrap();
        state.entered
    }

    /// Lets the stopped unmap go on.
    fn open(&self) {
        let (state, changed) = &*self.0;
        state.lock().unwrap().open = true;
        changed.notify_all();
    }
}

/// A backend whose next retire_fence, once armed, blocks (outside the inner backend) until the test
/// opens the gate: a slow driver call, made on purpose.
struct Gate<B> {
    inner: B,
    gate: GateHandle,
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
        {
            let (state, changed) = &*self.gate.0;
            let mut s = state.lock().unwrap();
            if s.armed {
                s.armed = false;
                s.entered = true;
                changed.notify_all();
                let _open = changed.wait_while(s, |s| !s.open).unwrap();
            }
        }
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
}


#[test]
fn while_discharge_all_runs_another_thread_sees_nothing_deferred_but_bytes_in_the_ledger() {
    let sim = SimBackend::new(SimConfig {
        fences_complete_at_once: false,
        ..SimConfig::default()
    })
    .unwrap();
    let gate = GateHandle::default();
    make_guard!(guard);
    let device = Device::new(
        guard,
        Gate {
            inner: sim.clone(),
            gate: gate.clone(),
        },
    );
    let binding = device.bind(Budget::unlimited()).unwrap();
    drop(binding.reserve(1).unwrap().commit().unwrap());
    drop(binding.reserve(1).unwrap().commit().unwrap());
    drop(binding);
    assert_eq!(device.custody().deferred.count, 2);
    sim.lose_context();
    let proof = device.confirm_context_lost().expect("lost");
    gate.arm();
    let seen = std::thread::scope(|s| {
        let discharging = s.spawn(|| device.discharge_all(&proof));
        assert!(gate.wait_entered(), "discharge_all never reached retire_fence");
        let custody = device.custody();
        let progress = device.poll();
        let ledger = device.ledger();
        gate.open();
        assert_eq!(discharging.join().unwrap(), 2);
        (custody, progress, ledger)
    });
    let (custody, progress, ledger) = seen;
    assert!(
        custody.deferred.owned_bytes >= ledger.owned_bytes,
        "custody counts {} owned bytes deferred, poll() says {} deferred, while the ledger \
         still holds {} owned bytes",
        custody.deferred.owned_bytes,
        progress.deferred,
        ledger.owned_bytes
    );
}
