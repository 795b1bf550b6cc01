//! Mechanisms chosen at run time: the registry's selection is never a dead
//! or unregistered mechanism, whatever the interleaving of a probed selection with the
//! registry's other changes (played in a set order through the `test-hooks` phases); a
//! mechanism whose creates fail for good is retired, new bindings go to the healthy one and old
//! tokens release on theirs; and a property test over random steps on two mechanisms.

use crate::common::{self, sim};
use memtoken::backend::doubles::{FaultHandle, Faulty, SimBackend};
use memtoken::backend::{Backend, Op};
use memtoken::mechanism::{Lifecycle, MechanismError, MechanismId, Mechanisms, Phase};
use memtoken::{Allocation, Binding, Budget, Committed, Device, make_guard};
use proptest::prelude::*;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::{self, ThreadId};

/// Holds the thread that registers itself, at one phase, until told to go on.
struct Gate {
    phase: Phase,
    thread: Mutex<Option<ThreadId>>,
    reached: Mutex<Sender<()>>,
    go: Mutex<Receiver<()>>,
}

/// Installs a gate at `phase` on `registry`: returns it, a receiver told when the gated thread
/// reaches the phase, and a sender that lets it go on.
fn gate(registry: &Mechanisms, phase: Phase) -> (Arc<Gate>, Receiver<()>, Sender<()>) {
    let (reached, reached_rx) = channel();
    let (go_tx, go) = channel();
    let gate = Arc::new(Gate {
        phase,
        thread: Mutex::new(None),
        reached: Mutex::new(reached),
        go: Mutex::new(go),
    });
    let hook = Arc::clone(&gate);
    registry.set_hook(move |p| {
        let me = Some(thread::current().id());
        if p == hook.phase && *hook.thread.lock().unwrap() == me {
            hook.reached.lock().unwrap().send(()).unwrap();
            hook.go.lock().unwrap().recv().unwrap();
        }
    });
    (gate, reached_rx, go_tx)
}

/// A registry of mechanisms named `names`, the first selected.
fn selected_first<const N: usize>(names: [&str; N]) -> (Mechanisms, [MechanismId; N]) {
    let registry = Mechanisms::new();
    let ids = names.map(|n| registry.register(n).unwrap());
    registry.select(ids[0]).unwrap();
    (registry, ids)
}

/// The selection is none, or a registered and active mechanism.
fn assert_valid(registry: &Mechanisms) {
    if let Some(id) = registry.selected() {
        assert_eq!(
            registry.lifecycle(id),
            Some(Lifecycle::Active),
            "{id} is selected: {registry:?}"
        );
    }
}

/// Runs `select_probed(candidate)` (its probe failing if `probe_fails`) on a thread held at
/// `phase`; runs `meanwhile` while it is held; returns what the selection returned.
fn race(
    registry: &Mechanisms,
    candidate: MechanismId,
    probe_fails: bool,
    phase: Phase,
    meanwhile: impl FnOnce(),
) -> Result<(), MechanismError> {
    let (gate, reached, go) = gate(registry, phase);
    thread::scope(|s| {
        // Owned here: a failed check drops it, which frees the held thread (its wait fails).
        let go = go;
        let selecting = s.spawn(|| {
            *gate.thread.lock().unwrap() = Some(thread::current().id());
            registry.select_probed(candidate, || {
                if probe_fails {
                    Err("a trial create failed")
                } else {
                    Ok(())
                }
            })
        });
        reached.recv().unwrap();
        if phase == Phase::Published {
            assert_eq!(registry.selected(), Some(candidate), "published first");
        }
        meanwhile();
        assert_valid(registry);
        go.send(()).unwrap();
        let out = selecting.join().unwrap();
        assert_valid(registry);
        out
    })
}

/// Two threads select: one, held after publishing its candidate, sees the candidate retired
/// by the other — the prior healthy mechanism is restored, at either phase. Fails if a
/// retirement of the selected mechanism clears the selection instead of restoring a healthy
/// prior one (`drop_selection` without its fallback).
#[test]
fn a_selection_racing_the_retirement_of_its_candidate_restores_the_prior_healthy_one() {
    for phase in [Phase::Published, Phase::Probed] {
        let registry = Mechanisms::new();
        let (a, b) = (
            registry.register("a").unwrap(),
            registry.register("b").unwrap(),
        );
        registry.select(a).unwrap();
        let out = race(&registry, b, false, phase, || registry.retire(b).unwrap());
        assert!(
            matches!(out, Err(MechanismError::Refused { now: Some(now), .. }) if now == a),
            "{phase:?}: {out:?}"
        );
        assert_eq!(registry.selected(), Some(a), "{phase:?}");
    }
}

/// A probed selection whose probe fails restores the prior mechanism only while it is
/// registered and active: retired meanwhile, the selection clears. Fails if the restore does
/// not check the prior's lifecycle (it would select a retired mechanism).
#[test]
fn a_failed_probe_restores_the_prior_only_if_it_is_still_active() {
    let registry = Mechanisms::new();
    let (a, b) = (
        registry.register("a").unwrap(),
        registry.register("b").unwrap(),
    );
    registry.select(a).unwrap();
    let out = race(&registry, b, true, Phase::Published, || {});
    assert!(matches!(out, Err(MechanismError::Refused { now: Some(now), .. }) if now == a));
    assert_eq!(registry.selected(), Some(a), "the healthy prior restored");
    // Now the prior dies while the probe runs.
    let out = race(&registry, b, true, Phase::Published, || {
        registry.retire(a).unwrap()
    });
    assert!(
        matches!(out, Err(MechanismError::Refused { now: None, .. })),
        "{out:?}"
    );
    assert_eq!(registry.selected(), None, "cleared, not the retired prior");
}

/// A selection made while a probed one is held is never overwritten by the held one's
/// refusal. Fails if the refusal does not check that the selection is still its own.
#[test]
fn a_newer_selection_is_never_overwritten() {
    for phase in [Phase::Published, Phase::Probed] {
        let registry = Mechanisms::new();
        let a = registry.register("a").unwrap();
        let b = registry.register("b").unwrap();
        let c = registry.register("c").unwrap();
        registry.select(a).unwrap();
        let out = race(&registry, b, true, phase, || registry.select(c).unwrap());
        assert!(out.is_err());
        assert_eq!(
            registry.selected(),
            Some(c),
            "{phase:?}: the newer selection stays"
        );
    }
}

/// Every interleaving of a held probed selection with one of the registry's other changes, at
/// each phase, with a probe that passes or fails: the selection is never a dead or
/// unregistered mechanism (checked while the selection is held, and after).
#[test]
fn no_interleaving_leaves_a_dead_or_unregistered_selection() {
    type Change = fn(&Mechanisms, [MechanismId; 3]);
    let changes: [(&str, Change); 8] = [
        ("retire the candidate", |r, [_, b, _]| r.retire(b).unwrap()),
        ("lose the candidate", |r, [_, b, _]| r.lose(b).unwrap()),
        ("retire the prior", |r, [a, ..]| r.retire(a).unwrap()),
        ("retire both", |r, [a, b, _]| {
            r.retire(a).unwrap();
            r.retire(b).unwrap();
        }),
        ("unregister the prior", |r, [a, ..]| {
            r.retire(a).unwrap();
            r.terminate(a).unwrap();
            r.unregister(a).unwrap();
        }),
        ("reuse the prior's slot", |r, [a, b, _]| {
            r.retire(a).unwrap();
            r.terminate(a).unwrap();
            r.unregister(a).unwrap();
            let again = r.register("a again").unwrap();
            assert_ne!(again, a);
            r.retire(b).unwrap();
        }),
        ("select another", |r, [.., c]| r.select(c).unwrap()),
        ("select another, retire it", |r, [.., c]| {
            r.select(c).unwrap();
            r.retire(c).unwrap();
        }),
    ];
    for phase in [Phase::Published, Phase::Probed] {
        for probe_fails in [false, true] {
            for (what, change) in changes {
                let registry = Mechanisms::new();
                let ids = ["a", "b", "c"].map(|n| registry.register(n).unwrap());
                registry.select(ids[0]).unwrap();
                let _ = race(&registry, ids[1], probe_fails, phase, || {
                    change(&registry, ids)
                });
                assert_valid(&registry);
                let _ = what;
            }
        }
    }
}

/// The lifecycle: active → retired or lost → terminated → unregistered, each from its own state
/// only; a retired mechanism cannot be selected; an unregistered one is not known.
#[test]
fn a_lifecycle_moves_one_way() {
    let registry = Mechanisms::new();
    let a = registry.register("a").unwrap();
    assert!(matches!(
        registry.terminate(a),
        Err(MechanismError::Inactive {
            now: Lifecycle::Active,
            ..
        })
    ));
    registry.lose(a).unwrap();
    assert!(registry.retire(a).is_err(), "lost is terminal for new work");
    assert!(matches!(
        registry.select(a),
        Err(MechanismError::Inactive { .. })
    ));
    assert!(registry.unregister(a).is_err(), "terminated first");
    registry.terminate(a).unwrap();
    registry.unregister(a).unwrap();
    assert_eq!(registry.lifecycle(a), None);
    assert_eq!(registry.select(a), Err(MechanismError::Unregistered(a)));
    assert_eq!(registry.name(a), None);
    let again = registry.register("again").unwrap();
    assert_eq!(registry.name(again).as_deref(), Some("again"));
    for i in 1..memtoken::mechanism::MAX_MECHANISMS {
        registry.register(format!("m{i}")).unwrap();
    }
    assert_eq!(registry.register("one too many"), Err(MechanismError::Full));
}

// ---- From the review of the registry: each fails on the code before its fix. ----

/// A plain selection of a candidate whose probe is in flight is newer than it: the probe's
/// refusal leaves it (the candidate was confirmed meanwhile).
#[test]
fn a_selection_of_a_candidate_in_flight_is_not_undone_by_its_failed_probe() {
    let (registry, [_p, x]) = selected_first(["p", "x"]);
    let out = race(&registry, x, true, Phase::Published, || {
        registry.select(x).unwrap()
    });
    assert!(out.is_err());
    assert_eq!(registry.selected(), Some(x));
}

/// Only confirmed selections are fallen back to: two overlapping probes that both fail end on
/// the last confirmed selection, never on a refused candidate; nor does retiring a newer
/// selection fall back to one.
#[test]
fn a_refused_candidate_is_never_fallen_back_to() {
    let (registry, [p, x, y]) = selected_first(["p", "x", "y"]);
    // x is published; y is published over it (its probe fails after x's has).
    let out = race(&registry, x, true, Phase::Published, || {
        let y_out = registry.select_probed(y, || Err("y's trial create failed"));
        assert!(y_out.is_err());
    });
    assert!(out.is_err());
    assert_eq!(registry.selected(), Some(p), "the last confirmed");
    // x's probe fails while a plain select(y) holds; retiring y goes back to p, not x.
    let out = race(&registry, x, true, Phase::Published, || {
        registry.select(y).unwrap()
    });
    assert!(out.is_err());
    registry.retire(y).unwrap();
    assert_eq!(registry.selected(), Some(p));
}

/// Retirements fall back through the whole history of confirmed selections, most recent
/// first: select a, b, c; retire c → b; retire b → a. Selecting again moves an entry, never
/// duplicates it: select a, b, a, c; retire c → a; retire a → b; retire b → none. Fails if a
/// retirement falls back one step only (b's retirement cleared the selection), or if a
/// re-selection leaves a stale entry behind (a would come back twice, or b first).
#[test]
fn retirements_fall_back_through_every_confirmed_selection_most_recent_first() {
    let (registry, [a, b, c]) = selected_first(["a", "b", "c"]);
    registry.select(b).unwrap();
    registry.select(c).unwrap();
    registry.retire(c).unwrap();
    assert_eq!(registry.selected(), Some(b), "retire c: the one before it");
    registry.retire(b).unwrap();
    assert_eq!(
        registry.selected(),
        Some(a),
        "retire b: the one before that"
    );
    registry.retire(a).unwrap();
    assert_eq!(registry.selected(), None, "nothing active left");

    let (registry, [a, b, c]) = selected_first(["a", "b", "c"]);
    registry.select(b).unwrap();
    registry.select(a).unwrap(); // a moves to the most recent place
    registry.select(c).unwrap();
    registry.retire(c).unwrap();
    assert_eq!(registry.selected(), Some(a), "a, the most recent before c");
    registry.retire(a).unwrap();
    assert_eq!(
        registry.selected(),
        Some(b),
        "then b: a was not entered twice"
    );
    registry.retire(b).unwrap();
    assert_eq!(registry.selected(), None);
}

/// Unregistering a terminated mechanism leaves the others' history alone: select a, b, c;
/// retire, terminate and unregister a; retire c → b. Fails if the unregister drops the other
/// confirmed selections (the retirement would then clear the selection).
#[test]
fn unregistering_one_mechanism_keeps_the_others_history() {
    let (registry, [a, b, c]) = selected_first(["a", "b", "c"]);
    registry.select(b).unwrap();
    registry.select(c).unwrap();
    registry.retire(a).unwrap();
    registry.terminate(a).unwrap();
    registry.unregister(a).unwrap();
    registry.retire(c).unwrap();
    assert_eq!(registry.selected(), Some(b), "b, the one before c");
}

/// One slot registered, ended and unregistered over and over gives a new id each time, and
/// an id of an earlier registration is never taken for a later one (it is unregistered, not
/// the mechanism now in its slot). Fails if a slot's generations repeat.
#[test]
fn a_slot_reused_many_times_never_gives_an_id_twice() {
    let registry = Mechanisms::new();
    let mut ids: Vec<MechanismId> = Vec::new();
    for round in 0..12 {
        let id = registry.register(format!("m{round}")).unwrap();
        assert!(!ids.contains(&id), "round {round}: {id} was given before");
        for old in &ids {
            assert_eq!(
                registry.lifecycle(*old),
                None,
                "round {round}: {old} came back"
            );
        }
        ids.push(id);
        registry.retire(id).unwrap();
        registry.terminate(id).unwrap();
        registry.unregister(id).unwrap();
    }
}

/// A refused probe falls back through the history too, skipping what is no longer active:
/// select a, b, c; retire b (not selected: nothing moves); probe d and fail → c; retire c → a
/// (b is gone from the history). Fails if a refusal or a retirement falls back to a retired
/// entry.
#[test]
fn a_refused_probe_falls_back_to_the_most_recent_active_confirmed_selection() {
    let (registry, [a, b, c, d]) = selected_first(["a", "b", "c", "d"]);
    registry.select(b).unwrap();
    registry.select(c).unwrap();
    registry.retire(b).unwrap();
    assert_eq!(
        registry.selected(),
        Some(c),
        "b was not selected: nothing moves"
    );
    let out = registry.select_probed(d, || Err("d's trial create failed"));
    assert!(
        matches!(out, Err(MechanismError::Refused { now: Some(now), .. }) if now == c),
        "{out:?}"
    );
    registry.retire(c).unwrap();
    assert_eq!(registry.selected(), Some(a), "b is retired: skipped");
}

/// A probe that panics refuses its selection as it unwinds.
#[test]
fn a_probe_that_panics_refuses_its_selection() {
    let (registry, [p, x]) = selected_first(["p", "x"]);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        registry.select_probed(x, || -> Result<(), &str> {
            panic!("the trial create panicked")
        })
    }));
    assert!(out.is_err());
    assert_eq!(registry.selected(), Some(p));
}

/// `on_selected` tries again when its mechanism stopped being active as it made something:
/// whether the making failed for it or succeeded (what was made is dropped, never returned on
/// a dead mechanism). And a name that panics leaves the registry as it was.
#[test]
fn making_on_a_mechanism_that_dies_meanwhile_tries_the_next_and_a_panicking_name_changes_nothing() {
    let (registry, [p, x]) = selected_first(["p", "x"]);
    registry.select(x).unwrap();
    let out = registry.on_selected(|id| {
        if id == x {
            registry.lose(x).unwrap(); // its context goes as the binding is made
            Err("context lost")
        } else {
            Ok(id)
        }
    });
    assert!(matches!(out, Ok(ref m) if m.mechanism == p), "{out:?}");

    let (registry, [p, x]) = selected_first(["p", "x"]);
    registry.select(x).unwrap();
    let out = registry.on_selected(|id| -> Result<_, &str> {
        if id == x {
            registry.lose(x).unwrap(); // lost as it is made, but made
        }
        Ok(id)
    });
    assert!(
        matches!(out, Ok(ref m) if m.mechanism == p && m.value == p),
        "made again on the mechanism selected now: {out:?}"
    );

    struct Bomb;
    impl From<Bomb> for String {
        fn from(_: Bomb) -> String {
            panic!("a name that panics")
        }
    }
    let registry = Mechanisms::new();
    let panicked =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| registry.register(Bomb)));
    assert!(panicked.is_err());
    let b = registry.register("b").unwrap();
    assert_eq!(registry.name(b).as_deref(), Some("b"), "{registry:?}");
}

/// A lock-free reader never sees a retired mechanism selected, and an id of one registry is
/// nothing to another.
#[test]
fn readers_never_see_a_dead_selection_and_ids_belong_to_their_registry() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let registry = Mechanisms::new();
    let (stop, seen) = (AtomicBool::new(false), AtomicBool::new(false));
    thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Some(x) = registry.selected()
                    && registry.lifecycle(x) != Some(Lifecycle::Active)
                    && registry.selected() == Some(x)
                {
                    seen.store(true, Ordering::SeqCst);
                }
            }
        });
        for _ in 0..common::unless_miri(100_000, 10) {
            let m = registry.register("m").unwrap();
            registry.select(m).unwrap();
            registry.retire(m).unwrap();
            registry.terminate(m).unwrap();
            registry.unregister(m).unwrap();
        }
        stop.store(true, Ordering::SeqCst);
    });
    assert!(
        !seen.load(Ordering::SeqCst),
        "a retired mechanism read as selected"
    );
    let (a, b) = (Mechanisms::new(), Mechanisms::new());
    let of_a = a.register("a's").unwrap();
    let _of_b = b.register("b's").unwrap();
    assert_eq!(b.select(of_a), Err(MechanismError::Unregistered(of_a)));
    assert_eq!(b.name(of_a), None);
}

/// A binding on one of two devices (each a mechanism, with its own brand).
enum Either<'a, 'b, 'ia, 'ib, B: Backend = Faulty<SimBackend>> {
    A(Binding<'a, 'ia, B>),
    B(Binding<'b, 'ib, B>),
}

/// A token on one of the two devices.
enum Token<'a, 'b, 'ia, 'ib, B: Backend = Faulty<SimBackend>> {
    A(Allocation<'a, 'ia, B, Committed>),
    B(Allocation<'b, 'ib, B, Committed>),
}

/// Binds on `mechanism`'s device: `a`'s for `ids.0`, `b`'s for `ids.1`.
fn bind_on<'a, 'b, 'ia, 'ib, B: Backend>(
    mechanism: MechanismId,
    ids: (MechanismId, MechanismId),
    a: &'a Device<'ia, B>,
    b: &'b Device<'ib, B>,
) -> Result<Either<'a, 'b, 'ia, 'ib, B>, memtoken::backend::BackendError> {
    if mechanism == ids.0 {
        Ok(Either::A(a.bind(Budget::unlimited())?))
    } else {
        assert_eq!(mechanism, ids.1);
        Ok(Either::B(b.bind(Budget::unlimited())?))
    }
}

/// A mechanism whose creates start failing for good is retired: new bindings go to the healthy
/// one, and the old tokens still release on theirs. Fails if a retired mechanism stays
/// selected.
#[test]
fn a_mechanism_failing_for_good_is_retired_and_old_tokens_release_on_it() {
    make_guard!(ga);
    make_guard!(gb);
    let (fa, fb) = (Faulty::new(sim(1 << 30)), Faulty::new(sim(1 << 30)));
    let (ha, hb): (FaultHandle, FaultHandle) = (fa.handle(), fb.handle());
    let (da, db) = (Device::new(ga, fa), Device::new(gb, fb));
    let g = da.granularity();
    let registry = Mechanisms::new();
    let ids = (
        registry.register("vmm").unwrap(),
        registry.register("plain").unwrap(),
    );
    registry.select(ids.0).unwrap();
    let first = registry.on_selected(|m| bind_on(m, ids, &da, &db)).unwrap();
    assert_eq!(first.mechanism, ids.0);
    let Either::A(binding_a) = &first.value else {
        panic!("on the selected mechanism")
    };
    let old = binding_a.reserve(g).unwrap().commit().unwrap();
    // From now on every create fails on the first mechanism: the engine retires it.
    ha.fail_from(Op::Create, 1);
    assert!(binding_a.reserve(g).unwrap().commit().is_err());
    registry.retire(ids.0).unwrap();
    registry.select(ids.1).unwrap();
    let second = registry.on_selected(|m| bind_on(m, ids, &da, &db)).unwrap();
    assert_eq!(
        second.mechanism, ids.1,
        "new bindings go to the healthy one"
    );
    let Either::B(binding_b) = &second.value else {
        panic!("on the healthy mechanism")
    };
    let new = binding_b.reserve(g).unwrap().commit().unwrap();
    // The old token still releases on its own mechanism (releases never create).
    old.release().complete().unwrap();
    new.release().complete().unwrap();
    drop((first, second));
    ha.clear();
    registry.terminate(ids.0).unwrap();
    assert!(da.close().is_clean());
    assert!(db.close().is_clean());
    assert!(ha.outstanding().is_zero() && hb.outstanding().is_zero());
}

/// Probing at open: a CUDA mechanism on a device without virtual memory management fails its
/// probe (opening its backend), so the selection stays on the healthy mechanism (the host
/// here), which new bindings go to; the CUDA mechanism is retired. Fails if a failed probe
/// leaves its candidate selected.
#[test]
fn a_device_without_vmm_fails_its_probe_and_the_selection_stays_on_the_host() {
    use memtoken::backend::cuda::CudaBackend;
    use memtoken::backend::doubles::{DriverModel, ModelConfig};
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap();
    let registry = Mechanisms::new();
    let host = registry.register("host").unwrap();
    let cuda = registry.register("cuda-vmm").unwrap();
    registry.select(host).unwrap();
    let mut opened = None;
    let out = registry.select_probed(cuda, || {
        CudaBackend::new(model.clone(), 0).map(|b| opened = Some(b))
    });
    let Err(MechanismError::Refused { why, now, .. }) = out else {
        panic!("{out:?}")
    };
    assert!(why.contains("virtual memory management"), "{why}");
    assert_eq!(now, Some(host), "the healthy mechanism stays selected");
    assert!(opened.is_none());
    registry.retire(cuda).unwrap();
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let bound = registry
        .on_selected(|m| {
            assert_eq!(m, host);
            device.bind(Budget::unlimited())
        })
        .unwrap();
    let token = bound
        .value
        .reserve(device.granularity())
        .unwrap()
        .commit()
        .unwrap();
    token.release().complete().unwrap();
    drop(bound);
    assert!(device.close().is_clean());
}

#[derive(Clone, Debug)]
enum Step {
    Select(usize),
    SelectProbed(usize, bool),
    Retire(usize),
    Lose(usize),
    Bind,
    Commit(usize),
    Release(usize),
    Fault(usize, Op, u64),
}

fn step() -> impl Strategy<Value = Step> {
    let op = prop::sample::select(vec![
        Op::Reserve,
        Op::Create,
        Op::Map,
        Op::Unmap,
        Op::Release,
        Op::Free,
    ]);
    prop_oneof![
        2 => (0usize..2).prop_map(Step::Select),
        2 => (0usize..2, any::<bool>()).prop_map(|(m, ok)| Step::SelectProbed(m, ok)),
        1 => (0usize..2).prop_map(Step::Retire),
        1 => (0usize..2).prop_map(Step::Lose),
        3 => Just(Step::Bind),
        4 => any::<usize>().prop_map(Step::Commit),
        3 => any::<usize>().prop_map(Step::Release),
        1 => (0usize..2, op, 1u64..4).prop_map(|(m, op, n)| Step::Fault(m, op, n)),
    ]
}

/// Random steps on two mechanisms (two devices over the simulator) with faults.
fn run(steps: &[Step]) {
    let (sa, sb) = (sim(1 << 30), sim(1 << 30));
    let (la, lb) = (sa.clone(), sb.clone());
    run_on(
        steps,
        [Faulty::new(sa), Faulty::new(sb)],
        [&move || la.lose_context(), &move || lb.lose_context()],
        &|_| (),
        &|| (),
    );
}

/// Random steps on the CUDA backend's two mechanisms, each a device over a driver model of its
/// own: VMM, and plain on a device without VMM.
fn run_cuda(steps: &[Step]) {
    use memtoken::backend::cuda::CudaBackend;
    use memtoken::backend::doubles::{DriverModel, ModelConfig, ModelOutstanding};
    let vmm = common::model();
    let plain = DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap();
    let (lv, lp) = (vmm.clone(), plain.clone());
    let (cv, cp) = (vmm.clone(), plain.clone());
    let (ov, op) = (vmm.clone(), plain.clone());
    run_on(
        steps,
        [
            Faulty::new(CudaBackend::new(vmm, 0).unwrap()),
            Faulty::new(CudaBackend::new_plain(plain, 0).unwrap()),
        ],
        [&move || lv.lose_context(), &move || lp.lose_context()],
        // After every step each device owns (and is charged) exactly what its driver holds,
        // quarantined and deferred memory included.
        &move |owned| {
            for (model, owned) in [&ov, &op].into_iter().zip(owned) {
                if model.lost_with().is_none() {
                    assert_eq!(owned, model.outstanding().physical_bytes as u64);
                }
            }
        },
        // Nothing is left in either driver, unless its context was lost (which took it all).
        &move || {
            for model in [&cv, &cp] {
                if model.lost_with().is_none() {
                    assert_eq!(model.outstanding(), ModelOutstanding::default());
                }
            }
        },
    );
}

/// Random steps on two mechanisms, the devices over `backends` (wrapped in `Faulty` for its
/// faults and counts), `lose[m]` taking mechanism `m`'s context down, `after_step` checking
/// the devices' owned bytes after every step, and `at_end` checking what is left below the
/// backends once both devices are closed.
fn run_on<B: Backend>(
    steps: &[Step],
    backends: [Faulty<B>; 2],
    lose: [&dyn Fn(); 2],
    after_step: &dyn Fn([u64; 2]),
    at_end: &dyn Fn(),
) {
    make_guard!(ga);
    make_guard!(gb);
    let [fa, fb] = backends;
    let handles = [fa.handle(), fb.handle()];
    let (da, db) = (Device::new(ga, fa), Device::new(gb, fb));
    let g = da.granularity();
    let registry = Mechanisms::new();
    let ids = (
        registry.register("a").unwrap(),
        registry.register("b").unwrap(),
    );
    let id = |m: usize| if m == 0 { ids.0 } else { ids.1 };
    // Bindings are set once each (a `OnceCell` sets through `&`), so tokens can borrow them
    // while more are made.
    let bindings: [std::cell::OnceCell<_>; 16] = Default::default();
    let mut made = 0;
    let mut tokens: Vec<(MechanismId, Token<'_, '_, '_, '_, Faulty<B>>)> = Vec::new();
    let mut lost = [false; 2];
    for step in steps {
        match *step {
            Step::Select(m) => {
                let _ = registry.select(id(m));
            }
            Step::SelectProbed(m, ok) => {
                let _ = registry.select_probed(id(m), || if ok { Ok(()) } else { Err("probe") });
            }
            Step::Retire(m) => {
                let _ = registry.retire(id(m));
            }
            Step::Lose(m) => {
                if registry.lose(id(m)).is_ok() {
                    lose[m]();
                    lost[m] = true;
                }
            }
            Step::Bind => {
                if made < bindings.len()
                    && let Ok(bound) = registry.on_selected(|m| bind_on(m, ids, &da, &db))
                {
                    let _ = bindings[made].set(bound);
                    made += 1;
                }
            }
            Step::Commit(k) => {
                if made == 0 {
                    continue;
                }
                let bound = bindings[k % made].get().expect("made");
                let token = match &bound.value {
                    Either::A(b) => b
                        .reserve(g)
                        .ok()
                        .and_then(|r| r.commit().ok())
                        .map(Token::A),
                    Either::B(b) => b
                        .reserve(g)
                        .ok()
                        .and_then(|r| r.commit().ok())
                        .map(Token::B),
                };
                if let Some(token) = token {
                    tokens.push((bound.mechanism, token));
                }
            }
            Step::Release(k) => {
                if tokens.is_empty() {
                    continue;
                }
                let (mechanism, token) = tokens.swap_remove(k % tokens.len());
                // Each token is on its own mechanism's device, whatever is selected now.
                match token {
                    Token::A(t) => {
                        assert_eq!(mechanism, ids.0);
                        drop(t.release());
                    }
                    Token::B(t) => {
                        assert_eq!(mechanism, ids.1);
                        drop(t.release());
                    }
                }
            }
            Step::Fault(m, op, n) => handles[m].fail_nth(op, n),
        }
        assert_valid(&registry);
        after_step([da.ledger().owned_bytes, db.ledger().owned_bytes]);
    }
    drop(tokens);
    drop(bindings);
    for h in &handles {
        h.clear();
    }
    da.retry_quarantine();
    db.retry_quarantine();
    let reports = [da.close(), db.close()];
    for m in 0..2 {
        // A lost context took its memory with it (the driver frees it): the device discharged
        // what it held, and the backend's own counts no longer say anything.
        if !lost[m] {
            assert!(reports[m].is_clean(), "{:?}", reports[m]);
            assert!(
                handles[m].outstanding().is_zero(),
                "{:?}",
                handles[m].outstanding()
            );
        }
    }
    at_end();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::proptest_cases(
        common::unless_miri(512, 4) as u32,
    )))]

    #[test]
    fn two_mechanisms_keep_a_valid_selection_and_release_every_token_on_its_own(
        steps in prop::collection::vec(step(), 1..60),
    ) {
        run(&steps);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::proptest_cases(
        common::unless_miri(256, 2) as u32,
    )))]

    /// The same on the CUDA backend's VMM and plain mechanisms (driver models): the plain
    /// device's tokens commit and release on it, never on the VMM one, and both drivers end
    /// with nothing outstanding.
    #[test]
    fn the_vmm_and_plain_cuda_mechanisms_keep_a_valid_selection_and_release_every_token_on_its_own(
        steps in prop::collection::vec(step(), 1..60),
    ) {
        run_cuda(&steps);
    }
}

/// A mechanism selected and confirmed already is not probed again: a second `select_probed`
/// of it returns at once, whatever its probe would say (its probe would have refused).
#[test]
fn a_mechanism_selected_and_confirmed_is_not_probed_again() {
    let registry = Mechanisms::new();
    let id = registry.register("cuda-vmm").unwrap();
    let probes = std::cell::Cell::new(0);
    let probe = |answer: Result<(), &'static str>| {
        probes.set(probes.get() + 1);
        answer
    };
    registry.select_probed(id, || probe(Ok(()))).unwrap();
    registry
        .select_probed(id, || probe(Err("would refuse")))
        .unwrap();
    registry.select(id).unwrap();
    assert_eq!(probes.get(), 1, "probed again");
    assert_eq!(registry.selected(), Some(id));
}

/// What `make` fails with on a mechanism that stays active is `on_selected`'s error, made once:
/// it is not swallowed and tried again.
#[test]
fn a_make_that_fails_on_an_active_mechanism_is_the_error() {
    use memtoken::mechanism::BindError;
    let registry = Mechanisms::new();
    let id = registry.register("cuda-vmm").unwrap();
    registry.select(id).unwrap();
    let mut makes = 0;
    let out = registry.on_selected(|_| -> Result<(), &str> {
        makes += 1;
        Err("out of memory")
    });
    assert!(
        matches!(out, Err(BindError::Make("out of memory"))),
        "{out:?}"
    );
    assert_eq!(makes, 1);
}

/// A mechanism's id, displayed (as errors name it), says which it is: its slot, the slot's
/// generation, and its registry. Fails if the id displays as nothing.
#[test]
fn a_mechanism_id_displays_its_slot_generation_and_registry() {
    let (_registry, [a, b]) = selected_first(["a", "b"]);
    let (a_said, b_said) = (a.to_string(), b.to_string());
    assert!(a_said.starts_with("mechanism 0#1 of registry "), "{a_said}");
    assert!(b_said.starts_with("mechanism 1#1 of registry "), "{b_said}");
    let (_, [other]) = selected_first(["a"]);
    assert_ne!(
        other.to_string(),
        a_said,
        "another registry's first mechanism"
    );
}

/// The confirmed mechanism, selected again while another one's probe is in flight (plainly or
/// probed), is published again and stays selected after the other's probe passes: being the
/// last confirmed is not being selected. Fails if either selection skips its work because its
/// mechanism was confirmed before (`select`'s or `select_probed`'s `published() == Some(id)`
/// → `!=`: the candidate stayed selected).
#[test]
fn a_confirmed_mechanism_selected_again_during_anothers_probe_is_selected() {
    let registry = Mechanisms::new();
    let a = registry.register("a").unwrap();
    let b = registry.register("b").unwrap();
    registry.select(a).unwrap();
    for probed in [false, true] {
        registry
            .select_probed(b, || {
                assert_eq!(registry.selected(), Some(b), "b's candidacy is published");
                if probed {
                    registry.select_probed(a, || Ok::<(), &str>(())).unwrap();
                } else {
                    registry.select(a).unwrap();
                }
                assert_eq!(registry.selected(), Some(a), "probed: {probed}");
                Ok::<(), &str>(())
            })
            .unwrap();
        assert_eq!(registry.selected(), Some(a), "probed: {probed}");
    }
}

/// The last confirmed mechanism, selected again during another one's probe, whose own probe
/// now fails is refused and never fallen back to, though it is active and confirmed before:
/// the selection goes to the confirmed one before it. Fails if the fall-back takes any active
/// confirmed entry (`fallback`'s `c != not && self.active(c)` → `||`: the refused candidate
/// came back).
#[test]
fn a_confirmed_mechanism_refused_on_its_reselection_is_not_fallen_back_to() {
    let (registry, [p, a, b]) = selected_first(["p", "a", "b"]);
    registry.select(a).unwrap();
    registry
        .select_probed(b, || {
            let out = registry.select_probed(a, || Err("a's trial create failed"));
            assert!(
                matches!(out, Err(MechanismError::Refused { now: Some(now), .. }) if now == p),
                "{out:?}"
            );
            Ok::<(), &str>(())
        })
        .unwrap();
    assert_eq!(registry.selected(), Some(p), "b's candidacy was overtaken");
}

/// A registry's Debug output names each registered mechanism with its slot and lifecycle, and
/// the selection. Fails if it prints nothing.
#[test]
fn a_registrys_debug_names_its_mechanisms_and_the_selection() {
    let registry = Mechanisms::new();
    let a = registry.register("cuda-vmm").unwrap();
    let b = registry.register("cuda-plain").unwrap();
    registry.select(b).unwrap();
    registry.retire(a).unwrap();
    assert_eq!(
        format!("{registry:?}"),
        format!(
            "{{(0, \"cuda-vmm\"): Some(Retired), (1, \"cuda-plain\"): Some(Active)}} \
             selected: Some({b:?})"
        )
    );
}
