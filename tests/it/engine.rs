//! Issue 25: an engine built by a constructor serves requests on four worker threads (each with
//! its own page pool and prefix cache, shared prompts sampled as forks) and ends with nothing
//! outstanding — the engine of `examples/serving_engine`, run here.

#[allow(dead_code)]
#[path = "../../examples/serving_engine/engine.rs"]
mod serving;

use memtoken::backend::HostBackend;
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
    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
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
