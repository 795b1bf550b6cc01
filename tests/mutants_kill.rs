//! Tests written to kill mutants that `cargo mutants` (`.cargo/mutants.toml`) found surviving
//! the other suites: each names the mutant it catches (as cargo-mutants names it) in its
//! comment. `.cargo/mutants-survivors.md` lists the mutants that survive everything, with why
//! each cannot change behaviour.

use memtoken::backend::cuda::{
    CaptureMode, CuError, CudaBackend, CudaPhys, Driver, DriverCall, DriverModel, ModelConfig,
    Placement,
};
use memtoken::backend::{
    Access, Backend, Cause, Exportable, Faulty, HandleType, HostBackend, HostConfig, Op, PosixFd,
    Shareable, SimBackend, SimConfig, Violation,
};
use memtoken::{
    Budget, CommitFailure, Device, GrowFailure, MESSAGE_LEN, PagePool, PrefixMessage, Returned,
    ShrinkFailure, TransitionError, WireError, make_guard,
};

#[path = "common/gate.rs"]
mod gate;

use gate::{Gate, GateHandle, gated_sim, manual_sim};

const GRANULE: usize = 2 << 20;

/// Asserts that `error`'s message starts with `summary`: a failure says what failed first.
fn says_first(error: &impl std::fmt::Display, summary: &str) {
    let message = error.to_string();
    assert!(message.starts_with(summary), "{message}");
}

fn sim(physical_capacity: u64) -> SimBackend {
    SimBackend::new(SimConfig {
        physical_capacity,
        ..SimConfig::default()
    })
    .unwrap()
}

/// Kills `src/allocation.rs: replace > with >= in Allocation<'b, 'id, B, Reserved>::admit`:
/// a commit of exactly the physical capacity fits.
#[test]
fn a_commit_of_exactly_the_physical_capacity_fits() {
    make_guard!(guard);
    let device = Device::new(guard, sim(4 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let all = binding.reserve(4 * GRANULE).unwrap().commit().unwrap();
    assert_eq!(device.ledger().owned_bytes, 4 * GRANULE as u64);
    all.release().complete().unwrap();
}

/// Kills `src/device.rs: replace Device<'id, B>::forget_cache with ()`: once the context is
/// lost, discharging the device forgets its cached granules (the driver freed them), so the
/// ledger holds nothing owned or cached any more.
#[test]
fn a_lost_context_discharges_the_granule_cache_from_the_ledger() {
    let sim = sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region();
    region = region.grow(3).unwrap();
    region.shrink(3).unwrap();
    region.release().complete().unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.owned_bytes, l.cached_bytes),
        (3 * GRANULE as u64, 3 * GRANULE as u64)
    );
    sim.lose_context();
    let proof = device
        .confirm_context_lost()
        .expect("the simulator says it is lost");
    device.discharge_all(&proof);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
}

/// Kills `src/error.rs: replace <impl Failure for ResumeFailure>::summary -> &'static str with ""`:
/// a failed resume's message starts by saying so.
#[test]
fn a_failed_resume_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let asleep = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .unwrap()
        .suspend()
        .unwrap();
    faults.fail_nth(Op::Create, 1);
    let e = asleep
        .resume()
        .expect_err("the create was failed on purpose");
    says_first(&e, "resuming the memory failed; ");
    drop(e.into_token());
}

/// Kills `src/region.rs: replace - with + in Allocation<'b, 'id, B, Elastic>::shrink`: a shrink
/// refused for a lost context names the granules it was asked to give back, at the tail.
#[test]
fn a_shrink_after_the_context_is_lost_names_the_tail_it_would_unmap() {
    let sim = sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(4 * GRANULE).unwrap().into_region();
    region = region.grow(3).unwrap();
    sim.lose_context();
    let Err(ShrinkFailure::Backend(e)) = region.shrink(1) else {
        panic!("a lost context refuses the shrink");
    };
    assert_eq!(e.cause, Cause::ContextLost);
    assert_eq!(e.op, Op::Unmap);
    assert_eq!((e.addr, e.len), (region.addr() + 2 * GRANULE, GRANULE));
    assert_eq!(region.committed_len(), 3 * GRANULE, "nothing was done");
}

fn model() -> DriverModel {
    DriverModel::new(ModelConfig {
        granularity: GRANULE,
        total_mem: 64 * GRANULE,
        ..ModelConfig::default()
    })
    .unwrap()
}

/// Kills `src/backend/cuda/mod.rs: replace && with || in CudaBackend<D>::check_not_busy`: a
/// copy not known to have landed keeps its own range busy, and only that range: another
/// allocation still releases.
#[test]
fn a_range_left_busy_by_a_copy_holds_back_only_itself() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    let b = binding.reserve(GRANULE).unwrap().commit().unwrap();
    // Neither the event nor the whole context can be waited for: the copy into `a` is not
    // known to have landed, so `a` stays busy.
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::CtxSynchronize, 1, CuError::UNKNOWN);
    a.copy_from_host(0, &[7; 64])
        .expect_err("the wait was failed on purpose");
    b.release()
        .complete()
        .map_err(|e| e.to_string())
        .expect("b is not busy");
    std::mem::forget(a); // still busy: it may never be unmapped
}

/// Kills `src/backend/cuda/mod.rs: replace < with > in <impl Exportable<PosixFd> for
/// CudaBackend<D>>::import`: an import that claims more than the driver's allocation is "too
/// small"; one that claims less is "longer than the message claims".
#[test]
fn a_cuda_import_tells_a_short_allocation_from_a_long_one() {
    let model = model();
    let exporter = CudaBackend::new(model.clone(), 0).unwrap();
    let importer = CudaBackend::new(model.clone(), 0).unwrap();
    let small = Exportable::<PosixFd>::create_exportable(&exporter, GRANULE).unwrap();
    let big = Exportable::<PosixFd>::create_exportable(&exporter, 2 * GRANULE).unwrap();
    let claim = |phys, real, len| {
        let fd = Exportable::<PosixFd>::export(&exporter, phys, real)
            .unwrap()
            .fd;
        let handle = Shareable { fd, offset: 0, len };
        Exportable::<PosixFd>::import(&importer, handle).expect_err("the size disagrees")
    };
    let short = claim(small, GRANULE, 2 * GRANULE);
    assert!(
        matches!(
            short.cause,
            Cause::Violation(Violation::ImportTooSmall { size, len, .. })
                if size == GRANULE as u64 && len == 2 * GRANULE
        ),
        "{short}"
    );
    let long = claim(big, 2 * GRANULE, GRANULE);
    assert!(
        matches!(long.cause, Cause::Violation(Violation::Import(m)) if m.contains("longer")),
        "{long}"
    );
    for (phys, n) in [(small, GRANULE), (big, 2 * GRANULE)] {
        exporter.release(phys, n).unwrap();
    }
}

/// Kills `src/backend/host.rs: replace HostBackend::page_size -> usize with 0` (and `with 1`):
/// the page size is the OS's, no larger than the granularity.
#[test]
fn the_host_backend_says_the_os_page_size() {
    let host = HostBackend::with_defaults().unwrap();
    let page = host.page_size();
    assert_eq!(page, rustix::param::page_size());
    assert!(page <= host.granularity(), "{page}");
}

/// Kills `src/backend/host.rs: replace > with == in HostBackend::check_capacity`: the host
/// backend creates up to exactly its capacity, and refuses a byte more.
#[test]
fn the_host_backend_creates_up_to_exactly_its_capacity() {
    let (host, page) = host_of_pages(4);
    let three = host.create(3 * page).unwrap();
    let e = host.create(2 * page).expect_err("past the capacity");
    assert!(matches!(e.cause, Cause::Exhausted { available, .. } if available == page as u64));
    let one = host.create(page).expect("exactly the capacity");
    assert_eq!(host.physical_in_use(), 4 * page as u64);
    host.release(one, page).unwrap();
    host.release(three, 3 * page).unwrap();
}

/// A host backend whose physical capacity is `pages` pages, and its page size.
fn host_of_pages(pages: u64) -> (HostBackend, usize) {
    let page = HostBackend::with_defaults().unwrap().granularity();
    let host = HostBackend::new(HostConfig {
        physical_capacity: pages * page as u64,
        ..HostConfig::default()
    })
    .unwrap();
    (host, page)
}

/// Whether any mapping of this process covers `addr` (from `/proc/self/maps`).
fn mapped(addr: usize) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().any(|line| {
        let range = line.split_whitespace().next().unwrap();
        let (start, end) = range.split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        (start..end).contains(&addr)
    })
}

/// Kills `src/backend/host.rs: replace + with - in <impl Backend for HostBackend>::reserve`:
/// a host reservation aligned to a granularity larger than the page trims the slack it
/// over-reserved after its end (and only there), so nothing past the reservation stays mapped.
#[test]
fn a_host_reservation_gives_back_the_slack_past_its_end() {
    let host = HostBackend::new(HostConfig {
        granularity: GRANULE,
        ..HostConfig::default()
    })
    .unwrap();
    assert!(host.page_size() < GRANULE, "the slack is a granule");
    // Another thread's mapping may land in the trimmed gap at once: one of three tries shows
    // it free (with the slack kept, none does).
    let trimmed = (0..3).any(|_| {
        let addr = host.reserve(GRANULE).unwrap();
        assert!(mapped(addr) && mapped(addr + GRANULE - 1));
        let free = !mapped(addr + GRANULE);
        host.free(addr, GRANULE).unwrap();
        free
    });
    assert!(trimmed, "the slack past the end is unmapped");
}

/// Kills `src/interop/ipc.rs: replace <impl std::fmt::Debug for Export<'_, '_, B, K>>::fmt ->
/// std::fmt::Result with Ok(Default::default())` and `src/interop/ipc.rs: replace - with / in
/// Allocation<'b, 'id, B, Owner<K>>::export`: an export's debug form shows its message and
/// handles, and its message carries the offset the backend gave each handle, body and boundary
/// (here one megabyte into each file, as a backend exporting pieces of one file would say).
#[test]
fn an_export_debugs_as_its_message_and_handles_and_carries_their_offsets() {
    const SHIFT: u64 = 1 << 20;
    make_guard!(guard);
    let gate = GateHandle::default();
    gate.shift_exports(SHIFT);
    let backend = Gate {
        inner: HostBackend::with_defaults().unwrap(),
        gate,
    };
    let device = Device::new(guard, backend);
    let owner = device.bind(Budget::unlimited()).unwrap();
    let page = device.granularity();
    let prefix = owner
        .reserve(3 * page)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    let export = prefix.export().unwrap();
    let debug = format!("{export:?}");
    assert!(debug.starts_with("Export {"), "{debug}");
    assert!(debug.contains("message: PrefixMessage"), "{debug}");
    assert!(debug.contains("handles: ["), "{debug}");
    let m = export.message();
    assert_eq!((m.body_len, m.body_offset), (2 * page as u64, SHIFT));
    assert_eq!(m.boundary_offset, SHIFT);
    drop(export);
    prefix.release().complete().unwrap();
}

/// A model with `config`, initialized, with its context retained and current.
fn opened(config: ModelConfig) -> DriverModel {
    let model = DriverModel::new(config).unwrap();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    model
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::unmap_under_work`: work
/// that named the range it uses faults when exactly that range is unmapped under it (fact 21).
#[test]
fn work_that_named_its_range_faults_when_that_range_is_unmapped() {
    let model = opened(ModelConfig::default());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(GRANULE, GRANULE, 0).unwrap();
    let handle = model.mem_create(GRANULE, 0).unwrap();
    model.submit_work_touching(stream, &[]); // an epoch before the access below
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `GRANULE` bytes long;
    // the mapping is exactly `[ptr, ptr + GRANULE)`, unmapped once, then released.
    unsafe {
        model.mem_map(ptr, GRANULE, 0, handle).unwrap();
        model.mem_set_access(ptr, GRANULE, &[(0, true)]).unwrap();
        model.submit_work_touching(stream, &[(ptr, GRANULE)]);
        model.mem_unmap(ptr, GRANULE).unwrap();
        model.mem_release(handle).unwrap();
    }
    model.complete_work_on(stream);
    assert_eq!(model.lost_with(), Some(CuError::ILLEGAL_ADDRESS));
}

/// Kills `src/backend/cuda/model.rs: replace < with <= in ModelState::unmap_under_work`: work
/// that named only the ranges beside a mapping, just before and just after it, goes on when
/// that mapping is unmapped under it.
#[test]
fn work_that_named_only_the_ranges_beside_a_mapping_survives_its_unmap() {
    let model = opened(ModelConfig::default());
    let stream = model.new_stream();
    let ptr = model.mem_address_reserve(3 * GRANULE, GRANULE, 0).unwrap();
    let handle = model.mem_create(GRANULE, 0).unwrap();
    let middle = ptr + GRANULE as u64;
    model.submit_work_touching(stream, &[]); // an epoch before the access below
    // SAFETY: the fresh reservation is unmapped; `handle` is live and `GRANULE` bytes long;
    // the mapping is exactly `[middle, middle + GRANULE)`, unmapped once, then released.
    unsafe {
        model.mem_map(middle, GRANULE, 0, handle).unwrap();
        model.mem_set_access(middle, GRANULE, &[(0, true)]).unwrap();
        let beside = [(ptr, GRANULE), (middle + GRANULE as u64, GRANULE)];
        model.submit_work_touching(stream, &beside);
        model.mem_unmap(middle, GRANULE).unwrap();
        model.mem_release(handle).unwrap();
    }
    model.complete_work_on(stream);
    assert_eq!(model.lost_with(), None);
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place`: scattered
/// reservations never overlap, even when they are large enough that random places collide.
#[test]
fn scattered_reservations_never_overlap() {
    let len = 1usize << 45; // two fit in the model's window, at most three
    for seed in 1..=8 {
        let model = opened(ModelConfig {
            placement: Placement::Scattered { seed },
            ..ModelConfig::default()
        });
        let a = model.mem_address_reserve(len, GRANULE, 0).unwrap();
        let b = model.mem_address_reserve(len, GRANULE, 0).unwrap();
        let (a, b) = (a as usize, b as usize);
        assert!(
            a + len <= b || b + len <= a,
            "seed {seed}: {a:#x} and {b:#x}"
        );
        // SAFETY: each is exactly one reservation with nothing mapped in it.
        unsafe {
            model.mem_address_free(a as u64, len).unwrap();
            model.mem_address_free(b as u64, len).unwrap();
        }
    }
}

/// Kills `src/device.rs: delete ! in <impl Drop for Device<'_, B>>::drop`: a device dropped
/// without `close` still shuts down first (a poll and a quarantine retry) before its own last
/// retry, so a residual whose first retry fails is released by the second.
#[test]
fn a_dropped_device_retries_its_quarantine_twice() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    faults.fail_nth(Op::Release, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = a.release().complete()
    else {
        panic!("the release was failed on purpose");
    };
    drop(quarantined); // into the device's quarantine
    faults.fail_nth(Op::Release, 1); // the next retry fails too
    drop(binding);
    drop(device);
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

/// Kills `src/error.rs: replace <impl Failure for GrowFailure>::summary -> &'static str with
/// "xyzzy"`: a failed growth's message starts by saying so.
#[test]
fn a_failed_growth_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Create, 1);
    let e = region
        .grow(1)
        .expect_err("the create was failed on purpose");
    says_first(&e, "the region could not grow; ");
    e.into_token().release().complete().unwrap();
}

/// Kills `src/page_pool.rs: replace - with + in PagePool<'pool, 'b, 'id, B>::push`,
/// `src/page_pool.rs: replace PageTable<'p, 'pool, 'b, 'id, B>::is_empty -> bool with true` and
/// `src/page_pool.rs: replace <impl fmt::Debug for PageTable<'_, '_, '_, '_, B>>::fmt ->
/// fmt::Result with Ok(Default::default())` and `replace PageTable<'p, 'pool, 'b, 'id,
/// B>::pop -> Option<Page<'p, 'pool, 'b, 'id, B>> with None` (and the pool's and the page's
/// `fmt::Debug`):
/// `push` answers the new page's position in the table, which is then not empty, debugs as its
/// pages, and pops the last; the pool debugs as its page size.
#[test]
fn a_pushed_page_is_at_the_position_push_answers() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let mut table = pool.table();
    assert!(table.is_empty());
    assert_eq!(pool.push(&mut table).unwrap(), 0);
    assert!(!table.is_empty());
    assert_eq!(pool.push(&mut table).unwrap(), 1);
    assert_eq!(table.len(), 2);
    assert_ne!(table.addr(0), table.addr(1));
    let debug = format!("{table:?}");
    assert!(debug.starts_with("PageTable { pages: ["), "{debug}");
    let debug = format!("{pool:?}");
    assert!(debug.starts_with("PagePool { page_size: 4096, "), "{debug}");
    let last = table.pop().expect("two pages in the table");
    assert_eq!(table.len(), 1);
    let debug = format!("{last:?}");
    assert!(debug.starts_with("Page { index: "), "{debug}");
    let (live, free) = (pool.live_pages(), pool.free_pages());
    pool.free(last);
    assert_eq!(
        (pool.live_pages(), pool.free_pages() + pool.cooling_pages()),
        (live - 1, free + 1),
        "freed: free, or cooling until its fence completes"
    );
    pool.clear(&mut table);
    assert!(table.is_empty());
}

/// A CUDA backend on `model` with `n` reservations of `GRANULE` bytes, each with its own
/// physical memory, not mapped.
fn reserved(model: &DriverModel, n: usize) -> (CudaBackend<DriverModel>, Vec<(usize, CudaPhys)>) {
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let ranges = (0..n)
        .map(|_| {
            let addr = backend.reserve(GRANULE).unwrap();
            (addr, backend.create(GRANULE).unwrap())
        })
        .collect();
    (backend, ranges)
}

/// Kills `src/backend/cuda/mod.rs: replace CudaBackend<D>::device -> i32 with 1`: the backend
/// says the `CUdevice` of the ordinal it was opened on.
#[test]
fn a_cuda_backend_says_its_device() {
    let model = model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    assert_eq!(backend.device(), model.device_get(0).unwrap());
}

/// Kills `src/backend/cuda/mod.rs: replace && with || in CudaBackend<D>::unstick`: a mapping
/// left by a failed rollback in one range is unmapped before that range is mapped or freed,
/// and only then: a map elsewhere does not touch it (nor fail when unmapping it would).
#[test]
fn a_stuck_mapping_is_unstuck_only_by_its_own_range() {
    let model = model();
    let (backend, r) = reserved(&model, 2);
    let [(a, pa), (b, pb)] = [r[0], r[1]];
    map_stuck(&model, &backend, a, pa);
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN);
    let unmaps = model.count(DriverCall::MemUnmap);
    backend
        .map(b, GRANULE, pb, Access::ReadWrite)
        .expect("b has nothing stuck");
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "a's mapping left alone"
    );
    model.clear();
    backend.unmap(b, GRANULE).unwrap();
    backend
        .free(a, GRANULE)
        .expect("a's stuck mapping goes first");
    backend.free(b, GRANULE).unwrap();
    backend.release(pa, GRANULE).unwrap();
    backend.release(pb, GRANULE).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: replace + with - in CudaBackend<D>::sweep_scratch`: a
/// copy's scratch range whose unmap failed is unmapped and freed by the next copy's sweep.
#[test]
fn the_next_copy_sweeps_a_scratch_range_left_mapped() {
    let model = model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, GRANULE, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(GRANULE).unwrap();
    let before = model.outstanding().reservations;
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN); // the scratch range's
    backend.copy_into_phys(dst, src, GRANULE).unwrap();
    assert_eq!(
        model.outstanding().reservations,
        before + 1,
        "the scratch range is left"
    );
    backend.copy_into_phys(dst, src, GRANULE).unwrap();
    assert_eq!(model.outstanding().reservations, before, "swept");
    backend.unmap(src, GRANULE).unwrap();
    backend.free(src, GRANULE).unwrap();
    backend.release(psrc, GRANULE).unwrap();
    backend.release(dst, GRANULE).unwrap();
}

/// Kills `src/backend/cuda/mod.rs: replace match guard freed.is_context_loss() with false in
/// <impl Backend for CudaBackend<D>>::copy_into_phys`: when freeing a copy's scratch range
/// loses the context, the copy fails with that loss, and the backend calls the driver no more.
#[test]
fn a_context_lost_freeing_a_scratch_range_is_the_copys_error() {
    let model = model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, GRANULE, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(GRANULE).unwrap();
    model.fail_nth(DriverCall::MemMap, 1, CuError::OUT_OF_MEMORY); // the scratch map
    model.fail_nth(DriverCall::MemAddressFree, 1, CuError::ILLEGAL_ADDRESS); // sticky
    let e = backend.copy_into_phys(dst, src, GRANULE).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Driver { code, .. } if code == CuError::ILLEGAL_ADDRESS.0),
        "{e}"
    );
    assert!(backend.context_lost());
    let _ = backend.unmap(src, GRANULE);
    drop(backend);
    assert_eq!(model.calls_after_loss(), 0);
}

/// Kills `src/backend/cuda/mod.rs: replace match guard freed.is_context_loss() with true in
/// <impl Backend for CudaBackend<D>>::copy_into_phys`: when the scratch range of a failed copy
/// cannot be freed for another reason than a lost context, the copy's error is its own, and
/// the next copy frees the scratch range.
#[test]
fn a_scratch_range_that_cannot_be_freed_waits_for_the_next_copy() {
    let model = model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, GRANULE, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(GRANULE).unwrap();
    model.fail_nth(DriverCall::MemMap, 1, CuError::OUT_OF_MEMORY); // the scratch map
    model.fail_nth(DriverCall::MemAddressFree, 1, CuError::INVALID_VALUE);
    let e = backend.copy_into_phys(dst, src, GRANULE).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Driver { code, .. } if code == CuError::OUT_OF_MEMORY.0),
        "{e}"
    );
    assert!(!backend.context_lost());
    backend.copy_into_phys(dst, src, GRANULE).unwrap();
    backend.unmap(src, GRANULE).unwrap();
    backend.release(psrc, GRANULE).unwrap();
    backend.release(dst, GRANULE).unwrap();
    backend.free(src, GRANULE).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/host.rs: replace -= with /= in <impl Backend for HostBackend>::release`:
/// a release gives its bytes back to the host backend's count of physical memory in use.
#[test]
fn a_host_release_gives_back_its_bytes() {
    let host = HostBackend::with_defaults().unwrap();
    let page = host.granularity();
    let a = host.create(2 * page).unwrap();
    let b = host.create(page).unwrap();
    assert_eq!(host.physical_in_use(), 3 * page as u64);
    host.release(a, 2 * page).unwrap();
    assert_eq!(host.physical_in_use(), page as u64);
    host.release(b, page).unwrap();
    assert_eq!(host.physical_in_use(), 0);
}

/// Kills `src/backend/host.rs: replace > with < in <impl Exportable<PosixFd> for
/// HostBackend>::import`: a host import may claim all of an exported file, and is refused when
/// it claims more.
#[test]
fn a_host_import_may_claim_all_of_the_file_and_no_more() {
    let exporter = HostBackend::with_defaults().unwrap();
    let importer = HostBackend::with_defaults().unwrap();
    let page = exporter.granularity();
    let phys = Exportable::<PosixFd>::create_exportable(&exporter, 2 * page).unwrap();
    let claim = |len| {
        let fd = Exportable::<PosixFd>::export(&exporter, phys, 2 * page)
            .unwrap()
            .fd;
        Exportable::<PosixFd>::import(&importer, Shareable { fd, offset: 0, len })
    };
    let e = claim(3 * page).expect_err("more than the file holds");
    assert!(
        matches!(e.cause, Cause::Violation(Violation::ImportTooSmall { len, size, .. })
            if len == 3 * page && size == 2 * page as u64),
        "{e}"
    );
    let whole = claim(2 * page).expect("exactly the file");
    importer.release(whole, 2 * page).unwrap();
    exporter.release(phys, 2 * page).unwrap();
}

/// Kills `src/error.rs: replace quarantine_note -> String with String::new()`: an undone
/// growth whose granule could not be released either says that it is in the quarantine.
#[test]
fn an_undone_growth_tells_of_what_it_left_in_the_quarantine() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 1);
    faults.fail_nth(Op::Release, 1);
    let e = region.grow(1).expect_err("the map was failed on purpose");
    assert!(
        matches!(e.cause, GrowFailure::Undone { quarantined: 1, .. }),
        "{:?}",
        e.cause
    );
    let message = e.cause.to_string();
    assert!(
        message
            .contains("1 granules whose release failed while undoing are in the device quarantine"),
        "{message}"
    );
    assert_eq!(device.retry_quarantine().released, 1);
    e.into_token().release().complete().unwrap();
}

/// Kills `src/region.rs: replace * with / in Allocation<'b, 'id, B, Elastic>::grow`: a growth
/// refused for a lost context names the granules it would have mapped.
#[test]
fn a_growth_after_the_context_is_lost_names_the_granules_it_would_map() {
    let sim = sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(4 * GRANULE).unwrap().into_region();
    let region = region.grow(1).unwrap();
    sim.lose_context();
    let e = region.grow(2).expect_err("the context is lost");
    let GrowFailure::Undone { cause, .. } = &e.cause else {
        panic!("{:?}", e.cause);
    };
    let CommitFailure::Backend(b) = &**cause else {
        panic!("{cause:?}");
    };
    assert_eq!(b.cause, Cause::ContextLost);
    assert_eq!((b.addr, b.len), (e.token.addr() + GRANULE, 2 * GRANULE));
}

/// Kills `src/error.rs: replace <impl Failure for CowFailure>::summary -> &'static str with
/// "xyzzy"`: a failed copy-on-write says so first.
#[test]
fn a_failed_copy_on_write_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .commit_prefix()
        .unwrap();
    let shared = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    faults.fail_nth(Op::Create, 1);
    let e = shared
        .diverge()
        .expect_err("the create was failed on purpose");
    says_first(&e, "copy-on-write of the boundary granule failed; ");
}

/// Kills `src/interop/mod.rs: replace Allocation<'_, '_, CudaBackend<D>, Elastic>::device_ptr ->
/// u64 with 1`: a CUDA region's device pointer is its start.
#[test]
fn a_cuda_regions_device_pointer_is_its_start() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(2 * GRANULE).unwrap().into_region();
    let region = region.grow(1).unwrap();
    assert_eq!(region.device_ptr(), region.addr() as u64);
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    assert_eq!(a.device_ptr(), a.addr() as u64);
}

/// Kills `src/residual.rs: replace += with -= in Holdings::absorb`: while a poll on one thread
/// is stopped in the backend tearing down a sharer's release, another thread's custody
/// reading counts the shared reference it still holds.
#[test]
fn a_sharer_being_torn_down_still_counts_its_shared_reference() {
    let (sim, gate, gated) = gated_sim();
    make_guard!(guard);
    let device = Device::new(guard, gated);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(1).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(1).unwrap().map_prefix(&prefix).unwrap();
    drop(shared);
    assert_eq!(device.custody().deferred.shared_refs, 1);
    sim.complete_fences();
    gate.arm(Op::Unmap);
    std::thread::scope(|s| {
        let poller = s.spawn(|| device.poll());
        let entered = gate.wait_entered();
        let reading = std::panic::catch_unwind(|| device.custody().deferred);
        gate.open(); // before any assertion can fail: the scope joins the poller
        assert!(entered, "the poll never reached the backend's unmap");
        let deferred = reading.expect("reading the custody");
        assert_eq!((deferred.count, deferred.shared_refs), (1, 1));
        assert_eq!(poller.join().unwrap().released, 1);
    });
    drop(prefix);
    sim.complete_fences();
    device.poll();
    drop(binding);
    assert!(device.close().is_clean());
}

/// Kills `src/backend/cuda/mod.rs: replace < with > in CudaBackend<D>::check_not_busy`: the
/// range a copy left busy is refused to an unmap.
#[test]
fn a_range_left_busy_by_a_copy_cannot_be_unmapped() {
    let model = model();
    let (backend, r) = reserved(&model, 1);
    let (a, pa) = r[0];
    backend.map(a, GRANULE, pa, Access::ReadWrite).unwrap();
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::CtxSynchronize, 1, CuError::UNKNOWN);
    backend
        .copy_from_host(a, &[7; 64])
        .expect_err("the wait was failed on purpose");
    let e = backend.unmap(a, GRANULE).expect_err("a is busy");
    assert!(
        matches!(e.cause, Cause::Violation(Violation::Busy { .. })),
        "{e}"
    );
    std::mem::forget(backend); // a copy may still run: nothing may be freed under it
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::check_not_busy` (both
/// of its comparisons): a range a copy left busy holds back only itself, not the mappings just
/// before and just after it.
#[test]
fn a_range_left_busy_by_a_copy_leaves_the_mappings_beside_it_free() {
    let model = model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(3 * GRANULE).unwrap();
    for i in 0..3 {
        let phys = backend.create(GRANULE).unwrap();
        backend
            .map(a + i * GRANULE, GRANULE, phys, Access::ReadWrite)
            .unwrap();
    }
    model.fail_nth(DriverCall::EventSynchronize, 1, CuError::UNKNOWN);
    model.fail_nth(DriverCall::CtxSynchronize, 1, CuError::UNKNOWN);
    backend
        .copy_from_host(a + GRANULE, &vec![7; GRANULE])
        .expect_err("the wait was failed on purpose");
    backend
        .unmap(a, GRANULE)
        .expect("the mapping before is not busy");
    backend
        .unmap(a + 2 * GRANULE, GRANULE)
        .expect("the mapping after is not busy");
    std::mem::forget(backend); // a copy may still run: nothing may be freed under it
}

/// Kills `src/backend/rules.rs: replace + with * in Book<P>::check_copy`: a copy from a range
/// mapped by several granules side by side reads all of them.
#[test]
fn a_copy_reads_a_source_of_several_mappings() {
    let sim = sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 3);
    let target = sim.create(3 * GRANULE).unwrap();
    sim.copy_into_phys(target, addr, 3 * GRANULE)
        .expect("every byte of the source is mapped");
    sim.release(target, 3 * GRANULE).unwrap();
    unmap_granules(&sim, addr, granules);
}

/// A reservation of `n` granules, each mapped to a physical allocation of its own: its address
/// and the allocations.
fn map_granules(sim: &SimBackend, n: usize) -> (usize, Vec<<SimBackend as Backend>::Phys>) {
    let addr = sim.reserve(n * GRANULE).unwrap();
    let granules = (0..n)
        .map(|i| {
            let phys = sim.create(GRANULE).unwrap();
            sim.map(addr + i * GRANULE, GRANULE, phys, Access::ReadWrite)
                .unwrap();
            phys
        })
        .collect();
    (addr, granules)
}

/// Undoes [`map_granules`].
fn unmap_granules(sim: &SimBackend, addr: usize, granules: Vec<<SimBackend as Backend>::Phys>) {
    let n = granules.len();
    for (i, phys) in granules.into_iter().enumerate() {
        sim.unmap(addr + i * GRANULE, GRANULE).unwrap();
        sim.release(phys, GRANULE).unwrap();
    }
    sim.free(addr, n * GRANULE).unwrap();
}

/// Kills `src/interop/ipc.rs: replace || with && in PrefixMessage::decode`: a message whose
/// length is no whole number of granules is malformed.
#[test]
fn a_message_of_no_whole_number_of_granules_is_malformed() {
    let g = GRANULE as u64;
    let message = PrefixMessage {
        len: 3 * g + 1,
        body_len: 2 * g + 1,
        granularity: g,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    };
    let bytes = message.encode();
    assert_eq!(bytes.len(), MESSAGE_LEN);
    assert!(
        matches!(
            PrefixMessage::decode(&bytes),
            Err(WireError::Malformed(m)) if m.contains("whole number of granules")
        ),
        "{:?}",
        PrefixMessage::decode(&bytes)
    );
}

/// Kills `src/interop/ipc.rs: replace > with >= in PrefixMessage::decode`: lengths up to
/// `isize::MAX` decode (with a granularity of one byte it is a whole number of granules); one
/// byte more is malformed.
#[test]
fn a_message_may_claim_up_to_isize_max_bytes() {
    let most = isize::MAX as u64;
    let claiming = |len: u64| {
        PrefixMessage::decode(
            &PrefixMessage {
                len,
                body_len: len - 1,
                granularity: 1,
                kind: HandleType::PosixFd,
                generation: 1,
                body_offset: 0,
                boundary_offset: 0,
            }
            .encode(),
        )
    };
    assert_eq!(claiming(most).map(|m| m.len).ok(), Some(most));
    assert!(
        matches!(claiming(most + 1), Err(WireError::Malformed(m)) if m.contains("whole number")),
        "{:?}",
        claiming(most + 1)
    );
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place`: scattered
/// reservations stay inside the model's window, whose top is where a top-down model places.
#[test]
fn scattered_reservations_stay_inside_the_window() {
    let len = 1usize << 45;
    let top_down = opened(ModelConfig {
        placement: Placement::TopDown,
        ..ModelConfig::default()
    });
    let top = top_down.mem_address_reserve(len, GRANULE, 0).unwrap() as usize + len;
    for seed in 1..=8 {
        let model = opened(ModelConfig {
            placement: Placement::Scattered { seed },
            ..ModelConfig::default()
        });
        for _ in 0..2 {
            let a = model.mem_address_reserve(len, GRANULE, 0).unwrap() as usize;
            assert!(
                a + len <= top,
                "seed {seed}: {a:#x} + {len:#x} is past {top:#x}"
            );
        }
    }
}

/// Kills `src/allocation.rs: replace == with != in Allocation<'b, 'id, B, S>::is_empty`: a
/// token is never empty.
#[test]
fn a_token_is_never_empty() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(1).unwrap();
    assert!(!a.is_empty());
    let a = a.commit().unwrap();
    assert!(!a.is_empty());
}

/// Kills `src/error.rs: replace <impl Failure for SuspendFailure>::summary -> &'static str
/// with ""`: a failed suspend says so first.
#[test]
fn a_failed_suspend_says_so_first() {
    let sim = sim(16 * GRANULE as u64);
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    sim.lose_context();
    let e = a.suspend().expect_err("the context is lost");
    says_first(&e, "suspending the memory failed; ");
}

/// Kills `src/backend/cuda/mod.rs: replace < with == in <impl Backend for
/// CudaBackend<D>>::unmap`: unmapping a range forgets the mappings a failed rollback left stuck
/// in it, so freeing the range later does not unmap them again.
#[test]
fn an_unmap_forgets_the_stuck_mapping_it_took_down() {
    let model = model();
    let (backend, r) = reserved(&model, 1);
    let (a, pa) = r[0];
    map_stuck(&model, &backend, a, pa);
    backend
        .unmap(a, GRANULE)
        .expect("the stuck mapping is still mapped");
    let unmaps = model.count(DriverCall::MemUnmap);
    backend.free(a, GRANULE).expect("nothing is left mapped");
    assert_eq!(model.count(DriverCall::MemUnmap), unmaps, "no unmap twice");
    backend.release(pa, GRANULE).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Maps `phys` at `addr` with its access grant failed and the rollback's unmap failed too: the
/// mapping is left stuck in the backend.
fn map_stuck(model: &DriverModel, backend: &CudaBackend<DriverModel>, addr: usize, phys: CudaPhys) {
    model.fail_nth(DriverCall::MemSetAccess, 1, CuError::OUT_OF_MEMORY);
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN); // the rollback
    backend
        .map(addr, GRANULE, phys, Access::ReadWrite)
        .expect_err("the access was failed on purpose");
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in <impl Backend for
/// CudaBackend<D>>::unmap`: unmapping a range forgets only the stuck mappings inside it, not
/// one that starts where it ends, which the free of the reservation then unmaps.
#[test]
fn an_unmap_keeps_the_stuck_mapping_right_after_it() {
    let model = model();
    let (backend, a, p0, p1) = stuck_after_the_first_granule(&model);
    backend.map(a, GRANULE, p0, Access::ReadWrite).unwrap();
    backend.unmap(a, GRANULE).unwrap();
    free_the_stuck_pair(&model, backend, a, p0, p1);
}

/// A CUDA backend on `model` with a reservation of two granules at `a` whose second granule
/// holds a stuck mapping of `p1` (see [`map_stuck`]); `p0` is created, not mapped.
fn stuck_after_the_first_granule(
    model: &DriverModel,
) -> (CudaBackend<DriverModel>, usize, CudaPhys, CudaPhys) {
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(2 * GRANULE).unwrap();
    let (p0, p1) = (
        backend.create(GRANULE).unwrap(),
        backend.create(GRANULE).unwrap(),
    );
    map_stuck(model, &backend, a + GRANULE, p1);
    (backend, a, p0, p1)
}

/// Frees what [`stuck_after_the_first_granule`] made (the free unmaps the stuck mapping first),
/// once the first granule is unmapped again; the model holds nothing after.
fn free_the_stuck_pair(
    model: &DriverModel,
    backend: CudaBackend<DriverModel>,
    a: usize,
    p0: CudaPhys,
    p1: CudaPhys,
) {
    backend
        .free(a, 2 * GRANULE)
        .expect("the free unmaps the stuck mapping first");
    backend.release(p0, GRANULE).unwrap();
    backend.release(p1, GRANULE).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: delete ! in <impl Backend for CudaBackend<D>>::retire_fence`:
/// a fence retired while its context cannot be made current has its events destroyed at the
/// next retirement.
#[test]
fn a_fence_retired_while_not_current_is_destroyed_at_the_next_retirement() {
    let model = model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let events = model.outstanding().events;
    let first = backend.fence();
    assert!(
        model.outstanding().events > events,
        "the fence recorded an event"
    );
    model.fail_nth(DriverCall::CtxSetCurrent, 1, CuError::UNKNOWN);
    backend.retire_fence(first);
    let second = backend.fence();
    backend.retire_fence(second);
    assert_eq!(model.outstanding().events, events);
}

/// Kills `src/backend/host.rs: replace -= with += in <impl Backend for HostBackend>::release`:
/// releasing an exportable allocation (a file of its own) gives its bytes back too.
#[test]
fn a_host_exportable_release_gives_back_its_bytes() {
    let host = HostBackend::with_defaults().unwrap();
    let page = host.granularity();
    let phys = Exportable::<PosixFd>::create_exportable(&host, 2 * page).unwrap();
    assert_eq!(host.physical_in_use(), 2 * page as u64);
    host.release(phys, 2 * page).unwrap();
    assert_eq!(host.physical_in_use(), 0);
}

/// Kills `src/backend/cuda/model.rs: replace ModelOutstanding::is_zero -> bool with true`: a
/// model that holds a reservation does not say it holds nothing.
#[test]
fn a_model_holding_a_reservation_is_not_empty() {
    let model = model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let addr = backend.reserve(GRANULE).unwrap();
    assert!(!model.outstanding().is_zero(), "{:?}", model.outstanding());
    backend.free(addr, GRANULE).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/model.rs: replace >= with < in <impl Driver for
/// DriverModel>::ctx_synchronize`: with nothing submitted, a blocking synchronize returns at
/// once (it waits only for unfinished work).
#[test]
fn a_blocking_synchronize_with_nothing_submitted_returns() {
    let model = opened(ModelConfig {
        synchronize_blocks: true,
        ..ModelConfig::default()
    });
    let (sent, seen) = std::sync::mpsc::channel();
    let other = model.clone();
    std::thread::spawn(move || {
        let ctx = other.primary_ctx_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this model.
        unsafe { other.ctx_set_current(ctx) }.unwrap();
        let _ = sent.send(other.ctx_synchronize());
    });
    let synchronized = seen.recv_timeout(gate::STALL);
    assert_eq!(synchronized, Ok(Ok(())), "the synchronize never returned");
}

/// Kills `src/error.rs: replace <impl Failure for CommitFailure>::summary -> &'static str with ""`:
/// a failed commit's message starts by saying so.
#[test]
fn a_failed_commit_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    faults.fail_nth(Op::Create, 1);
    let e = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .expect_err("the create was failed on purpose");
    says_first(&e, "commit failed; ");
}

/// Kills `src/backend/host.rs: replace - with + in <impl Backend for HostBackend>::create`: a
/// create refused because no free range is long enough, though enough bytes are free in
/// pieces, says how many bytes are free.
#[test]
fn a_host_create_refused_for_fragmentation_says_what_is_free() {
    let (host, page) = host_of_pages(4);
    let pieces: Vec<_> = (0..3).map(|_| host.create(page).unwrap()).collect();
    host.release(pieces[1], page).unwrap();
    // Two pages are free, one between the pieces and one after them: no two side by side.
    let e = host
        .create(2 * page)
        .expect_err("no free range of two pages");
    assert!(
        matches!(e.cause, Cause::Exhausted { available, capacity, .. }
            if available == 2 * page as u64 && capacity == 4 * page as u64),
        "{e}"
    );
    host.release(pieces[0], page).unwrap();
    host.release(pieces[2], page).unwrap();
}

/// Kills `src/backend/sim.rs: replace - with + in <impl Backend for SimBackend>::copy_from_host`:
/// a copy into a range of two mappings that ends inside the second writes exactly its bytes.
#[test]
fn a_simulator_copy_ending_inside_a_second_mapping_writes_its_bytes() {
    let sim = sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 2);
    let bytes: Vec<u8> = (0..GRANULE).map(|i| (i % 251) as u8).collect();
    sim.copy_from_host(addr + GRANULE / 2, &bytes)
        .expect("every byte of the destination is mapped");
    let mut back = vec![0xff; 2 * GRANULE];
    sim.copy_to_host(&mut back, addr).unwrap();
    assert!(
        back[..GRANULE / 2].iter().all(|&b| b == 0),
        "before the copy"
    );
    assert!(back[GRANULE / 2..3 * GRANULE / 2] == bytes[..], "the copy");
    assert!(back[3 * GRANULE / 2..].iter().all(|&b| b == 0), "after it");
    unmap_granules(&sim, addr, granules);
}

/// Kills `src/sleep.rs: replace Allocation<'b, 'id, B, Suspended<Elastic>>::withheld_granules
/// -> usize with 0`: a region suspended while its unmaps fail withholds those granules, and
/// says how many.
#[test]
fn a_region_suspended_while_unmaps_fail_says_what_it_withholds() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(4 * GRANULE).unwrap().into_region();
    let region = region.grow(3).unwrap();
    faults.fail_from(Op::Unmap, 2);
    let mut asleep = region.suspend().unwrap();
    faults.clear();
    assert_eq!(asleep.withheld_granules(), 2, "the second and the first");
    assert_eq!(asleep.withheld_bytes(), 2 * GRANULE);
    asleep.reclaim().unwrap();
    assert_eq!(
        (asleep.withheld_granules(), asleep.withheld_bytes()),
        (0, 0)
    );
    asleep.release().complete().unwrap();
    let l = device.ledger();
    assert_eq!(
        (l.reserved_bytes, l.mapped_bytes, binding.used()),
        (0, 0, 0),
        "{l:?}"
    );
    assert_eq!(l.owned_bytes, l.cached_bytes, "what is left is the cache");
}

/// Kills `src/backend/cuda/model.rs: replace += with -= in DriverModel::new_stream`: every new
/// stream, however many the model made, is one of its own and never the legacy stream (a
/// capture may begin on it: fact 41).
#[test]
fn tens_of_thousands_of_new_streams_are_each_their_own() {
    let model = model();
    let streams: Vec<_> = (0..1 << 16).map(|_| model.new_stream()).collect();
    let distinct: std::collections::HashSet<_> = streams.iter().collect();
    assert_eq!(distinct.len(), streams.len());
    for &stream in &streams {
        model.begin_capture(stream, CaptureMode::Global);
        model.end_capture(stream).unwrap();
    }
}

/// Kills `src/backend/mod.rs: replace BackendError::is_injected -> bool with true`: only a
/// fault that `Faulty` injected says it was injected; a refused call does not.
#[test]
fn only_an_injected_fault_says_it_was_injected() {
    let sim = sim(16 * GRANULE as u64);
    let faulty = Faulty::new(sim.clone());
    faulty.handle().fail_nth(Op::Reserve, 1);
    assert!(faulty.reserve(GRANULE).unwrap_err().is_injected());
    let refused = sim.free(GRANULE, GRANULE).unwrap_err();
    assert!(matches!(refused.cause, Cause::Violation(_)), "{refused}");
    assert!(!refused.is_injected(), "{refused}");
}

/// Kills `src/backend/rules.rs: replace > with >= in Book<P>::check_copy`: a copy of no bytes
/// is refused as a copy of memory not mapped (it names the empty range), before any check of
/// its length.
#[test]
fn a_copy_of_nothing_names_the_empty_range() {
    let (host, page) = host_of_pages(4);
    let addr = host.reserve(page).unwrap();
    let phys = host.create(page).unwrap();
    host.map(addr, page, phys, Access::ReadWrite).unwrap();
    let target = host.create(page).unwrap();
    let e = host.copy_into_phys(target, addr, 0).unwrap_err();
    assert_eq!(
        e.cause,
        Cause::Violation(Violation::NotMapped { addr, len: 0 })
    );
    host.release(target, page).unwrap();
    host.unmap(addr, page).unwrap();
    host.release(phys, page).unwrap();
    host.free(addr, page).unwrap();
}

/// Kills `src/backend/rules.rs: replace < with <= in Book<P>::resolve` (with which the check
/// loops for ever): a copy that runs from a mapping into unmapped address space is refused.
#[test]
fn a_copy_running_past_its_mapping_is_refused() {
    let sim = sim(16 * GRANULE as u64);
    let addr = sim.reserve(2 * GRANULE).unwrap();
    let phys = sim.create(GRANULE).unwrap();
    sim.map(addr, GRANULE, phys, Access::ReadWrite).unwrap();
    let mut bytes = vec![0; 2 * GRANULE];
    let e = sim.copy_to_host(&mut bytes, addr).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Violation(Violation::NotMapped { .. })),
        "{e}"
    );
    let e = sim.copy_from_host(addr, &bytes).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Violation(Violation::NotMapped { .. })),
        "{e}"
    );
    sim.unmap(addr, GRANULE).unwrap();
    sim.release(phys, GRANULE).unwrap();
    sim.free(addr, 2 * GRANULE).unwrap();
}

/// Kills `src/backend/host.rs: replace HostBackend::open_files -> usize with 1`: the host
/// counts the files it holds open, from none.
#[test]
fn the_host_counts_its_open_files_from_none() {
    let (host, page) = host_of_pages(4);
    assert_eq!(host.open_files(), 0);
    let a = host.create_exportable(page).unwrap();
    let b = host.create_exportable(page).unwrap();
    assert_eq!(host.open_files(), 2);
    host.release(a, page).unwrap();
    host.release(b, page).unwrap();
    assert_eq!(host.open_files(), 0);
}

/// Kills `src/backend/host.rs: replace | with & in reopen_read_only`: the descriptor an export
/// hands out is closed on `exec`, like every descriptor the backend opens.
#[test]
fn an_exported_descriptor_is_closed_on_exec() {
    let (host, page) = host_of_pages(4);
    let phys = host.create_exportable(page).unwrap();
    let handle = host.export(phys, page).unwrap();
    let flags = rustix::io::fcntl_getfd(&handle.fd).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC), "{flags:?}");
    drop(handle);
    host.release(phys, page).unwrap();
}

/// Kills `src/sharing.rs: replace <impl Sealed for Sharer>::shared -> Option<&SharedPhys<B::Phys>>
/// with None`: a sharer counts the mappings of the prefix it maps, its own included.
#[test]
fn a_sharer_counts_the_mappings_of_its_prefix() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(GRANULE).unwrap().commit_prefix().unwrap();
    let sharer = binding
        .reserve(GRANULE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    assert_eq!((prefix.mappings(), sharer.mappings()), (2, 2));
    sharer.release().complete().unwrap();
    assert_eq!(prefix.mappings(), 1);
    prefix.release().complete().unwrap();
}

/// Kills `src/unwind.rs: replace Guarded<B>::retire_fence with ()`: a completed release gives
/// its fence's event back to the driver at once, not when the backend goes.
#[test]
fn a_completed_release_destroys_its_event() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap().commit().unwrap();
    let releasing = a.release();
    assert_eq!(model.outstanding().events, 1, "the release's fence");
    releasing.complete().unwrap();
    assert_eq!(model.outstanding().events, 0);
}

/// Kills `src/device.rs: replace <impl std::fmt::Debug for Device<'_, B>>::fmt ->
/// std::fmt::Result with Ok(Default::default())` and `src/allocation.rs: replace <impl
/// fmt::Debug for Allocation<'_, '_, B, S>>::fmt -> fmt::Result with Ok(Default::default())`
/// and the same for its `fmt::Display` and for the `fmt::Debug` of `Binding`: a device debugs
/// as its granularity and ledger, a binding as what it uses, a token debugs and shows its
/// state and range.
#[test]
fn a_device_and_its_tokens_debug_as_what_they_hold() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(GRANULE).unwrap();
    let debug = format!("{device:?}");
    assert!(
        debug.starts_with(&format!(
            "Device {{ granularity: {GRANULE}, ledger: LedgerSnapshot {{ reserved_bytes: {GRANULE},"
        )),
        "{debug}"
    );
    let debug = format!("{binding:?}");
    assert!(debug.starts_with("Binding { used: 0, limit: "), "{debug}");
    let debug = format!("{a:?}");
    assert!(debug.starts_with("Allocation { state: "), "{debug}");
    let shown = a.to_string();
    assert!(shown.starts_with("the Reserved allocation #"), "{shown}");
    assert!(
        shown.ends_with(&format!(" of {GRANULE} bytes at {:#x}", a.addr())),
        "{shown}"
    );
    assert!(
        debug.contains(&format!("addr: {:#x}, len: {GRANULE},", a.addr())),
        "{debug}"
    );
}

/// Kills `src/error.rs: replace <impl Failure for ReleaseFailure>::summary -> &'static str with
/// "xyzzy"` and `src/quarantine.rs: replace <impl fmt::Debug for Quarantined<'_, '_, B>>::fmt ->
/// fmt::Result with Ok(Default::default())`: a release that cannot complete yet, and one that
/// failed, each say so first; the quarantined token debugs as its residual.
#[test]
fn a_release_not_done_says_why_first() {
    make_guard!(guard);
    let sim = manual_sim();
    let backend = Faulty::new(sim.clone());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let releasing = binding
        .reserve(GRANULE)
        .unwrap()
        .commit()
        .unwrap()
        .release();
    let e = releasing.complete().expect_err("its fence is pending");
    says_first(&e, "the release cannot complete yet; ");
    let Returned::Unchanged(releasing) = e.token else {
        panic!("a pending release hands its token back unchanged");
    };
    sim.complete_fences();
    faults.fail_nth(Op::Release, 1);
    let e = releasing
        .complete()
        .expect_err("the release was failed on purpose");
    says_first(&e, "the release failed; ");
    let Returned::Quarantined(quarantined) = e.token else {
        panic!("a failed release hands its token back quarantined");
    };
    let debug = format!("{quarantined:?}");
    assert!(debug.starts_with("Quarantined { residual: "), "{debug}");
    drop(quarantined); // it goes to the device's quarantine
    let p = device.retry_quarantine();
    assert_eq!((p.released, p.quarantined), (1, 0), "{p:?}");
}

/// Kills `src/interop/ipc.rs: replace == with != in PrefixMessage::decode`: a message with no
/// body may not name a body offset; one with a body may.
#[test]
fn only_a_message_with_a_body_names_a_body_offset() {
    let g = GRANULE as u64;
    let decoded = |len: u64, body_offset: u64| {
        PrefixMessage::decode(
            &PrefixMessage {
                len,
                body_len: len - g,
                granularity: g,
                kind: HandleType::PosixFd,
                generation: 1,
                body_offset,
                boundary_offset: 0,
            }
            .encode(),
        )
    };
    assert!(
        matches!(decoded(g, g), Err(WireError::Malformed(m)) if m.contains("body offset")),
        "{:?}",
        decoded(g, g)
    );
    assert_eq!(decoded(3 * g, g).map(|m| m.body_offset).ok(), Some(g));
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place` (the top-down
/// search's first candidate) and `replace - with / in ModelState::place` (its next candidate,
/// below a reservation in the way): a top-down model places each reservation right below the
/// highest one it fits under.
#[test]
fn top_down_reservations_stack_downwards() {
    let model = opened(ModelConfig {
        placement: Placement::TopDown,
        ..ModelConfig::default()
    });
    let len = 4 * GRANULE;
    let a = model.mem_address_reserve(len, GRANULE, 0).unwrap();
    let b = model.mem_address_reserve(len, GRANULE, 0).unwrap();
    assert_eq!(b + len as u64, a);
    // With the top free again, twice as much no longer fits there: it goes right below `b`.
    // SAFETY: `a` is a reservation of `len` bytes made above, with nothing mapped in it.
    unsafe { model.mem_address_free(a, len) }.unwrap();
    let c = model.mem_address_reserve(2 * len, GRANULE, 0).unwrap();
    assert_eq!(c + 2 * len as u64, b);
}

/// Kills `src/error.rs: replace <impl Failure for ShareFailure>::summary -> &'static str with
/// "xyzzy"`: a failed mapping of a prefix says so first.
#[test]
fn a_failed_mapping_of_a_prefix_says_so_first() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .commit_prefix()
        .unwrap();
    let e = binding
        .reserve(GRANULE)
        .unwrap()
        .map_prefix(&prefix)
        .expect_err("the reservation is shorter than the prefix");
    says_first(&e, "mapping the prefix failed; ");
}

/// Kills `src/backend/export.rs: delete match arm 8 in HandleType::from_code` and `replace
/// HandleType::code -> u8 with 1`: the code of a fabric handle (8) names it, so a message of
/// fabric handles is refused as not descriptors, not as malformed.
#[test]
fn a_message_of_fabric_handles_is_refused_as_not_descriptors() {
    assert_eq!(HandleType::from_code(8), Some(HandleType::Fabric));
    assert_eq!(HandleType::Fabric.code(), 8);
    let g = GRANULE as u64;
    let bytes = PrefixMessage {
        len: g,
        body_len: 0,
        granularity: g,
        kind: HandleType::Fabric,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
    .encode();
    assert!(matches!(
        PrefixMessage::decode(&bytes),
        Err(WireError::NotADescriptor(HandleType::Fabric))
    ));
}

/// Kills `src/backend/cuda/model.rs: replace > with >= in DriverModel::create`: the model
/// creates up to exactly its device's memory.
#[test]
fn the_model_creates_up_to_exactly_its_memory() {
    let model = opened(ModelConfig {
        total_mem: 4 * GRANULE,
        ..ModelConfig::default()
    });
    let all = model
        .mem_create(4 * GRANULE, 0)
        .expect("exactly the memory");
    assert_eq!(model.mem_create(GRANULE, 0), Err(CuError::OUT_OF_MEMORY));
    // SAFETY: `all` was created above, is mapped nowhere, and is released once.
    unsafe { model.mem_release(all) }.unwrap();
}

/// Kills `src/interop/mod.rs: replace Allocation<'_, '_, CudaBackend<D>, Elastic>::copy_from_host
/// -> Result<(), BackendError> with Ok(())`: bytes copied into a CUDA region read back.
#[test]
fn bytes_copied_into_a_cuda_region_read_back() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .into_region()
        .grow(2)
        .unwrap();
    let bytes: Vec<u8> = (0..100).collect();
    region.copy_from_host(GRANULE - 50, &bytes).unwrap();
    let mut back = vec![0; 100];
    region.copy_to_host(GRANULE - 50, &mut back).unwrap();
    assert_eq!(back, bytes);
}

/// Kills `src/backend/mod.rs: replace Backend::wait_fence -> bool with true` (the default, which
/// the simulator uses) and `src/backend/faulty.rs: replace <impl Backend for Faulty<B>>::wait_fence
/// -> bool with true`: a device dropped while a release's fence has not completed leaves that
/// memory to the driver, never frees it under the work.
#[test]
fn a_device_dropped_before_a_fence_completes_frees_nothing_under_it() {
    dropped_before_the_fence_completes(|sim| sim);
    dropped_before_the_fence_completes(Faulty::new);
}

/// A device over `wrap(simulator)` dropped while a release waits for its fence: nothing of it
/// is freed.
fn dropped_before_the_fence_completes<W: Backend>(wrap: impl FnOnce(SimBackend) -> W) {
    let sim = manual_sim();
    {
        make_guard!(guard);
        let device = Device::new(guard, wrap(sim.clone()));
        let binding = device.bind(Budget::unlimited()).unwrap();
        drop(
            binding
                .reserve(GRANULE)
                .unwrap()
                .commit()
                .unwrap()
                .release(),
        );
    }
    assert_eq!(
        (sim.reservations(), sim.mappings(), sim.physical_in_use()),
        (1, 1, GRANULE as u64)
    );
}

/// Kills `src/backend/cuda/model.rs: replace + with * in ModelState::place` (in the number of
/// slots a scattered placement draws from): a scattered model can place a reservation as long
/// as its whole window, which has one slot.
#[test]
fn a_scattered_model_places_a_reservation_of_its_whole_window() {
    let window = 0x7000_0000_0000;
    let model = opened(ModelConfig {
        placement: Placement::Scattered { seed: 1 },
        ..ModelConfig::default()
    });
    let a = model.mem_address_reserve(window, GRANULE, 0).unwrap();
    assert_eq!(a, 0x1000_0000_0000);
}

/// Kills `src/backend/cuda/model.rs: replace += with *= in DriverModel::enter`: the model
/// counts every call made after its context was lost.
#[test]
fn the_model_counts_the_calls_after_a_loss() {
    let model = opened(ModelConfig::default());
    model.fail_nth(DriverCall::MemCreate, 1, CuError::ILLEGAL_ADDRESS); // sticky
    assert!(model.mem_create(GRANULE, 0).is_err());
    assert_eq!(model.calls_after_loss(), 0);
    assert!(model.mem_create(GRANULE, 0).is_err());
    assert!(model.mem_create(GRANULE, 0).is_err());
    assert_eq!(model.calls_after_loss(), 2);
}

/// Kills `src/region.rs: replace += with *= in GiveBack<'a, 'b, 'id, B>::give`: the granules a
/// shrink gives back, cached or released, leave the binding's budget.
#[test]
fn a_shrink_refunds_the_binding_for_what_it_gave_back() {
    make_guard!(guard);
    let device = Device::new(guard, sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_cache_cap(GRANULE as u64);
    let mut region = binding
        .reserve(4 * GRANULE)
        .unwrap()
        .into_region()
        .grow(3)
        .unwrap();
    assert_eq!(binding.used(), 3 * GRANULE as u64);
    region.shrink(2).unwrap(); // one cached, one released
    assert_eq!(binding.used(), GRANULE as u64);
    region.release().complete().unwrap();
    assert_eq!(binding.used(), 0);
}

/// Kills `src/region.rs: replace += with -= in Allocation<'b, 'id, B, Elastic>::undo_grow`: an
/// undone growth counts the granule it had created and mapped and then failed to release, as
/// well as the one whose map failed.
#[test]
fn an_undone_growth_counts_every_granule_it_left_in_the_quarantine() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(2 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 2);
    faults.fail_from(Op::Release, 1);
    let e = region
        .grow(2)
        .expect_err("the second map was failed on purpose");
    faults.clear();
    assert!(
        matches!(
            e.cause,
            GrowFailure::Undone {
                at: 1,
                quarantined: 2,
                ..
            }
        ),
        "{:?}",
        e.cause
    );
    assert_eq!(device.retry_quarantine().released, 2);
    e.into_token().release().complete().unwrap();
    assert_eq!(binding.used(), 0);
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::unstick`: a map unsticks
/// only what a failed rollback left inside its own range, not the stuck mapping that starts
/// where that range ends.
#[test]
fn a_map_leaves_the_stuck_mapping_right_after_its_range() {
    let model = model();
    let (backend, a, p0, p1) = stuck_after_the_first_granule(&model);
    let unmaps = model.count(DriverCall::MemUnmap);
    backend.map(a, GRANULE, p0, Access::ReadWrite).unwrap();
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "the next one left alone"
    );
    backend.unmap(a, GRANULE).unwrap();
    free_the_stuck_pair(&model, backend, a, p0, p1);
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place` (the lowest-first
/// search): a lowest-first model places each reservation right above the one before.
#[test]
fn lowest_first_reservations_stack_upwards() {
    let model = opened(ModelConfig {
        placement: Placement::LowestFirst,
        ..ModelConfig::default()
    });
    let len = 4 * GRANULE;
    let a = model.mem_address_reserve(len, GRANULE, 0).unwrap();
    let b = model.mem_address_reserve(len, GRANULE, 0).unwrap();
    assert_eq!(a + len as u64, b);
}

/// Kills `src/backend/rules.rs: replace > with >= in Book<P>::check_copy` (its self-copy
/// check): a copy into memory mapped right before the source range, not in it, is no copy of
/// that memory into itself.
#[test]
fn a_copy_into_memory_mapped_just_before_the_source_is_no_self_copy() {
    let sim = sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 2);
    sim.copy_into_phys(granules[0], addr + GRANULE, GRANULE)
        .expect("the source is the second granule only");
    unmap_granules(&sim, addr, granules);
}

/// Kills `src/interop/mod.rs: replace - with + in Allocation<'_, '_, CudaBackend<D>,
/// Diverged>::copy_to_boundary`: a copy into a diverged prefix's private granule that runs
/// past that granule is refused before any driver call.
#[test]
#[should_panic(expected = "do not fit in")]
fn a_copy_past_a_diverged_boundary_panics() {
    let model = model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .commit_prefix()
        .unwrap();
    let mut own = binding
        .reserve(2 * GRANULE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap()
        .diverge()
        .unwrap();
    let _ = own.copy_to_boundary(1, &vec![1; GRANULE]);
}

/// Kills `src/backend/cuda/model.rs: replace DriverModel::fail_from with ()`: a failure planned
/// from the nth call on fails that call and every later one, until cleared.
#[test]
fn a_model_failure_planned_from_a_call_on_lasts_until_cleared() {
    let model = opened(ModelConfig::default());
    model.fail_from(DriverCall::MemAddressReserve, 2, CuError::OUT_OF_MEMORY);
    let first = model.mem_address_reserve(GRANULE, GRANULE, 0).unwrap();
    for _ in 0..3 {
        assert_eq!(
            model.mem_address_reserve(GRANULE, GRANULE, 0),
            Err(CuError::OUT_OF_MEMORY)
        );
    }
    model.clear();
    let second = model.mem_address_reserve(GRANULE, GRANULE, 0).unwrap();
    // SAFETY: both are reservations made above with nothing mapped in them, each freed once.
    unsafe {
        model.mem_address_free(first, GRANULE).unwrap();
        model.mem_address_free(second, GRANULE).unwrap();
    }
}

/// Kills `src/allocation.rs: replace > with >= in Binding<'b, 'id, B>::reserve`: a binding may
/// reserve exactly its backend's whole address space.
#[test]
fn a_reservation_may_take_the_whole_address_space() {
    make_guard!(guard);
    let backend = SimBackend::new(SimConfig {
        address_space: 4 * GRANULE,
        ..SimConfig::strict()
    })
    .unwrap();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let all = binding
        .reserve(4 * GRANULE)
        .expect("exactly the address space");
    assert_eq!(all.len(), 4 * GRANULE);
}

/// Kills `src/backend/cuda/model.rs: replace DriverModel::enqueue_legacy with ()`: a copy from
/// the host is work on the legacy stream, so an event recorded there after it is not done
/// until that work completes (when events do not complete at once).
#[test]
fn a_copy_is_work_an_event_after_it_waits_for() {
    let model = opened(ModelConfig {
        events_complete_at_once: false,
        ..ModelConfig::default()
    });
    let ptr = model.mem_address_reserve(GRANULE, GRANULE, 0).unwrap();
    let handle = model.mem_create(GRANULE, 0).unwrap();
    let event = model.event_create().unwrap();
    // SAFETY: the fresh reservation is unmapped and `handle` is live and `GRANULE` bytes long;
    // the copy stays inside the mapping, which has read-write access; the event is ours; all
    // is given back once, in order, after the work completed.
    unsafe {
        model.mem_map(ptr, GRANULE, 0, handle).unwrap();
        model.mem_set_access(ptr, GRANULE, &[(0, true)]).unwrap();
        model.memcpy_htod(ptr, &[7; 64]).unwrap();
        model.event_record(event, 0).unwrap();
        assert_eq!(
            model.event_query(event),
            Ok(false),
            "the copy has not completed"
        );
        model.complete_work();
        assert_eq!(model.event_query(event), Ok(true));
        model.event_destroy(event).unwrap();
        model.mem_unmap(ptr, GRANULE).unwrap();
        model.mem_release(handle).unwrap();
        model.mem_address_free(ptr, GRANULE).unwrap();
    }
}

/// Kills `src/backend/faulty.rs: replace Outstanding::is_zero -> bool with true`: what a
/// `Faulty` backend counts as handed out is not zero while a reservation is.
#[test]
fn a_faulty_backend_holding_a_reservation_has_something_outstanding() {
    let faulty = Faulty::new(sim(16 * GRANULE as u64));
    let addr = faulty.reserve(GRANULE).unwrap();
    assert!(!faulty.handle().outstanding().is_zero());
    faulty.free(addr, GRANULE).unwrap();
    assert!(faulty.handle().outstanding().is_zero());
}

/// Kills `src/backend/cuda/model.rs: replace && with || in DriverModel::enter`: a call that
/// needs a context is misuse while the primary context is retained but not current.
#[test]
#[should_panic(expected = "no current context")]
fn a_call_with_a_retained_context_not_current_is_misuse() {
    let model = DriverModel::new(ModelConfig::default()).unwrap();
    model.init().unwrap();
    let _ctx = model.primary_ctx_retain(0).unwrap();
    let _ = model.mem_create(GRANULE, 0);
}

/// Kills `src/sharing.rs: replace - with + in Allocation<'_, '_, B, Diverged>::boundary_mut` and
/// `replace <impl Sealed for Diverged>::shared -> Option<&SharedPhys<B::Phys>> with None`: a
/// diverged prefix's writable boundary is exactly its last granule, and it still counts the
/// mappings of the body it shares.
#[test]
fn a_diverged_boundary_is_one_granule() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let page = device.granularity();
    let prefix = binding.reserve(3 * page).unwrap().commit_prefix().unwrap();
    let mut own = binding
        .reserve(3 * page)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap()
        .diverge()
        .unwrap();
    assert_eq!(own.boundary_mut().len(), page);
    assert_eq!(
        (own.mappings(), prefix.mappings()),
        (2, 2),
        "the body is still shared"
    );
}

/// Kills `src/backend/cuda/mod.rs: replace CudaPhys::handle -> u64 with 1` (and `with 0`): each
/// physical allocation answers its own driver handle.
#[test]
fn each_cuda_allocation_answers_its_own_handle() {
    let model = model();
    let (backend, r) = reserved(&model, 2);
    let handles: Vec<u64> = r.iter().map(|&(_, phys)| phys.handle()).collect();
    assert_ne!(handles[0], handles[1]);
    for (addr, phys) in r {
        backend.release(phys, GRANULE).unwrap();
        backend.free(addr, GRANULE).unwrap();
    }
}

/// Kills `src/interop/ipc.rs: replace match guard bytes.len() < MESSAGE_LEN with true in
/// PrefixMessage::decode`: bytes longer than a message are malformed, not truncated.
#[test]
fn bytes_longer_than_a_message_are_malformed() {
    assert!(matches!(
        PrefixMessage::decode(&[0; MESSAGE_LEN + 1]),
        Err(WireError::Malformed("longer than a message"))
    ));
}

/// Kills `src/backend/rules.rs: replace == with != in Book<P>::apply_unmap` and
/// `src/backend/sim.rs: delete ! in <impl Backend for SimBackend>::release`: physical memory
/// released while mapped twice stays known to the book, its bytes with it, until its last
/// mapping goes.
#[test]
fn memory_released_while_mapped_twice_lives_until_its_last_unmap() {
    let sim = SimBackend::new(SimConfig {
        release_while_mapped: true,
        ..SimConfig::strict()
    })
    .unwrap();
    let addr = sim.reserve(2 * GRANULE).unwrap();
    let phys = sim.create(GRANULE).unwrap();
    sim.map(addr, GRANULE, phys, Access::ReadWrite).unwrap();
    sim.map(addr + GRANULE, GRANULE, phys, Access::ReadOnly)
        .unwrap();
    sim.copy_from_host(addr, &[7]).unwrap();
    sim.release(phys, GRANULE).unwrap();
    sim.unmap(addr, GRANULE).unwrap();
    let mut byte = [1];
    sim.copy_to_host(&mut byte, addr + GRANULE)
        .expect("still mapped once");
    assert_eq!(byte, [7], "its bytes live with it");
    sim.unmap(addr + GRANULE, GRANULE).unwrap();
    assert_eq!(sim.physical_in_use(), 0);
    sim.free(addr, 2 * GRANULE).unwrap();
}

/// Kills `src/backend/cuda/model.rs: replace || with && in DriverModel::begin_capture`: a
/// capture cannot begin on the legacy stream (fact 41).
#[test]
#[should_panic(expected = "cannot capture on stream")]
fn a_capture_on_the_legacy_stream_is_misuse() {
    model().begin_capture(0, CaptureMode::Global);
}

/// Kills `src/region.rs: replace < with == in Allocation<'b, 'id, B, Elastic>::undo_grow`: an
/// undone growth gives every granule it took from the cache back to the cache.
#[test]
fn an_undone_growth_from_the_cache_gives_it_all_back() {
    make_guard!(guard);
    let backend = Faulty::new(sim(16 * GRANULE as u64));
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    device.set_cache_cap(3 * GRANULE as u64);
    let mut warm = binding
        .reserve(3 * GRANULE)
        .unwrap()
        .into_region()
        .grow(3)
        .unwrap();
    warm.shrink(3).unwrap();
    warm.release().complete().unwrap();
    assert_eq!(
        device.cached_bytes(),
        3 * GRANULE as u64,
        "setup: three cached"
    );
    let region = binding.reserve(3 * GRANULE).unwrap().into_region();
    faults.fail_nth(Op::Map, 3);
    let e = region
        .grow(3)
        .expect_err("the third map was failed on purpose");
    assert_eq!(
        device.cached_bytes(),
        3 * GRANULE as u64,
        "all back in the cache"
    );
    assert_eq!(faults.calls(Op::Release), 0, "none released");
    e.into_token().release().complete().unwrap();
}

/// Kills `src/backend/host.rs: replace <impl Drop for HostBackend>::drop with ()`: a host
/// backend dropped with a reservation still held (a forgotten token's) gives it back to the OS.
#[test]
fn a_dropped_host_backend_gives_back_what_it_still_reserved() {
    // Another thread's mapping may land in the range at once: one of three tries shows it free.
    let freed = (0..3).any(|_| {
        let host = HostBackend::with_defaults().unwrap();
        let addr = host.reserve(4 * host.granularity()).unwrap();
        assert!(mapped(addr));
        drop(host);
        !mapped(addr)
    });
    assert!(freed, "the reservation went with the backend");
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::overlaps` (both of its
/// comparisons): a copy from a range is not held back by the stuck mappings that end where it
/// starts and start where it ends.
#[test]
fn a_copy_is_not_held_back_by_the_stuck_mappings_beside_it() {
    let model = model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(3 * GRANULE).unwrap();
    let phys: Vec<_> = (0..3).map(|_| backend.create(GRANULE).unwrap()).collect();
    for i in [0, 2] {
        map_stuck(&model, &backend, a + i * GRANULE, phys[i]);
    }
    backend
        .map(a + GRANULE, GRANULE, phys[1], Access::ReadWrite)
        .unwrap();
    let mut bytes = vec![0; GRANULE];
    backend
        .copy_to_host(&mut bytes, a + GRANULE)
        .expect("the middle granule is mapped, with access");
    backend.unmap(a + GRANULE, GRANULE).unwrap();
    backend.free(a, 3 * GRANULE).unwrap();
    for p in phys {
        backend.release(p, GRANULE).unwrap();
    }
}

/// Kills `src/interop/ipc.rs: replace || with && in PrefixMessage::decode`: a granularity that
/// is no power of two is malformed.
#[test]
fn a_granularity_that_is_no_power_of_two_is_malformed() {
    let bytes = PrefixMessage {
        len: 3,
        body_len: 0,
        granularity: 3,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
    .encode();
    assert!(matches!(
        PrefixMessage::decode(&bytes),
        Err(WireError::Malformed("granularity is not a power of two"))
    ));
}

/// Kills `src/backend/sim.rs: replace - with + in <impl Backend for SimBackend>::create`: the
/// simulator creates up to its physical capacity and refuses a granule more, saying none is
/// left.
#[test]
fn the_simulator_creates_up_to_its_capacity() {
    let sim = sim(2 * GRANULE as u64);
    let all = sim.create(2 * GRANULE).unwrap();
    let e = sim.create(GRANULE).expect_err("past the capacity");
    assert!(
        matches!(e.cause, Cause::Exhausted { available: 0, .. }),
        "{e}"
    );
    sim.release(all, 2 * GRANULE).unwrap();
}

/// Kills `src/backend/cuda/model.rs: replace - with + in ModelState::place` and `replace - with /
/// in ModelState::place` in the top-down search's alignment masks: a top-down model honours an
/// alignment larger than the length, for the first reservation and for one placed below
/// another.
#[test]
fn top_down_placement_honours_a_larger_alignment() {
    let model = opened(ModelConfig {
        placement: Placement::TopDown,
        ..ModelConfig::default()
    });
    let align = 4 * GRANULE;
    let a = model.mem_address_reserve(GRANULE, align, 0).unwrap();
    let b = model.mem_address_reserve(GRANULE, align, 0).unwrap();
    assert_eq!(
        (a % align as u64, b % align as u64),
        (0, 0),
        "{a:#x} {b:#x}"
    );
    assert_eq!(b + align as u64, a, "the next aligned place below");
}

/// Kills `src/backend/cuda/model.rs: replace + with - in ModelState::place` (the lowest-first
/// search's check of the window's top): once a reservation fills the window, no other fits.
#[test]
fn a_full_window_places_nothing_more() {
    let model = opened(ModelConfig {
        placement: Placement::LowestFirst,
        ..ModelConfig::default()
    });
    let window = 0x7000_0000_0000;
    let all = model.mem_address_reserve(window, GRANULE, 0).unwrap();
    assert_eq!(all, 0x1000_0000_0000);
    assert!(model.mem_address_reserve(GRANULE, GRANULE, 0).is_err());
}
