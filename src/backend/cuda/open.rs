//! Opening and closing: the backend on a device's primary context (or on a cudarc context),
//! what it reads from the driver when opened, its peers, the context retains it holds, and
//! what it gives back when dropped.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::CudaBackend;
#[cfg(feature = "cuda")]
use super::Kept;
use super::driver::{
    AllocationProps, Context, CuError, DeviceAttribute, Driver, DriverCall, Event,
    HANDLE_TYPE_POSIX_FD,
};
use super::record::CudaState;
#[cfg(feature = "cuda")]
use super::sys::SysDriver;
use crate::backend::{Backend, BackendError, Op, Violation, lock};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Why a CUDA backend could not be opened.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library could be loaded on this machine.
    #[error("no CUDA driver found (libcuda could not be loaded): {0}")]
    NoDriver(String),
    /// A driver call failed while opening the device.
    #[error("opening the CUDA device failed: {call:?} returned {error}")]
    Driver {
        /// The call that failed.
        call: DriverCall,
        /// What it returned.
        error: CuError,
    },
    /// A peer given to [`CudaBackend::with_peers`] cannot access the device's memory:
    /// `cuDeviceCanAccessPeer(peer, device)` said 0.
    #[error(
        "device {peer} cannot access memory on device {device}: \
         cuDeviceCanAccessPeer({peer}, {device}) said 0"
    )]
    NoPeerAccess {
        /// The backend's device.
        device: i32,
        /// The peer that cannot access it.
        peer: i32,
    },
    /// A peer list given to [`CudaBackend::with_peers`] names the backend's own device or a
    /// device twice, or comes after memory was mapped.
    #[error("bad peer list: {0}")]
    BadPeers(String),
    /// The device does not support virtual memory management
    /// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` is 0: support varies by device,
    /// driver and virtualization), which every call of this backend needs. Nothing was made.
    #[error(
        "device {device} does not support virtual memory management \
         (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0), which memtoken's CUDA \
         backend needs: choose another mechanism (see memtoken::mechanism), such as the host \
         backend"
    )]
    NoVmm {
        /// The device.
        device: i32,
    },
}

/// The mechanism a [`CudaBackend`] runs: chosen when it is opened, for its whole life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaMechanism {
    /// Virtual memory management (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, ...):
    /// everything memtoken offers.
    Vmm,
    /// Plain allocation (`cuMemAlloc`, `cuMemFree`; fact 59), for a device without virtual
    /// memory management: a commit allocates, a release frees, with the same tokens, fences
    /// and views. A reservation is a claim on a length only (its address a placeholder): the
    /// committed token's address is where the driver put the memory. Growing a region in
    /// place, sharing a prefix (and so export), suspend and read-only maps are refused with
    /// [`Cause::Unsupported`](crate::backend::Cause::Unsupported) naming the capability
    /// ([`Device::lacks`](crate::Device::lacks) says so up front); peers are refused when the
    /// backend is made ([`with_peers`](CudaBackend::with_peers): [`CudaError::BadPeers`]).
    Plain,
}

/// Which mechanism to open a backend with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Vmm,
    Plain,
    /// VMM where the device has it (attribute 102), plain where not.
    Auto,
}

/// What opening reads from the driver (see [`CudaBackend::new`]).
struct Opened {
    plain: bool,
    vmm_supported: bool,
    granularity: usize,
    props: AllocationProps,
    exportable_granularity: Result<usize, CuError>,
    capacity: u64,
}

impl<D: Driver> CudaBackend<D> {
    /// Opens device `ordinal` through `driver`: initializes the driver, retains the device's
    /// primary context (released on drop), checks that the device supports virtual memory
    /// management (attribute 102), reads whether memory can be made
    /// GPUDirect-RDMA-capable (attribute 110), and reads the recommended granularity for the
    /// properties of plain and of exportable memory (see
    /// [`exportable_granularity`](Self::exportable_granularity)).
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] with the call that failed; [`CudaError::NoVmm`] for a device
    /// without virtual memory management.
    pub fn new(driver: D, ordinal: i32) -> Result<Self, CudaError> {
        Self::open_with(driver, ordinal, Want::Vmm)
    }

    /// Opens device `ordinal` through `driver` on the plain mechanism
    /// ([`CudaMechanism::Plain`]: `cuMemAlloc`, `cuMemFree`), whether or not the device has
    /// virtual memory management. Makes no VMM call.
    ///
    /// ```
    /// use memtoken::backend::cuda::{CudaBackend, CudaMechanism};
    /// use memtoken::backend::doubles::{DriverModel, ModelConfig};
    /// // A device without virtual memory management (attribute 102 is 0).
    /// let model = DriverModel::new(ModelConfig { vmm: false, ..ModelConfig::default() })?;
    /// let backend = CudaBackend::new_plain(model, 0)?;
    /// assert_eq!(backend.mechanism(), CudaMechanism::Plain);
    /// assert!(!backend.vmm_supported());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] with the call that failed.
    pub fn new_plain(driver: D, ordinal: i32) -> Result<Self, CudaError> {
        Self::open_with(driver, ordinal, Want::Plain)
    }

    /// Opens device `ordinal` through `driver` on the best mechanism it has: VMM where the
    /// device supports it (attribute 102 is 1), else the plain one
    /// ([`mechanism`](Self::mechanism) says which, [`vmm_supported`](Self::vmm_supported)
    /// why).
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] with the call that failed.
    pub fn new_auto(driver: D, ordinal: i32) -> Result<Self, CudaError> {
        Self::open_with(driver, ordinal, Want::Auto)
    }

    fn open_with(driver: D, ordinal: i32, want: Want) -> Result<Self, CudaError> {
        let at = |call| move |error| CudaError::Driver { call, error };
        driver.init().map_err(at(DriverCall::Init))?;
        let device = driver
            .device_get(ordinal)
            .map_err(at(DriverCall::DeviceGet))?;
        let ctx = driver
            .primary_ctx_retain(device)
            .map_err(at(DriverCall::PrimaryCtxRetain))?;
        // SAFETY: `ctx` was retained just above from this driver; the backend gives that
        // retain back when it drops (`owns_retain`), and not before.
        unsafe { Self::open_on(driver, device, ctx, true, want) }
    }

    /// Opens the backend on context `ctx` of `device`.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context of `device` from `driver`, and stays live until the backend is
    /// dropped: retained by the caller and given back by the backend when `owns_retain`, or
    /// kept alive by its owner otherwise.
    unsafe fn open_on(
        driver: D,
        device: i32,
        ctx: Context,
        owns_retain: bool,
        want: Want,
    ) -> Result<Self, CudaError> {
        // SAFETY: the caller promises `ctx` a live context of `device` from `driver`.
        let opened = unsafe { Self::read_device(&driver, device, ctx, want) };
        let Opened {
            plain,
            vmm_supported,
            granularity,
            props,
            exportable_granularity,
            capacity,
        } = match opened {
            Ok(v) => v,
            Err(e) => {
                // No call into a context a sticky error took down.
                let lost = matches!(e, CudaError::Driver { error, .. } if error.is_context_loss());
                if owns_retain && !lost {
                    // SAFETY: gives back the retain the caller handed over, once.
                    let _ = unsafe { driver.primary_ctx_release(device) };
                }
                return Err(e);
            }
        };
        Ok(Self {
            driver,
            device,
            ctx,
            granularity,
            props,
            exportable_granularity,
            capacity,
            plain,
            vmm_supported,
            peers: Vec::new(),
            grant_rw: vec![(device, true)],
            grant_ro: vec![(device, false)],
            owns_retain,
            #[cfg(feature = "cuda")]
            kept: Mutex::new(Kept::default()),
            lost: AtomicBool::new(false),
            peer_work: std::sync::atomic::AtomicUsize::new(0),
            state: Mutex::new(CudaState::new(granularity)),
        })
    }

    /// Makes `ctx` current and reads what opening needs: whether memory can be made
    /// RDMA-capable, the granularity of plain and of exportable memory, and the device memory.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context of `device` from `driver`.
    unsafe fn read_device(
        driver: &D,
        device: i32,
        ctx: Context,
        want: Want,
    ) -> Result<Opened, CudaError> {
        let at = |call| move |error| CudaError::Driver { call, error };
        // SAFETY: the caller promises `ctx` live.
        unsafe { driver.ctx_set_current(ctx) }.map_err(at(DriverCall::CtxSetCurrent))?;
        // Fact 14: `cuMemCreate` needs attribute 102 (VMM supported); asked first, once: a
        // device without it is refused before any VMM call.
        let vmm = driver
            .device_get_attribute(DeviceAttribute::VirtualMemoryManagementSupported, device)
            .map_err(at(DriverCall::DeviceGetAttribute))?;
        let vmm_supported = vmm == 1;
        let plain = match want {
            Want::Vmm if !vmm_supported => return Err(CudaError::NoVmm { device }),
            Want::Vmm => false,
            Want::Plain => true,
            Want::Auto => !vmm_supported,
        };
        if plain {
            // No VMM call at all (`cuMemGetAllocationGranularity` is one).
            let capacity = driver
                .device_total_mem(device)
                .map_err(at(DriverCall::DeviceTotalMem))?;
            return Ok(Opened {
                plain,
                vmm_supported,
                granularity: super::plain::PLAIN_GRANULARITY,
                props: AllocationProps::pinned(device),
                exportable_granularity: Err(CuError::NOT_SUPPORTED),
                capacity: capacity as u64,
            });
        }
        // Fact 14: `gpuDirectRDMACapable` needs attribute 110; asked once, here.
        let rdma = driver
            .device_get_attribute(DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported, device)
            .map_err(at(DriverCall::DeviceGetAttribute))?;
        let props = AllocationProps::pinned(device).with_gpu_direct_rdma(rdma == 1);
        // Fact 15: granularity depends on the properties, so each kind of memory has its
        // own query, made with the properties it is created with.
        let granularity = driver
            .mem_get_allocation_granularity(props)
            .map_err(at(DriverCall::MemGetAllocationGranularity))?;
        let exportable = props.with_handle_types(HANDLE_TYPE_POSIX_FD);
        let exportable_granularity = match driver.mem_get_allocation_granularity(exportable) {
            Err(e) if e.is_context_loss() => {
                return Err(at(DriverCall::MemGetAllocationGranularity)(e));
            }
            // Plain memory still works: only exportable memory is refused, with this.
            answer => answer,
        };
        let capacity = driver
            .device_total_mem(device)
            .map_err(at(DriverCall::DeviceTotalMem))?;
        Ok(Opened {
            plain,
            vmm_supported,
            granularity,
            props,
            exportable_granularity,
            capacity: capacity as u64,
        })
    }

    /// The mechanism this backend runs, chosen when it was opened.
    pub fn mechanism(&self) -> CudaMechanism {
        if self.plain {
            CudaMechanism::Plain
        } else {
            CudaMechanism::Vmm
        }
    }

    /// Whether the device supports virtual memory management (attribute 102), as read when
    /// the backend was opened: why [`new_auto`](Self::new_auto) chose its mechanism.
    pub fn vmm_supported(&self) -> bool {
        self.vmm_supported
    }

    /// The device ordinal's `CUdevice`.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Whether the memory this backend creates is GPUDirect-RDMA-capable
    /// (`allocFlags.gpuDirectRDMACapable`), so that a NIC can register it: true where the
    /// device's attribute `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED` (110),
    /// read when the backend was opened, is 1 (fact 14). Every `cuMemCreate`, plain and
    /// exportable, asks it then, and none otherwise.
    pub fn gpu_direct_rdma(&self) -> bool {
        self.props.gpu_direct_rdma
    }

    /// The properties every plain `cuMemCreate` of this backend is made with, and the
    /// [`granularity`](Backend::granularity) was asked with: pinned memory on its device,
    /// [RDMA-capable](Self::gpu_direct_rdma) where the device can. Exportable memory adds a
    /// POSIX descriptor to `handle_types`.
    pub fn allocation_props(&self) -> AllocationProps {
        self.props
    }

    /// The recommended granularity of exportable memory's properties
    /// ([`allocation_props`](Self::allocation_props) with a POSIX descriptor requested), read
    /// when the backend was opened: granularity depends on the properties (fact 15), and every
    /// allocation is sized by the device's one [`granularity`](Backend::granularity). Where
    /// the device's granularity is not a multiple of this one, exportable memory would not fit
    /// it, so creating or importing it is refused ([`Violation::Unaligned`], naming both);
    /// plain memory is not affected.
    ///
    /// # Errors
    ///
    /// What the driver returned for the query (then exportable memory is refused with it).
    pub fn exportable_granularity(&self) -> Result<usize, CuError> {
        self.exportable_granularity
    }

    /// Gives the devices `peers` (ordinals) access to every mapping this backend makes, along
    /// with its own device: each map's one `cuMemSetAccess` names them all (fact 18), with the
    /// mapping's access, so every remap — a region's regrown granule, a copy-on-write boundary,
    /// memory woken at the same address — gives each peer its access back. Each peer is
    /// checked first with `cuDeviceCanAccessPeer(peer, device)` (fact 32), and is never dropped
    /// silently: a peer that cannot access is an error.
    ///
    /// **Peer work is not fenced.** A fence records events in this device's context only: a
    /// peer's kernel, or a collective, using this memory is not waited for by a release. Declare
    /// such work with [`peer_work`](Self::peer_work): while a declaration lives, every release
    /// waits (its fence is not done), and the device's drop, which cannot wait for a peer,
    /// leaves what still waits and reports it.
    ///
    /// ```
    /// use memtoken::backend::{cuda::CudaBackend, doubles::{DriverModel, ModelConfig}};
    /// let model = DriverModel::new(ModelConfig {
    ///     devices: 2,
    ///     peer_access: vec![(1, 0)],
    ///     ..ModelConfig::default()
    /// })
    /// .unwrap();
    /// let backend = CudaBackend::new(model, 0).unwrap().with_peers(&[1]).unwrap();
    /// assert_eq!(backend.peers(), &[1]);
    /// ```
    ///
    /// # Errors
    ///
    /// [`CudaError::NoPeerAccess`] for a peer that cannot access this device's memory;
    /// [`CudaError::BadPeers`] if `peers` names this device or a device twice, or if the
    /// backend has mapped memory already (it would lack the peers' access);
    /// [`CudaError::Driver`] if `cuDeviceGet` or `cuDeviceCanAccessPeer` fails. The backend is
    /// dropped then.
    pub fn with_peers(mut self, peers: &[i32]) -> Result<Self, CudaError> {
        if self.plain && !peers.is_empty() {
            let why = format!("{}: it cannot give peers access", super::plain::PLAIN);
            return Err(CudaError::BadPeers(why));
        }
        if lock(&self.state).book.mappings() > 0 {
            let why = "peers must be set before anything is mapped".to_string();
            return Err(CudaError::BadPeers(why));
        }
        let mut devices = Vec::with_capacity(peers.len());
        let lost = &self.lost;
        let at = |call| {
            move |error: CuError| {
                if error.is_context_loss() {
                    lost.store(true, Ordering::Release); // no call into it on drop
                }
                CudaError::Driver { call, error }
            }
        };
        for &ordinal in peers {
            let peer = self
                .driver
                .device_get(ordinal)
                .map_err(at(DriverCall::DeviceGet))?;
            if peer == self.device {
                let why = format!("device {ordinal} is the backend's own device");
                return Err(CudaError::BadPeers(why));
            }
            if devices.contains(&peer) {
                return Err(CudaError::BadPeers(format!(
                    "device {ordinal} is named twice"
                )));
            }
            let can = self
                .driver
                .device_can_access_peer(peer, self.device)
                .map_err(at(DriverCall::DeviceCanAccessPeer))?;
            if !can {
                let device = self.device;
                return Err(CudaError::NoPeerAccess { device, peer });
            }
            devices.push(peer);
        }
        let grants = |rw| {
            let peers = devices.iter().map(move |&peer| (peer, rw));
            std::iter::once((self.device, rw)).chain(peers).collect()
        };
        (self.grant_rw, self.grant_ro) = (grants(true), grants(false));
        self.peers = devices;
        Ok(self)
    }

    /// The peer devices (`CUdevice`s) given access to every mapping along with this device
    /// (see [`with_peers`](Self::with_peers)); empty unless set.
    pub fn peers(&self) -> &[i32] {
        &self.peers
    }

    /// Takes a retain of the primary context, counted, for
    /// [`Backend::pin`](crate::backend::Backend::pin).
    pub(super) fn retain_pin(&self) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Pin, 0, 0)?;
        self.driver
            .primary_ctx_retain(self.device)
            .map_err(|e| self.fail(Op::Pin, 0, 0, e))?;
        s.pins += 1;
        Ok(())
    }

    /// Gives back a retain [`retain_pin`](Self::retain_pin) took, for
    /// [`Backend::unpin`](crate::backend::Backend::unpin).
    pub(super) fn release_pin(&self) -> Result<(), BackendError> {
        let mut s = self.enter(Op::Unpin, 0, 0)?;
        if s.pins == 0 {
            return Err(BackendError::refused(Op::Unpin, 0, 0, Violation::NotPinned));
        }
        // SAFETY: `s.pins` above proved a retain taken by `pin` not yet given back; this gives
        // back that one (the retain taken when opening is not counted in it).
        unsafe { self.driver.primary_ctx_release(self.device) }
            .map_err(|e| self.fail(Op::Unpin, 0, 0, e))?;
        s.pins -= 1;
        Ok(())
    }
}

/// Opens device `ordinal`'s primary context through cudarc ([`memtoken::cudarc`](crate::cudarc)),
/// without panicking where there is no driver (cudarc's `CudaContext::new` panics when it
/// cannot load `libcuda`): the way to learn whether this machine has a usable GPU.
///
/// # Errors
///
/// [`CudaError::NoDriver`] when no CUDA driver is installed (checked before any call),
/// [`CudaError::Driver`] when the driver refuses the device.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub fn open_context(
    ordinal: i32,
) -> Result<std::sync::Arc<cudarc::driver::CudaContext>, CudaError> {
    SysDriver::load()?;
    let ordinal_usize = usize::try_from(ordinal).map_err(|_| CudaError::Driver {
        call: DriverCall::DeviceGet,
        error: CuError::INVALID_DEVICE,
    })?;
    cudarc::driver::CudaContext::new(ordinal_usize).map_err(|e| CudaError::Driver {
        call: DriverCall::DeviceGet,
        error: CuError(e.0 as i32),
    })
}

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
impl CudaBackend<SysDriver> {
    /// Opens device `ordinal` through the real driver, loaded at run time.
    ///
    /// # Errors
    ///
    /// [`CudaError::NoDriver`] when no CUDA driver is installed (checked before any call, so
    /// this never panics), [`CudaError::Driver`] when a call fails.
    pub fn open(ordinal: i32) -> Result<Self, CudaError> {
        Self::new(SysDriver::load()?, ordinal)
    }

    /// Opens device `ordinal` through the real driver on the best mechanism it has: see
    /// [`new_auto`](Self::new_auto).
    ///
    /// # Errors
    ///
    /// As for [`open`](Self::open), without [`CudaError::NoVmm`].
    pub fn open_auto(ordinal: i32) -> Result<Self, CudaError> {
        Self::new_auto(SysDriver::load()?, ordinal)
    }

    /// Opens device `ordinal` through the real driver on the plain mechanism: see
    /// [`new_plain`](Self::new_plain).
    ///
    /// # Errors
    ///
    /// As for [`open`](Self::open), without [`CudaError::NoVmm`].
    pub fn open_plain(ordinal: i32) -> Result<Self, CudaError> {
        Self::new_plain(SysDriver::load()?, ordinal)
    }

    /// Opens the backend on the context of a cudarc `CudaContext` the caller already uses,
    /// sharing it instead of retaining the context behind cudarc's back: the backend keeps the
    /// `Arc` (so the context lives as long as the backend) and makes that context current for
    /// its calls.
    ///
    /// # Errors
    ///
    /// [`CudaError::Driver`] when a call fails while opening.
    pub fn from_context(
        context: std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<Self, CudaError> {
        let driver = SysDriver::load()?;
        let (device, ctx) = (context.cu_device(), context.cu_ctx() as Context);
        // SAFETY: `ctx` is the live context of `context`, which the backend keeps (below) until
        // it is dropped; the backend takes no retain of its own (`owns_retain` false).
        let backend = unsafe { Self::open_on(driver, device, ctx, false, Want::Vmm) }?;
        lock(&backend.kept).context = Some(context);
        Ok(backend)
    }
}

impl<D: Driver> Drop for CudaBackend<D> {
    fn drop(&mut self) {
        // Copies whose wait failed and that no later fence settled: one more wait for the
        // legacy stream, where they ran, settles them (their scratch ranges go below). If it
        // fails too (or a blocking stream captures), their scratch ranges stay mapped: never
        // taken down under a copy that may still run.
        if !self.context_lost() && !lock(&self.state).unsettled.is_empty() {
            let _ = self.wait_legacy();
        }
        if let Ok(mut s) = self.enter(Op::Free, 0, 0) {
            // VMM calls: never barred by a capture (fact 40); none once the context is lost.
            // The last chance: a failed exchange is tried once more.
            let relaxed = self.relaxed().or_else(|_| self.relaxed());
            // Each step stops at a sticky error: nothing more may be called then.
            let swept = relaxed.as_ref().map_err(|&e| e).and_then(|_| {
                self.unmap_inaccessible(&mut s, 0, u64::MAX)
                    .and_then(|()| self.sweep_scratch(&mut s))
            });
            if let Err(e) = swept {
                let _ = self.fail(Op::Free, 0, 0, e);
            }
            drop(relaxed);
            self.destroy_dead_execs(&mut s);
            let events: Vec<Event> = s.events.drain().map(|(_, event)| event).collect();
            for event in events {
                if self.context_lost() {
                    break;
                }
                // SAFETY: `s.events` held exactly the events this driver created for this
                // backend and that are not destroyed; draining it destroys each once.
                if let Err(e) = unsafe { self.driver.event_destroy(event) } {
                    let _ = self.fail(Op::Fence, 0, 0, e);
                }
            }
        }
        if self.owns_retain && !self.context_lost() {
            // SAFETY: gives back the retain `new` took, once: `drop` runs once, and `unpin`
            // gives back only the retains `pin` took.
            let _ = unsafe { self.driver.primary_ctx_release(self.device) };
        }
    }
}
