//! Threads: eight threads allocate, commit, share, diverge, grow, shrink, suspend, resume, drop
//! and poll on one device while faults are injected at random backend calls; at the end, after
//! retries, nothing is outstanding — not in the ledger, not in the backend.

use crate::common::{self, Rng};

use memtoken::backend::{
    Op,
    doubles::{Faulty, SimBackend, SimConfig},
};
use memtoken::{Budget, Device, make_guard};
use std::sync::atomic::{AtomicU64, Ordering};

const THREADS: usize = 8;
const OPS_PER_THREAD: usize = common::unless_miri(1_500, 20);

/// One round per thousand `PROPTEST_CASES` (one by default), each with its own seeds:
/// `PROPTEST_CASES=20000` runs twenty.
#[test]
fn eight_threads_on_one_device_with_faults_leave_nothing_outstanding() {
    let rounds = (common::proptest_cases(1000) / 1000).max(1);
    for round in 0..u64::from(rounds) {
        eight_threads(round);
    }
}

/// Eight threads on one device, seeded by `round`, then nothing outstanding.
fn eight_threads(round: u64) {
    make_guard!(guard);
    let sim = SimBackend::new(SimConfig {
        granularity: 1 << 16,
        // Physical memory on release: the simulator forbids releasing mapped memory.
        ..SimConfig::strict()
    })
    .unwrap();
    let backend = Faulty::new(sim.clone());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let g = device.granularity();
    let done = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (device, faults, done) = (&device, faults.clone(), &done);
            scope.spawn(move || {
                let seed = (t as u64 + 1) * 0x1000_0001 + round * 0x0100_0000_0001;
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
                let binding = device.bind(Budget::bytes(64 * g as u64)).unwrap();
                for _ in 0..OPS_PER_THREAD {
                    // Now and then, a fault at one of the next calls of some kind.
                    if rng.below(16) == 0 {
                        let op = [
                            Op::Create,
                            Op::Map,
                            Op::Unmap,
                            Op::Release,
                            Op::Free,
                            Op::Copy,
                        ][rng.below(6) as usize];
                        faults.fail_nth(op, 1 + rng.below(4));
                    }
                    match rng.below(6) {
                        0 => {
                            let Ok(r) = binding.reserve((1 + rng.below(3) as usize) * g) else {
                                continue;
                            };
                            if let Ok(a) = r.commit() {
                                if rng.below(2) == 0 {
                                    drop(a.release().complete());
                                } else {
                                    drop(a);
                                }
                            }
                        }
                        1 => {
                            let Ok(r) = binding.reserve((1 + rng.below(3) as usize) * g) else {
                                continue;
                            };
                            let Ok(prefix) = r.commit_prefix() else {
                                continue;
                            };
                            let Ok(r) = binding.reserve(prefix.len()) else {
                                continue;
                            };
                            if let Ok(shared) = r.map_prefix(&prefix) {
                                if rng.below(2) == 0 {
                                    drop(prefix);
                                }
                                drop(shared.diverge());
                            }
                        }
                        2 => {
                            let Ok(r) = binding.reserve(6 * g) else {
                                continue;
                            };
                            let mut region = r.into_region();
                            if region.grow(1 + rng.below(4) as usize).is_err() {
                                continue;
                            }
                            let _ = region.shrink(1);
                            let _ = region.grow(1);
                        }
                        3 => {
                            let Ok(r) = binding.reserve(4 * g) else {
                                continue;
                            };
                            let mut region = r.into_region();
                            if region.grow(2).is_err() {
                                continue;
                            }
                            let saving = rng.below(2) == 0;
                            let asleep = if saving {
                                region.suspend_saving()
                            } else {
                                region.suspend()
                            };
                            if let Ok(asleep) = asleep {
                                drop(asleep.resume());
                            }
                        }
                        4 => {
                            device.poll();
                        }
                        _ => {
                            device.retry_quarantine();
                        }
                    }
                }
                done.fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    assert_eq!(done.load(Ordering::Relaxed), THREADS as u64);
    faults.clear();
    // Everything the threads dropped went back, or to the quarantine: retry it.
    for _ in 0..4 {
        device.retry_quarantine();
        device.poll();
    }
    device.trim_cache();
    let custody = device.custody();
    assert_eq!(custody.quarantined.count, 0, "{custody:?}");
    assert_eq!(custody.deferred.count, 0, "{custody:?}");
    assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    assert!(device.close().is_clean());
}
