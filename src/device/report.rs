//! What a device tells about itself: the progress of a poll or a retry ([`Progress`]), what it
//! holds in its custody ([`Custody`]), what was forgotten ([`Forgotten`]) and what it held
//! when it closed ([`CloseReport`]) — and how each is read off the device.

use super::Device;
use crate::backend::{Backend, lock};
use crate::ledger::LedgerSnapshot;
use crate::residual::Holdings;
use std::sync::atomic::Ordering;

/// Which queue of the custody a residual is (or, being torn down, came from).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Queue {
    Quarantine,
    Deferred,
}

/// What [`Device::retry_quarantine`] and [`Device::poll`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Residuals fully released by this call.
    pub released: usize,
    /// Residuals still quarantined in the device after it.
    pub quarantined: usize,
    /// Releases still waiting for their fence after it.
    pub deferred: usize,
}

/// What a device holds in its own custody (see [`Device::custody`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Custody {
    /// Residuals in the device's quarantine.
    pub quarantined: Holdings,
    /// Releases waiting for their fence.
    pub deferred: Holdings,
    /// Shared physical memory (mapped by several tokens): `count` prefixes, their
    /// `owned_bytes` (each charged once, whatever the number of mappings), and the references
    /// on them (`shared_refs`). A prefix's memory (one or two physical allocations) is released
    /// when its last reference goes.
    pub shared: Holdings,
}

/// What was forgotten (`mem::forget`, or leaked) and never given back to a device, beyond the
/// bytes its ledger shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// Bindings never dropped. Each still held its context pin, which the device releases as it
    /// drops (a binding borrows its device, so none can be alive by then).
    pub bindings: u64,
    /// Blocks of a [`KvCache`](crate::kv::KvCache) never given back before the cache dropped
    /// (a block table, or a prefix cache, forgotten); their memory went with the cache's
    /// planes. Blocks lent to a transfer engine are not among them: they are withheld for a
    /// peer ([`CloseReport::withheld_for_peers`]).
    pub blocks: u64,
}

impl Forgotten {
    /// True when nothing was forgotten.
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// What a device held when it closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloseReport {
    /// The ledger after a last poll and retry. Non-zero bytes not explained by `progress`
    /// mean a token was forgotten (`mem::forget`): its bytes were never refunded.
    pub ledger: LedgerSnapshot,
    /// What the last poll and retry left.
    pub progress: Progress,
    /// Bindings and KV blocks forgotten, which hold no bytes of the ledger.
    pub forgotten: Forgotten,
    /// Memory withheld for good because a peer it was exposed to never said it was done with
    /// it, and which peer (counted in the ledger's `quarantined` too).
    pub withheld_for_peers: Vec<crate::device::WithheldForPeer>,
}

impl CloseReport {
    /// True when the device closed with nothing outstanding and nothing forgotten.
    pub fn is_clean(&self) -> bool {
        self.ledger.is_zero() && self.progress.deferred == 0 && self.forgotten.is_zero()
    }
}

/// What a device left behind as it dropped, handed to the sink of
/// [`Device::report_drop_to`] (or, with no sink, written as one line to standard error when
/// something was left): memory that stays with the driver until the process ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropReport {
    /// Releases whose work was never known to have finished — their fence could not be
    /// waited for (a covered stream still captured a CUDA graph, or a wait failed) — left to
    /// the driver rather than freed under that work.
    pub left_waiting: Holdings,
    /// Residuals still quarantined after a last retry (a teardown that keeps failing, or
    /// memory a graph memtoken does not know of may still use).
    pub quarantined: Holdings,
}

impl DropReport {
    /// True when nothing was left behind.
    pub fn is_clean(&self) -> bool {
        self.left_waiting.count == 0 && self.quarantined.count == 0
    }
}

impl std::fmt::Display for DropReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (w, q) = (&self.left_waiting, &self.quarantined);
        write!(
            f,
            "{} release(s) whose work never finished ({} bytes mapped, {} owned) and {} \
             quarantined residual(s) ({} bytes mapped, {} owned) left to the driver",
            w.count, w.mapped_bytes, w.owned_bytes, q.count, q.mapped_bytes, q.owned_bytes
        )
    }
}

/// Where a dropping device reports what it left behind.
pub(super) type DropSink = Box<dyn FnOnce(&DropReport) + Send>;

impl<B: Backend> Device<'_, B> {
    /// Hands what this device leaves behind as it drops to `sink`, called once from its
    /// `Drop`, clean or not (replacing any sink set before). Without a sink, a device that
    /// leaves something behind says so in one line on standard error — never silently.
    /// [`close`](Self::close) reports what is left before the drop's last waits.
    pub fn report_drop_to(&self, sink: impl FnOnce(&DropReport) + Send + 'static) {
        *lock(&self.drop_sink) = Some(Box::new(sink));
    }

    /// What the device holds in its own custody: residuals quarantined after a dropped
    /// token's teardown failed, and releases waiting for their fence. A residual that a poll or
    /// a retry on another thread is tearing down right now is counted where it came from, with
    /// what it held when it was taken out: a reading never under-reports.
    pub fn custody(&self) -> Custody {
        let (quarantined, deferred) = {
            let books = lock(&self.books);
            (
                books.holdings(Queue::Quarantine),
                books.holdings(Queue::Deferred),
            )
        };
        Custody {
            quarantined,
            deferred,
            shared: self.shared.holdings(),
        }
    }

    /// A last poll and quarantine retry, and what is left: the report of
    /// [`close`](Self::close), also made as an unclosed device drops.
    pub(super) fn shutdown(&self) -> CloseReport {
        self.poll();
        self.trim_cache();
        let progress = self.retry_quarantine();
        CloseReport {
            ledger: self.ledger(),
            progress,
            forgotten: Forgotten {
                bindings: self.bindings.load(Ordering::Relaxed),
                blocks: self.forgotten_blocks.load(Ordering::Relaxed),
            },
            withheld_for_peers: self.withheld_for_peers(),
        }
    }

    /// The progress of a poll or a retry that released `released` residuals: what is still
    /// quarantined and deferred, busy residuals counted where they came from.
    pub(super) fn progress(&self, released: usize) -> Progress {
        let books = lock(&self.books);
        Progress {
            released,
            quarantined: books.count(Queue::Quarantine),
            deferred: books.count(Queue::Deferred),
        }
    }
}
