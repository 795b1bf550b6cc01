//! The CUDA backend's whole state machine, against the strict driver model: reserve, commit,
//! share, copy-on-write, release, quarantine, deferred release behind events, device loss, and
//! an injected failure of every driver call kind.

use crate::common::Grown;
use crate::common::{self, assert_no_cause_repeated};
use memtoken::backend::{Access, Backend, BackendError, Cause, Op, doubles::Faulty};
use memtoken::backend::{
    cuda::{CuError, CudaBackend, CudaPhys, Driver, DriverCall},
    doubles::{DriverModel, ModelConfig, ModelOutstanding},
};
use memtoken::{
    Allocation, Budget, Device, Releasing, TransitionError, errors::ReleaseFailure,
    errors::Returned, make_guard, report::Quarantined,
};

const G: usize = common::MODEL_GRANULARITY;

/// Completes a started release if its fence allows. A pending one is dropped: the device
/// finishes it at a later poll. What a failed completion leaves goes to `quarantined`.
fn complete_or_defer<'b, 'id, B: Backend>(
    releasing: Allocation<'b, 'id, B, Releasing>,
    quarantined: &mut Vec<Quarantined<'b, 'id, B>>,
) {
    match releasing.complete().map_err(TransitionError::into_token) {
        Ok(_) => {}
        Err(Returned::Unchanged(pending)) => drop(pending),
        Err(Returned::Quarantined(q)) => quarantined.push(q),
    }
}

#[test]
fn a_full_cycle_with_data_round_trips_through_the_device() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut a = binding.reserve(G + 1).unwrap().commit().unwrap();
    assert_eq!(a.len(), 2 * G, "rounded to the recommended granularity");
    assert_eq!(a.device_ptr() % G as u64, 0);
    let data: Vec<u8> = (0..4096).map(|i| i as u8).collect();
    a.copy_from_host(0, &data).unwrap();
    let mut back = vec![0; 4096];
    a.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    a.release().complete().unwrap();
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(
        model.outstanding(),
        ModelOutstanding::default(),
        "nothing left, the context released"
    );
}

#[test]
fn a_failed_set_access_after_a_successful_map_is_rolled_back() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(G).unwrap();
    model.fail_nth(DriverCall::MemSetAccess, 1, CuError::INVALID_VALUE);
    let unmaps = model.count(DriverCall::MemUnmap);
    let err = reserved.commit().unwrap_err();
    assert!(
        crate::common::transition_messages(&err)
            .join(": ")
            .contains("CUDA_ERROR_INVALID_VALUE"),
        "{}",
        crate::common::transition_messages(&err).join(": ")
    );
    assert_no_cause_repeated(&err.cause);
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps + 1,
        "the map was undone"
    );
    let held = model.outstanding();
    assert_eq!(
        (held.reservations, held.physical_bytes),
        (1, 0),
        "nothing mapped, nothing created"
    );
    assert!(device.ledger().mapped_bytes == 0 && device.ledger().owned_bytes == 0);
    // The reservation is intact: it commits now, and the memory is usable.
    let mut a = err.into_token().commit().unwrap();
    a.copy_from_host(0, &[1, 2, 3]).unwrap();
}

#[test]
fn drop_with_work_in_flight_never_blocks_and_releases_after_the_fence() {
    let model = common::held_fences();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work(); // a kernel using `a` is still running
    let before = model.count(DriverCall::MemUnmap);
    drop(a);
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        before,
        "nothing unmapped under the kernel"
    );
    assert_eq!(
        model.count(DriverCall::StreamSynchronize),
        0,
        "nothing waited"
    );
    assert_eq!(device.poll().deferred, 1);
    assert_eq!(device.ledger().owned_bytes, G as u64);
    model.complete_work();
    let p = device.poll();
    assert_eq!((p.released, p.deferred), (1, 0));
    assert!(device.ledger().is_zero());
    assert_eq!(model.outstanding().events, 0, "the event was destroyed");
}

#[test]
fn an_explicit_release_waits_for_its_fence_without_blocking() {
    let model = common::held_fences();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    model.submit_work();
    let releasing = a.release();
    let Err(TransitionError {
        token: Returned::Unchanged(releasing),
        cause: ReleaseFailure::Pending,
    }) = releasing.complete()
    else {
        panic!("the kernel is still running");
    };
    model.complete_work();
    assert!(releasing.is_ready());
    releasing.complete().unwrap();
    assert!(device.ledger().is_zero());
}

#[test]
fn no_driver_call_follows_device_loss() {
    let model = common::held_fences();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let committed = binding.reserve(G).unwrap().commit().unwrap();
    let at = committed.addr();
    let reserved = binding.reserve(G).unwrap();
    let prefix = binding.reserve(G).unwrap().commit_prefix().unwrap();
    let shared = binding.reserve(G).unwrap().map_prefix(&prefix).unwrap();
    model.submit_work();
    let in_flight = binding.reserve(G).unwrap().commit().unwrap();
    drop(in_flight); // deferred behind its event

    model.lose_context();
    // The first call after the loss discovers it; from then on, nothing reaches the driver.
    let Err(TransitionError {
        token: Returned::Quarantined(quarantined),
        cause,
    }) = committed.release().complete()
    else {
        panic!("the context is gone");
    };
    // (Recording the release's fence was the call that found the loss.)
    // The fence's call found the loss; the release itself made no call.
    assert!(
        matches!(&cause, ReleaseFailure::Backend(b) if b.cause == Cause::ContextLost),
        "{cause:?}"
    );
    let discovered = model.calls_after_loss();
    assert!(
        discovered <= 2,
        "{discovered} calls before the loss was known"
    );
    assert!(device.confirm_context_lost().is_some());

    drop((reserved, shared, prefix));
    device.poll();
    device.retry_quarantine();
    let err = quarantined.retry().unwrap_err();
    // Named by the call its teardown would make first: the unmap of all it maps.
    assert!(
        matches!(&err.cause, ReleaseFailure::Backend(b)
            if **b == BackendError::new(Op::Unmap, at, G, Cause::ContextLost)),
        "{:?}",
        err.cause
    );
    assert!(binding.reserve(G).is_err());
    assert_eq!(
        model.calls_after_loss(),
        discovered,
        "a driver call followed the loss"
    );

    let proof = device.confirm_context_lost().unwrap();
    err.into_token().discharge(&proof);
    device.discharge_all(&proof);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    let report = device.close();
    assert!(report.is_clean());
    assert_eq!(model.calls_after_loss(), discovered);
}

#[test]
fn sharing_copy_on_write_and_pages_carry_data_on_the_device() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = binding.reserve(2 * G).unwrap().commit_prefix().unwrap();
    let filled = prefix.copy_from_host(0, &vec![7; 2 * G]);
    filled.expect("no sharer yet").unwrap();
    let a = binding.reserve(2 * G).unwrap().map_prefix(&prefix).unwrap();
    let b = binding.reserve(2 * G).unwrap().map_prefix(&prefix).unwrap();
    let mut seen = vec![0; 16];
    b.copy_to_host(G + 100, &mut seen).unwrap();
    assert_eq!(seen, vec![7; 16], "the sharer reads the owner's bytes");
    let created = model.count(DriverCall::MemCreate);
    let mut a = a.diverge().unwrap();
    assert_eq!(
        model.count(DriverCall::MemCreate),
        created + 1,
        "one private granule"
    );
    assert_eq!(device.ledger().owned_bytes, 3 * G as u64);
    a.copy_boundary_from_host(100, &[9; 16]).unwrap();
    a.copy_to_host(G + 100, &mut seen).unwrap();
    assert_eq!(seen, vec![9; 16], "the sharer's own write");
    a.copy_to_host(G + 200, &mut seen).unwrap();
    assert_eq!(seen, vec![7; 16], "copied from the original");
    b.copy_to_host(G + 100, &mut seen).unwrap();
    assert_eq!(
        seen,
        vec![7; 16],
        "the other sharer still sees the original"
    );
    prefix.copy_to_host(G + 100, &mut seen).unwrap();
    assert_eq!(seen, vec![7; 16], "so does the owner");

    make_guard!(cache_guard);
    let layout = memtoken::kv::Layout::new(64, 16).plane(4096);
    let cache = memtoken::kv::KvCache::new(cache_guard, &binding, &layout).unwrap();
    cache.replenish().unwrap();
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
    cache.push(&mut table).unwrap();
    table.write(0, 1, 8, &[5; 8]).unwrap();
    let mut block = vec![0; 8];
    table.read(0, 1, 8, &mut block).unwrap();
    assert_eq!(block, vec![5; 8]);
    drop(table);
    drop(cache);

    drop((a, b, prefix));
    assert!(device.ledger().is_zero());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// Every driver call kind, failed once in the middle of a workload: nothing is lost.
#[test]
fn an_injected_failure_of_every_driver_call_kind_loses_nothing() {
    for call in common::every_nth_under_miri(DriverCall::ALL, 3) {
        for nth in [1, 2] {
            let model = common::held_fences();
            make_guard!(guard);
            let faulty = Faulty::new(common::cuda(&model));
            let faults = faulty.handle();
            let device = Device::new(guard, faulty);
            {
                let Ok(binding) = device.bind(Budget::unlimited()) else {
                    continue;
                };
                model.fail_nth(call, nth, CuError::OUT_OF_MEMORY);
                workload(&device, &binding, &model);
                model.clear();
                model.complete_work();
                device.poll();
                device.retry_quarantine();
                assert!(
                    device.ledger().is_zero(),
                    "{call:?} #{nth}: {:?}",
                    device.ledger()
                );
            }
            let report = device.close();
            assert!(report.is_clean(), "{call:?} #{nth}: {report:?}");
            let mut left = faults.outstanding();
            left.pins = 0; // a failed unpin is counted by the device, not lost
            assert!(
                left.is_zero(),
                "{call:?} #{nth}: the backend holds {left:?}"
            );
            let held = model.outstanding();
            if held.events != 0 {
                let log = model.log();
                let n = |c| log.iter().filter(|&&x| x == c).count();
                eprintln!(
                    "{call:?} #{nth}: created {} destroyed {}",
                    n(DriverCall::EventCreate),
                    n(DriverCall::EventDestroy)
                );
            }
            assert_eq!(
                (held.reservations, held.physical_bytes, held.events),
                (0, 0, 0),
                "{call:?} #{nth}"
            );
        }
    }
}

/// Every driver call kind, failing once with a sticky error: from that call on, no call reaches
/// the driver, and everything is discharged with the proof that the context is gone.
#[test]
fn a_sticky_error_in_any_driver_call_stops_all_calls_and_everything_is_discharged() {
    for call in common::every_nth_under_miri(DriverCall::ALL, 2) {
        let model = common::held_fences();
        make_guard!(guard);
        let device = Device::new(guard, Faulty::new(common::cuda(&model)));
        {
            let binding = device.bind(Budget::unlimited()).unwrap();
            model.fail_nth(call, 1, CuError::ILLEGAL_ADDRESS);
            workload(&device, &binding, &model);
            model.complete_work();
            device.poll();
            device.retry_quarantine();
            if let Some(proof) = device.confirm_context_lost() {
                device.discharge_all(&proof);
            }
            assert!(device.ledger().is_zero(), "{call:?}: {:?}", device.ledger());
        }
        drop(device);
        assert_eq!(
            model.calls_after_loss(),
            0,
            "{call:?}: a call followed the sticky error"
        );
    }
}

/// Reserve, commit, share, copy-on-write, release and drop, tolerating any failure.
fn workload<'b, 'id>(
    device: &Device<'id, Faulty<CudaBackend<DriverModel>>>,
    binding: &'b memtoken::Binding<'b, 'id, Faulty<CudaBackend<DriverModel>>>,
    model: &DriverModel,
) {
    let mut quarantined = Vec::new();
    let Ok(reserved) = binding.reserve(2 * G) else {
        return;
    };
    let prefix = match reserved.commit_prefix() {
        Ok(p) => p,
        Err(e) => {
            drop(e.into_token());
            return;
        }
    };
    if let Ok(r) = binding.reserve(2 * G) {
        match r.map_prefix(&prefix).map_err(TransitionError::into_token) {
            Ok(shared) => match shared.diverge().map_err(TransitionError::into_token) {
                Ok(d) => complete_or_defer(d.release(), &mut quarantined),
                Err(Returned::Unchanged(token)) => drop(token),
                Err(Returned::Quarantined(q)) => quarantined.push(q),
            },
            Err(Returned::Unchanged(token)) => drop(token),
            Err(Returned::Quarantined(q)) => quarantined.push(q),
        }
    }
    model.submit_work();
    if let Ok(r) = binding.reserve(G)
        && let Ok(c) = r.commit()
    {
        complete_or_defer(c.release(), &mut quarantined);
    }
    drop(prefix);
    model.complete_work();
    device.poll();
    for q in quarantined {
        let _ = q.retry(); // a failure moves it to the device's quarantine
    }
}

/// Every pair of driver call kinds: one fails with an ordinary error, the other (later) with a
/// sticky one. The first leaves leftovers to retry (stuck mappings, scratch ranges, events);
/// the second must stop every call, those retries included.
#[test]
fn an_ordinary_failure_then_a_sticky_one_never_lets_a_call_through() {
    let pairs = DriverCall::ALL
        .into_iter()
        .flat_map(|first| DriverCall::ALL.map(|second| (first, second)))
        .filter(|(first, second)| first != second); // one plan per kind
    for (first, second) in common::every_nth_under_miri(pairs, 23) {
        let model = common::held_fences();
        make_guard!(guard);
        let device = Device::new(guard, Faulty::new(common::cuda(&model)));
        {
            let binding = device.bind(Budget::unlimited()).unwrap();
            model.fail_nth(first, 1, CuError::OUT_OF_MEMORY);
            model.fail_nth(second, 2, CuError::ILLEGAL_ADDRESS);
            workload(&device, &binding, &model);
            model.complete_work();
            device.poll();
            device.retry_quarantine();
            if let Some(proof) = device.confirm_context_lost() {
                device.discharge_all(&proof);
            }
            assert!(
                device.ledger().is_zero(),
                "{first:?}, {second:?}: {:?}",
                device.ledger()
            );
        }
        drop(device);
        let after = model.calls_after_loss();
        assert_eq!(
            after, 0,
            "{first:?} then {second:?}: a call followed the sticky error"
        );
    }
}

/// A sticky error while the backend opens the device: no call follows it, not even the
/// release of the context it retained.
#[test]
fn a_sticky_error_while_opening_makes_no_further_call() {
    for call in [
        DriverCall::CtxSetCurrent,
        DriverCall::DeviceGetAttribute,
        DriverCall::MemGetAllocationGranularity,
        DriverCall::DeviceTotalMem,
    ] {
        let model = common::model();
        model.fail_nth(call, 1, CuError::ILLEGAL_ADDRESS);
        let err = CudaBackend::new(model.clone(), 0).unwrap_err();
        assert!(err.to_string().contains("ILLEGAL_ADDRESS"), "{err}");
        assert_eq!(model.calls_after_loss(), 0, "{call:?}");
    }
    // An ordinary error while opening releases the context it retained.
    let model = common::model();
    model.fail_nth(DriverCall::DeviceTotalMem, 1, CuError::INVALID_VALUE);
    assert!(CudaBackend::new(model.clone(), 0).is_err());
    assert_eq!(model.outstanding().retains, 0, "the retain was released");
}

/// A mapping left behind by a failed rollback is unmapped on drop; if that unmap finds the
/// context gone, nothing else is called (no event destroyed, no context released).
#[test]
fn a_sticky_error_while_dropping_the_backend_stops_its_cleanup() {
    let model = common::model();
    let backend = common::cuda(&model);
    {
        use memtoken::backend::{Access, Backend};
        let addr = backend.reserve(G).unwrap();
        let phys = backend.create(G).unwrap();
        model.fail_nth(DriverCall::MemSetAccess, 1, CuError::INVALID_VALUE);
        model.fail_nth(DriverCall::MemUnmap, 1, CuError::INVALID_VALUE);
        assert!(backend.map(addr, G, phys, Access::ReadWrite).is_err());
        let _event = backend.fence();
        model.fail_nth(DriverCall::MemUnmap, 1, CuError::ILLEGAL_ADDRESS);
    }
    drop(backend);
    assert_eq!(
        model.calls_after_loss(),
        0,
        "the backend's cleanup called into a lost context"
    );
}

/// `CUDA_ERROR_UNKNOWN` (999) has no sticky wording in the CUDA documentation: after it the
/// context is not declared lost (which would let quarantined memory be discharged while the
/// live context still holds it), and later calls reach the driver.
#[test]
fn an_unknown_error_from_a_vmm_call_does_not_lose_the_context() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(G).unwrap();
    model.fail_nth(DriverCall::MemCreate, 1, CuError::UNKNOWN);
    let err = reserved.commit().unwrap_err();
    assert!(
        crate::common::transition_messages(&err)
            .join(": ")
            .contains("CUDA_ERROR_UNKNOWN"),
        "{}",
        crate::common::transition_messages(&err).join(": ")
    );
    assert!(
        device.confirm_context_lost().is_none(),
        "999 was taken for context loss"
    );
    let (creates, maps) = (
        model.count(DriverCall::MemCreate),
        model.count(DriverCall::MemMap),
    );
    let mut a = err.into_token().commit().expect("the context lives on");
    assert_eq!(model.count(DriverCall::MemCreate), creates + 1);
    assert_eq!(model.count(DriverCall::MemMap), maps + 1);
    a.copy_from_host(0, &[1, 2, 3]).unwrap();
    a.release().complete().unwrap();
    assert!(device.confirm_context_lost().is_none());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.calls_after_loss(), 0);
    assert_eq!(model.outstanding(), ModelOutstanding::default());
}

/// `CUDA_ERROR_EXTERNAL_DEVICE` (911) is sticky ("the process must be terminated and
/// relaunched"): the context is lost from that call on, and no call follows it.
#[test]
fn an_external_device_error_from_a_vmm_call_loses_the_context() {
    let model = common::model();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(G).unwrap();
    model.fail_nth(DriverCall::MemCreate, 1, CuError::EXTERNAL_DEVICE);
    let err = reserved.commit().unwrap_err();
    assert!(
        crate::common::transition_messages(&err)
            .join(": ")
            .contains("CUDA_ERROR_EXTERNAL_DEVICE"),
        "{}",
        crate::common::transition_messages(&err).join(": ")
    );
    let calls = model.log().len();
    let proof = device
        .confirm_context_lost()
        .expect("911 is sticky: the context is lost");
    assert!(err.into_token().commit().is_err());
    assert!(binding.reserve(G).is_err());
    device.poll();
    device.retry_quarantine();
    assert_eq!(model.log().len(), calls, "a call followed the sticky error");
    assert_eq!(
        model.calls_after_loss(),
        0,
        "a call followed the sticky error"
    );
    device.discharge_all(&proof);
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    drop(binding);
    assert!(device.close().is_clean());
    assert_eq!(model.calls_after_loss(), 0);
}

/// The driver may hand a released handle's value out again, even while the old memory is still
/// mapped (the model does, on purpose): the backend takes it for a new allocation, the stale
/// `CudaPhys` is refused before the driver, and the old memory's unmap and the new memory's use
/// and release do not touch each other.
#[test]
fn a_handle_value_reissued_while_its_old_memory_is_mapped_is_a_new_allocation() {
    use memtoken::backend::Access;
    let model = common::model();
    let backend = common::cuda(&model);
    let old_addr = backend.reserve(G).unwrap();
    let old = backend.create(G).unwrap();
    backend.map(old_addr, G, old, Access::ReadWrite).unwrap();
    backend.copy_from_host(old_addr, &[1; 16]).unwrap();
    backend.release(old, G).unwrap(); // legal while mapped: the memory goes with the unmap
    let new = backend.create(G).unwrap();
    assert_eq!(
        new.handle(),
        old.handle(),
        "the model hands the value out again"
    );
    assert_ne!(new, old, "but the backend tells the allocations apart");
    let new_addr = backend.reserve(G).unwrap();
    backend.map(new_addr, G, new, Access::ReadWrite).unwrap();
    backend.copy_from_host(new_addr, &[2; 16]).unwrap();
    assert_eq!(model.outstanding().physical_bytes, 2 * G);

    // The stale one names the new allocation's handle: refused, no driver call.
    let releases = model.count(DriverCall::MemRelease);
    assert!(backend.release(old, G).is_err());
    let spare = backend.reserve(G).unwrap();
    assert!(backend.map(spare, G, old, Access::ReadWrite).is_err());
    assert_eq!(model.count(DriverCall::MemRelease), releases);
    assert_eq!(model.count(DriverCall::MemMap), 2);

    // Each mapping still reads its own memory.
    let mut seen = [0; 16];
    backend.copy_to_host(&mut seen, old_addr).unwrap();
    assert_eq!(seen, [1; 16]);
    backend.copy_to_host(&mut seen, new_addr).unwrap();
    assert_eq!(seen, [2; 16]);

    // The old memory goes with its unmap; the new one stays, readable.
    backend.unmap(old_addr, G).unwrap();
    assert_eq!(model.outstanding().physical_bytes, G);
    backend.copy_to_host(&mut seen, new_addr).unwrap();
    assert_eq!(seen, [2; 16]);
    // Copy-on-write from the new memory into a third allocation reads the new bytes.
    let third = backend.create(G).unwrap();
    backend.copy_into_phys(third, new_addr, G).unwrap();
    backend.map(spare, G, third, Access::ReadOnly).unwrap();
    backend.copy_to_host(&mut seen, spare).unwrap();
    assert_eq!(seen, [2; 16]);

    for addr in [new_addr, spare] {
        backend.unmap(addr, G).unwrap();
    }
    backend.release(new, G).unwrap();
    backend.release(third, G).unwrap();
    for addr in [old_addr, new_addr, spare] {
        backend.free(addr, G).unwrap();
    }
    assert_eq!(
        model.outstanding(),
        ModelOutstanding {
            retains: 1,
            ..ModelOutstanding::default()
        }
    );
    drop(backend);
    assert!(model.outstanding().is_zero());
}

/// The driver may hand a destroyed event's value out again (the model does, on purpose): an
/// old fence whose event was destroyed never stands for the new event that reuses the value.
/// Retiring it destroys nothing of the new fence's, which does not look done before its work.
#[test]
fn an_event_value_reissued_after_destroy_is_not_taken_for_an_old_fence() {
    use memtoken::backend::Backend;
    let model = common::held_fences();
    let (a, b) = (common::cuda(&model), common::cuda(&model));
    let old = a.fence();
    drop(a); // destroys the old fence's event: its value is free again
    assert_eq!(model.outstanding().events, 0);
    model.submit_work(); // what `b`'s fences must wait for
    let first = b.fence(); // reuses the destroyed event's value
    assert!(!b.fence_done(&first));
    b.retire_fence(old);
    assert_eq!(
        model.outstanding().events,
        1,
        "the old fence's retirement destroyed the new fence's event"
    );
    assert!(
        !b.fence_done(&first),
        "the old fence's retirement made the new fence look done"
    );
    let second = b.fence();
    b.retire_fence(first);
    assert_eq!(model.outstanding().events, 1);
    assert!(!b.fence_done(&second), "the new fence looks done");
    model.complete_work();
    assert!(b.fence_done(&second));
    b.retire_fence(second);
    assert_eq!(model.outstanding().events, 0);
    drop(b);
    assert!(model.outstanding().is_zero());
}

/// The model maps only whole allocations from offset 0 (CUDA-FACTS 17: `cuMemMap`'s offset
/// "currently must be zero", and mapped memory "cannot be split up"): a part of a handle, at
/// offset 0 or past it, is refused as illegal, and the whole handle is accepted.
#[test]
fn the_model_maps_only_whole_handles_from_offset_zero() {
    use memtoken::backend::cuda::Driver;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let model = common::model();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: the context was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let handle = model.mem_create(2 * G, 0).unwrap();
    let ptr = model.mem_address_reserve(2 * G, G, 0).unwrap();
    for (size, offset) in [(G, 0), (G, G)] {
        // SAFETY: a live reservation with nothing mapped, and a live handle of 2 G bytes.
        let refused = catch_unwind(AssertUnwindSafe(|| unsafe {
            model.mem_map(ptr, size, offset, handle)
        }));
        let message = *refused
            .expect_err("a part of a handle is refused")
            .downcast::<String>()
            .unwrap();
        assert!(message.contains("whole physical allocation"), "{message}");
    }
    // SAFETY: as above; nothing was mapped by the refused calls.
    unsafe { model.mem_map(ptr, 2 * G, 0, handle) }.unwrap();
    // SAFETY: exactly the mapping made above, then its reservation and handle.
    unsafe {
        model.mem_unmap(ptr, 2 * G).unwrap();
        model.mem_address_free(ptr, 2 * G).unwrap();
        model.mem_release(handle).unwrap();
        model.primary_ctx_release(0).unwrap();
    }
    assert!(model.outstanding().is_zero());
}

// ---- Facts 14, 15: creation properties. ----

/// Fact 14: `gpuDirectRDMACapable` needs attribute 110. The backend reads the attribute once,
/// when opened; then every `cuMemCreate` — a commit, a prefix's body and boundary, a
/// copy-on-write granule, exportable memory — asks RDMA-capable memory exactly where it is 1,
/// and (fact 15) each granularity is asked with the properties its memory is created with:
/// the plain ones, and the same with a POSIX descriptor requested.
#[test]
fn every_create_asks_rdma_capable_memory_exactly_where_the_device_supports_it() {
    use memtoken::backend::PosixFd;
    use memtoken::backend::cuda::{AllocationProps, HANDLE_TYPE_POSIX_FD};
    for rdma in [true, false] {
        let model = DriverModel::new(ModelConfig {
            rdma_with_vmm: rdma,
            ..common::model_config()
        })
        .unwrap();
        let opened = common::cuda(&model);
        let plain = AllocationProps::pinned(0).with_gpu_direct_rdma(rdma);
        let exportable = plain.with_handle_types(HANDLE_TYPE_POSIX_FD);
        assert_eq!(opened.gpu_direct_rdma(), rdma);
        assert_eq!(opened.allocation_props(), plain);
        assert_eq!(opened.exportable_granularity(), Ok(G));
        make_guard!(guard);
        let device = Device::new(guard, opened);
        let binding = device.bind(Budget::unlimited()).unwrap();
        let committed = binding.reserve(G).unwrap().commit().unwrap();
        let prefix = binding.reserve(3 * G).unwrap().commit_prefix().unwrap();
        let shared = binding.reserve(3 * G).unwrap().map_prefix(&prefix).unwrap();
        let diverged = shared.diverge().unwrap();
        let exported = binding
            .reserve(3 * G)
            .unwrap()
            .commit_prefix_exportable::<PosixFd>()
            .unwrap();
        let log = model.props_log();
        let asked = |call| {
            log.iter()
                .filter(|&&(c, _)| c == call)
                .map(|&(_, props)| props)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            asked(DriverCall::MemGetAllocationGranularity),
            [plain, exportable],
            "rdma {rdma}: the granularity of each kind of memory, asked once, when opened"
        );
        assert_eq!(
            asked(DriverCall::MemCreate),
            [plain, plain, plain, plain, exportable, exportable],
            "rdma {rdma}: commit, prefix body and boundary, copy-on-write, exportable prefix"
        );
        assert_eq!(
            model.count(DriverCall::DeviceGetAttribute),
            2,
            "each attribute (102: VMM, 110: RDMA) read once"
        );
        for token in [committed.release(), exported.release()] {
            token.complete().unwrap();
        }
        diverged.release().complete().unwrap();
        prefix.release().complete().unwrap();
        drop(binding);
        assert!(device.close().is_clean());
        assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
    }
}

/// An ordinary error while reading attribute 110 fails the open, as any other query of the
/// open does, and gives the retained context back.
#[test]
fn a_failed_attribute_query_fails_the_open() {
    let model = common::model();
    model.fail_nth(DriverCall::DeviceGetAttribute, 1, CuError::INVALID_VALUE);
    let e = CudaBackend::new(model.clone(), 0).unwrap_err();
    assert!(e.to_string().contains("DeviceGetAttribute"), "{e}");
    assert_eq!(model.count(DriverCall::MemCreate), 0);
    assert_eq!(model.outstanding().retains, 0, "the retain was released");
}

// ---------------------------------------------------------------------------------------------
// Mappings a failed rollback left stuck, a copy's scratch range, events and handles; CUDA
// tokens as device memory
// ---------------------------------------------------------------------------------------------

/// A CUDA backend on `model` with `n` reservations of `G` bytes, each with its own
/// physical memory, not mapped.
fn reserved(model: &DriverModel, n: usize) -> (CudaBackend<DriverModel>, Vec<(usize, CudaPhys)>) {
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let ranges = (0..n)
        .map(|_| {
            let addr = backend.reserve(G).unwrap();
            (addr, backend.create(G).unwrap())
        })
        .collect();
    (backend, ranges)
}

/// Maps `phys` at `addr` with its access grant failed and the rollback's unmap failed too: the
/// mapping is left stuck in the backend.
fn map_stuck(model: &DriverModel, backend: &CudaBackend<DriverModel>, addr: usize, phys: CudaPhys) {
    model.fail_nth(DriverCall::MemSetAccess, 1, CuError::OUT_OF_MEMORY);
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN); // the rollback
    backend
        .map(addr, G, phys, Access::ReadWrite)
        .expect_err("the access was failed on purpose");
}

/// A CUDA backend on `model` with a reservation of two granules at `a` whose second granule
/// holds a stuck mapping of `p1` (see [`map_stuck`]); `p0` is created, not mapped.
fn stuck_after_the_first_granule(
    model: &DriverModel,
) -> (CudaBackend<DriverModel>, usize, CudaPhys, CudaPhys) {
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(2 * G).unwrap();
    let (p0, p1) = (backend.create(G).unwrap(), backend.create(G).unwrap());
    map_stuck(model, &backend, a + G, p1);
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
        .free(a, 2 * G)
        .expect("the free unmaps the stuck mapping first");
    backend.release(p0, G).unwrap();
    backend.release(p1, G).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: replace CudaBackend<D>::device -> i32 with 1`: the backend
/// says the `CUdevice` of the ordinal it was opened on.
#[test]
fn a_cuda_backend_says_its_device() {
    let model = common::small_model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    assert_eq!(backend.device(), model.device_get(0).unwrap());
}

/// Kills `src/backend/cuda/mod.rs: replace CudaPhys::handle -> u64 with 1` (and `with 0`): each
/// physical allocation answers its own driver handle.
#[test]
fn each_cuda_allocation_answers_its_own_handle() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 2);
    let handles: Vec<u64> = r.iter().map(|&(_, phys)| phys.handle()).collect();
    assert_ne!(handles[0], handles[1]);
    for (addr, phys) in r {
        backend.release(phys, G).unwrap();
        backend.free(addr, G).unwrap();
    }
}

/// Kills `src/backend/cuda/mod.rs: replace && with || in CudaBackend<D>::unstick`: a mapping
/// left by a failed rollback in one range is unmapped before that range is mapped or freed,
/// and only then: a map elsewhere does not touch it (nor fail when unmapping it would).
#[test]
fn a_stuck_mapping_is_unstuck_only_by_its_own_range() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 2);
    let [(a, pa), (b, pb)] = [r[0], r[1]];
    map_stuck(&model, &backend, a, pa);
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN);
    let unmaps = model.count(DriverCall::MemUnmap);
    backend
        .map(b, G, pb, Access::ReadWrite)
        .expect("b has nothing stuck");
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "a's mapping left alone"
    );
    model.clear();
    backend.unmap(b, G).unwrap();
    backend.free(a, G).expect("a's stuck mapping goes first");
    backend.free(b, G).unwrap();
    backend.release(pa, G).unwrap();
    backend.release(pb, G).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::unstick`: a map unsticks
/// only what a failed rollback left inside its own range, not the stuck mapping that starts
/// where that range ends.
#[test]
fn a_map_leaves_the_stuck_mapping_right_after_its_range() {
    let model = common::small_model();
    let (backend, a, p0, p1) = stuck_after_the_first_granule(&model);
    let unmaps = model.count(DriverCall::MemUnmap);
    backend.map(a, G, p0, Access::ReadWrite).unwrap();
    assert_eq!(
        model.count(DriverCall::MemUnmap),
        unmaps,
        "the next one left alone"
    );
    backend.unmap(a, G).unwrap();
    free_the_stuck_pair(&model, backend, a, p0, p1);
}

/// Kills `src/backend/cuda/mod.rs: replace < with == in <impl Backend for
/// CudaBackend<D>>::unmap`: unmapping a range forgets the mappings a failed rollback left stuck
/// in it, so freeing the range later does not unmap them again.
#[test]
fn an_unmap_forgets_the_stuck_mapping_it_took_down() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 1);
    let (a, pa) = r[0];
    map_stuck(&model, &backend, a, pa);
    backend
        .unmap(a, G)
        .expect("the stuck mapping is still mapped");
    let unmaps = model.count(DriverCall::MemUnmap);
    backend.free(a, G).expect("nothing is left mapped");
    assert_eq!(model.count(DriverCall::MemUnmap), unmaps, "no unmap twice");
    backend.release(pa, G).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in <impl Backend for
/// CudaBackend<D>>::unmap`: unmapping a range forgets only the stuck mappings inside it, not
/// one that starts where it ends, which the free of the reservation then unmaps.
#[test]
fn an_unmap_keeps_the_stuck_mapping_right_after_it() {
    let model = common::small_model();
    let (backend, a, p0, p1) = stuck_after_the_first_granule(&model);
    backend.map(a, G, p0, Access::ReadWrite).unwrap();
    backend.unmap(a, G).unwrap();
    free_the_stuck_pair(&model, backend, a, p0, p1);
}

/// Kills `src/backend/cuda/mod.rs: replace < with <= in CudaBackend<D>::overlaps` (both of its
/// comparisons): a copy from a range is not held back by the stuck mappings that end where it
/// starts and start where it ends.
#[test]
fn a_copy_is_not_held_back_by_the_stuck_mappings_beside_it() {
    let model = common::small_model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(3 * G).unwrap();
    let phys: Vec<_> = (0..3).map(|_| backend.create(G).unwrap()).collect();
    for i in [0, 2] {
        map_stuck(&model, &backend, a + i * G, phys[i]);
    }
    backend.map(a + G, G, phys[1], Access::ReadWrite).unwrap();
    let mut bytes = vec![0; G];
    backend
        .copy_to_host(&mut bytes, a + G)
        .expect("the middle granule is mapped, with access");
    backend.unmap(a + G, G).unwrap();
    backend.free(a, 3 * G).unwrap();
    for p in phys {
        backend.release(p, G).unwrap();
    }
}

/// A copy within device memory whose ranges overlap is refused, whichever comes first
/// (`cuMemcpyDtoD` of overlapping ranges is undefined), and one whose ranges only touch is
/// made. Fails if either half of the overlap check is lost.
#[test]
fn a_copy_within_device_memory_refuses_overlapping_ranges_either_way() {
    use memtoken::backend::Violation;
    let model = common::small_model();
    let backend = CudaBackend::new(model.clone(), 0).unwrap();
    let a = backend.reserve(2 * G).unwrap();
    let p = backend.create(2 * G).unwrap();
    backend.map(a, 2 * G, p, Access::ReadWrite).unwrap();
    for (dst, src) in [(a + G / 2, a), (a, a + G / 2)] {
        let e = backend.copy_within(dst, src, G).unwrap_err();
        assert!(
            matches!(e.cause, Cause::Violation(Violation::OverlappingCopy { .. })),
            "{e}"
        );
    }
    backend.copy_within(a + G, a, G).expect("they only touch");
    backend.copy_within(a, a + G, G).expect("they only touch");
    backend.unmap(a, 2 * G).unwrap();
    backend.free(a, 2 * G).unwrap();
    backend.release(p, 2 * G).unwrap();
}

/// Kills `src/backend/cuda/mod.rs: replace + with - in CudaBackend<D>::sweep_scratch`: a
/// copy's scratch range whose unmap failed is unmapped and freed by the next copy's sweep.
#[test]
fn the_next_copy_sweeps_a_scratch_range_left_mapped() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, G, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(G).unwrap();
    let before = model.outstanding().reservations;
    model.fail_nth(DriverCall::MemUnmap, 1, CuError::UNKNOWN); // the scratch range's
    backend.copy_into_phys(dst, src, G).unwrap();
    assert_eq!(
        model.outstanding().reservations,
        before + 1,
        "the scratch range is left"
    );
    backend.copy_into_phys(dst, src, G).unwrap();
    assert_eq!(model.outstanding().reservations, before, "swept");
    backend.unmap(src, G).unwrap();
    backend.free(src, G).unwrap();
    backend.release(psrc, G).unwrap();
    backend.release(dst, G).unwrap();
}

/// Kills `src/backend/cuda/mod.rs: replace match guard freed.is_context_loss() with false in
/// <impl Backend for CudaBackend<D>>::copy_into_phys`: when freeing a copy's scratch range
/// loses the context, the copy fails with that loss, and the backend calls the driver no more.
#[test]
fn a_context_lost_freeing_a_scratch_range_is_the_copys_error() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, G, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(G).unwrap();
    model.fail_nth(DriverCall::MemMap, 1, CuError::OUT_OF_MEMORY); // the scratch map
    model.fail_nth(DriverCall::MemAddressFree, 1, CuError::ILLEGAL_ADDRESS); // sticky
    let e = backend.copy_into_phys(dst, src, G).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Driver { code, .. } if code == CuError::ILLEGAL_ADDRESS.0),
        "{e}"
    );
    assert!(backend.context_lost());
    let _ = backend.unmap(src, G);
    drop(backend);
    assert_eq!(model.calls_after_loss(), 0);
}

/// Kills `src/backend/cuda/mod.rs: replace match guard freed.is_context_loss() with true in
/// <impl Backend for CudaBackend<D>>::copy_into_phys`: when the scratch range of a failed copy
/// cannot be freed for another reason than a lost context, the copy's error is its own, and
/// the next copy frees the scratch range.
#[test]
fn a_scratch_range_that_cannot_be_freed_waits_for_the_next_copy() {
    let model = common::small_model();
    let (backend, r) = reserved(&model, 1);
    let (src, psrc) = r[0];
    backend.map(src, G, psrc, Access::ReadWrite).unwrap();
    let dst = backend.create(G).unwrap();
    model.fail_nth(DriverCall::MemMap, 1, CuError::OUT_OF_MEMORY); // the scratch map
    model.fail_nth(DriverCall::MemAddressFree, 1, CuError::INVALID_VALUE);
    let e = backend.copy_into_phys(dst, src, G).unwrap_err();
    assert!(
        matches!(e.cause, Cause::Driver { code, .. } if code == CuError::OUT_OF_MEMORY.0),
        "{e}"
    );
    assert!(!backend.context_lost());
    backend.copy_into_phys(dst, src, G).unwrap();
    backend.unmap(src, G).unwrap();
    backend.release(psrc, G).unwrap();
    backend.release(dst, G).unwrap();
    backend.free(src, G).unwrap();
    drop(backend);
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Kills `src/backend/cuda/mod.rs: delete ! in <impl Backend for CudaBackend<D>>::retire_fence`:
/// a fence retired while its context cannot be made current has its events destroyed at the
/// next retirement.
#[test]
fn a_fence_retired_while_not_current_is_destroyed_at_the_next_retirement() {
    let model = common::small_model();
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

/// Kills `src/unwind.rs: replace Guarded<B>::retire_fence with ()`: a completed release gives
/// its fence's event back to the driver at once, not when the backend goes.
#[test]
fn a_completed_release_destroys_its_event() {
    let model = common::small_model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let a = binding.reserve(G).unwrap().commit().unwrap();
    let releasing = a.release();
    assert_eq!(model.outstanding().events, 1, "the release's fence");
    releasing.complete().unwrap();
    assert_eq!(model.outstanding().events, 0);
}

/// Kills `src/interop/mod.rs: replace Allocation<'_, '_, CudaBackend<D>, Elastic>::device_ptr ->
/// u64 with 1`: a CUDA region's device pointer is its start.
#[test]
fn a_cuda_regions_device_pointer_is_its_start() {
    let model = common::small_model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let region = binding.reserve(2 * G).unwrap().into_region();
    let region = region.grown(1);
    assert_eq!(region.device_ptr(), region.addr() as u64);
    let a = binding.reserve(G).unwrap().commit().unwrap();
    assert_eq!(a.device_ptr(), a.addr() as u64);
}

/// Kills `src/interop/mod.rs: replace Allocation<'_, '_, CudaBackend<D>, Elastic>::copy_from_host
/// -> Result<(), BackendError> with Ok(())`: bytes copied into a CUDA region read back.
#[test]
fn bytes_copied_into_a_cuda_region_read_back() {
    let model = common::small_model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let mut region = binding.reserve(2 * G).unwrap().into_region().grown(2);
    let bytes: Vec<u8> = (0..100).collect();
    region.copy_from_host(G - 50, &bytes).unwrap();
    let mut back = vec![0; 100];
    region.copy_to_host(G - 50, &mut back).unwrap();
    assert_eq!(back, bytes);
}

/// Kills `src/interop/mod.rs: replace - with + in Allocation<'_, '_, CudaBackend<D>,
/// Diverged>::copy_boundary_from_host`: a copy into a diverged prefix's private granule that runs
/// past that granule is refused before any driver call.
#[test]
#[should_panic(expected = "do not fit in")]
fn a_copy_past_a_diverged_boundary_panics() {
    let model = common::small_model();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let prefix = binding.reserve(2 * G).unwrap().commit_prefix().unwrap();
    let mut own = binding
        .reserve(2 * G)
        .unwrap()
        .map_prefix(&prefix)
        .unwrap()
        .diverge()
        .unwrap();
    let _ = own.copy_boundary_from_host(1, &vec![1; G]);
}

/// A device without virtual memory management (attribute 102 is 0: support varies by device,
/// driver and virtualization) is refused when the backend opens, with an error naming the
/// capability — before any VMM call (the model takes one as misuse) — and the primary context's
/// retain is given back. Fails if the backend does not ask attribute 102 first.
#[test]
fn a_device_without_vmm_is_refused_when_opened_naming_the_capability() {
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap();
    let e = CudaBackend::new(model.clone(), 0).unwrap_err();
    assert_eq!(e, memtoken::backend::cuda::CudaError::NoVmm { device: 0 });
    assert!(e.to_string().contains("virtual memory management"), "{e}");
    assert_eq!(model.count(DriverCall::MemGetAllocationGranularity), 0);
    assert_eq!(
        model.count(DriverCall::PrimaryCtxRelease),
        1,
        "the retain given back"
    );
}
