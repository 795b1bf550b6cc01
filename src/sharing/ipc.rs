//! Shared prefixes across processes: an [`Export`] of an [`ExportablePrefix`]'s physical memory,
//! the message that hands it over a Unix domain socket ([`PrefixMessage`], descriptors passed
//! with `SCM_RIGHTS`), the [`Offer`] a receiver decodes from it, and the [`ImportedPrefix`] —
//! a read-only mapping token in the importing process.
//!
//! The exporter keeps its memory alive while the export is outstanding (an [`Export`] holds a
//! reference on it, counted by [`Device::outstanding_exports`](crate::Device::outstanding_exports));
//! the importer owns nothing of it: its token owns zero bytes, maps the memory read-only and
//! gives back its own handles, once, when it goes.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::Owner;
use crate::allocation::Allocation;
use crate::backend::{
    Access, Backend, BackendError, Exportable, HandleKind, HandleType, Op, PosixFd, Shareable,
};
use crate::device::Binding;
use crate::error::ReserveError;
use crate::residual::{Held, SharedPhys};
use crate::state::Wait;
use crate::state::{
    Live, Readable, Retired, Retiring, State,
    sealed::{self, Repr},
};
use crate::unwind::Scope;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketType,
};
use std::io::{IoSlice, IoSliceMut};
use std::marker::PhantomData;
use std::mem::{ManuallyDrop, MaybeUninit};

/// The length of a [`PrefixMessage`] on the wire, in bytes.
pub const MESSAGE_LEN: usize = 64;
/// The first bytes of every message.
const MAGIC: [u8; 8] = *b"MTPREFIX";
/// The message format's version.
const VERSION: u16 = 1;
/// The most descriptors a message carries: the body's and the boundary granule's.
const MAX_FDS: usize = 2;

/// An imported prefix: another process's prefix, mapped read-only into this one. It owns zero
/// bytes here (nothing is charged to its binding), lends `&[u8]` and never `&mut [u8]`, and
/// gives back this process's handles on the memory exactly once, when it is released or
/// dropped — with the same teardown order and quarantine as a local
/// [`PrefixMapping`](crate::sharing::PrefixMapping). Made by [`Binding::import`].
///
/// It cannot be written through:
///
/// ```compile_fail,E0599
/// # use memtoken::{make_guard, Budget, Device, sharing::ImportedPrefix};
/// # use memtoken::backend::HostBackend;
/// fn write(imported: &mut ImportedPrefix<'_, '_, HostBackend>) {
///     imported.as_mut_slice()[0] = 1;
/// }
/// ```
///
/// nor outlive the binding it was imported through:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device, sharing::Offer};
/// # use memtoken::backend::HostBackend;
/// fn keep(offer: Offer) {
///     make_guard!(guard);
///     let device = Device::new(guard, HostBackend::with_defaults().unwrap());
///     let binding = device.bind(Budget::unlimited()).unwrap();
///     let imported = binding.import(offer).unwrap();
///     drop(binding);
///     drop(imported);
/// }
/// ```
pub type ImportedPrefix<'b, 'id, B> = Allocation<'b, 'id, B, Imported>;

/// State of an [`ImportedPrefix`]: a read-only mapping of another process's physical memory.
#[derive(Debug)]
pub enum Imported {}

impl sealed::Sealed for Imported {}

impl Repr for Imported {
    /// This process's handles on the imported memory: the body's and the boundary's.
    type Parts<B: Backend> = (Option<(B::Phys, usize)>, (B::Phys, usize));

    fn retire<B: Backend>((body, boundary): Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let (backend, len) = (at.backend, at.len);
        let imported = body.into_iter().chain([boundary]).collect();
        Retired {
            held: Held {
                imported,
                ..Held::mapped(len)
            },
            // Work may still read the mapping: its release waits for a fence.
            fence: Wait::on(backend.fence_for(&[at.addr])),
            charged: 0,
            tail: 0,
        }
    }
}

impl State for Imported {
    const NAME: &'static str = "ImportedPrefix";
}
impl Live for Imported {}
impl Readable for Imported {}

/// Why a prefix could not be handed over, received or decoded. Nothing was mapped; every
/// descriptor received with the message has been closed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The socket call failed.
    #[error("the socket call failed")]
    Io(#[from] std::io::Error),
    /// The peer closed the socket, or sent fewer bytes than a message has.
    #[error("truncated message: {got} of {MESSAGE_LEN} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
    },
    /// More descriptors (or other control data) came than a message carries: the kernel
    /// dropped the rest.
    #[error("the message's control data was truncated: more than {MAX_FDS} descriptors sent")]
    ControlTruncated,
    /// Not a prefix message, or one of another version.
    #[error("not a memtoken prefix message (version {VERSION}): {0}")]
    Malformed(&'static str),
    /// A handle kind this message cannot carry over a socket.
    #[error("handle kind {0:?} does not travel as a descriptor over a socket")]
    NotADescriptor(HandleType),
    /// Not as many descriptors as the message says.
    #[error("the message says {expected} descriptor(s), {got} came with it")]
    Descriptors {
        /// What the message says.
        expected: usize,
        /// What came.
        got: usize,
    },
    /// A descriptor is a regular file shorter than the message says.
    #[error(
        "descriptor {index} holds {size:#x} bytes, the message claims {len:#x} at offset \
         {offset:#x}: refused, never mapped"
    )]
    TooSmall {
        /// Which descriptor (0: the first).
        index: usize,
        /// Offset the message claims.
        offset: u64,
        /// Length the message claims.
        len: u64,
        /// The file's real size.
        size: u64,
    },
}

impl From<WireError> for crate::Error {
    fn from(e: WireError) -> Self {
        Self::plain(e)
    }
}

/// Why an [`Offer`] could not be imported. Nothing stays mapped or reserved (what could not be
/// undone is in the device's quarantine); the offer's descriptors are closed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The exporter's granularity is not this device's.
    #[error(
        "the prefix was laid out in granules of {offer:#x} bytes, this device's are {device:#x}: \
         import it on a device of the same granularity"
    )]
    Granularity {
        /// The exporter's.
        offer: usize,
        /// This device's.
        device: usize,
    },
    /// Reserving the VA failed.
    #[error("reserving the imported prefix's VA failed")]
    Reserve(#[source] Box<ReserveError>),
    /// The backend refused the handle or a mapping of it.
    #[error("importing or mapping the prefix failed")]
    Backend(#[source] Box<BackendError>),
}

impl From<ReserveError> for ImportError {
    fn from(e: ReserveError) -> Self {
        Self::Reserve(Box::new(e))
    }
}

impl From<BackendError> for ImportError {
    fn from(e: BackendError) -> Self {
        Self::Backend(Box::new(e))
    }
}

impl crate::error::sealed::Sealed for ImportError {}

impl crate::error::Failure for ImportError {
    fn summary(&self) -> &'static str {
        "the prefix could not be imported"
    }
}

/// The message that hands a prefix over: its layout, its handle kind and the exporter's
/// generation. Fixed-size ([`MESSAGE_LEN`] bytes, little-endian); the descriptors travel
/// beside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMessage {
    /// The prefix's length in bytes.
    pub len: u64,
    /// The body's length (all but the boundary granule; 0 for a one-granule prefix).
    pub body_len: u64,
    /// The exporter's granularity.
    pub granularity: u64,
    /// The kind of the handles.
    pub kind: HandleType,
    /// The exported prefix's generation in the exporter.
    pub generation: u64,
    /// Where the body starts in its file.
    pub body_offset: u64,
    /// Where the boundary granule starts in its file.
    pub boundary_offset: u64,
}

fn u64_at(bytes: &[u8; MESSAGE_LEN], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

impl PrefixMessage {
    /// How many descriptors come with it: one per physical allocation.
    pub fn descriptors(&self) -> usize {
        1 + usize::from(self.body_len > 0)
    }

    /// The bytes on the wire.
    pub fn encode(&self) -> [u8; MESSAGE_LEN] {
        let mut out = [0u8; MESSAGE_LEN];
        out[..8].copy_from_slice(&MAGIC);
        out[8..10].copy_from_slice(&VERSION.to_le_bytes());
        out[10] = self.kind.code();
        out[11] = self.descriptors() as u8;
        let words = [
            self.len,
            self.body_len,
            self.granularity,
            self.generation,
            self.body_offset,
            self.boundary_offset,
        ];
        for (i, w) in words.iter().enumerate() {
            out[16 + 8 * i..24 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Reads and checks a message: every field is validated, nothing is trusted.
    ///
    /// # Errors
    ///
    /// [`WireError::Truncated`] for fewer than [`MESSAGE_LEN`] bytes, [`WireError::Malformed`]
    /// for more, or for a field out of its range (magic, version, reserved bytes, a layout
    /// that is not whole granules ending in one boundary granule), and
    /// [`WireError::NotADescriptor`] for a kind that cannot travel over a socket.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let bytes: &[u8; MESSAGE_LEN] = match bytes.try_into() {
            Ok(b) => b,
            Err(_) if bytes.len() < MESSAGE_LEN => {
                return Err(WireError::Truncated { got: bytes.len() });
            }
            Err(_) => return Err(WireError::Malformed("longer than a message")),
        };
        let bad = |what| Err(WireError::Malformed(what));
        if bytes[..8] != MAGIC {
            return bad("wrong magic");
        }
        if bytes[8..10] != VERSION.to_le_bytes() {
            return bad("unknown version");
        }
        if bytes[12..16] != [0; 4] {
            return bad("reserved bytes are not zero");
        }
        let kind = match HandleType::from_code(bytes[10]) {
            Some(HandleType::PosixFd) => HandleType::PosixFd,
            Some(other) => return Err(WireError::NotADescriptor(other)),
            None => return bad("unknown handle kind"),
        };
        let message = Self {
            len: u64_at(bytes, 16),
            body_len: u64_at(bytes, 24),
            granularity: u64_at(bytes, 32),
            kind,
            generation: u64_at(bytes, 40),
            body_offset: u64_at(bytes, 48),
            boundary_offset: u64_at(bytes, 56),
        };
        let g = message.granularity;
        if !g.is_power_of_two() || usize::try_from(g).is_err() {
            return bad("granularity is not a power of two");
        }
        if message.len == 0 || !message.len.is_multiple_of(g) || message.len > isize::MAX as u64 {
            return bad("length is not a positive whole number of granules");
        }
        if message.body_len.checked_add(g) != Some(message.len) {
            return bad("the boundary is not exactly the last granule");
        }
        if message.body_len == 0 && message.body_offset != 0 {
            return bad("a body offset without a body");
        }
        if message.generation == 0 {
            return bad("generation 0");
        }
        if usize::from(bytes[11]) != message.descriptors() {
            return bad("descriptor count does not match the layout");
        }
        Ok(message)
    }

    /// `(offset, len)` of each physical allocation, in the order of the descriptors.
    fn pieces(&self) -> impl Iterator<Item = (u64, u64)> {
        let body = (self.body_len > 0).then_some((self.body_offset, self.body_len));
        body.into_iter()
            .chain([(self.boundary_offset, self.granularity)])
    }
}

/// A prefix offered by another process, received and checked but not mapped: the message
/// and its descriptors, each a regular file at least as long as the message claims (checked
/// with `fstat`), or a descriptor of another kind (a CUDA driver's), which the importing
/// backend checks with what it knows (the driver refuses a descriptor that names no exported
/// memory). Import it with [`Binding::import`]; dropping it closes the descriptors.
#[derive(Debug)]
pub struct Offer {
    message: PrefixMessage,
    fds: Vec<OwnedFd>,
}

impl Offer {
    /// Decodes `bytes` and checks `fds` against it: exactly as many as the message says, each
    /// regular file among them holding at least `offset + len` bytes. Other descriptors are
    /// left to the backend that imports them (the host refuses anything but a sealed `memfd`).
    ///
    /// # Errors
    ///
    /// As [`PrefixMessage::decode`], [`WireError::Descriptors`] for a wrong count, and
    /// [`WireError::TooSmall`] for a regular file shorter than its piece.
    pub fn new(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Self, WireError> {
        let message = PrefixMessage::decode(bytes)?;
        if fds.len() != message.descriptors() {
            let (expected, got) = (message.descriptors(), fds.len());
            return Err(WireError::Descriptors { expected, got });
        }
        for (index, ((offset, len), fd)) in message.pieces().zip(&fds).enumerate() {
            let size = match rustix::fs::fstat(fd) {
                Ok(st) if rustix::fs::FileType::from_raw_mode(st.st_mode).is_file() => {
                    u64::try_from(st.st_size).unwrap_or(0)
                }
                // Not a file: its size means nothing here; the importing backend checks it.
                Ok(_) => continue,
                Err(e) => return Err(WireError::Io(e.into())),
            };
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(WireError::TooSmall {
                    index,
                    offset,
                    len,
                    size,
                });
            }
        }
        Ok(Self { message, fds })
    }

    /// Receives one message and its descriptors from `socket` (a connected Unix domain
    /// socket), and checks them as [`Offer::new`] does.
    ///
    /// On a record socket (`SOCK_SEQPACKET`, `SOCK_DGRAM`) one record is exactly one message:
    /// a shorter record is [`WireError::Truncated`] and a longer one [`WireError::Malformed`]
    /// — one read, never stitched to the record after it, and the next call reads the next
    /// record. On a stream socket (`SOCK_STREAM`) the message may come in pieces, and reads go
    /// on until all [`MESSAGE_LEN`] bytes have come. Every read checks that no control data
    /// (descriptors) was cut off.
    ///
    /// # A peer that stalls
    ///
    /// On a blocking socket this waits as long as the socket does: a peer that sends part of
    /// a message on a stream socket (or nothing at all) and then neither sends the rest nor
    /// closes keeps this call waiting for good. Bound the wait on the socket itself before
    /// calling — `SO_RCVTIMEO` (`UnixStream::set_read_timeout`, or
    /// `rustix::net::sockopt::set_socket_timeout`) — or make it non-blocking: the call then
    /// returns [`WireError::Io`] (`WouldBlock`) when the time is up or nothing is there, and
    /// the descriptors received so far are closed. A record socket never waits for a second
    /// record.
    ///
    /// # Errors
    ///
    /// [`WireError::Io`] if a socket call fails or times out, [`WireError::ControlTruncated`]
    /// if more descriptors came than a message carries, [`WireError::Truncated`] if the peer
    /// closed before a whole message or sent a short record, [`WireError::Malformed`] for a
    /// record longer than a message; else as [`Offer::new`].
    pub fn recv(socket: impl AsFd) -> Result<Self, WireError> {
        let socket = socket.as_fd();
        let records = rustix::net::sockopt::socket_type(socket).map_err(std::io::Error::from)?
            != SocketType::STREAM;
        let mut buf = [0u8; MESSAGE_LEN];
        let mut fds = Vec::new();
        let mut got = 0;
        while got < MESSAGE_LEN {
            let (n, flags) = recv_some(socket, &mut buf[got..], &mut fds)?;
            if records {
                if flags.contains(ReturnFlags::TRUNC) {
                    return Err(WireError::Malformed("a record longer than a message"));
                }
                if n < MESSAGE_LEN {
                    return Err(WireError::Truncated { got: n });
                }
            } else if n == 0 {
                return Err(WireError::Truncated { got });
            }
            got += n;
        }
        Self::new(&buf, fds)
    }

    /// The message.
    pub fn message(&self) -> &PrefixMessage {
        &self.message
    }
}

/// One read of `socket` into `buf`: the bytes read and the flags, the descriptors that came
/// with them added to `fds` (closed with it on any error).
///
/// # Errors
///
/// [`WireError::Io`] if the call fails, [`WireError::ControlTruncated`] if the kernel cut off
/// control data (more descriptors than a message carries).
fn recv_some(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> Result<(usize, ReturnFlags), WireError> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let received = rustix::net::recvmsg(socket, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
        .map_err(std::io::Error::from)?;
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if received.flags.contains(ReturnFlags::CTRUNC) {
        return Err(WireError::ControlTruncated);
    }
    Ok((received.bytes, received.flags))
}

/// Sends `message` and `fds` on `socket`, the descriptors with the first byte.
fn send(
    socket: BorrowedFd<'_>,
    message: &PrefixMessage,
    fds: &[BorrowedFd<'_>],
) -> Result<(), WireError> {
    let bytes = message.encode();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(WireError::Malformed("too many descriptors for one message"));
    }
    let iov = [IoSlice::new(&bytes)];
    let mut sent = rustix::net::sendmsg(socket, &iov, &mut control, SendFlags::NOSIGNAL)
        .map_err(std::io::Error::from)?;
    while sent < MESSAGE_LEN {
        sent += rustix::net::send(socket, &bytes[sent..], SendFlags::NOSIGNAL)
            .map_err(std::io::Error::from)?;
    }
    Ok(())
}

/// An export of a prefix's physical memory to one other process: the handles to send
/// ([`send`](Export::send)) and a reference on the memory, so it lives while the export is
/// outstanding, whatever happens to the prefix and its local sharers. The exporter's device
/// counts it ([`Device::outstanding_exports`](crate::Device::outstanding_exports)). It
/// borrows its binding like any token.
///
/// # When an export ends
///
/// When this token is dropped (or [`end`](Export::end)ed): the reference goes back (the last
/// one releases the memory here), and the exporter's handles are closed. The peer's mapping is
/// not ended by it — the peer holds handles of its own, and the memory lives while any process
/// maps it (on CUDA the driver counts, facts 22 and 27; on the host each exportable allocation is a
/// `memfd` of its own, which the kernel keeps while it is mapped or open) — so ending early
/// is safe for both processes, but from then on the exporter's ledger no longer counts the
/// memory the peer still maps. End an export once the peer has confirmed it is done with it:
/// it exited, or it said so on the socket.
///
/// Exporting is one-way for writes: once a prefix was exported, its owner never writes it
/// again (`as_mut_slice` and the other writers give `None` for good, even after every export
/// ended), since an importer may still read it; on the host the file is also sealed against
/// every write (`F_SEAL_WRITE`), in every process, at the first export. One export may be sent
/// to several peers; it is counted once.
#[must_use = "dropping an export ends it at once"]
pub struct Export<'b, 'id, B: Exportable<K>, K: HandleKind> {
    binding: &'b Binding<'b, 'id, B>,
    shared: ManuallyDrop<SharedPhys<B::Phys>>,
    handles: Vec<Shareable>,
    message: PrefixMessage,
    kind: PhantomData<K>,
}

impl<B: Exportable<K>, K: HandleKind> std::fmt::Debug for Export<'_, '_, B, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("message", &self.message)
            .field("handles", &self.handles)
            .finish_non_exhaustive()
    }
}

impl<'b, 'id, B: Exportable<K>, K: HandleKind> Allocation<'b, 'id, B, Owner<K>> {
    /// Exports this prefix's physical memory (each allocation, body and boundary, as a new
    /// handle of kind `K`) for one other process. The export holds a reference on the memory
    /// until it ends (see [`Export`]). From now on the owner never writes the prefix again.
    ///
    /// # Errors
    ///
    /// The backend's, if a handle cannot be made: nothing is left exported. If the first
    /// piece (the body, or the one granule) was refused, the prefix is as it was, still
    /// writable by its owner; if a later piece was, the pieces before it may be sealed for good,
    /// so the owner never writes the prefix again. On the host, memory whose pages are pinned
    /// (an RDMA registration, say) cannot be sealed against writes and is refused with
    /// [`Violation::Unsealable`](crate::backend::Violation::Unsealable): export before you
    /// register.
    ///
    /// The export borrows the binding like any token, so the binding cannot be dropped while
    /// the export is outstanding:
    ///
    /// ```compile_fail,E0505
    /// use memtoken::backend::{HostBackend, PosixFd};
    /// use memtoken::{make_guard, Budget, Device};
    /// make_guard!(guard);
    /// let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    /// let binding = device.bind(Budget::unlimited()).unwrap();
    /// let prefix = binding.reserve(4096).unwrap().commit_prefix_exportable::<PosixFd>().unwrap();
    /// let export = prefix.export().unwrap();
    /// drop(prefix);
    /// drop(binding);
    /// drop(export);
    /// ```
    pub fn export(&self) -> Result<Export<'b, 'id, B, K>, BackendError> {
        Scope::run::<B, _>(move || {
            let binding = self.binding();
            let device = binding.device();
            device.ensure_live(Op::Create, 0, self.len())?;
            let backend = device.backend();
            let split = self.parts().split();
            let mut handles = Vec::with_capacity(MAX_FDS);
            for (phys, len) in split.body.into_iter().chain([split.boundary]) {
                match backend.export(phys, len) {
                    Ok(handle) => handles.push(handle),
                    Err(e) => {
                        // A piece exported before may be sealed for good (read-only on the
                        // host): the owner never writes the prefix again.
                        if !handles.is_empty() {
                            self.parts().mark_exported();
                        }
                        return Err(e);
                    }
                }
            }
            let offset = |i: usize| handles.get(i).map_or(0, |h: &Shareable| h.offset);
            let message = PrefixMessage {
                len: self.len() as u64,
                body_len: split.body_len() as u64,
                granularity: device.granularity() as u64,
                kind: K::TYPE,
                generation: self.generation().get(),
                body_offset: if split.body.is_some() { offset(0) } else { 0 },
                boundary_offset: offset(handles.len() - 1),
            };
            // From now on the owner never writes the memory: an importer may be reading it.
            self.parts().mark_exported();
            let shared = device.export_ref(self.parts());
            Ok(Export {
                binding,
                shared: ManuallyDrop::new(shared),
                handles,
                message,
                kind: PhantomData,
            })
        })
    }
}

impl<B: Exportable<PosixFd>> Export<'_, '_, B, PosixFd> {
    /// Sends the message and the descriptors on `socket` (a connected Unix domain socket). The
    /// export stays outstanding: end it once the peer is done (see [`Export`]).
    ///
    /// # Errors
    ///
    /// [`WireError::Io`] if the socket call fails.
    pub fn send(&self, socket: impl AsFd) -> Result<(), WireError> {
        let fds: Vec<BorrowedFd<'_>> = self.handles.iter().map(|h| h.fd.as_fd()).collect();
        send(socket.as_fd(), &self.message, &fds)
    }
}

impl<B: Exportable<K>, K: HandleKind> Export<'_, '_, B, K> {
    /// The message this export sends.
    pub fn message(&self) -> &PrefixMessage {
        &self.message
    }

    /// Ends the export (as dropping it does; see [`Export`]).
    pub fn end(self) {}
}

impl<B: Exportable<K>, K: HandleKind> Drop for Export<'_, '_, B, K> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        let device = self.binding.device();
        // SAFETY: taken once, here, and never used again.
        let shared = unsafe { ManuallyDrop::take(&mut self.shared) };
        device.end_export(shared); // the last reference releases the memory
    }
}

impl<'b, 'id, B: Exportable<PosixFd>> Binding<'b, 'id, B> {
    /// Imports `offer` into this process: reserves exactly its length, imports its handles and
    /// maps them read-only. The token owns zero bytes here (nothing is charged to this
    /// binding's budget; its mapped bytes are), and gives back its handles exactly once.
    ///
    /// # Errors
    ///
    /// [`ImportError`]: the granularity differs, the reservation is refused, or the backend
    /// refuses a handle (a descriptor shorter than it claims, one it cannot trust) or its
    /// mapping. Whatever was done is undone; what cannot be is quarantined in the device.
    pub fn import(&'b self, offer: Offer) -> Result<ImportedPrefix<'b, 'id, B>, ImportError> {
        Scope::run::<B, _>(move || {
            let device = self.device();
            let (message, fds) = (offer.message, offer.fds);
            let g = device.granularity();
            if message.granularity != g as u64 {
                return Err(ImportError::Granularity {
                    offer: usize::try_from(message.granularity).unwrap_or(usize::MAX),
                    device: g,
                });
            }
            // `decode` bounded the length by `isize::MAX`, and the granularity matches.
            let len = usize::try_from(message.len).map_err(|_| ReserveError::Overflow {
                requested: usize::MAX,
                granularity: g,
            })?;
            let reserved = self.reserve(len)?;
            let (core, ()) = reserved.into_core();
            let backend = device.backend();
            let mut imported = Vec::with_capacity(MAX_FDS);
            let mut mapped = 0;
            let step = || -> Result<(), BackendError> {
                device.ensure_live(Op::Map, core.addr, len)?;
                for ((offset, n), fd) in message.pieces().zip(fds) {
                    let n = n as usize; // each piece is at most `len`, a usize
                    let phys = backend.import(Shareable { fd, offset, len: n })?;
                    imported.push((phys, n));
                }
                for &(phys, n) in &imported {
                    device.map(core.addr + mapped, n, phys, Access::ReadOnly)?;
                    mapped += n;
                }
                Ok(())
            };
            if let Err(e) = step() {
                let held = Held {
                    imported,
                    ..Held::mapped(mapped)
                };
                let residual = core.residual(held);
                device.teardown_or_quarantine(residual);
                return Err(ImportError::Backend(Box::new(e)));
            }
            let boundary = imported
                .pop()
                .expect("one piece per descriptor, the boundary last");
            Ok(Allocation::from_core(core, (imported.pop(), boundary)))
        })
    }
}
