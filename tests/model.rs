//! Property test: random sequences of reserve / commit / write / release / drop / retry with
//! faults injected at random backend calls, on the strict simulator and on the host backend.
//!
//! After every step: the ledger equals the sum of live tokens, quarantined tokens and what the
//! device holds in custody; the backend's own outstanding counts equal the ledger; no two held
//! VA ranges overlap (so quarantined VA is never handed out again); the budget equals what the
//! binding's tokens own; host memory holds what was written. At the end, after retries, the
//! backend holds nothing.
//!
//! 1,000 cases per backend by default; `PROPTEST_CASES=N` for more.

use memtoken::backend::{Backend, FaultHandle, Faulty, HostBackend, Op, SimBackend, SimConfig};
use memtoken::{
    Allocation, Binding, Budget, Committed, CompleteError, Device, Quarantined, Releasing,
    Reserved, make_guard,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    Reserve(usize),
    Commit(usize),
    Write(usize, u8),
    /// Reserved → released; Committed → Releasing; Releasing → complete; Quarantined → retry.
    Release(usize),
    Drop(usize),
    RetryDevice,
    Poll,
    CompleteFences,
    Fault(Op, u64),
}

fn step() -> impl Strategy<Value = Step> {
    let op = prop::sample::select(vec![
        Op::Reserve,
        Op::Free,
        Op::Create,
        Op::Release,
        Op::Map,
        Op::Unmap,
    ]);
    prop_oneof![
        3 => (1usize..4).prop_map(Step::Reserve),
        3 => any::<usize>().prop_map(Step::Commit),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Step::Write(i, b)),
        4 => any::<usize>().prop_map(Step::Release),
        2 => any::<usize>().prop_map(Step::Drop),
        1 => Just(Step::RetryDevice),
        1 => Just(Step::Poll),
        1 => Just(Step::CompleteFences),
        2 => (op, 1u64..4).prop_map(|(op, n)| Step::Fault(op, n)),
    ]
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

enum Token<'b, 'id, B: Backend> {
    Reserved(Allocation<'b, 'id, B, Reserved>),
    /// The byte the memory was last filled with (host only; 0 = fresh memory).
    Committed(Allocation<'b, 'id, B, Committed>, u8),
    Releasing(Allocation<'b, 'id, B, Releasing>),
    Quarantined(Quarantined<'b, 'id, B>),
}

/// What the backend-specific part of the model does with memory.
trait Memory<B: Backend> {
    fn fill(&self, a: &mut Allocation<'_, '_, B, Committed>, byte: u8) -> bool;
    fn holds(&self, a: &Allocation<'_, '_, B, Committed>, byte: u8) -> bool;
    fn complete_fences(&self) {}
}

struct NoMemory(SimBackend);
impl Memory<Faulty<SimBackend>> for NoMemory {
    fn fill(&self, _: &mut Allocation<'_, '_, Faulty<SimBackend>, Committed>, _: u8) -> bool {
        false
    }
    fn holds(&self, _: &Allocation<'_, '_, Faulty<SimBackend>, Committed>, _: u8) -> bool {
        true
    }
    fn complete_fences(&self) {
        self.0.complete_fences();
    }
}

struct HostMemory;
impl Memory<Faulty<HostBackend>> for HostMemory {
    fn fill(&self, a: &mut Allocation<'_, '_, Faulty<HostBackend>, Committed>, byte: u8) -> bool {
        a.as_mut_slice().fill(byte);
        true
    }
    fn holds(&self, a: &Allocation<'_, '_, Faulty<HostBackend>, Committed>, byte: u8) -> bool {
        let s = a.as_slice();
        s[0] == byte && s[s.len() - 1] == byte && s.iter().all(|&b| b == byte)
    }
}

struct Model<'b, 'id, B: Backend, M> {
    device: &'b Device<'id, B>,
    binding: &'b Binding<'b, 'id, B>,
    faults: FaultHandle,
    memory: M,
    tokens: Vec<Token<'b, 'id, B>>,
}

impl<'b, 'id, B: Backend, M: Memory<B>> Model<'b, 'id, B, M> {
    fn apply(&mut self, step: &Step) {
        let n = self.tokens.len();
        let pick = |i: usize| (n > 0).then(|| i % n);
        match *step {
            Step::Reserve(granules) => {
                let g = self.device.granularity();
                if let Ok(t) = self.binding.reserve(granules * g) {
                    self.tokens.push(Token::Reserved(t));
                }
            }
            Step::Commit(i) => {
                let Some(i) = pick(i) else { return };
                if let Token::Reserved(_) = self.tokens[i] {
                    let Token::Reserved(t) = self.tokens.swap_remove(i) else {
                        unreachable!()
                    };
                    let generation = t.generation();
                    match t.commit() {
                        Ok(c) => self.tokens.push(Token::Committed(c, 0)),
                        Err(e) => {
                            let t = e.into_token();
                            assert_eq!(t.generation(), generation, "the same token comes back");
                            self.tokens.push(Token::Reserved(t));
                        }
                    }
                }
            }
            Step::Write(i, byte) => {
                let Some(i) = pick(i) else { return };
                if let Token::Committed(a, fill) = &mut self.tokens[i]
                    && self.memory.fill(a, byte)
                {
                    *fill = byte;
                }
            }
            Step::Release(i) => {
                let Some(i) = pick(i) else { return };
                let next = match self.tokens.swap_remove(i) {
                    Token::Reserved(t) => t
                        .release()
                        .err()
                        .map(|e| Token::Quarantined(e.into_token())),
                    Token::Committed(t, _) => Some(Token::Releasing(t.release())),
                    Token::Releasing(t) => match t.complete() {
                        Ok(_) => None,
                        Err(CompleteError::Pending(t)) => Some(Token::Releasing(t)),
                        Err(CompleteError::Failed(e)) => Some(Token::Quarantined(e.into_token())),
                    },
                    Token::Quarantined(q) => {
                        q.retry().err().map(|e| Token::Quarantined(e.into_token()))
                    }
                };
                self.tokens.extend(next);
            }
            Step::Drop(i) => {
                if let Some(i) = pick(i) {
                    drop(self.tokens.swap_remove(i));
                }
            }
            Step::RetryDevice => {
                self.device.retry_quarantine();
            }
            Step::Poll => {
                self.device.poll();
            }
            Step::CompleteFences => self.memory.complete_fences(),
            Step::Fault(op, nth) => self.faults.fail_nth(op, nth),
        }
    }

    fn check(&self) {
        let (mut reserved, mut mapped, mut owned, mut quarantined, mut budget) = (0u64, 0, 0, 0, 0);
        let mut ranges = self.device.withheld_ranges();
        for t in &self.tokens {
            let (addr, len, m, o, holds_va) = match t {
                Token::Reserved(a) => (a.addr(), a.size(), 0, 0, true),
                Token::Committed(a, fill) => {
                    assert!(
                        self.memory.holds(a, *fill),
                        "memory of {a:?} lost its contents"
                    );
                    (a.addr(), a.size(), a.size(), a.size(), true)
                }
                Token::Releasing(a) => (a.addr(), a.size(), a.size(), a.size(), true),
                Token::Quarantined(q) => {
                    quarantined += 1;
                    let r = q.residual();
                    let (addr, len) = r.range();
                    (addr, len, r.mapped_bytes(), r.owned_bytes(), r.holds_va())
                }
            };
            if holds_va {
                reserved += len as u64;
                ranges.push((addr, len));
            }
            mapped += m as u64;
            owned += o as u64;
            budget += o as u64;
        }
        let custody = self.device.custody();
        for h in [custody.quarantined, custody.deferred] {
            reserved += h.reserved_bytes;
            mapped += h.mapped_bytes;
            owned += h.owned_bytes;
        }
        quarantined += custody.quarantined.count as u64;

        let ledger = self.device.ledger();
        assert_eq!(
            ledger.reserved_bytes, reserved,
            "reserved: ledger vs tokens"
        );
        assert_eq!(ledger.mapped_bytes, mapped, "mapped: ledger vs tokens");
        assert_eq!(ledger.owned_bytes, owned, "owned: ledger vs tokens");
        assert_eq!(
            ledger.quarantined, quarantined,
            "quarantined: ledger vs tokens"
        );
        assert_eq!(
            self.binding.used(),
            budget,
            "budget vs tokens the binding owns"
        );

        let backend = self.faults.outstanding();
        assert_eq!(
            backend.reserved_bytes, ledger.reserved_bytes,
            "reserved: backend vs ledger"
        );
        assert_eq!(
            backend.mapped_bytes, ledger.mapped_bytes,
            "mapped: backend vs ledger"
        );
        assert_eq!(
            backend.physical_bytes, ledger.owned_bytes,
            "owned: backend vs ledger"
        );
        assert_eq!(
            backend.reservations as usize,
            ranges.len(),
            "one reservation per held range"
        );

        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "held VA ranges overlap: {:x?} and {:x?}",
                w[0],
                w[1]
            );
        }
    }

    /// Clears faults and gives everything back; asserts nothing is left.
    fn finish(mut self) {
        self.faults.clear();
        for t in self.tokens.drain(..) {
            match t {
                Token::Quarantined(q) => {
                    q.retry()
                        .expect("a retry after the faults cleared releases everything");
                }
                other => drop(other),
            }
        }
        self.memory.complete_fences(); // the fences recorded by the drops above
        self.device.poll();
        let p = self.device.retry_quarantine();
        assert_eq!((p.quarantined, p.deferred), (0, 0), "{p:?}");
        assert!(self.device.ledger().is_zero(), "{:?}", self.device.ledger());
        assert_eq!(self.binding.used(), 0);
        let mut left = self.faults.outstanding();
        left.pins = 0; // the binding is still alive
        assert!(left.is_zero(), "the backend still holds {left:?}");
    }
}

fn run<B: Backend, M: Memory<B>>(
    device: &Device<'_, B>,
    faults: FaultHandle,
    memory: M,
    steps: &[Step],
) {
    let binding = device
        .bind(Budget::bytes(8 * device.granularity() as u64))
        .unwrap();
    let mut model = Model {
        device,
        binding: &binding,
        faults,
        memory,
        tokens: Vec::new(),
    };
    for step in steps {
        model.apply(step);
        model.check();
    }
    model.finish();
}

fn run_sim(steps: &[Step]) {
    make_guard!(guard);
    let sim = SimBackend::new(SimConfig {
        fences_complete_at_once: false,
        ..SimConfig::default()
    });
    let backend = Faulty::new(sim.clone());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    run(&device, faults.clone(), NoMemory(sim), steps);
    assert!(faults.outstanding().is_zero());
}

fn run_host(steps: &[Step]) {
    make_guard!(guard);
    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    run(&device, faults.clone(), HostMemory, steps);
    assert!(faults.outstanding().is_zero());
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn simulated_backend_loses_nothing(steps in prop::collection::vec(step(), 1..60)) {
        run_sim(&steps);
    }

    #[test]
    fn host_backend_loses_nothing(steps in prop::collection::vec(step(), 1..60)) {
        run_host(&steps);
    }
}
