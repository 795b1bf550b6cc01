//! For `benches/gpu_costs.rs`: whether there is a GPU to time (the GPU tests' convention), and
//! granule slots on the real driver below the backend, for the raw VMM calls.

use memtoken::backend::Backend;
use memtoken::backend::cuda::{AllocationProps, Context, CuResult, CudaBackend, Driver, SysDriver};

/// The real device 0, or `None` with the reason printed when this machine has no usable GPU —
/// as `tests/gpu/cases.rs` decides.
///
/// # Panics
///
/// When `MEMTOKEN_REQUIRE_GPU=1` and there is no usable GPU.
pub fn gpu_or_skip() -> Option<CudaBackend<SysDriver>> {
    let required = std::env::var("MEMTOKEN_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaBackend::open(0) {
        Ok(backend) => Some(backend),
        Err(e) if required => panic!("gpu_costs: MEMTOKEN_REQUIRE_GPU=1 but no GPU is usable: {e}"),
        Err(e) => {
            println!(
                "gpu_costs: skipped, no usable CUDA GPU: {e}; run on a GPU machine: \
                 ../shared/gpu/prepare.sh, then bash .gpu/run.sh (MEMTOKEN_REQUIRE_GPU=1 makes \
                 this a failure)"
            );
            None
        }
    }
}

/// Panics with the call's name unless it succeeded.
fn ok<T>(r: CuResult<T>, call: &str) -> T {
    r.unwrap_or_else(|e| panic!("{call}: {e}"))
}

/// `S` granule slots in one reservation, on the driver directly (each method one driver call
/// through memtoken's `Driver` seam: for `SysDriver`, one `cudarc::driver::sys` call), each
/// checked against the slot's state first so that only live handles and exactly mapped ranges
/// reach the driver. Holds a retain of the device's primary context of its own, made current
/// on the thread that made the slots (and again by [`make_current`](Self::make_current)).
pub struct Slots<D: Driver, const S: usize> {
    driver: D,
    device: i32,
    ctx: Context,
    /// The properties the backend creates plain memory with.
    props: AllocationProps,
    g: usize,
    /// The reservation (0 until `new` made it).
    base: u64,
    handles: [Option<u64>; S],
    mapped: [bool; S],
}

impl<D: Driver, const S: usize> Slots<D, S> {
    /// Slots on `driver`, for the device `backend` opened on it (so the driver is initialized),
    /// with its granularity and the properties it creates plain memory with.
    pub fn new(driver: D, backend: &CudaBackend<D>) -> Self {
        let device = backend.device();
        let ctx = ok(
            driver.primary_ctx_retain(device),
            "cuDevicePrimaryCtxRetain",
        );
        let g = backend.granularity();
        let mut slots = Self {
            driver,
            device,
            ctx,
            props: backend.allocation_props(),
            g,
            base: 0,
            handles: [None; S],
            mapped: [false; S],
        };
        slots.make_current();
        let base = slots.driver.mem_address_reserve(S * g, g, 0);
        slots.base = ok(base, "cuMemAddressReserve");
        slots
    }

    /// Makes the retained context current on the calling thread.
    pub fn make_current(&self) {
        // SAFETY: `ctx` was retained by `new`; it is given back only when the slots drop.
        let r = unsafe { self.driver.ctx_set_current(self.ctx) };
        ok(r, "cuCtxSetCurrent");
    }

    fn ptr(&self, i: usize) -> u64 {
        self.base + (i * self.g) as u64
    }

    /// `cuMemCreate` of one granule for slot `i`, which holds none.
    pub fn create(&mut self, i: usize) {
        assert!(self.handles[i].is_none(), "slot {i} holds memory");
        let handle = self.driver.mem_create_with(self.g, self.props);
        self.handles[i] = Some(ok(handle, "cuMemCreate"));
    }

    /// `cuMemMap` of slot `i`'s granule at the slot.
    pub fn map(&mut self, i: usize) {
        let handle = self.handles[i].expect("the slot holds memory");
        assert!(!self.mapped[i], "slot {i} is mapped");
        // SAFETY: the range is slot `i` of the live reservation `new` made, not mapped
        // (checked); `handle` was created for this slot, one granule long, and is not released
        // (`release` takes it out of the slot).
        let r = unsafe { self.driver.mem_map(self.ptr(i), self.g, 0, handle) };
        ok(r, "cuMemMap");
        self.mapped[i] = true;
    }

    /// `cuMemSetAccess` (read-write, for this device) on slot `i`'s mapping.
    pub fn set_access(&mut self, i: usize) {
        assert!(self.mapped[i], "slot {i} is not mapped");
        let grant = [(self.device, true)];
        // SAFETY: the range is exactly slot `i`'s mapping (checked), in a live reservation.
        let r = unsafe { self.driver.mem_set_access(self.ptr(i), self.g, &grant) };
        ok(r, "cuMemSetAccess");
    }

    /// `cuMemUnmap` of slot `i`'s mapping.
    pub fn unmap(&mut self, i: usize) {
        assert!(self.mapped[i], "slot {i} is not mapped");
        // SAFETY: the range is exactly slot `i`'s mapping (checked), in a live reservation; no
        // work that could use it was ever submitted.
        let r = unsafe { self.driver.mem_unmap(self.ptr(i), self.g) };
        ok(r, "cuMemUnmap");
        self.mapped[i] = false;
    }

    /// `cuMemRelease` of slot `i`'s granule, not mapped.
    pub fn release(&mut self, i: usize) {
        assert!(!self.mapped[i], "slot {i} is mapped");
        let handle = self.handles[i].take().expect("the slot holds memory");
        // SAFETY: `handle` was created by `create` and is released once: taken out of its slot.
        ok(unsafe { self.driver.mem_release(handle) }, "cuMemRelease");
    }
}

impl<D: Driver, const S: usize> Drop for Slots<D, S> {
    fn drop(&mut self) {
        for i in 0..S {
            if self.mapped[i] {
                self.unmap(i);
            }
            if self.handles[i].is_some() {
                self.release(i);
            }
        }
        if self.base != 0 {
            // SAFETY: `base` is the reservation `new` made, `S * g` long, with nothing mapped.
            let r = unsafe { self.driver.mem_address_free(self.base, S * self.g) };
            ok(r, "cuMemAddressFree");
        }
        // SAFETY: gives back the one retain of the primary context `new` took.
        let r = unsafe { self.driver.primary_ctx_release(self.device) };
        ok(r, "cuDevicePrimaryCtxRelease");
    }
}
