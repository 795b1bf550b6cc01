//! A loom model of the granule cache's admit/cap race (`RUSTFLAGS="--cfg loom" cargo test
//! --release --lib loom`): a region's growth takes granules from the cache and is undone,
//! giving them back, while another thread lowers the cache's cap — in every interleaving loom
//! finds (the cache's lock and cap, the ledger and the binding's budget are loom's types there,
//! see `crate::sync`; the backend, a [`Faulty`] simulator, is plain Rust).
#![allow(unsafe_code)] // one `unsafe` call, with its `// SAFETY:` proof

use crate::backend::Op;
use crate::backend::doubles::{Faulty, SimBackend, SimConfig};
use crate::error::GrowError;
use crate::sync::model;
use crate::{Budget, Device};
use generativity::{Guard, Id};
use loom::sync::Arc;
use loom::thread;

/// The simulator's granularity: small, nothing depends on it.
const G: usize = 64 << 10;

/// The cache holds two granules, under a cap of two; a region grows by three: it takes both
/// from the cache, maps them, and the create of the third fails, so the growth is undone and
/// gives the two back — to the cache as far as its cap then allows, else released, and every
/// release fails (each granule then in the device's quarantine). Meanwhile another thread
/// lowers the cap to one granule ([`Device::set_cache_cap`], which trims the cache down to it).
///
/// Whatever the interleaving, nothing is lost or counted twice: every granule that left the
/// cache, by the undo or by the trim, is in the quarantine, and the undone growth counts those
/// it put there (`GrowError::Undone::quarantined`); the cached axis holds exactly the granules
/// the cache holds; the binding is charged nothing; and once releases work again, everything
/// is released. The undo releases a granule only when the cap was lowered between the growth's
/// take and its give-back — an interleaving no single-threaded test reaches.
#[test]
fn a_growth_undone_while_the_cache_cap_is_lowered_loses_and_double_counts_nothing() {
    model(|| {
        let sim = SimConfig {
            granularity: G,
            ..SimConfig::strict()
        };
        let backend = Faulty::new(SimBackend::new(sim).unwrap());
        let faults = backend.handle();
        // SAFETY: `Id::new` asks that no other `Id` of this lifetime be confused with it. Every
        // device of this model is branded `'static` this way, one at a time (each execution
        // makes one, and drops it before the next), and none of its tokens, bindings or
        // regions leaves the execution that made it.
        let guard = unsafe { Guard::new(Id::new()) };
        let cap = Budget::bytes(2 * G as u64);
        let device = Arc::new(Device::with_cache(guard, backend, Budget::unlimited(), cap));
        let binding = device.bind(Budget::unlimited()).unwrap();
        // Two granules in the cache.
        let mut warm = binding.reserve(2 * G).unwrap().into_region();
        warm.grow(2).unwrap();
        warm.shrink(2).unwrap();
        warm.release().complete().unwrap();
        assert_eq!(device.cached_bytes(), 2 * G as u64, "setup: two cached");
        let mut region = binding.reserve(3 * G).unwrap().into_region();
        faults.fail_nth(Op::Create, 1);
        faults.fail_from(Op::Release, 1);

        let lowering = {
            let device = device.clone();
            thread::spawn(move || device.set_cache_cap_trimmed(G as u64))
        };
        let undone = region
            .grow(3)
            .expect_err("the create was failed on purpose");
        let trimmed = lowering.join().unwrap();

        let GrowError::Undone { quarantined, .. } = undone else {
            panic!("the growth is undone whole: {undone:?}");
        };
        let ledger = device.ledger();
        assert_eq!(trimmed % G as u64, 0);
        assert_eq!(
            ledger.quarantined,
            quarantined as u64 + trimmed / G as u64,
            "each granule that left the cache is quarantined once, and counted by the one that \
             released it (the undone growth said {quarantined}, the trim took {trimmed} bytes)"
        );
        assert_eq!(
            ledger.owned_bytes,
            ledger.cached_bytes + ledger.quarantined * G as u64,
            "the two granules are cached or quarantined"
        );
        assert_eq!(ledger.owned_bytes, 2 * G as u64, "nothing was released");
        assert_eq!(binding.used(), 0, "the undone growth is charged nothing");
        assert_eq!(region.committed_granules(), 0);

        // Releases work again: the quarantine and the cache give back exactly what they hold.
        faults.clear();
        let released = device.retry_quarantine().released;
        assert_eq!(released as u64, ledger.quarantined);
        assert_eq!(device.trim_cache(), ledger.cached_bytes);
        region.release().complete().unwrap();
        drop(binding);
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
        let Ok(device) = Arc::try_unwrap(device) else {
            panic!("the other thread has ended: its clone is gone");
        };
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero(), "{:?}", faults.outstanding());
    });
}
