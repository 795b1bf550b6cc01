//! A slot at the end of its generations, set directly in the slot's word: 2^56 registrations
//! cannot be run.

use super::{Lifecycle, MechanismError, Mechanisms};
use crate::sync::Ordering;

/// The last generation a slot takes: 56 bits, beside the lifecycle's 8 in the slot's word.
const LAST: u64 = (1 << 56) - 1;

/// A slot one generation short of the last takes the last, and its mechanism is known by its
/// id through every lifecycle; once unregistered the slot is never taken again: with every
/// slot at its last generation, a registration is refused as full. Fails if a slot goes past
/// the last generation (its word's generation wraps, and the new id would name whatever had the
/// slot at generation 0).
#[test]
fn a_slot_at_its_last_generation_is_never_taken_again() {
    let registry = Mechanisms::new();
    for slot in &registry.slots {
        slot.store(LAST << 8, Ordering::SeqCst); // vacant, at the last generation
    }
    registry.slots[0].store((LAST - 1) << 8, Ordering::SeqCst);
    let id = registry.register("last").unwrap();
    assert_eq!((id.index, id.generation), (0, LAST));
    assert_eq!(registry.lifecycle(id), Some(Lifecycle::Active));
    // `lose`, not `retire`: tests/it/money.rs allows a call of `.retire(` in src/ nowhere but
    // the token's release.
    registry.lose(id).unwrap();
    registry.terminate(id).unwrap();
    assert_eq!(registry.lifecycle(id), Some(Lifecycle::Terminated));
    registry.unregister(id).unwrap();
    assert_eq!(registry.lifecycle(id), None);
    assert!(
        matches!(registry.register("again"), Err(MechanismError::Full)),
        "a slot went past its last generation"
    );
}
