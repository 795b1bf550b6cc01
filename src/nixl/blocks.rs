//! The KV cache's blocks over NIXL, by id.
//!
//! - **Registered by group.** [`Agent::register_cache`] registers a [`KvCache`]'s memory a
//!   group at a time — each plane's part of the group — as a transfer first uses one of its
//!   blocks, and lets a group's registrations go before the cache unmaps it (a
//!   [`replenish`](KvCache::replenish) over the high watermark, a sleep). No group holding a
//!   block a transfer or an offer holds is unmapped: such a block is live, and the cache does
//!   not sleep while one is lent ([`KvError::Lent`]).
//! - **Moved by id.** [`Agent::write_blocks`] and [`Agent::read_blocks`] move the blocks at
//!   some positions of a table — every plane of each, in order — to or from a peer's offered
//!   memory. The transfer holds the table until it is done ([`BlockTransfer::wait`]); if it
//!   does not finish, the table's blocks are withheld for good (never handed out again, and
//!   the cache's planes withheld as it drops).
//! - **Offered tables.** [`Agent::offer_table`] moves a table into an [`OfferedTable`] and
//!   gives the metadata through which one peer reaches its blocks — those blocks only, each
//!   plane's part registered on its own. The offered table lends nothing: no id, no byte, no
//!   copy. [`OfferedTable::take_back`] hands the table back once the peer has said it is done
//!   ([`Peer::done`]) or its end was vouched for ([`Agent::peer_exited`]); dropped before, its
//!   blocks are withheld for good. So no byte of a block a peer may still write is read. A
//!   whole cache is never offered.

use super::{Agent, AgentId, Marks, NixlError, Peer, PeerMetadata, RemoteRange, Span, Transfer};
use super::{SpanOf, engine, kind};
use crate::backend::{Addr, Backend, lock};
use crate::error::TransitionError;
use crate::kv::{BlockTable, GroupWatch, KvCache, KvError};
use nixl_sys::{RegistrationHandle, XferOp};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A cache's registrations, by group: each plane's part of the group.
#[derive(Default)]
struct Groups {
    handles: Mutex<HashMap<usize, Vec<RegistrationHandle>>>,
}

impl GroupWatch for Groups {
    fn unmapping(&self, group: usize) {
        // Deregistered (nixl-sys deregisters as a handle drops) before the memory goes.
        lock(&self.handles).remove(&group);
    }

    fn released(&self) {
        lock(&self.handles).clear();
    }

    fn withheld(&self) {
        std::mem::forget(std::mem::take(&mut *lock(&self.handles)));
    }
}

/// A [`KvCache`] registered with NIXL by an [`Agent`] ([`Agent::register_cache`]): it borrows
/// the cache; each group is registered as a transfer first uses one of its blocks and
/// deregistered before the cache unmaps it. A block transfer borrows it and holds its table.
/// If a transfer of its blocks did not finish, the cache stays registered after it drops (a
/// second registration is refused): each group is still deregistered before it is unmapped,
/// and what is registered as the cache drops stays registered for good.
pub struct RegisteredCache<'a, 'p, 'c, 'b, 'id, B: Backend> {
    agent: &'a Agent<'a, 'id, B>,
    cache: &'p KvCache<'c, 'b, 'id, B>,
    groups: Arc<Groups>,
    /// Transfers of its blocks.
    marks: Marks,
}

impl<'a, 'p, 'c, 'b, 'id, B: Backend> RegisteredCache<'a, 'p, 'c, 'b, 'id, B> {
    /// Groups registered now.
    pub fn registered_groups(&self) -> usize {
        lock(&self.groups.handles).len()
    }

    /// Whether a transfer of its blocks did not finish, is in flight or was forgotten.
    pub fn is_poisoned(&self) -> bool {
        self.marks.busy()
    }

    /// Registers group `group` — each plane's part — unless it is.
    fn ensure(&self, group: usize) -> Result<(), NixlError> {
        let mut handles = lock(&self.groups.handles);
        if handles.contains_key(&group) {
            return Ok(());
        }
        let (mem, dev) = kind(self.agent.device.backend().location())?;
        let planes = self.cache.layout().planes().len();
        let mut made = Vec::with_capacity(planes);
        for plane in 0..planes {
            let (addr, len) = self.cache.group_span(plane, group);
            let span = Span {
                addr,
                len,
                mem,
                dev,
            };
            made.push(
                self.agent
                    .raw
                    .register_memory(&span, None)
                    .map_err(engine("registerMem"))?,
            );
        }
        handles.insert(group, made);
        Ok(())
    }

    /// The blocks at `positions` of `table`, every plane of each in order, as pieces, their
    /// groups registered.
    fn pieces(
        &self,
        agent: &Agent<'_, 'id, B>,
        table: &BlockTable<'p, 'c, 'b, 'id, B>,
        positions: &[usize],
    ) -> Result<Vec<(Addr, usize)>, NixlError> {
        if !std::ptr::eq(self.agent.raw_ptr(), agent.raw_ptr()) {
            return Err(NixlError::OtherAgent);
        }
        if self.cache.is_asleep() {
            return Err(NixlError::Kv(Box::new(KvError::Asleep)));
        }
        let planes = self.cache.layout().planes();
        let mut pieces = Vec::with_capacity(positions.len() * planes.len());
        for &at in positions {
            let Some(&block) = table.ids().get(at) else {
                return Err(NixlError::Position {
                    position: at,
                    blocks: table.len(),
                });
            };
            self.ensure(self.cache.group_of(block))?;
            for (p, plane) in planes.iter().enumerate() {
                pieces.push((self.cache.block_addr(p, block), plane.block_bytes));
            }
        }
        Ok(pieces)
    }
}

impl<B: Backend> Drop for RegisteredCache<'_, '_, '_, '_, '_, B> {
    fn drop(&mut self) {
        if self.is_poisoned() {
            // The engine may still run a request over a group holding the unfinished
            // transfer's blocks (withheld: live, never unmapped). The watch stays, so every
            // other group is still deregistered before the cache unmaps it; the cache, whose
            // blocks stay lent, keeps what is left registered for good as it drops.
            return;
        }
        self.cache.clear_watch();
        // Each group is deregistered as its handles drop.
        drop(std::mem::take(&mut *lock(&self.groups.handles)));
    }
}

impl<B: Backend> fmt::Debug for RegisteredCache<'_, '_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredCache")
            .field("groups", &self.registered_groups())
            .field("poisoned", &self.is_poisoned())
            .finish()
    }
}

/// A posted transfer of a block table's blocks ([`Agent::write_blocks`],
/// [`Agent::read_blocks`]): it holds the table, its blocks lent, until it is done. Dropped
/// before, it waits as a [`Transfer`] does; if the transfer did not finish, the table's blocks
/// are withheld for good (never handed out again, and the cache's planes withheld as it
/// drops).
#[must_use = "a transfer dropped at once waits for itself"]
pub struct BlockTransfer<'t, 'p, 'c, 'b, 'id, B: Backend> {
    transfer: Transfer<'t>,
    cache: &'p KvCache<'c, 'b, 'id, B>,
    table: Option<BlockTable<'p, 'c, 'b, 'id, B>>,
    /// The blocks it lent (the table's).
    lent: usize,
    /// Its blocks are lent (until seen complete: a forgotten one stays lent, and the cache
    /// then withholds its planes).
    counted: bool,
}

impl<'p, 'c, 'b, 'id, B: Backend> BlockTransfer<'_, 'p, 'c, 'b, 'id, B> {
    /// The bytes it moves.
    pub fn bytes(&self) -> usize {
        self.transfer.bytes()
    }

    /// Whether it is done, asking NIXL once.
    ///
    /// # Errors
    ///
    /// NIXL's error: the transfer failed (the blocks are withheld as it drops).
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        let polled = self.transfer.poll();
        if matches!(polled, Ok(true)) {
            self.completed();
        }
        polled
    }

    /// Seen complete (never after a failure: the transfer's own flag, which every failure
    /// sets, is checked first): its blocks are no longer lent.
    fn completed(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.cache.unlend(self.lent);
        }
    }

    /// Waits until it is done, for at most `limit`, and hands the table back.
    ///
    /// # Errors
    ///
    /// NIXL's error, or [`NixlError::TimedOut`]: the table's blocks are withheld for good.
    pub fn wait(mut self, limit: Duration) -> Result<BlockTable<'p, 'c, 'b, 'id, B>, NixlError> {
        if !self.transfer.finish_within(limit)? {
            self.transfer.give_up(true);
            return Err(NixlError::TimedOut(limit));
        }
        self.completed();
        Ok(self.table.take().expect("held until handed back"))
    }
}

impl<B: Backend> Drop for BlockTransfer<'_, '_, '_, '_, '_, B> {
    fn drop(&mut self) {
        if !self.transfer.done {
            // A failure is in the transfer's flag, read below.
            let _ = self.transfer.wait_in_drop();
        }
        // It failed or timed out (every failure gives the transfer up, which sets its flag):
        // the engine may still touch the table's blocks.
        if self.transfer.failed {
            if let Some(table) = self.table.take() {
                self.cache
                    .withhold(table, "an unfinished transfer".to_owned());
            }
        } else {
            self.completed();
        }
    }
}

impl<B: Backend> fmt::Debug for BlockTransfer<'_, '_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockTransfer")
            .field("transfer", &self.transfer)
            .finish_non_exhaustive()
    }
}

/// A block table offered to one peer ([`Agent::offer_table`]): the peer may write and read its
/// blocks until it says it is done. It lends nothing — no id, no byte, no copy: the table is
/// moved in, and comes back only through [`take_back`](Self::take_back), once the peer is done
/// with it. Dropped before, its blocks are withheld for good.
///
/// A table offered is not read (`ui-tests/offered_table_lends_nothing.rs`):
///
/// ```compile_fail,E0382
/// # use memtoken::backend::HostBackend;
/// # use memtoken::kv::{KvCache, Layout};
/// # use memtoken::nixl::Agent;
/// # use memtoken::{make_guard, Budget, Device};
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults()?);
/// # let binding = device.bind(Budget::unlimited())?;
/// # let agent = Agent::new(&device, "decode")?;
/// # let prefill = agent.id();
/// # make_guard!(g);
/// # let cache = KvCache::new(g, &binding, &Layout::new(64, 16).plane(4096))?;
/// # cache.replenish()?;
/// let mut table = cache.table();
/// cache.push(&mut table)?;
/// let (offered, metadata) = agent.offer_table(&prefill, table).map_err(memtoken::Error::from)?;
/// let mut bytes = [0; 16];
/// table.read(0, 0, 0, &mut bytes)?; // error: `table` was moved into the offer
/// # Ok(()) }
/// ```
pub struct OfferedTable<'a, 'p, 'c, 'b, 'id, B: Backend> {
    agent: &'a Agent<'a, 'id, B>,
    table: Option<BlockTable<'p, 'c, 'b, 'id, B>>,
    /// Each block's part of each plane, registered on its own: what the metadata exposes.
    handles: Vec<RegistrationHandle>,
    /// Its id in the agent's book.
    id: u64,
}

impl<'a, 'p, 'c, 'b, 'id, B: Backend> OfferedTable<'a, 'p, 'c, 'b, 'id, B> {
    /// Blocks offered.
    pub fn len(&self) -> usize {
        self.table.as_ref().map_or(0, BlockTable::len)
    }

    /// Whether no block is offered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The peers it was offered to that have not said they are done.
    fn pending(&self) -> Vec<String> {
        let _ = self.agent.collect(); // acknowledgements that arrived count
        self.agent.book().pending(self.id)
    }

    /// The table back, once the peer is done with it ([`Peer::done`], or
    /// [`Agent::peer_exited`]): its blocks are deregistered and no longer lent, and the table
    /// reads and writes them again.
    ///
    /// # Errors
    ///
    /// [`NixlError::Exposed`], with the offered table handed back: the peer may still write
    /// the blocks.
    #[allow(clippy::result_large_err)] // the offer handed back whole; not a hot path
    pub fn take_back(
        mut self,
    ) -> Result<BlockTable<'p, 'c, 'b, 'id, B>, TransitionError<Self, NixlError>> {
        let peers = self.pending();
        if !peers.is_empty() {
            return Err(TransitionError {
                token: self,
                cause: NixlError::Exposed {
                    peers,
                    poisoned: false,
                },
            });
        }
        Ok(self.settle(None).expect("not withheld"))
    }

    /// Lets the offer go: deregistered, and the table handed back (no peer may touch it) or
    /// withheld for `who` (one may).
    fn settle(&mut self, who: Option<String>) -> Option<BlockTable<'p, 'c, 'b, 'id, B>> {
        let table = self.table.take()?;
        self.agent.book().exposed.remove(&self.id);
        // Deregistered: a late write of the peer's still lands (NIXL's deregistration does
        // not revoke it), so the blocks are withheld then, never reused.
        self.handles.clear();
        let cache = table.cache();
        match who {
            None => {
                cache.unlend(table.len());
                Some(table)
            }
            Some(who) => {
                cache.withhold(table, who);
                None
            }
        }
    }
}

impl<B: Backend> Drop for OfferedTable<'_, '_, '_, '_, '_, B> {
    fn drop(&mut self) {
        if self.table.is_none() {
            return;
        }
        let peers = self.pending();
        let who = (!peers.is_empty()).then(|| peers.join(", "));
        drop(self.settle(who)); // taken back: its blocks go back to the cache
    }
}

impl<B: Backend> fmt::Display for OfferedTable<'_, '_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a block table of {} blocks offered to a peer",
            self.len()
        )
    }
}

impl<B: Backend> fmt::Debug for OfferedTable<'_, '_, '_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OfferedTable")
            .field("blocks", &self.len())
            .finish_non_exhaustive()
    }
}

impl<'d, 'id, B: Backend> Agent<'d, 'id, B> {
    /// Registers `cache` with NIXL for transfers of its blocks
    /// ([`write_blocks`](Self::write_blocks), [`read_blocks`](Self::read_blocks)): each group
    /// as a transfer first uses it, deregistered before the cache unmaps it. The cache is not
    /// offered: offer tables ([`offer_table`](Self::offer_table)).
    ///
    /// # Errors
    ///
    /// [`NixlError::CacheRegistered`] if the cache is registered already (one registration
    /// at a time); [`NixlError::Unreachable`].
    pub fn register_cache<'p, 'c, 'b>(
        &self,
        cache: &'p KvCache<'c, 'b, 'id, B>,
    ) -> Result<RegisteredCache<'_, 'p, 'c, 'b, 'id, B>, NixlError> {
        kind(self.device.backend().location())?;
        let groups = Arc::new(Groups::default());
        if !cache.set_watch(groups.clone()) {
            return Err(NixlError::CacheRegistered);
        }
        Ok(RegisteredCache {
            agent: self,
            cache,
            groups,
            marks: Marks::default(),
        })
    }

    /// A WRITE of the blocks at `positions` of `table` (a table of `cache`'s) — each block's
    /// part of every plane, in order — into `remote`'s ranges, one per block and plane, then
    /// `notify`. The transfer holds the table until it is done ([`BlockTransfer::wait`] hands
    /// it back): if it does not finish, its blocks are withheld for good.
    ///
    /// # Errors
    ///
    /// As for [`write`](Self::write); [`NixlError::Position`]; [`NixlError::Kv`] while the
    /// cache sleeps: the table handed back.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)] // both sides and the notification
    pub fn write_blocks<'t, 'p, 'c, 'b>(
        &'t self,
        cache: &'t RegisteredCache<'_, 'p, 'c, 'b, 'id, B>,
        table: BlockTable<'p, 'c, 'b, 'id, B>,
        positions: &[usize],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<
        BlockTransfer<'t, 'p, 'c, 'b, 'id, B>,
        TransitionError<BlockTable<'p, 'c, 'b, 'id, B>, NixlError>,
    > {
        self.blocks(XferOp::Write, cache, table, positions, peer, remote, notify)
    }

    /// A READ of `remote`'s ranges into the blocks at `positions` of `table`, one range per
    /// block and plane in order, then `notify`; the transfer holds the table as for
    /// [`write_blocks`](Self::write_blocks). Every block read into must be writable through
    /// the table (not shared, not cached).
    ///
    /// # Errors
    ///
    /// As for [`write_blocks`](Self::write_blocks); [`NixlError::Kv`] with
    /// [`KvError::ReadOnly`] for a shared block: the table handed back.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)] // both sides and the notification
    pub fn read_blocks<'t, 'p, 'c, 'b>(
        &'t self,
        cache: &'t RegisteredCache<'_, 'p, 'c, 'b, 'id, B>,
        table: BlockTable<'p, 'c, 'b, 'id, B>,
        positions: &[usize],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<
        BlockTransfer<'t, 'p, 'c, 'b, 'id, B>,
        TransitionError<BlockTable<'p, 'c, 'b, 'id, B>, NixlError>,
    > {
        self.blocks(XferOp::Read, cache, table, positions, peer, remote, notify)
    }

    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn blocks<'t, 'p, 'c, 'b>(
        &'t self,
        op: XferOp,
        registered: &'t RegisteredCache<'_, 'p, 'c, 'b, 'id, B>,
        table: BlockTable<'p, 'c, 'b, 'id, B>,
        positions: &[usize],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<
        BlockTransfer<'t, 'p, 'c, 'b, 'id, B>,
        TransitionError<BlockTable<'p, 'c, 'b, 'id, B>, NixlError>,
    > {
        let cache = registered.cache;
        let read_only = matches!(op, XferOp::Read)
            .then(|| {
                positions
                    .iter()
                    .find(|&&at| at < table.len() && !cache.is_writable(&table, at))
            })
            .flatten();
        let pieces = match read_only {
            Some(&position) => Err(NixlError::Kv(Box::new(KvError::ReadOnly { position }))),
            None => registered.pieces(self, &table, positions),
        };
        let pieces = match pieces {
            Ok(pieces) => pieces,
            Err(cause) => {
                return Err(TransitionError {
                    token: table,
                    cause,
                });
            }
        };
        // Lent from before the post: the cache keeps the blocks, and will not sleep, while one
        // may run (for good if it is forgotten).
        let lent = table.len();
        cache.lend(lent);
        let posts = registered.marks.in_flight.load(Ordering::Acquire);
        let started = self.start(
            op,
            pieces.into_iter().map(Ok),
            &registered.marks,
            peer,
            remote,
            notify,
        );
        match started {
            Ok(transfer) => Ok(BlockTransfer {
                transfer,
                cache,
                table: Some(table),
                lent,
                counted: true,
            }),
            Err(cause) if registered.marks.in_flight.load(Ordering::Acquire) > posts => {
                // This post failed (it stays counted): what it may have started keeps the
                // blocks; the error hands back an empty table.
                cache.withhold(table, "an unfinished transfer".to_owned());
                Err(TransitionError {
                    token: cache.table(),
                    cause,
                })
            }
            Err(cause) => {
                cache.unlend(lent); // nothing was posted
                Err(TransitionError {
                    token: table,
                    cause,
                })
            }
        }
    }

    /// Offers `table`'s blocks to `to` (that agent, that incarnation): the metadata through
    /// which it reaches them — each block's part of every plane, block by block in the
    /// table's order (regions `position × planes + plane`), and nothing else of the cache.
    /// The table moves into the returned [`OfferedTable`], which lends nothing until the peer
    /// is done ([`OfferedTable::take_back`]). Every block must be the table's alone (not
    /// shared, not cached): the peer writes it.
    ///
    /// # Errors
    ///
    /// [`NixlError::Kv`] with [`KvError::ReadOnly`] for a shared or cached block, or
    /// [`KvError::Asleep`]; as for [`offer`](Self::offer). The table is handed back, nothing
    /// exposed.
    #[allow(clippy::type_complexity)] // the table handed back, as every transition's error
    pub fn offer_table<'p, 'c, 'b>(
        &self,
        to: &AgentId,
        table: BlockTable<'p, 'c, 'b, 'id, B>,
    ) -> Result<
        (OfferedTable<'_, 'p, 'c, 'b, 'id, B>, PeerMetadata),
        TransitionError<BlockTable<'p, 'c, 'b, 'id, B>, NixlError>,
    > {
        match self.expose_table(to, &table) {
            Ok((handles, id, metadata)) => {
                table.cache().lend(table.len());
                let offered = OfferedTable {
                    agent: self,
                    table: Some(table),
                    handles,
                    id,
                };
                Ok((offered, metadata))
            }
            Err(cause) => Err(TransitionError {
                token: table,
                cause,
            }),
        }
    }

    /// Registers each block of `table` in each plane on its own and exposes those to `to`:
    /// the registrations, the offer's id and its metadata.
    #[allow(clippy::type_complexity)]
    fn expose_table(
        &self,
        to: &AgentId,
        table: &BlockTable<'_, '_, '_, 'id, B>,
    ) -> Result<(Vec<RegistrationHandle>, u64, PeerMetadata), NixlError> {
        let (mem, dev) = kind(self.device.backend().location())?;
        let cache = table.cache();
        if cache.is_asleep() {
            return Err(NixlError::Kv(Box::new(KvError::Asleep)));
        }
        if let Some(position) = (0..table.len()).find(|&at| !cache.is_writable(table, at)) {
            return Err(NixlError::Kv(Box::new(KvError::ReadOnly { position })));
        }
        let planes = cache.layout().planes();
        let mut spans = Vec::with_capacity(table.len() * planes.len());
        let mut handles = Vec::with_capacity(spans.capacity());
        for &block in table.ids() {
            for (p, plane) in planes.iter().enumerate() {
                let span = Span {
                    addr: cache.block_addr(p, block),
                    len: plane.block_bytes,
                    mem,
                    dev,
                };
                handles.push(
                    self.raw
                        .register_memory(&span, None)
                        .map_err(engine("registerMem"))?,
                );
                spans.push(SpanOf {
                    addr: span.addr,
                    len: span.len,
                    kind: mem,
                    dev,
                });
            }
        }
        let id = {
            let mut book = self.book();
            book.next += 1;
            book.next
        };
        let metadata = self.expose(to, spans.into_iter().map(|span| (id, span)))?;
        Ok((handles, id, metadata))
    }
}

impl<B: Backend> Peer<'_, '_, '_, B> {
    /// The whole of each offered region in `regions`, in order: the remote side of a transfer
    /// of whole blocks into (or from) an offered table — its blocks' regions are `position ×
    /// planes + plane`, after the regions of the offers loaded before it.
    ///
    /// # Errors
    ///
    /// [`NixlError::NoRegion`] past the last region.
    pub fn whole(&self, regions: Range<usize>) -> Result<Vec<RemoteRange>, NixlError> {
        regions
            .map(|region| {
                let len = self.regions.get(region).map_or(0, |r| r.len as usize);
                self.range(region, 0, len)
            })
            .collect()
    }
}
