//! Shared prefixes: real aliasing on the host, read-only sharers, teardown order, copy-on-write
//! of the boundary granule, and exactly-once accounting of shared physical memory.

use crate::common::gate::{Gate, GateHandle};
use crate::common::{self, GRANULE, assert_no_cause_repeated, messages, says_first};
use memtoken::backend::{
    HostBackend, HostConfig, Op, PosixFd,
    doubles::{Faulty, SimBackend},
};
use memtoken::{
    Budget, Device, TransitionError, errors::CommitFailure, errors::CowFailure, errors::Returned,
    errors::ShareFailure, make_guard,
};

const PAGE: usize = 4096;

/// What `/proc/self/maps` says of the page at `addr`: (perms, file offset of that page, path).
/// The kernel may merge adjacent mappings into one line, so the offset is computed from the
/// line that contains `addr`.
fn proc_map(addr: usize) -> (String, u64, String) {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("procfs");
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next().unwrap().split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        if (start..end).contains(&addr) {
            let perms = fields.next().unwrap().to_string();
            let offset = u64::from_str_radix(fields.next().unwrap(), 16).unwrap();
            let path = fields.skip(2).collect::<Vec<_>>().join(" ");
            return (perms, offset + (addr - start) as u64, path);
        }
    }
    panic!("no mapping contains {addr:#x}");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn sharers_alias_the_owners_physical_pages_read_only() {
    make_guard!(guard);
    let backend = Faulty::new(crate::common::host());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let owner = device.bind(Budget::unlimited()).unwrap();
    let sharer = device.bind(Budget::bytes(0)).unwrap(); // sharing costs no owned bytes

    let mut prefix = owner.reserve(3 * PAGE).unwrap().commit_prefix().unwrap();
    let prompt: Vec<u8> = (0..3 * PAGE).map(|i| (i % 251) as u8).collect();
    prefix
        .as_mut_slice()
        .expect("no sharer yet")
        .copy_from_slice(&prompt);
    let physical_before = faults.outstanding().physical;

    let sharers: Vec<_> = (0..4)
        .map(|_| {
            sharer
                .reserve(3 * PAGE)
                .unwrap()
                .map_prefix(&prefix)
                .unwrap()
        })
        .collect();
    assert_eq!(
        faults.outstanding().physical,
        physical_before,
        "no physical memory created"
    );
    assert_eq!(prefix.mappings(), 5);
    assert!(
        prefix.as_mut_slice().is_none(),
        "the owner cannot write while shared"
    );

    let (owner_perms, owner_offset, owner_path) = proc_map(prefix.addr());
    assert_eq!(&owner_perms, "rw-s");
    for s in &sharers {
        assert_ne!(s.addr(), prefix.addr());
        assert_eq!(
            s.as_slice(),
            &prompt[..],
            "every sharer reads the owner's bytes"
        );
        // Body and boundary granule are two mappings of the same memfd pages as the owner's.
        let (perms, offset, path) = proc_map(s.addr());
        assert_eq!(
            perms, "r--s",
            "the sharer's mapping is read-only at run time"
        );
        assert_eq!(
            (offset, &path),
            (owner_offset, &owner_path),
            "same physical pages"
        );
        let (perms, offset, _) = proc_map(s.addr() + 2 * PAGE);
        assert_eq!(
            (perms.as_str(), offset),
            ("r--s", owner_offset + 2 * PAGE as u64)
        );
    }
    let l = device.ledger();
    assert_eq!(
        l.owned_bytes,
        3 * PAGE as u64,
        "owned once, whatever the number of sharers"
    );
    assert_eq!(
        l.mapped_bytes,
        5 * 3 * PAGE as u64,
        "mapped once per mapping"
    );
    assert_eq!(sharer.used(), 0);
}

#[test]
fn shared_memory_lives_as_long_as_its_last_mapping_and_is_released_once() {
    make_guard!(guard);
    let sim = SimBackend::strict();
    let device = Device::new(guard, Faulty::new(sim.clone()));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let a = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    let b = binding.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    let releases = || sim.calls().iter().filter(|c| c.op == Op::Release).count();

    let releasing = prefix.release();
    assert!(releasing.is_ready(), "fences complete at once");
    releasing.complete().unwrap();
    assert_eq!(
        binding.used(),
        0,
        "the owner's budget no longer carries the prefix"
    );
    assert_eq!(
        device.ledger().owned_bytes,
        2 * g as u64,
        "the device still holds it"
    );
    assert_eq!(device.custody().shared.shared_refs, 2);
    drop(a);
    assert_eq!((releases(), sim.physical_in_use()), (0, 2 * g as u64));
    b.release().complete().unwrap();
    assert_eq!(
        (releases(), sim.physical_in_use()),
        (2, 0),
        "its two allocations (body and boundary granule) released exactly once each, with the \
         last mapping"
    );
    assert!(device.ledger().is_zero());
    assert_eq!(device.custody().shared.count, 0);
}

#[test]
fn dropping_a_sequence_unmaps_its_prefix_before_the_binding_unpins() {
    struct Sequence<'b, 'id> {
        prefix: memtoken::sharing::PrefixMapping<'b, 'id, SimBackend>,
        pages: Vec<memtoken::Allocation<'b, 'id, SimBackend, memtoken::Committed>>,
    }
    make_guard!(guard);
    let sim = SimBackend::strict();
    let device = Device::new(guard, sim.clone());
    let g = device.granularity();
    let system = device.bind(Budget::unlimited()).unwrap();
    let prompt = system.reserve(2 * g).unwrap().commit_prefix().unwrap();
    {
        let session = device.bind(Budget::unlimited()).unwrap();
        let seqs: Vec<Sequence> = (0..3)
            .map(|_| Sequence {
                prefix: session.reserve(2 * g).unwrap().map_prefix(&prompt).unwrap(),
                pages: vec![session.reserve(g).unwrap().commit().unwrap()],
            })
            .collect();
        let prefix_ranges: Vec<usize> = seqs.iter().map(|s| s.prefix.addr()).collect();
        assert_eq!(seqs[0].pages.len(), 1);
        let start = sim.calls().len();
        drop(seqs);
        drop(session); // the compiler refuses this line above `drop(seqs)` (ui-tests)
        let calls = &sim.calls()[start..];
        let unpin = calls
            .iter()
            .position(|c| c.op == Op::Unpin)
            .expect("the pin is released");
        for addr in prefix_ranges {
            let unmap = calls
                .iter()
                .position(|c| c.op == Op::Unmap && c.addr == addr)
                .expect("every prefix mapping is unmapped");
            assert!(
                unmap < unpin,
                "prefix at {addr:#x} unmapped after the pin's release"
            );
        }
        assert_eq!(unpin, calls.len() - 1, "the unpin is the last call");
    }
    drop(prompt);
    drop(system);
    assert!(device.close().is_clean());
}

#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn copy_on_write_gives_one_sharer_a_private_boundary_granule() {
    make_guard!(guard);
    let backend = Faulty::new(crate::common::host());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(2 * PAGE).unwrap().commit_prefix().unwrap();
    prefix.as_mut_slice().unwrap().fill(7);
    let a = binding
        .reserve(2 * PAGE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    let b = binding
        .reserve(2 * PAGE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    let owned_before = device.ledger().owned_bytes;
    let used_before = binding.used();

    let mut a = a.diverge().unwrap();
    assert_eq!(a.boundary_offset(), PAGE);
    assert!(
        a.as_slice().iter().all(|&x| x == 7),
        "the copy holds the old bytes"
    );
    a.boundary_mut()[100..200].fill(9);
    assert!(a.as_slice()[PAGE + 100..PAGE + 200].iter().all(|&x| x == 9));
    assert!(a.as_slice()[PAGE + 200..].iter().all(|&x| x == 7));
    assert!(
        b.as_slice().iter().all(|&x| x == 7),
        "the other sharer still sees the original"
    );
    assert!(
        prefix.as_slice().iter().all(|&x| x == 7),
        "so does the owner"
    );
    assert_eq!(
        device.ledger().owned_bytes,
        owned_before + PAGE as u64,
        "one extra granule"
    );
    assert_eq!(binding.used(), used_before + PAGE as u64);
    assert_eq!(
        proc_map(a.addr() + PAGE).0,
        "rw-s",
        "the private granule is writable"
    );
    assert_eq!(
        proc_map(a.addr()).0,
        "r--s",
        "the body is still shared read-only"
    );
    assert_eq!(
        prefix.mappings(),
        3,
        "the diverged sharer still maps the body"
    );

    drop((a, b, prefix));
    assert!(device.ledger().is_zero());
    assert_eq!(binding.used(), 0);
    drop(binding);
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

#[test]
fn a_sharers_failed_unmap_quarantines_that_sharers_range_only() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let prefix = binding.reserve(g).unwrap().commit_prefix().unwrap();
    let a = binding.reserve(g).unwrap().map_prefix(&prefix).unwrap();
    let b = binding.reserve(g).unwrap().map_prefix(&prefix).unwrap();
    let a_addr = a.addr();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        ..
    }) = a.release().complete()
    else {
        panic!("the unmap was failed on purpose");
    };
    let r = quarantined.residual();
    assert_eq!(r.range(), (a_addr, g));
    assert!(r.holds_shared() && r.holds_va());
    assert_eq!(r.mapped_bytes(), g);
    assert_eq!(
        prefix.mappings(),
        3,
        "the quarantined mapping keeps its reference"
    );
    drop(prefix);
    b.release().complete().unwrap();
    assert_eq!(
        device.ledger().owned_bytes,
        g as u64,
        "still mapped by the quarantined sharer"
    );
    quarantined.retry().unwrap();
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_refused_share_returns_the_reservation_unchanged() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let prefix = binding.reserve(2 * g).unwrap().commit_prefix().unwrap();

    let Err(TransitionError {
        token: Returned::Unchanged(token),
        cause,
    }) = binding.reserve(g).unwrap().map_prefix(&prefix)
    else {
        panic!("sizes differ");
    };
    assert_eq!(
        cause,
        ShareFailure::SizeMismatch {
            reservation: g,
            prefix: 2 * g
        }
    );
    drop(token);
    for nth in [1, 2] {
        faults.fail_nth(Op::Map, nth);
        let reserved = binding.reserve(2 * g).unwrap();
        let generation = reserved.generation();
        let Err(TransitionError {
            token: Returned::Unchanged(token),
            ..
        }) = reserved.map_prefix(&prefix)
        else {
            panic!("map #{nth} was failed on purpose");
        };
        assert_eq!(token.generation(), generation);
        assert_eq!(prefix.mappings(), 1, "no reference left behind");
        assert_eq!(
            device.ledger().mapped_bytes,
            2 * g as u64,
            "only the owner's mapping"
        );
    }
    // Boundary map fails and undoing the body fails too: the remains are quarantined.
    faults.fail_nth(Op::Map, 2);
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause: ShareFailure::RollbackFailed { error, rollback },
    }) = binding.reserve(2 * g).unwrap().map_prefix(&prefix)
    else {
        panic!("both failed on purpose");
    };
    assert_eq!((error.op, rollback.op), (Op::Map, Op::Unmap));
    assert_eq!(quarantined.residual().mapped_bytes(), g);
    assert_eq!(prefix.mappings(), 2);
    quarantined.retry().unwrap();
    assert_eq!(prefix.mappings(), 1);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn a_refused_copy_on_write_leaves_the_mapping_shared_and_nothing_charged() {
    make_guard!(guard);
    let backend = Faulty::new(HostBackend::new(HostConfig::default()).unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(2 * PAGE).unwrap().commit_prefix().unwrap();
    prefix.as_mut_slice().unwrap().fill(5);
    let mut shared = binding
        .reserve(2 * PAGE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    let before = (device.ledger(), binding.used(), faults.outstanding());
    for (op, nth) in [(Op::Create, 1), (Op::Copy, 1), (Op::Map, 1)] {
        faults.fail_nth(op, nth);
        let Err(err) = shared.diverge() else {
            panic!("{op:?} was failed on purpose");
        };
        assert_no_cause_repeated(&err.cause);
        let TransitionError {
            token: Returned::Unchanged(token),
            cause: CowFailure::Private(cause),
        } = err
        else {
            panic!("{op:?} failed alone: the mapping comes back unchanged");
        };
        let chain = messages(&cause);
        assert!(
            chain.iter().any(|m| m.contains(&format!("{op:?}"))),
            "{chain:?}"
        );
        shared = token;
        assert_eq!(
            (device.ledger(), binding.used(), faults.outstanding()),
            before,
            "after {op:?}"
        );
        assert!(shared.as_slice().iter().all(|&x| x == 5));
        assert_eq!(proc_map(shared.addr() + PAGE).0, "r--s");
    }
    // A failed unmap leaves the boundary's state unknown: the mapping is quarantined whole,
    // lending no memory any more; the private granule is given back at once.
    let second = binding
        .reserve(2 * PAGE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    faults.fail_nth(Op::Unmap, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause: CowFailure::Unmap(_),
    }) = second.diverge()
    else {
        panic!("the unmap was failed on purpose");
    };
    let r = quarantined.residual();
    assert_eq!(
        (r.mapped_bytes(), r.owned_bytes(), r.holds_shared()),
        (2 * PAGE, 0, true)
    );
    assert_eq!(
        binding.used(),
        before.1,
        "the private granule is not charged"
    );
    quarantined.retry().unwrap();
    // The remap fails and so does restoring the original: the remains are quarantined.
    faults.fail_from(Op::Map, 1);
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause: CowFailure::Remap { .. },
    }) = shared.diverge()
    else {
        panic!("both maps failed on purpose");
    };
    faults.clear();
    let r = quarantined.residual();
    assert_eq!(
        (r.mapped_bytes(), r.owned_bytes()),
        (PAGE, 0),
        "the body only"
    );
    assert_eq!(binding.used(), before.1);
    quarantined.retry().unwrap();
    drop(prefix);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_copy_on_write_past_the_budget_is_refused_with_numbers() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::strict());
    let g = device.granularity();
    let owner = device.bind(Budget::unlimited()).unwrap();
    let sharer = device.bind(Budget::bytes(0)).unwrap();
    let prefix = owner.reserve(g).unwrap().commit_prefix().unwrap();
    let shared = sharer.reserve(g).unwrap().map_prefix(&prefix).unwrap();
    let Err(TransitionError {
        token: Returned::Unchanged(_),
        cause: CowFailure::Private(cause),
    }) = shared.diverge()
    else {
        panic!("the sharer has no budget for a private granule");
    };
    assert_eq!(
        *cause,
        CommitFailure::Budget {
            requested: g as u64,
            used: 0,
            limit: 0
        }
    );
    assert!(
        cause
            .to_string()
            .contains(&format!("{g} bytes exceed the binding's budget")),
        "{cause}"
    );
}

#[test]
fn the_device_budget_still_counts_a_prefix_whose_owner_has_gone() {
    make_guard!(guard);
    let device = Device::with_budget(guard, SimBackend::strict(), Budget::bytes(3 << 21));
    let g = device.granularity();
    let owner = device.bind(Budget::bytes(2 * g as u64)).unwrap();
    let sharer = device.bind(Budget::bytes(0)).unwrap();
    let prefix = owner.reserve(2 * g).unwrap().commit_prefix().unwrap();
    let shared = sharer.reserve(2 * g).unwrap().map_prefix(&prefix).unwrap();
    drop(prefix);
    assert_eq!(
        owner.used(),
        0,
        "the owner's budget no longer carries the prefix"
    );
    // ... but the device's does, for as long as the sharer keeps the memory.
    let err = owner.reserve(2 * g).unwrap().commit().unwrap_err();
    assert_eq!(
        err.cause,
        CommitFailure::DeviceBudget {
            requested: 2 * g as u64,
            used: 2 * g as u64,
            limit: 3 * g as u64
        }
    );
    assert!(
        err.cause.to_string().contains("device's budget"),
        "{}",
        err.cause
    );
    assert_no_cause_repeated(&err.cause);
    assert_eq!(owner.used(), 0, "a refused commit charges nothing");
    drop(shared);
    owner.reserve(2 * g).unwrap().commit().unwrap();
}

#[test]
fn a_prefix_keeps_its_boundary_granule_in_an_allocation_of_its_own() {
    make_guard!(guard);
    let sim = SimBackend::strict();
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let creates = || {
        let calls = sim.calls();
        let lens = calls.iter().filter(|c| c.op == Op::Create).map(|c| c.len);
        lens.collect::<Vec<_>>()
    };
    let prefix = binding.reserve(3 * g).unwrap().commit_prefix().unwrap();
    assert_eq!(creates(), [2 * g, g], "the body, then the boundary granule");
    let one = binding.reserve(g).unwrap().commit_prefix().unwrap();
    assert_eq!(creates(), [2 * g, g, g], "one granule: one allocation");
    // Every map of a prefix, the owner's and a sharer's, is a whole allocation: the strict
    // simulator refuses (panics on) anything else.
    let shared = binding.reserve(3 * g).unwrap().map_prefix(&prefix).unwrap();
    let maps = sim.calls().iter().filter(|c| c.op == Op::Map).count();
    assert_eq!(maps, 2 + 1 + 2);
    let diverged = shared.diverge().unwrap();
    drop((diverged, one, prefix));
    drop(binding);
    assert!(device.ledger().is_zero());
    assert_eq!(sim.physical_in_use(), 0);
}

#[test]
fn a_prefix_whose_boundary_cannot_be_created_or_mapped_comes_back_unchanged() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let mut reserved = binding.reserve(2 * g).unwrap();
    let addr = reserved.addr();
    // The boundary's create fails (the body's succeeded), then its map (the body's succeeded).
    for (op, nth) in [(Op::Create, 2), (Op::Map, 2)] {
        faults.fail_nth(op, nth);
        let Err(e) = reserved.commit_prefix() else {
            panic!("{op:?} #{nth} was failed on purpose");
        };
        assert!(matches!(e.cause, CommitFailure::Backend(ref b) if b.op == op));
        let Returned::Unchanged(back) = e.into_token() else {
            panic!("everything could be undone");
        };
        assert_eq!(back.addr(), addr);
        assert_eq!(binding.used(), 0, "nothing charged");
        let ledger = device.ledger();
        assert_eq!((ledger.owned_bytes, ledger.mapped_bytes), (0, 0));
        let o = faults.outstanding();
        assert_eq!((o.physical, o.mappings), (0, 0), "the body is gone again");
        reserved = back;
        faults.clear();
    }
    let prefix = reserved.commit_prefix().unwrap();
    drop(prefix);
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_half_made_prefix_that_cannot_be_unmapped_is_quarantined_whole_and_a_retry_frees_it() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let reserved = binding.reserve(3 * g).unwrap();
    let addr = reserved.addr();
    faults.fail_nth(Op::Map, 2);
    faults.fail_nth(Op::Unmap, 1);
    let Err(e) = reserved.commit_prefix() else {
        panic!("the boundary's map was failed on purpose");
    };
    let CommitFailure::UnmapFailed { rollback, .. } = &e.cause else {
        panic!("{}", e.cause);
    };
    assert_eq!(
        (rollback.op, rollback.addr, rollback.len),
        (Op::Unmap, addr, 2 * g)
    );
    assert_no_cause_repeated(&e.cause);
    assert!(
        crate::common::transition_messages(&e)
            .iter()
            .any(|m| m.contains("quarantined"))
    );
    let Returned::Quarantined(q) = e.into_token() else {
        panic!("the body could not be unmapped");
    };
    let r = q.residual();
    assert_eq!(r.range(), (addr, 3 * g));
    assert!(r.holds_va());
    assert_eq!((r.mapped_bytes(), r.owned_bytes()), (2 * g, 2 * g));
    assert_eq!(binding.used(), 2 * g as u64, "the body stays charged");
    let o = faults.outstanding();
    assert_eq!(o.physical, 1, "the boundary's memory went back");
    q.retry().unwrap();
    assert_eq!(binding.used(), 0);
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(faults.outstanding().is_zero());
}

/// A copy-on-write whose private map fails maps the shared *boundary* allocation back, not the
/// body's: with body and boundary filled differently, the restored granule shows the boundary's
/// bytes and the boundary's physical page.
#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn a_failed_copy_on_write_maps_the_boundary_allocation_back() {
    make_guard!(guard);
    let backend = Faulty::new(HostBackend::new(HostConfig::default()).unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    assert_eq!(device.granularity(), PAGE);
    let mut prefix = binding.reserve(2 * PAGE).unwrap().commit_prefix().unwrap();
    let bytes = prefix.as_mut_slice().unwrap();
    bytes[..PAGE].fill(1);
    bytes[PAGE..].fill(2);
    let shared = binding
        .reserve(2 * PAGE)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap();
    faults.fail_nth(Op::Map, 1);
    let Err(TransitionError {
        token: Returned::Unchanged(shared),
        ..
    }) = shared.diverge()
    else {
        panic!("the private granule's map was failed on purpose");
    };
    let page = |addr| proc_map(addr).1;
    assert_eq!(page(shared.addr() + PAGE), page(prefix.addr() + PAGE));
    assert!(shared.as_slice()[PAGE..].iter().all(|&b| b == 2));
    drop((shared, prefix));
    drop(binding);
    assert!(device.ledger().is_zero());
}

/// Every way `commit_prefix` can fail and be undone: the reservation comes back, nothing stays
/// charged to it, and what could not be released is in the device's quarantine, counted and
/// owned, until a retry frees it.
#[test]
fn every_undone_commit_prefix_leaves_the_ledger_equal_to_the_backend() {
    /// Which calls fail: the `n`th of a kind, or (`true`) every one from the `n`th on.
    type Faults = &'static [(Op, u64, bool)];
    let plans: [(&str, Faults); 6] = [
        ("body create", &[(Op::Create, 1, false)]),
        ("body map", &[(Op::Map, 1, false)]),
        (
            "body map, body release",
            &[(Op::Map, 1, false), (Op::Release, 1, false)],
        ),
        (
            "boundary map, body release",
            &[(Op::Map, 2, false), (Op::Release, 1, false)],
        ),
        (
            "boundary map, both releases",
            &[(Op::Map, 2, false), (Op::Release, 1, true)],
        ),
        (
            "boundary create, body release",
            &[(Op::Create, 2, false), (Op::Release, 1, false)],
        ),
    ];
    for (name, plan) in plans {
        make_guard!(guard);
        let backend = Faulty::new(SimBackend::strict());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let g = device.granularity();
        let reserved = binding.reserve(3 * g).unwrap();
        for &(op, n, from) in plan {
            if from {
                faults.fail_from(op, n);
            } else {
                faults.fail_nth(op, n);
            }
        }
        let Err(e) = reserved.commit_prefix() else {
            panic!("{name}: failed on purpose");
        };
        let Returned::Unchanged(back) = e.into_token() else {
            panic!("{name}: nothing stays mapped, so the reservation comes back");
        };
        let ledger = device.ledger();
        assert_eq!((binding.used(), ledger.mapped_bytes), (0, 0), "{name}");
        assert_eq!(ledger.reserved_bytes, 3 * g as u64, "{name}");
        let o = faults.outstanding();
        assert_eq!(
            ledger.owned_bytes, o.physical_bytes,
            "{name}: owned = created"
        );
        let quarantined = device.custody().quarantined.count as u64;
        assert_eq!(ledger.quarantined, quarantined, "{name}");
        assert_eq!(
            quarantined, o.physical,
            "{name}: each unreleased allocation quarantined"
        );
        faults.clear();
        device.retry_quarantine();
        drop(back);
        drop(binding);
        assert!(device.ledger().is_zero(), "{name}");
        assert!(faults.outstanding().is_zero(), "{name}");
    }
}

#[test]
fn a_half_made_prefix_whose_boundary_release_fails_too_keeps_both_counted() {
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    let reserved = binding.reserve(3 * g).unwrap();
    faults.fail_nth(Op::Map, 2);
    faults.fail_nth(Op::Unmap, 1);
    faults.fail_nth(Op::Release, 1);
    let Err(e) = reserved.commit_prefix() else {
        panic!("failed on purpose");
    };
    let Returned::Quarantined(q) = e.into_token() else {
        panic!("the body could not be unmapped");
    };
    let ledger = device.ledger();
    assert_eq!(
        ledger.quarantined, 2,
        "the half-made prefix and the boundary's memory"
    );
    assert_eq!(
        (ledger.owned_bytes, ledger.mapped_bytes),
        (3 * g as u64, 2 * g as u64)
    );
    assert_eq!(binding.used(), 2 * g as u64);
    faults.clear();
    q.retry().unwrap();
    device.retry_quarantine();
    drop(binding);
    assert!(device.ledger().is_zero());
    assert!(faults.outstanding().is_zero());
}

// ---------------------------------------------------------------------------------------------
// Counted mappings, a diverged boundary, failures that say so first, an export's form
// ---------------------------------------------------------------------------------------------

/// Kills `src/sharing/mod.rs: replace <impl Sealed for Sharer>::shared -> Option<&SharedPhys<B::Phys>>
/// with None`: a sharer counts the mappings of the prefix it maps, its own included.
#[test]
fn a_sharer_counts_the_mappings_of_its_prefix() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
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

/// Kills `src/sharing/mod.rs: replace - with + in Allocation<'_, '_, B, Diverged>::boundary_mut` and
/// `replace <impl Sealed for Diverged>::shared -> Option<&SharedPhys<B::Phys>> with None`: a
/// diverged prefix's writable boundary is exactly its last granule, and it still counts the
/// mappings of the body it shares.
#[test]
#[cfg_attr(
    miri,
    ignore = "one memory at two addresses: the heap store (Miri's) maps none twice"
)]
fn a_diverged_boundary_is_one_granule() {
    make_guard!(guard);
    let device = Device::new(guard, crate::common::host());
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

/// Kills `src/error.rs: replace <impl Failure for ShareFailure>::summary -> &'static str with
/// "xyzzy"`: a failed mapping of a prefix says so first.
#[test]
fn a_failed_mapping_of_a_prefix_says_so_first() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
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
    says_first(&e, "mapping the prefix failed: ");
}

/// Kills `src/error.rs: replace <impl Failure for CowFailure>::summary -> &'static str with
/// "xyzzy"`: a failed copy-on-write says so first.
#[test]
fn a_failed_copy_on_write_says_so_first() {
    make_guard!(guard);
    let backend = Faulty::new(common::sim(16 * GRANULE as u64));
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
    says_first(&e, "copy-on-write of the boundary granule failed: ");
}

/// Kills `src/sharing/ipc.rs: replace <impl std::fmt::Debug for Export<'_, '_, B, K>>::fmt ->
/// std::fmt::Result with Ok(Default::default())` and `src/sharing/ipc.rs: replace - with / in
/// Allocation<'b, 'id, B, Owner<K>>::export`: an export's debug form shows its message and
/// handles, and its message carries the offset the backend gave each handle, body and boundary
/// (here one megabyte into each file, as a backend exporting pieces of one file would say).
#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
fn an_export_debugs_as_its_message_and_handles_and_carries_their_offsets() {
    const SHIFT: u64 = 1 << 20;
    make_guard!(guard);
    let gate = GateHandle::default();
    gate.shift_exports(SHIFT);
    let backend = Gate {
        // It exports: a memfd whatever MEMTOKEN_HOST_MEMORY says.
        inner: memtoken::backend::HostBackend::with_defaults().unwrap(),
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
