//! Planned faults, keyed by the kind of call: the machinery that [`Faulty`](super::Faulty)
//! (kinds: [`Op`](crate::backend::Op)) and [`DriverModel`](crate::backend::doubles::DriverModel) (kinds:
//! [`DriverCall`](crate::backend::cuda::DriverCall)) share. It counts the calls of each kind and decides
//! whether the one being made is planned to fail, and with what error.

use std::collections::HashMap;
use std::hash::Hash;

/// One kind's plan.
#[derive(Clone, Copy, Debug)]
struct Plan<E> {
    /// The call number (of its kind, 1-based, counted since the plans were made) that fails.
    at: u64,
    /// The error it fails with.
    error: E,
    /// Whether every later call of the kind fails too, until cleared.
    persistent: bool,
}

/// A call planned to fail: which call of its kind it is (1-based), and its error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fault<E> {
    pub(crate) nth: u64,
    pub(crate) error: E,
}

/// Per-kind call counters and at most one plan per kind. Not synchronized: its owner keeps it
/// under the lock that also orders the calls it counts.
#[derive(Debug)]
pub(crate) struct FaultPlan<K, E> {
    calls: HashMap<K, u64>,
    plans: HashMap<K, Plan<E>>,
}

impl<K, E> Default for FaultPlan<K, E> {
    fn default() -> Self {
        Self {
            calls: HashMap::new(),
            plans: HashMap::new(),
        }
    }
}

impl<K: Copy + Eq + Hash, E: Copy> FaultPlan<K, E> {
    /// Plans the `n`th call of `kind` from now (`n = 1`: the next one) to fail with `error`;
    /// `persistent`: every one after it too, until [`clear`](Self::clear). A new plan for a kind
    /// replaces its previous one.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub(crate) fn plan(&mut self, kind: K, n: u64, error: E, persistent: bool) {
        assert!(
            n >= 1,
            "calls are counted from 1: n = 1 fails the next call"
        );
        let at = self.calls(kind) + n;
        let plan = Plan {
            at,
            error,
            persistent,
        };
        self.plans.insert(kind, plan);
    }

    /// Removes every plan (the counts stay).
    pub(crate) fn clear(&mut self) {
        self.plans.clear();
    }

    /// Calls of `kind` counted so far, failed ones included.
    pub(crate) fn calls(&self, kind: K) -> u64 {
        self.calls.get(&kind).copied().unwrap_or(0)
    }

    /// Counts a call of `kind`; `Err` with its number and error if it is planned to fail. A
    /// one-off plan is used up by the call it fails.
    pub(crate) fn enter(&mut self, kind: K) -> Result<(), Fault<E>> {
        let nth = {
            let count = self.calls.entry(kind).or_insert(0);
            *count += 1;
            *count
        };
        match self.plans.get(&kind).copied() {
            Some(p) if nth == p.at || (p.persistent && nth > p.at) => {
                if !p.persistent {
                    self.plans.remove(&kind);
                }
                Err(Fault {
                    nth,
                    error: p.error,
                })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_off_plan_fails_exactly_the_nth_call_from_now() {
        let mut plan: FaultPlan<u8, &str> = FaultPlan::default();
        plan.enter(1).unwrap();
        plan.plan(1, 2, "boom", false);
        plan.enter(1).unwrap();
        plan.enter(0).unwrap(); // another kind: counted apart
        assert_eq!(
            plan.enter(1),
            Err(Fault {
                nth: 3,
                error: "boom"
            })
        );
        plan.enter(1).unwrap();
        assert_eq!((plan.calls(1), plan.calls(0), plan.calls(2)), (4, 1, 0));
    }

    #[test]
    fn a_persistent_plan_fails_until_cleared() {
        let mut plan: FaultPlan<u8, ()> = FaultPlan::default();
        plan.plan(0, 1, (), true);
        assert!(plan.enter(0).is_err());
        assert!(plan.enter(0).is_err());
        plan.clear();
        plan.enter(0).unwrap();
        assert_eq!(plan.calls(0), 3);
    }

    #[test]
    #[should_panic(expected = "counted from 1")]
    fn the_zeroth_call_cannot_be_planned() {
        FaultPlan::<u8, ()>::default().plan(0, 0, (), false);
    }
}
