//! Regression test (found in review, fixed): `Device::discharge_all` takes the quarantine and the deferred queue out of the books
//! without counting them as busy, then makes backend calls (`retire_fence`) before it refunds
//! the ledger: while it runs, another thread sees `custody()` / `Progress` report nothing
//! deferred while the ledger still holds the bytes (the under-report `Books::busy` was made to
//! prevent for poll and retry_quarantine).

use crate::common::gate::gated_sim;
use memtoken::backend::Op;
use memtoken::{Budget, Device, make_guard};

#[test]
fn while_discharge_all_runs_another_thread_sees_nothing_deferred_but_bytes_in_the_ledger() {
    let (sim, gate, gated) = gated_sim();
    make_guard!(guard);
    let device = Device::new(guard, gated);
    let binding = device.bind(Budget::unlimited()).unwrap();
    drop(binding.reserve(1).unwrap().commit().unwrap());
    drop(binding.reserve(1).unwrap().commit().unwrap());
    drop(binding);
    assert_eq!(device.custody().deferred.count, 2);
    sim.lose_context();
    let proof = device.confirm_context_lost().expect("lost");
    gate.arm(Op::Fence);
    let seen = std::thread::scope(|s| {
        let discharging = s.spawn(|| device.discharge_all(&proof));
        assert!(
            gate.wait_entered(),
            "discharge_all never reached retire_fence"
        );
        let custody = device.custody();
        let progress = device.poll();
        let ledger = device.ledger();
        gate.open();
        assert_eq!(discharging.join().unwrap(), 2);
        (custody, progress, ledger)
    });
    let (custody, progress, ledger) = seen;
    assert!(
        custody.deferred.owned_bytes >= ledger.owned_bytes,
        "custody counts {} owned bytes deferred, poll() says {} deferred, while the ledger \
         still holds {} owned bytes",
        custody.deferred.owned_bytes,
        progress.deferred,
        ledger.owned_bytes
    );
}
