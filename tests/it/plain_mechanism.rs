//! The CUDA backend's plain mechanism, on the driver model of a device
//! without virtual memory management: it is what gets selected there; commit, release, copies,
//! fences and the KV cache (allocated whole) work on it, a commit allocating (`cuMemAlloc`) and a release freeing
//! (`cuMemFree`); growing a region, sharing a prefix, suspend, export, read-only maps and
//! peers are refused with [`Cause::Unsupported`] naming the capability, with nothing done; and
//! a mechanism whose creates fail for good is retired while its old tokens release on it.

use crate::common;
use memtoken::backend::cuda::{CuError, CudaBackend, CudaError, CudaMechanism, DriverCall};
use memtoken::backend::doubles::{DriverModel, ModelConfig, ModelOutstanding};
use memtoken::backend::{Ability, BackendError, Cause, PosixFd};
use memtoken::mechanism::{MechanismError, Mechanisms};
use memtoken::{
    Budget, Device, TransitionError, errors::CommitFailure, errors::GrowError, errors::Returned,
    errors::SuspendFailure, make_guard,
};

/// A driver model of a device without virtual memory management (attribute 102 is 0): any
/// VMM call on it is misuse, and panics.
fn no_vmm() -> DriverModel {
    DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap()
}

/// The capability `e` says the mechanism lacks, if it is such a refusal.
fn unsupported(e: &BackendError) -> Option<&'static str> {
    match e.cause {
        Cause::Unsupported { capability, .. } => Some(capability),
        _ => None,
    }
}

/// The token a refusal handed back unchanged.
fn unchanged<T, Q>(token: Returned<T, Q>) -> T {
    match token {
        Returned::Unchanged(token) => token,
        Returned::Quarantined(_) => panic!("the token comes back unchanged"),
    }
}

/// Probed at open, the VMM mechanism is refused and the plain one selected; on it a
/// reservation allocates nothing, a commit allocates (the token at the driver's address), the
/// bytes round-trip, a release frees, and a KV cache (allocated whole) works; the model never sees a VMM call
/// (it would panic) and ends with nothing outstanding. Fails if a commit keeps the
/// placeholder address (the copies would be refused: nothing is mapped there), or if a
/// release does not free.
#[test]
fn a_device_without_vmm_selects_the_plain_mechanism_where_commit_release_and_pools_work() {
    let model = no_vmm();
    let registry = Mechanisms::new();
    let vmm = registry.register("cuda-vmm").unwrap();
    let plain = registry.register("cuda-plain").unwrap();
    let out = registry.select_probed(vmm, || CudaBackend::new(model.clone(), 0).map(drop));
    let Err(MechanismError::Refused { why, now, .. }) = out else {
        panic!("{out:?}")
    };
    assert!(why.contains("virtual memory management"), "{why}");
    assert_eq!(now, None);
    registry.retire(vmm).unwrap();
    let mut opened = None;
    registry
        .select_probed(plain, || {
            CudaBackend::new_plain(model.clone(), 0).map(|b| opened = Some(b))
        })
        .unwrap();
    assert_eq!(registry.selected(), Some(plain));
    let backend = opened.unwrap();
    assert_eq!(backend.mechanism(), CudaMechanism::Plain);
    assert!(!backend.vmm_supported());
    // `new_auto` makes the same choice by itself.
    let auto = CudaBackend::new_auto(model.clone(), 0).unwrap();
    assert_eq!(auto.mechanism(), CudaMechanism::Plain);
    drop(auto);
    assert!(matches!(
        CudaBackend::new(model.clone(), 0),
        Err(CudaError::NoVmm { device: 0 })
    ));

    make_guard!(guard);
    let device = Device::new(guard, backend);
    let g = device.granularity();
    let binding = device.bind(Budget::bytes(8 * g as u64)).unwrap();
    let reserved = binding.reserve(2 * g).unwrap();
    let placeholder = reserved.addr();
    assert_eq!(
        model.count(DriverCall::MemAlloc),
        0,
        "a reservation allocates nothing"
    );
    assert_eq!(device.ledger().owned_bytes, 0);
    let mut token = reserved.commit().unwrap();
    assert_eq!(model.count(DriverCall::MemAlloc), 1, "a commit allocates");
    assert_ne!(
        token.addr(),
        placeholder,
        "the token is where the driver put the memory"
    );
    assert_eq!(
        model.address_range(token.addr() as u64),
        Some((token.addr() as u64, 2 * g))
    );
    assert_eq!(device.ledger().owned_bytes, 2 * g as u64);
    let bytes = common::pattern(2 * g, 5);
    token.copy_from_host(0, &bytes).unwrap();
    let mut back = vec![0; 2 * g];
    token.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, bytes);
    token.release().complete().unwrap();
    assert_eq!(model.count(DriverCall::MemFree), 1, "a release frees");
    assert!(device.ledger().is_zero());

    make_guard!(cache_guard);
    let layout = memtoken::kv::Layout::new(64, 16).plane(64 << 10);
    let cache = memtoken::kv::KvCache::new(cache_guard, &binding, &layout).unwrap();
    assert!(!cache.maps_on_demand(), "allocated whole");
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    table.write(0, 2, 8, &[9; 8]).unwrap();
    let mut block = [0; 8];
    table.read(0, 2, 8, &mut block).unwrap();
    assert_eq!(block, [9; 8]);
    drop(table);
    cache.replenish().unwrap(); // the fence over the blocks given back
    drop(cache);
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// On a device with virtual memory management, `new_auto` takes the VMM mechanism, and every
/// opening says the device has it: the plain one too, asked for by name, which is why its
/// mechanism is plain. Fails if `vmm_supported` answers for the mechanism rather than the device.
#[test]
fn a_device_with_vmm_says_so_whatever_mechanism_was_opened() {
    let model = DriverModel::new(common::model_config()).unwrap();
    let auto = CudaBackend::new_auto(model.clone(), 0).unwrap();
    assert_eq!(auto.mechanism(), CudaMechanism::Vmm);
    assert!(auto.vmm_supported());
    drop(auto);
    let plain = CudaBackend::new_plain(model.clone(), 0).unwrap();
    assert_eq!(plain.mechanism(), CudaMechanism::Plain);
    assert!(plain.vmm_supported());
    drop(plain);
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// On the plain mechanism, what needs VMM is refused up front, naming the capability, with
/// nothing done: a region's growth, a prefix (shared or exportable), a suspend (of a token
/// and of a region), peers; the token comes back unchanged and still works. Fails if any of
/// them reaches the driver (the model panics on a VMM call) or is emulated.
#[test]
fn on_the_plain_mechanism_regions_sharing_suspend_and_export_are_refused_naming_the_capability() {
    let model = no_vmm();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    for ability in Ability::ALL {
        assert!(device.lacks(ability).is_some(), "{ability:?}");
    }
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    let calls = model.log().len();

    let mut region = binding.reserve(4 * g).unwrap().into_region();
    let Err(GrowError::Unsupported(e)) = region.grow(1) else {
        panic!("a region cannot grow in place")
    };
    assert_eq!(
        unsupported(&e),
        Some(Ability::MapAtReservedAddress.capability())
    );
    assert!(e.to_string().contains("plain-allocation"), "{e}");
    assert_eq!(region.committed_granules(), 0);
    region.release().complete().unwrap();
    // One granule too: its growth would cover the whole reservation, as a commit does.
    let mut region = binding.reserve(g).unwrap().into_region();
    assert!(matches!(region.grow(1), Err(GrowError::Unsupported(_))));
    region.release().complete().unwrap();

    let reserved = binding.reserve(g).unwrap();
    let TransitionError { token, cause } = reserved.commit_prefix().unwrap_err();
    let CommitFailure::Unsupported(e) = &cause else {
        panic!("{cause:?}")
    };
    assert_eq!(unsupported(e), Some(Ability::MapTwice.capability()));
    let reserved = unchanged(token);
    let TransitionError { token, cause } =
        reserved.commit_prefix_exportable::<PosixFd>().unwrap_err();
    let CommitFailure::Unsupported(e) = &cause else {
        panic!("{cause:?}")
    };
    assert_eq!(unsupported(e), Some(Ability::Export.capability()));
    let reserved = unchanged(token);
    let made = model.log().split_off(calls);
    assert!(
        made.iter().all(|&c| c == DriverCall::CtxSetCurrent),
        "no memory call was made for any of them: {made:?}"
    );

    let token = reserved.commit().expect("still a plain reservation");
    let TransitionError { token, cause } = token.suspend().unwrap_err();
    let SuspendFailure::Backend(e) = &cause else {
        panic!("{cause:?}")
    };
    assert_eq!(unsupported(e), Some(Ability::SuspendInPlace.capability()));
    token.release().complete().unwrap();

    let peers = CudaBackend::new_plain(model.clone(), 0)
        .unwrap()
        .with_peers(&[1]);
    assert!(matches!(peers, Err(CudaError::BadPeers(why)) if why.contains("peers")));

    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// The plain mechanism's memory is freed only after its fence: a release while a kernel may
/// still use the memory waits (`cuMemFree` does not), and frees once the work is done. Fails
/// if the free is made at the release's start (the model faults: work ran on freed memory).
#[test]
fn on_the_plain_mechanism_memory_is_freed_after_its_fence() {
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        events_complete_at_once: false,
        ..common::model_config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let token = binding
        .reserve(device.granularity())
        .unwrap()
        .commit()
        .unwrap();
    model.submit_work(); // a kernel may still use it
    let releasing = match token.release().complete().map_err(|e| e.into_token()) {
        Err(Returned::Unchanged(releasing)) => releasing,
        _ => panic!("the release waits for the kernel"),
    };
    assert_eq!(
        model.count(DriverCall::MemFree),
        0,
        "nothing freed under the kernel"
    );
    model.complete_work();
    releasing.complete().unwrap();
    assert_eq!(model.count(DriverCall::MemFree), 1);
    assert_eq!(model.lost_with(), None, "no work ran on freed memory");
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// A failed `cuMemAlloc` leaves the reservation as it was and nothing charged; a commit
/// retried succeeds. And a plain mechanism whose creates fail for good is retired: new
/// bindings go to the healthy one (a VMM device), and the old token still releases on its
/// own. Fails if a failed commit keeps a charge, or if the retirement lets the selection stay.
#[test]
fn a_plain_mechanism_failing_for_good_is_retired_and_its_old_tokens_release_on_it() {
    let (sick, healthy) = (no_vmm(), common::model());
    make_guard!(ga);
    make_guard!(gb);
    let a = Device::new(ga, CudaBackend::new_plain(sick.clone(), 0).unwrap());
    let b = Device::new(gb, CudaBackend::new(healthy.clone(), 0).unwrap());
    let registry = Mechanisms::new();
    let (plain, vmm) = (
        registry.register("cuda-plain").unwrap(),
        registry.register("cuda-vmm").unwrap(),
    );
    registry.select(plain).unwrap();
    let on_a = registry
        .on_selected(|m| {
            assert_eq!(m, plain);
            a.bind(Budget::unlimited())
        })
        .unwrap();
    let g = a.granularity();
    let old = on_a.value.reserve(g).unwrap().commit().unwrap();
    sick.fail_from(DriverCall::MemAlloc, 1, CuError::OUT_OF_MEMORY);
    let err = on_a.value.reserve(g).unwrap().commit().unwrap_err();
    assert!(
        matches!(err.cause, CommitFailure::Backend(_)),
        "{:?}",
        err.cause
    );
    assert_eq!(
        a.ledger().owned_bytes,
        g as u64,
        "only the old token is owned"
    );
    drop(err);
    registry.retire(plain).unwrap();
    assert_eq!(registry.selected(), None);
    registry.select(vmm).unwrap();
    let on_b = registry
        .on_selected(|m| {
            assert_eq!(m, vmm);
            b.bind(Budget::unlimited())
        })
        .unwrap();
    let new = on_b.value.reserve(g).unwrap().commit().unwrap();
    old.release().complete().unwrap();
    new.release().complete().unwrap();
    drop((on_a, on_b));
    sick.clear();
    registry.terminate(plain).unwrap();
    assert!(a.close().is_clean());
    assert!(b.close().is_clean());
    assert_eq!(sick.outstanding(), ModelOutstanding::default());
    assert_eq!(healthy.outstanding(), ModelOutstanding::default());
}

/// A wrapper backend forwards what its backend lacks and where it places memory: through
/// `Faulty`, a plain commit's token is at the driver's address. Fails
/// if `Faulty` keeps the trait's defaults (the token would keep its placeholder address).
#[test]
fn through_a_wrapper_the_plain_mechanism_places_and_refuses_as_itself() {
    use memtoken::backend::doubles::Faulty;
    let model = no_vmm();
    make_guard!(guard);
    let faulty = Faulty::new(CudaBackend::new_plain(model.clone(), 0).unwrap());
    let faults = faulty.handle();
    let device = Device::new(guard, faulty);
    assert!(device.lacks(Ability::MapTwice).is_some());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(device.granularity()).unwrap();
    let placeholder = reserved.addr();
    let token = reserved.commit().unwrap();
    assert_ne!(token.addr(), placeholder);
    assert_eq!(
        model.address_range(token.addr() as u64),
        Some((token.addr() as u64, token.len())),
        "the token is where the driver put the memory"
    );
    token.release().complete().unwrap();
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// On the plain mechanism the memory goes with its reservation's free, which comes before the
/// allocation's release: a failed `cuMemFree` leaves the memory owned and charged (in
/// quarantine), so the binding's budget still counts it, and a retry frees it. Fails if the
/// release refunds the owned bytes first (the ledger says 0 while the driver holds 2 MiB, and
/// a second commit fits the one-granule budget).
#[test]
fn on_the_plain_mechanism_a_failed_free_keeps_the_memory_charged() {
    let model = no_vmm();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let g = device.granularity();
    let binding = device.bind(Budget::bytes(g as u64)).unwrap();
    let token = binding.reserve(g).unwrap().commit().unwrap();
    model.fail_nth(DriverCall::MemFree, 1, CuError::OUT_OF_MEMORY);
    let quarantined = match token.release().complete() {
        Err(TransitionError {
            token: Returned::Quarantined(q),
            ..
        }) => q,
        Err(TransitionError { cause, .. }) => panic!("{cause:?}"),
        Ok(_) => panic!("the free was planned to fail"),
    };
    assert_eq!(
        device.ledger().owned_bytes,
        model.outstanding().physical_bytes as u64,
        "what the driver still holds is charged"
    );
    assert!(
        binding.reserve(g).unwrap().commit().is_err(),
        "the budget still counts the quarantined memory"
    );
    drop(quarantined);
    device.retry_quarantine();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// A panic planned at every call of a commit and its release through `Faulty`: nothing is lost
/// (the placement is not a call that can fail). Fails if `Faulty::placed` can panic: the commit
/// would unwind after its memory was made and kept, leaving it charged with no token.
#[test]
fn a_panic_at_any_call_of_a_plain_commit_loses_nothing() {
    use memtoken::backend::doubles::Faulty;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let model = no_vmm();
    make_guard!(guard);
    let faulty = Faulty::new(CudaBackend::new_plain(model.clone(), 0).unwrap());
    let faults = faulty.handle();
    let device = Device::new(guard, faulty);
    let g = device.granularity();
    let binding = device.bind(Budget::unlimited()).unwrap();
    for n in 1..10 {
        let reserved = binding.reserve(g).unwrap();
        faults.panic_at_call(n);
        let out = catch_unwind(AssertUnwindSafe(|| {
            reserved.commit().map(|t| t.release().complete().is_ok())
        }));
        faults.clear();
        drop(out);
        // A release a panic interrupted is finished by the device (deferred) or quarantined.
        device.retry_quarantine();
        device.poll();
        assert!(device.ledger().is_zero(), "n={n}: {:?}", device.ledger());
    }
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// Placeholder addresses are reused once freed: more of the largest reservations than fit
/// between the placeholders' base and the top of the address space, one at a time, all
/// succeed. Fails if placeholders are handed out from a counter that only grows (it runs out
/// after 122,880 reservations of 2^47 bytes).
#[test]
fn placeholder_addresses_are_reused_and_never_run_out() {
    let model = no_vmm();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let largest = 1 << 47;
    let first = binding.reserve(largest).unwrap();
    let first_addr = first.addr();
    drop(first);
    // More than the address space holds without reuse; a thousand under Miri.
    for _ in 0..common::unless_miri(130_000, 1_000) {
        let reserved = binding.reserve(largest).unwrap();
        assert_eq!(
            reserved.addr(),
            first_addr,
            "the freed placeholder is reused"
        );
    }
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// `cuMemFree` may synchronize like a use of the legacy stream (fact 59): the plain mechanism
/// probes the legacy stream first, so a free while a blocking stream captures waits (here a
/// failed commit's rollback, quarantined, then retried) and the capture ends valid. Fails
/// without the probe: the model's free invalidates the capture.
#[test]
fn a_plain_free_waits_while_a_blocking_stream_captures() {
    use memtoken::backend::Op;
    use memtoken::backend::cuda::CaptureMode;
    use memtoken::backend::doubles::Faulty;
    let model = no_vmm();
    make_guard!(guard);
    let faulty = Faulty::new(CudaBackend::new_plain(model.clone(), 0).unwrap());
    let faults = faulty.handle();
    let device = Device::new(guard, faulty);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let blocking = model.new_blocking_stream();
    model.begin_capture(blocking, CaptureMode::Relaxed);
    faults.fail_nth(Op::Map, 1);
    let TransitionError { token, cause } = binding
        .reserve(device.granularity())
        .unwrap()
        .commit()
        .unwrap_err();
    assert!(
        matches!(cause, CommitFailure::RollbackFailed { .. }),
        "the rollback's free waits: {cause:?}"
    );
    drop(token);
    assert_eq!(
        model.end_capture(blocking),
        Ok(()),
        "the capture ends valid"
    );
    device.retry_quarantine();
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// A call of the fuzz below: indices pick among what the backend handed out (addresses of
/// reservations and placements, physical allocations, released ones included), with near
/// misses and wild values.
#[derive(Clone, Debug)]
enum Call {
    Reserve(u8),
    Free(u8, u8),
    Create(u8),
    Release(u8, u8),
    Map(u8, u8, u8, bool),
    Unmap(u8, u8),
    CopyToHost(u8, u8),
    CopyFromHost(u8, u8),
}

fn call() -> impl proptest::strategy::Strategy<Value = Call> {
    use proptest::prelude::*;
    prop_oneof![
        any::<u8>().prop_map(Call::Reserve),
        (any::<u8>(), any::<u8>()).prop_map(|(a, l)| Call::Free(a, l)),
        any::<u8>().prop_map(Call::Create),
        (any::<u8>(), any::<u8>()).prop_map(|(p, l)| Call::Release(p, l)),
        (any::<u8>(), any::<u8>(), any::<u8>(), any::<bool>())
            .prop_map(|(a, l, p, rw)| Call::Map(a, l, p, rw)),
        (any::<u8>(), any::<u8>()).prop_map(|(a, l)| Call::Unmap(a, l)),
        (any::<u8>(), any::<u8>()).prop_map(|(a, l)| Call::CopyToHost(a, l)),
        (any::<u8>(), any::<u8>()).prop_map(|(a, l)| Call::CopyFromHost(a, l)),
    ]
}

/// Arbitrary calls straight at the plain mechanism's `Backend` methods: none panics, and none
/// reaches the driver model as misuse (which panics: a stale or foreign pointer to `cuMemFree`,
/// a VMM call on `cuMemAlloc` memory, a copy outside live memory). Fails if the backend's
/// record lets a freed or never-placed allocation be placed, freed or copied through.
#[test]
fn the_plain_mechanism_takes_any_input() {
    use memtoken::backend::{Access, Addr, Backend};
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: common::proptest_cases(256),
        ..Config::default()
    });
    let strategy = prop::collection::vec(call(), 1..64);
    runner
        .run(&strategy, |calls| {
            let model = no_vmm();
            let b = CudaBackend::new_plain(model.clone(), 0).unwrap();
            let g = b.granularity();
            // What was handed out, with its length: reservations, then placements.
            let mut addrs: Vec<(Addr, usize)> = vec![(0, g), (usize::MAX - g + 1, g)];
            let mut phys = Vec::new();
            let len = |i: u8| match i % 8 {
                0 => 0,
                4 => g + 1,
                5 => 1 << 47,
                6 => usize::MAX,
                7 => 2 * g,
                _ => g,
            };
            // Mostly the latest ones, exactly; sometimes a near miss.
            let pick = |addrs: &[(Addr, usize)], i: u8, l: u8| {
                let k = addrs.len() - 1 - usize::from(i % 4).min(addrs.len() - 1);
                let (base, n) = addrs[k];
                let at = match i / 64 {
                    0..=2 => base,
                    _ => base.wrapping_add(g),
                };
                (at, if l.is_multiple_of(2) { n } else { len(l) })
            };
            for call in &calls {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match *call {
                    Call::Reserve(l) => {
                        if let Ok(a) = b.reserve(len(l)) {
                            addrs.push((a, len(l)));
                        }
                    }
                    Call::Free(a, l) => {
                        let (at, n) = pick(&addrs, a, l);
                        drop(b.free(at, n));
                    }
                    Call::Create(l) => {
                        if let Ok(p) = b.create(len(l)) {
                            phys.push((p, len(l)));
                        }
                    }
                    Call::Release(p, l) if !phys.is_empty() => {
                        let k = phys.len() - 1 - usize::from(p % 4).min(phys.len() - 1);
                        let (p, n) = phys[k];
                        drop(b.release(p, if l.is_multiple_of(2) { n } else { len(l) }));
                    }
                    Call::Map(a, l, p, rw) if !phys.is_empty() => {
                        let k = phys.len() - 1 - usize::from(p % 4).min(phys.len() - 1);
                        let (p, n) = phys[k];
                        let (at, _) = pick(&addrs, a, l);
                        let n = if l.is_multiple_of(2) { n } else { len(l) };
                        let access = if rw {
                            Access::ReadWrite
                        } else {
                            Access::ReadOnly
                        };
                        if b.map(at, n, p, access).is_ok() {
                            addrs.push((b.placed(at, p), n));
                        }
                    }
                    Call::Unmap(a, l) => {
                        let (at, n) = pick(&addrs, a, l);
                        drop(b.unmap(at, n));
                    }
                    Call::CopyToHost(a, l) => {
                        let (at, n) = pick(&addrs, a, l);
                        let mut buf = vec![0; n.min(4 * g)];
                        drop(b.copy_to_host(&mut buf, at));
                    }
                    Call::CopyFromHost(a, l) => {
                        let (at, n) = pick(&addrs, a, l);
                        let buf = vec![7; n.min(4 * g)];
                        drop(b.copy_from_host(at, &buf));
                    }
                    Call::Release(..) | Call::Map(..) => {}
                }));
                prop_assert!(out.is_ok(), "{call:?} panicked");
            }
            Ok(())
        })
        .unwrap();
}

/// The backend itself places only a fresh allocation over a whole placeholder reservation:
/// part of one, a range past its start, or a real address is refused naming
/// `MapAtReservedAddress`, with the allocation left unplaced (its release frees it); a whole
/// placeholder above the lowest places. Fails if the backend's check is dropped or turned
/// around (the typed layer refuses these before they reach it).
#[test]
fn a_plain_map_places_only_over_a_whole_placeholder() {
    use memtoken::backend::{Access, Backend};
    let model = no_vmm();
    let b = CudaBackend::new_plain(model.clone(), 0).unwrap();
    let g = b.granularity();
    let reserved = b.reserve(2 * g).unwrap();
    let phys = b.create(g).unwrap();
    for at in [reserved, reserved + g] {
        let e = b.map(at, g, phys, Access::ReadWrite).unwrap_err();
        assert_eq!(
            unsupported(&e),
            Some(Ability::MapAtReservedAddress.capability())
        );
    }
    // A whole placeholder above the lowest (claimed while that one is) places; the real
    // address it places at, unmapped, is refused.
    let second = b.reserve(g).unwrap();
    assert!(second > reserved, "{second:#x}");
    b.map(second, g, phys, Access::ReadWrite).unwrap();
    let placed = b.placed(second, phys);
    assert_ne!(placed, second, "at the allocator's address");
    b.unmap(placed, g).unwrap();
    let other = b.create(g).unwrap();
    let e = b.map(placed, g, other, Access::ReadWrite).unwrap_err();
    assert_eq!(
        unsupported(&e),
        Some(Ability::MapAtReservedAddress.capability())
    );
    b.release(other, g).unwrap();
    b.free(placed, g).unwrap();
    b.free(reserved, 2 * g).unwrap();
    drop(b);
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}
