//! Tests written to kill mutants that `cargo mutants` (`.cargo/mutants.toml`) found surviving
//! the other suites: each names the mutant it catches (as cargo-mutants names it) in its
//! comment. `.cargo/mutants-survivors.md` lists the mutants that survive everything, with why
//! each cannot change behaviour.

use memtoken::backend::{Cause, Faulty, Op, SimBackend, SimConfig};
use memtoken::{Budget, Device, ShrinkFailure, make_guard};

const GRANULE: usize = 2 << 20;

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
    let message = e.to_string();
    assert!(
        message.starts_with("resuming the memory failed; "),
        "{message}"
    );
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
