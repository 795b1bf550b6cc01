//! Unwind safety: a backend call that panics leaves the ledger, the budgets
//! and the shared counts consistent, and what a queue held goes back into it.
//!
//! An exhaustive, deterministic harness. For each [`Scenario`] (one per transition and queue
//! operation), each kind of backend call in [`Op::ALL`], and each `n` from 1 to one past the
//! number of calls of that kind the operation makes (counted in a dry run first), a fresh
//! device over `Faulty<…>` is set up, the `n`th call of that kind from then on is planned to
//! panic ([`FaultHandle::panic_nth`]), and the operation runs under `catch_unwind`. Then:
//!
//! - the injected panic reached the caller exactly when the dry run says the call is made (so
//!   no case passes vacuously), and no other panic did;
//! - right after it: the ledger equals what the live tokens, the device's custody, its shared
//!   memory and its granule cache hold; the backend holds what the ledger says; each binding's
//!   budget equals what its tokens own; the shared references equal the live mappings; the
//!   KV cache lost no block; the pins equal the live bindings ([`World::check`]);
//! - once every token is dropped and the device has polled, trimmed its cache and retried its
//!   quarantine, nothing is charged or held anywhere, and nothing panicked again ([`settle`]).
//!
//! A second harness panics at any call ([`FaultHandle::panic_at_call`]): one long scenario (the
//! device made, bindings, commits, a prefix shared and diverged, a region grown, shrunk,
//! suspended and resumed, an export imported, a KV cache, releases, a poll: [`Step`]) runs
//! with its `n`th call of any kind panicking, for each `n` from 1 to one past the number of
//! calls its dry run makes. The panic must reach the caller at that call and stop the
//! scenario; right after, the invariants hold; once the faults are cleared, every token, the
//! KV cache and the bindings dropped and the device closed, it closes clean and the backend holds
//! nothing ([`any_call_case`]). Its second variant (`any_call_in_drops_*`) skips the releases
//! and the poll, so that live tokens of every kind are left to drop, and keeps the plan armed
//! through the teardown: `n` runs on through the calls of the tokens' drops, the KV cache's, the
//! bindings' and the device's close, and the panic must surface from the stage that makes the
//! call — a drop or `close` included.
//!
//! Every scenario runs on the strict simulator; those the backend supports also run on the host
//! backend and on the CUDA backend over the driver model (the long scenario runs on these two).
//! Each backend's cases run in a child process (this test binary run again), so that a panic
//! while unwinding — which aborts the process — fails its own case: the parent resumes after
//! it. The parent prints nothing unless a case fails; `MEMTOKEN_UNWIND_REPORT=1` prints each
//! scenario's calls and fired panics.

use memtoken::backend::{
    Addr, Backend, Exportable, HostBackend, Op, PosixFd,
    doubles::{FaultHandle, Faulty, SimBackend, SimConfig},
};
use memtoken::backend::{
    cuda::CudaBackend,
    doubles::{DriverModel, ModelConfig},
};
use memtoken::kv::{BlockTable, KvCache, Layout};
use memtoken::{
    Allocation, Binding, Budget, Committed, Device, Releasing, Reserved, errors::Returned,
    make_guard, region::Region, report::Quarantined, sharing::DivergedMapping,
    sharing::ExportablePrefix, sharing::ImportedPrefix, sharing::Offer, sharing::Prefix,
    sharing::PrefixMapping, sleep::SuspendedAllocation, sleep::SuspendedRegion,
};
use std::any::Any;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;

/// The start of every injected panic's message: of a call of a kind, a getter, or any call.
const INJECTED: &str = "Faulty: panic injected into ";
/// Set in a child process: the name of the test whose cases it runs.
const CHILD_ENV: &str = "MEMTOKEN_UNWIND_CHILD";
/// Set in a child process: the index of the first case to run.
const FROM_ENV: &str = "MEMTOKEN_UNWIND_FROM";
/// Set to print each scenario's dry-run calls and fired panics, failures or not.
const REPORT_ENV: &str = "MEMTOKEN_UNWIND_REPORT";
/// Marks a line of the child's protocol; fields are separated by `SEP`, failures by `FAILS`.
const MARK: &str = "UNWIND";
const SEP: char = '\u{1f}';
const FAILS: char = '\u{1e}';

/// The simulator's and the driver model's granularity: small, so that saving and restoring
/// suspended memory costs little.
const GRANULE: usize = 4096;

type Fy<E> = Faulty<<E as Env>::Inner>;

// ---------------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------------

/// Anything: an export, held only to be dropped.
trait Opaque {}
impl<T: ?Sized> Opaque for T {}

/// A backend under test: how to make one, and what only some backends can do.
trait Env: Sized {
    /// The backend that [`Faulty`] wraps.
    type Inner: Backend + 'static;
    /// Whether memory can be exported and imported as `PosixFd` handles.
    const EXPORTS: bool;

    /// A fresh backend and a handle on it; `manual`: fences complete only when told.
    fn make(manual: bool) -> (Self, Self::Inner);

    /// Completes every fence recorded so far.
    fn complete_fences(&self);

    /// Writes into `a`'s memory where the host can (a token over `Faulty<CudaBackend<…>>` has
    /// no copies of its own: only suspending and resuming copy there).
    fn write(a: &mut Allocation<'_, '_, Fy<Self>, Committed>) {
        let _ = a;
    }

    /// Submits work that fences recorded from now on wait for (where fences can be pending).
    fn submit_work(&self) {}

    /// Checks what the wrapped backend still holds once the device is gone (the device gives
    /// back, as it drops, every pin whose unpin failed).
    fn after_close(&self) -> Result<(), String> {
        Ok(())
    }

    /// Commits `r` as an exportable prefix (setup only: panics on failure).
    fn exportable<'b, 'id>(
        r: Allocation<'b, 'id, Fy<Self>, Reserved>,
    ) -> ExportablePrefix<'b, 'id, Fy<Self>, PosixFd>;

    /// Exports `p`.
    fn export<'b, 'id>(
        p: &ExportablePrefix<'b, 'id, Fy<Self>, PosixFd>,
    ) -> Option<Box<dyn Opaque + 'b>>;

    /// An offer of `p` as another process would receive it: exported, sent over a socket pair
    /// and received, the export ended (setup only: panics on failure).
    fn offer(p: &ExportablePrefix<'_, '_, Fy<Self>, PosixFd>) -> Offer;

    /// Imports `offer` through `binding`.
    fn import<'b, 'id>(
        binding: &'b Binding<'b, 'id, Fy<Self>>,
        offer: Offer,
    ) -> Option<ImportedPrefix<'b, 'id, Fy<Self>>>;
}

fn exportable_of<'b, 'id, B: Exportable<PosixFd>>(
    r: Allocation<'b, 'id, B, Reserved>,
) -> ExportablePrefix<'b, 'id, B, PosixFd> {
    r.commit_prefix_exportable::<PosixFd>()
        .map_err(|e| e.cause)
        .expect("setup: commit_prefix_exportable")
}

fn export_of<'b, 'id, B: Exportable<PosixFd> + 'static>(
    p: &ExportablePrefix<'b, 'id, B, PosixFd>,
) -> Option<Box<dyn Opaque + 'b>> {
    let export = p.export().ok()?;
    Some(Box::new(export))
}

fn offer_of<B: Exportable<PosixFd>>(p: &ExportablePrefix<'_, '_, B, PosixFd>) -> Offer {
    let export = p.export().expect("setup: export");
    let (a, b) = UnixStream::pair().expect("setup: a socket pair");
    export.send(&a).expect("setup: send the offer");
    Offer::recv(&b).expect("setup: receive the offer")
}

fn import_of<'b, 'id, B: Exportable<PosixFd>>(
    binding: &'b Binding<'b, 'id, B>,
    offer: Offer,
) -> Option<ImportedPrefix<'b, 'id, B>> {
    binding.import(offer).ok()
}

/// The strict simulator.
struct Sim(SimBackend);

impl Env for Sim {
    type Inner = SimBackend;
    const EXPORTS: bool = false;

    fn make(manual: bool) -> (Self, SimBackend) {
        let sim = SimBackend::new(SimConfig {
            granularity: GRANULE,
            fences_complete_at_once: !manual,
            ..SimConfig::strict()
        })
        .expect("a simulator");
        (Self(sim.clone()), sim)
    }

    fn complete_fences(&self) {
        self.0.complete_fences();
    }

    fn exportable<'b, 'id>(
        _: Allocation<'b, 'id, Fy<Self>, Reserved>,
    ) -> ExportablePrefix<'b, 'id, Fy<Self>, PosixFd> {
        unreachable!("the simulator exports nothing")
    }

    fn export<'b, 'id>(
        _: &ExportablePrefix<'b, 'id, Fy<Self>, PosixFd>,
    ) -> Option<Box<dyn Opaque + 'b>> {
        unreachable!("the simulator exports nothing")
    }

    fn offer(_: &ExportablePrefix<'_, '_, Fy<Self>, PosixFd>) -> Offer {
        unreachable!("the simulator exports nothing")
    }

    fn import<'b, 'id>(
        _: &'b Binding<'b, 'id, Fy<Self>>,
        _: Offer,
    ) -> Option<ImportedPrefix<'b, 'id, Fy<Self>>> {
        unreachable!("the simulator imports nothing")
    }
}

/// The host backend (its fences are always complete).
struct Host;

impl Env for Host {
    type Inner = HostBackend;
    const EXPORTS: bool = true;

    fn make(_manual: bool) -> (Self, HostBackend) {
        (Self, HostBackend::with_defaults().expect("a host backend"))
    }

    fn complete_fences(&self) {}

    fn write(a: &mut Allocation<'_, '_, Fy<Self>, Committed>) {
        a.as_mut_slice().fill(7);
    }

    fn exportable<'b, 'id>(
        r: Allocation<'b, 'id, Fy<Self>, Reserved>,
    ) -> ExportablePrefix<'b, 'id, Fy<Self>, PosixFd> {
        exportable_of(r)
    }

    fn export<'b, 'id>(
        p: &ExportablePrefix<'b, 'id, Fy<Self>, PosixFd>,
    ) -> Option<Box<dyn Opaque + 'b>> {
        export_of(p)
    }

    fn offer(p: &ExportablePrefix<'_, '_, Fy<Self>, PosixFd>) -> Offer {
        offer_of(p)
    }

    fn import<'b, 'id>(
        binding: &'b Binding<'b, 'id, Fy<Self>>,
        offer: Offer,
    ) -> Option<ImportedPrefix<'b, 'id, Fy<Self>>> {
        import_of(binding, offer)
    }
}

/// The CUDA backend over the strict driver model.
struct Cuda(DriverModel);

impl Env for Cuda {
    type Inner = CudaBackend<DriverModel>;
    const EXPORTS: bool = true;

    fn make(manual: bool) -> (Self, CudaBackend<DriverModel>) {
        let model = DriverModel::new(ModelConfig {
            granularity: GRANULE,
            events_complete_at_once: !manual,
            ..ModelConfig::default()
        })
        .expect("a driver model");
        let backend = CudaBackend::new(model.clone(), 0).expect("a CUDA backend on the model");
        (Self(model), backend)
    }

    fn complete_fences(&self) {
        self.0.complete_work();
    }

    fn submit_work(&self) {
        self.0.submit_work();
    }

    fn after_close(&self) -> Result<(), String> {
        let held = self.0.outstanding();
        if held.is_zero() {
            Ok(())
        } else {
            Err(format!(
                "the driver model still holds something once the device is gone [{held:?}]"
            ))
        }
    }

    fn exportable<'b, 'id>(
        r: Allocation<'b, 'id, Fy<Self>, Reserved>,
    ) -> ExportablePrefix<'b, 'id, Fy<Self>, PosixFd> {
        exportable_of(r)
    }

    fn export<'b, 'id>(
        p: &ExportablePrefix<'b, 'id, Fy<Self>, PosixFd>,
    ) -> Option<Box<dyn Opaque + 'b>> {
        export_of(p)
    }

    fn offer(p: &ExportablePrefix<'_, '_, Fy<Self>, PosixFd>) -> Offer {
        offer_of(p)
    }

    fn import<'b, 'id>(
        binding: &'b Binding<'b, 'id, Fy<Self>>,
        offer: Offer,
    ) -> Option<ImportedPrefix<'b, 'id, Fy<Self>>> {
        import_of(binding, offer)
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens and what they hold
// ---------------------------------------------------------------------------------------------

/// A live token of any kind.
enum Tok<'b, 'id, B: Backend> {
    Reserved(Allocation<'b, 'id, B, Reserved>),
    Committed(Allocation<'b, 'id, B, Committed>),
    /// A release in progress, and what it holds (what its token held when it began).
    Releasing(Allocation<'b, 'id, B, Releasing>, Holds),
    Prefix(Prefix<'b, 'id, B>),
    Exportable(ExportablePrefix<'b, 'id, B, PosixFd>),
    Sharer(PrefixMapping<'b, 'id, B>),
    Diverged(DivergedMapping<'b, 'id, B>),
    Region(Region<'b, 'id, B>),
    Asleep(SuspendedAllocation<'b, 'id, B>),
    AsleepRegion(SuspendedRegion<'b, 'id, B>),
    Quarantined(Quarantined<'b, 'id, B>),
    Imported(ImportedPrefix<'b, 'id, B>),
    /// An export: a reference on its prefix's memory, nothing else.
    Export {
        /// Held only to be dropped.
        _export: Box<dyn Opaque + 'b>,
    },
}

/// What one token holds, as its public accessors say.
#[derive(Clone, Copy, Debug, Default)]
struct Holds {
    /// The VA range it keeps reserved.
    range: Option<(Addr, usize)>,
    mapped: usize,
    /// Physical bytes it owns alone.
    owned: usize,
    /// Bytes charged to its binding's budget.
    charged: usize,
    /// Whether it holds a reference on shared physical memory.
    shares: bool,
    /// Bytes of another process's memory it holds handles on (counted by the backend only).
    imported: usize,
}

impl<'b, 'id, B: Backend> Tok<'b, 'id, B> {
    fn holds(&self, g: usize) -> Holds {
        let mapping = |addr, len, owned, charged, shares| Holds {
            range: Some((addr, len)),
            mapped: len,
            owned,
            charged,
            shares,
            imported: 0,
        };
        // Committed granules and withheld ones: mapped, owned and charged.
        let granules = |addr, len, n| Holds {
            range: Some((addr, len)),
            mapped: n,
            owned: n,
            charged: n,
            ..Holds::default()
        };
        match self {
            Tok::Reserved(a) => Holds {
                range: Some((a.addr(), a.len())),
                ..Holds::default()
            },
            Tok::Committed(a) => mapping(a.addr(), a.len(), a.len(), a.len(), false),
            Tok::Releasing(_, h) => *h,
            // A prefix's memory is the device's; the owner's budget carries it.
            Tok::Prefix(p) => mapping(p.addr(), p.len(), 0, p.len(), true),
            Tok::Exportable(p) => mapping(p.addr(), p.len(), 0, p.len(), true),
            Tok::Sharer(m) => mapping(m.addr(), m.len(), 0, 0, true),
            Tok::Diverged(d) => mapping(d.addr(), d.len(), g, g, true),
            Tok::Region(r) => granules(
                r.addr(),
                r.len(),
                r.committed_len() + r.withheld_granules() * g,
            ),
            Tok::Asleep(a) => granules(a.addr(), a.len(), a.withheld_bytes()),
            Tok::AsleepRegion(r) => granules(r.addr(), r.len(), r.withheld_bytes()),
            Tok::Quarantined(q) => {
                let r = q.residual();
                Holds {
                    range: r.holds_va().then(|| r.range()),
                    mapped: r.mapped_bytes(),
                    owned: r.owned_bytes(),
                    charged: r.owned_bytes(),
                    shares: r.holds_shared(),
                    imported: 0,
                }
            }
            Tok::Imported(i) => Holds {
                imported: i.len(),
                ..mapping(i.addr(), i.len(), 0, 0, false)
            },
            Tok::Export { .. } => Holds {
                shares: true,
                ..Holds::default()
            },
        }
    }

    /// The binding whose budget carries what the token owns (none for an export).
    fn binding(&self) -> Option<&'b Binding<'b, 'id, B>> {
        Some(match self {
            Tok::Reserved(a) => a.binding(),
            Tok::Committed(a) => a.binding(),
            Tok::Releasing(a, _) => a.binding(),
            Tok::Prefix(a) => a.binding(),
            Tok::Exportable(a) => a.binding(),
            Tok::Sharer(a) => a.binding(),
            Tok::Diverged(a) => a.binding(),
            Tok::Region(a) => a.binding(),
            Tok::Asleep(a) => a.binding(),
            Tok::AsleepRegion(a) => a.binding(),
            Tok::Quarantined(q) => q.binding(),
            Tok::Imported(a) => a.binding(),
            Tok::Export { .. } => return None,
        })
    }

    /// Starts the release of a live token. What it holds stays held; what it does not own
    /// alone (a prefix's bytes) leaves its budget.
    fn release(self, g: usize) -> Self {
        let h = self.holds(g);
        let h = Holds {
            charged: h.owned,
            ..h
        };
        let releasing = match self {
            Tok::Reserved(a) => a.release(),
            Tok::Committed(a) => a.release(),
            Tok::Prefix(a) => a.release(),
            Tok::Exportable(a) => a.release(),
            Tok::Sharer(a) => a.release(),
            Tok::Diverged(a) => a.release(),
            Tok::Region(a) => a.release(),
            Tok::Asleep(a) => a.release(),
            Tok::AsleepRegion(a) => a.release(),
            Tok::Imported(a) => a.release(),
            Tok::Releasing(..) | Tok::Quarantined(_) | Tok::Export { .. } => {
                unreachable!("not a live token")
            }
        };
        Tok::Releasing(releasing, h)
    }
}

/// The token a fallible transition hands back.
fn returned<'b, 'id, B: Backend, T>(
    r: Returned<T, Quarantined<'b, 'id, B>>,
    unchanged: impl FnOnce(T) -> Tok<'b, 'id, B>,
) -> Tok<'b, 'id, B> {
    match r {
        Returned::Unchanged(t) => unchanged(t),
        Returned::Quarantined(q) => Tok::Quarantined(q),
    }
}

// ---------------------------------------------------------------------------------------------
// The world a case runs in, and its invariants
// ---------------------------------------------------------------------------------------------

/// Returns `Err("what [left vs right]")` from the enclosing function unless both are equal.
macro_rules! ensure_eq {
    ($left:expr, $right:expr, $what:expr) => {{
        let (left, right) = ($left, $right);
        if left != right {
            return Err(format!("{} [{:?} vs {:?}]", $what, left, right));
        }
    }};
}

/// A device, two bindings (an owner and a sharer), a KV cache, and the live tokens.
struct World<'w, 'c, 'b, 'id, E: Env> {
    env: &'w E,
    device: &'b Device<'id, Fy<E>>,
    owner: &'b Binding<'b, 'id, Fy<E>>,
    sharer: &'b Binding<'b, 'id, Fy<E>>,
    faults: &'w FaultHandle,
    cache: &'w KvCache<'c, 'b, 'id, Fy<E>>,
    tokens: Vec<Tok<'b, 'id, Fy<E>>>,
    table: Option<BlockTable<'w, 'c, 'b, 'id, Fy<E>>>,
    offer: Option<Offer>,
}

impl<'w, 'c, 'b, 'id, E: Env> World<'w, 'c, 'b, 'id, E> {
    fn g(&self) -> usize {
        self.device.granularity()
    }

    fn push(&mut self, t: Tok<'b, 'id, Fy<E>>) {
        self.tokens.push(t);
    }

    /// The last token pushed: each scenario's subject.
    fn take(&mut self) -> Tok<'b, 'id, Fy<E>> {
        self.tokens.pop().expect("a subject token")
    }

    fn last_region(&mut self) -> &mut Region<'b, 'id, Fy<E>> {
        match self.tokens.last_mut() {
            Some(Tok::Region(r)) => r,
            _ => unreachable!("the subject is a region"),
        }
    }

    fn reserve(
        &self,
        who: &'b Binding<'b, 'id, Fy<E>>,
        granules: usize,
    ) -> Allocation<'b, 'id, Fy<E>, Reserved> {
        who.reserve(granules * self.g()).expect("setup: reserve")
    }

    fn commit(&self, granules: usize) -> Allocation<'b, 'id, Fy<E>, Committed> {
        let r = self.reserve(self.owner, granules);
        r.commit().map_err(|e| e.cause).expect("setup: commit")
    }

    fn prefix(&self, granules: usize) -> Prefix<'b, 'id, Fy<E>> {
        let r = self.reserve(self.owner, granules);
        r.commit_prefix()
            .map_err(|e| e.cause)
            .expect("setup: commit_prefix")
    }

    fn exportable(&self, granules: usize) -> ExportablePrefix<'b, 'id, Fy<E>, PosixFd> {
        E::exportable(self.reserve(self.owner, granules))
    }

    fn share(&self, p: &Prefix<'b, 'id, Fy<E>>) -> PrefixMapping<'b, 'id, Fy<E>> {
        let r = self.reserve(self.sharer, p.len() / self.g());
        r.map_prefix(p)
            .map_err(|e| e.cause)
            .expect("setup: map_prefix")
    }

    fn region(&self, room: usize, grown: usize) -> Region<'b, 'id, Fy<E>> {
        let mut r = self.reserve(self.owner, room).into_region();
        r.grow(grown).expect("setup: grow");
        r
    }

    /// A committed allocation whose completion failed at its first `fail` call: quarantined.
    fn quarantined(&self, granules: usize, fail: Op) -> Quarantined<'b, 'id, Fy<E>> {
        let releasing = self.commit(granules).release();
        self.faults.fail_nth(fail, 1);
        let result = releasing.complete();
        self.faults.clear();
        match result.map_err(|e| e.into_token()) {
            Err(Returned::Quarantined(q)) => q,
            _ => panic!("setup: the completion was to fail at its {fail:?} call"),
        }
    }

    /// Drops `t` with the first call of kind `fail` failing: what it held goes to the
    /// device's quarantine.
    fn drop_failing(&self, t: Tok<'b, 'id, Fy<E>>, fail: Op) {
        self.faults.fail_nth(fail, 1);
        drop(t);
        self.faults.clear();
    }

    /// The invariants, right after an operation (panicked or not): everything charged is held
    /// by someone, everything held is charged, and the backend agrees.
    fn check(&self) -> Result<(), String> {
        let g = self.g();
        let (mut reserved, mut mapped, mut owned, mut imported) = (0u64, 0u64, 0u64, 0u64);
        let (mut owner_charged, mut sharer_charged) = (0u64, 0u64);
        let (mut shares, mut quarantined) = (0u64, 0u64);
        let mut ranges = self.device.withheld_ranges();
        for t in &self.tokens {
            let h = t.holds(g);
            if let Some(range) = h.range {
                reserved += range.1 as u64;
                ranges.push(range);
            }
            mapped += h.mapped as u64;
            owned += h.owned as u64;
            imported += h.imported as u64;
            shares += u64::from(h.shares);
            quarantined += u64::from(matches!(t, Tok::Quarantined(_)));
            match t.binding() {
                Some(b) if std::ptr::eq(b, self.owner) => owner_charged += h.charged as u64,
                Some(_) => sharer_charged += h.charged as u64,
                None => {}
            }
        }
        // The KV cache's plane: reserved whole through the owner, its mapped granules owned
        // and charged.
        let plane = self.cache.stride(0) * self.cache.blocks();
        ranges.push((self.cache.base(0), plane));
        let backed = self.cache.mapped_bytes() as u64;
        reserved += plane as u64;
        mapped += backed;
        owned += backed;
        owner_charged += backed;
        let held = self.table.as_ref().map_or(0, BlockTable::len);
        ensure_eq!(
            self.cache.live_blocks(),
            held,
            "KV cache: blocks handed out vs the table's"
        );
        // Every block of a mapped group free or live, once: none lost from the free lists.
        self.cache.check_blocks()?;

        let custody = self.device.custody();
        for h in [custody.quarantined, custody.deferred] {
            reserved += h.reserved_bytes;
            mapped += h.mapped_bytes;
            owned += h.owned_bytes;
            shares += h.shared_refs;
        }
        quarantined += custody.quarantined.count as u64;
        let ledger = self.device.ledger();
        // Shared memory is owned once, by the device; cached granules by the device too.
        owned += custody.shared.owned_bytes + ledger.cached_bytes;
        ensure_eq!(
            custody.shared.shared_refs,
            shares,
            "shared references vs live mappings and custody"
        );
        if custody.shared.count as u64 > shares {
            return Err(format!(
                "shared memory outlived its last mapping [{} allocations, {shares} references]",
                custody.shared.count
            ));
        }
        ensure_eq!(
            ledger.reserved_bytes,
            reserved,
            "reserved: ledger vs tokens and custody"
        );
        ensure_eq!(
            ledger.mapped_bytes,
            mapped,
            "mapped: ledger vs tokens and custody"
        );
        ensure_eq!(
            ledger.owned_bytes,
            owned,
            "owned: ledger vs tokens, custody, shared memory and cache"
        );
        ensure_eq!(
            ledger.quarantined,
            quarantined,
            "quarantined: ledger vs quarantined tokens and custody"
        );
        ensure_eq!(
            self.owner.used(),
            owner_charged,
            "owner's budget vs what its tokens own"
        );
        ensure_eq!(
            self.sharer.used(),
            sharer_charged,
            "sharer's budget vs what its tokens own"
        );

        let backend = self.faults.outstanding();
        ensure_eq!(
            backend.reserved_bytes,
            ledger.reserved_bytes,
            "reserved: backend vs ledger"
        );
        ensure_eq!(
            backend.mapped_bytes,
            ledger.mapped_bytes,
            "mapped: backend vs ledger"
        );
        // Imported handles are physical memory to the backend, owned by another process (their
        // residuals in custody do not say how many bytes they hold: allow for them there).
        let in_custody = custody.quarantined.count + custody.deferred.count > 0;
        let lowest = ledger.owned_bytes + imported;
        if backend.physical_bytes != lowest && !(in_custody && backend.physical_bytes > lowest) {
            return Err(format!(
                "owned: backend vs ledger (and imported handles) [{} vs {lowest}]",
                backend.physical_bytes
            ));
        }
        ensure_eq!(
            backend.reservations as usize,
            ranges.len(),
            "reservations: backend vs held ranges"
        );
        ensure_eq!(
            backend.pins,
            2 + self.device.failed_unpins(),
            "pins: backend vs live bindings and failed unpins"
        );
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "held VA ranges overlap [{:x?} and {:x?}]",
                    w[0], w[1]
                ));
            }
        }
        Ok(())
    }

    /// Drops every token and the table, the sharers' mappings before their prefixes, each under
    /// [`catch`] (so that a panic in one drop leaves the others to theirs): the panics caught.
    fn drop_all(&mut self) -> Vec<String> {
        let mut panics = Vec::new();
        while let Some(t) = self.tokens.pop() {
            panics.extend(catch(move || drop(t)).err());
        }
        let table = self.table.take();
        panics.extend(catch(move || drop(table)).err());
        self.offer = None;
        panics
    }
}

/// A stage of a case's teardown: the calls made before it, and the panics caught in it.
struct Teardown {
    name: &'static str,
    before: u64,
    panics: Vec<String>,
}

impl Teardown {
    /// Runs stage `name`, which catches its own panics (`f` returns them).
    fn run(faults: &FaultHandle, name: &'static str, f: impl FnOnce() -> Vec<String>) -> Self {
        let before = faults.any_calls();
        let panics = f();
        Self {
            name,
            before,
            panics,
        }
    }

    /// Its panics, as failures (where none is expected).
    fn failures(self) -> impl Iterator<Item = String> {
        let name = self.name;
        self.panics
            .into_iter()
            .map(move |p| format!("{name} panicked: {p}"))
    }
}

/// Gives everything back once every token is gone: fences completed, deferred releases polled,
/// the cache trimmed, the quarantine retried. Then nothing may be charged or held, and the
/// backend holds only the bindings' pins.
fn settle<E: Env>(
    env: &E,
    device: &Device<'_, Fy<E>>,
    bindings: [&Binding<'_, '_, Fy<E>>; 2],
    faults: &FaultHandle,
) -> Result<(), String> {
    let progress = catch(|| {
        env.complete_fences();
        device.poll();
        device.trim_cache();
        device.retry_quarantine()
    })
    .map_err(|p| format!("poll, trim_cache or retry_quarantine panicked: {p}"))?;
    ensure_eq!(
        (progress.quarantined, progress.deferred),
        (0, 0),
        "left in custody after poll and retry (quarantined, deferred)"
    );
    let ledger = device.ledger();
    if !ledger.is_zero() {
        return Err(format!("the ledger is not zero [{ledger:?}]"));
    }
    for b in bindings {
        ensure_eq!(b.used(), 0, "a budget is still charged");
    }
    let mut left = faults.outstanding();
    ensure_eq!(
        left.pins,
        2 + device.failed_unpins(),
        "pins vs live bindings"
    );
    left.pins = 0;
    if !left.is_zero() {
        return Err(format!("the backend still holds something [{left:?}]"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

/// One transition or queue operation, with the state it starts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Scenario {
    Reserve,
    Commit,
    ReleaseCommitted,
    ReleasePrefix,
    ReleaseRegion,
    CompleteReserved,
    CompleteCommitted,
    /// The owner's release, its prefix's last mapping: the shared memory goes with it.
    CompletePrefix,
    CompleteRegion,
    DropReserved,
    DropCommitted,
    DropReleasing,
    /// The owner's prefix, unshared: the last mapping.
    DropPrefix,
    /// The owner's prefix while a sharer maps it.
    DropPrefixShared,
    /// A sharer, the last mapping once the owner is gone.
    DropSharerLast,
    DropDiverged,
    DropRegion,
    /// A region with a granule withheld after a failed unmap.
    DropRegionWithheld,
    DropSuspended,
    DropSuspendedRegion,
    /// A quarantined token dropped, then the device's quarantine retried.
    DropQuarantined,
    CommitPrefix1,
    CommitPrefix3,
    MapPrefix,
    Diverge,
    /// `into_region` and a growth by 3 granules, none cached.
    Grow,
    /// A growth by 5 granules, 3 of them from the cache.
    GrowFromCache,
    Shrink,
    /// A shrink by 3 granules with room in the cache for 1: 2 are released.
    ShrinkPastCap,
    /// Two withheld granules, room in the cache for 1.
    Reclaim,
    Suspend,
    SuspendSaving,
    SuspendRegion,
    SuspendRegionSaving,
    Resume,
    ResumeSaved,
    ResumeRegion,
    ResumeRegionSaved,
    /// A suspended allocation whose mapping was withheld by a failed unmap.
    ResumeWithheld,
    Retry,
    /// Several deferred releases whose fences completed.
    Poll,
    /// Several quarantined residuals, each stuck at another call.
    RetryQuarantine,
    TrimCache,
    SetCacheCap,
    /// A replenish that maps groups of the KV cache.
    KvMap,
    /// A replenish that records the one fence of the blocks given back since the last (a
    /// clear makes no backend call).
    KvFence,
    /// A replenish that unmaps the groups over the high watermark.
    KvShrink,
    Export,
    Import,
    /// An export ended after its prefix went: the last reference.
    DropExportLast,
    DropImported,
    /// A binding made and dropped.
    Bind,
}

impl Scenario {
    const ALL: [Scenario; 52] = {
        use Scenario::*;
        [
            Reserve,
            Commit,
            ReleaseCommitted,
            ReleasePrefix,
            ReleaseRegion,
            CompleteReserved,
            CompleteCommitted,
            CompletePrefix,
            CompleteRegion,
            DropReserved,
            DropCommitted,
            DropReleasing,
            DropPrefix,
            DropPrefixShared,
            DropSharerLast,
            DropDiverged,
            DropRegion,
            DropRegionWithheld,
            DropSuspended,
            DropSuspendedRegion,
            DropQuarantined,
            CommitPrefix1,
            CommitPrefix3,
            MapPrefix,
            Diverge,
            Grow,
            GrowFromCache,
            Shrink,
            ShrinkPastCap,
            Reclaim,
            Suspend,
            SuspendSaving,
            SuspendRegion,
            SuspendRegionSaving,
            Resume,
            ResumeSaved,
            ResumeRegion,
            ResumeRegionSaved,
            ResumeWithheld,
            Retry,
            Poll,
            RetryQuarantine,
            TrimCache,
            SetCacheCap,
            KvMap,
            KvFence,
            KvShrink,
            Export,
            Import,
            DropExportLast,
            DropImported,
            Bind,
        ]
    };

    /// Whether backend `E` can run it: exports need a backend that exports; a deferred
    /// queue and cooling blocks need fences that can be pending (not the host's).
    fn runs_on<E: Env>(self) -> bool {
        use Scenario::*;
        match self {
            Export | Import | DropExportLast | DropImported => E::EXPORTS,
            Poll | KvFence => !<E::Inner as Backend>::IMMEDIATE,
            _ => true,
        }
    }

    /// Whether its fences complete only when told (so that releases queue up).
    fn manual_fences(self) -> bool {
        self == Scenario::Poll
    }

    /// Makes the state the operation starts from; its subject is pushed last.
    fn setup<E: Env>(self, w: &mut World<'_, '_, '_, '_, E>) {
        use Scenario::*;
        let g = w.g();
        match self {
            Reserve | Bind => {}
            KvMap => w.cache.set_watermarks(3, 4),
            Commit | DropReserved | CommitPrefix3 => w.push(Tok::Reserved(w.reserve(w.owner, 3))),
            CommitPrefix1 => w.push(Tok::Reserved(w.reserve(w.owner, 1))),
            ReleaseCommitted | DropCommitted | Suspend | SuspendSaving => {
                w.push(Tok::Committed(w.commit(3)));
            }
            ReleasePrefix | DropPrefix => w.push(Tok::Prefix(w.prefix(3))),
            ReleaseRegion | DropRegion => w.push(Tok::Region(w.region(4, 3))),
            CompleteReserved => w.push(Tok::Reserved(w.reserve(w.owner, 3)).release(g)),
            CompleteCommitted | DropReleasing => {
                w.push(Tok::Committed(w.commit(3)).release(g));
            }
            CompletePrefix => w.push(Tok::Prefix(w.prefix(3)).release(g)),
            CompleteRegion => w.push(Tok::Region(w.region(4, 3)).release(g)),
            DropPrefixShared => {
                let p = w.prefix(3);
                w.push(Tok::Sharer(w.share(&p)));
                w.push(Tok::Prefix(p));
            }
            DropSharerLast => {
                let p = w.prefix(3);
                let m = w.share(&p);
                p.release().complete().expect("setup: the owner's release");
                w.push(Tok::Sharer(m));
            }
            DropDiverged => {
                let p = w.prefix(3);
                let d = w.share(&p).diverge().map_err(|e| e.cause);
                let d = d.expect("setup: diverge");
                w.push(Tok::Prefix(p));
                w.push(Tok::Diverged(d));
            }
            DropRegionWithheld => {
                let mut r = w.region(4, 3);
                w.faults.fail_nth(Op::Unmap, 1);
                let stuck = r.shrink(1);
                w.faults.clear();
                assert!(stuck.is_err(), "setup: the shrink was to fail");
                w.push(Tok::Region(r));
            }
            DropSuspended | Resume => {
                let a = w.commit(3).suspend().map_err(|e| e.cause);
                w.push(Tok::Asleep(a.expect("setup: suspend")));
            }
            ResumeSaved => {
                let a = w.commit(3).suspend_saving().map_err(|e| e.cause);
                w.push(Tok::Asleep(a.expect("setup: suspend_saving")));
            }
            DropSuspendedRegion | ResumeRegion => {
                let r = w.region(8, 3).suspend().map_err(|e| e.cause);
                w.push(Tok::AsleepRegion(r.expect("setup: suspend")));
            }
            ResumeRegionSaved => {
                let r = w.region(8, 3).suspend_saving().map_err(|e| e.cause);
                w.push(Tok::AsleepRegion(r.expect("setup: suspend_saving")));
            }
            ResumeWithheld => {
                let c = w.commit(3);
                w.faults.fail_nth(Op::Unmap, 1);
                let a = c.suspend().map_err(|e| e.cause);
                w.faults.clear();
                let a = a.expect("setup: suspend");
                assert_eq!(a.withheld_bytes(), 3 * g, "setup: the unmap was to fail");
                w.push(Tok::Asleep(a));
            }
            DropQuarantined | Retry => w.push(Tok::Quarantined(w.quarantined(3, Op::Unmap))),
            MapPrefix => {
                w.push(Tok::Prefix(w.prefix(3)));
                w.push(Tok::Reserved(w.reserve(w.sharer, 3)));
            }
            Diverge => {
                let p = w.prefix(3);
                let m = w.share(&p);
                w.push(Tok::Prefix(p));
                w.push(Tok::Sharer(m));
            }
            Grow => w.push(Tok::Reserved(w.reserve(w.owner, 8))),
            GrowFromCache => {
                let mut r = w.region(8, 3);
                r.shrink(3).expect("setup: shrink");
                w.push(Tok::Region(r));
                w.push(Tok::Reserved(w.reserve(w.owner, 8)));
            }
            Shrink | SuspendRegion | SuspendRegionSaving => w.push(Tok::Region(w.region(8, 4))),
            ShrinkPastCap => {
                w.device.set_cache_cap(g as u64);
                w.push(Tok::Region(w.region(8, 4)));
            }
            Reclaim => {
                w.device.set_cache_cap(g as u64);
                let mut r = w.region(8, 4);
                w.faults.fail_from(Op::Unmap, 1);
                let stuck = r.shrink(2);
                w.faults.clear();
                assert!(stuck.is_err(), "setup: the shrink was to fail");
                assert_eq!(r.withheld_granules(), 2, "setup: two granules withheld");
                w.push(Tok::Region(r));
            }
            Poll => {
                // Each goes to the deferred queue: its fence is pending.
                w.env.submit_work();
                drop(w.commit(2));
                drop(w.commit(1));
                drop(w.prefix(3));
                drop(w.region(4, 2));
                assert_eq!(w.device.custody().deferred.count, 4, "setup: four deferred");
                w.env.complete_fences();
            }
            RetryQuarantine => {
                for fail in [Op::Unmap, Op::Release, Op::Free] {
                    w.drop_failing(Tok::Committed(w.commit(2)), fail);
                }
                w.drop_failing(Tok::Prefix(w.prefix(3)), Op::Release);
                let n = w.device.custody().quarantined.count;
                assert!(n >= 4, "setup: four quarantined residuals, {n}");
            }
            TrimCache | SetCacheCap => {
                let mut r = w.region(8, 3);
                r.shrink(3).expect("setup: shrink");
                w.push(Tok::Region(r));
            }
            KvFence => {
                let cache = w.cache;
                cache.replenish().expect("setup: replenish");
                let table = w.table.insert(cache.table());
                for _ in 0..3 {
                    cache.push(table).expect("setup: push");
                }
                cache.clear(table);
            }
            KvShrink => {
                let cache = w.cache;
                cache.set_watermarks(3, 4);
                cache.replenish().expect("setup: replenish");
                cache.set_watermarks(0, 0);
            }
            Export => w.push(Tok::Exportable(w.exportable(3))),
            Import => {
                let p = w.exportable(3);
                w.offer = Some(E::offer(&p));
                w.push(Tok::Exportable(p));
            }
            DropExportLast => {
                let p = w.exportable(3);
                let export = E::export(&p).expect("setup: export");
                p.release().complete().expect("setup: the owner's release");
                w.push(Tok::Export { _export: export });
            }
            DropImported => {
                let p = w.exportable(3);
                let offer = E::offer(&p);
                let imported = E::import(w.sharer, offer).expect("setup: import");
                w.push(Tok::Exportable(p));
                w.push(Tok::Imported(imported));
            }
        }
    }

    /// The operation under test. Whatever it hands back goes back into the world.
    fn run<E: Env>(self, w: &mut World<'_, '_, '_, '_, E>) {
        use Scenario::*;
        let g = w.g();
        match self {
            Reserve => {
                if let Ok(r) = w.owner.reserve(3 * g) {
                    w.push(Tok::Reserved(r));
                }
            }
            Commit => {
                let Tok::Reserved(r) = w.take() else {
                    unreachable!()
                };
                w.push(match r.commit() {
                    Ok(c) => Tok::Committed(c),
                    Err(e) => Tok::Reserved(e.into_token()),
                });
            }
            ReleaseCommitted | ReleasePrefix | ReleaseRegion => {
                let t = w.take();
                w.push(t.release(g));
            }
            CompleteReserved | CompleteCommitted | CompletePrefix | CompleteRegion => {
                let Tok::Releasing(a, h) = w.take() else {
                    unreachable!()
                };
                if let Err(e) = a.complete() {
                    w.push(returned(e.into_token(), |a| Tok::Releasing(a, h)));
                }
            }
            DropReserved | DropCommitted | DropReleasing | DropPrefix | DropPrefixShared
            | DropSharerLast | DropDiverged | DropRegion | DropRegionWithheld | DropSuspended
            | DropSuspendedRegion | DropExportLast | DropImported => drop(w.take()),
            DropQuarantined => {
                drop(w.take());
                w.device.retry_quarantine();
            }
            CommitPrefix1 | CommitPrefix3 => {
                let Tok::Reserved(r) = w.take() else {
                    unreachable!()
                };
                w.push(match r.commit_prefix() {
                    Ok(p) => Tok::Prefix(p),
                    Err(e) => returned(e.into_token(), Tok::Reserved),
                });
            }
            MapPrefix => {
                let Tok::Reserved(r) = w.take() else {
                    unreachable!()
                };
                let Some(Tok::Prefix(p)) = w.tokens.first() else {
                    unreachable!()
                };
                let t = match r.map_prefix(p) {
                    Ok(m) => Tok::Sharer(m),
                    Err(e) => returned(e.into_token(), Tok::Reserved),
                };
                w.push(t);
            }
            Diverge => {
                let Tok::Sharer(m) = w.take() else {
                    unreachable!()
                };
                w.push(match m.diverge() {
                    Ok(d) => Tok::Diverged(d),
                    Err(e) => returned(e.into_token(), Tok::Sharer),
                });
            }
            Grow | GrowFromCache => {
                let Tok::Reserved(r) = w.take() else {
                    unreachable!()
                };
                let n = if self == Grow { 3 } else { 5 };
                let mut region = r.into_region();
                let _ = region.grow(n); // refused or not, the region stays
                w.push(Tok::Region(region));
            }
            Shrink | ShrinkPastCap => {
                let _ = w.last_region().shrink(3);
            }
            Reclaim => {
                let _ = w.last_region().reclaim();
            }
            Suspend | SuspendSaving => {
                let Tok::Committed(c) = w.take() else {
                    unreachable!()
                };
                let asleep = if self == Suspend {
                    c.suspend()
                } else {
                    c.suspend_saving()
                };
                w.push(match asleep {
                    Ok(a) => Tok::Asleep(a),
                    Err(e) => Tok::Committed(e.into_token()),
                });
            }
            SuspendRegion | SuspendRegionSaving => {
                let Tok::Region(r) = w.take() else {
                    unreachable!()
                };
                let asleep = if self == SuspendRegion {
                    r.suspend()
                } else {
                    r.suspend_saving()
                };
                w.push(match asleep {
                    Ok(a) => Tok::AsleepRegion(a),
                    Err(e) => Tok::Region(e.into_token()),
                });
            }
            Resume | ResumeSaved | ResumeWithheld => {
                let Tok::Asleep(a) = w.take() else {
                    unreachable!()
                };
                w.push(match a.resume() {
                    Ok(c) => Tok::Committed(c),
                    Err(e) => Tok::Asleep(e.into_token()),
                });
            }
            ResumeRegion | ResumeRegionSaved => {
                let Tok::AsleepRegion(a) = w.take() else {
                    unreachable!()
                };
                w.push(match a.resume() {
                    Ok(r) => Tok::Region(r),
                    Err(e) => Tok::AsleepRegion(e.into_token()),
                });
            }
            Retry => {
                let Tok::Quarantined(q) = w.take() else {
                    unreachable!()
                };
                if let Err(e) = q.retry() {
                    w.push(Tok::Quarantined(e.into_token()));
                }
            }
            Poll => {
                w.device.poll();
            }
            RetryQuarantine => {
                w.device.retry_quarantine();
            }
            TrimCache => {
                w.device.trim_cache();
            }
            SetCacheCap => w.device.set_cache_cap(g as u64),
            KvMap | KvFence | KvShrink => {
                let _ = w.cache.replenish();
            }
            Export => {
                let Some(Tok::Exportable(p)) = w.tokens.last() else {
                    unreachable!()
                };
                if let Some(export) = E::export(p) {
                    w.push(Tok::Export { _export: export });
                }
            }
            Import => {
                let offer = w.offer.take().expect("an offer");
                if let Some(imported) = E::import(w.sharer, offer) {
                    w.push(Tok::Imported(imported));
                }
            }
            Bind => {
                if let Ok(binding) = w.device.bind(Budget::unlimited()) {
                    drop(binding);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One case
// ---------------------------------------------------------------------------------------------

/// What one run of a scenario did.
#[derive(Debug, Default)]
struct Outcome {
    /// Calls of each kind (in [`Op::ALL`]'s order) that the operation made.
    calls: [u64; Op::ALL.len()],
    /// The message of the panic that reached the caller, if one did.
    panic: Option<String>,
    /// The message the planned panic has, if it fires.
    expected: Option<String>,
    failures: Vec<String>,
}

fn calls(faults: &FaultHandle) -> [u64; Op::ALL.len()] {
    Op::ALL.map(|op| faults.calls(op))
}

fn index(op: Op) -> usize {
    Op::ALL.iter().position(|&o| o == op).expect("every op")
}

/// A panic's message.
fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else {
        "a panic with no message".to_string()
    }
}

/// Runs scenario `s` on a fresh device over backend `E`, with the planned panic if any.
fn run_case<E: Env>(s: Scenario, plan: Option<(Op, u64)>) -> Outcome {
    let mut out = Outcome::default();
    let (env, inner) = E::make(s.manual_fences());
    let backend = Faulty::new(inner);
    let faults = backend.handle();
    let whole = catch(|| {
        make_guard!(guard);
        let device = Device::new(guard, backend);
        let g = device.granularity() as u64;
        let owner = device.bind(Budget::bytes(64 * g)).expect("a binding");
        let sharer = device.bind(Budget::bytes(64 * g)).expect("a binding");
        // `exercise` clears the plan: nothing may panic in the teardown.
        make_guard!(cache_guard);
        let layout = kv_layout(device.granularity());
        let cache = KvCache::new(cache_guard, &owner, &layout).expect("a KV cache");
        let teardown = in_world(&env, &device, &owner, &sharer, &faults, cache, |w| {
            exercise(w, s, plan, &mut out);
        });
        out.failures
            .extend(teardown.into_iter().flat_map(Teardown::failures));
        if let Err(e) = settle(&env, &device, [&owner, &sharer], &faults) {
            out.failures.push(format!("in the end: {e}"));
        }
        drop((owner, sharer));
        let failed_unpins = device.failed_unpins();
        let pins = faults.outstanding().pins;
        if pins != failed_unpins {
            let e = format!("pins once the bindings are gone [{pins} vs {failed_unpins}]");
            out.failures.push(format!("in the end: {e}"));
        }
        drop(device);
    });
    match whole {
        Err(p) => out.failures.push(format!(
            "in the end: panicked while giving everything back: {p}"
        )),
        Ok(()) => {
            if let Err(e) = env.after_close() {
                out.failures.push(format!("in the end: {e}"));
            }
        }
    }
    out
}

/// The case proper: the tokens of the scenario, the operation, the checks.
fn exercise<E: Env>(
    w: &mut World<'_, '_, '_, '_, E>,
    s: Scenario,
    plan: Option<(Op, u64)>,
    out: &mut Outcome,
) {
    let faults = w.faults;
    if let Err(p) = catch(|| s.setup(w)) {
        out.failures
            .push(format!("setup panicked (a harness bug): {p}"));
    } else if let Err(e) = w.check() {
        out.failures
            .push(format!("after setup (a harness bug): {e}"));
    } else {
        let before = calls(faults);
        if let Some((op, n)) = plan {
            faults.panic_nth(op, n);
            let nth = before[index(op)] + n;
            out.expected = Some(format!("{INJECTED}{op:?} call #{nth}"));
        }
        let result = catch(|| s.run(w));
        faults.clear();
        let after = calls(faults);
        for (i, c) in out.calls.iter_mut().enumerate() {
            *c = after[i] - before[i];
        }
        out.panic = result.err();
        if let Err(e) = w.check() {
            out.failures.push(format!("right after: {e}"));
        }
    }
}

/// The KV cache of a world: one plane, four blocks a granule (a group), 16 groups.
fn kv_layout(g: usize) -> Layout {
    Layout::new(64, 16).plane(g / 4)
}

/// A world around `cache`, handed to `body`; then every token and table dropped, and the cache:
/// those two stages of the teardown. A plan `body` leaves armed stays armed through them.
fn in_world<'c, 'b, 'id, E: Env>(
    env: &E,
    device: &'b Device<'id, Fy<E>>,
    owner: &'b Binding<'b, 'id, Fy<E>>,
    sharer: &'b Binding<'b, 'id, Fy<E>>,
    faults: &FaultHandle,
    cache: KvCache<'c, 'b, 'id, Fy<E>>,
    body: impl FnOnce(&mut World<'_, 'c, 'b, 'id, E>),
) -> [Teardown; 2] {
    let mut w = World {
        env,
        device,
        owner,
        sharer,
        faults,
        cache: &cache,
        tokens: Vec::new(),
        table: None,
        offer: None,
    };
    body(&mut w);
    let tokens = Teardown::run(faults, "dropping the tokens", || w.drop_all());
    drop(w);
    let cache = Teardown::run(faults, "dropping the KV cache", move || {
        catch(move || drop(cache)).err().into_iter().collect()
    });
    [tokens, cache]
}

/// What is wrong with a case that planned the `n`th call of kind `op` to panic, the
/// operation making `made` such calls in its dry run.
fn judge(o: &Outcome, op: Op, n: u64, made: u64) -> Vec<String> {
    let mut failures = Vec::new();
    let fires = n <= made;
    match (&o.panic, fires) {
        (None, true) => failures.push(format!(
            "the planned panic did not reach the caller (the operation returned) [{op:?} #{n}]"
        )),
        (Some(m), true) if Some(m) != o.expected.as_ref() => {
            failures.push(format!("another panic reached the caller: {m}"));
        }
        (Some(m), false) => failures.push(format!(
            "a panic reached the caller though the planned call is never made: {m}"
        )),
        _ => {}
    }
    if !fires && o.calls[index(op)] != made {
        failures.push(format!(
            "the operation made another number of {op:?} calls than in its dry run [{} vs {made}]",
            o.calls[index(op)]
        ));
    }
    failures.extend(o.failures.iter().cloned());
    failures
}

// ---------------------------------------------------------------------------------------------
// A panic at any call of one long scenario
// ---------------------------------------------------------------------------------------------

/// The long scenario's steps once the device and its two bindings are made, in order. Each
/// keeps what it makes in the world at once, so that what a panic stops is dropped after it.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// An allocation reserved, committed and written.
    Commit,
    /// The allocation suspended, saving its bytes, and resumed.
    Sleep,
    /// A prefix made, and mapped by the sharer.
    Share,
    /// The sharer's mapping diverged: its last granule copied on write.
    Diverge,
    /// A region grown by 3 granules, shrunk by 2 (into the cache), grown by 1 (from it).
    Grow,
    /// The region suspended and resumed.
    SleepRegion,
    /// An exportable prefix made, exported, offered, and imported by the sharer.
    Export,
    /// Groups of the KV cache mapped, blocks taken into a table, written, given back; the
    /// groups unmapped again.
    Kv,
    /// A third binding made and dropped.
    Bind,
    /// Every token released and its release completed; the export ended.
    Release,
    /// The device polled, its quarantine retried, its cache trimmed.
    Poll,
    /// In place of the two above, where the teardown is armed: more kinds of token left live
    /// for it — a reservation, a release begun, a suspended allocation, a block in a
    /// table.
    Leave,
}

impl Step {
    const ALL: [Step; 12] = {
        use Step::*;
        [
            Commit,
            Sleep,
            Share,
            Diverge,
            Grow,
            SleepRegion,
            Export,
            Kv,
            Bind,
            Release,
            Poll,
            Leave,
        ]
    };

    /// Whether it runs in the variant whose teardown is armed (`in_drops`), which leaves the
    /// tokens live for it, or in the other, which gives them back first.
    fn runs(self, in_drops: bool) -> bool {
        match self {
            Step::Release | Step::Poll => !in_drops,
            Step::Leave => in_drops,
            _ => true,
        }
    }

    fn run<E: Env>(self, w: &mut World<'_, '_, '_, '_, E>) {
        match self {
            Step::Commit => {
                let mut a = w.commit(2);
                E::write(&mut a);
                w.push(Tok::Committed(a));
            }
            Step::Sleep => {
                let Tok::Committed(a) = w.take() else {
                    unreachable!()
                };
                let a = a.suspend_saving().map_err(|e| e.cause);
                w.push(Tok::Asleep(a.expect("suspend_saving")));
                let Tok::Asleep(a) = w.take() else {
                    unreachable!()
                };
                let a = a.resume().map_err(|e| e.cause);
                w.push(Tok::Committed(a.expect("resume")));
            }
            Step::Share => {
                w.push(Tok::Prefix(w.prefix(3)));
                let Some(Tok::Prefix(p)) = w.tokens.last() else {
                    unreachable!()
                };
                let m = w.share(p);
                w.push(Tok::Sharer(m));
            }
            Step::Diverge => {
                let Tok::Sharer(m) = w.take() else {
                    unreachable!()
                };
                let d = m.diverge().map_err(|e| e.cause);
                w.push(Tok::Diverged(d.expect("diverge")));
            }
            Step::Grow => {
                w.push(Tok::Region(w.reserve(w.owner, 8).into_region()));
                let r = w.last_region();
                r.grow(3).expect("grow");
                r.shrink(2).expect("shrink");
                r.grow(1).expect("grow");
            }
            Step::SleepRegion => {
                let Tok::Region(r) = w.take() else {
                    unreachable!()
                };
                let r = r.suspend().map_err(|e| e.cause);
                w.push(Tok::AsleepRegion(r.expect("suspend")));
                let Tok::AsleepRegion(r) = w.take() else {
                    unreachable!()
                };
                let r = r.resume().map_err(|e| e.cause);
                w.push(Tok::Region(r.expect("resume")));
            }
            Step::Export => {
                w.push(Tok::Exportable(w.exportable(2)));
                let Some(Tok::Exportable(p)) = w.tokens.last() else {
                    unreachable!()
                };
                w.offer = Some(E::offer(p));
                let export = E::export(p).expect("an export");
                w.push(Tok::Export { _export: export });
                let offer = w.offer.take().expect("an offer");
                let imported = E::import(w.sharer, offer).expect("an import");
                w.push(Tok::Imported(imported));
            }
            Step::Kv => {
                let cache = w.cache;
                cache.set_watermarks(2, 3);
                cache.replenish().expect("a replenish");
                let table = w.table.insert(cache.table());
                for _ in 0..5 {
                    cache.push(table).expect("a block");
                }
                table.write(0, 4, 0, &[7; 8]).expect("a write");
                cache.clear(table);
                cache.set_watermarks(0, 0);
                cache.replenish().expect("a replenish");
            }
            Step::Bind => drop(w.device.bind(Budget::unlimited()).expect("a binding")),
            Step::Release => {
                let g = w.g();
                for _ in 0..w.tokens.len() {
                    let Tok::Releasing(a, h) = (match w.take() {
                        Tok::Export { .. } => continue, // dropped: the export ends
                        t => t.release(g),
                    }) else {
                        unreachable!()
                    };
                    if let Err(e) = a.complete() {
                        // Pending: kept (first, so that each token is taken once).
                        let t = returned(e.into_token(), |a| Tok::Releasing(a, h));
                        w.tokens.insert(0, t);
                    }
                }
            }
            Step::Poll => {
                w.device.poll();
                w.device.retry_quarantine();
                w.device.trim_cache();
            }
            Step::Leave => {
                let g = w.g();
                w.push(Tok::Reserved(w.reserve(w.owner, 1)));
                w.push(Tok::Committed(w.commit(1)).release(g));
                let a = w.commit(1).suspend().map_err(|e| e.cause);
                w.push(Tok::Asleep(a.expect("suspend")));
                let cache = w.cache;
                cache.set_watermarks(1, 2);
                cache.replenish().expect("a replenish");
                let table = w.table.insert(cache.table());
                cache.push(table).expect("a block");
            }
        }
    }
}

/// What one run of the long scenario did.
#[derive(Debug, Default)]
struct Run {
    /// Whether the plan stays armed through the teardown, whose stages count as the scenario's
    /// (the second variant: see [`any_call_case`]).
    in_drops: bool,
    /// Each stage begun, with the number of calls made before it.
    stages: Vec<(u64, String)>,
    /// Calls made by the end of the scenario (of the teardown, `in_drops`), or by where a panic
    /// stopped it.
    calls: u64,
    /// The message of the panic that stopped the scenario (or, `in_drops`, of the first panic
    /// caught in the teardown).
    panic: Option<String>,
    /// The stage that `panic` surfaced from, as in `stages`.
    surfaced: Option<(u64, String)>,
    failures: Vec<String>,
}

impl Run {
    /// Runs stage `name` unless a panic stopped the scenario: what it returns, if it returns.
    fn stage<R>(&mut self, faults: &FaultHandle, name: &str, f: impl FnOnce() -> R) -> Option<R> {
        if self.panic.is_some() {
            return None;
        }
        self.stages.push((faults.any_calls(), name.to_string()));
        let result = catch(f);
        self.calls = faults.any_calls();
        result.map_err(|p| self.caught(p)).ok()
    }

    /// The panic that stopped the run, which surfaced from the last stage begun.
    fn caught(&mut self, panic: String) {
        self.panic = Some(panic);
        self.surfaced = self.stages.last().cloned();
    }

    /// Takes in teardown stage `t`, just run. `in_drops`: a stage as the scenario's, whose
    /// first panic is the run's unless one stopped the scenario; else no panic is expected in
    /// it.
    fn teardown(&mut self, faults: &FaultHandle, t: Teardown) {
        if !self.in_drops {
            self.failures.extend(t.failures());
            return;
        }
        self.stages.push((t.before, t.name.to_string()));
        self.calls = faults.any_calls();
        let mut panics = t.panics.into_iter();
        if self.panic.is_none()
            && let Some(p) = panics.next()
        {
            self.caught(p);
        }
        let name = t.name;
        let again = panics.map(|p| format!("{name} panicked again: {p}"));
        self.failures.extend(again);
    }

    /// The stage that makes call #`n`, as a dry run tells.
    fn stage_at(&self, n: u64) -> Option<&(u64, String)> {
        let stage = self.stages.iter().rev().find(|(before, _)| *before < n);
        stage.filter(|_| n <= self.calls)
    }

    /// The name of [`stage_at`](Self::stage_at).
    fn stage_of(&self, n: u64) -> &str {
        self.stage_at(n).map_or("past the end", |(_, name)| name)
    }
}

/// The start of the message of the panic injected into call #`n`.
fn injected_at(n: u64) -> String {
    format!("{INJECTED}call #{n} of any kind (")
}

/// Runs the long scenario on a fresh device over backend `E`, its call #`n` of any kind
/// planned to panic (before the device is made, so that calls #1 to #4 are its getters); checks
/// the invariants where it stopped ([`World::check`]); then, the faults cleared, drops every
/// token, the KV cache and the bindings, and closes the device: it must close clean, and leave
/// nothing in the backend.
///
/// `in_drops`: the releases and the poll are skipped, more tokens left live ([`Step::Leave`]),
/// and the plan stays armed through the teardown, each of whose stages (the tokens'
/// drops, the KV cache's, the bindings', the close) is a stage of the run, calls counted; a panic
/// in one is the run's panic. A panic at one of `close`'s own calls resumes from `close`,
/// which then returns no report (the device's `Drop`, which runs as `close` returns, still
/// finishes the work): so every report `close` returns must be clean, in either variant.
fn any_call_case<E: Env>(plan: Option<u64>, in_drops: bool) -> Run {
    let mut run = Run {
        in_drops,
        ..Run::default()
    };
    let (env, inner) = E::make(false);
    let backend = Faulty::new(inner);
    let faults = backend.handle();
    if let Some(n) = plan {
        faults.panic_at_call(n);
    }
    let mut failed_unpins = 0;
    make_guard!(guard);
    if let Some(device) = run.stage(&faults, "Device::new", move || Device::new(guard, backend)) {
        let bind = || device.bind(Budget::unlimited()).expect("a binding");
        let owner = run.stage(&faults, "bind", bind);
        let sharer = run.stage(&faults, "bind", bind);
        make_guard!(cache_guard);
        let cache = match &owner {
            Some(owner) if sharer.is_some() => run.stage(&faults, "KvCache::new", || {
                let layout = kv_layout(device.granularity());
                KvCache::new(cache_guard, owner, &layout).expect("a KV cache")
            }),
            _ => None,
        };
        if let (Some(owner), Some(sharer), Some(cache)) = (&owner, &sharer, cache) {
            let steps = Step::ALL.into_iter().filter(|s| s.runs(in_drops));
            let teardown = in_world(&env, &device, owner, sharer, &faults, cache, |w| {
                for step in steps {
                    run.stage(&faults, &format!("{step:?}"), || step.run(w));
                }
                if let Err(e) = w.check() {
                    run.failures.push(format!("right after: {e}"));
                }
                if !in_drops {
                    faults.clear();
                }
            });
            for t in teardown {
                run.teardown(&faults, t);
            }
        }
        if !in_drops {
            faults.clear();
        }
        let bindings = Teardown::run(&faults, "dropping the bindings", move || {
            catch(move || drop((owner, sharer)))
                .err()
                .into_iter()
                .collect()
        });
        run.teardown(&faults, bindings);
        failed_unpins = device.failed_unpins();
        let mut report = None;
        let close = Teardown::run(&faults, "closing the device", || {
            catch(|| report = Some(device.close()))
                .err()
                .into_iter()
                .collect()
        });
        run.teardown(&faults, close);
        if let Some(report) = report.filter(|r| !r.is_clean()) {
            run.failures
                .push(format!("the device closed unclean [{report:?}]"));
        }
    }
    let left = faults.outstanding();
    if !left.is_zero() {
        run.failures.push(format!(
            "the backend still holds something once the device is gone [{left:?}; failed \
             unpins before the close: {failed_unpins}]"
        ));
    }
    if let Err(e) = env.after_close() {
        run.failures.push(e);
    }
    run
}

/// What is wrong with a run whose call #`n` was planned to panic, as compared with its dry
/// run; each failure after the panic names the kind of the call that panicked.
fn judge_any(run: &Run, n: u64, dry: &Run) -> Vec<String> {
    let (injected, made) = (injected_at(n), dry.calls);
    let mut failures = Vec::new();
    match (&run.panic, n <= made) {
        (None, true) => failures.push(format!(
            "the planned panic did not reach the caller (the run went to its end) [call #{n}]"
        )),
        (Some(m), true) if !m.starts_with(&injected) => {
            failures.push(format!("another panic reached the caller: {m}"));
        }
        (Some(_), true) if run.surfaced.as_ref() != dry.stage_at(n) => {
            failures.push(format!(
                "the planned panic surfaced from another stage than the one making the call \
                 [{:?} vs {:?}]",
                run.surfaced,
                dry.stage_at(n)
            ));
        }
        (Some(m), false) => failures.push(format!(
            "a panic reached the caller though the planned call is never made: {m}"
        )),
        _ => {}
    }
    if n > made && run.calls != made {
        failures.push(format!(
            "the scenario made another number of calls than in its dry run [{} vs {made}]",
            run.calls
        ));
    }
    let kind = run.panic.as_deref().and_then(|m| m.strip_prefix(&injected));
    let kind = kind.map(|k| k.trim_end_matches(')').trim_matches('"'));
    failures.extend(run.failures.iter().map(|f| match kind {
        Some(kind) => format!("a {kind} call panicked, then: {f}"),
        None => f.clone(),
    }));
    failures
}

/// Runs the long scenario's cases on backend `E` from case `from` on, as [`child`] does: a dry
/// run, then one case for each call it makes, and one past them; `IN_DROPS`: the variant that
/// keeps the plan armed through the teardown (see [`any_call_case`]).
fn any_call_child<E: Env, const IN_DROPS: bool>(from: usize) {
    silence_injected_panics();
    let name = if IN_DROPS {
        "the long scenario, unreleased, armed through its teardown"
    } else {
        "the long scenario"
    };
    let dry = any_call_case::<E>(None, IN_DROPS);
    let mut failures = dry.failures.clone();
    if let Some(p) = &dry.panic {
        failures.push(format!("the scenario panicked with nothing planned: {p}"));
    }
    let ends = dry.stages.iter().skip(1).map(|s| s.0).chain([dry.calls]);
    let stages: Vec<String> = (dry.stages.iter().zip(ends))
        .map(|((before, stage), end)| format!("{stage} #{}..{end}", before + 1))
        .collect();
    let (made, total) = (stages.join(", "), dry.calls.to_string());
    let joined = failures.join(&FAILS.to_string());
    emit(&["dry", name, &made, &total, &joined], false);
    for n in 1..=dry.calls + 1 {
        let id = (n - 1) as usize;
        if id < from {
            continue;
        }
        let (id, n_str) = (id.to_string(), n.to_string());
        emit(&["start", &id, name, dry.stage_of(n), &n_str], true);
        let run = any_call_case::<E>(Some(n), IN_DROPS);
        let fired = run
            .panic
            .as_deref()
            .is_some_and(|m| m.starts_with(&injected_at(n)));
        let joined = judge_any(&run, n, &dry).join(&FAILS.to_string());
        emit(
            &["done", &id, if fired { "1" } else { "0" }, &joined],
            false,
        );
    }
    emit(&["end"], false);
}

// ---------------------------------------------------------------------------------------------
// The child: runs the cases, one line each
// ---------------------------------------------------------------------------------------------

thread_local! {
    /// Whether a panic is unwinding on this thread, not yet caught by [`catch`].
    static UNWINDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, catching a panic: its message.
fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    let result = catch_unwind(AssertUnwindSafe(f));
    UNWINDING.set(false);
    result.map_err(|p| message(&*p))
}

/// Silences the injected panics' messages (expected by the thousand); every other panic goes
/// to the default hook, so real failures stay visible — except that a panic while another
/// unwinds (which aborts the process) is told in two lines, without the full backtrace that the
/// default hook forces on it (symbolizing it takes longer than all the cases).
fn silence_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let again = UNWINDING.replace(true);
            let message = message(info.payload());
            if again {
                let at = info.location().map(ToString::to_string);
                let at = at.unwrap_or_else(|| "an unknown place".to_string());
                eprintln!("a panic while unwinding panicked at {at}:\n{message}");
            } else if !message.starts_with(INJECTED) {
                default(info);
            }
        }));
    });
}

/// One line of the protocol: no newline and no separator inside a field.
fn line(fields: &[&str]) -> String {
    let clean = |f: &str| f.replace(['\n', SEP], " / ");
    let fields: Vec<String> = fields.iter().map(|f| clean(f)).collect();
    format!("{MARK}{SEP}{}\n", fields.join(&SEP.to_string()))
}

/// Writes one line of the protocol on stdout, and on stderr too if `also_stderr` (where an
/// abort's messages land after it).
fn emit(fields: &[&str], also_stderr: bool) {
    let l = line(fields);
    let mut stdout = std::io::stdout();
    stdout.write_all(l.as_bytes()).expect("stdout");
    stdout.flush().expect("stdout");
    if also_stderr {
        std::io::stderr().write_all(l.as_bytes()).expect("stderr");
    }
}

/// Runs every case of backend `E` from case `from` on, reporting each on stdout (and marking
/// its start on stderr too, where an abort's messages land).
fn child<E: Env>(from: usize) {
    silence_injected_panics();
    let mut next = 0usize;
    for s in Scenario::ALL.into_iter().filter(|s| s.runs_on::<E>()) {
        let dry = run_case::<E>(s, None);
        let mut failures = dry.failures.clone();
        if let Some(p) = &dry.panic {
            failures.push(format!("the operation panicked with nothing planned: {p}"));
        }
        if dry.calls.iter().sum::<u64>() == 0 {
            failures.push("the operation makes no backend call: nothing to test".to_string());
        }
        let made: Vec<String> = Op::ALL
            .iter()
            .zip(dry.calls)
            .filter(|&(_, c)| c > 0)
            .map(|(op, c)| format!("{op:?}×{c}"))
            .collect();
        let total = dry.calls.iter().sum::<u64>().to_string();
        let name = format!("{s:?}");
        let joined = failures.join(&FAILS.to_string());
        emit(&["dry", &name, &made.join(" "), &total, &joined], false);
        for op in Op::ALL {
            let made = dry.calls[index(op)];
            for n in 1..=made + 1 {
                let id = next;
                next += 1;
                if id < from {
                    continue;
                }
                let (id, op_name, n_str) = (id.to_string(), format!("{op:?}"), n.to_string());
                emit(&["start", &id, &name, &op_name, &n_str], true);
                let o = run_case::<E>(s, Some((op, n)));
                let failures = judge(&o, op, n, made);
                let fired = if o.panic.is_some() && o.panic == o.expected {
                    "1"
                } else {
                    "0"
                };
                let joined = failures.join(&FAILS.to_string());
                emit(&["done", &id, fired, &joined], false);
            }
        }
    }
    emit(&["end"], false);
}

// ---------------------------------------------------------------------------------------------
// The parent: runs the child until every case is done, and reports
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Case {
    scenario: String,
    op: String,
    n: u64,
    fired: bool,
    done: bool,
    failures: Vec<String>,
}

#[derive(Debug, Default)]
struct Report {
    /// Each scenario's dry-run calls (told, and counted), and its dry run's failures.
    dry: BTreeMap<String, (String, u64, Vec<String>)>,
    cases: BTreeMap<usize, Case>,
    ended: bool,
}

impl Report {
    fn read(&mut self, stdout: &str) {
        let mark = format!("{MARK}{SEP}");
        for l in stdout.lines() {
            // The first line follows libtest's `test … ` on the same line.
            let Some((_, l)) = l.split_once(&mark) else {
                continue;
            };
            let fields: Vec<&str> = l.split(SEP).collect();
            let failures = |f: &str| -> Vec<String> {
                f.split(FAILS)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            };
            match fields.as_slice() {
                ["dry", name, made, total, fails] => {
                    let total = total.parse().unwrap_or(0);
                    let dry = (made.to_string(), total, failures(fails));
                    self.dry.insert(name.to_string(), dry);
                }
                ["start", id, scenario, op, n] => {
                    let case = Case {
                        scenario: scenario.to_string(),
                        op: op.to_string(),
                        n: n.parse().unwrap_or(0),
                        ..Case::default()
                    };
                    self.cases.insert(id.parse().unwrap_or(usize::MAX), case);
                }
                ["done", id, fired, fails] => {
                    if let Some(case) = self.cases.get_mut(&id.parse().unwrap_or(usize::MAX)) {
                        case.done = true;
                        case.fired = *fired == "1";
                        case.failures = failures(fails);
                    }
                }
                ["end"] => self.ended = true,
                _ => {}
            }
        }
    }

    /// The summary: one line per scenario × op × distinct failure, and each scenario's calls
    /// and fired panics.
    fn summary(&self) -> (Vec<String>, Vec<String>) {
        let mut grouped: BTreeMap<(String, String, String), (Vec<u64>, String)> = BTreeMap::new();
        for (name, (_, _, fails)) in &self.dry {
            for f in fails {
                let key = (name.clone(), "dry run".to_string(), normalize(f));
                grouped.entry(key).or_insert_with(|| (vec![], f.clone()));
            }
        }
        for case in self.cases.values() {
            for f in &case.failures {
                let key = (case.scenario.clone(), case.op.clone(), normalize(f));
                let entry = grouped.entry(key).or_insert_with(|| (vec![], f.clone()));
                entry.0.push(case.n);
            }
        }
        let failures = grouped
            .into_iter()
            .map(|((scenario, op, _), (ns, example))| {
                let ns: Vec<String> = ns.iter().map(u64::to_string).collect();
                format!("{scenario} × {op} n={{{}}}: {example}", ns.join(","))
            })
            .collect();
        let mut table = Vec::new();
        for (name, (made, total, _)) in &self.dry {
            let cases: Vec<&Case> = self
                .cases
                .values()
                .filter(|c| &c.scenario == name)
                .collect();
            let fired = cases.iter().filter(|c| c.fired).count();
            table.push(format!(
                "{name}: calls {made}; {} cases, the planned panic fired in {fired} (calls made: {total})",
                cases.len()
            ));
        }
        (failures, table)
    }
}

/// A failure's message without its numbers, to group equal failures.
fn normalize(f: &str) -> String {
    let head = f.split(" [").next().unwrap_or(f);
    head.chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect()
}

/// The panic messages on the child's stderr after the start of case `id`.
fn abort_messages(stderr: &str, id: usize) -> String {
    let marker = line(&["start", &id.to_string()]);
    let marker = marker.trim_end();
    let tail = stderr.rsplit_once(marker).map_or(stderr, |(_, t)| t);
    let mut messages = Vec::new();
    let mut lines = tail.lines();
    while let Some(l) = lines.next() {
        if l.contains(" panicked at ")
            && let Some(m) = lines.next()
        {
            messages.push(m.trim().to_string());
        }
    }
    if messages.is_empty() {
        "no panic message".to_string()
    } else {
        messages.join("; then ")
    }
}

/// Runs test `test`'s cases in child processes (again after each abort) and fails with the
/// list of failing cases; `tell`: prints each scenario's calls and fired panics either way.
fn parent(test: &str, tell: bool) {
    let exe = std::env::current_exe().expect("this test binary");
    let mut report = Report::default();
    let mut from = 0;
    loop {
        let output = Command::new(&exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, test)
            .env(FROM_ENV, from.to_string())
            .env_remove(REPORT_ENV)
            // The parent reports each panic's message; backtraces would only slow the child.
            .env("RUST_BACKTRACE", "0")
            .output()
            .expect("run this test binary as a child");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        report.read(&stdout);
        if report.ended && output.status.success() {
            break;
        }
        let aborted = report
            .cases
            .iter_mut()
            .filter(|(id, c)| **id >= from && !c.done)
            .last();
        let Some((&id, case)) = aborted else {
            panic!(
                "the child running {test} failed outside any case ({}):\n{stderr}",
                output.status
            );
        };
        case.done = true;
        case.failures.push(format!(
            "the process aborted (a panic while unwinding): {}",
            abort_messages(&stderr, id)
        ));
        from = id + 1;
    }
    let (failures, table) = report.summary();
    if tell || std::env::var_os(REPORT_ENV).is_some() {
        eprintln!("{test}:\n  {}", table.join("\n  "));
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed on {test}:\n  {}\n\nPer scenario:\n  {}",
        report
            .cases
            .values()
            .filter(|c| !c.failures.is_empty())
            .count(),
        report.cases.len(),
        failures.join("\n  "),
        table.join("\n  ")
    );
    assert!(
        !report.cases.is_empty(),
        "no case ran on {test}: the harness tests nothing"
    );
}

/// The body of test `name`: its cases (`child`, from the case it is told) in a child process,
/// the parent elsewhere; `tell` as for [`parent`].
fn test(name: &str, child: fn(usize), tell: bool) {
    match std::env::var(CHILD_ENV) {
        Ok(running) if running == name => {
            let from = std::env::var(FROM_ENV)
                .ok()
                .and_then(|f| f.parse().ok())
                .unwrap_or(0);
            child(from);
        }
        // A child of another test: not this one's to run.
        Ok(_) => {}
        Err(_) => parent(name, tell),
    }
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn unwind_sim() {
    test("unwind_sim", child::<Sim>, false);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn unwind_host() {
    test("unwind_host", child::<Host>, false);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn unwind_cuda_model() {
    test("unwind_cuda_model", child::<Cuda>, false);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn any_call_host() {
    test("any_call_host", any_call_child::<Host, false>, true);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn any_call_cuda_model() {
    test("any_call_cuda_model", any_call_child::<Cuda, false>, true);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn any_call_in_drops_host() {
    test("any_call_in_drops_host", any_call_child::<Host, true>, true);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn any_call_in_drops_cuda_model() {
    test(
        "any_call_in_drops_cuda_model",
        any_call_child::<Cuda, true>,
        true,
    );
}
