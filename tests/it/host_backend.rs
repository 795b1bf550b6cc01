//! The host backend's own promises, below the token layer: the OS page size and granularity,
//! physical memory counted up to its capacity and given back on release, the files it holds
//! open (closed on `exec`), imports that may claim all of an exported file and no more, and
//! address space given back to the OS (the slack of an aligned reservation at once, what a
//! dropped backend still held when it goes).

use crate::common::GRANULE;
use memtoken::backend::{
    Access, Backend, Cause, Exportable, HostBackend, HostConfig, HostMemory, Op, PosixFd,
    Shareable, Violation,
};

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

/// Kills `src/backend/host.rs: replace HostBackend::page_size -> usize with 0` (and `with 1`):
/// the page size is the OS's, no larger than the granularity.
#[test]
fn the_host_backend_says_the_os_page_size() {
    let host = HostBackend::with_defaults().unwrap();
    let page = host.page_size();
    assert_eq!(page, rustix::param::page_size());
    assert!(page <= host.granularity(), "{page}");
}

/// The host backend withholds nothing (no graph can use its memory): `Backend::withheld` says
/// no for any range, mapped or given back, so a pool may hand any part of it to a new owner.
/// And it maps at reserved addresses, so `Backend::placed` says memory lives where it was
/// reserved. Fails if either default answer changes (withholds, or places elsewhere).
#[test]
fn the_host_backend_withholds_nothing_and_places_at_the_reservation() {
    let host = HostBackend::with_defaults().unwrap();
    let g = host.granularity();
    let addr = host.reserve(g).unwrap();
    let phys = host.create(g).unwrap();
    host.map(addr, g, phys, Access::ReadWrite).unwrap();
    assert!(!host.withheld(addr, g), "mapped");
    assert_eq!(host.placed(addr, phys), addr, "where it was reserved");
    host.unmap(addr, g).unwrap();
    host.release(phys, g).unwrap();
    assert!(!host.withheld(addr, g), "given back");
    host.free(addr, g).unwrap();
}

/// Set in the child process of [`a_copy_the_file_takes_in_part_goes_on_where_it_stopped`].
const SHORT_WRITE_CHILD: &str = "MEMTOKEN_SHORT_WRITE_CHILD";

/// A copy into memory of the `memfd` store that `pwrite` takes in part goes on from where the
/// part ended: under a file-size limit (`RLIMIT_FSIZE`) half a granule past the store's start,
/// the first `pwrite` of a granule at offset 0 writes half, and the second, from the half, is
/// refused (`EFBIG`), so the copy fails. Run in a child process (the limit is the process's),
/// started through `sh` to ignore `SIGXFSZ`, which would otherwise kill it. Fails if the
/// offset does not move on by what was written (`copy_into_phys`' `at += n` → `*=` writes the
/// second half over the first and succeeds; `-=` wraps below 0).
#[test]
#[cfg_attr(miri, ignore = "runs a child process with a file-size limit")]
fn a_copy_the_file_takes_in_part_goes_on_where_it_stopped() {
    const NAME: &str = "host_backend::a_copy_the_file_takes_in_part_goes_on_where_it_stopped";
    if std::env::var_os(SHORT_WRITE_CHILD).is_none() {
        let out = std::process::Command::new("sh")
            .args(["-c", "trap '' XFSZ; exec \"$0\" \"$@\""])
            .arg(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(SHORT_WRITE_CHILD, "1")
            .output()
            .expect("run this test binary as a child");
        let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(said.contains("1 passed"), "the child ran the test: {said}");
        return;
    }
    let host = HostBackend::new(HostConfig {
        memory: HostMemory::Memfd,
        ..HostConfig::default()
    })
    .unwrap();
    let g = host.granularity();
    let into = host.create(g).unwrap(); // the store's first range: at offset 0 of its file
    let from = host.create(g).unwrap();
    let addr = host.reserve(g).unwrap();
    host.map(addr, g, from, Access::ReadWrite).unwrap();
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Fsize);
    setrlimit(
        Resource::Fsize,
        Rlimit {
            current: Some(g as u64 / 2),
            maximum: limit.maximum,
        },
    )
    .unwrap();
    let copied = host.copy_into_phys(into, addr, g);
    setrlimit(Resource::Fsize, limit).unwrap();
    let e = copied.expect_err("the second half is past the file-size limit");
    assert_eq!(e.op, Op::Copy, "{e}");
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

/// Kills `src/backend/host.rs: replace - with + in <impl Backend for HostBackend>::create`: a
/// create refused because no free range is long enough, though enough bytes are free in
/// pieces, says how many bytes are free.
#[test]
#[cfg_attr(
    miri,
    ignore = "the memfd store's physical ranges: the heap store (Miri's) makes each memory a buffer of its own, so nothing fragments"
)]
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

/// Kills `src/backend/host.rs: replace -= with += in <impl Backend for HostBackend>::release`:
/// releasing an exportable allocation (a file of its own) gives its bytes back too.
#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
fn a_host_exportable_release_gives_back_its_bytes() {
    let host = HostBackend::with_defaults().unwrap();
    let page = host.granularity();
    let phys = Exportable::<PosixFd>::create_exportable(&host, 2 * page).unwrap();
    assert_eq!(host.physical_in_use(), 2 * page as u64);
    host.release(phys, 2 * page).unwrap();
    assert_eq!(host.physical_in_use(), 0);
}

/// Kills `src/backend/host.rs: replace HostBackend::open_files -> usize with 1`: the host
/// counts the files it holds open, from none.
#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
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
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
fn an_exported_descriptor_is_closed_on_exec() {
    let (host, page) = host_of_pages(4);
    let phys = host.create_exportable(page).unwrap();
    let handle = host.export(phys, page).unwrap();
    let flags = rustix::io::fcntl_getfd(&handle.fd).unwrap();
    assert!(flags.contains(rustix::io::FdFlags::CLOEXEC), "{flags:?}");
    drop(handle);
    host.release(phys, page).unwrap();
}

/// Kills `src/backend/host.rs: replace > with < in <impl Exportable<PosixFd> for
/// HostBackend>::import`: a host import may claim all of an exported file, and is refused when
/// it claims more.
#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
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

/// Kills `src/backend/host.rs: replace + with - in <impl Backend for HostBackend>::reserve`:
/// a host reservation aligned to a granularity larger than the page trims the slack it
/// over-reserved after its end (and only there), so nothing past the reservation stays mapped.
#[test]
#[cfg_attr(
    miri,
    ignore = "reads the kernel's mappings (/proc/self/maps): Miri's heap store has none"
)]
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

/// Kills `src/backend/host.rs: replace <impl Drop for HostBackend>::drop with ()`: a host
/// backend dropped with a reservation still held (a forgotten token's) gives it back to the OS.
#[test]
#[cfg_attr(
    miri,
    ignore = "reads the kernel's mappings (/proc/self/maps): Miri's heap store has none"
)]
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

/// Kills `src/backend/rules/mod.rs: replace > with >= in Book<P>::check_copy`: a copy of no bytes
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

// ---- The anonymous store: the host backend where `memfd_create` is refused. ----

/// A host backend on the anonymous store (as where `memfd_create` is refused).
fn anonymous() -> HostBackend {
    HostBackend::new(HostConfig {
        memory: memtoken::backend::HostMemory::Anonymous,
        ..HostConfig::default()
    })
    .unwrap()
}

/// Without a `memfd`, the host backend still does what VMM does — a granule mapped at two
/// addresses shows the same bytes (a prefix and its sharer), a region grows and shrinks
/// through the cache, memory suspended with its bytes comes back with them, copy-on-write
/// copies into the store, a release gives the pages back — and says which store it runs on.
/// Fails if a map copies the pages instead of sharing them, a copy into the store is lost, or
/// a release keeps the pages.
#[test]
#[cfg_attr(
    miri,
    ignore = "the anonymous store: Miri has no shared or fixed mappings"
)]
fn without_a_memfd_the_host_shares_grows_sleeps_and_gives_back() {
    use memtoken::{Budget, Device, make_guard};
    let backend = anonymous();
    assert_eq!(backend.memory(), memtoken::backend::HostMemory::Anonymous);
    make_guard!(guard);
    let device = Device::new(guard, backend);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    // A prefix and its sharer map the same pages.
    let mut prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    prefix.as_mut_slice().expect("no sharer yet")[g + 5] = 42;
    let sharer = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    assert_eq!(sharer.as_slice()[g + 5], 42, "one granule at two addresses");
    // Copy-on-write copies the boundary granule into memory of the sharer's own.
    let sharer = sharer.diverge().unwrap();
    assert_eq!(sharer.as_slice()[g + 5], 42, "copied into the store");
    // A region through the cache.
    let mut region = binding.reserve(4 * g).unwrap().into_region();
    region.grow(3).unwrap();
    region.as_mut_slice()[3 * g - 1] = 7;
    region.shrink(2).unwrap();
    region.grow(2).unwrap();
    // Sleep and wake with the bytes.
    let mut a = binding.reserve(g).unwrap().commit().unwrap();
    a.as_mut_slice()[0] = 9;
    let a = a.suspend_saving().unwrap().resume().unwrap();
    assert_eq!(a.as_slice()[0], 9, "restored through the store");
    drop((a, region, sharer, prefix));
    drop(binding);
    assert!(device.close().is_clean());
    // A release gives the pages back: a new allocation over the same range reads zeros.
    let host = anonymous();
    let addr = host.reserve(g).unwrap();
    let phys = host.create(g).unwrap();
    host.map(addr, g, phys, Access::ReadWrite).unwrap();
    host.copy_from_host(addr, &[1; 64]).unwrap();
    host.unmap(addr, g).unwrap();
    host.release(phys, g).unwrap();
    let again = host.create(g).unwrap();
    host.map(addr, g, again, Access::ReadWrite).unwrap();
    let mut seen = [0xff; 64];
    host.copy_to_host(&mut seen, addr).unwrap();
    assert_eq!(seen, [0; 64], "the released pages went back");
    host.unmap(addr, g).unwrap();
    host.release(again, g).unwrap();
    host.free(addr, g).unwrap();
    assert_eq!(host.physical_in_use(), 0);
}

/// Without a `memfd` there is no file to send: memory created exportable is refused with an
/// error naming the capability and the mechanism, and nothing is created. Fails if the store
/// silently hands out a `memfd` anyway, or an error that does not say why.
#[test]
#[cfg_attr(
    miri,
    ignore = "the anonymous store: Miri has no shared or fixed mappings"
)]
fn without_a_memfd_export_is_refused_naming_what_cannot_be_done() {
    let host = anonymous();
    let g = host.granularity();
    let e = Exportable::<PosixFd>::create_exportable(&host, g).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Unsupported { .. }),
        "{e}: the capability is missing, not a passing failure"
    );
    let said = e.to_string();
    assert!(
        said.contains("export") && said.contains("anonymous"),
        "{said}"
    );
    assert_eq!(
        host.lacks(memtoken::backend::Ability::Export),
        Some("the host's anonymous store (memfd_create refused or not asked for)"),
        "said once, up front"
    );
    assert_eq!((host.physical_in_use(), host.open_files()), (0, 0));
}

/// The permissions of the mapping that covers `addr` (from `/proc/self/maps`: `rw-s`, `r--s`).
fn permissions(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let covering = maps.lines().find(|line| {
        let range = line.split_whitespace().next().unwrap();
        let (start, end) = range.split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        (start..end).contains(&addr)
    });
    covering
        .expect("mapped")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_owned()
}

/// On the anonymous store a map inherits the store's read-write protection until the backend
/// sets the mapping's own: a read-only map (a sharer's) is read-only in the process's page
/// tables, and shows the same pages as the read-write one. Fails without the `mprotect`.
#[test]
#[cfg_attr(
    miri,
    ignore = "the anonymous store: Miri has no shared or fixed mappings"
)]
fn without_a_memfd_a_read_only_map_is_read_only_in_the_page_tables() {
    let host = anonymous();
    let g = host.granularity();
    let phys = host.create(g).unwrap();
    let (rw, ro) = (host.reserve(g).unwrap(), host.reserve(g).unwrap());
    host.map(rw, g, phys, Access::ReadWrite).unwrap();
    host.map(ro, g, phys, Access::ReadOnly).unwrap();
    assert_eq!(
        (permissions(rw), permissions(ro)),
        ("rw-s".into(), "r--s".into())
    );
    host.copy_from_host(rw, &[5; 16]).unwrap();
    let mut seen = [0; 16];
    host.copy_to_host(&mut seen, ro).unwrap();
    assert_eq!(seen, [5; 16], "the same pages");
    for at in [rw, ro] {
        host.unmap(at, g).unwrap();
        host.free(at, g).unwrap();
    }
    host.release(phys, g).unwrap();
}

/// On the heap store (Miri's), a device sleeps and wakes memory with its bytes, and refuses a
/// shared prefix, naming what the store cannot do — the device reads each ability the store
/// lacks for itself. Fails if the device takes one ability's answer for another's (then sleep
/// is refused too, as the store lacks sharing).
#[test]
fn on_the_heap_store_memory_sleeps_and_wakes_but_no_prefix_is_shared() {
    use memtoken::backend::HostMemory;
    use memtoken::{Budget, Device, make_guard};
    let host = HostBackend::new(HostConfig {
        memory: HostMemory::Heap,
        ..HostConfig::default()
    })
    .unwrap();
    let g = host.granularity();
    make_guard!(guard);
    let device = Device::new(guard, host);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(2 * g).unwrap().commit().unwrap();
    a.as_mut_slice()[g + 1] = 7;
    let addr = a.addr();
    let a = a.suspend_saving().unwrap().resume().unwrap();
    assert_eq!(
        (a.addr(), a.as_slice()[g + 1]),
        (addr, 7),
        "woke with its bytes"
    );
    let e = binding.reserve(g).unwrap().commit_prefix().unwrap_err();
    let why = format!("{e:?}");
    assert!(why.contains("two addresses"), "{why}");
    assert!(why.contains("heap store"), "{why}");
    drop((e, a));
    drop(binding);
    assert!(device.close().is_clean());
}
