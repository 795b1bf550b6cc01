//! Export and import of physical memory as POSIX descriptors (facts 26–29).
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use super::driver::{Driver, HANDLE_TYPE_POSIX_FD, ShareableHandle};
use super::plain::PLAIN;
use super::{CudaBackend, CudaPhys, next_serial};
use crate::backend::Refuse;
use crate::backend::{Ability, BackendError, Exportable, Op, PosixFd, Shareable, Violation};
use rustix::fd::AsRawFd;

impl<D: Driver> CudaBackend<D> {
    /// Refuses exportable memory (created or imported) of `len` bytes for `op` unless its
    /// properties' granularity is known and fits the device granularity (fact 15): no call is
    /// made then.
    fn check_exportable_fits(&self, op: Op, len: usize) -> Result<(), BackendError> {
        if self.plain {
            return Err(Ability::Export.refused(op, 0, len, PLAIN));
        }
        let exportable = self
            .exportable_granularity
            .map_err(|e| self.fail(op, 0, len, e))?;
        if self.granularity.is_multiple_of(exportable) {
            return Ok(());
        }
        let v = Violation::GranularityMisfit {
            device: self.granularity,
            exportable,
        };
        Err(BackendError::refused(op, 0, len, v))
    }
}

/// Export as a POSIX descriptor (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, facts 26–29).
/// Fabric handles are declared ([`Fabric`](crate::backend::Fabric)) but not exported by this backend.
impl<D: Driver> Exportable<PosixFd> for CudaBackend<D> {
    /// `cuMemCreate` with `requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
    /// (the handle type is chosen here, once: fact 26) and the backend's other properties
    /// ([`allocation_props`](CudaBackend::allocation_props): RDMA-capable where the device
    /// can). Refused before the call where the granularity of these properties does not fit
    /// the device's ([`exportable_granularity`](CudaBackend::exportable_granularity)).
    fn create_exportable(&self, len: usize) -> Result<CudaPhys, BackendError> {
        let (mut s, _relaxed) = self.enter_vmm(Op::Create, 0, len)?;
        s.book.check_create(len).refused(Op::Create, 0, len)?;
        self.check_exportable_fits(Op::Create, len)?;
        let props = self.props.with_handle_types(HANDLE_TYPE_POSIX_FD);
        let handle = self
            .driver
            .mem_create_with(len, props)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        let phys = CudaPhys {
            handle,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        s.exportable.insert(phys);
        Ok(phys)
    }

    /// `cuMemExportToShareableHandle`: a new descriptor of the whole allocation (offset 0),
    /// owned by the caller. The memory lives while it is open, whatever this process releases
    /// (fact 27).
    fn export(&self, phys: CudaPhys, len: usize) -> Result<Shareable, BackendError> {
        if self.plain {
            return Err(Ability::Export.refused(Op::Create, 0, len, PLAIN));
        }
        let (s, _relaxed) = self.enter_vmm(Op::Create, 0, len)?;
        let refuse = |v| BackendError::refused(Op::Create, 0, len, v);
        s.book
            .check_release(phys, len)
            .or_else(|v| match v {
                Violation::PhysStillMapped { .. } => Ok(()),
                v => Err(v),
            })
            .map_err(refuse)?;
        if !s.exportable.contains(&phys) {
            return Err(refuse(Violation::NotExportable));
        }
        // SAFETY: `check_release` above proved `phys` created by this backend through this
        // driver and not released, so its handle is live (see `release`).
        let shared = unsafe {
            self.driver
                .mem_export_to_shareable_handle(phys.handle, HANDLE_TYPE_POSIX_FD)
        }
        .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        match shared {
            ShareableHandle::Fd(fd) => Ok(Shareable { fd, offset: 0, len }),
            ShareableHandle::Opaque(_) => Err(refuse(Violation::Import(
                "the driver exported something other than a descriptor",
            ))),
        }
    }

    /// `cuMemImportFromShareableHandle` with the descriptor by value (fact 28); the descriptor
    /// is closed right after. A CUDA handle is a whole allocation: an offset other than 0 is
    /// refused before the call. Where the driver says the allocation's size (the model), a size
    /// other than the message's is refused and the import released at once; the real driver
    /// does not say it, and then `cuMemMap` of the claimed length is what checks it
    /// (assumption 7). The handle is released once, by [`Backend::release`](crate::backend::Backend::release) (fact 29).
    fn import(&self, handle: Shareable) -> Result<CudaPhys, BackendError> {
        let Shareable { fd, offset, len } = handle;
        if self.plain {
            // An import is mapped at a reserved address: the plain mechanism cannot.
            return Err(Ability::Export.refused(Op::Create, 0, len, PLAIN));
        }
        let (mut s, _relaxed) = self.enter_vmm(Op::Create, 0, len)?;
        let refuse = |v| BackendError::refused(Op::Create, 0, len, v);
        s.book.check_create(len).map_err(refuse)?;
        // Imported memory was made with exportable properties: it is mapped as the device
        // granularity sizes it only where theirs fits (fact 15).
        self.check_exportable_fits(Op::Create, len)?;
        if offset != 0 {
            return Err(refuse(Violation::Import(
                "an offset into a CUDA allocation: handles are mapped whole, from 0",
            )));
        }
        let raw = fd.as_raw_fd() as u64;
        let imported = self
            .driver
            .mem_import_from_shareable_handle(raw, HANDLE_TYPE_POSIX_FD)
            .map_err(|e| self.fail(Op::Create, 0, len, e))?;
        drop(fd); // fact 28: the importer may close its descriptor right after the import
        // SAFETY: `imported` was returned just above by this driver and is not released.
        let size = unsafe { self.driver.mem_allocation_size(imported) };
        if let Some(size) = size.filter(|&size| size != len) {
            // SAFETY: as above; released once, here, and never recorded.
            if let Err(e) = unsafe { self.driver.mem_release(imported) } {
                return Err(self.fail(Op::Release, 0, len, e));
            }
            return Err(refuse(if size < len {
                Violation::ImportTooSmall {
                    offset,
                    len,
                    size: size as u64,
                }
            } else {
                Violation::Import("the allocation is longer than the message claims")
            }));
        }
        let phys = CudaPhys {
            handle: imported,
            serial: next_serial(),
        };
        s.book.apply_create(phys, len);
        s.imported.insert(phys);
        Ok(phys)
    }
}
