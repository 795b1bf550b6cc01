//! What the CUDA backend relies on without a documented rule (the module docs of
//! `memtoken::backend::cuda`, "Assumptions not yet verified on a GPU"), each checked on the
//! real driver through the `Driver` seam, below the backend: no token and no record, only the
//! driver's answers. A test fails when the driver refuses the call the backend relies on, or
//! when the bytes read back are not the ones the rule promises.
//!
//! None of them writes through a read-only mapping or touches an unmapped address: such a
//! fault would be sticky and end every other test of the process.

use super::usable;
use memtoken::backend::cuda::{
    AllocationProps, Context, CuError, CuResult, CudaError, DeviceAttribute, Driver, DriverCall,
    ErrorFate, SysDriver,
};

/// Device 0 through the seam: the real driver, the device, and its primary context, retained
/// here, made current on the thread that opened it, and given back on drop.
struct Raw {
    driver: SysDriver,
    device: i32,
    ctx: Context,
    /// The properties the backend creates plain memory with: RDMA-capable where attribute 110
    /// says the device can be.
    props: AllocationProps,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` for `props`, as the backend reads it.
    g: usize,
}

impl Raw {
    /// Device 0.
    ///
    /// # Panics
    ///
    /// When it cannot be opened (the runner runs these tests only where a GPU answered).
    fn open(test: &str) -> Self {
        let at = |call| move |error| CudaError::Driver { call, error };
        let opened = SysDriver::load().and_then(|driver| {
            driver.init().map_err(at(DriverCall::Init))?;
            let device = driver.device_get(0).map_err(at(DriverCall::DeviceGet))?;
            let ctx = driver
                .primary_ctx_retain(device)
                .map_err(at(DriverCall::PrimaryCtxRetain))?;
            Ok(Self {
                driver,
                device,
                ctx,
                props: AllocationProps::pinned(device),
                g: 0,
            })
        });
        let mut raw = usable(test, opened);
        // SAFETY: `raw.ctx` was retained just above and is given back only when `raw` drops.
        ok(
            unsafe { raw.driver.ctx_set_current(raw.ctx) },
            "cuCtxSetCurrent",
        );
        let rdma = ok(
            raw.driver.device_get_attribute(
                DeviceAttribute::GpuDirectRdmaWithCudaVmmSupported,
                raw.device,
            ),
            "cuDeviceGetAttribute (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)",
        );
        raw.props = raw.props.with_gpu_direct_rdma(rdma == 1);
        raw.g = ok(
            raw.driver.mem_get_allocation_granularity(raw.props),
            "cuMemGetAllocationGranularity (RECOMMENDED)",
        );
        raw
    }

    /// A reservation of `granules` granules, aligned to one.
    fn reserve(&self, granules: usize) -> u64 {
        let size = granules * self.g;
        ok(
            self.driver.mem_address_reserve(size, self.g, 0),
            "cuMemAddressReserve",
        )
    }

    /// A physical allocation of `granules` granules on the device, with the backend's
    /// properties.
    fn create(&self, granules: usize) -> u64 {
        ok(
            self.driver.mem_create_with(granules * self.g, self.props),
            "cuMemCreate",
        )
    }

    /// Maps all of `handle` (`granules` granules) at `ptr`, offset 0, as the backend does.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + granules * g)` lies in a live reservation, unmapped; `handle` is live and
    /// exactly that long.
    unsafe fn map(&self, ptr: u64, handle: u64, granules: usize) -> CuResult<()> {
        // SAFETY: the caller's promise.
        unsafe { self.driver.mem_map(ptr, granules * self.g, 0, handle) }
    }

    /// Grants this device read-write or read-only access to `[ptr, ptr + size)`.
    ///
    /// # Safety
    ///
    /// The range is exactly covered by live mappings.
    unsafe fn access(&self, ptr: u64, size: usize, read_write: bool) -> CuResult<()> {
        // SAFETY: the caller's promise.
        unsafe {
            self.driver
                .mem_set_access(ptr, size, &[(self.device, read_write)])
        }
    }

    /// Writes `bytes` at `ptr` and waits until they have landed.
    ///
    /// # Safety
    ///
    /// The range is mapped with read-write access.
    unsafe fn write(&self, ptr: u64, bytes: &[u8]) {
        // SAFETY: the caller's promise.
        ok(
            unsafe { self.driver.memcpy_htod(ptr, bytes) },
            "cuMemcpyHtoD",
        );
        // From pageable memory the copy may still run on the legacy stream.
        ok(
            // SAFETY: 0 is the legacy stream, always live.
            unsafe { self.driver.stream_synchronize(0) },
            "cuStreamSynchronize (legacy) after cuMemcpyHtoD",
        );
    }

    /// Reads `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// The range is mapped with access.
    unsafe fn read(&self, ptr: u64, len: usize) -> Vec<u8> {
        let mut bytes = vec![0; len];
        // SAFETY: the caller's promise.
        ok(
            unsafe { self.driver.memcpy_dtoh(&mut bytes, ptr) },
            "cuMemcpyDtoH",
        );
        bytes
    }

    /// Unmaps `[ptr, ptr + size)` and frees the reservation, exactly that range.
    ///
    /// # Safety
    ///
    /// The range is one live reservation, exactly covered by live mappings.
    unsafe fn unmap_and_free(&self, ptr: u64, size: usize) {
        // SAFETY: the caller's promise.
        ok(unsafe { self.driver.mem_unmap(ptr, size) }, "cuMemUnmap");
        // SAFETY: the caller's promise; nothing is mapped there any more.
        ok(
            unsafe { self.driver.mem_address_free(ptr, size) },
            "cuMemAddressFree",
        );
    }

    /// Releases each handle.
    ///
    /// # Safety
    ///
    /// Each is live and released once.
    unsafe fn release(&self, handles: &[u64]) {
        for &handle in handles {
            // SAFETY: the caller's promise.
            ok(unsafe { self.driver.mem_release(handle) }, "cuMemRelease");
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: gives back the retain `open` took, once.
        let _ = unsafe { self.driver.primary_ctx_release(self.device) };
    }
}

/// The value of a call that must succeed; otherwise a panic naming the call and its error.
fn ok<T>(result: CuResult<T>, call: &str) -> T {
    result.unwrap_or_else(|e| panic!("{call} failed: {e}"))
}

/// `len` bytes that differ from those of another `seed`.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 7 + seed * 13) % 251) as u8)
        .collect()
}

/// Fails, naming the first byte that differs, unless `got` is `want`.
fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: byte {i} is {}, expected {}", got[i], want[i]);
    }
}

/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM` for pinned memory with `props`, straight from cudarc:
/// the `Driver` seam reads only the recommended granularity, the one the backend uses.
pub(super) fn minimum_granularity(props: AllocationProps) -> CuResult<usize> {
    use cudarc::driver::sys;
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType(props.handle_types),
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: props.device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(props.gpu_direct_rdma),
            usage: 0,
            reserved: [0; 4],
        },
    };
    let (mut granularity, flag) = (
        0,
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    );
    // SAFETY: the driver library is loaded (every caller opened a `Raw` or a backend through
    // `SysDriver::load` first); `granularity` and `prop` outlive the call.
    let r = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, flag) };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(granularity)
    } else {
        Err(CuError(r as i32))
    }
}

/// Assumption 1: `PROT_READ` for the owning device (no reference says whether the device that
/// holds the memory may get read-only access). A shared prefix's sharers map the owner's
/// memory read-only on the same device and read it through host copies and, for copy-on-write,
/// device-to-device copies.
fn gpu_read_only_access_for_the_owning_device() {
    let raw = Raw::open("gpu_read_only_access_for_the_owning_device");
    let g = raw.g;
    let (shared, copy) = (raw.create(1), raw.create(1));
    let (owner, sharer, private) = (raw.reserve(1), raw.reserve(1), raw.reserve(1));
    let (first, later) = (pattern(g, 1), pattern(g, 2));
    // SAFETY: each range is one fresh granule-sized reservation, mapped once to a live
    // one-granule handle; copies touch only mapped ranges with access, read-write for their
    // destinations (nothing is ever written through `sharer`); each range is unmapped and freed
    // once, before the handles are released once.
    unsafe {
        ok(raw.map(owner, shared, 1), "cuMemMap (owner)");
        ok(
            raw.access(owner, g, true),
            "cuMemSetAccess READWRITE (owner)",
        );
        raw.write(owner, &first);
        ok(raw.map(sharer, shared, 1), "cuMemMap (a second VA)");
        let granted = raw.access(sharer, g, false);
        ok(granted, "cuMemSetAccess PROT_READ for the owning device");
        let seen = raw.read(sharer, g);
        assert_bytes(&seen, &first, "read through the read-only view");
        // The same memory, not a snapshot: a later write through the owner shows there.
        raw.write(owner, &later);
        let seen = raw.read(sharer, g);
        assert_bytes(
            &seen,
            &later,
            "read-only view after a write through the owner",
        );
        // Copy-on-write: a device-to-device copy whose source is the read-only view.
        ok(raw.map(private, copy, 1), "cuMemMap (private copy)");
        ok(
            raw.access(private, g, true),
            "cuMemSetAccess READWRITE (private)",
        );
        let copied = raw.driver.memcpy_dtod(private, sharer, g);
        ok(copied, "cuMemcpyDtoD from the read-only view");
        ok(
            raw.driver.stream_synchronize(0),
            "cuStreamSynchronize (legacy) after the copy",
        );
        let seen = raw.read(private, g);
        assert_bytes(&seen, &later, "copy made from the read-only view");
        for va in [sharer, owner, private] {
            raw.unmap_and_free(va, g);
        }
        raw.release(&[shared, copy]);
    }
}

/// Assumption 2: one `cuMemUnmap` over several adjacent mappings (the samples do it,
/// the reference only says a sub-range cannot be unmapped). A prefix mapping's body and tail
/// handles are mapped side by side and go with one unmap.
fn gpu_one_unmap_covers_adjacent_mappings() {
    let raw = Raw::open("gpu_one_unmap_covers_adjacent_mappings");
    let g = raw.g;
    let (body, tail) = (raw.create(1), raw.create(1));
    let va = raw.reserve(2);
    let (a, b) = (pattern(g, 3), pattern(g, 4));
    // SAFETY: `va` is a fresh reservation of two granules; each handle (one granule, live) is
    // mapped into one granule of it, with access granted per mapping; the one unmap covers both
    // mappings exactly; after it the range is a reservation again, mapped anew the same way
    // and unmapped before it is freed; each handle is released once, last.
    unsafe {
        ok(raw.map(va, body, 1), "cuMemMap (first granule)");
        ok(raw.map(va + g as u64, tail, 1), "cuMemMap (second granule)");
        ok(raw.access(va, g, true), "cuMemSetAccess (first)");
        ok(
            raw.access(va + g as u64, g, true),
            "cuMemSetAccess (second)",
        );
        raw.write(va, &a);
        raw.write(va + g as u64, &b);
        let unmapped = raw.driver.mem_unmap(va, 2 * g);
        ok(unmapped, "one cuMemUnmap over two adjacent mappings");
        // Both granules are unmapped: each takes a new mapping, here the handles swapped, and
        // the handles kept their bytes.
        ok(
            raw.map(va, tail, 1),
            "cuMemMap after the unmap (first granule)",
        );
        let again = raw.map(va + g as u64, body, 1);
        ok(
            again,
            "cuMemMap after the unmap (second granule: was it unmapped?)",
        );
        ok(
            raw.access(va, g, true),
            "cuMemSetAccess after the unmap (first)",
        );
        ok(
            raw.access(va + g as u64, g, true),
            "cuMemSetAccess after the unmap (second)",
        );
        assert_bytes(&raw.read(va, g), &b, "the second handle, remapped first");
        assert_bytes(
            &raw.read(va + g as u64, g),
            &a,
            "the first handle, remapped second",
        );
        ok(raw.driver.mem_unmap(va, g), "cuMemUnmap (first)");
        ok(
            raw.driver.mem_unmap(va + g as u64, g),
            "cuMemUnmap (second)",
        );
        ok(raw.driver.mem_address_free(va, 2 * g), "cuMemAddressFree");
        raw.release(&[body, tail]);
    }
}

/// Assumption 3: one `cuMemSetAccess` over several adjacent mappings, read-write and read-only
/// (the samples do it across devices; the reference asks for "a fully mapped address
/// range"). The backend grants access per mapping today; this checks the rule before anything
/// grants it once for a prefix's body and tail.
fn gpu_one_set_access_covers_adjacent_mappings() {
    let raw = Raw::open("gpu_one_set_access_covers_adjacent_mappings");
    let g = raw.g;
    let (first, second) = (raw.create(1), raw.create(1));
    let (rw, ro) = (raw.reserve(2), raw.reserve(2));
    let (a, b) = (pattern(g, 5), pattern(g, 6));
    // SAFETY: `rw` and `ro` are fresh two-granule reservations, each granule mapped once to a
    // live one-granule handle; writes go only through `rw`, after its access was granted
    // read-write; each granule is unmapped on its own before its reservation is freed; each
    // handle is released once, last.
    unsafe {
        for va in [rw, ro] {
            ok(raw.map(va, first, 1), "cuMemMap (first granule)");
            ok(
                raw.map(va + g as u64, second, 1),
                "cuMemMap (second granule)",
            );
        }
        ok(
            raw.access(rw, 2 * g, true),
            "one cuMemSetAccess READWRITE over two mappings",
        );
        raw.write(rw, &a);
        raw.write(rw + g as u64, &b);
        assert_bytes(&raw.read(rw, g), &a, "first mapping, read-write");
        assert_bytes(
            &raw.read(rw + g as u64, g),
            &b,
            "second mapping, read-write",
        );
        ok(
            raw.access(ro, 2 * g, false),
            "one cuMemSetAccess PROT_READ over two mappings",
        );
        assert_bytes(&raw.read(ro, g), &a, "first mapping, read-only");
        assert_bytes(&raw.read(ro + g as u64, g), &b, "second mapping, read-only");
        for va in [rw, ro] {
            ok(raw.driver.mem_unmap(va, g), "cuMemUnmap (first)");
            ok(
                raw.driver.mem_unmap(va + g as u64, g),
                "cuMemUnmap (second)",
            );
            ok(raw.driver.mem_address_free(va, 2 * g), "cuMemAddressFree");
        }
        raw.release(&[first, second]);
    }
}

/// Assumption 4: one copy may span adjacent mappings of different handles (the backend checks
/// a copy mapping by mapping and then makes one call; a prefix's body and tail are two
/// handles). PyTorch's expandable segments use mapped pieces as one buffer; no
/// reference says so for copies.
fn gpu_one_copy_spans_adjacent_mappings() {
    let raw = Raw::open("gpu_one_copy_spans_adjacent_mappings");
    let g = raw.g;
    let (first, second, whole) = (raw.create(1), raw.create(1), raw.create(2));
    let (split, dst) = (raw.reserve(2), raw.reserve(2));
    let data = pattern(2 * g, 7);
    // SAFETY: `split` is a fresh two-granule reservation with one one-granule handle mapped in
    // each granule, `dst` one with a two-granule handle mapped whole; access is granted per
    // mapping, read-write; each range is unmapped mapping by mapping before it is freed; each
    // handle is released once, last.
    unsafe {
        ok(raw.map(split, first, 1), "cuMemMap (first granule)");
        ok(
            raw.map(split + g as u64, second, 1),
            "cuMemMap (second granule)",
        );
        ok(raw.access(split, g, true), "cuMemSetAccess (first)");
        ok(
            raw.access(split + g as u64, g, true),
            "cuMemSetAccess (second)",
        );
        ok(raw.map(dst, whole, 2), "cuMemMap (destination)");
        ok(raw.access(dst, 2 * g, true), "cuMemSetAccess (destination)");
        raw.write(split, &data); // one cuMemcpyHtoD across both mappings
        assert_bytes(
            &raw.read(split, g),
            &data[..g],
            "first mapping after one write",
        );
        let second_half = raw.read(split + g as u64, g);
        assert_bytes(&second_half, &data[g..], "second mapping after one write");
        let window = raw.read(split + (g - 4096) as u64, 8192);
        assert_bytes(
            &window,
            &data[g - 4096..g + 4096],
            "one read across the seam",
        );
        let copied = raw.driver.memcpy_dtod(dst, split, 2 * g);
        ok(copied, "one cuMemcpyDtoD from two mappings");
        ok(
            raw.driver.stream_synchronize(0),
            "cuStreamSynchronize (legacy) after the copy",
        );
        assert_bytes(&raw.read(dst, 2 * g), &data, "device copy of both mappings");
        ok(raw.driver.mem_unmap(split, g), "cuMemUnmap (first)");
        ok(
            raw.driver.mem_unmap(split + g as u64, g),
            "cuMemUnmap (second)",
        );
        ok(
            raw.driver.mem_address_free(split, 2 * g),
            "cuMemAddressFree",
        );
        raw.unmap_and_free(dst, 2 * g);
        raw.release(&[first, second, whole]);
    }
}

/// Assumption 5: the recommended granularity, which the backend uses for every size, address
/// and offset, is a multiple of the minimum one (which `cuMemCreate` and `cuMemMap` require), a
/// power of two (`cuMemAddressReserve` takes it as the alignment) and a multiple of the host
/// page size (reservation sizes). The reference says only that it is "for best performance".
fn gpu_recommended_granularity_is_a_power_of_two_multiple_of_the_minimum() {
    let test = "gpu_recommended_granularity_is_a_power_of_two_multiple_of_the_minimum";
    let raw = Raw::open(test);
    let (g, page) = (raw.g, rustix::param::page_size());
    let minimum = ok(minimum_granularity(raw.props), "MINIMUM granularity");
    assert!(
        minimum > 0 && g >= minimum,
        "recommended {g}, minimum {minimum}"
    );
    assert_eq!(
        g % minimum,
        0,
        "recommended {g} is no multiple of minimum {minimum}"
    );
    assert!(g.is_power_of_two(), "recommended {g} is no power of two");
    assert_eq!(
        g % page,
        0,
        "recommended {g} is no multiple of the host page {page}"
    );
    // Reservations come aligned to it, at every size the backend asks for.
    for granules in [1, 3, 8] {
        let va = raw.reserve(granules);
        assert_eq!(
            va % g as u64,
            0,
            "a reservation at {va:#x} is not {g}-aligned"
        );
        // SAFETY: the reservation made just above, exactly, with nothing mapped in it.
        ok(
            unsafe { raw.driver.mem_address_free(va, granules * g) },
            "cuMemAddressFree",
        );
    }
}

/// Assumption 6: a `cuMemSetAccess` that fails leaves its mapping in place, without access, and
/// the context usable: the backend's `map` then rolls the mapping back with `cuMemUnmap`. The
/// reference says nothing of the state after a failure. The failure is made with a device
/// ordinal no machine has.
fn gpu_a_failed_set_access_leaves_the_mapping_to_unmap() {
    let raw = Raw::open("gpu_a_failed_set_access_leaves_the_mapping_to_unmap");
    let g = raw.g;
    let handle = raw.create(1);
    let va = raw.reserve(1);
    let data = pattern(g, 8);
    // SAFETY: `va` is a fresh one-granule reservation, mapped to the live one-granule handle,
    // unmapped (the rollback under test), mapped again with access before anything is copied,
    // and unmapped again before it is freed; the handle is released once, last. No copy touches
    // the mapping while it has no access.
    unsafe {
        ok(raw.map(va, handle, 1), "cuMemMap");
        let no_device = 1 << 20;
        let refused = raw.driver.mem_set_access(va, g, &[(no_device, true)]);
        let e = refused.expect_err("cuMemSetAccess for a device that does not exist succeeded");
        assert_eq!(
            e.fate(),
            ErrorFate::Transient,
            "a refused access grant: {e}"
        );
        ok(
            raw.driver.mem_unmap(va, g),
            "the rollback cuMemUnmap after a failed cuMemSetAccess",
        );
        // The context goes on, and the range takes the mapping again.
        ok(raw.map(va, handle, 1), "cuMemMap after the rollback");
        ok(raw.access(va, g, true), "cuMemSetAccess after the rollback");
        raw.write(va, &data);
        assert_bytes(&raw.read(va, g), &data, "after the rollback");
        raw.unmap_and_free(va, g);
        raw.release(&[handle]);
    }
}

/// Assumption 7: `cuMemMap` of an imported handle refuses a size past the allocation's end
/// (the reference: "offset + size must be less than the size of the memory allocation"), so an
/// importer that cannot ask the driver for the size may map the length the message claims.
/// A one-granule exportable allocation is exported, imported in this process, and mapped with
/// two granules: refused, with a transient error; then with one: mapped, and its bytes read.
fn gpu_a_map_past_an_imported_allocation_is_refused() {
    use memtoken::backend::cuda::{HANDLE_TYPE_POSIX_FD, ShareableHandle};
    use std::os::fd::AsRawFd;
    let raw = Raw::open("gpu_a_map_past_an_imported_allocation_is_refused");
    let handle = ok(
        raw.driver
            .mem_create_with(raw.g, raw.props.with_handle_types(HANDLE_TYPE_POSIX_FD)),
        "cuMemCreate (POSIX fd requested)",
    );
    let ptr = raw.reserve(1);
    let want = pattern(raw.g, 7);
    // SAFETY: `[ptr, ptr + g)` is a fresh reservation; `handle` is live and one granule long.
    unsafe {
        ok(raw.map(ptr, handle, 1), "cuMemMap");
        ok(raw.access(ptr, raw.g, true), "cuMemSetAccess");
        raw.write(ptr, &want);
    }
    // SAFETY: `handle` is live.
    let shared = ok(
        unsafe {
            raw.driver
                .mem_export_to_shareable_handle(handle, HANDLE_TYPE_POSIX_FD)
        },
        "cuMemExportToShareableHandle",
    );
    let ShareableHandle::Fd(fd) = shared else {
        panic!("a POSIX handle is a descriptor");
    };
    let imported = ok(
        raw.driver
            .mem_import_from_shareable_handle(fd.as_raw_fd() as u64, HANDLE_TYPE_POSIX_FD),
        "cuMemImportFromShareableHandle",
    );
    drop(fd); // fact 28
    let two = raw.reserve(2);
    // SAFETY: the assumption under test: the driver refuses a size past the allocation rather
    // than mapping it. `[two, two + 2g)` is a fresh reservation; `imported` is live.
    let past = unsafe { raw.map(two, imported, 2) };
    let e = past.expect_err("a map of two granules of a one-granule import must be refused");
    assert_eq!(e.fate(), ErrorFate::Transient, "{e}");
    // SAFETY: `[two, two + g)` is unmapped (the map above was refused); `imported` is live and
    // one granule long.
    unsafe {
        ok(raw.map(two, imported, 1), "cuMemMap of the import");
        ok(raw.access(two, raw.g, false), "cuMemSetAccess (read-only)");
        assert_bytes(&raw.read(two, raw.g), &want, "the imported bytes");
        ok(raw.driver.mem_unmap(two, raw.g), "cuMemUnmap");
        ok(
            raw.driver.mem_address_free(two, 2 * raw.g),
            "cuMemAddressFree",
        );
        raw.unmap_and_free(ptr, raw.g);
        raw.release(&[imported, handle]);
    }
}

/// Assumption 8: a descriptor that names no exported memory — a device node, a socket, a memfd,
/// a number no longer open — is an error of the import call, not a crash or a handle.
fn gpu_importing_a_foreign_descriptor_is_an_error() {
    use memtoken::backend::cuda::HANDLE_TYPE_POSIX_FD;
    use std::os::fd::{AsRawFd, OwnedFd};
    let raw = Raw::open("gpu_importing_a_foreign_descriptor_is_an_error");
    let null: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let memfd = rustix::fs::memfd_create("foreign", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&memfd, raw.g as u64).unwrap();
    let closed = {
        let fd: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        fd.as_raw_fd()
    };
    let cases = [
        ("/dev/null", null.as_raw_fd()),
        ("a socket", socket.as_raw_fd()),
        ("a memfd", memfd.as_raw_fd()),
        ("a closed number", closed),
    ];
    for (what, fd) in cases {
        let imported = raw
            .driver
            .mem_import_from_shareable_handle(fd as u64, HANDLE_TYPE_POSIX_FD);
        assert!(imported.is_err(), "{what} was imported as {imported:?}");
    }
    // The descriptors are untouched: still open, still what they were.
    assert!(rustix::fs::fstat(&memfd).unwrap().st_size == raw.g as i64);
    assert!(rustix::fs::fstat(&null).is_ok());
}

/// Every test of this module, by name: what the runner (`main.rs`) runs. A test left out of the list is dead code, which the
/// lints refuse.
pub(crate) const TESTS: &[(&str, fn())] = tests![
    gpu_read_only_access_for_the_owning_device,
    gpu_one_unmap_covers_adjacent_mappings,
    gpu_one_set_access_covers_adjacent_mappings,
    gpu_one_copy_spans_adjacent_mappings,
    gpu_recommended_granularity_is_a_power_of_two_multiple_of_the_minimum,
    gpu_a_failed_set_access_leaves_the_mapping_to_unmap,
    gpu_a_map_past_an_imported_allocation_is_refused,
    gpu_importing_a_foreign_descriptor_is_an_error,
];
