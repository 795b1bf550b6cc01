//! Moving bytes between agents — processes, machines — through NVIDIA NIXL (feature `nixl`),
//! with the borrows and proofs NIXL itself does not give.
//!
//! **The pieces.** An [`Agent`] is tied to a device. [`Agent::register`] takes a token and
//! gives a [`Registered`] one: the memory is registered with NIXL while it lives. A
//! [`Transfer`] (a READ into a local registration, a WRITE from one, to or from a [`Peer`]'s
//! memory) borrows the local registration — mutably for a READ, which writes it — and the peer,
//! and hands them back when it completes ([`Transfer::poll`], [`Transfer::wait`]): a token under
//! an in-flight transfer cannot be released (a compile error). Notifications are values
//! ([`Agent::notifications`]).
//!
//! **What NIXL does not stop, and what memtoken does about it.** Deregistering memory on the
//! target does not stop an initiator that still holds the target's metadata: bytes kept
//! landing after it (see the project's `TRANSFER-ENGINE.md`). So memory exposed to a peer —
//! [`Agent::offer`] puts a registration's descriptors in the metadata a peer loads — is given
//! back only with a proof that every peer it was exposed to is done with it and has
//! invalidated that metadata: the peer's acknowledgement ([`Peer::done`], which invalidates,
//! then says so with a write into the offering agent's mailbox and a notification), or the
//! peer's end, on the caller's `unsafe` word that the process waited for is the peer's, local,
//! and that no write of it lands after it ended ([`Agent::peer_exited`]). Without one,
//! releasing it ([`Registered::release`], or a drop) withholds the memory for good — its VA
//! and physical memory kept, never reused — and the device's report names the peer
//! ([`Device::withheld_for_peers`](crate::Device::withheld_for_peers)). The proof is a
//! cooperating peer's word: against a peer that does not give it, the withholding is what holds.
//! A registration that was never offered is in no metadata: no peer can reach it.
//!
//! **A transfer that does not finish.** A transfer counts as in flight on its registration (or
//! registered KV cache) and its peer from before it is posted until a poll sees it complete — so one that is
//! forgotten (`mem::forget`) stays in flight for good. Dropping an in-flight transfer waits
//! until NIXL says it is done, for at most [`DROP_WAIT`]; if the engine reports an error, or the
//! time runs out (the peer is gone), the local registration is poisoned. Either way its token
//! can only be withheld, as above, a block table's blocks are withheld (and the KV cache's
//! planes as it drops), and the peer cannot acknowledge
//! anything ([`Peer::done`] refuses). A request still in progress is leaked rather than released
//! under the engine.
//!
//! **Offers.** Only a committed allocation is offered ([`Offered`]). An offer is made to one
//! agent ([`AgentId`]: its name and incarnation, which the loading side sends first), which
//! alone can load it — not even an agent made again under that name; an agent holds one
//! [`Peer`] of another at a time (a later offer is added with [`Peer::extend`]), and an offer
//! it acknowledged cannot be loaded again. Load a peer once, extend it, and say `done` when
//! finished with it: each load-and-done cycle costs NIXL 1.5.1 four file descriptors it never
//! closes.
//! An offer carries each region's memory kind (NIXL's DRAM or VRAM) and device, and the peer's
//! side of a transfer is built with them ([`RemoteRange`]), not with the loading agent's own: a
//! transfer whose remote ranges lie in two kinds is refused ([`NixlError::MixedKinds`]), an
//! offer in another version of the format ([`PeerMetadata`]) too ([`NixlError::Version`]).
//! A notification may not begin like the acknowledgement ([`NixlError::Reserved`]). These
//! protect against mistakes, not against a hostile process: another program speaking NIXL can
//! forge an acknowledgement, and metadata edited on its way (its epoch, an incarnation) counts
//! as hostile too — the proof is a cooperating peer's word.
//!
//! **Bytes.** A registration lends its token ([`Registered::token`]) only while no peer may
//! touch the memory (never offered, or every peer done) and no transfer runs: never a `&[u8]`
//! that a peer's write can change. Bytes are lent on a cooperating peer's acknowledgement, or
//! on the caller's `unsafe` word ([`Agent::peer_exited`]).
//!
//! Run time: NIXL's library is loaded when the first agent is made. `scripts/install-nixl.sh`
//! installs it under `target/nixl/`, and `source target/nixl/env.sh` puts it on the loader's
//! path (with UCX kept on the loopback). Without it, [`Agent::new`] returns
//! [`NixlError::Missing`] — NIXL's shim would abort the process on any other call.
// `MemoryRegion::as_ptr` is an `unsafe fn` of nixl-sys's trait, `Agent::peer_exited` an
// `unsafe fn` (its caller vouches for the peer's end); the unsafe blocks are `Registered`'s
// taking of its token and handle, once, each with its `SAFETY:` proof.
#![allow(unsafe_code)]

mod blocks;

pub use blocks::{BlockTransfer, OfferedTable, RegisteredCache};

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, Location};
use crate::device::Device;
use crate::error::TransitionError;
use crate::kv::KvError;
use crate::nixl_wire::{self, Decoded, MemKind, WireError};
use crate::state::Committed;
use crate::transfer::Registrable;
use nixl_sys::{MemType, NotificationMap, RegDescList, XferDescList, XferOp, XferStatus};
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The longest a dropped in-flight [`Transfer`] waits for NIXL to say it is done before it
/// poisons its local registration.
pub const DROP_WAIT: Duration = Duration::from_secs(2);

/// The notification a peer's [`Peer::done`] sends, followed by the metadata's epoch.
const DONE: &[u8] = b"memtoken/done/";

/// Why a NIXL step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NixlError {
    /// NIXL's library is not on the loader's path.
    #[error(
        "NIXL's library (libnixl_capi.so) is not on the loader's path: run \
         scripts/install-nixl.sh, then `source target/nixl/env.sh` (feature `nixl`)"
    )]
    Missing,
    /// A NIXL call failed.
    #[error("NIXL's {call} failed")]
    Engine {
        /// The call.
        call: &'static str,
        /// NIXL's error.
        #[source]
        source: nixl_sys::NixlError,
    },
    /// Memory NIXL cannot reach (the simulator's).
    #[error("NIXL cannot reach memory at {location:?}")]
    Unreachable {
        /// Where the memory is.
        location: Location,
    },
    /// A peer's metadata is malformed.
    #[error("a peer's metadata is malformed: {0}")]
    Wire(&'static str),
    /// A peer's metadata in another version of memtoken's format — an offer in the old format
    /// (`MTNIXL01`, whose regions carry no memory kind or device) among them: refused, never
    /// read as this one.
    #[error(
        "a peer's metadata is in memtoken's NIXL format {found}, not {} (this build's): an \
         offer of another memtoken version is refused, never misread",
        String::from_utf8_lossy(nixl_wire::MAGIC)
    )]
    Version {
        /// Its first 8 bytes, as text (`MTNIXL` and the version).
        found: String,
    },
    /// A transfer's remote ranges lie in memory of two kinds (a peer's host and GPU memory):
    /// a NIXL descriptor list has one kind — post one transfer per kind.
    #[error(
        "a transfer's remote ranges lie in {first} and {other} memory: NIXL takes one memory \
         kind per side (post one transfer per kind)"
    )]
    MixedKinds {
        /// The first range's kind (NIXL's name: `DRAM`, `VRAM`).
        first: &'static str,
        /// Another range's kind.
        other: &'static str,
    },
    /// A range outside its registration or its peer's region.
    #[error("{len} bytes at offset {offset} do not fit in {size}")]
    Range {
        /// The offset.
        offset: usize,
        /// The length.
        len: usize,
        /// What it must fit in.
        size: usize,
    },
    /// The local and remote sides of a transfer differ.
    #[error(
        "a transfer's sides differ: {local} local ranges of {local_bytes} bytes against \
         {remote} remote ranges of {remote_bytes}, or a pair of different lengths"
    )]
    Mismatch {
        /// Local ranges.
        local: usize,
        /// Their bytes.
        local_bytes: usize,
        /// Remote ranges.
        remote: usize,
        /// Their bytes.
        remote_bytes: usize,
    },
    /// The transfer did not finish within its time: what it touches is withheld.
    #[error(
        "the transfer did not finish within {0:?}: what it touches (its registration, or its \
         table's blocks and their cache's planes) is withheld for good"
    )]
    TimedOut(Duration),
    /// A block position past the end of its table.
    #[error("position {position} is past the end of a table of {blocks} blocks")]
    Position {
        /// The position.
        position: usize,
        /// The table's blocks.
        blocks: usize,
    },
    /// A region index past the peer's offered regions.
    #[error("the peer offered {regions} regions: there is no region {region}")]
    NoRegion {
        /// The index.
        region: usize,
        /// The regions offered.
        regions: usize,
    },
    /// The metadata was offered to another agent.
    #[error(
        "the metadata was offered to {offered_to} (that incarnation of it), not to this {loader}"
    )]
    NotForUs {
        /// Whom the offer names.
        offered_to: String,
        /// The agent loading it.
        loader: String,
    },
    /// A peer of that agent is loaded already: extend it ([`Peer::extend`]).
    #[error("a Peer of {0} is loaded already (NIXL keeps one metadata per agent): extend it")]
    AlreadyLoaded(String),
    /// An offer this agent already said it is done with.
    #[error("offer {epoch} of {peer} was already acknowledged (up to {acked}): load a newer one")]
    Stale {
        /// The offering agent.
        peer: String,
        /// The offer's epoch.
        epoch: u64,
        /// The last epoch acknowledged.
        acked: u64,
    },
    /// An offer no newer than the one the peer holds.
    #[error("offer {epoch} is not newer than the offer {loaded} the peer holds")]
    NotNewer {
        /// The offer's epoch.
        epoch: u64,
        /// The epoch of the offer loaded.
        loaded: u64,
    },
    /// The transfer failed earlier (an error, or its time ran out): what it touches is
    /// withheld.
    #[error("the transfer failed earlier: what it touches is withheld for good")]
    Failed,
    /// An offer to an agent of this agent's own name, which NIXL would never load.
    #[error("an offer to {0}, this agent's own name: NIXL loads no agent's own metadata")]
    SelfOffer(String),
    /// A notification that begins like memtoken's acknowledgement.
    #[error("a notification may not begin with `memtoken/done/`: that is the acknowledgement's")]
    Reserved,
    /// The memory may still be touched by these peers or by an unfinished transfer.
    #[error("the memory may still be touched by {}", who(.peers, *.poisoned))]
    Exposed {
        /// Peers it was exposed to that have not said they are done.
        peers: Vec<String>,
        /// Whether a transfer that used it did not finish.
        poisoned: bool,
    },
    /// A peer with a transfer that did not finish (or is still in flight, or was forgotten)
    /// cannot say it is done.
    #[error(
        "a transfer with {0} did not finish, is in flight or was forgotten: no acknowledgement \
         is sent (the peer withholds what it offered)"
    )]
    Tainted(String),
    /// A registration, a registered KV cache or a peer of another agent.
    #[error("a registration, a registered KV cache or a peer of another agent than the transfer's")]
    OtherAgent,
    /// Waiting for a peer process failed.
    #[error("waiting for the peer's process failed")]
    Wait(#[source] std::io::Error),
    /// The KV cache refused: a shared block where the peer writes, or the cache asleep.
    #[error("the KV cache refused")]
    Kv(#[source] Box<KvError>),
    /// The KV cache is registered already (one registration at a time).
    #[error("the KV cache is registered with NIXL already (one registration at a time)")]
    CacheRegistered,
}

fn who(peers: &[String], poisoned: bool) -> String {
    let mut parts: Vec<String> = peers.iter().map(|p| format!("peer {p}")).collect();
    if poisoned {
        parts.push("a transfer in flight, forgotten or unfinished".into());
    }
    parts.join(" and ")
}

impl crate::error::sealed::Sealed for NixlError {}

impl crate::error::Failure for NixlError {
    fn summary(&self) -> &'static str {
        "a NIXL transfer step failed"
    }
}

fn engine(call: &'static str) -> impl FnOnce(nixl_sys::NixlError) -> NixlError {
    move |source| NixlError::Engine { call, source }
}

impl From<WireError> for NixlError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Malformed(why) => NixlError::Wire(why),
            WireError::Version { found } => NixlError::Version { found },
            WireError::NoRegion { region, regions } => NixlError::NoRegion { region, regions },
            WireError::Range { offset, len, size } => NixlError::Range { offset, len, size },
            WireError::MixedKinds { first, other } => NixlError::MixedKinds {
                first: first.name(),
                other: other.name(),
            },
        }
    }
}

/// The memory kind and device id of memory at `location`, as NIXL names them.
fn kind(location: Location) -> Result<(MemKind, u64), NixlError> {
    match location {
        Location::Host => Ok((MemKind::Dram, 0)),
        Location::Cuda { device } => Ok((MemKind::Vram, device as u64)),
        Location::Simulated => Err(NixlError::Unreachable { location }),
    }
}

/// NIXL's memory type of a kind.
fn mem_type(kind: MemKind) -> MemType {
    match kind {
        MemKind::Dram => MemType::Dram,
        MemKind::Vram => MemType::Vram,
    }
}

/// A range NIXL registers: nixl-sys registers what implements its descriptor traits.
#[derive(Debug)]
struct Span {
    addr: Addr,
    len: usize,
    mem: MemKind,
    dev: u64,
}

impl nixl_sys::MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl nixl_sys::NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        mem_type(self.mem)
    }

    fn device_id(&self) -> u64 {
        self.dev
    }
}

/// What transfers mark on what they use (a registration, a registered KV cache, a remote agent): in flight
/// from the post until a poll sees the transfer complete — so a transfer forgotten
/// (`mem::forget`) stays in flight for good — and poisoned when it failed or did not finish in
/// time.
#[derive(Debug, Default)]
struct Marks {
    in_flight: AtomicUsize,
    poisoned: AtomicBool,
}

impl Remote {
    /// The last epoch acknowledged of the incarnation `instance`'s offers (0: none).
    fn acked(&self, instance: u64) -> u64 {
        crate::backend::lock(&self.acked)
            .get(&instance)
            .copied()
            .unwrap_or(0)
    }
}

impl Marks {
    /// Whether an engine may still touch what these marks are on.
    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0 || self.poisoned.load(Ordering::Acquire)
    }
}

/// What an agent knows of one remote agent, shared by every [`Peer`] it loads of it.
#[derive(Debug, Default)]
struct Remote {
    /// Transfers with it (poisoned: one did not finish: no acknowledgement is ever sent).
    marks: Marks,
    /// For each incarnation of it, the last epoch of its offers this agent acknowledged: an
    /// offer at or below it is refused (it was invalidated and said done with).
    acked: Mutex<HashMap<u64, u64>>,
    /// A [`Peer`] of it is loaded (one at a time: NIXL's metadata is per remote agent).
    live: AtomicBool,
    /// The incarnation of it the live [`Peer`] holds offers of.
    instance: AtomicU64,
}

/// What an agent knows of exposures and acknowledgements.
#[derive(Default)]
struct Book {
    /// The remote agents it loaded offers of.
    remotes: HashMap<String, Arc<Remote>>,
    /// Registrations made (their ids).
    next: u64,
    /// Offers made: each offer's epoch.
    epoch: u64,
    /// For each live registration offered: the peers (each incarnation apart) and the epoch
    /// of the last offer to each.
    exposed: HashMap<u64, Vec<(AgentId, u64)>>,
    /// For each peer (each incarnation apart), the last epoch it said it is done with (or that
    /// was current when its process was seen to end).
    done: HashMap<AgentId, u64>,
    /// Notifications received and not yet taken.
    inbox: Vec<Notification>,
}

impl Book {
    /// The peers `id` was exposed to that have not said they are done with it.
    fn pending(&self, id: u64) -> Vec<String> {
        let mut peers: Vec<String> = self
            .exposed
            .get(&id)
            .into_iter()
            .flatten()
            .filter(|(peer, epoch)| self.done.get(peer).is_none_or(|done| done < epoch))
            .map(|(peer, _)| peer.name.clone())
            .collect();
        peers.sort();
        peers.dedup();
        peers
    }
}

/// Who an agent is: its name and its incarnation (an agent made again under the same name is
/// another). An offer is made to one ([`Agent::offer`]), which alone can load it: the loading
/// agent sends its id to the offering one first ([`to_bytes`](Self::to_bytes)).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AgentId {
    name: String,
    instance: u64,
}

impl AgentId {
    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bytes to send: the incarnation (8 bytes, little-endian), then the name (UTF-8).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.instance.to_le_bytes().to_vec();
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    /// An id from its bytes.
    ///
    /// # Errors
    ///
    /// [`NixlError::Wire`]: too short, or a name that is not UTF-8.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, NixlError> {
        let (instance, name) = bytes
            .split_at_checked(8)
            .ok_or(NixlError::Wire("an agent id is at least 8 bytes"))?;
        Ok(Self {
            name: std::str::from_utf8(name)
                .map_err(|_| NixlError::Wire("an agent's name is not UTF-8"))?
                .to_owned(),
            instance: u64::from_le_bytes(instance.try_into().expect("8 bytes")),
        })
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// A notification from a peer: who sent it and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub from: String,
    /// The message.
    pub message: Vec<u8>,
}

/// A NIXL agent (with its UCX backend) tied to a device: it registers that device's tokens
/// and moves their bytes to and from its peers.
pub struct Agent<'d, 'id, B: Backend> {
    device: &'d Device<'id, B>,
    name: String,
    raw: nixl_sys::Agent,
    _ucx: nixl_sys::Backend,
    /// Where peers' acknowledgements land (see [`Peer::done`]): host bytes registered with
    /// NIXL, offered with every offer, leaked — never freed, as a late peer may still write it.
    mailbox: Span,
    _mailbox: nixl_sys::RegistrationHandle,
    /// This agent's incarnation: an agent made again under the same name numbers its offers
    /// from 1 again, and its peers tell the two apart by it.
    instance: u64,
    book: Mutex<Book>,
}

/// The bytes of an agent's mailbox.
const MAILBOX: usize = 64;

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
    fn raw_ptr(&self) -> *const nixl_sys::Agent {
        &self.raw
    }

    fn book(&self) -> MutexGuard<'_, Book> {
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
    fn expose(
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
    /// agent already said it is done with; NIXL's error. Nothing stays loaded then.
    pub fn load(&self, metadata: &[u8]) -> Result<Peer<'_, 'd, 'id, B>, NixlError> {
        let decoded = self.check(metadata)?;
        let by = std::str::from_utf8(decoded.offered_by)
            .map_err(|_| NixlError::Wire("the offering agent's name is not UTF-8"))?
            .to_owned();
        let remote = self.remote(&by);
        // The one live Peer of `by`: claimed before anything is loaded, so that a failure
        // below never touches the metadata of a Peer in use.
        if remote.live.swap(true, Ordering::AcqRel) {
            return Err(NixlError::AlreadyLoaded(by));
        }
        let loaded = self.load_offer(&decoded, &by, &remote);
        if let Err(e) = loaded {
            remote.live.store(false, Ordering::Release);
            return Err(e);
        }
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
    fn check<'m>(&self, metadata: &'m [u8]) -> Result<Decoded<'m>, NixlError> {
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
    /// acknowledged it already; what was loaded is invalidated again on a failure.
    fn load_offer(
        &self,
        decoded: &Decoded<'_>,
        by: &str,
        remote: &Remote,
    ) -> Result<(), NixlError> {
        // Each incarnation of `by` numbers its offers afresh.
        remote.instance.store(decoded.instance, Ordering::Release);
        let acked = remote.acked(decoded.instance);
        if decoded.epoch <= acked {
            return Err(NixlError::Stale {
                peer: by.to_owned(),
                epoch: decoded.epoch,
                acked,
            });
        }
        let name = self.load_md(decoded.conn)?;
        let fail = |e| {
            // Only `by`'s (claimed) or an agent's without a live Peer: never one in use.
            for n in [&name, by] {
                if n == by || !self.remote(n).live.load(Ordering::Acquire) {
                    let _ = self.raw.invalidate_remote_md(n);
                }
            }
            Err(e)
        };
        if name != by {
            return fail(NixlError::Wire(
                "its connection information is another agent's",
            ));
        }
        match self.load_md(decoded.md) {
            Ok(again) if again == name => Ok(()),
            Ok(_) => fail(NixlError::Wire("its two parts name different agents")),
            Err(e) => fail(e),
        }
    }

    /// NIXL's `loadRemoteMD`: the agent the metadata names. nixl-sys panics on a name that is
    /// not UTF-8 (malformed or edited metadata, its lock no longer held then): an error here.
    fn load_md(&self, metadata: &[u8]) -> Result<String, NixlError> {
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

    /// What this agent knows of the remote agent `name`.
    fn remote(&self, name: &str) -> Arc<Remote> {
        self.book()
            .remotes
            .entry(name.to_owned())
            .or_default()
            .clone()
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
    fn collect(&self) -> Result<(), NixlError> {
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

    fn post<'t, S: Registrable>(
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
    fn start<'t>(
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

/// `span`'s `ranges` (offset, length) as absolute pieces, each checked to lie in it.
fn pieces<'r>(
    span: &'r Span,
    ranges: &'r [(usize, usize)],
) -> impl ExactSizeIterator<Item = Result<(Addr, usize), NixlError>> + Clone + 'r {
    ranges.iter().map(move |&(offset, len)| {
        if offset.checked_add(len).is_none_or(|end| end > span.len) {
            return Err(NixlError::Range {
                offset,
                len,
                size: span.len,
            });
        }
        Ok((span.addr + offset, len))
    })
}

/// NIXL's descriptor lists for a transfer between local `pieces` (address, length; or why
/// one is not) in memory of kind `mem` on device `dev`, and `remote`, in pairs of equal
/// lengths.
fn lists(
    (mem, dev): (MemKind, u64),
    pieces: impl ExactSizeIterator<Item = Result<(Addr, usize), NixlError>> + Clone,
    remote: &[RemoteRange],
) -> Result<(XferDescList<'static>, XferDescList<'static>), NixlError> {
    let mismatch = || NixlError::Mismatch {
        local: pieces.len(),
        local_bytes: pieces.clone().flatten().map(|p| p.1).sum(),
        remote: remote.len(),
        remote_bytes: remote.iter().map(|r| r.len).sum(),
    };
    if pieces.len() != remote.len() {
        return Err(mismatch());
    }
    let mut mine = XferDescList::new(mem_type(mem)).map_err(engine("createXferDlist"))?;
    for (piece, r) in pieces.clone().zip(remote) {
        let (addr, len) = piece?;
        if len != r.len {
            return Err(mismatch());
        }
        mine.add_desc(addr, len, dev);
    }
    Ok((mine, remote_list(remote, mem)?))
}

/// NIXL's descriptor list of the peer's side of a transfer over `remote`: the peer's memory
/// kind and each range's device, as the peer offered them (`nixl_wire::remote_side`) — NIXL
/// finds a remote descriptor only under its own kind and device. `local` is the kind of an
/// empty list.
fn remote_list(remote: &[RemoteRange], local: MemKind) -> Result<XferDescList<'static>, NixlError> {
    let (kind, descs) = nixl_wire::remote_side(remote, local)?;
    let mut theirs = XferDescList::new(mem_type(kind)).map_err(engine("createXferDlist"))?;
    for (addr, len, dev) in descs {
        theirs.add_desc(addr, len, dev);
    }
    Ok(theirs)
}

/// 64 bits no other agent is likely to have had: the process, the time and a count within the
/// process, hashed with the standard library's randomly keyed hasher (so that no arithmetic
/// between the fields can make two agents alike).
fn incarnation() -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    static MADE: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    std::process::id().hash(&mut hasher);
    std::time::SystemTime::now().hash(&mut hasher);
    MADE.fetch_add(1, Ordering::Relaxed).hash(&mut hasher);
    hasher.finish()
}

/// `<incarnation>/<epoch>`, as an acknowledgement carries them.
fn parse_done(text: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(text).ok()?;
    let (instance, epoch) = text.split_once('/')?;
    Some((instance.parse().ok()?, epoch.parse().ok()?))
}

/// A registration that can be [offered](Agent::offer) to a peer: a [`Registered`] committed
/// allocation, the one token written through nothing but itself. A shared prefix is refused —
/// its sharers read its bytes through `&[u8]`, which a peer's write would change under them
/// (`ui-tests/offer_shared_prefix.rs`):
///
/// ```compile_fail,E0277
/// # use memtoken::backend::HostBackend;
/// # use memtoken::nixl::Agent;
/// # use memtoken::{make_guard, Budget, Device};
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults()?);
/// # let binding = device.bind(Budget::unlimited())?;
/// # let agent = Agent::new(&device, "a")?;
/// let prefix = binding.reserve(device.granularity())?.commit_prefix()?;
/// let mut registered = agent.register(prefix)?;
/// let offer = agent.offer(&agent.id(), &mut [&mut registered])?; // error: not `Offered`
/// # Ok(()) }
/// ```
pub trait Offered: sealed::Sealed {
    /// Its id in its agent's book.
    #[doc(hidden)]
    fn id(&self) -> u64;
    /// What NIXL registered.
    #[doc(hidden)]
    fn span(&self) -> SpanOf;
    /// The agent that registered it.
    #[doc(hidden)]
    fn owner(&self) -> *const ();
}

/// What a registration covers (for [`Offered`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct SpanOf {
    addr: usize,
    len: usize,
    kind: MemKind,
    dev: u64,
}

mod sealed {
    pub trait Sealed {}
}

/// A token registered with NIXL by an [`Agent`]: it owns the token; a [`Transfer`] borrows it.
/// It lends the token back ([`token`](Self::token)) only while no peer and no transfer can
/// touch the memory, and gives it up ([`release`](Self::release)) only with every peer it was
/// offered to done — otherwise the memory is withheld for good.
///
/// Releasing its token under an in-flight transfer does not compile
/// (`ui-tests/release_under_transfer.rs`):
///
/// ```compile_fail,E0505
/// # use memtoken::backend::HostBackend;
/// # use memtoken::nixl::Agent;
/// # use memtoken::{make_guard, Budget, Device};
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults()?);
/// # let binding = device.bind(Budget::unlimited())?;
/// # let agent = Agent::new(&device, "a")?;
/// # let peer = agent.load(&[])?;
/// let source = agent.register(binding.reserve(4096)?.commit()?)?;
/// let write = agent.write(&source, &[(0, 4096)], &peer, &[peer.range(0, 0, 4096)?], None)?;
/// let token = source.release()?; // error: `source` is borrowed by the transfer
/// write.wait(memtoken::nixl::DROP_WAIT)?;
/// # Ok(()) }
/// ```
pub struct Registered<'a, 'b, 'id, B: Backend, S: Registrable> {
    agent: &'a Agent<'a, 'id, B>,
    token: ManuallyDrop<Allocation<'b, 'id, B, S>>,
    handle: ManuallyDrop<nixl_sys::RegistrationHandle>,
    span: Span,
    id: u64,
    /// Transfers of it: in flight until seen complete; poisoned if one did not finish.
    marks: Marks,
}

impl<B: Backend> sealed::Sealed for Registered<'_, '_, '_, B, Committed> {}

/// Only a committed allocation is offered: it alone is written through nothing but itself (a
/// prefix's owner or sharer shares its bytes, which a peer's write would change under them).
impl<B: Backend> Offered for Registered<'_, '_, '_, B, Committed> {
    fn id(&self) -> u64 {
        self.id
    }

    fn span(&self) -> SpanOf {
        SpanOf {
            addr: self.span.addr,
            len: self.span.len,
            kind: self.span.mem,
            dev: self.span.dev,
        }
    }

    fn owner(&self) -> *const () {
        self.agent.raw_ptr().cast()
    }
}

impl<'a, 'b, 'id, B: Backend, S: Registrable> Registered<'a, 'b, 'id, B, S> {
    /// The registered memory's length.
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// Whether it is empty (never: a token holds at least a granule).
    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    /// Whether a transfer that used it did not finish, is still in flight or was forgotten
    /// (`mem::forget`): the engine may still touch it, and it can only be withheld.
    pub fn is_poisoned(&self) -> bool {
        self.marks.busy()
    }

    /// Why the memory may still be touched: peers offered it that are not done, or a transfer
    /// in flight, forgotten or unfinished. `None` when nothing can touch it.
    fn exposure(&self) -> Option<NixlError> {
        let _ = self.agent.collect(); // acknowledgements that arrived count
        let peers = self.agent.book().pending(self.id);
        let poisoned = self.is_poisoned();
        (poisoned || !peers.is_empty()).then_some(NixlError::Exposed { peers, poisoned })
    }

    /// The token — its bytes, through its views — while nothing else can touch the memory: no
    /// peer it was offered to is still holding it and no transfer of it runs (a READ borrows
    /// the registration mutably; a new offer too).
    ///
    /// # Errors
    ///
    /// [`NixlError::Exposed`]: which peers may still touch it, or an unfinished transfer.
    pub fn token(&self) -> Result<&Allocation<'b, 'id, B, S>, NixlError> {
        match self.exposure() {
            None => Ok(&self.token),
            Some(e) => Err(e),
        }
    }

    /// Deregisters the memory and gives the token back, once every peer it was offered to is
    /// done with it (see [`Peer::done`], [`Agent::peer_exited`]) and every transfer of it has
    /// finished. Otherwise the memory is withheld for good — never reused, its VA and
    /// physical memory kept — and the error says which peers (and whether a transfer) may
    /// still touch it; [`Device::withheld_for_peers`](crate::Device::withheld_for_peers) and
    /// the device's close report name them too.
    ///
    /// # Errors
    ///
    /// [`NixlError::Exposed`], the memory withheld.
    pub fn release(self) -> Result<Allocation<'b, 'id, B, S>, NixlError> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so `settle` runs once.
        unsafe { this.settle() }
    }

    /// Deregisters and gives the token back, or withholds it (see
    /// [`release`](Self::release)).
    ///
    /// # Safety
    ///
    /// Called once; the registration is not used after (its token and handle are taken).
    unsafe fn settle(&mut self) -> Result<Allocation<'b, 'id, B, S>, NixlError> {
        let exposure = self.exposure();
        // SAFETY: the caller's promise: taken once.
        let (token, handle) = unsafe {
            (
                ManuallyDrop::take(&mut self.token),
                ManuallyDrop::take(&mut self.handle),
            )
        };
        self.agent.book().exposed.remove(&self.id);
        let Some(e) = exposure else {
            drop(handle); // deregistered (nixl-sys discards NIXL's status)
            return Ok(token);
        };
        let peers = match &e {
            NixlError::Exposed { peers, .. } if !peers.is_empty() => peers.join(", "),
            _ => "a transfer in flight, forgotten or unfinished".to_owned(),
        };
        if self.is_poisoned() {
            // The engine may still run a request over it: NIXL's registration stays.
            std::mem::forget(handle);
        } else {
            drop(handle);
        }
        token.withhold_for_peer(peers);
        Err(e)
    }
}

impl<B: Backend, S: Registrable> Drop for Registered<'_, '_, '_, B, S> {
    fn drop(&mut self) {
        // SAFETY: once, here; nothing uses `self` after. The token is dropped or withheld.
        let _ = unsafe { self.settle() };
    }
}

impl<B: Backend, S: Registrable> fmt::Debug for Registered<'_, '_, '_, B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("addr", &format_args!("{:#x}", self.span.addr))
            .field("len", &self.span.len)
            .field("poisoned", &self.is_poisoned())
            .finish()
    }
}

/// A peer's metadata as it travels: memtoken's header (the format's version, the offer's
/// epoch, and each region offered with its memory kind and device), NIXL's connection
/// information, and the offered registrations' descriptors. Little-endian, fixed-size fields;
/// the parts length-prefixed. Metadata of another version of the format — the old `MTNIXL01`,
/// whose regions carry no kind or device — is refused ([`NixlError::Version`]), never misread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerMetadata(Vec<u8>);

impl PeerMetadata {
    /// The bytes to send.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

// Defined with the wire format, which builds it from a decoded offer without NIXL.
pub use crate::nixl_wire::RemoteRange;

/// A peer whose metadata an agent loaded: its offered regions are reachable until it is
/// [done](Self::done) (or dropped, which does the same as far as it can).
pub struct Peer<'a, 'd, 'id, B: Backend> {
    agent: &'a Agent<'d, 'id, B>,
    name: String,
    epoch: u64,
    /// Each region offered, with its memory kind and device.
    regions: Vec<nixl_wire::Region>,
    /// The peer's mailbox, where the acknowledgement lands.
    mailbox: u64,
    /// The peer's connection information and its mailbox's descriptor, loaded again after its
    /// regions' metadata is invalidated, so that the acknowledgement can still be sent.
    conn: Vec<u8>,
    mailbox_md: Vec<u8>,
    /// What this agent knows of it: its transfers, its last acknowledged offer.
    remote: Arc<Remote>,
    finished: bool,
}

impl<B: Backend> Peer<'_, '_, '_, B> {
    /// Its agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The regions it offered: start and length of each.
    pub fn regions(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + '_ {
        self.regions.iter().map(|r| (r.addr, r.len))
    }

    /// `len` bytes at `offset` of its `region`-th offered region, in that region's memory kind
    /// and device (as the peer offered it).
    ///
    /// # Errors
    ///
    /// [`NixlError::NoRegion`] past the last region, [`NixlError::Range`] outside it.
    pub fn range(
        &self,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<RemoteRange, NixlError> {
        Ok(nixl_wire::remote_desc(&self.regions, region, offset, len)?)
    }

    /// NIXL's descriptor list of the peer's side of a transfer over `remote`, as a transfer
    /// with this peer builds it — built, not posted (feature `test-hooks`: memtoken's tests).
    ///
    /// # Errors
    ///
    /// [`NixlError::MixedKinds`]; NIXL's error.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn remote_list(&self, remote: &[RemoteRange]) -> Result<XferDescList<'static>, NixlError> {
        let (local, _) = kind(self.agent.device.backend().location())?;
        remote_list(remote, local)
    }

    /// Done with the peer's memory: its metadata is invalidated here (no transfer can reach
    /// it any more), then the peer is told so — the acknowledgement its agent takes as the
    /// proof that this agent will not touch what it offered. No transfer with it can run: each
    /// borrows the peer.
    ///
    /// # Errors
    ///
    /// [`NixlError::Tainted`] if a transfer with it did not finish (nothing is acknowledged:
    /// the peer withholds what it offered); NIXL's error.
    pub fn done(mut self) -> Result<(), NixlError> {
        self.finish()
    }

    /// Adds a later offer of the same agent (its regions follow those offered before, in
    /// [`regions`](Self::regions) and [`range`](Self::range)); [`done`](Self::done) then
    /// acknowledges it too. Taking the peer mutably, it waits for no transfer with it.
    ///
    /// # Errors
    ///
    /// As for [`Agent::load`], and [`NixlError::Wire`] for an offer of another agent; the
    /// peer is unchanged then.
    pub fn extend(&mut self, metadata: &[u8]) -> Result<(), NixlError> {
        let decoded = self.agent.check(metadata)?;
        if decoded.offered_by != self.name.as_bytes()
            || decoded.instance != self.remote.instance.load(Ordering::Acquire)
        {
            return Err(NixlError::Wire("an offer of another agent than the peer's"));
        }
        if decoded.epoch <= self.epoch {
            return Err(NixlError::NotNewer {
                epoch: decoded.epoch,
                loaded: self.epoch,
            });
        }
        let again = self.agent.load_md(decoded.md)?;
        if again != self.name {
            // Not this peer's: its descriptors go again (no Peer of that agent is in use).
            if !self.agent.remote(&again).live.load(Ordering::Acquire) {
                let _ = self.agent.raw.invalidate_remote_md(&again);
            }
            return Err(NixlError::Wire("its descriptors are another agent's"));
        }
        self.epoch = decoded.epoch;
        self.regions.extend(decoded.regions);
        self.mailbox = decoded.mailbox;
        self.mailbox_md = decoded.mailbox_md.to_vec();
        Ok(())
    }

    fn finish(&mut self) -> Result<(), NixlError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        // First: these offers can never be loaded again, whatever happens below.
        let instance = self.remote.instance.load(Ordering::Acquire);
        let mut acked = crate::backend::lock(&self.remote.acked);
        let last = acked.entry(instance).or_insert(0);
        *last = (*last).max(self.epoch);
        drop(acked);
        let acknowledged = self.acknowledge();
        // The name may be loaded afresh from now on (its metadata is invalidated).
        self.remote.live.store(false, Ordering::Release);
        acknowledged
    }

    /// Invalidates the peer's metadata, then acknowledges its offers with a write into its
    /// mailbox whose completion says it went out, unless a transfer with it may still run.
    fn acknowledge(&self) -> Result<(), NixlError> {
        let raw = &self.agent.raw;
        raw.invalidate_remote_md(&self.name)
            .map_err(engine("invalidateRemoteMD"))?;
        // A transfer in flight, forgotten or unfinished may still touch the peer's memory.
        if self.remote.marks.busy() {
            return Err(NixlError::Tainted(self.name.clone()));
        }
        // Connection information and the mailbox only: no region of the peer's is reachable.
        let sent = [&self.conn, &self.mailbox_md]
            .into_iter()
            .try_for_each(|part| self.agent.load_md(part).map(drop))
            .and_then(|()| self.send_acknowledgement());
        // Sent or not, the connection goes too, so that an agent of the name (this one or a
        // new incarnation) can be loaded afresh.
        let _ = raw.invalidate_remote_md(&self.name);
        sent
    }

    /// The acknowledgement: a write into the peer's mailbox, with the notification, waited
    /// for (its completion says it went out).
    fn send_acknowledgement(&self) -> Result<(), NixlError> {
        let raw = &self.agent.raw;
        // Which incarnation says so, and up to which offer.
        let mut message = DONE.to_vec();
        let said = format!("{}/{}", self.agent.instance, self.epoch);
        message.extend_from_slice(said.as_bytes());
        let own = &self.agent.mailbox;
        let mut mine = XferDescList::new(MemType::Dram).map_err(engine("createXferDlist"))?;
        mine.add_desc(own.addr, 8, 0);
        let mut theirs = XferDescList::new(MemType::Dram).map_err(engine("createXferDlist"))?;
        theirs.add_desc(self.mailbox as usize, 8, 0);
        let mut args = nixl_sys::OptArgs::new().map_err(engine("createOptArgs"))?;
        args.set_has_notification(true)
            .map_err(engine("optArgsSetHasNotif"))?;
        args.set_notification_message(&message)
            .map_err(engine("optArgsSetNotifMsg"))?;
        let req = raw
            .create_xfer_req(XferOp::Write, &mine, &theirs, &self.name, Some(&args))
            .map_err(engine("createXferReq"))?;
        // The mailboxes are never given back: nothing for the acknowledgement to mark.
        let (own_marks, their_marks) = (Marks::default(), Marks::default());
        let ack = Transfer::post(raw, req, &own_marks, &their_marks, 8)?;
        ack.wait(DROP_WAIT)
    }
}

impl<B: Backend> Drop for Peer<'_, '_, '_, B> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl<B: Backend> fmt::Debug for Peer<'_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer")
            .field("name", &self.name)
            .field("epoch", &self.epoch)
            .field("regions", &self.regions.len())
            .finish()
    }
}

/// A posted NIXL transfer. It borrows its local registration (mutably for a READ) and its
/// peer; [`poll`](Self::poll) and [`wait`](Self::wait) say when it is done. Dropped before,
/// it waits for NIXL for at most [`DROP_WAIT`], then poisons the local registration and
/// taints the peer (see the module's docs). Forgotten (`mem::forget`), it stays in flight for
/// good: the registration is withheld, the peer never acknowledges.
#[must_use = "a transfer dropped at once waits for itself"]
pub struct Transfer<'t> {
    raw: &'t nixl_sys::Agent,
    req: Option<nixl_sys::XferRequest>,
    /// The local memory's marks (a registration's, a registered KV cache's).
    local: &'t Marks,
    /// The remote agent's marks.
    remote: &'t Marks,
    bytes: usize,
    /// Seen complete, or given up.
    done: bool,
    /// Given up: failed or timed out.
    failed: bool,
    /// Counted in flight on both marks (until seen complete).
    counted: bool,
}

impl<'t> Transfer<'t> {
    /// Posts `req`, counted in flight on `local` and `remote` from before the post until a
    /// poll sees it complete.
    ///
    /// # Errors
    ///
    /// NIXL's error; what the request may have started counts as unfinished (poisoned).
    fn post(
        raw: &'t nixl_sys::Agent,
        req: nixl_sys::XferRequest,
        local: &'t Marks,
        remote: &'t Marks,
        bytes: usize,
    ) -> Result<Self, NixlError> {
        local.in_flight.fetch_add(1, Ordering::AcqRel);
        remote.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut transfer = Self {
            raw,
            req: Some(req),
            local,
            remote,
            bytes,
            done: false,
            failed: false,
            counted: true,
        };
        match raw.post_xfer_req(transfer.req.as_ref().expect("just made"), None) {
            Ok(true) => Ok(transfer),
            Ok(false) => {
                transfer.complete();
                Ok(transfer)
            }
            Err(e) => {
                // Whether the engine started part of it is not said: unfinished, and the
                // request is leaked rather than released under it.
                transfer.give_up(true);
                Err(engine("postXferReq")(e))
            }
        }
    }

    /// Seen complete: no longer in flight.
    fn complete(&mut self) {
        self.done = true;
        if std::mem::take(&mut self.counted) {
            self.local.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.remote.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Transfer<'_> {
    /// The bytes it moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether it is done, asking NIXL once.
    ///
    /// # Errors
    ///
    /// NIXL's error: the transfer failed, and its local registration is poisoned.
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        if self.done {
            return if self.failed {
                Err(NixlError::Failed)
            } else {
                Ok(true)
            };
        }
        let req = self.req.as_ref().expect("held until done");
        match self.raw.get_xfer_status(req) {
            Ok(XferStatus::Success) => {
                self.complete();
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => {
                self.give_up(false);
                Err(engine("getXferStatus")(e))
            }
        }
    }

    /// Waits until it is done, for at most `limit`; hands the borrows back.
    ///
    /// # Errors
    ///
    /// NIXL's error, or [`NixlError::TimedOut`]: the local registration is poisoned.
    pub fn wait(mut self, limit: Duration) -> Result<(), NixlError> {
        if !self.finish_within(limit)? {
            self.give_up(true);
            return Err(NixlError::TimedOut(limit));
        }
        Ok(())
    }

    /// Polls until done or `limit` has passed: whether done. Each poll drives the engine's
    /// progress, so polls come back to back for the first 100 µs (a transfer of a few pages is
    /// done by then; the clock is read once every 64 polls), then the thread yields between
    /// polls up to a millisecond, then sleeps between them (200 µs at most).
    fn finish_within(&mut self, limit: Duration) -> Result<bool, NixlError> {
        let start = Instant::now();
        let mut polls = 0u32;
        let mut waited = Duration::ZERO;
        while !self.poll()? {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) || waited >= Duration::from_micros(100) {
                waited = start.elapsed();
                if waited >= limit {
                    return Ok(false);
                }
            }
            if waited < Duration::from_micros(100) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200).min(limit - waited));
            }
        }
        Ok(true)
    }

    /// Poisons the local memory's marks and the remote agent's (it stays counted in flight); a
    /// request still in progress is leaked, never released under the engine.
    fn give_up(&mut self, in_progress: bool) {
        self.local.poisoned.store(true, Ordering::Release);
        self.remote.poisoned.store(true, Ordering::Release);
        self.done = true;
        self.failed = true;
        if in_progress {
            std::mem::forget(self.req.take());
        }
    }

    /// Waits, as a drop does, for at most [`DROP_WAIT`].
    fn wait_in_drop(&mut self) -> Result<(), NixlError> {
        if !self.finish_within(DROP_WAIT)? {
            self.give_up(true);
            return Err(NixlError::TimedOut(DROP_WAIT));
        }
        Ok(())
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.wait_in_drop();
        }
    }
}

impl fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("bytes", &self.bytes)
            .field("done", &self.done)
            .finish()
    }
}
