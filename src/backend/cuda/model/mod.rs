//! [`DriverModel`]: the CUDA driver's VMM rules in pure Rust, so the CUDA backend's whole state
//! machine runs in `cargo test` on any machine.
//!
//! Where the CUDA documentation is silent, the model takes the strictest reading the crate's CUDA
//! facts ([`facts`](crate::backend::cuda::facts)) give; each such rule names its fact number.

// Where things are: `config` (the settings), `state` (what the model holds, and the rules that
// move it), `controls` (the test controls: planned failures, loss, work, captures, what is
// held), `driver` (the `Driver` implementation); here the type, its call gate and its checks.
mod captures;
mod checks;
mod config;
mod controls;
mod driver;
mod sharing;
mod state;

pub use config::{CaptureMode, ModelConfig, Placement};
pub use controls::ModelOutstanding;

use super::driver::{AllocationProps, CuError, CuResult, DriverCall};
use super::driver::{HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD};
use crate::backend::{ConfigError, Violation, lock};
use state::ModelState;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A strict model of the CUDA driver's VMM rules, events and context.
///
/// It **panics** on a call the real driver would reject as misuse — a VMM call without a
/// current context, a reservation or mapping not aligned to the granularity, a free of
/// anything but exactly a reservation or with mappings under it, a map over a mapping, an
/// unmap of something not exactly mapped, an access change or copy on unmapped memory, a copy
/// through memory without access, an unknown handle or event, access for a peer device never
/// asked about — because the CUDA backend must never make one. Releasing a handle while mapped
/// is allowed, as in CUDA: the memory goes with its last unmap.
///
/// Where the documentation is silent it takes the strictest reading of [`facts`](crate::backend::cuda::facts):
///
/// - **Unmap under running work faults** (fact 21): `cuMemUnmap` does not wait. Work submitted
///   on any stream ([`submit_work_on`](Self::submit_work_on), or a copy) may touch any memory
///   mapped with access when it was submitted; if such a mapping is unmapped before the work
///   completes, the context takes the sticky `CUDA_ERROR_ILLEGAL_ADDRESS` (700) when that work
///   completes (or is synchronized). A mapping made after the work was submitted may be
///   unmapped freely.
/// - **Address hints are ignored** (fact 12): `cuMemAddressReserve` places a reservation by
///   [`ModelConfig::placement`], never at the hint.
/// - **Values come back** (fact 25): a released handle's value comes back from the next
///   `cuMemCreate`, and a destroyed event's from the next `cuEventCreate`, the last given back
///   first. A handle's value may come back while its old memory is still mapped: nothing in
///   the documentation keeps it reserved until the last unmap, so it is free as soon as
///   `cuMemRelease` returned.
/// - **Exactly the sticky codes stick** (facts 33–35): after an injected 700, 702, 714–719,
///   911, 226, 721, 710 or 810 every call returns that same code; after 4
///   (`DEINITIALIZED`) every call returns 4; after 709 (`CONTEXT_IS_DESTROYED`, not sticky
///   in the sheet's sense: the process could make a new context) the context is destroyed, and
///   every call into it returns 709, while calls that need no context (`cuInit`,
///   `cuDeviceGet`, `cuDeviceTotalMem`, `cuDeviceCanAccessPeer`) still succeed; every other
///   code fails only its call.
/// - **Captures refuse VMM calls** (facts 40–43): while a GLOBAL capture is open on any thread
///   (or a THREAD_LOCAL one on the calling thread), `cuMemAddressReserve`,
///   `cuMemAddressFree`, `cuMemCreate`, `cuMemRelease`, `cuMemMap`, `cuMemSetAccess`,
///   `cuMemUnmap` and `cuStreamSynchronize` return `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
///   (900) with nothing changed, and invalidate that capture ([`end_capture`](Self::end_capture)
///   then says so). RELAXED captures refuse nothing. A synchronize of a capturing stream is
///   refused, and invalidates its capture, in every mode (fact 41). The model has no
///   `cuCtxSynchronize`: memtoken never calls it (it would invalidate every capture open in
///   the context).
/// - **GPUDirect RDMA only where attribute 110 says so** (fact 14): `cuMemCreate` or
///   `cuMemGetAllocationGranularity` with `gpuDirectRDMACapable` on a device whose
///   `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` ([`ModelConfig::rdma_with_vmm`],
///   read by `cuDeviceGetAttribute`) is 0 panics: the backend asks it only where the attribute
///   is 1. [`props_log`](Self::props_log) lists the properties of every such call.
/// - **Granularity depends on the properties** (fact 15): `cuMemGetAllocationGranularity`
///   answers [`ModelConfig::exportable_granularity`] for exportable properties and
///   [`ModelConfig::granularity`] for the others; a `cuMemCreate` whose size, or a `cuMemMap`
///   whose address, is not a multiple of the granularity of the memory's own properties panics
///   (facts 14, 16).
/// - **Peer access only after asking** (fact 32): `cuMemSetAccess` for a device other than
///   the one owning the memory panics unless `cuDeviceCanAccessPeer(device, owner)` was
///   called, and returns `CUDA_ERROR_INVALID_DEVICE` (101) if that said 0. A descriptor list
///   that is empty, or names a device twice or a device the model does not have, panics.
/// - **No peer loses access across a remap** (facts 18, 31): the model remembers every device
///   given access to any mapping of a reservation, until the reservation is freed. A new
///   mapping there (a region's regrown granule, a copy-on-write boundary, memory woken at the
///   same address) whose first `cuMemSetAccess` leaves one of them out panics: the real driver
///   would accept it, and the peer's next access would fault or hang (NCCL deadlocked for
///   56 minutes on such a remap, openxla/xla#40852). [`access_of`](Self::access_of) reads the
///   access each device has.
///
/// It fails on purpose where asked ([`fail_nth`](Self::fail_nth) with any `CUresult`), loses
/// the context where asked ([`lose_context`](Self::lose_context): from then on every call into
/// the context returns `CUDA_ERROR_CONTEXT_IS_DESTROYED` and is counted in
/// [`calls_after_loss`](Self::calls_after_loss)), and runs streams whose recorded events
/// complete when told ([`complete_work`](Self::complete_work)). Clones share one model.
#[derive(Clone, Debug)]
pub struct DriverModel {
    config: Arc<ModelConfig>,
    state: Arc<Mutex<ModelState>>,
    /// Signalled when work completes or the context is lost: `cuEventSynchronize` waits on it.
    done: Arc<Condvar>,
}

/// The codes after which, by facts 33–34, "any further CUDA work will return the same error"
/// (the documentation: the process must be terminated and relaunched; 710: the context cannot
/// be used anymore). Exactly these are sticky in the model; it keeps its own list, so that it
/// checks [`CuError::fate`] rather than agreeing with it by construction.
const STICKY: [i32; 13] = [
    700, 702, 714, 715, 716, 717, 718, 719, 911, 226, 721, // fact 33
    710, 810, // fact 34
];

/// Panics for a call the real driver would reject as misuse (see [`DriverModel`]).
fn misuse(call: DriverCall, what: impl std::fmt::Display) -> ! {
    panic!("DriverModel: illegal {call:?}: {what}")
}

impl DriverModel {
    /// A model with `config`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the setting if a granularity (plain or exportable) is not a
    /// power of two, or the device memory or the number of devices is zero.
    pub fn new(config: ModelConfig) -> Result<Self, ConfigError> {
        ConfigError::check_granularity(config.granularity)?;
        if let Some(exportable) = config.exportable_granularity {
            ConfigError::check_granularity(exportable)?;
        }
        ConfigError::check_positive("device memory", config.total_mem as u64)?;
        ConfigError::check_positive("devices", config.devices.max(0) as u64)?;
        let state = ModelState::new(&config);
        Ok(Self {
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
            done: Arc::new(Condvar::new()),
        })
    }

    /// The model's state, locked.
    fn state(&self) -> MutexGuard<'_, ModelState> {
        lock(&self.state)
    }

    /// The granularity of memory with `props` (fact 15: it depends on the properties), for
    /// `call`. Misuse: an unknown device, or GPUDirect RDMA asked of a device whose attribute
    /// 110 is 0 (fact 14). `CUDA_ERROR_INVALID_VALUE`: a handle type the model does not know
    /// (fact 14 lists the flags).
    fn granularity_for(&self, call: DriverCall, props: AllocationProps) -> CuResult<usize> {
        self.check_device(call, props.device);
        if props.gpu_direct_rdma && !self.config.rdma_with_vmm {
            misuse(
                call,
                format_args!(
                    "gpuDirectRDMACapable asked on device {}, whose attribute 110 \
                     (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) is 0",
                    props.device
                ),
            );
        }
        if props.handle_types & !(HANDLE_TYPE_POSIX_FD | HANDLE_TYPE_FABRIC) != 0 {
            return Err(CuError::INVALID_VALUE);
        }
        Ok(match self.config.exportable_granularity {
            Some(g) if props.handle_types != 0 => g,
            _ => self.config.granularity,
        })
    }

    /// Logs a call, fails it if planned or if the context is lost, and checks that a context is
    /// current for calls that need one.
    fn enter(&self, call: DriverCall, needs_ctx: bool) -> CuResult<MutexGuard<'_, ModelState>> {
        let mut s = self.state();
        if let Some(lost) = s.lost {
            s.calls_after_loss += 1;
            let into_ctx = needs_ctx
                || matches!(
                    call,
                    DriverCall::PrimaryCtxRetain
                        | DriverCall::PrimaryCtxRelease
                        | DriverCall::CtxSetCurrent
                );
            if lost.process_wide || into_ctx {
                return Err(lost.error);
            }
        }
        s.log.push(call);
        if let Some((on, left, stream, mode)) = s.begin_before.take_if(|b| b.0.contains(&call)) {
            if left > 1 {
                s.begin_before = Some((on, left - 1, stream, mode));
            } else if s.capture_of(stream).is_none() {
                s.open_capture(stream, mode);
            }
        }
        if let Some((on, left, stream)) = s.end_before.take_if(|b| b.0.contains(&call)) {
            if left > 1 {
                s.end_before = Some((on, left - 1, stream));
            } else if let Some(Ok(graph)) = s.end_elsewhere(stream) {
                s.hook_graph = Some(graph);
            }
        }
        if let Err(fault) = s.faults.enter(call) {
            // Facts 33–35: exactly the sticky codes stick.
            let e = fault.error;
            if STICKY.contains(&e.0) || e == CuError::DEINITIALIZED {
                s.lose(e, true);
            } else if e == CuError::CONTEXT_IS_DESTROYED {
                s.lose(e, false);
            }
            return Err(e);
        }
        if call != DriverCall::Init && !s.initialized {
            misuse(call, "cuInit was not called");
        }
        if needs_ctx && !(s.current && s.retains > 0) {
            misuse(call, "no current context");
        }
        Ok(s)
    }

    /// What a check of the record returned, or misuse.
    fn check<T>(call: DriverCall, r: Result<T, Violation>) -> T {
        r.unwrap_or_else(|v| misuse(call, v))
    }

    /// Misuse unless `device` is one of the model's.
    fn check_device(&self, call: DriverCall, device: i32) {
        if !(0..self.config.devices).contains(&device) {
            misuse(call, format_args!("unknown device {device}"));
        }
    }
}

impl Default for DriverModel {
    fn default() -> Self {
        Self::new(ModelConfig::default()).expect("the default settings are valid")
    }
}
