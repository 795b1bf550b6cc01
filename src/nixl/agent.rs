//! [`Agent`]'s calls: registration, metadata, offers, transfers and notifications.

use super::{
    Agent, AgentId, Book, DONE, MAILBOX, Marks, NixlError, Notification, Offered, Peer,
    PeerMetadata, Registered, Remote, RemoteRange, Span, SpanOf, Transfer, engine, incarnation,
    kind, lists, mem_type, parse_done, pieces,
};
use crate::allocation::Allocation;
use crate::backend::{Addr, Backend};
use crate::device::Device;
use crate::error::TransitionError;
use crate::nixl_wire::{self, Decoded, MemKind};
use crate::state::Committed;
use crate::transfer::Registrable;
use nixl_sys::{MemType, NotificationMap, RegDescList, XferOp};
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

impl<'d, 'id, B: Backend> Agent<'d, 'id, B> {
    /// An agent named `name` (unique among the agents that will meet) for `device`'s memory,
    /// with NIXL's UCX backend.
    ///
    /// # Errors
    ///
    /// [`NixlError::Missing`] without NIXL's library on the loader's path; NIXL's error.
    pub fn new(device: &'d Device<'id, B>, name: &str) -> Result<Self, NixlError> {
        if nixl_sys::is_stub() {
            return Err(NixlError::Missing);
        }
        kind(device.backend().location())?;
        // NIXL's default thread mode takes no lock of its own; nixl-sys serializes every call
        // that changes the agent (registrations, metadata, posts, status, notifications) with
        // its write lock, and lets only `createXferReq` — a `const` method of NIXL's agent —
        // run beside another. (NIXL's `Strict` mode cost a fifth more instructions per
        // transfer here, in spin locks against its progress thread.)
        let raw = nixl_sys::Agent::new(name).map_err(engine("createAgent"))?;
        let (_mems, params) = raw
            .get_plugin_params("UCX")
            .map_err(engine("getPluginParams(UCX)"))?;
        let ucx = raw
            .create_backend("UCX", &params)
            .map_err(engine("createBackend(UCX)"))?;
        // Leaked: a peer that keeps this agent's metadata may write it after the agent is gone.
        let bytes: &'static mut [u8; MAILBOX] = Box::leak(Box::new([0; MAILBOX]));
        let mailbox = Span {
            addr: bytes.as_mut_ptr() as Addr,
            len: MAILBOX,
            mem: MemKind::Dram,
            dev: 0,
        };
        let registered = raw
            .register_memory(&mailbox, None)
            .map_err(engine("registerMem"))?;
        Ok(Self {
            device,
            name: name.to_owned(),
            raw,
            _ucx: ucx,
            mailbox,
            _mailbox: registered,
            instance: incarnation(),
            book: Mutex::new(Book::default()),
        })
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its id — name and incarnation — to send to an agent that will make it an offer.
    pub fn id(&self) -> AgentId {
        AgentId {
            name: self.name.clone(),
            instance: self.instance,
        }
    }

    /// The device it moves memory of.
    pub fn device(&self) -> &'d Device<'id, B> {
        self.device
    }

    /// Whether NIXL holds a registration of exactly `len` bytes at `addr` on this agent
    /// (feature `test-hooks`: memtoken's tests).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn holds_registration(&self, addr: Addr, len: usize) -> bool {
        let Ok((mem, dev)) = kind(self.device.backend().location()) else {
            return false;
        };
        let Ok(mut list) = RegDescList::new(mem_type(mem)) else {
            return false;
        };
        list.add_desc(addr, len, dev);
        self.raw.get_local_partial_md(&list, None).is_ok()
    }

    /// The agent's identity (its NIXL handle's address), whatever its lifetimes.
    pub(super) fn raw_ptr(&self) -> *const nixl_sys::Agent {
        &self.raw
    }

    pub(super) fn book(&self) -> MutexGuard<'_, Book> {
        crate::backend::lock(&self.book)
    }

    /// Registers `token`'s memory with NIXL: the registration owns the token until it is
    /// [released](Registered::release). Peers reach it only once [offered](Self::offer).
    ///
    /// # Errors
    ///
    /// NIXL's error, with the token handed back.
    #[allow(clippy::type_complexity)] // the token handed back, as every transition's error
    pub fn register<'b, S: Registrable>(
        &self,
        token: Allocation<'b, 'id, B, S>,
    ) -> Result<Registered<'_, 'b, 'id, B, S>, TransitionError<Allocation<'b, 'id, B, S>, NixlError>>
    {
        let span = match kind(self.device.backend().location()) {
            Ok((mem, dev)) => Span {
                addr: token.addr(),
                len: token.len(),
                mem,
                dev,
            },
            Err(cause) => return Err(TransitionError { token, cause }),
        };
        let handle = match self.raw.register_memory(&span, None) {
            Ok(handle) => handle,
            Err(e) => {
                return Err(TransitionError {
                    token,
                    cause: engine("registerMem")(e),
                });
            }
        };
        let id = {
            let mut book = self.book();
            book.next += 1;
            book.next
        };
        Ok(Registered {
            agent: self,
            token: ManuallyDrop::new(token),
            handle: ManuallyDrop::new(handle),
            span,
            id,
            marks: Marks::default(),
        })
    }

    /// The metadata through which `peer` — that agent, that incarnation: no other can load it
    /// — reaches the registrations `regs` (and no other): NIXL's connection information and
    /// their descriptors, with memtoken's header. Each is exposed to `peer` from now on, until
    /// `peer` says it is done with this offer or a later one ([`Peer::done`]). Taking each
    /// registration mutably, it waits for no lent token.
    ///
    /// # Errors
    ///
    /// NIXL's error; nothing is exposed then.
    pub fn offer(
        &self,
        to: &AgentId,
        regs: &mut [&mut dyn Offered],
    ) -> Result<PeerMetadata, NixlError> {
        if regs.iter().any(|r| r.owner() != self.raw_ptr().cast()) {
            return Err(NixlError::OtherAgent);
        }
        self.expose(to, regs.iter().map(|reg| (reg.id(), reg.span())))
    }

    /// The metadata through which `to` reaches each span of `spans` (each with the id in the
    /// book of what it belongs to, which is exposed to `to` from now on).
    pub(super) fn expose(
        &self,
        to: &AgentId,
        spans: impl Iterator<Item = (u64, SpanOf)> + Clone,
    ) -> Result<PeerMetadata, NixlError> {
        let peer = to.name.as_str();
        if peer == self.name {
            // NIXL refuses to load an agent's own name: such an offer could never be
            // acknowledged, and what it exposed could only be withheld.
            return Err(NixlError::SelfOffer(to.name.clone()));
        }
        let (mem, _) = kind(self.device.backend().location())?;
        let mem = mem_type(mem);
        let empty = RegDescList::new(mem).map_err(engine("createRegDlist"))?;
        let conn = self
            .raw
            .get_local_partial_md(&empty, None)
            .map_err(engine("getLocalPartialMD"))?;
        let mut list = RegDescList::new(mem).map_err(engine("createRegDlist"))?;
        let mut regions = Vec::new();
        for (_, span) in spans.clone() {
            list.add_desc(span.addr, span.len, span.dev);
            // Its kind and device travel with it: the peer's descriptors of it need them.
            regions.push(nixl_wire::Region {
                addr: span.addr as u64,
                len: span.len as u64,
                kind: span.kind,
                dev: span.dev,
            });
        }
        let md = self
            .raw
            .get_local_partial_md(&list, None)
            .map_err(engine("getLocalPartialMD"))?;
        let mut only_mailbox = RegDescList::new(MemType::Dram).map_err(engine("createRegDlist"))?;
        only_mailbox.add_desc(self.mailbox.addr, MAILBOX, 0);
        let mailbox = self
            .raw
            .get_local_partial_md(&only_mailbox, None)
            .map_err(engine("getLocalPartialMD"))?;
        let mut book = self.book();
        book.epoch += 1;
        let epoch = book.epoch;
        for (id, _) in spans {
            let exposed = book.exposed.entry(id).or_default();
            exposed.retain(|(p, e)| p != to || *e == epoch);
            if !exposed.iter().any(|(p, _)| p == to) {
                exposed.push((to.clone(), epoch));
            }
        }
        Ok(PeerMetadata(nixl_wire::encode(
            [epoch, self.instance, to.instance, self.mailbox.addr as u64],
            &regions,
            [peer.as_bytes(), self.name.as_bytes(), &conn, &md, &mailbox],
        )))
    }

    /// Loads a peer's metadata (from its [`offer`](Self::offer) to this agent): the peer's
    /// regions are reachable through the returned [`Peer`] until it is [done](Peer::done).
    /// One `Peer` of an agent at a time — NIXL keeps one metadata per agent: a later offer of
    /// the same agent is added with [`Peer::extend`].
    ///
    /// # Errors
    ///
    /// [`NixlError::Wire`] for malformed metadata, [`NixlError::NotForUs`] for an offer to
    /// another agent, [`NixlError::AlreadyLoaded`], [`NixlError::Stale`] for an offer this
    /// agent already said it is done with; NIXL's error. Nothing stays loaded then but the
    /// metadata of agents with a live [`Peer`] here. (A malformed part naming such an agent
    /// may make NIXL itself drop that agent's record: that Peer's transfers and
    /// [`done`](Peer::done) then fail, and its agent withholds what it offered — it fails
    /// closed.)
    pub fn load(&self, metadata: &[u8]) -> Result<Peer<'_, 'd, 'id, B>, NixlError> {
        let decoded = self.check(metadata)?;
        let by = std::str::from_utf8(decoded.offered_by)
            .map_err(|_| NixlError::Wire("the offering agent's name is not UTF-8"))?
            .to_owned();
        // The one live Peer of `by`: claimed before anything is loaded, so that a failure
        // below never touches the metadata of a Peer in use. Claimed, released and asked
        // under the book's lock (see `forget_loaded`).
        let remote = {
            let mut book = self.book();
            let remote = book.remotes.entry(by.clone()).or_default().clone();
            if remote.live.swap(true, Ordering::AcqRel) {
                return Err(NixlError::AlreadyLoaded(by));
            }
            remote
        };
        self.load_offer(&decoded, &by, &remote)?;
        Ok(Peer {
            agent: self,
            name: by,
            epoch: decoded.epoch,
            regions: decoded.regions,
            mailbox: decoded.mailbox,
            conn: decoded.conn.to_vec(),
            mailbox_md: decoded.mailbox_md.to_vec(),
            remote,
            finished: false,
        })
    }

    /// Decodes `metadata` and checks that it is offered to this agent.
    pub(super) fn check<'m>(&self, metadata: &'m [u8]) -> Result<Decoded<'m>, NixlError> {
        let decoded = nixl_wire::decode(metadata)?;
        if decoded.offered_to != self.name.as_bytes() || decoded.for_instance != self.instance {
            return Err(NixlError::NotForUs {
                offered_to: String::from_utf8_lossy(decoded.offered_to).into_owned(),
                loader: self.name.clone(),
            });
        }
        Ok(decoded)
    }

    /// Loads the offer of `by` (whose one live Peer the caller claimed): refused if this agent
    /// acknowledged it already. On a failure, what was loaded is invalidated again and the
    /// claim released ([`forget_loaded`](Self::forget_loaded)).
    pub(super) fn load_offer(
        &self,
        decoded: &Decoded<'_>,
        by: &str,
        remote: &Remote,
    ) -> Result<(), NixlError> {
        let fail = |e, other: Option<&str>| {
            self.forget_loaded(other.into_iter().chain([by]), Some(remote));
            Err(e)
        };
        // Each incarnation of `by` numbers its offers afresh.
        remote.instance.store(decoded.instance, Ordering::Release);
        let acked = remote.acked(decoded.instance);
        if decoded.epoch <= acked {
            return fail(
                NixlError::Stale {
                    peer: by.to_owned(),
                    epoch: decoded.epoch,
                    acked,
                },
                None,
            );
        }
        let name = match self.load_md(decoded.conn) {
            Ok(name) => name,
            // NIXL may keep the connection information of a load that failed after it.
            Err(e) => return fail(e, None),
        };
        if name != by {
            return fail(
                NixlError::Wire("its connection information is another agent's"),
                Some(&name),
            );
        }
        match self.load_md(decoded.md) {
            Ok(again) if again == name => Ok(()),
            Ok(other) => fail(
                NixlError::Wire("its two parts name different agents"),
                Some(&other),
            ),
            Err(e) => fail(e, None),
        }
    }

    /// Invalidates the metadata of each agent of `names` that has no live [`Peer`] here — or
    /// whose Peer's claim is `released` (a load that failed, a Peer done), which is let go in
    /// the same step. Under the book's lock, as every claim and release is: a load that
    /// finds an agent live left what it loaded before the Peer's own last invalidation
    /// (which clears it then), and one that finds it not live invalidates what it loaded
    /// itself; neither can invalidate metadata a Peer claimed after it looked.
    pub(super) fn forget_loaded<'n>(
        &self,
        names: impl IntoIterator<Item = &'n str>,
        released: Option<&Remote>,
    ) {
        let book = self.book();
        if let Some(remote) = released {
            remote.live.store(false, Ordering::Release);
        }
        for name in names {
            let live = book
                .remotes
                .get(name)
                .is_some_and(|r| r.live.load(Ordering::Acquire));
            if !live {
                let _ = self.raw.invalidate_remote_md(name);
            }
        }
    }

    /// NIXL's `loadRemoteMD`: the agent the metadata names. nixl-sys panics on a name that is
    /// not UTF-8 (malformed or edited metadata, its lock no longer held then): an error here.
    pub(super) fn load_md(&self, metadata: &[u8]) -> Result<String, NixlError> {
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.raw.load_remote_md(metadata)
        }));
        match loaded {
            Ok(loaded) => loaded.map_err(engine("loadRemoteMD")),
            Err(_) => Err(NixlError::Wire(
                "NIXL's metadata names an agent that is not UTF-8",
            )),
        }
    }

    /// Takes the notifications received so far (acknowledgements of [`Peer::done`] are kept
    /// by the agent, not returned).
    ///
    /// # Errors
    ///
    /// NIXL's error.
    pub fn notifications(&self) -> Result<Vec<Notification>, NixlError> {
        self.collect()?;
        Ok(std::mem::take(&mut self.book().inbox))
    }

    /// Collects what arrived: acknowledgements into the book, the rest into the inbox.
    pub(super) fn collect(&self) -> Result<(), NixlError> {
        let mut map = NotificationMap::new().map_err(engine("createNotifMap"))?;
        self.raw
            .get_notifications(&mut map, None)
            .map_err(engine("getNotifs"))?;
        let mut received = Vec::new();
        for from in map.agents() {
            let from = from.map_err(engine("notifMapGetAgent"))?;
            let n = map
                .get_notifications_size(from)
                .map_err(engine("notifMapGetNotifsSize"))?;
            for i in 0..n {
                let message = map
                    .get_notification_bytes(from, i)
                    .map_err(engine("notifMapGetNotif"))?;
                received.push(Notification {
                    from: from.to_owned(),
                    message,
                });
            }
        }
        let mut book = self.book();
        for n in received {
            // `memtoken/done/<the acknowledging incarnation>/<epoch>`: it covers that
            // incarnation's offers only.
            match n.message.strip_prefix(DONE).and_then(parse_done) {
                Some((instance, epoch)) => {
                    let who = AgentId {
                        name: n.from,
                        instance,
                    };
                    let done = book.done.entry(who).or_insert(0);
                    *done = (*done).max(epoch);
                }
                None => book.inbox.push(n),
            }
        }
        Ok(())
    }

    /// The proof from a peer's end, on the caller's word: `child` is waited for, then every
    /// offer made so far to `peer` (that incarnation: a new agent of the same name is another)
    /// counts as done with — its registrations lend their token and release cleanly. Nothing
    /// here can check that `child` is the peer's process: that is what the caller vouches for.
    ///
    /// # Safety
    ///
    /// Once this returns `Ok`, [`Registered::token`] lends `&` access — `as_slice`'s `&[u8]`
    /// among it — to the memory offered to `peer`, and [`Registered::release`] gives it back
    /// for reuse. A write from `peer` landing after that is a data race. The caller vouches
    /// that none can:
    ///
    /// - `child` runs the agent `peer` — that incarnation, made in that process: not another
    ///   process, not a new agent of the same name — and no other process holds the metadata
    ///   of the offers made to it (it passed them to no other process, nor to a process it
    ///   started);
    /// - `child` is local: a process on this machine, a child of this process (not a peer on
    ///   another machine, nor a process another one waits for), not already waited for by
    ///   other means — so that `wait` returning means that it has ended;
    /// - the transport between them delivers no write of `peer`'s after its process has ended:
    ///   nothing it posted is still on the wire, queued in a NIC or buffered on this side to
    ///   be copied in later. (UCX's `cma` transport on one machine writes synchronously from
    ///   the writer's process, so its writes end with it; a transport that buffers on the
    ///   receiving side, TCP among them, or an RDMA NIC, may still deliver after the writer's
    ///   end, and the caller must know that it does not.)
    ///
    /// Where this cannot be vouched for, wait for the peer's [`Peer::done`] instead, or let the
    /// memory be withheld: that is always safe.
    ///
    /// Safe code cannot give this word (`ui-tests/peer_exited_from_safe_code.rs`):
    ///
    /// ```compile_fail,E0133
    /// # use memtoken::backend::HostBackend;
    /// # use memtoken::nixl::{Agent, AgentId};
    /// # use memtoken::{make_guard, Budget, Device};
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # make_guard!(guard);
    /// # let device = Device::new(guard, HostBackend::with_defaults()?);
    /// # let agent = Agent::new(&device, "a")?;
    /// # let peer = AgentId::from_bytes(&[0; 9])?;
    /// let mut child = std::process::Command::new("true").spawn()?; // not the peer
    /// agent.peer_exited(&peer, &mut child)?; // error: a call to an unsafe fn needs `unsafe`
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`NixlError::Wait`]: the wait failed, and nothing is proved.
    pub unsafe fn peer_exited(
        &self,
        peer: &AgentId,
        child: &mut std::process::Child,
    ) -> Result<(), NixlError> {
        child.wait().map_err(NixlError::Wait)?;
        let mut book = self.book();
        let epoch = book.epoch;
        let done = book.done.entry(peer.clone()).or_insert(0);
        *done = (*done).max(epoch);
        Ok(())
    }

    /// A WRITE: `local`'s ranges (offset, length) into `remote`'s, in pairs of equal lengths,
    /// then `notify` (if any) delivered to the peer after the bytes. Borrows `local` and the
    /// peer until the transfer is done.
    ///
    /// # Errors
    ///
    /// [`NixlError::Range`], [`NixlError::Mismatch`]; NIXL's error.
    pub fn write<'t, S: Registrable>(
        &'t self,
        local: &'t Registered<'_, '_, 'id, B, S>,
        ranges: &[(usize, usize)],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'t>, NixlError> {
        self.post(XferOp::Write, local, ranges, peer, remote, notify)
    }

    /// A READ: `remote`'s ranges into `local`'s (offset, length), in pairs of equal lengths,
    /// then `notify` (if any) delivered to the peer. Borrows `local` mutably — it is written —
    /// and the peer until the transfer is done.
    ///
    /// # Errors
    ///
    /// As for [`write`](Self::write).
    pub fn read<'t>(
        &'t self,
        local: &'t mut Registered<'_, '_, 'id, B, Committed>,
        ranges: &[(usize, usize)],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'t>, NixlError> {
        self.post(XferOp::Read, local, ranges, peer, remote, notify)
    }

    pub(super) fn post<'t, S: Registrable>(
        &'t self,
        op: XferOp,
        local: &'t Registered<'_, '_, 'id, B, S>,
        ranges: &[(usize, usize)],
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'t>, NixlError> {
        if !std::ptr::eq(local.agent.raw_ptr(), self.raw_ptr()) {
            return Err(NixlError::OtherAgent);
        }
        self.start(
            op,
            pieces(&local.span, ranges),
            &local.marks,
            peer,
            remote,
            notify,
        )
    }

    /// Posts a transfer of local `pieces` (in registered memory whose marks are `local`) to or
    /// from `remote`.
    pub(super) fn start<'t>(
        &'t self,
        op: XferOp,
        pieces: impl ExactSizeIterator<Item = Result<(Addr, usize), NixlError>> + Clone,
        local: &'t Marks,
        peer: &'t Peer<'_, '_, 'id, B>,
        remote: &[RemoteRange],
        notify: Option<&[u8]>,
    ) -> Result<Transfer<'t>, NixlError> {
        if !std::ptr::eq(peer.agent.raw_ptr(), self.raw_ptr()) {
            return Err(NixlError::OtherAgent);
        }
        if notify.is_some_and(|m| m.starts_with(DONE)) {
            return Err(NixlError::Reserved);
        }
        let local_kind = kind(self.device.backend().location())?;
        let bytes = pieces.clone().flatten().map(|p| p.1).sum();
        let (mine, theirs) = lists(local_kind, pieces, remote)?;
        let args = match notify {
            None => None,
            Some(message) => {
                let mut args = nixl_sys::OptArgs::new().map_err(engine("createOptArgs"))?;
                args.set_has_notification(true)
                    .map_err(engine("optArgsSetHasNotif"))?;
                args.set_notification_message(message)
                    .map_err(engine("optArgsSetNotifMsg"))?;
                Some(args)
            }
        };
        let req = self
            .raw
            .create_xfer_req(op, &mine, &theirs, &peer.name, args.as_ref())
            .map_err(engine("createXferReq"))?;
        Transfer::post(&self.raw, req, local, &peer.remote.marks, bytes)
    }
}

impl<B: Backend> fmt::Debug for Agent<'_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}
