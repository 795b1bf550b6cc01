//! Exportable physical memory: the handle kinds an allocation may be exported as, chosen when it
//! is created ([`Exportable::create_exportable`]), and the calls that export and import it.

use super::{Backend, BackendError};
use rustix::fd::OwnedFd;

pub(crate) mod sealed {
    /// Only this crate names this trait, so only it adds handle kinds.
    pub trait Kind {}
}

/// A kind of shareable handle physical memory may be exported as (sealed). It is a type, chosen
/// when the memory is created: memory created without one has no export method at all.
pub trait HandleKind: sealed::Kind + 'static {
    /// The kind, as a value (what travels in a message).
    const TYPE: HandleType;
}

/// A POSIX file descriptor: CUDA's `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`; on the host, the
/// allocation's own sealed `memfd`. It travels over a Unix domain socket (`SCM_RIGHTS`).
#[derive(Debug)]
pub enum PosixFd {}

/// A fabric handle: CUDA's `CU_MEM_HANDLE_TYPE_FABRIC` (64 bytes, shared within an IMEX domain,
/// facts 27, 28 and 30 of [`cuda::facts`](crate::backend::cuda::facts)). Declared for the driver model; no backend shipped
/// here exports it yet.
#[derive(Debug)]
pub enum Fabric {}

impl sealed::Kind for PosixFd {}
impl sealed::Kind for Fabric {}
impl HandleKind for PosixFd {
    const TYPE: HandleType = HandleType::PosixFd;
}
impl HandleKind for Fabric {
    const TYPE: HandleType = HandleType::Fabric;
}

listed! {
    /// A handle kind as a value.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum HandleType {
        /// [`PosixFd`].
        PosixFd,
        /// [`Fabric`].
        Fabric,
    }
}

impl HandleType {
    /// Its code in a message: its bit in CUDA's `CUmemAllocationHandleType` (the one place
    /// the codes are written; the CUDA driver seam's constants are these).
    pub const fn code(self) -> u8 {
        match self {
            Self::PosixFd => 0x1,
            Self::Fabric => 0x8,
        }
    }

    /// The kind with `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }
}

/// One physical allocation exported as a file descriptor: the file, where the allocation
/// starts in it, and its length. On CUDA the offset is 0 and the descriptor is the driver's
/// (`cuMemExportToShareableHandle`); on the host it is a read-only descriptor of the
/// allocation's own sealed `memfd`.
#[derive(Debug)]
pub struct Shareable {
    /// The descriptor; closing it closes this process's handle on the memory, nothing else.
    pub fd: OwnedFd,
    /// Where the allocation starts in the file.
    pub offset: u64,
    /// The allocation's length in bytes.
    pub len: usize,
}

/// A backend whose physical memory can be created exportable as handles of kind `K`, exported,
/// and imported in another process.
///
/// Imported memory is a physical handle of this backend like any other: it is mapped whole
/// (read-only by the typed layer) and released once with [`Backend::release`], which gives
/// back this process's handle on it and never the exporter's memory: that goes when every
/// process has released and unmapped it (fact 22 of [`cuda::facts`](crate::backend::cuda::facts)).
pub trait Exportable<K: HandleKind>: Backend {
    /// Creates `len` bytes of physical memory that may be exported as `K`.
    fn create_exportable(&self, len: usize) -> Result<Self::Phys, BackendError>;
    /// Exports `phys` (`len` bytes, created by [`create_exportable`](Self::create_exportable))
    /// as a handle another process can import. Each call makes a new handle.
    fn export(&self, phys: Self::Phys, len: usize) -> Result<Shareable, BackendError>;
    /// Imports a handle exported by another process (or this one): `len` bytes of physical
    /// memory this backend may map. The handle is checked against the memory it names: a
    /// descriptor smaller than `offset + len` is refused, never mapped.
    fn import(&self, handle: Shareable) -> Result<Self::Phys, BackendError>;
}
