//! The simulator and the rule book it keeps, and `Faulty`'s counts, below the token layer: the
//! simulator creates up to its capacity; copies read and write exactly the mappings they span
//! and are refused past them; memory released while still mapped lives until its last mapping
//! goes; only a fault `Faulty` injected says it was injected.

use crate::common::{self, GRANULE};
use memtoken::backend::{
    Access, Backend, BackendError, Cause, ConfigError, Op, Violation,
    doubles::{Faulty, SimBackend, SimConfig},
};

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

/// Kills `src/backend/sim.rs: replace - with + in <impl Backend for SimBackend>::create`: the
/// simulator creates up to its physical capacity and refuses a granule more, saying none is
/// left.
#[test]
fn the_simulator_creates_up_to_its_capacity() {
    let sim = common::sim(2 * GRANULE as u64);
    let all = sim.create(2 * GRANULE).unwrap();
    let e = sim.create(GRANULE).expect_err("past the capacity");
    assert!(
        matches!(e.cause, Cause::Exhausted { available: 0, .. }),
        "{e}"
    );
    sim.release(all, 2 * GRANULE).unwrap();
}

/// Kills `src/backend/rules/mod.rs: replace + with * in Book<P>::check_copy`: a copy from a range
/// mapped by several granules side by side reads all of them.
#[test]
fn a_copy_reads_a_source_of_several_mappings() {
    let sim = common::sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 3);
    let target = sim.create(3 * GRANULE).unwrap();
    sim.copy_into_phys(target, addr, 3 * GRANULE)
        .expect("every byte of the source is mapped");
    sim.release(target, 3 * GRANULE).unwrap();
    unmap_granules(&sim, addr, granules);
}

/// Kills `src/backend/sim.rs: replace - with + in <impl Backend for SimBackend>::copy_from_host`:
/// a copy into a range of two mappings that ends inside the second writes exactly its bytes.
#[test]
fn a_simulator_copy_ending_inside_a_second_mapping_writes_its_bytes() {
    let sim = common::sim(16 * GRANULE as u64);
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

/// A copy that runs from a mapping into unmapped address space is refused (`Book::resolve`
/// finds no mapping under the granule past it; a resolve that answered a mapping there would
/// let the check loop for ever).
#[test]
fn a_copy_running_past_its_mapping_is_refused() {
    let sim = common::sim(16 * GRANULE as u64);
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

/// Kills `src/backend/rules/mod.rs: replace > with >= in Book<P>::check_copy` (its self-copy
/// check): a copy into memory mapped right before the source range, not in it, is no copy of
/// that memory into itself.
#[test]
fn a_copy_into_memory_mapped_just_before_the_source_is_no_self_copy() {
    let sim = common::sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 2);
    sim.copy_into_phys(granules[0], addr + GRANULE, GRANULE)
        .expect("the source is the second granule only");
    unmap_granules(&sim, addr, granules);
}

/// Kills `src/backend/rules/mod.rs: replace == with != in Book<P>::apply_unmap` and
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

/// Kills `src/backend/mod.rs: replace BackendError::is_injected -> bool with true`: only a
/// fault that `Faulty` injected says it was injected; a refused call does not.
#[test]
fn only_an_injected_fault_says_it_was_injected() {
    let sim = common::sim(16 * GRANULE as u64);
    let faulty = Faulty::new(sim.clone());
    faulty.handle().fail_nth(Op::Reserve, 1);
    assert!(faulty.reserve(GRANULE).unwrap_err().is_injected());
    let refused = sim.free(GRANULE, GRANULE).unwrap_err();
    assert!(matches!(refused.cause, Cause::Violation(_)), "{refused}");
    assert!(!refused.is_injected(), "{refused}");
}

/// Kills `src/backend/faulty.rs: replace Outstanding::is_zero -> bool with true`: what a
/// `Faulty` backend counts as handed out is not zero while a reservation is.
#[test]
fn a_faulty_backend_holding_a_reservation_has_something_outstanding() {
    let faulty = Faulty::new(common::sim(16 * GRANULE as u64));
    let addr = faulty.reserve(GRANULE).unwrap();
    assert!(!faulty.handle().outstanding().is_zero());
    faulty.free(addr, GRANULE).unwrap();
    assert!(faulty.handle().outstanding().is_zero());
}

// The simulator's own settings and refusals, called directly.

/// Asserts that `config` is refused with an error `expected` accepts, whose message holds
/// `words`.
fn refused(config: SimConfig, expected: fn(&ConfigError) -> bool, words: &str) {
    let e = SimBackend::new(config.clone()).unwrap_err();
    assert!(expected(&e), "{config:?}: {e:?}");
    assert!(e.to_string().contains(words), "{e}");
}

#[test]
fn a_bad_configuration_is_an_error_not_a_panic() {
    use ConfigError::*;
    let d = SimConfig::default;
    let g = 3 << 20;
    refused(
        SimConfig {
            granularity: g,
            ..d()
        },
        |e| matches!(e, GranularityNotPowerOfTwo { granularity } if *granularity == 3 << 20),
        "power of two",
    );
    refused(
        SimConfig {
            granularity: 0,
            ..d()
        },
        |e| matches!(e, GranularityNotPowerOfTwo { .. }),
        "power of two",
    );
    refused(
        SimConfig {
            address_space: (1 << 30) + 4096,
            ..d()
        },
        |e| {
            matches!(
                e,
                NotAGranularityMultiple {
                    what: "address space",
                    ..
                }
            )
        },
        "address space",
    );
    refused(
        SimConfig {
            address_space: 0,
            ..d()
        },
        |e| matches!(e, NotAGranularityMultiple { value: 0, .. }),
        "address space",
    );
    refused(
        SimConfig {
            physical_capacity: 0,
            ..d()
        },
        |e| {
            matches!(
                e,
                Zero {
                    what: "physical capacity"
                }
            )
        },
        "physical capacity",
    );
}

#[test]
fn a_reservation_past_the_address_space_is_exhausted_not_illegal() {
    let sim = SimBackend::new(SimConfig {
        address_space: 4 << 20,
        ..SimConfig::strict()
    })
    .unwrap();
    let e = sim.reserve(6 << 20).unwrap_err();
    assert!(matches!(e.cause, Cause::AddressSpace { requested, .. } if requested == 6 << 20));
    assert_eq!(sim.reservations(), 0);
    let addr = sim.reserve(4 << 20).unwrap();
    sim.free(addr, 4 << 20).unwrap();
}

#[test]
fn an_illegal_call_is_refused_recorded_and_changes_nothing() {
    let sim = SimBackend::default();
    let g = sim.granularity();
    let addr = sim.reserve(2 * g).unwrap();
    let phys = sim.create(g).unwrap();
    sim.map(addr, g, phys, Access::ReadWrite).unwrap();
    sim.copy_from_host(addr, &[7; 16]).unwrap();
    let refused = [
        sim.map(addr, g, phys, Access::ReadWrite).unwrap_err(), // already mapped
        sim.free(addr, 2 * g).unwrap_err(),                     // still mapped
        sim.release(phys, g).unwrap_err(),                      // still mapped
        sim.unmap(addr + g, g).unwrap_err(),                    // not mapped
        sim.unmap(usize::MAX - g + 1, 2 * g).unwrap_err(),      // end overflows
        sim.copy_from_host(addr + g, &[1]).unwrap_err(),        // not mapped
        sim.unpin().unwrap_err(),                               // no pin
    ];
    assert!(
        refused
            .iter()
            .all(|e| matches!(e.cause, Cause::Violation(_)))
    );
    assert_eq!(sim.violations(), refused.to_vec());
    let mut bytes = [0; 16];
    sim.copy_to_host(&mut bytes, addr).unwrap();
    assert_eq!(bytes, [7; 16]);
    assert_eq!((sim.reservations(), sim.mappings()), (1, 1));
    assert_eq!(sim.physical_in_use(), g as u64);
    sim.unmap(addr, g).unwrap();
    sim.release(phys, g).unwrap();
    sim.free(addr, 2 * g).unwrap();
    assert_eq!(sim.violations().len(), refused.len());
}

#[test]
fn a_handle_of_another_simulator_is_unknown_here() {
    let (a, b) = (SimBackend::strict(), SimBackend::default());
    let g = a.granularity();
    let (pa, pb) = (a.create(g).unwrap(), b.create(g).unwrap());
    let e = b.release(pa, g).unwrap_err();
    assert_eq!(e.cause, Cause::Violation(Violation::UnknownPhys));
    assert_eq!(b.physical_in_use(), g as u64);
    a.release(pa, g).unwrap();
    b.release(pb, g).unwrap();
}

#[test]
fn a_call_after_the_context_is_lost_is_refused_and_recorded() {
    let sim = SimBackend::default();
    let g = sim.granularity();
    sim.lose_context();
    let e = sim.reserve(g).unwrap_err();
    assert_eq!(e, BackendError::new(Op::Reserve, 0, g, Cause::ContextLost));
    assert_eq!(sim.violations(), vec![e]);
    assert_eq!(sim.reservations(), 0);
}

#[test]
#[should_panic(
    expected = "SimBackend: illegal Free: [0x1000, +0x1000) is not (inside) a reservation"
)]
fn a_strict_simulator_panics_at_the_first_violation() {
    let _ = SimBackend::strict().free(0x1000, 0x1000);
}

#[test]
#[should_panic(expected = "SimBackend: Pin called after the context is lost")]
fn a_strict_simulator_panics_at_a_call_after_the_loss() {
    let sim = SimBackend::strict();
    sim.lose_context();
    let _ = sim.pin();
}

#[test]
fn a_strict_panic_leaves_the_simulator_usable() {
    let sim = SimBackend::strict();
    let probe = sim.clone();
    let panicked = std::thread::spawn(move || probe.unpin()).join();
    assert!(panicked.is_err());
    assert_eq!(sim.violations().len(), 1);
    let g = sim.granularity();
    let addr = sim.reserve(g).unwrap();
    sim.free(addr, g).unwrap();
}

/// `Backend::copy_within`'s default, which the simulator keeps (through a host buffer): the
/// bytes of one granule land at another, those around them untouched, and a copy of nothing
/// succeeds at any address. Fails if the default copies nothing.
#[test]
fn the_default_copy_within_moves_the_bytes_through_the_host() {
    let sim = common::sim(16 * GRANULE as u64);
    let (addr, granules) = map_granules(&sim, 3);
    let bytes: Vec<u8> = (0..GRANULE).map(|i| (i % 253) as u8 + 1).collect();
    sim.copy_from_host(addr, &bytes).unwrap();
    sim.copy_within(addr + 2 * GRANULE, addr, GRANULE)
        .expect("both ranges are mapped");
    let mut back = vec![0; 3 * GRANULE];
    sim.copy_to_host(&mut back, addr).unwrap();
    assert!(back[2 * GRANULE..] == bytes[..], "the copy landed");
    assert!(
        back[GRANULE..2 * GRANULE].iter().all(|&b| b == 0),
        "between"
    );
    assert!(back[..GRANULE] == bytes[..], "the source");
    sim.copy_within(0, 0, 0).expect("a copy of nothing");
    unmap_granules(&sim, addr, granules);
}
