//! Unit tests of the CUDA backend against the driver model.

use super::*;
use crate::backend::doubles::DriverModel;
use crate::backend::{Access, Addr, Backend, Cause, Violation, lock};

fn open(model: &DriverModel) -> CudaBackend<DriverModel> {
    CudaBackend::new(model.clone(), 0).unwrap()
}

/// Two new streams of the model, known to `backend`: `(other, home)`.
#[allow(unsafe_code)] // `know_stream`, proven below
fn two_known_streams(model: &DriverModel, backend: &CudaBackend<DriverModel>) -> (Stream, Stream) {
    let (other, home) = (model.new_stream(), model.new_stream());
    // SAFETY: streams of the model's only context, live as long as the model.
    unsafe {
        backend.know_stream(other);
        backend.know_stream(home);
    }
    (other, home)
}

/// A model whose events complete only with the work before them, and the backend on it.
fn lazy_model() -> (DriverModel, CudaBackend<DriverModel>) {
    let model = DriverModel::new(crate::backend::doubles::ModelConfig {
        events_complete_at_once: false,
        ..Default::default()
    })
    .unwrap();
    let backend = open(&model);
    (model, backend)
}

/// A kernel on `stream` touching `len` bytes at `at`, and an event recorded after it.
#[allow(unsafe_code)] // the driver's event record, proven below
fn kernel(model: &DriverModel, stream: Stream, at: Addr, len: usize) -> Event {
    model.submit_work_touching(stream, &[(at as u64, len)]);
    let done = model.event_create().unwrap();
    // SAFETY: a live event and stream of the model.
    unsafe { model.event_record(done, stream) }.unwrap();
    done
}

/// One granule reserved, created and mapped read-write on `backend`: its address and length.
fn one_mapped_granule(backend: &CudaBackend<DriverModel>) -> (Addr, usize) {
    let g = backend.granularity();
    let addr = backend.reserve(g).unwrap();
    let phys = backend.create(g).unwrap();
    backend.map(addr, g, phys, Access::ReadWrite).unwrap();
    (addr, g)
}

#[test]
fn an_unpin_without_a_pin_is_refused_and_keeps_the_backends_own_retain() {
    let model = DriverModel::default();
    let backend = open(&model);
    let e = backend.unpin().unwrap_err();
    assert_eq!(e.cause, Cause::Violation(Violation::NotPinned));
    assert_eq!(model.outstanding().retains, 1);
    backend.pin().unwrap();
    backend.unpin().unwrap();
    assert_eq!(model.outstanding().retains, 1);
    drop(backend);
    assert_eq!(model.outstanding().retains, 0);
}

#[test]
fn a_reservation_past_the_address_space_is_exhausted_before_the_driver() {
    let model = DriverModel::default();
    let backend = open(&model);
    let g = backend.granularity();
    let len = (backend.address_space() + g) & !(g - 1);
    let e = backend.reserve(len).unwrap_err();
    assert!(matches!(e.cause, Cause::AddressSpace { .. }), "{e}");
    assert_eq!(model.count(DriverCall::MemAddressReserve), 0);
}

#[test]
fn a_range_whose_end_overflows_is_refused_before_the_driver() {
    let model = DriverModel::default();
    let backend = open(&model);
    let g = backend.granularity();
    let phys = backend.create(g).unwrap();
    let top = usize::MAX - g + 1;
    let refused = [
        backend.free(top, 2 * g).unwrap_err(),
        backend
            .map(top, 2 * g, phys, Access::ReadWrite)
            .unwrap_err(),
        backend.unmap(top, 2 * g).unwrap_err(),
        backend.unmap(g, usize::MAX).unwrap_err(),
        backend.copy_into_phys(phys, top, 2 * g).unwrap_err(),
        backend.copy_from_host(usize::MAX, &[1, 2]).unwrap_err(),
        backend.copy_to_host(&mut [0; 2], usize::MAX).unwrap_err(),
    ];
    for e in &refused {
        assert!(matches!(e.cause, Cause::Violation(_)), "{e}");
    }
    for call in [
        DriverCall::MemAddressFree,
        DriverCall::MemMap,
        DriverCall::MemUnmap,
        DriverCall::MemcpyHtoD,
        DriverCall::MemcpyDtoH,
        DriverCall::MemcpyDtoD,
    ] {
        assert_eq!(model.count(call), 0, "{call:?}");
    }
    // An empty copy copies nothing, wherever: no driver call sees its address.
    backend.copy_from_host(0, &[]).unwrap();
    backend.copy_to_host(&mut [], usize::MAX).unwrap();
    assert_eq!(model.count(DriverCall::MemcpyHtoD), 0);
    backend.release(phys, g).unwrap();
}

#[test]
fn a_create_past_the_device_memory_is_out_of_memory() {
    let model = DriverModel::default();
    let backend = open(&model);
    let g = backend.granularity();
    let e = backend.create(usize::MAX & !(g - 1)).unwrap_err();
    assert!(matches!(e.cause, Cause::Driver { .. }), "{e}");
    assert_eq!(model.outstanding().physical_bytes, 0);
}

#[test]
fn an_event_named_twice_at_retirement_is_destroyed_once() {
    let model = DriverModel::default();
    let backend = open(&model);
    let fence = backend.fence();
    let marks = lock(&fence.0).clone();
    model.fail_nth(DriverCall::EventDestroy, 1, CuError::INVALID_VALUE);
    backend.retire_fence(fence); // fails: the event waits in `retired`
    assert_eq!(model.outstanding().events, 1);
    // A fence naming the same event (as a foreign one could) retires it once, not twice.
    backend.retire_fence(CudaFence(Mutex::new(marks)));
    assert_eq!(model.outstanding().events, 0);
    assert_eq!(model.count(DriverCall::EventDestroy), 2);
}

#[test]
fn a_scratch_range_waiting_to_be_freed_is_not_the_callers_to_map() {
    let model = DriverModel::default();
    let backend = open(&model);
    let g = backend.granularity();
    let (addr, src) = (backend.reserve(g).unwrap(), backend.create(g).unwrap());
    backend.map(addr, g, src, Access::ReadWrite).unwrap();
    let dst = backend.create(g).unwrap();
    model.fail_nth(DriverCall::MemAddressFree, 1, CuError::INVALID_VALUE);
    backend.copy_into_phys(dst, addr, g).unwrap();
    let (scratch, span) = lock(&backend.state).scratch[0];
    let e = backend
        .map(scratch as Addr, span, dst, Access::ReadWrite)
        .unwrap_err();
    assert!(
        matches!(e.cause, Cause::Violation(Violation::NotReserved { .. })),
        "{e}"
    );
    // The next copy frees the scratch range.
    backend.copy_into_phys(dst, addr, g).unwrap();
    assert!(lock(&backend.state).scratch.is_empty());
    assert_eq!(model.outstanding().reservations, 1);
}

/// A use on a stream the backend does not hold (neither covered nor known), or on the
/// per-thread stream, is not noted (`touch` says `false`), and a device view's use there is
/// refused with nothing called for it (only the home stream's own order); a held stream's is
/// noted, as the home stream's use was. Fails if `touch` takes a stream it
/// does not hold (its `||` → `&&`).
#[test]
#[allow(unsafe_code)] // the backend's `use_through_view`, proven at the call
fn a_use_on_a_stream_the_backend_does_not_hold_is_not_noted() {
    let (model, backend) = lazy_model();
    let (other, home) = two_known_streams(&model, &backend);
    let stranger = model.new_stream();
    let (addr, g) = one_mapped_granule(&backend);
    assert!(!backend.touch(stranger, addr), "a stream it does not hold");
    assert!(
        !backend.touch(PER_THREAD_STREAM, addr),
        "the per-thread stream"
    );
    let calls = model.log().len();
    // SAFETY: `home` is held by the backend and stands for a view's lent home stream;
    // `stranger` is a live stream of the model's context.
    assert!(!unsafe { backend.use_through_view(home, stranger, addr, false) });
    assert_eq!(
        model.log().len(),
        calls + 2,
        "the home stream's own order only (enter, capture check): {:?}",
        &model.log()[calls..]
    );
    assert!(backend.touch(other, addr), "a known stream");
    let s = lock(&backend.state);
    let key = s.uses_key(addr).expect("the memory's uses");
    let touched = &s.uses[&key].touched;
    assert!(!touched.contains(&stranger), "{touched:?}");
    assert!(
        touched.contains(&other) && touched.contains(&home),
        "{touched:?}"
    );
    drop(s);
    backend.unmap(addr, g).unwrap();
}

/// A device view's use on another stream than its home (`use_through_view`, which
/// `DeviceView` calls on the real driver), with a capture another thread begins on the home
/// stream between the check and the join's record (the model's hook): the other stream never
/// joins it, nothing waits on or asks the captured event while it is open (the capture ends
/// valid), and the memory's release — which fences both streams — stays pending until the
/// capture has ended. Fails with the join's question after the record removed: the other
/// stream waited on the captured event and joined the capture.
#[test]
#[allow(unsafe_code)] // the backend's `use_through_view` and the driver's own query, each proven
fn a_view_used_on_another_stream_never_joins_a_capture_begun_on_its_home_and_holds_the_memory() {
    use crate::backend::doubles::CaptureMode;
    let (model, backend) = lazy_model();
    let (other, home) = two_known_streams(&model, &backend);
    let (addr, g) = one_mapped_granule(&backend);
    // SAFETY: `home` is held by the backend and stands for a view's lent home stream; `other`
    // is held and live.
    assert!(unsafe { backend.use_through_view(home, home, addr, true) });
    model.submit_work_touching(home, &[(addr as u64, g)]); // the view's kernel on its home
    let waits = model.count(DriverCall::StreamWaitEvent);
    // The first record from here on is the join's, on the home stream.
    model.begin_capture_before(&[DriverCall::EventRecord], 1, home, CaptureMode::Global);
    // SAFETY: as above.
    assert!(unsafe { backend.use_through_view(home, other, addr, false) });
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent),
        waits,
        "no wait on the captured event"
    );
    // SAFETY: a live stream of the model's context.
    let joined = unsafe { model.stream_get_capture_info(other) };
    assert_eq!(
        joined,
        Ok(CaptureInfo::None),
        "`other` did not join the capture"
    );
    let fence = backend.record_fence_over(Some(&[addr]));
    model.complete_work(); // the uncaptured work has completed; the capture is still open
    assert!(
        !backend.poll_fence(&fence),
        "the memory stays held while the capture is open"
    );
    assert_eq!(
        model.end_capture(home),
        Ok(()),
        "neither invalidated nor joined"
    );
    model.complete_work();
    assert!(
        backend.poll_fence(&fence),
        "and is let go once it has ended"
    );
    backend.destroy_fence(fence);
    backend.unmap(addr, g).unwrap();
    assert_eq!(model.lost_with(), None);
}

/// A device view's uses on another stream are ordered per memory: a read there joins the home
/// stream (one wait), and a later read on the home stream waits for a write made on the other
/// stream. Fails if `use_through_view` leaves out the join or the other stream's own order.
#[test]
#[allow(unsafe_code)] // the backend's `use_through_view`, proven at each call
fn a_write_through_a_view_on_another_stream_orders_the_next_use_on_its_home() {
    let model = DriverModel::default();
    let backend = open(&model);
    let (other, home) = two_known_streams(&model, &backend);
    let (addr, g) = one_mapped_granule(&backend);
    let waits = model.count(DriverCall::StreamWaitEvent);
    // SAFETY: both held and live; `home` stands for a view's lent home stream.
    assert!(unsafe { backend.use_through_view(home, other, addr, false) });
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent),
        waits + 1,
        "a read on `other`: the join of `home`"
    );
    // SAFETY: as above.
    assert!(unsafe { backend.use_through_view(home, other, addr, true) });
    let waits = model.count(DriverCall::StreamWaitEvent);
    // SAFETY: as above.
    assert!(unsafe { backend.use_through_view(home, home, addr, false) });
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent),
        waits + 1,
        "the read on `home` waits for the write on `other`"
    );
    backend.unmap(addr, g).unwrap();
}

/// The device view's join of its home stream (`join_stream`, which `DeviceView`
/// uses on the real driver): a capture begun on the home stream between the check and the
/// record is never joined — the other stream does not capture afterwards, the capture ends
/// valid — and the join says it did not happen. Without a capture, it joins (a wait).
#[test]
#[allow(unsafe_code)] // the backend's `join_stream` and the driver's own query, each proven
fn a_join_of_a_home_stream_never_joins_a_capture_begun_between_check_and_record() {
    use crate::backend::doubles::CaptureMode;
    let model = DriverModel::default();
    let backend = open(&model);
    let (other, home) = two_known_streams(&model, &backend);
    let waits = model.count(DriverCall::StreamWaitEvent);
    // SAFETY: both known to the backend and live.
    assert!(unsafe { backend.join_stream(other, home) }, "joined");
    assert_eq!(model.count(DriverCall::StreamWaitEvent), waits + 1);
    model.begin_capture_before(&[DriverCall::EventRecord], 1, home, CaptureMode::Global);
    // SAFETY: as above.
    assert!(!unsafe { backend.join_stream(other, home) }, "not joined");
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent),
        waits + 1,
        "no wait"
    );
    // SAFETY: a live stream of the model's context.
    let info = unsafe { model.stream_get_capture_info(other) };
    assert_eq!(
        info,
        Ok(CaptureInfo::None),
        "`other` did not join the capture"
    );
    assert_eq!(
        model.end_capture(home),
        Ok(()),
        "neither invalidated nor unjoined"
    );
}

/// Two reservations, each with a uses group of its own (each used through a view on its own
/// memory, `first` on stream `a`, `second` on `b`), whose groups become one as `second` maps
/// `first`'s memory (`shared`) — after `first`'s write on `a` (`wrote`), still running.
struct Joined {
    model: DriverModel,
    backend: CudaBackend<DriverModel>,
    b: Stream,
    g: usize,
    first: Addr,
    second: Addr,
    wrote: Event,
}

#[allow(unsafe_code)] // the backend's `order_use`, proven
fn joined() -> Joined {
    let (model, backend) = lazy_model();
    let (a, b) = two_known_streams(&model, &backend);
    let g = backend.granularity();
    let (first, second) = (backend.reserve(g).unwrap(), backend.reserve(g).unwrap());
    let (shared, own) = (backend.create(g).unwrap(), backend.create(g).unwrap());
    backend.map(first, g, shared, Access::ReadWrite).unwrap();
    backend.map(second, g, own, Access::ReadWrite).unwrap();
    // SAFETY: `b` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(b, second, true) }; // `second` gets a group of its own
    // SAFETY: `a` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(a, first, true) }; // and `first` another
    let wrote = kernel(&model, a, first, g);
    backend.unmap(second, g).unwrap();
    backend.map(second, g, shared, Access::ReadWrite).unwrap();
    Joined {
        model,
        backend,
        b,
        g,
        first,
        second,
        wrote,
    }
}

impl Joined {
    /// Writes through `at` on stream `b` (ordered by the backend), completes `b`'s work, and
    /// answers whether `first`'s write on `a` had to complete first.
    #[allow(unsafe_code)] // the backend's `order_use` and the driver's event calls, each proven
    fn write_on_b_waited(&self, at: Addr) -> bool {
        // SAFETY: `b` is known to the backend and live (as long as the model).
        unsafe { self.backend.order_use(self.b, at, true) };
        let _write = kernel(&self.model, self.b, at, self.g);
        self.model.complete_work_on(self.b);
        // SAFETY: a live event of the model.
        unsafe { self.model.event_query(self.wrote) }.unwrap()
    }
}

/// Two reservations that each have a uses group of their own are merged into one as the second
/// maps the first's memory: a write through the second then waits for the first's last write,
/// made on another stream before the second mapped that memory. Fails if the second
/// reservation keeps its own group (a reservation with a group taken by the join for one
/// already in the group it joins).
#[test]
fn a_reservation_with_uses_of_its_own_joins_the_group_of_the_memory_it_maps() {
    let j = joined();
    assert!(
        j.write_on_b_waited(j.second),
        "the write through `second` did not wait for `first`'s write to the same memory"
    );
    j.model.complete_work();
    j.backend.unmap(j.first, j.g).unwrap();
    j.backend.unmap(j.second, j.g).unwrap();
    assert_eq!(j.model.lost_with(), None);
}

/// A group two reservations joined keeps its uses until its last member is freed: with one of
/// the two freed, a write through the other still waits for the last write made through it on
/// another stream. Fails if a merge miscounts the joined group's members (a group of one and a
/// group of one counted as one), so that the first free forgets the group.
#[test]
fn a_joined_group_keeps_its_uses_until_its_last_member_is_freed() {
    let j = joined();
    j.backend.unmap(j.second, j.g).unwrap();
    j.backend.free(j.second, j.g).unwrap();
    assert!(
        j.write_on_b_waited(j.first),
        "with one member of a joined group freed, a write through the other did not wait for \
         its last write on another stream"
    );
    j.model.complete_work();
    j.backend.unmap(j.first, j.g).unwrap();
    assert_eq!(j.model.lost_with(), None);
}

/// A merge keeps every stream either group was touched by: once `second` has joined `first`'s
/// group, a fence over `first` covers `b`, which touched `second`'s group before the join.
/// Fails if the merge drops the touched streams of the group that goes (the fence is then done
/// while `b`'s work still runs).
#[test]
fn a_merged_group_is_fenced_on_every_stream_either_group_was_touched_by() {
    let j = joined();
    j.model.complete_work();
    j.model.submit_work_touching(j.b, &[]);
    let fence = j.backend.fence_for(&[j.first]);
    assert!(
        !j.backend.fence_done(&fence),
        "the fence over the merged group does not cover `b`"
    );
    j.model.complete_work();
    assert!(j.backend.fence_done(&fence));
    j.backend.retire_fence(fence);
    j.backend.unmap(j.first, j.g).unwrap();
    j.backend.unmap(j.second, j.g).unwrap();
    assert_eq!(j.model.lost_with(), None);
}

/// A merge keeps the earlier uses of the group that goes: `b` wrote `second` before the join,
/// so once `second` has joined `first`'s group, a write through `first` on a third stream
/// waits for the work queued on `b` (here after the join), as for `a`'s write to `first`.
/// Fails if the merge drops the readers and the writer of the group that goes.
#[test]
#[allow(unsafe_code)] // the backend's `order_use` and the driver's event calls, each proven
fn a_write_through_a_merged_group_waits_for_the_earlier_uses_of_either_group() {
    let j = joined();
    let on_b = kernel(&j.model, j.b, j.second, 0); // `b`'s use of `second`, still running
    let (c, _) = two_known_streams(&j.model, &j.backend);
    // SAFETY: `c` is known to the backend and live (as long as the model).
    unsafe { j.backend.order_use(c, j.first, true) };
    let _write = kernel(&j.model, c, j.first, j.g);
    j.model.complete_work_on(c);
    // SAFETY: live events of the model.
    let waited = unsafe { (j.model.event_query(j.wrote), j.model.event_query(on_b)) };
    assert_eq!(
        waited,
        (Ok(true), Ok(true)),
        "the write on `c` did not wait for both earlier uses"
    );
    j.model.complete_work();
    j.backend.unmap(j.first, j.g).unwrap();
    j.backend.unmap(j.second, j.g).unwrap();
    assert_eq!(j.model.lost_with(), None);
}

/// A merge lists each earlier stream once: a write after the join waits once for each stream
/// that used either group — `a`, which wrote both, and `d`, which read `first` — not twice for
/// `a`. Fails if the merge adds the gone group's writer as a reader of the kept group although
/// it is already the kept group's writer (a second `cuStreamWaitEvent` on the same stream).
#[test]
#[allow(unsafe_code)] // the backend's `order_use`, proven at each call
fn a_write_after_a_merge_waits_once_for_each_earlier_stream() {
    let (model, backend) = lazy_model();
    let (a, d) = two_known_streams(&model, &backend);
    let (c, _) = two_known_streams(&model, &backend);
    let g = backend.granularity();
    let (first, second) = (backend.reserve(g).unwrap(), backend.reserve(g).unwrap());
    let (shared, own) = (backend.create(g).unwrap(), backend.create(g).unwrap());
    backend.map(first, g, shared, Access::ReadWrite).unwrap();
    backend.map(second, g, own, Access::ReadWrite).unwrap();
    // SAFETY: `a`, `d` and `c` are known to the backend and live (as long as the model).
    unsafe {
        backend.order_use(a, second, true); // `second`'s group: written on `a`
        backend.order_use(a, first, true); // `first`'s: written on `a`,
        backend.order_use(d, first, false); // then read on `d`
    }
    backend.unmap(second, g).unwrap();
    backend.map(second, g, shared, Access::ReadWrite).unwrap(); // joins `first`'s group
    let waits = model.count(DriverCall::StreamWaitEvent);
    // SAFETY: as above.
    unsafe { backend.order_use(c, first, true) };
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent) - waits,
        2,
        "one wait for `a`, one for `d`"
    );
    model.complete_work();
    backend.unmap(first, g).unwrap();
    backend.unmap(second, g).unwrap();
    assert_eq!(model.lost_with(), None);
}

/// A write waits once for each earlier stream, also where the last writer read the memory
/// after its write (it is then both the writer and a reader). Fails if such a stream is waited
/// for twice (a second `cuStreamWaitEvent` on it).
#[test]
#[allow(unsafe_code)] // the backend's `order_use`, proven at each call
fn a_write_waits_once_for_a_writer_that_read_since() {
    let (model, backend) = lazy_model();
    let (a, d) = two_known_streams(&model, &backend);
    let (c, _) = two_known_streams(&model, &backend);
    let (x, g) = one_mapped_granule(&backend);
    // SAFETY: `a`, `d` and `c` are known to the backend and live (as long as the model).
    unsafe {
        backend.order_use(a, x, true); // written on `a`,
        backend.order_use(d, x, false); // read on `d`,
        backend.order_use(a, x, false); // and read on `a`
    }
    let waits = model.count(DriverCall::StreamWaitEvent);
    // SAFETY: as above.
    unsafe { backend.order_use(c, x, true) };
    assert_eq!(
        model.count(DriverCall::StreamWaitEvent) - waits,
        2,
        "one wait for `a`, one for `d`"
    );
    model.complete_work();
    backend.unmap(x, g).unwrap();
    assert_eq!(model.lost_with(), None);
}

/// Letting a stream go (`idle`) forgets its uses only: a use of the memory through another
/// stream (`a`, a write if `write`, else a read) stays one, so the memory's release fences `a`,
/// and the next write, on a third stream, waits for the use on `a`.
#[allow(unsafe_code)] // the backend's `order_use` and the driver's event calls, each proven
fn a_use_outlives_letting_another_stream_go(write: bool) {
    let (model, backend) = lazy_model();
    let (a, b) = two_known_streams(&model, &backend);
    let (idle, _) = two_known_streams(&model, &backend);
    let (x, g) = one_mapped_granule(&backend);
    // SAFETY: `a` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(a, x, write) };
    let used = kernel(&model, a, x, g);
    assert!(backend.forget_stream(idle), "nothing ran on it");
    let fence = backend.record_fence_over(Some(&[x]));
    assert!(
        !backend.poll_fence(&fence),
        "the release's fence covers the use on `a`"
    );
    // SAFETY: `b` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(b, x, true) };
    let _write = kernel(&model, b, x, g);
    model.complete_work_on(b);
    // SAFETY: a live event of the model.
    let waited = unsafe { model.event_query(used) }.unwrap();
    assert!(waited, "the write on `b` did not wait for the use on `a`");
    model.complete_work();
    assert!(backend.poll_fence(&fence));
    backend.destroy_fence(fence);
    backend.unmap(x, g).unwrap();
    assert_eq!(model.lost_with(), None);
}

/// [`a_use_outlives_letting_another_stream_go`] for a write: the last write through another
/// stream stays the memory's last write. Fails if letting a stream go clears the last writer
/// whichever stream it was.
#[test]
fn letting_a_stream_go_keeps_the_last_write_through_another() {
    a_use_outlives_letting_another_stream_go(true);
}

/// [`a_use_outlives_letting_another_stream_go`] for a read. Fails if letting a stream go drops
/// the other streams' reads or uses (`forget`'s `!=` → `==` in either list keeps only the
/// stream let go).
#[test]
fn letting_a_stream_go_keeps_the_reads_and_uses_through_others() {
    a_use_outlives_letting_another_stream_go(false);
}

/// A backend with no executable graph left to destroy makes no call for them as it drops: its
/// drop's only capture-mode exchanges are the sweep's (relaxed, then restored). Fails if the
/// destruction of dead graphs relaxes the mode with none to destroy (`destroy_dead_execs`'
/// `||` → `&&`: two more exchanges).
#[test]
fn a_backend_with_no_graph_to_destroy_drops_without_a_call_for_them() {
    let model = DriverModel::default();
    let backend = open(&model);
    let before = model.count(DriverCall::ThreadExchangeStreamCaptureMode);
    drop(backend);
    assert_eq!(
        model.count(DriverCall::ThreadExchangeStreamCaptureMode) - before,
        2,
        "{:?}",
        model.log()
    );
}

/// A third reservation mapping memory two others map joins their group too: a write through it
/// waits for the first's last write, made on another stream. Fails if only the second mapping
/// of a memory joins (a third, or later, keeps a group of its own).
#[test]
#[allow(unsafe_code)] // the backend's `order_use` and the driver's event calls, each proven
fn a_third_mapping_of_the_same_memory_joins_its_group() {
    let (model, backend) = lazy_model();
    let (a, c) = two_known_streams(&model, &backend);
    let g = backend.granularity();
    let reserved = [(); 3].map(|()| backend.reserve(g).unwrap());
    let shared = backend.create(g).unwrap();
    for &at in &reserved[..2] {
        backend.map(at, g, shared, Access::ReadWrite).unwrap();
    }
    // SAFETY: `a` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(a, reserved[0], true) };
    let wrote = kernel(&model, a, reserved[0], g);
    // The third mapping of the same memory.
    backend
        .map(reserved[2], g, shared, Access::ReadWrite)
        .unwrap();
    // SAFETY: `c` is known to the backend and live (as long as the model).
    unsafe { backend.order_use(c, reserved[2], true) };
    model.submit_work_touching(c, &[(reserved[2] as u64, g)]);
    model.complete_work_on(c);
    // SAFETY: a live event of the model.
    let finished = unsafe { model.event_query(wrote) }.unwrap();
    assert!(
        finished,
        "the write through the third mapping did not wait for the first's write"
    );
    model.complete_work();
    for at in reserved {
        backend.unmap(at, g).unwrap();
    }
    assert_eq!(model.lost_with(), None);
}

/// A group of uses goes with its last reservation: two reservations mapping one memory share a
/// group, which stays while either is reserved and is forgotten when both are freed — also after
/// many rounds (no group left behind to grow the record). Fails if `leave_group` never brings
/// a group's count of members to 0.
#[test]
#[allow(unsafe_code)] // `order_use`, proven below
fn a_group_of_uses_goes_with_its_last_reservation() {
    let (model, backend) = lazy_model();
    let (a, _) = two_known_streams(&model, &backend);
    let g = backend.granularity();
    for round in 0..3 {
        let reserved = [(); 2].map(|()| backend.reserve(g).unwrap());
        let shared = backend.create(g).unwrap();
        for &at in &reserved {
            backend.map(at, g, shared, Access::ReadWrite).unwrap();
        }
        // SAFETY: `a` is known to the backend and live (as long as the model).
        unsafe { backend.order_use(a, reserved[0], true) };
        model.submit_work_touching(a, &[(reserved[0] as u64, g)]);
        model.complete_work_on(a);
        let group = lock(&backend.state).uses_key(reserved[1]);
        assert!(
            group.is_some(),
            "round {round}: the second mapping is not in the group"
        );
        assert_eq!(group, lock(&backend.state).uses_key(reserved[0]));
        for &at in &reserved {
            backend.unmap(at, g).unwrap();
        }
        backend.release(shared, g).unwrap();
        backend.free(reserved[0], g).unwrap();
        assert_eq!(
            lock(&backend.state).uses.len(),
            1,
            "round {round}: the group went with its first reservation"
        );
        backend.free(reserved[1], g).unwrap();
        let state = lock(&backend.state);
        assert!(
            state.uses.is_empty() && state.groups.is_empty(),
            "round {round}: a group outlived its reservations: {} groups of uses",
            state.uses.len()
        );
    }
    assert_eq!(model.lost_with(), None);
}

/// A range held for a capture is held by a graph (and reported withheld), one beside it is
/// not, and once let go it is not either. Fails if `held_by_graph` answers `true` for all.
#[test]
fn only_what_a_capture_holds_is_held_by_a_graph() {
    let model = DriverModel::default();
    let backend = open(&model);
    let (at, len): (Addr, usize) = (0x10_0000, 0x1000);
    assert!(!backend.held_by_graph(at, len));
    backend.hold_for_capture(at, len);
    assert!(backend.held_by_graph(at, len) && backend.withheld(at + len - 1, 1));
    assert!(!backend.held_by_graph(at + len, len), "the range beside it");
    backend.let_go(&[(at, len)]);
    assert!(!backend.held_by_graph(at, len) && !backend.withheld(at, len));
}
