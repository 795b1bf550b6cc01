//! `mem::forget` is safe, and what it forgets shows in `Device::close`'s report: a token's bytes
//! in the ledger, a binding and a page (which hold no bytes of their own) as counts; a forgotten
//! binding's context pin is released when its device drops.

use memtoken::backend::doubles::{Faulty, SimBackend};
use memtoken::{Budget, Device, Forgotten, PagePool, make_guard};

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
            pages: 0
        }
    );
    assert!(report.ledger.is_zero(), "a binding holds no bytes");
    assert!(!report.is_clean(), "{report:?}");
    assert_eq!(sim.pins(), 0, "the forgotten binding kept its pin");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "forgets a page table on purpose: its Vec leaks, which Miri reports as a leak"
)]
fn forgotten_pages_and_page_tables_show_in_the_close_report() {
    let faulty = Faulty::new(SimBackend::strict());
    let faults = faulty.handle();
    make_guard!(guard);
    let device = Device::new(guard, faulty);
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        make_guard!(pool_guard);
        let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
        let kept = pool.alloc().unwrap();
        std::mem::forget(pool.alloc().unwrap());
        let mut table = pool.table();
        for _ in 0..3 {
            pool.push(&mut table).unwrap();
        }
        std::mem::forget(table);
        pool.free(kept);
    }
    drop(binding);
    let report = device.close();
    assert_eq!(report.forgotten.pages, 4, "{report:?}");
    assert_eq!(report.forgotten.bindings, 0);
    assert!(report.ledger.is_zero(), "the pool's chunks went with it");
    assert!(!report.is_clean());
    assert!(faults.outstanding().is_zero());
}

#[test]
fn a_device_whose_bindings_and_pages_all_went_back_closes_clean() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::strict());
    let binding = device.bind(Budget::unlimited()).unwrap();
    {
        make_guard!(pool_guard);
        let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
        let page = pool.alloc().unwrap();
        let mut table = pool.table();
        pool.push(&mut table).unwrap();
        drop(page);
        drop(table);
    }
    drop(binding);
    let report = device.close();
    assert!(report.is_clean(), "{report:?}");
    assert!(report.forgotten.is_zero());
}
