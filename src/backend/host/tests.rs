//! The host backend's unit tests: its settings, stores and the calls each makes.

use super::*;

fn bad(config: HostConfig) -> ConfigError {
    HostBackend::new(config).unwrap_err()
}

#[test]
fn a_bad_configuration_is_an_error_not_a_panic() {
    let page = rustix::param::page_size();
    let e = bad(HostConfig {
        granularity: 3 * page,
        ..HostConfig::default()
    });
    assert!(
        matches!(e, ConfigError::GranularityNotPowerOfTwo { .. }),
        "{e}"
    );
    let e = bad(HostConfig {
        granularity: page / 2,
        ..HostConfig::default()
    });
    assert!(
        matches!(e, ConfigError::GranularityBelowPageSize { page_size, .. } if page_size == page),
        "{e}"
    );
    assert!(e.to_string().contains("page size"), "{e}");
    let e = bad(HostConfig {
        physical_capacity: 0,
        ..HostConfig::default()
    });
    assert!(
        matches!(
            e,
            ConfigError::NotAGranularityMultiple {
                what: "physical capacity",
                ..
            }
        ),
        "{e}"
    );
    let e = bad(HostConfig {
        physical_capacity: (1 << 30) + 1,
        ..HostConfig::default()
    });
    assert!(
        matches!(e, ConfigError::NotAGranularityMultiple { .. }),
        "{e}"
    );
    let e = bad(HostConfig {
        address_space: page + 1,
        ..HostConfig::default()
    });
    assert!(
        matches!(
            e,
            ConfigError::NotAGranularityMultiple {
                what: "address space",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("address space"), "{e}");
    let e = bad(HostConfig {
        address_space: usize::MAX & !(page - 1),
        ..HostConfig::default()
    });
    assert!(matches!(e, ConfigError::AddressSpaceTooLarge { .. }), "{e}");
}

/// The heap store with a page's granularity.
fn heap_store() -> HostBackend {
    HostBackend::new(HostConfig {
        memory: HostMemory::Heap,
        ..HostConfig::default()
    })
    .unwrap()
}

/// Memory keeps its bytes while it is not mapped, and shows them wherever it is mapped
/// next; a copy into it lands where it lives (mapped or not). Fails if an unmap does not
/// copy the bytes back, or a map does not copy them in.
#[test]
fn the_heap_store_keeps_the_bytes_of_memory_across_unmap_and_map() {
    let host = heap_store();
    assert_eq!(host.memory(), HostMemory::Heap);
    let g = host.granularity();
    let (a, b) = (host.reserve(g).unwrap(), host.reserve(g).unwrap());
    let phys = host.create(g).unwrap();
    host.map(a, g, phys, Access::ReadWrite).unwrap();
    host.copy_from_host(a + 8, &[1, 2, 3]).unwrap();
    host.unmap(a, g).unwrap();
    host.map(b, g, phys, Access::ReadOnly).unwrap();
    let mut back = [0; 4];
    host.copy_to_host(&mut back, b + 7).unwrap();
    assert_eq!(back, [0, 1, 2, 3], "the bytes followed the memory");
    // A copy into other memory, first unmapped, then mapped.
    let other = host.create(g).unwrap();
    host.copy_into_phys(other, b, g).unwrap();
    host.map(a, g, other, Access::ReadWrite).unwrap();
    host.copy_to_host(&mut back, a + 7).unwrap();
    assert_eq!(back, [0, 1, 2, 3], "copied into the unmapped memory");
    host.copy_from_host(a + 8, &[9]).unwrap();
    host.unmap(b, g).unwrap();
    host.copy_into_phys(phys, a, g).unwrap();
    host.map(b, g, phys, Access::ReadOnly).unwrap();
    host.copy_to_host(&mut back, b + 7).unwrap();
    assert_eq!(back, [0, 9, 2, 3], "copied from the mapped memory");
    host.unmap(a, g).unwrap();
    host.unmap(b, g).unwrap();
    host.release(phys, g).unwrap();
    host.release(other, g).unwrap();
    assert_eq!(host.physical_in_use(), 0);
    assert_eq!(
        host.state().heap.live(),
        (2, 0),
        "the buffers went with their release"
    );
    host.free(a, g).unwrap();
    host.free(b, g).unwrap();
    assert_eq!(
        host.state().heap.live(),
        (0, 0),
        "the reservations went with their free"
    );
}

/// Memory created and released over and over, more times than the store holds at once: each
/// release gives its range of the store back, on every store (the memfd, the anonymous
/// mapping, the heap), so no create is refused for the ranges of memory released before.
#[test]
#[cfg_attr(
    miri,
    ignore = "needs a memfd or the anonymous store (Miri has the heap store only)"
)]
fn memory_released_gives_its_range_of_the_store_back() {
    for memory in [HostMemory::Memfd, HostMemory::Anonymous, HostMemory::Heap] {
        let g = 4 << 10;
        let Ok(host) = HostBackend::new(HostConfig {
            physical_capacity: 4 * g as u64,
            memory,
            ..HostConfig::default()
        }) else {
            assert_eq!(
                memory,
                HostMemory::Memfd,
                "only a memfd may be refused here"
            );
            continue; // a sandbox without memfd_create
        };
        for round in 0..12 {
            let phys = host
                .create(g)
                .unwrap_or_else(|e| panic!("{memory:?}, round {round}: {e}"));
            host.release(phys, g).unwrap();
        }
        let all: Vec<_> = (0..4).map(|_| host.create(g).unwrap()).collect();
        assert!(
            host.create(g).is_err(),
            "{memory:?}: the capacity still binds"
        );
        for phys in all {
            host.release(phys, g).unwrap();
        }
        assert_eq!(host.physical_in_use(), 0);
    }
}

/// What the heap store's backend gives back as it drops: every reservation still live, the
/// ones kept for good too (nothing outside the process can reach heap memory). Fails if the
/// drop's sweep gives back nothing (the reservations would leak, as Miri's leak check says).
#[test]
fn the_heap_stores_drop_gives_back_every_reservation_left() {
    let host = heap_store();
    let g = host.granularity();
    let (a, b) = (host.reserve(g).unwrap(), host.reserve(2 * g).unwrap());
    host.keep_for_good(b, 2 * g);
    assert_eq!(host.state().heap.live(), (2, 0));
    super::heap::drop_all(&mut host.state().heap);
    assert_eq!(
        host.state().heap.live(),
        (0, 0),
        "a reservation left at the drop was not given back (a at {a:#x}, b at {b:#x})"
    );
}

/// What needs one memory at two addresses is refused by name: a second mapping of mapped
/// memory, and export; reservations are aligned to the granularity.
#[test]
fn the_heap_store_maps_no_memory_twice_and_says_so() {
    // Above the page size, so that alignment is the store's doing (small: Miri copies
    // every byte it tracks).
    let page = rustix::param::page_size();
    let host = HostBackend::new(HostConfig {
        memory: HostMemory::Heap,
        granularity: 16 * page,
        physical_capacity: 64 * page as u64,
        ..HostConfig::default()
    })
    .unwrap();
    assert_eq!(host.lacks(Ability::MapTwice), Some(heap::HEAP));
    assert_eq!(host.lacks(Ability::Export), Some(heap::HEAP));
    assert_eq!(host.lacks(Ability::SuspendInPlace), None);
    let g = host.granularity();
    let (a, b) = (host.reserve(g).unwrap(), host.reserve(2 * g).unwrap());
    assert_eq!((a % g, b % g), (0, 0), "aligned to the granularity");
    let phys = host.create(g).unwrap();
    host.map(a, g, phys, Access::ReadWrite).unwrap();
    let e = host.map(b, g, phys, Access::ReadOnly).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Unsupported { mechanism, .. } if mechanism == heap::HEAP),
        "{e}"
    );
    host.unmap(a, g).unwrap();
    host.release(phys, g).unwrap();
    host.free(a, g).unwrap();
    // `b` is left reserved: the backend's drop gives it back.
}

#[test]
#[cfg_attr(miri, ignore = "a memfd, which Miri lacks")]
fn an_os_refusal_of_the_memfd_carries_the_os_error() {
    // No file may be 2^63 bytes long: `ftruncate` fails, and the error says why.
    let e = bad(HostConfig {
        physical_capacity: 1 << 63,
        ..HostConfig::default()
    });
    assert!(matches!(e, ConfigError::Memfd { .. }), "{e}");
    assert!(std::error::Error::source(&e).is_some(), "{e:?}");
}

/// Whether any page of `[addr, addr + len)` is mapped (by anything): `msync` of one page
/// fails with `ENOMEM` where nothing is.
fn any_mapped(addr: Addr, len: usize) -> bool {
    let page = rustix::param::page_size();
    (addr..addr + len).step_by(page).any(|at| {
        // SAFETY: an asynchronous `msync` only schedules write-back of what is mapped
        // there; it changes no mapping and no byte.
        unsafe { rustix::mm::msync(at as *mut _, page, rustix::mm::MsyncFlags::ASYNC) }.is_ok()
    })
}

#[test]
#[cfg_attr(miri, ignore = "raw mmap and msync, which Miri lacks")]
fn a_reservation_never_lands_in_the_hole_of_a_poisoned_one() {
    let host = HostBackend::with_defaults().unwrap();
    // Large, so that the kernel finds few higher gaps to offer first; each request is half
    // of it, so that it fits there even when the kernel aligns it to 2 MiB (THP).
    let hole = 64 << 20;
    let len = hole / 2;
    let outer = host.reserve(3 * hole).unwrap();
    let at = outer + hole;
    {
        // What a failed `MAP_FIXED` whose placeholder could not be put back leaves behind:
        // a poisoned reservation with a hole in it, which the kernel may hand out again.
        let mut s = host.state();
        s.book.poison(at, hole);
        // SAFETY: the middle of a reservation of this backend, which nothing references;
        // it is poisoned, so the backend never touches it again.
        unsafe { rustix::mm::munmap(at as *mut _, hole) }.unwrap();
    }
    // (Not asserted empty now: another test thread may map into the hole at any time —
    // what follows holds whoever fills it.)
    // The kernel places a new mapping in the highest gap that fits: sooner or later in
    // the hole. What it offers there is kept as a plug and never handed out.
    let mut reserved = Vec::new();
    for _ in 0..64 {
        match host.reserve(len) {
            Ok(addr) => reserved.push(addr),
            Err(e) => assert!(
                matches!(e.cause, Cause::Violation(Violation::Poisoned { .. })),
                "{e}"
            ),
        }
        if any_mapped(at, hole) {
            break;
        }
    }
    assert!(any_mapped(at, hole), "the kernel never offered the hole");
    for &addr in &reserved {
        assert!(addr + len <= outer || outer + 3 * hole <= addr, "{addr:#x}");
    }
    for addr in reserved {
        host.free(addr, len).unwrap();
    }
    let e = host.free(outer, 3 * hole).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Violation(Violation::Poisoned { .. })),
        "{e}"
    );
}

#[test]
fn a_handle_of_another_host_backend_is_unknown_here() {
    let (a, b) = (
        HostBackend::with_defaults().unwrap(),
        HostBackend::with_defaults().unwrap(),
    );
    let g = a.granularity();
    let (pa, pb) = (a.create(g).unwrap(), b.create(g).unwrap());
    let e = b.release(pa, g).unwrap_err();
    assert_eq!(e.cause, Cause::Violation(Violation::UnknownPhys));
    assert_eq!(b.physical_in_use(), g as u64);
    a.release(pa, g).unwrap();
    b.release(pb, g).unwrap();
}

#[test]
fn an_unpin_without_a_pin_is_refused() {
    let host = HostBackend::with_defaults().unwrap();
    let e = host.unpin().unwrap_err();
    assert_eq!(e.cause, Cause::Violation(Violation::NotPinned));
    host.pin().unwrap();
    host.unpin().unwrap();
    assert!(host.unpin().is_err());
}

#[test]
fn a_reservation_past_the_address_space_is_exhausted() {
    let page = rustix::param::page_size();
    let host = HostBackend::new(HostConfig {
        address_space: 4 * page,
        ..HostConfig::default()
    })
    .unwrap();
    let e = host.reserve(8 * page).unwrap_err();
    assert!(matches!(e.cause, Cause::AddressSpace { requested, .. } if requested == 8 * page));
    let addr = host.reserve(4 * page).unwrap();
    host.free(addr, 4 * page).unwrap();
}

/// Kills `keep_for_good` emptied (a mutant of the NIXL run: memory exposed to a transfer
/// engine's peer that never said it was done is kept for good through it): a range kept for
/// good is never freed, and the backend's drop leaves it mapped — whatever a late peer writes
/// there lands in memory this process still owns. Fails if the range can be freed.
#[test]
#[cfg_attr(miri, ignore = "raw mmap and msync, which Miri lacks")]
fn a_range_kept_for_good_is_never_freed_nor_unmapped() {
    let host = HostBackend::with_defaults().unwrap();
    let g = host.granularity();
    let kept = host.reserve(g).unwrap();
    host.keep_for_good(kept, g);
    let e = host.free(kept, g).expect_err("kept for good");
    assert!(
        matches!(e.cause, Cause::Violation(Violation::Poisoned { .. })),
        "{e}"
    );
    drop(host);
    assert!(
        any_mapped(kept, g),
        "the drop unmapped a range kept for good"
    );
}
