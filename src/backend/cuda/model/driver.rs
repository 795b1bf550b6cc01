//! The driver model's [`Driver`] implementation: each call logged, failed where planned or
//! after a loss, checked against the rules (misuse panics), and applied to the model's state.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

#[cfg(doc)]
use super::ModelConfig;
use super::state::ModelState;
use super::{DriverModel, misuse};
use crate::backend::cuda::driver::{
    AllocationProps, CaptureInfo, CaptureMode, Context, CuError, CuResult, DeviceAttribute, Driver,
    DriverCall, Event, Graph, GraphExec, ShareableHandle, Stream,
};
use crate::backend::{Access, Addr};

/// The model's only context (device 0's primary context).
const CTX: Context = 0xc0de;

// The `unsafe fn`s need no `unsafe` here: the model checks every value it is given and panics on
// one the real driver would not survive.
impl Driver for DriverModel {
    fn init(&self) -> CuResult<()> {
        self.enter(DriverCall::Init, false)?.initialized = true;
        Ok(())
    }

    fn device_get(&self, ordinal: i32) -> CuResult<i32> {
        let _s = self.enter(DriverCall::DeviceGet, false)?;
        if (0..self.config.devices).contains(&ordinal) {
            Ok(ordinal)
        } else {
            Err(CuError::INVALID_DEVICE)
        }
    }

    /// Attribute 110 is [`ModelConfig::rdma_with_vmm`] and 102 [`ModelConfig::vmm`] for every
    /// device (fact 14); an unknown device is `CUDA_ERROR_INVALID_DEVICE`, as for `cuDeviceGet`.
    fn device_get_attribute(&self, attribute: DeviceAttribute, device: i32) -> CuResult<i32> {
        let _s = self.enter(DriverCall::DeviceGetAttribute, false)?;
        if !(0..self.config.devices).contains(&device) {
            return Err(CuError::INVALID_DEVICE);
        }
        match attribute {
            DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported => {
                Ok(i32::from(self.config.rdma_with_vmm))
            }
            DeviceAttribute::VirtualMemoryManagementSupported => Ok(i32::from(self.config.vmm)),
        }
    }

    fn device_total_mem(&self, device: i32) -> CuResult<usize> {
        let _s = self.enter(DriverCall::DeviceTotalMem, false)?;
        self.check_device(DriverCall::DeviceTotalMem, device);
        Ok(self.config.total_mem)
    }

    /// Fact 32: says what [`ModelConfig::peer_access`] lists, and remembers that it was asked;
    /// a device and itself are not peers (0).
    fn device_can_access_peer(&self, dev: i32, peer: i32) -> CuResult<bool> {
        let call = DriverCall::DeviceCanAccessPeer;
        let mut s = self.enter(call, false)?;
        let devices = 0..self.config.devices;
        if !devices.contains(&dev) || !devices.contains(&peer) {
            return Err(CuError::INVALID_DEVICE);
        }
        let can = dev != peer && self.config.peer_access.contains(&(dev, peer));
        s.peers_asked.insert((dev, peer), can);
        Ok(can)
    }

    fn primary_ctx_retain(&self, device: i32) -> CuResult<Context> {
        let mut s = self.enter(DriverCall::PrimaryCtxRetain, false)?;
        if device != 0 {
            misuse(
                DriverCall::PrimaryCtxRetain,
                "only device 0 has a context in the model",
            );
        }
        s.retains += 1;
        Ok(CTX)
    }

    unsafe fn primary_ctx_release(&self, _device: i32) -> CuResult<()> {
        let mut s = self.enter(DriverCall::PrimaryCtxRelease, false)?;
        if s.retains == 0 {
            misuse(
                DriverCall::PrimaryCtxRelease,
                "released more often than retained",
            );
        }
        s.retains -= 1;
        if s.retains == 0 {
            s.current = false;
        }
        Ok(())
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> CuResult<()> {
        let mut s = self.enter(DriverCall::CtxSetCurrent, false)?;
        if ctx != CTX || s.retains == 0 {
            misuse(DriverCall::CtxSetCurrent, "not a live context");
        }
        s.current = true;
        Ok(())
    }

    /// Fact 15: by the properties ([`ModelConfig::exportable_granularity`] for exportable
    /// ones); fact 14: RDMA-capable properties on a device without attribute 110 are misuse.
    fn mem_get_allocation_granularity(&self, props: AllocationProps) -> CuResult<usize> {
        let call = DriverCall::MemGetAllocationGranularity;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        s.props_log.push((call, props));
        self.granularity_for(call, props)
    }

    /// Fact 12: the hint is ignored; the reservation lands where
    /// [`ModelConfig::placement`] puts it. Fact 43: refused during a global capture.
    fn mem_address_reserve(&self, size: usize, alignment: usize, hint: u64) -> CuResult<u64> {
        let call = DriverCall::MemAddressReserve;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        Self::check(call, s.book.check_reserve(size));
        let g = self.config.granularity;
        if !alignment.is_multiple_of(g) {
            misuse(call, "alignment is not a multiple of the granularity");
        }
        if !(hint as Addr).is_multiple_of(g) {
            misuse(
                call,
                "the address hint is not a multiple of the granularity",
            );
        }
        s.refused_by_capture()?;
        let Some(addr) = s.place(self.config.placement, size, alignment.max(g)) else {
            return Err(CuError::OUT_OF_MEMORY);
        };
        s.book.apply_reserve(addr, size);
        s.placed.insert(addr, size);
        Ok(addr as u64)
    }

    unsafe fn mem_address_free(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemAddressFree;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        Self::check_not_plain(&s, call, ptr as Addr, size);
        Self::check(call, s.book.check_free(ptr as Addr, size));
        s.refused_by_capture()?;
        s.book.apply_free(ptr as Addr);
        s.placed.remove(&(ptr as Addr));
        s.granted_in.remove(&(ptr as Addr));
        Ok(())
    }

    /// `cuMemCreate` with `props`. Fact 14: RDMA-capable only where attribute 110 is 1, a
    /// size that is a multiple of the granularity of `props` (fact 15), else misuse.
    fn mem_create_with(&self, size: usize, props: AllocationProps) -> CuResult<u64> {
        let call = DriverCall::MemCreate;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        s.props_log.push((call, props));
        Self::check(call, s.book.check_create(size));
        let granule = self.granularity_for(call, props)?;
        if !size.is_multiple_of(granule) {
            misuse(
                call,
                format_args!(
                    "size {size:#x} is not a multiple of the granularity {granule:#x} of its \
                     properties {props:?}"
                ),
            );
        }
        s.refused_by_capture()?;
        let allocation = s.new_allocation(size, self.config.total_mem)?;
        let handle = s.new_handle();
        s.handles.insert(handle, allocation);
        s.owners.insert(allocation, props.device);
        s.granules.insert(allocation, granule);
        if props.handle_types != 0 {
            s.handle_types.insert(allocation, props.handle_types);
        }
        s.book.apply_create(allocation, size);
        Ok(handle)
    }

    unsafe fn mem_export_to_shareable_handle(
        &self,
        handle: u64,
        handle_type: u32,
    ) -> CuResult<ShareableHandle> {
        let call = DriverCall::MemExportToShareableHandle;
        let mut s = self.enter(call, true)?;
        s.export(call, handle, handle_type)
    }

    fn mem_import_from_shareable_handle(&self, shareable: u64, handle_type: u32) -> CuResult<u64> {
        let call = DriverCall::MemImportFromShareableHandle;
        let mut s = self.enter(call, true)?;
        s.import(shareable, handle_type)
    }

    /// Fact 59: with or without attribute 102; the memory lands where
    /// [`ModelConfig::placement`] puts it, mapped read-write for the context (device 0), with
    /// no handle. Refused during a global capture (fact 42), as `cudaMalloc` is.
    fn mem_alloc(&self, size: usize) -> CuResult<u64> {
        let call = DriverCall::MemAlloc;
        let mut s = self.enter(call, true)?;
        if size == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        s.refused_by_capture()?;
        let g = self.config.granularity;
        let Some(addr) = s.place(self.config.placement, size.next_multiple_of(g), g) else {
            return Err(CuError::OUT_OF_MEMORY);
        };
        let allocation = s.new_allocation(size, self.config.total_mem)?;
        s.owners.insert(allocation, 0);
        s.book.apply_reserve(addr, size);
        s.placed.insert(addr, size);
        s.book.apply_create(allocation, size);
        s.book.apply_map(addr, size, allocation, Access::ReadWrite);
        let epoch = s.epoch;
        s.access_epoch.insert(addr, (size, epoch));
        s.grants.entry(addr).or_default().insert(0, true);
        s.plain.insert(addr, (allocation, size));
        Ok(addr as u64)
    }

    /// Fact 59: exactly a live `cuMemAlloc` start, else misuse. Does not wait: work that may
    /// still touch the memory faults when it completes (as after an unmap, fact 21). Refused
    /// during a global capture, and, as a use of the legacy stream, while a blocking stream
    /// captures (invalidating that capture).
    unsafe fn mem_free(&self, ptr: u64) -> CuResult<()> {
        let call = DriverCall::MemFree;
        let mut s = self.enter(call, true)?;
        let addr = ptr as Addr;
        let Some(&(allocation, size)) = s.plain.get(&addr) else {
            misuse(call, "not the start of a live cuMemAlloc allocation");
        };
        s.refused_by_capture()?;
        // The strict reading of fact 59: it may synchronize, as a use of the legacy stream.
        s.legacy_refused()?;
        s.plain.remove(&addr);
        let end = addr + size;
        s.book.apply_release(allocation);
        for (gone, len) in s.book.handles_in(addr, size) {
            s.gone(gone, len);
        }
        s.book.apply_unmap(addr, size);
        s.access_epoch.remove(&addr);
        s.grants.remove(&addr);
        s.unmap_under_work(addr, end);
        s.book.apply_free(addr);
        s.placed.remove(&addr);
        s.granted_in.remove(&addr);
        Ok(())
    }

    unsafe fn mem_allocation_size(&self, handle: u64) -> Option<usize> {
        let s = self.state();
        let &allocation = s.handles.get(&handle)?;
        s.book.phys_len(allocation)
    }

    unsafe fn mem_release(&self, handle: u64) -> CuResult<()> {
        let call = DriverCall::MemRelease;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        let Some(&allocation) = s.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        let len = s
            .book
            .phys_len(allocation)
            .expect("a live handle's allocation");
        Self::check(call, s.book.check_release(allocation, len));
        s.refused_by_capture()?;
        s.handles.remove(&handle);
        let mapped = s.book.is_mapped(allocation);
        s.book.apply_release(allocation);
        if !mapped {
            s.gone(allocation, len);
        }
        // The value is free from now on, even while the memory stays mapped.
        s.free_handles.push(handle);
        Ok(())
    }

    unsafe fn mem_map(&self, ptr: u64, size: usize, offset: usize, handle: u64) -> CuResult<()> {
        let call = DriverCall::MemMap;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        Self::check_not_plain(&s, call, ptr as Addr, size);
        let Some(&allocation) = s.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        Self::check(
            call,
            s.book.check_map(ptr as Addr, size, allocation, offset),
        );
        // Facts 15, 16: `ptr` is a multiple of the granularity of the memory's properties.
        let granule = s.granules.get(&allocation).copied().unwrap_or(1);
        if !ptr.is_multiple_of(granule as u64) {
            misuse(
                call,
                format_args!(
                    "{ptr:#x} is not a multiple of the granularity {granule:#x} of the memory's \
                     properties"
                ),
            );
        }
        s.refused_by_capture()?;
        s.book
            .apply_map(ptr as Addr, size, allocation, Access::ReadOnly);
        s.no_access.insert(ptr as Addr);
        Ok(())
    }

    /// One descriptor per device (fact 18): none, a device twice or an unknown device is
    /// misuse. Fact 32: access for a device other than the memory's owner needs a
    /// `cuDeviceCanAccessPeer(device, owner)` asked before (else misuse) that said 1 (else
    /// `CUDA_ERROR_INVALID_DEVICE`, and nothing changes). A new mapping's first access must
    /// name every device given access in its reservation before (else misuse: see
    /// [`DriverModel`]). Fact 21: a mapping's first access starts the work that may touch it.
    /// Fact 43: refused during a global capture.
    unsafe fn mem_set_access(&self, ptr: u64, size: usize, access: &[(i32, bool)]) -> CuResult<()> {
        let call = DriverCall::MemSetAccess;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        Self::check_not_plain(&s, call, ptr as Addr, size);
        self.check_descriptors(call, access);
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.check_unmap(addr, size));
        let mappings = s.mappings_in(addr, size);
        if Self::peer_refused(&s, call, access, &mappings) {
            return Err(CuError::INVALID_DEVICE);
        }
        s.refused_by_capture()?;
        // The context's own device (0) is the one whose copies the model checks: its access is
        // what the record and `no_access` hold. A peer's grant changes neither.
        if let Some(&(_, read_write)) = access.iter().find(|&&(d, _)| d == 0) {
            let access = if read_write {
                Access::ReadWrite
            } else {
                Access::ReadOnly
            };
            Self::check(call, s.book.set_access(addr, size, access));
            let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
            for start in starts {
                s.no_access.remove(&start);
            }
        }
        let epoch = s.epoch;
        for (start, len, _) in mappings {
            s.access_epoch.entry(start).or_insert((len, epoch));
            s.grants
                .entry(start)
                .or_default()
                .extend(access.iter().copied());
            let reservation = s.reservation_of(start);
            let devices = access.iter().map(|&(d, _)| d);
            s.granted_in.entry(reservation).or_default().extend(devices);
        }
        Ok(())
    }

    /// Fact 21: does not wait for work in flight; work that may touch the range faults when it
    /// completes. Fact 43: refused during a global capture.
    unsafe fn mem_unmap(&self, ptr: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemUnmap;
        self.check_vmm(call);
        let mut s = self.enter(call, true)?;
        Self::check_not_plain(&s, call, ptr as Addr, size);
        let (addr, end) = (ptr as Addr, ptr as Addr + size);
        Self::check(call, s.book.check_unmap(addr, size));
        s.refused_by_capture()?;
        for (allocation, len) in s.book.handles_in(addr, size) {
            // Memory released while mapped goes with its last mapping.
            s.gone(allocation, len);
        }
        s.book.apply_unmap(addr, size);
        let starts: Vec<Addr> = s.no_access.range(addr..end).copied().collect();
        for start in starts {
            s.no_access.remove(&start);
        }
        let granted: Vec<Addr> = s.grants.range(addr..end).map(|(&a, _)| a).collect();
        for start in granted {
            s.grants.remove(&start);
        }
        s.unmap_under_work(addr, end);
        Ok(())
    }

    unsafe fn memcpy_dtod(&self, dst: u64, src: u64, size: usize) -> CuResult<()> {
        let call = DriverCall::MemcpyDtoD;
        let mut s = self.enter(call, true)?;
        s.legacy_refused()?; // fact 41: a synchronous copy uses the legacy stream
        let mut bytes = Vec::with_capacity(size);
        for (h, off, n) in s.pieces(call, src, size, false) {
            bytes.extend(s.read(h, off, n));
        }
        let mut at = 0;
        for (h, off, n) in s.pieces(call, dst, size, true) {
            let len = s.book.phys_len_any(h);
            s.write(h, len, off, &bytes[at..at + n]);
            at += n;
        }
        // The copy may run after the call returns: work on the legacy stream until completed,
        // touching its source and its destination (fact 21).
        let touches = vec![(src as Addr, size), (dst as Addr, size)];
        s.enqueue_legacy(self.config.events_complete_at_once, touches);
        s.check_lost()
    }

    /// Waits for the work submitted on `stream`. Fact 41: synchronizing a capturing stream is
    /// refused with `STREAM_CAPTURE_UNSUPPORTED` and invalidates its capture, in any mode; the
    /// legacy stream while a blocking stream captures, with `STREAM_CAPTURE_IMPLICIT` (and
    /// invalidates that capture). A synchronize is a potentially unsafe call (fact 40, the
    /// strict reading): refused like the VMM calls under a capture that bars the thread.
    unsafe fn stream_synchronize(&self, stream: Stream) -> CuResult<()> {
        let call = DriverCall::StreamSynchronize;
        let mut s = self.enter(call, true)?;
        if !s.live_stream(stream) {
            misuse(call, format_args!("no stream {stream:#x}"));
        }
        if let Some(c) = s.capture_mut(stream) {
            c.invalidated = true;
            return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
        }
        if stream == 0 {
            s.legacy_refused()?;
        }
        s.refused_by_capture()?;
        let upto = s.streams[&stream].submitted;
        let done = |s: &ModelState| s.streams[&stream].completed >= upto;
        while self.config.synchronize_blocks && !done(&s) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
            s.check_lost()?;
        }
        s.complete(stream, upto);
        s.check_lost()
    }

    unsafe fn memcpy_htod(&self, dst: u64, src: &[u8]) -> CuResult<()> {
        let call = DriverCall::MemcpyHtoD;
        let mut s = self.enter(call, true)?;
        s.legacy_refused()?; // fact 41: a synchronous copy uses the legacy stream
        let mut at = 0;
        for (h, off, n) in s.pieces(call, dst, src.len(), true) {
            let len = s.book.phys_len_any(h);
            s.write(h, len, off, &src[at..at + n]);
            at += n;
        }
        // From pageable memory the DMA may still run after the call returns (the bytes are
        // staged): work on the legacy stream until completed, touching its destination
        // (fact 21).
        let touches = vec![(dst as Addr, src.len())];
        s.enqueue_legacy(self.config.events_complete_at_once, touches);
        s.check_lost()
    }

    unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: u64) -> CuResult<()> {
        let call = DriverCall::MemcpyDtoH;
        let mut s = self.enter(call, true)?;
        s.legacy_refused()?; // fact 41: a synchronous copy uses the legacy stream
        // Synchronous: it runs after the legacy stream's earlier work (and what that waited
        // for), which finishes first. Work on another stream it was not ordered after may
        // still write what it reads: a stale read, counted.
        let upto = s.streams[&0].submitted;
        s.complete(0, upto);
        if s.busy_elsewhere(src as Addr, dst.len()) {
            s.stale_reads += 1;
        }
        let mut at = 0;
        for (h, off, n) in s.pieces(call, src, dst.len(), false) {
            dst[at..at + n].copy_from_slice(&s.read(h, off, n));
            at += n;
        }
        Ok(())
    }

    fn event_create(&self) -> CuResult<Event> {
        let mut s = self.enter(DriverCall::EventCreate, true)?;
        let event = match s.free_events.pop() {
            Some(destroyed) => destroyed,
            None => {
                s.next_event += 1;
                s.next_event - 1
            }
        };
        s.events.insert(event, None);
        Ok(event)
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> CuResult<()> {
        let call = DriverCall::EventRecord;
        let mut s = self.enter(call, true)?;
        let Some(submitted) = s
            .streams
            .get(&stream)
            .filter(|w| !w.destroyed)
            .map(|w| w.submitted)
        else {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        };
        if !s.events.contains_key(&event) {
            misuse(call, "unknown event");
        }
        if stream == 0 {
            s.legacy_refused()?;
        }
        // Fact 39: recorded on a capturing stream, the event is a set of graph nodes, not a
        // mark of the stream's work.
        if let Some(id) = s.capture_mut(stream).map(|c| c.id) {
            s.captured.insert(event, (stream, id));
            return s.check_lost();
        }
        s.captured.remove(&event);
        s.events.insert(event, Some((stream, submitted)));
        if self.config.events_complete_at_once {
            s.complete(stream, submitted);
            self.done.notify_all();
        }
        s.check_lost()
    }

    unsafe fn event_query(&self, event: Event) -> CuResult<bool> {
        let call = DriverCall::EventQuery;
        let mut s = self.enter(call, true)?;
        let Some(&recorded) = s.events.get(&event) else {
            misuse(call, "unknown event");
        };
        s.captured_event(event)?;
        Ok(s.covered(recorded))
    }

    unsafe fn event_synchronize(&self, event: Event) -> CuResult<()> {
        let call = DriverCall::EventSynchronize;
        let mut s = self.enter(call, true)?;
        let Some(&recorded) = s.events.get(&event) else {
            misuse(call, "unknown event");
        };
        s.captured_event(event)?;
        // With `synchronize_blocks`, blocks the calling thread, as the driver does, until
        // another thread completes the work; every other call goes on meanwhile. Otherwise the
        // work completes now, as if the GPU had finished it during the wait.
        while self.config.synchronize_blocks && !s.covered(recorded) {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
            s.check_lost()?;
        }
        if let Some((stream, at)) = recorded {
            s.complete(stream, at);
        }
        s.check_lost()
    }

    unsafe fn event_destroy(&self, event: Event) -> CuResult<()> {
        let call = DriverCall::EventDestroy;
        let mut s = self.enter(call, true)?;
        if s.events.remove(&event).is_none() {
            misuse(call, "unknown event");
        }
        s.captured.remove(&event);
        s.free_events.push(event);
        Ok(())
    }

    /// Fact 41: on the legacy stream while a blocking stream captures, 906, which invalidates
    /// nothing.
    unsafe fn stream_is_capturing(&self, stream: Stream) -> CuResult<bool> {
        let call = DriverCall::StreamIsCapturing;
        let s = self.enter(call, true)?;
        if !s.live_stream(stream) {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        }
        s.legacy_probe(stream)?;
        Ok(s.capture_of(stream).is_some())
    }

    /// Fact 60: the capture's id while it is active, none once invalidated; fact 41 on the
    /// legacy stream, as for `cuStreamIsCapturing`. Invalidates nothing.
    unsafe fn stream_get_capture_info(&self, stream: Stream) -> CuResult<CaptureInfo> {
        let call = DriverCall::StreamGetCaptureInfo;
        let s = self.enter(call, true)?;
        if !s.live_stream(stream) {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        }
        s.legacy_probe(stream)?;
        let capture = s.capture_of(stream).and_then(|o| s.captures.get(&o));
        Ok(match capture {
            None => CaptureInfo::None,
            Some(c) if c.invalidated => CaptureInfo::Invalidated,
            Some(c) => CaptureInfo::Active { id: c.id },
        })
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> CuResult<CaptureMode> {
        let mut s = self.enter(DriverCall::ThreadExchangeStreamCaptureMode, false)?;
        let me = std::thread::current().id();
        let old = s.thread_modes.insert(me, mode);
        Ok(old.unwrap_or(CaptureMode::Global))
    }

    /// Fact 41: never on the legacy stream (misuse); a stream capturing already answers
    /// `STREAM_CAPTURE_UNSUPPORTED`.
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> CuResult<()> {
        let call = DriverCall::StreamBeginCapture;
        let mut s = self.enter(call, true)?;
        if stream == 0 || !s.live_stream(stream) {
            misuse(call, format_args!("cannot capture on stream {stream:#x}"));
        }
        if s.capture_of(stream).is_some() {
            return Err(CuError::STREAM_CAPTURE_UNSUPPORTED);
        }
        s.open_capture(stream, mode);
        Ok(())
    }

    /// The capture's work as a graph; `STREAM_CAPTURE_WRONG_THREAD` from another thread than
    /// the one that began a non-relaxed capture (which stays open), and
    /// `STREAM_CAPTURE_INVALIDATED` (the capture ended, no graph) after a refused call
    /// invalidated it, `STREAM_CAPTURE_UNJOINED` (ended, no graph) while a stream that joined
    /// it was not joined back (fact 39), and `STREAM_CAPTURE_UNMATCHED` from a stream that
    /// only joined it (the capture is invalidated). Misuse: a stream that does not capture.
    unsafe fn stream_end_capture(&self, stream: Stream) -> CuResult<Graph> {
        let call = DriverCall::StreamEndCapture;
        let mut s = self.enter(call, true)?;
        if let Some(c) = s
            .joined
            .get(&stream)
            .copied()
            .and_then(|o| s.captures.get_mut(&o))
        {
            c.invalidated = true;
            return Err(CuError::STREAM_CAPTURE_UNMATCHED);
        }
        let Some(capture) = s.captures.get(&stream) else {
            // Fact 60: its capture was ended by another party since memtoken asked (what the
            // driver answers is not documented: the model answers one of the call's codes).
            if s.ended_elsewhere.contains(&stream) {
                return Err(CuError::INVALID_VALUE);
            }
            misuse(call, format_args!("stream {stream:#x} does not capture"));
        };
        let me = std::thread::current().id();
        if capture.mode != CaptureMode::Relaxed && capture.thread != me {
            return Err(CuError::STREAM_CAPTURE_WRONG_THREAD);
        }
        let nodes = s.close_capture(stream).expect("just found")?;
        let graph = s.next_graph;
        s.next_graph += 1;
        s.graphs.insert(graph, nodes);
        Ok(graph)
    }

    unsafe fn graph_instantiate(&self, graph: Graph) -> CuResult<GraphExec> {
        let call = DriverCall::GraphInstantiate;
        let mut s = self.enter(call, true)?;
        // Potentially unsafe calls (fact 40, the strict reading, as for the VMM calls).
        s.refused_by_capture()?;
        let Some(nodes) = s.graphs.get(&graph).cloned() else {
            misuse(call, format_args!("unknown graph {graph:#x}"));
        };
        let exec = s.next_graph;
        s.next_graph += 1;
        s.execs.insert(exec, nodes);
        Ok(exec)
    }

    /// Each node becomes work on `stream`; one using memory not mapped with access now faults
    /// when it completes (see [`DriverModel`]).
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> CuResult<()> {
        let call = DriverCall::GraphLaunch;
        let mut s = self.enter(call, true)?;
        let Some(nodes) = s.execs.get(&exec).cloned() else {
            misuse(call, format_args!("unknown executable graph {exec:#x}"));
        };
        if !s.live_stream(stream) {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        }
        if stream == 0 {
            s.legacy_refused()?;
        }
        s.launch(stream, &nodes);
        if self.config.events_complete_at_once {
            let upto = s.streams[&stream].submitted;
            s.complete(stream, upto);
        }
        s.check_lost()
    }

    /// Work submitted on `stream` from now on runs after the event's work; an event never
    /// recorded is no wait. Fact 39: a capturing stream may not wait on an event that is not
    /// captured (905, and the capture invalidated). A wait on a captured event whose capture
    /// is open joins it: an uncapturing stream captures into it from then on (its work becomes
    /// that capture's nodes, and the capture cannot end until the stream is joined back — its
    /// origin waits on an event captured on it); a stream of another capture is refused
    /// (`STREAM_CAPTURE_MERGE`, both captures invalidated). A wait on a captured event whose
    /// capture has ended is refused with `CAPTURED_EVENT` (the strict reading: fact 39).
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> CuResult<()> {
        let call = DriverCall::StreamWaitEvent;
        let mut s = self.enter(call, true)?;
        if !s.live_stream(stream) {
            misuse(call, format_args!("unknown stream {stream:#x}"));
        }
        let Some(&recorded) = s.events.get(&event) else {
            misuse(call, "unknown event");
        };
        if stream == 0 {
            s.legacy_refused()?;
        }
        if let Some(&(on, id)) = s.captured.get(&event) {
            return s.wait_captured(stream, on, id);
        }
        if let Some(c) = s.capture_mut(stream) {
            c.invalidated = true;
            return Err(CuError::STREAM_CAPTURE_ISOLATION);
        }
        if let Some((on, upto)) = recorded {
            s.submit_wait(stream, on, upto);
        }
        s.check_lost()
    }

    /// Launches in flight are work already: they finish on their own.
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> CuResult<()> {
        let call = DriverCall::GraphExecDestroy;
        let mut s = self.enter(call, true)?;
        // Potentially unsafe calls (fact 40, the strict reading, as for the VMM calls).
        s.refused_by_capture()?;
        if s.execs.remove(&exec).is_none() {
            misuse(call, format_args!("unknown executable graph {exec:#x}"));
        }
        Ok(())
    }

    unsafe fn graph_destroy(&self, graph: Graph) -> CuResult<()> {
        let call = DriverCall::GraphDestroy;
        let mut s = self.enter(call, true)?;
        // Potentially unsafe calls (fact 40, the strict reading, as for the VMM calls).
        s.refused_by_capture()?;
        if s.graphs.remove(&graph).is_none() {
            misuse(call, format_args!("unknown graph {graph:#x}"));
        }
        Ok(())
    }
}
