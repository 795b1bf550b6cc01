//! Moving bytes between agents — processes, machines — through NVIDIA NIXL (feature `nixl`),
//! with the borrows and proofs NIXL itself does not give.
//! Guide: [`guide::nixl`](crate::guide::nixl).
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

mod agent;
mod blocks;
mod peer;
mod registered;
#[cfg(test)]
mod tests;
mod transfer;

pub use blocks::{BlockTransfer, OfferedTable, RegisteredCache};

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, Location};
use crate::device::Device;
use crate::kv::KvError;
use crate::nixl_wire::{self, MemKind, WireError};
use crate::state::Committed;
use crate::transfer::Registrable;
use nixl_sys::{MemType, XferDescList};
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
