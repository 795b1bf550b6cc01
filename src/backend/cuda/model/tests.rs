//! Unit tests of the driver model, called directly.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::*;
use crate::backend::cuda::driver::Driver;

#[test]
fn a_bad_configuration_is_an_error_not_a_panic() {
    let e = DriverModel::new(ModelConfig {
        granularity: 3 << 20,
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(e, ConfigError::GranularityNotPowerOfTwo { .. }),
        "{e}"
    );
    let e = DriverModel::new(ModelConfig {
        total_mem: 0,
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Zero {
                what: "device memory"
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("device memory is zero"), "{e}");
    let e = DriverModel::new(ModelConfig {
        exportable_granularity: Some(3 << 20),
        ..ModelConfig::default()
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::GranularityNotPowerOfTwo {
                granularity: 0x30_0000
            }
        ),
        "{e}"
    );
}

#[test]
fn outstanding_names_what_the_model_holds() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let g = model.config.granularity;
    let ptr = model.mem_address_reserve(2 * g, g, 0).unwrap();
    let handle = model.mem_create(g, 0).unwrap();
    // SAFETY: the first granule of the fresh reservation is unmapped; `handle` is live and
    // one granule long.
    unsafe { model.mem_map(ptr, g, 0, handle) }.unwrap();
    let event = model.event_create().unwrap();
    let held = model.outstanding();
    assert_eq!(
        held,
        ModelOutstanding {
            reservations: 1,
            physical_bytes: g,
            mappings: 1,
            events: 1,
            retains: 1,
        }
    );
    // SAFETY: each value was made above by this model and is given back once, the mapping
    // before its handle's memory and reservation, the retain last.
    unsafe {
        model.event_destroy(event).unwrap();
        model.mem_release(handle).unwrap();
        assert_eq!(
            model.outstanding().physical_bytes,
            g,
            "released while mapped"
        );
        model.mem_unmap(ptr, g).unwrap();
        model.mem_address_free(ptr, 2 * g).unwrap();
        model.primary_ctx_release(0).unwrap();
    }
    assert!(model.outstanding().is_zero());
}

#[test]
fn released_handles_and_destroyed_events_come_back() {
    let model = DriverModel::default();
    model.init().unwrap();
    let ctx = model.primary_ctx_retain(0).unwrap();
    // SAFETY: `ctx` was just retained from this model.
    unsafe { model.ctx_set_current(ctx) }.unwrap();
    let g = model.config.granularity;
    let ptr = model.mem_address_reserve(g, g, 0).unwrap();
    let old = model.mem_create(g, 0).unwrap();
    let event = model.event_create().unwrap();
    // SAFETY: the fresh reservation is unmapped and `old` live; each value is given back
    // once, and the reissued ones are new live values.
    unsafe {
        model.mem_map(ptr, g, 0, old).unwrap();
        model.mem_release(old).unwrap();
        let new = model.mem_create(g, 0).unwrap();
        assert_eq!(
            new, old,
            "released while mapped, the value comes back at once"
        );
        assert_eq!(model.outstanding().physical_bytes, 2 * g);
        model.mem_unmap(ptr, g).unwrap();
        assert_eq!(model.outstanding().physical_bytes, g, "the old memory went");
        model.mem_release(new).unwrap();
        model.event_destroy(event).unwrap();
        assert_eq!(model.event_create().unwrap(), event);
        model.event_destroy(event).unwrap();
        model.mem_address_free(ptr, g).unwrap();
        model.primary_ctx_release(0).unwrap();
    }
    assert!(model.outstanding().is_zero());
}
