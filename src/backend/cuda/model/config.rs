//! The driver model's settings: [`ModelConfig`], and where reservations land ([`Placement`]);
//! a stream capture's mode ([`CaptureMode`]) is the driver seam's.

#[cfg(doc)]
use super::DriverModel;

/// Where the model places a reservation. A non-zero address passed to `cuMemAddressReserve` is
/// only a hint, and the driver documents no placement (fact 12): the model ignores hints, and
/// the backend must work wherever a reservation lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The lowest gap above the model's base: addresses rise, and a freed gap is filled first.
    LowestFirst,
    /// The highest gap below the top of the model's window: addresses fall.
    TopDown,
    /// Pseudo-random aligned places in the model's window, drawn from `seed` (the highest gap
    /// when a few draws all collide).
    Scattered {
        /// The same seed gives the same places for the same calls.
        seed: u64,
    },
}

pub use crate::backend::cuda::driver::CaptureMode;

/// Settings of a [`DriverModel`].
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// Recommended allocation granularity of pinned memory that is not exportable: a power of
    /// two. Default: 2 MiB.
    pub granularity: usize,
    /// Recommended granularity of exportable memory (`requestedHandleTypes` not 0): a power
    /// of two, or `None` for the same as [`granularity`](Self::granularity) (the default).
    /// Granularity depends on the allocation properties (fact 15): the model answers
    /// `cuMemGetAllocationGranularity` by them, and refuses a `cuMemCreate` or `cuMemMap`
    /// that does not fit the granularity of the memory's own properties.
    pub exportable_granularity: Option<usize>,
    /// The device attribute `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`
    /// (110) of every device: whether memory may be created GPUDirect-RDMA-capable
    /// (`allocFlags.gpuDirectRDMACapable`, which "needs attribute 110": fact 14). Default:
    /// true, as on the data-centre GPUs memtoken serves.
    pub rdma_with_vmm: bool,
    /// The device attribute `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (102) of
    /// every device: whether the VMM calls work at all (fact 14: `cuMemCreate` needs it).
    /// Without it, a VMM call is misuse: the backend asks the attribute when it opens and
    /// refuses such a device. Default: true.
    pub vmm: bool,
    /// Device memory: not zero. Default: 16 GiB (modelled: bytes are kept only where written).
    pub total_mem: usize,
    /// Whether recorded events complete at once. Default: true.
    pub events_complete_at_once: bool,
    /// Whether `cuEventSynchronize` and `cuStreamSynchronize` block the calling thread until
    /// another thread completes the work (`complete_work`, `complete_work_on`), as a real wait
    /// does. Default: false — the wait returns with the work complete, as if the GPU finished
    /// it meanwhile (so a test that never completes its work does not hang).
    pub synchronize_blocks: bool,
    /// Where reservations land (fact 12). Default: [`Placement::Scattered`], so that nothing
    /// comes to depend on where the driver places a reservation.
    pub placement: Placement,
    /// Devices: ordinals `0..devices`, not zero. Default: 2, peers of each other (as two GPUs
    /// of one NVLink pair).
    /// Only device 0 has a (primary) context in the model; the others can own memory
    /// (`cuMemCreate`) and be granted access (`cuMemSetAccess`), which
    /// [`DriverModel::access_of`] reads back per device.
    pub devices: i32,
    /// The pairs `(dev, peer)` for which `cuDeviceCanAccessPeer(dev, peer)` says 1: `dev` can
    /// access memory on `peer` (fact 32). Default: `(0, 1)` and `(1, 0)`.
    pub peer_access: Vec<(i32, i32)>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            granularity: 2 << 20,
            exportable_granularity: None,
            rdma_with_vmm: true,
            vmm: true,
            total_mem: 16 << 30,
            events_complete_at_once: true,
            synchronize_blocks: false,
            placement: Placement::Scattered { seed: 0x5eed },
            devices: 2,
            peer_access: vec![(0, 1), (1, 0)],
        }
    }
}
