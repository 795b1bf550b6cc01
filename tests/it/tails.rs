//! Property test of the mapped tails, on two threads sharing one device: an engine
//! thread drives two elastic regions — grows (from the tail first), shrinks into the tail,
//! resets (shrinks to nothing, keeping the tail), sets tail caps, trims tails, suspends and
//! resumes — while a second thread puts the device's budget under pressure (commits that the
//! budget refuses ask the tails back), trims the cache, sets the device's tail cap and asks the
//! tails back; faults are injected at random backend calls. The steps interleave one at a time
//! (each thread takes the world's lock for one step), so after every step, whichever thread
//! made it: the ledger equals what the live tokens hold plus the tails, the cache, the
//! quarantine and the deferred releases; the tail figure equals the regions' tails; each
//! region's slice and typed view cover its committed part exactly. At the end, nothing is
//! outstanding.
//!
//! 256 cases by default (4 under Miri); `PROPTEST_CASES=N` for more.

use crate::common::{self, Rng};
use memtoken::backend::{
    Backend, HostBackend, Op,
    doubles::{FaultHandle, Faulty},
};
use memtoken::{
    Allocation, Binding, Budget, Committed, Device, region::Region, sleep::SuspendedRegion,
};
use proptest::prelude::*;
use std::sync::Mutex;

type B = Faulty<HostBackend>;

/// A step of the engine thread, on region `r % 2`.
#[derive(Clone, Debug)]
enum Engine {
    Grow(usize, usize),
    Shrink(usize, usize),
    /// Shrinks to nothing, keeping what the tail's cap allows: the next request's region.
    Reset(usize),
    TailCap(usize, usize),
    TrimTail(usize),
    Suspend(usize),
    Resume(usize),
    Fault(Op, u64),
}

/// A step of the pressure thread.
#[derive(Clone, Debug)]
enum Pressure {
    /// Commits 1-3 granules (the device's budget may refuse, asking the tails back).
    Commit(usize),
    /// Releases its oldest allocation.
    Release,
    TrimCache,
    /// The device's cap on all tails: 0-3 granules, 4 for none.
    DeviceTailCap(u64),
    AskTailsBack,
}

fn engine() -> impl Strategy<Value = Engine> {
    let op = prop::sample::select(vec![Op::Create, Op::Release, Op::Map, Op::Unmap]);
    prop_oneof![
        4 => (0usize..2, 1usize..4).prop_map(|(r, n)| Engine::Grow(r, n)),
        3 => (0usize..2, 1usize..4).prop_map(|(r, n)| Engine::Shrink(r, n)),
        2 => (0usize..2).prop_map(Engine::Reset),
        2 => (0usize..2, 0usize..5).prop_map(|(r, n)| Engine::TailCap(r, n)),
        1 => (0usize..2).prop_map(Engine::TrimTail),
        1 => (0usize..2).prop_map(Engine::Suspend),
        1 => (0usize..2).prop_map(Engine::Resume),
        1 => (op, 1u64..4).prop_map(|(op, n)| Engine::Fault(op, n)),
    ]
}

fn pressure() -> impl Strategy<Value = Pressure> {
    prop_oneof![
        3 => (1usize..4).prop_map(Pressure::Commit),
        2 => Just(Pressure::Release),
        1 => Just(Pressure::TrimCache),
        1 => (0u64..5).prop_map(Pressure::DeviceTailCap),
        1 => Just(Pressure::AskTailsBack),
    ]
}

/// A region of the engine: awake or asleep.
enum Slot<'b, 'id> {
    Awake(Region<'b, 'id, B>),
    Asleep(SuspendedRegion<'b, 'id, B>),
    Gone,
}

/// What both threads hold; one step at a time changes it.
struct World<'b, 'id> {
    regions: [Slot<'b, 'id>; 2],
    held: Vec<Allocation<'b, 'id, B, Committed>>,
    /// The tails' bytes after the last step.
    tails: u64,
}

impl World<'_, '_> {
    /// The ledger against the tokens (see the module docs).
    fn check(&mut self, device: &Device<'_, B>) {
        let g = device.granularity() as u64;
        let (mut owned, mut mapped, mut tails) = (0u64, 0u64, 0u64);
        for slot in &self.regions {
            match slot {
                Slot::Awake(r) => {
                    let kept = (r.committed_granules() + r.tail_granules() + r.withheld_granules())
                        as u64
                        * g;
                    owned += kept;
                    mapped += kept;
                    tails += r.tail_granules() as u64 * g;
                    assert_eq!(r.as_slice().len(), r.committed_len(), "slice");
                    let view = r.as_slice_of::<u64>().expect("aligned");
                    assert_eq!(std::mem::size_of_val(view), r.committed_len(), "view");
                }
                Slot::Asleep(r) => {
                    owned += r.withheld_bytes() as u64;
                    mapped += r.withheld_bytes() as u64;
                }
                Slot::Gone => {}
            }
        }
        for a in &self.held {
            owned += a.len() as u64;
            mapped += a.len() as u64;
        }
        let custody = device.custody();
        for h in [custody.quarantined, custody.deferred] {
            owned += h.owned_bytes;
            mapped += h.mapped_bytes;
        }
        let l = device.ledger();
        owned += l.cached_bytes;
        assert_eq!(l.tail_bytes, tails, "tails: ledger vs regions");
        // Tails grow only under the device's cap (one over a cap lowered since is asked back).
        if l.tail_bytes > self.tails {
            assert!(l.tail_bytes <= device.tail_cap(), "the device's tail cap");
        }
        self.tails = l.tail_bytes;
        assert_eq!(
            l.owned_bytes, owned,
            "owned: ledger vs tokens, tails, cache, custody"
        );
        assert_eq!(
            l.mapped_bytes, mapped,
            "mapped: ledger vs tokens, tails, custody"
        );
    }

    fn engine_step(&mut self, step: &Engine, faults: &FaultHandle) {
        match *step {
            Engine::Grow(r, n) => {
                if let Slot::Awake(region) = &mut self.regions[r] {
                    let (committed, tail) = (region.committed_granules(), region.tail_granules());
                    match region.grow(n) {
                        Ok(()) => assert_eq!(region.committed_granules(), committed + n),
                        Err(_) => {
                            assert_eq!(region.committed_granules(), committed, "all or nothing");
                            assert_eq!(region.tail_granules(), tail, "the tail given back");
                        }
                    }
                }
            }
            Engine::Shrink(r, n) => {
                if let Slot::Awake(region) = &mut self.regions[r] {
                    let n = n.min(region.committed_granules());
                    let committed = region.committed_granules();
                    if region.shrink(n).is_ok() {
                        assert_eq!(region.committed_granules(), committed - n);
                    }
                }
            }
            Engine::Reset(r) => {
                if let Slot::Awake(region) = &mut self.regions[r] {
                    let n = region.committed_granules();
                    if region.shrink(n).is_ok() {
                        assert_eq!(region.committed_granules(), 0);
                    }
                }
            }
            Engine::TailCap(r, n) => {
                if let Slot::Awake(region) = &mut self.regions[r] {
                    let _ = region.set_tail_cap(n);
                    assert_eq!(region.tail_cap(), n);
                }
            }
            Engine::TrimTail(r) => {
                if let Slot::Awake(region) = &mut self.regions[r]
                    && region.trim_tail().is_ok()
                {
                    assert_eq!(region.tail_granules(), 0);
                }
            }
            Engine::Suspend(r) | Engine::Resume(r) => {
                // Taken out, changed, put back: a failed change hands the token back.
                let slot = std::mem::replace(&mut self.regions[r], Slot::Gone);
                self.regions[r] = match (slot, step) {
                    (Slot::Awake(region), Engine::Suspend(_)) => match region.suspend() {
                        Ok(asleep) => Slot::Asleep(asleep),
                        Err(e) => Slot::Awake(e.into_token()),
                    },
                    (Slot::Asleep(asleep), Engine::Resume(_)) => match asleep.resume() {
                        Ok(region) => Slot::Awake(region),
                        Err(e) => Slot::Asleep(e.into_token()),
                    },
                    (slot, _) => slot,
                };
            }
            Engine::Fault(op, n) => faults.fail_nth(op, n),
        }
    }
}

impl<'b, 'id> World<'b, 'id> {
    fn pressure_step(
        &mut self,
        step: &Pressure,
        device: &Device<'id, B>,
        binding: &'b Binding<'b, 'id, B>,
    ) {
        let g = device.granularity();
        match *step {
            Pressure::Commit(n) => {
                if let Ok(reserved) = binding.reserve(n * g)
                    && let Ok(a) = reserved.commit()
                {
                    self.held.push(a);
                }
            }
            Pressure::Release => {
                if !self.held.is_empty() {
                    let a = self.held.remove(0);
                    let _ = a.release().complete();
                }
            }
            Pressure::TrimCache => {
                device.trim_cache();
            }
            Pressure::DeviceTailCap(n) => {
                device.set_tail_cap(if n == 4 { u64::MAX } else { n * g as u64 });
            }
            Pressure::AskTailsBack => device.ask_tails_back(),
        }
    }
}

/// Runs both threads' steps on one device (budget 10 granules, cache cap `cache` granules),
/// checking after every step; then nothing is outstanding.
fn run(engine_steps: &[Engine], pressure_steps: &[Pressure], cache: u64) {
    memtoken::make_guard!(guard);
    let backend = Faulty::new(common::host());
    let faults = backend.handle();
    let g = backend.granularity() as u64;
    let device = Device::with_cache(
        guard,
        backend,
        Budget::bytes(10 * g),
        Budget::bytes(cache * g),
    );
    let engine_binding = device.bind(Budget::unlimited()).unwrap();
    let pressure_binding = device.bind(Budget::unlimited()).unwrap();
    let regions = [0, 1].map(|_| {
        let reserved = engine_binding.reserve(6 * g as usize).unwrap();
        Slot::Awake(reserved.into_region())
    });
    let world = Mutex::new(World {
        regions,
        held: Vec::new(),
        tails: 0,
    });
    let (world_ref, device_ref) = (&world, &device);
    std::thread::scope(|s| {
        let faults = &faults;
        s.spawn(move || {
            for step in engine_steps {
                let mut w = world_ref.lock().unwrap();
                w.engine_step(step, faults);
                w.check(device_ref);
            }
        });
        let binding = &pressure_binding;
        s.spawn(move || {
            for step in pressure_steps {
                let mut w = world_ref.lock().unwrap();
                w.pressure_step(step, device_ref, binding);
                w.check(device_ref);
            }
        });
    });
    faults.clear();
    drop(world.into_inner().unwrap());
    device.retry_quarantine();
    drop((engine_binding, pressure_binding));
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::proptest_cases(
        common::unless_miri(256, 4) as u32,
    )))]

    #[test]
    fn tails_on_two_threads_keep_the_ledger_whole(
        engine_steps in prop::collection::vec(engine(), 1..60),
        pressure_steps in prop::collection::vec(pressure(), 1..30),
        cache in 0u64..4,
    ) {
        run(&engine_steps, &pressure_steps, cache);
    }
}

/// The same two jobs with no lock between steps: two engine threads (one region each, with
/// tails, caps, trims and reclaims) and a pressure thread (commits under the device budget,
/// releases, cache trims and caps, tail caps, requests, faults) really run at once. At the end
/// the ledger equals the tokens, the tails, the cache and the custody, and the device closes
/// clean with nothing outstanding.
#[test]
fn tails_on_threads_running_at_once_keep_the_ledger_whole() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let rounds = (common::proptest_cases(1000) / 50).max(1);
    for round in 0..u64::from(rounds) {
        memtoken::make_guard!(guard);
        let backend = Faulty::new(common::host());
        let faults = backend.handle();
        let g = backend.granularity() as u64;
        let device =
            Device::with_cache(guard, backend, Budget::bytes(14 * g), Budget::bytes(3 * g));
        let engine = device.bind(Budget::unlimited()).unwrap();
        let pressure = device.bind(Budget::unlimited()).unwrap();
        let stop = AtomicBool::new(false);
        let (regions, held) = std::thread::scope(|s| {
            let engines: Vec<_> = (0..2u64)
                .map(|i| {
                    let mut region = engine.reserve(6 * g as usize).unwrap().into_region();
                    s.spawn(move || {
                        let mut rng = Rng(round * 7 + i * 13 + 1);
                        for _ in 0..common::unless_miri(1000, 10) {
                            let (x, n) = (rng.next(), rng.next() as usize % 4 + 1);
                            match x % 8 {
                                0..=2 => drop(region.grow(n)),
                                3..=5 => drop(region.shrink(n.min(region.committed_granules()))),
                                6 => drop(region.set_tail_cap(n - 1)),
                                _ => drop(region.reclaim()),
                            }
                        }
                        region
                    })
                })
                .collect();
            let (device, pressure, stop, faults) = (&device, &pressure, &stop, &faults);
            let pressing = s.spawn(move || {
                let mut held = Vec::new();
                let mut rng = Rng(round + 99);
                while !stop.load(Ordering::Relaxed) {
                    let (x, y) = (rng.next(), rng.next());
                    match x % 9 {
                        0..=2 => {
                            let len = (y as usize % 3 + 1) * g as usize;
                            if let Ok(a) = pressure.reserve(len).unwrap().commit() {
                                held.push(a);
                            }
                        }
                        3 => {
                            if !held.is_empty() {
                                drop(held.remove(0).release().complete());
                            }
                        }
                        4 => drop(device.trim_cache()),
                        5 => device.set_tail_cap(if y % 5 == 4 { u64::MAX } else { (y % 5) * g }),
                        6 => device.ask_tails_back(),
                        7 => device.set_cache_cap((y % 4) * g),
                        _ => {
                            let op =
                                [Op::Map, Op::Create, Op::Unmap, Op::Release][(y % 4) as usize];
                            faults.fail_nth(op, y % 5 + 1);
                        }
                    }
                    std::thread::yield_now();
                }
                held
            });
            let regions: Vec<_> = engines.into_iter().map(|h| h.join().unwrap()).collect();
            stop.store(true, Ordering::Relaxed);
            (regions, pressing.join().unwrap())
        });
        faults.clear();
        let (l, c) = (device.ledger(), device.custody());
        let tails: u64 = regions.iter().map(|r| r.tail_granules() as u64 * g).sum();
        let kept = regions
            .iter()
            .map(|r| {
                (r.committed_granules() + r.tail_granules() + r.withheld_granules()) as u64 * g
            })
            .chain(held.iter().map(|a| a.len() as u64))
            .sum::<u64>();
        assert_eq!(l.tail_bytes, tails, "round {round}: tails");
        let (q, d) = (c.quarantined, c.deferred);
        assert_eq!(
            l.owned_bytes,
            kept + l.cached_bytes + q.owned_bytes + d.owned_bytes,
            "round {round}: owned"
        );
        assert_eq!(
            l.mapped_bytes,
            kept + q.mapped_bytes + d.mapped_bytes,
            "round {round}: mapped"
        );
        drop((regions, held));
        device.retry_quarantine();
        drop((engine, pressure));
        let report = device.close();
        assert!(report.is_clean(), "{report:?}");
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }
}
