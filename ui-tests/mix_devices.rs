// Two devices carry two distinct brands: device B's proof that its context is lost cannot
// discharge a quarantined token of device A.
use memtoken::backend::doubles::SimBackend;
use memtoken::{Budget, Device, errors::Returned, make_guard};

fn main() {
    make_guard!(guard_a);
    make_guard!(guard_b);
    let device_a = Device::new(guard_a, SimBackend::default());
    let device_b = Device::new(guard_b, SimBackend::default());
    let binding_a = device_a.bind(Budget::unlimited()).unwrap();
    let proof_b = device_b.confirm_context_lost().unwrap();
    // (Compile-only: at run time this release would succeed.)
    if let Err(error) = binding_a.reserve(4096).unwrap().release().complete() {
        if let Returned::Quarantined(q) = error.into_token() {
            let _ = q.discharge(&proof_b);
        }
    }
}
