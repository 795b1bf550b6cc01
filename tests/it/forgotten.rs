//! `mem::forget` is safe, and what it forgets shows in `Device::close`'s report: a token's bytes
//! in the ledger, a binding and a KV block (which hold no bytes of their own) as counts; a forgotten
//! binding's context pin is released when its device drops.

use memtoken::backend::doubles::{Faulty, SimBackend};
use memtoken::kv::{KvCache, Layout};
use memtoken::{Budget, Device, make_guard, report::Forgotten};

#[test]
fn a_forgotten_binding_shows_in_the_close_report_and_its_pin_goes_with_the_device() {
    let sim = SimBackend::strict();
    make_guard!(guard);
    let device = Device::new(guard, sim.clone());
    let kept = device.bind(Budget::unlimited()).unwrap();
    std::mem::forget(device.bind(Budget::unlimited()).unwrap());
    assert_eq!(sim.pins(), 2);
    drop(kept);
    let report = device.close();
    assert_eq!(
        report.forgotten,
        Forgotten {
            bindings: 1,
            blocks: 0
        }
    );
    assert!(report.ledger.is_zero(), "a binding holds no bytes");
    assert!(!report.is_clean(), "{report:?}");
    assert_eq!(sim.pins(), 0, "the forgotten binding kept its pin");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "forgets a block table on purpose: its Vec leaks, which Miri reports as a leak"
)]
fn forgotten_block_tables_show_in_the_close_report() {
    let faulty = Faulty::new(SimBackend::strict());
    let faults = faulty.handle();
    make_guard!(guard);
    let device = Device::new(guard, faulty);
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        make_guard!(cache_guard);
        let layout = Layout::new(64, 16).plane(1024);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        cache.replenish().unwrap();
        let mut kept = cache.table();
        cache.push(&mut kept).unwrap();
        let mut table = cache.table();
        for _ in 0..3 {
            cache.push(&mut table).unwrap();
        }
        std::mem::forget(table);
        cache.clear(&mut kept);
        cache.replenish().unwrap(); // the block given back is free again
    }
    drop(binding);
    let report = device.close();
    assert_eq!(report.forgotten.blocks, 3, "{report:?}");
    assert_eq!(report.forgotten.bindings, 0);
    assert!(report.ledger.is_zero(), "the cache's planes went with it");
    assert!(!report.is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_device_whose_bindings_and_blocks_all_went_back_closes_clean() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::strict());
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        make_guard!(cache_guard);
        let layout = Layout::new(64, 16).plane(1024);
        let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        cache.replenish().unwrap();
        let mut table = cache.table();
        cache.push(&mut table).unwrap();
        drop(table);
    }
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
    assert!(report.forgotten.is_zero());
}
