//! Physical memory in files of its own: memory created exportable (a sealed `memfd` per
//! allocation), its export — sealed against every write first — and memory imported from
//! another process.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::{HostBackend, HostPhys, HostState, Place, os_error};
use crate::backend::Refuse;
use crate::backend::export::{Exportable, PosixFd, Shareable};
use crate::backend::rules::Violation;
use crate::backend::{Access, BackendError, Op};
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{FallocateFlags, FileType, MemfdFlags, Mode, OFlags, SealFlags};

/// Physical memory that is not a range of the device's `memfd`.
#[derive(Debug)]
pub(super) struct HostFile {
    /// Read-write while [`FileKind::Exportable`]; read-only once sealed or imported.
    pub(super) fd: OwnedFd,
    pub(super) offset: u64,
    pub(super) kind: FileKind,
}

/// What a [`HostFile`] is, and so what may be done with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FileKind {
    /// Created exportable and not exported yet: mapped as asked, written freely.
    Exportable,
    /// Exported: sealed with `F_SEAL_WRITE`, so no process can ever write it again; mapped
    /// read-only only, through a read-only descriptor (the only one kept).
    Sealed,
    /// Imported from another process (sealed with `F_SEAL_WRITE` there, checked here): mapped
    /// read-only only, and not counted in this backend's physical capacity (the exporter's
    /// memory).
    Imported,
}

impl FileKind {
    /// Whether the file may be mapped read-write or written.
    pub(super) fn writable(self) -> bool {
        self == Self::Exportable
    }
}

/// The seals of an exportable `memfd` from its creation: its size is fixed for good, so no
/// process that maps it can be made to fault by a shrink.
const EXPORT_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// The seals added at its first export: no write to it at all, through any descriptor or
/// mapping, in any process — the kernel grants `F_SEAL_WRITE` only while no writable shared
/// mapping of the file exists, so its bytes can never change again — and no seal changes after
/// that. (`F_SEAL_FUTURE_WRITE` would not do: it leaves every writable mapping made before it.)
const EXPORTED_SEALS: SealFlags = SealFlags::WRITE.union(SealFlags::SEAL);

impl HostBackend {
    /// Makes an exportable allocation immutable for good, before its first export: every
    /// mapping of it in this process — the owner's, read-write, and each sharer's — is made
    /// again from a read-only descriptor (the kernel refuses `F_SEAL_WRITE` while any shared
    /// mapping made through a writable descriptor exists, even a `PROT_READ` one), then the
    /// file is sealed with `F_SEAL_WRITE` and `F_SEAL_SEAL`, and only the read-only descriptor
    /// is kept. Refused with [`Violation::Unsealable`] if the kernel refuses the seal (pinned
    /// pages): every mapping is then made again as it was, and nothing changed.
    fn seal_against_writes(
        s: &mut HostState,
        phys: HostPhys,
        len: usize,
    ) -> Result<(), BackendError> {
        let HostState { book, files, .. } = s;
        let file = files.get_mut(&phys.serial).expect("checked by `export`");
        let read_only =
            reopen_read_only(file.fd.as_fd()).map_err(|e| os_error(Op::Create, 0, len, e))?;
        let mappings = book.mappings_of(phys);
        // A mapping the book no longer trusts (in a poisoned reservation) is never touched again:
        // the memory cannot be made read-only everywhere, so it is not exported.
        for &(addr, n, _) in &mappings {
            book.check_unmap(addr, n).refused(Op::Create, addr, n)?;
        }
        let mut touched = 0;
        let mut result = Ok(());
        for &(addr, n, _) in &mappings {
            touched += 1;
            // SAFETY: the book says `[addr, addr + n)` is a mapping of this backend of the whole
            // of `phys`, that is `n` bytes of this file from `file.offset`: mapped again from the
            // same file at the same offset, its bytes do not change.
            let remapped = unsafe {
                Self::map_place(
                    addr,
                    n,
                    Place::File(read_only.as_fd(), file.offset),
                    Access::ReadOnly,
                )
            };
            if let Err(e) = remapped {
                result = Err(os_error(Op::Map, addr, n, e));
                break;
            }
        }
        if result.is_ok() {
            match rustix::fs::fcntl_add_seals(&file.fd, EXPORTED_SEALS) {
                Ok(()) => {
                    file.fd = read_only;
                    file.kind = FileKind::Sealed;
                    for &(addr, n, _) in &mappings {
                        book.set_access(addr, n, Access::ReadOnly)
                            .expect("a mapping of the book covers itself");
                    }
                    return Ok(());
                }
                Err(errno) => {
                    let errno = errno.raw_os_error();
                    let v = Violation::Unsealable { errno };
                    result = Err(BackendError::refused(Op::Create, 0, len, v));
                }
            }
        }
        // Refused: every mapping touched goes back to how it was (a failed `MAP_FIXED` may
        // have left a hole; a range that cannot be mapped again is never touched again).
        for &(addr, n, access) in &mappings[..touched] {
            // SAFETY: as above; the mapping there is of the same bytes of the same file, or
            // a hole left by the failed call.
            let restored = unsafe {
                Self::map_place(addr, n, Place::File(file.fd.as_fd(), file.offset), access)
            };
            if restored.is_err() {
                book.poison(addr, n);
            }
        }
        result
    }
}

/// `/proc/self/fd/N` of `fd` opened again, read-only: a new open file description that can
/// never map the memory writable, whatever the process holding it does.
fn reopen_read_only(fd: BorrowedFd<'_>) -> rustix::io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
}

impl Exportable<PosixFd> for HostBackend {
    /// A `memfd` of its own, `len` bytes allocated now and sealed at that size, so that the
    /// descriptor sent to another process exposes this allocation and nothing else, and the
    /// kernel keeps its pages while any process maps it.
    fn create_exportable(&self, len: usize) -> Result<HostPhys, BackendError> {
        if self.memory() == super::HostMemory::Anonymous {
            let export = crate::backend::Ability::Export;
            return Err(export.refused(Op::Create, 0, len, super::ANONYMOUS));
        }
        let mut s = self.state();
        s.book.check_create(len).refused(Op::Create, 0, len)?;
        self.check_capacity(&s, len)?;
        let fail = |e| os_error(Op::Create, 0, len, e);
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd = rustix::fs::memfd_create("memtoken-export", flags).map_err(fail)?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(fail)?;
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64).map_err(fail)?;
        rustix::fs::fcntl_add_seals(&fd, EXPORT_SEALS).map_err(fail)?;
        let phys = Self::next_phys(0);
        let file = HostFile {
            fd,
            offset: 0,
            kind: FileKind::Exportable,
        };
        s.files.insert(phys.serial, file);
        s.used += len as u64;
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    /// A read-only descriptor of the allocation's own `memfd` (opened again through
    /// `/proc/self/fd`), after sealing the file against every write at its first export
    /// (`F_SEAL_WRITE`, then `F_SEAL_SEAL`; every mapping of it in this process is made
    /// read-only first, see `seal_against_writes`): its bytes never change again, in any
    /// process; the process it is sent to can read this allocation and nothing else.
    ///
    /// Refused with [`Violation::Unsealable`] if the kernel will not seal it (its pages are
    /// pinned, by an RDMA registration say): nothing is exported and every mapping is as it
    /// was.
    fn export(&self, phys: HostPhys, len: usize) -> Result<Shareable, BackendError> {
        let mut s = self.state();
        s.book
            .check_release(phys, len)
            .or_else(|v| match v {
                Violation::PhysStillMapped { .. } => Ok(()),
                v => Err(v),
            })
            .refused(Op::Create, 0, len)?;
        let Some(file) = s
            .files
            .get(&phys.serial)
            .filter(|f| f.kind != FileKind::Imported)
        else {
            let v = Violation::NotExportable;
            return Err(BackendError::refused(Op::Create, 0, len, v));
        };
        // The descriptor to send first: sealing is the last step that can fail, so a refused
        // export leaves the memory as it was.
        let fd = reopen_read_only(file.fd.as_fd()).map_err(|e| os_error(Op::Create, 0, len, e))?;
        let offset = file.offset;
        if file.kind == FileKind::Exportable {
            Self::seal_against_writes(&mut s, phys, len)?;
        }
        Ok(Shareable { fd, offset, len })
    }

    /// Checks the descriptor before anything is mapped: a regular file sealed against
    /// shrinking and against every write (`F_SEAL_WRITE`, which the kernel grants only while no
    /// writable shared mapping of the file exists anywhere, so the exporter cannot change the
    /// bytes lent here as `&[u8]`; `F_SEAL_FUTURE_WRITE` alone leaves the mappings made before
    /// it writable, and is refused) — the seals first, since a seal can never be
    /// removed: once the file cannot shrink its size can only grow, so the size checked next
    /// holds for good and no mapping of it can fault later — an offset aligned to the page,
    /// whole granules, and a file at least `offset + len` bytes long (`fstat`). The descriptor
    /// is then opened again read-only, and only ever mapped read-only.
    fn import(&self, handle: Shareable) -> Result<HostPhys, BackendError> {
        let Shareable { fd, offset, len } = handle;
        let refuse = |v| BackendError::refused(Op::Create, 0, len, v);
        let mut s = self.state();
        s.book.check_create(len).map_err(refuse)?;
        if !offset.is_multiple_of(self.page_size as u64) {
            return Err(refuse(Violation::Import(
                "offset not aligned to the page size",
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| refuse(Violation::Import("not a sealed memfd")))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(refuse(Violation::Import(
                "not sealed against shrinking (a mapping of it could fault)",
            )));
        }
        if !seals.contains(SealFlags::WRITE) {
            return Err(refuse(Violation::Import(
                "not sealed with F_SEAL_WRITE (a writable mapping made before a weaker seal could \
                 change bytes lent as &[u8])",
            )));
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| os_error(Op::Create, 0, len, e))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(refuse(Violation::Import("not a regular file")));
        }
        let size = u64::try_from(stat.st_size).unwrap_or(0);
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > size) {
            return Err(refuse(Violation::ImportTooSmall { offset, len, size }));
        }
        let fd = reopen_read_only(fd.as_fd()).map_err(|e| os_error(Op::Create, 0, len, e))?;
        let phys = Self::next_phys(offset);
        let file = HostFile {
            fd,
            offset,
            kind: FileKind::Imported,
        };
        s.files.insert(phys.serial, file);
        s.book.apply_create(phys, len);
        Ok(phys)
    }
}
