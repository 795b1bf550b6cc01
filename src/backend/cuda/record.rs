//! The record: what a CUDA backend handed out and the driver still holds, and the checks
//! every call passes against it before it reaches the driver (check, prove, apply: the record
//! is checked first, then the `unsafe` call is made, its proof naming the check, and only then
//! is the record changed).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::{CaptureMode, CuError, CuResult, Driver, Event, Stream};
use super::{CudaBackend, CudaPhys};
use crate::backend::Refuse;
use crate::backend::rules::Book;
use crate::backend::{Access, Addr, Backend, BackendError, Cause, Op, Span, Violation, lock};
use std::collections::{HashMap, HashSet};
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

/// What a backend handed out and the driver still holds; behind the backend's one lock.
#[derive(Debug)]
pub(super) struct CudaState {
    /// Physical memory keyed by [`CudaPhys`] (handle and serial), never by the handle alone.
    pub(super) book: Book<CudaPhys>,
    /// Live events this backend created, by the serial their fence names.
    pub(super) events: HashMap<u64, Event>,
    /// Serials of events no fence refers to any more whose destruction failed: retried later.
    pub(super) retired: Vec<u64>,
    /// Mappings whose access could not be set and whose rollback unmap failed too: unmapped
    /// before their range is mapped again or freed, and on drop.
    pub(super) inaccessible: Vec<(u64, usize)>,
    /// Scratch reservations of copy-on-write whose teardown failed: (address, length).
    /// Retried by the next copy and on drop.
    pub(super) scratch: Vec<(u64, usize)>,
    /// Context retains taken by [`Backend::pin`] and not yet given back by [`Backend::unpin`]
    /// (the retain taken when opening is not counted: it is given back on drop).
    pub(super) pins: u64,
    /// Ranges a copy is using while it runs outside the lock, each under a serial of its own:
    /// unmap, free and map refuse them.
    pub(super) busy: Vec<(u64, u64, usize)>,
    /// Copies whose wait failed: not known to have finished, so their busy marks (and their
    /// scratch range, mapped) stay until an event recorded on the legacy stream after them has
    /// completed ([`settle_copies`](CudaBackend::settle_copies)).
    pub(super) unsettled: Vec<Unsettled>,
    /// Live physical memory created exportable as a POSIX descriptor.
    pub(super) exportable: HashSet<CudaPhys>,
    /// Live physical memory imported from a descriptor: mapped read-only, written never.
    pub(super) imported: HashSet<CudaPhys>,
    /// Ranges a view lent to work on a stream while it captured outside memtoken's own
    /// capture: a graph memtoken does not know of may use them whenever it is launched, so
    /// they are never unmapped (unmap refuses them; their tokens' releases quarantine them).
    pub(super) graph_held: Vec<(u64, usize)>,
    /// Ranges lent by a memtoken capture to the work it captures: held (never unmapped) from
    /// the lend until its graph is dropped, or, if the capture ends with no graph, until then
    /// — and for good if the capture is forgotten or ended by someone else. One entry per
    /// lend (a range lent twice is let go twice).
    pub(super) capture_held: Vec<(u64, usize)>,
    /// Executable graphs whose destruction could not be made (the capture mode could not be
    /// relaxed): destroyed at the next one, or as the backend drops.
    pub(super) dead_execs: Vec<super::driver::GraphExec>,
    /// The serial of the event that orders the legacy stream after another (recorded there,
    /// waited on by the legacy stream, recorded again for the next): made once, when first
    /// needed.
    pub(super) handoff: Option<u64>,
    /// Per memory, the streams that used it through views: see
    /// [`order_use`](CudaBackend::order_use). Keyed by a group: a reservation (by its start: a
    /// token's range, or a KV cache's plane), joined by every reservation that maps the same
    /// physical memory at once (a prefix's owner and its sharers), so that uses through any of
    /// them are ordered with the others' and fenced by each one's release.
    pub(super) uses: HashMap<u64, Uses>,
    /// The group of each reservation with uses (see `uses`); it leaves as the reservation is
    /// freed, and the group goes with its last member.
    pub(super) groups: HashMap<Addr, u64>,
    /// Streams every fence covers, the legacy stream first (see
    /// [`cover_stream`](CudaBackend::cover_stream)).
    pub(super) covered: Vec<Stream>,
    /// Streams views may be made for, fenced only where a view used the memory (see
    /// [`know_stream`](CudaBackend::know_stream)).
    pub(super) known: Vec<Stream>,
    /// Live views per stream: a stream is not forgotten while one lives.
    pub(super) views: HashMap<Stream, usize>,
    /// The plain mechanism (fact 59): placed reservations (the driver's address → the
    /// allocation there, freed with the reservation), and the allocations placed and not
    /// released. (Its placeholders are the book's reservations from `PLACEHOLDER_BASE` up.)
    pub(super) placements: HashMap<Addr, CudaPhys>,
    pub(super) placed: HashSet<CudaPhys>,
}

/// The streams that used one reservation's memory through views: its last writer and the
/// readers since (what a new use waits for), and every stream that used it (what its release
/// fences).
#[derive(Debug, Default)]
pub(super) struct Uses {
    pub(super) writer: Option<Stream>,
    pub(super) readers: Vec<Stream>,
    /// Every stream that used it through a view, once each: its release fences them.
    pub(super) touched: Vec<Stream>,
    /// Reservations in the group.
    pub(super) members: usize,
}

/// A copy on the legacy stream whose wait failed (see [`CudaState::unsettled`]).
#[derive(Debug)]
pub(super) struct Unsettled {
    /// A serial taken once the copy had been started: an event created after it is recorded
    /// after the copy, so its completion means the copy's.
    pub(super) after: u64,
    /// The copy's busy marks.
    pub(super) marks: Vec<u64>,
    /// Its scratch range and length, still mapped, if it had one.
    pub(super) scratch: Option<(u64, usize)>,
}

impl CudaState {
    /// Whether the backend may use `stream`: the legacy stream, or one covered or known (whose
    /// owner promised it live until it is forgotten or the backend drops).
    pub(super) fn holds(&self, stream: Stream) -> bool {
        stream == 0 || self.covered.contains(&stream) || self.known.contains(&stream)
    }

    /// The uses group of the memory at `addr`, if any view used it (or memory it shares).
    pub(super) fn uses_key(&self, addr: Addr) -> Option<u64> {
        let reservation = self.book.reservation_of(addr)?;
        self.groups.get(&reservation).copied()
    }

    /// The uses group of the memory at `addr`, made now if it has none; `None` if `addr` is
    /// not reserved.
    pub(super) fn uses_key_or_new(&mut self, addr: Addr) -> Option<u64> {
        let reservation = self.book.reservation_of(addr)?;
        Some(self.join(reservation, None))
    }

    /// Puts `reservation` in group `into` (a new one if `None`), or, if it has one, merges the
    /// two; returns its group. A merge keeps every stream either group knew of: touched, and
    /// the writers and readers (a second writer becomes a reader — a later write waits for
    /// it; a later read, rarely, does not).
    fn join(&mut self, reservation: Addr, into: Option<u64>) -> u64 {
        let own = self.groups.get(&reservation).copied();
        let into = match (own, into) {
            (Some(own), None) => return own,
            (Some(own), Some(into)) if own == into => return own,
            (None, into) => into.unwrap_or_else(|| {
                let key = super::next_serial();
                self.uses.insert(key, Uses::default());
                key
            }),
            (Some(own), Some(into)) => {
                let gone = self.uses.remove(&own).unwrap_or_default();
                let kept = self.uses.entry(into).or_default();
                for t in gone.touched {
                    if !kept.touched.contains(&t) {
                        kept.touched.push(t);
                    }
                }
                let earlier = gone.readers.into_iter().chain(gone.writer);
                for r in earlier {
                    if !kept.readers.contains(&r) && kept.writer != Some(r) {
                        kept.readers.push(r);
                    }
                }
                kept.members += gone.members;
                for group in self.groups.values_mut().filter(|g| **g == own) {
                    *group = into;
                }
                return into;
            }
        };
        self.groups.insert(reservation, into);
        self.uses.entry(into).or_default().members += 1;
        into
    }

    /// `addr` was just mapped with `phys`: its reservation joins the group of every other
    /// reservation mapping `phys` now (a prefix's sharer, its owner's).
    pub(super) fn link_mapping(&mut self, addr: Addr, phys: super::CudaPhys) {
        // Mapped once (almost always): nothing to join, and no scan of the mappings.
        if self.book.maps_of(phys) < 2 {
            return;
        }
        let Some(reservation) = self.book.reservation_of(addr) else {
            return;
        };
        let others: Vec<Addr> = self
            .book
            .mappings_of(phys)
            .into_iter()
            .filter_map(|(at, _, _)| self.book.reservation_of(at))
            .filter(|&r| r != reservation)
            .collect();
        for other in others {
            let group = self.join(other, None);
            self.join(reservation, Some(group));
        }
    }

    /// Enters the free of the reservation at `addr` (just made): the book forgets it, and it
    /// leaves its uses group (a later reservation at the same address starts afresh).
    pub(super) fn free_reservation(&mut self, addr: Addr) {
        self.book.apply_free(addr);
        self.leave_group(addr);
    }

    /// `reservation` was freed: it leaves its group, which goes with its last member.
    fn leave_group(&mut self, reservation: Addr) {
        let Some(key) = self.groups.remove(&reservation) else {
            return;
        };
        if let Some(uses) = self.uses.get_mut(&key) {
            uses.members -= 1;
            if uses.members == 0 {
                self.uses.remove(&key);
            }
        }
    }

    /// An empty record for memory of `granularity`.
    pub(super) fn new(granularity: usize) -> Self {
        Self {
            book: Book::new(granularity, true),
            events: HashMap::new(),
            retired: Vec::new(),
            inaccessible: Vec::new(),
            scratch: Vec::new(),
            pins: 0,
            busy: Vec::new(),
            unsettled: Vec::new(),
            exportable: HashSet::new(),
            imported: HashSet::new(),
            graph_held: Vec::new(),
            capture_held: Vec::new(),
            dead_execs: Vec::new(),
            handoff: None,
            uses: HashMap::new(),
            groups: HashMap::new(),
            covered: vec![0],
            known: Vec::new(),
            views: HashMap::new(),
            placements: HashMap::new(),
            placed: HashSet::new(),
        }
    }
}

impl<D: Driver> CudaBackend<D> {
    /// Locks the record and makes the context current, unless the context is lost. Calls hold
    /// the lock across the driver call, so a check and its call cannot be separated by another.
    pub(super) fn enter(
        &self,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<MutexGuard<'_, CudaState>, BackendError> {
        if self.context_lost() {
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        let state = lock(&self.state);
        if self.context_lost() {
            // Another thread found the loss while this one waited for the record.
            return Err(BackendError::new(op, addr, len, Cause::ContextLost));
        }
        // SAFETY: `self.ctx` was retained from this driver in `new` and is given back only in
        // `drop`, so it is live.
        unsafe { self.driver.ctx_set_current(self.ctx) }
            .map_err(|e| self.fail(op, addr, len, e))?;
        Ok(state)
    }

    /// [`enter`](Self::enter) for a VMM call, with the thread's capture mode
    /// [`relaxed`](Self::relaxed) until the second guard drops (VMM calls are never barred by a
    /// capture: fact 40). Bound as `let (s, _relaxed)`, the mode is restored before the record
    /// is unlocked.
    pub(super) fn enter_vmm(
        &self,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<(MutexGuard<'_, CudaState>, Relaxed<'_, D>), BackendError> {
        let state = self.enter(op, addr, len)?;
        let relaxed = self.relaxed().map_err(|e| self.fail(op, addr, len, e))?;
        Ok((state, relaxed))
    }

    /// The calling thread's capture interaction mode, relaxed until the guard drops (then
    /// restored): the VMM calls made meanwhile are neither refused by another thread's capture
    /// nor invalidate it (fact 40), as PyTorch relaxes its allocations (fact 42). If the
    /// exchange fails, its error is returned and the calls are not made: made in the thread's
    /// own mode, they could be refused by an open capture and invalidate it (fact 42) — a
    /// transient failure of the caller is better than a broken capture. A loss is noted.
    pub(super) fn relaxed(&self) -> CuResult<Relaxed<'_, D>> {
        if self.context_lost() {
            // No call once the context is lost; what follows sees the loss itself.
            return Ok(Relaxed {
                backend: self,
                old: None,
            });
        }
        let old = match self
            .driver
            .thread_exchange_capture_mode(CaptureMode::Relaxed)
        {
            Ok(old) => (old != CaptureMode::Relaxed).then_some(old),
            Err(e) => {
                let _ = self.fail(Op::Free, 0, 0, e); // notes a loss
                return Err(e);
            }
        };
        Ok(Relaxed { backend: self, old })
    }

    /// A driver error as a [`BackendError`] of `op`; an error that means the context is lost
    /// marks the backend lost, so that it calls nothing more.
    pub(super) fn fail(&self, op: Op, addr: Addr, len: usize, e: CuError) -> BackendError {
        if e.is_context_loss() {
            self.lost.store(true, Ordering::Release);
        }
        let cause = Cause::Driver {
            code: e.0,
            name: e.name(),
        };
        BackendError::new(op, addr, len, cause)
    }

    /// Checks that `[addr, addr + len)` is mapped with access (read-write if `write`). A
    /// mapping left by a failed rollback has no access.
    pub(super) fn check_mapped(
        s: &CudaState,
        op: Op,
        addr: Addr,
        len: usize,
        write: bool,
    ) -> Result<(), BackendError> {
        let book = &s.book;
        let not_mapped =
            || BackendError::refused(op, addr, len, Violation::NotMapped { addr, len });
        let (mut at, end) = (addr, Span::new(addr, len).end().ok_or_else(not_mapped)?);
        if Self::overlaps(&s.inaccessible, addr, len) {
            return Err(not_mapped());
        }
        while at < end {
            let (_, _, run, access) = book.resolve(at).ok_or_else(not_mapped)?;
            if write && access != Access::ReadWrite {
                return Err(not_mapped());
            }
            at += run;
        }
        Ok(())
    }

    /// `[addr, addr + len)` as driver pointers, or `refusal` if its end overflows: the first
    /// check of every call that takes a range, before anything adds `len` to `addr`.
    pub(super) fn span(
        op: Op,
        addr: Addr,
        len: usize,
        refusal: Violation,
    ) -> Result<(u64, u64), BackendError> {
        match Span::new(addr, len).end() {
            Some(end) => Ok((addr as u64, end as u64)),
            None => Err(BackendError::refused(op, addr, len, refusal)),
        }
    }

    /// Refuses a call on a range a copy is using. The range's end does not overflow (checked
    /// by [`span`](Self::span) first).
    pub(super) fn check_not_busy(
        s: &CudaState,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        let (start, end) = (addr as u64, Span::new(addr, len).end_or_top() as u64);
        if s.busy
            .iter()
            .any(|&(_, p, n)| p < end && start < p + n as u64)
        {
            return Err(BackendError::refused(
                op,
                addr,
                len,
                Violation::Busy { addr, len },
            ));
        }
        Ok(())
    }

    /// The checks before an unmap of `[addr, addr + len)`, on either mechanism: no copy uses
    /// it, no graph may launch on it (memtoken's or another's capture holds it), and it is
    /// exactly covered by whole live mappings (the proof the VMM `cuMemUnmap` names).
    pub(super) fn check_unmappable(
        s: &CudaState,
        addr: Addr,
        len: usize,
    ) -> Result<(), BackendError> {
        Self::check_not_busy(s, Op::Unmap, addr, len)?;
        let refuse = |v| Err(BackendError::refused(Op::Unmap, addr, len, v));
        if Self::overlaps(&s.graph_held, addr, len) {
            return refuse(Violation::HeldByGraph { addr, len });
        }
        if Self::overlaps(&s.capture_held, addr, len) {
            return refuse(Violation::HeldByCapture { addr, len });
        }
        s.book.check_unmap(addr, len).refused(Op::Unmap, addr, len)
    }

    /// Whether any listed range overlaps `[addr, addr + len)` (its end saturating at the top of
    /// the address space).
    pub(super) fn overlaps(ranges: &[(u64, usize)], addr: Addr, len: usize) -> bool {
        let (start, end) = (addr as u64, Span::new(addr, len).end_or_top() as u64);
        ranges.iter().any(|&(p, n)| p < end && start < p + n as u64)
    }

    /// Unmaps what a failed rollback left mapped in `[start, end)`; what still fails stays.
    pub(super) fn unmap_inaccessible(
        &self,
        s: &mut CudaState,
        start: u64,
        end: u64,
    ) -> CuResult<()> {
        let (inside, outside): (Vec<_>, Vec<_>) = s
            .inaccessible
            .drain(..)
            .partition(|&(p, _)| start <= p && p < end);
        s.inaccessible = outside;
        let mut result = Ok(());
        for (ptr, size) in inside {
            // SAFETY: a range is in `s.inaccessible` only while the driver still holds it mapped
            // exactly (a map whose rollback unmap failed, still in the book as mapped), and it
            // leaves the list when unmapped; the record's lock is held.
            match unsafe { self.driver.mem_unmap(ptr, size) } {
                Ok(()) => s.book.apply_unmap(ptr as Addr, size),
                Err(e) => {
                    s.inaccessible.push((ptr, size));
                    if e.is_context_loss() {
                        return Err(e);
                    }
                    result = result.and(Err(e));
                }
            }
        }
        result
    }
}

/// The guard of [`CudaBackend::relaxed`]: gives the calling thread its capture interaction
/// mode back when dropped.
pub(super) struct Relaxed<'a, D: Driver> {
    backend: &'a CudaBackend<D>,
    /// The mode to give back, where the thread was not relaxed already.
    old: Option<CaptureMode>,
}

impl<D: Driver> Drop for Relaxed<'_, D> {
    fn drop(&mut self) {
        // Once the context is lost no call is made (the mode dies with the thread's use of it).
        if let Some(old) = self.old
            && !self.backend.context_lost()
            && let Err(e) = self.backend.driver.thread_exchange_capture_mode(old)
            && e.is_context_loss()
        {
            let _ = self.backend.fail(Op::Free, 0, 0, e); // noted: nothing more is called
        }
    }
}
