//! An engine built by a constructor serves requests on four worker threads (each with
//! its own KV cache and prefix cache, shared prompts sampled as forks) and ends with nothing
//! outstanding — the engine of `examples/serving_engine`, run here.

#[allow(dead_code)]
#[path = "../../examples/serving_engine/engine.rs"]
mod serving;

use memtoken::backend::doubles::Faulty;
use memtoken::{Budget, Device, make_guard};
use serving::{Config, Engine, Request};

fn request(id: u64) -> Request {
    let system = (id % 3) as u32;
    let mut prompt: Vec<u32> = (0..64).map(|t| system * 1_000 + t).collect();
    prompt.extend((0..7).map(|t| 1_000_000 + id as u32 * 10 + t));
    Request {
        id,
        prompt,
        samples: 3,
        generate: 20,
    }
}

#[test]
fn an_engine_serves_requests_on_four_threads_and_leaves_nothing_outstanding() {
    make_guard!(guard);
    let backend = Faulty::new(crate::common::host());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    let stats = std::thread::scope(|scope| {
        let engine = Engine::start(scope, &binding, Config { workers: 4 });
        for id in 0..48 {
            engine.submit(request(id));
        }
        engine.finish()
    })
    .map_err(|e| e.to_string())
    .unwrap();
    assert_eq!(stats.requests, 48);
    assert!(
        stats.hits > 0,
        "requests sharing a system prompt met in one pool"
    );
    assert!(
        stats.copies > 0,
        "samples wrote into their shared last page"
    );
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
    assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
}

mod owned {
    //! The owned form: an `Engine` returned by a constructor owns its device, binding, KV cache
    //! and tokens; moved to another thread, it lends its tokens' memory to four more.

    use memtoken::backend::HostBackend;
    use memtoken::backend::doubles::{FaultHandle, Faulty};
    use memtoken::{Allocation, Budget, Committed, Engine, Keeps, region::Region};

    type Host = Faulty<HostBackend>;

    /// The engines' KV cache: 64 blocks of 16 tokens, one plane of 1 KiB a block.
    fn layout() -> memtoken::kv::Layout {
        memtoken::kv::Layout::new(64, 16).plane(1024)
    }

    struct Serving;
    struct Kept<'e> {
        weights: Allocation<'e, 'e, Host, Committed>,
        outputs: Vec<Allocation<'e, 'e, Host, Committed>>,
        scratch: Region<'e, 'e, Host>,
    }
    impl Keeps<Host> for Serving {
        type Of<'e> = Kept<'e>;
    }

    /// The constructor: everything made inside, returned together.
    fn start() -> Result<(Engine<Host, Serving>, FaultHandle), memtoken::Error> {
        let backend = Faulty::new(HostBackend::with_defaults()?);
        let faults = backend.handle();
        let engine = Engine::new(backend, Budget::unlimited(), &layout(), |parts| {
            let g = parts.device.granularity();
            let mut weights = parts.binding.reserve(g)?.commit()?;
            weights
                .as_mut_slice_of::<u32>()?
                .iter_mut()
                .for_each(|w| *w = 3);
            let outputs = (0..4)
                .map(|_| Ok(parts.binding.reserve(g)?.commit()?))
                .collect::<Result<_, memtoken::Error>>()?;
            let mut scratch = parts.binding.reserve(4 * g)?.into_region();
            scratch.grow(1)?;
            Ok(Kept {
                weights,
                outputs,
                scratch,
            })
        })?;
        Ok((engine, faults))
    }

    #[test]
    fn an_owned_engine_moves_to_a_thread_and_lends_its_tokens_to_four_more() {
        let (mut engine, faults) = start().unwrap();
        let sums = std::thread::spawn(move || {
            let sums = engine.with(|parts, kept| -> Result<Vec<u64>, memtoken::Error> {
                let weights = &kept.weights;
                std::thread::scope(|scope| {
                    for (i, out) in kept.outputs.iter_mut().enumerate() {
                        scope.spawn(move || {
                            let w = weights.as_slice_of::<u32>().unwrap();
                            let o = out.as_mut_slice_of::<u32>().unwrap();
                            for (o, w) in o.iter_mut().zip(w) {
                                *o = w * (i as u32 + 1);
                            }
                        });
                    }
                });
                kept.scratch.grow(1)?;
                parts.cache.replenish()?;
                let mut table = parts.cache.table();
                parts.cache.push(&mut table)?;
                Ok(kept
                    .outputs
                    .iter()
                    .map(|o| {
                        o.as_slice_of::<u32>()
                            .unwrap()
                            .iter()
                            .map(|&v| u64::from(v))
                            .sum()
                    })
                    .collect())
            });
            let report = engine.close();
            (sums, report)
        })
        .join()
        .unwrap();
        let (sums, report) = sums;
        let sums = sums.unwrap();
        let per = sums[0];
        assert_eq!(sums, vec![per, 2 * per, 3 * per, 4 * per]);
        assert!(report.is_clean(), "{report:?}");
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }

    /// An engine dropped without `close`, a block table and a grown region in use, releases
    /// all it holds as it drops: what it keeps, then the cache, the bindings and the device.
    /// Fails if the drop leaves anything outstanding (`Engine`'s drop emptied: nothing released).
    #[test]
    fn an_engine_dropped_without_close_releases_everything() {
        let (mut engine, faults) = start().unwrap();
        engine
            .with(|parts, kept| -> Result<(), memtoken::Error> {
                kept.scratch.grow(1)?;
                parts.cache.replenish()?;
                let mut table = parts.cache.table();
                parts.cache.push(&mut table)?;
                Ok(())
            })
            .unwrap();
        assert!(!faults.outstanding().is_zero(), "the engine holds memory");
        assert_eq!(format!("{engine:?}"), "Engine { .. }");
        drop(engine);
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }

    /// An engine that keeps block tables moves to another thread with them and comes back:
    /// each table's blocks keep their bytes across both moves, the cache hands out and takes
    /// back blocks on either thread, and everything goes at the end. Fails if a move loses or
    /// mixes a table's blocks, or the counts of the cache drift.
    #[test]
    fn an_engine_keeping_block_tables_moves_to_a_thread_and_back() {
        struct Sequences;
        impl Keeps<Host> for Sequences {
            type Of<'e> = Vec<memtoken::kv::BlockTable<'e, 'e, 'e, 'e, Host>>;
        }
        let backend = Faulty::new(crate::common::host());
        let faults = backend.handle();
        // Each block of table `t` holds `t * 16 + position` in its first byte.
        let mark = |t: usize, position: usize| [(t * 16 + position) as u8];
        let mut engine =
            Engine::<Host, Sequences>::new(backend, Budget::unlimited(), &layout(), |parts| {
                // Groups of 4 blocks: room for the null block and all nine.
                parts.cache.set_watermarks(3, 4);
                parts.cache.replenish()?;
                let mut tables = Vec::new();
                for t in 0..3 {
                    let mut table = parts.cache.table();
                    for position in 0..2 {
                        parts.cache.push(&mut table)?;
                        table.write(0, position, 0, &mark(t, position))?;
                    }
                    tables.push(table);
                }
                Ok(tables)
            })
            .unwrap();
        let read = |table: &memtoken::kv::BlockTable<'_, '_, '_, '_, Host>| {
            (0..table.len())
                .map(|position| {
                    let mut byte = [0];
                    table.read(0, position, 0, &mut byte).unwrap();
                    byte[0]
                })
                .collect::<Vec<_>>()
        };
        let mut engine = std::thread::spawn(move || {
            engine.with(|parts, tables| -> Result<(), memtoken::Error> {
                for (t, table) in tables.iter_mut().enumerate() {
                    assert_eq!(read(table), [mark(t, 0)[0], mark(t, 1)[0]]);
                    parts.cache.push(table)?;
                    table.write(0, 2, 0, &mark(t, 2))?;
                }
                parts.cache.clear(&mut tables[1]);
                Ok(())
            })?;
            Ok::<_, memtoken::Error>(engine)
        })
        .join()
        .unwrap()
        .unwrap();
        engine.with(|parts, tables| {
            let marks = |t| (0..3).map(|p| mark(t, p)[0]).collect::<Vec<_>>();
            assert_eq!(read(&tables[0]), marks(0));
            assert!(tables[1].is_empty());
            assert_eq!(read(&tables[2]), marks(2));
            assert_eq!(parts.cache.live_blocks(), 6, "two tables of three blocks");
            parts.cache.check_blocks().unwrap();
        });
        let report = engine.close();
        assert!(report.is_clean(), "{report:?}");
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }

    /// A failing build tears down what was made, in order, and says why.
    #[test]
    fn a_failed_build_leaves_nothing() {
        let backend = Faulty::new(crate::common::host());
        let faults = backend.handle();
        // Create #1 maps the KV cache's null group, #2 the weights: #3 is the build's second.
        faults.fail_nth(memtoken::backend::Op::Create, 3);
        let made = Engine::<Host, Serving>::new(backend, Budget::unlimited(), &layout(), |parts| {
            let g = parts.device.granularity();
            let weights = parts.binding.reserve(g)?.commit()?;
            let outputs = vec![parts.binding.reserve(g)?.commit()?];
            let scratch = parts.binding.reserve(g)?.into_region();
            Ok(Kept {
                weights,
                outputs,
                scratch,
            })
        });
        let e = made.unwrap_err();
        assert!(e.to_string().starts_with("commit failed: "), "{e}");
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }

    /// A panic in the constructor's build tears down what was made (the tokens while it
    /// unwinds, then the KV cache, the binding and the device): nothing is left.
    #[test]
    fn a_panic_in_build_leaves_nothing() {
        let backend = Faulty::new(crate::common::host());
        let faults = backend.handle();
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Engine::<Host, Serving>::new(backend, Budget::unlimited(), &layout(), |parts| {
                let g = parts.device.granularity();
                let _weights = parts.binding.reserve(g)?.commit()?;
                panic!("a build that panics");
            })
        }));
        assert!(made.is_err());
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }

    /// An engine with two bindings (weights and KV cache under their own budgets): each budget
    /// holds on its own, the KV cache draws from the first, and everything goes at the end. Fails
    /// if the bindings share one budget.
    #[test]
    fn an_engine_with_two_bindings_keeps_each_budget() {
        struct Two;
        impl Keeps<Host> for Two {
            type Of<'e> = Vec<Allocation<'e, 'e, Host, Committed>>;
        }
        let backend = Faulty::new(crate::common::host());
        let faults = backend.handle();
        let g = memtoken::backend::Backend::granularity(&backend);
        let budget = |granules| Budget::bytes(granules as u64 * g as u64);
        let mut engine = Engine::<Host, Two>::with_bindings(
            backend,
            budget(4),
            &[budget(1)],
            &layout(),
            |parts| {
                assert_eq!(parts.bindings.len(), 2);
                assert!(std::ptr::eq(parts.binding, &parts.bindings[0]));
                Ok(vec![parts.bindings[1].reserve(g)?.commit()?])
            },
        )
        .unwrap();
        engine.with(|parts, kept| {
            let over = parts.bindings[1].reserve(g).unwrap().commit();
            assert!(over.is_err(), "the second binding's budget is spent");
            drop(over);
            parts
                .cache
                .replenish()
                .expect("the cache draws from the first");
            let mut table = parts.cache.table();
            parts.cache.push(&mut table).expect("a block");
            kept.push(parts.bindings[0].reserve(g).unwrap().commit().unwrap());
        });
        let report = engine.close();
        assert!(report.is_clean(), "{report:?}");
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    }
}
