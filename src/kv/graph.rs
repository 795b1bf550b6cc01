//! Graphs over the KV cache: a memtoken [`Capture`] lends the planes' addresses to captured
//! work, and its graph borrows the cache — not its mappings.

use super::KvCache;
use crate::backend::cuda::{CudaBackend, Driver, Stream};
use crate::error::ViewError;
use crate::interop::{Capture, StreamView, StreamViewMut};
use bytemuck::Pod;
use std::marker::PhantomData;

/// The planes of a [`KvCache`] lent to a [`Capture`]: their device pointers, for the captured
/// kernels (block `b` of plane `p` at `device_ptr(p) + b × stride(p)`).
///
/// The graph borrows the cache (shared), not its mappings: while the graph lives the cache still
/// [`replenish`](KvCache::replenish)es — groups mapped and given back — and sleeps and wakes.
/// What stays true:
///
/// - a launch while the cache sleeps is refused
///   ([`Violation::Asleep`](crate::backend::Violation::Asleep)), and nothing is launched;
/// - every launch runs on the capture's stream, which the cache's fences cover from the
///   capture on: a group given back by `replenish` is unmapped only once the launches made
///   before its fence have completed, and sleep waits for them (`KvError::Pending`);
/// - **which block ids a launch reads is the launch's obligation**: the ids the captured
///   kernels read (a block table in device memory) must be blocks held by tables when the
///   graph launches. A stale id may read a group given back since — unmapped memory, which
///   faults and loses the context.
#[derive(Debug)]
pub struct KvPlanes<'c> {
    ptrs: Vec<u64>,
    _capture: PhantomData<&'c ()>,
}

impl KvPlanes<'_> {
    /// Plane `plane`'s device pointer (`CUdeviceptr`): its base address.
    ///
    /// # Panics
    ///
    /// If there is no such plane.
    pub fn device_ptr(&self, plane: usize) -> u64 {
        self.ptrs[plane]
    }

    /// The planes lent.
    pub fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// Whether no plane is lent (never: a cache has one at least).
    pub fn is_empty(&self) -> bool {
        self.ptrs.is_empty()
    }
}

impl<'t, 'id, D: Driver> Capture<'t, 'id, D> {
    /// `cache`'s planes for the captured work: the cache is borrowed by the capture and its
    /// graph (see [`KvPlanes`] for what the graph may then assume).
    pub fn kv_planes<'c>(
        &'c self,
        cache: &'t KvCache<'_, '_, 'id, CudaBackend<D>>,
    ) -> KvPlanes<'c> {
        let ptrs = cache
            .bases
            .iter()
            .enumerate()
            .map(|(p, &base)| {
                let len = cache.stride(p) * cache.blocks();
                self.lend_unheld(base, len, cache.awake.clone());
                base as u64
            })
            .collect();
        KvPlanes {
            ptrs,
            _capture: PhantomData,
        }
    }
}

impl<D: Driver> KvCache<'_, '_, '_, CudaBackend<D>> {
    /// Plane `plane` as elements of `T`, for the kernels of a step on the raw `stream` (known to
    /// the device or covered): the pointer rule of every stream view. Taking the pointer orders
    /// the work after the plane's earlier uses on other streams, and the cache's fences cover
    /// `stream` from then on; **if a capture memtoken did not make is open on `stream`** when the
    /// pointer is taken or the view drops, the plane may be in a graph memtoken does not know of:
    /// it is held for good — the backend refuses to unmap any of it again (a give-back or a
    /// sleep leaves its part of each group mapped, and `wake` maps the other planes' parts back;
    /// such a group is pinned, its failure to go reported once).
    /// Engines that capture their decode step should
    /// capture through memtoken's [`Capture`] ([`Capture::kv_planes`]), whose graph borrows the
    /// cache instead. The raw [`base`](KvCache::base) is neither ordered nor probed: used in a
    /// foreign capture, keeping the plane mapped is the launch's obligation.
    ///
    /// Which blocks the kernels read and write is their obligation: blocks the tables hold.
    ///
    /// # Errors
    ///
    /// As for [`Allocation::stream_view`](crate::Allocation::stream_view).
    ///
    /// # Panics
    ///
    /// If there is no such plane.
    pub fn plane_view<T: Pod>(
        &self,
        plane: usize,
        stream: Stream,
    ) -> Result<StreamViewMut<'_, T, D>, ViewError> {
        let backend = self.binding.device().backend().raw();
        let len = self.stride(plane) * self.blocks();
        StreamView::lend(backend, self.base(plane), len, stream, false).map(StreamViewMut::new)
    }
}
