//! The driver model's shareable handles: export (`cuMemExportToShareableHandle`: a real
//! descriptor for a POSIX handle, watched until every copy is closed) and import.

use super::misuse;
use super::state::{ModelState, Shared, Watched, identity, inode_of};
use crate::backend::cuda::driver::{
    CuError, CuResult, DriverCall, HANDLE_TYPE_POSIX_FD, ShareableHandle,
};
use rustix::fd::AsFd;
use rustix::net::{AddressFamily, SocketFlags, SocketType};

impl ModelState {
    /// `cuMemExportToShareableHandle` of `handle` as `handle_type`.
    pub(super) fn export(
        &mut self,
        call: DriverCall,
        handle: u64,
        handle_type: u32,
    ) -> CuResult<ShareableHandle> {
        let Some(&allocation) = self.handles.get(&handle) else {
            misuse(call, "unknown or released handle");
        };
        // Fact 26: only a type requested at creation (the error is the model's choice).
        let requested = self.handle_types.get(&allocation).copied().unwrap_or(0);
        if handle_type.count_ones() != 1 || requested & handle_type == 0 {
            return Err(CuError::INVALID_VALUE);
        }
        let key = self.next_shareable;
        self.next_shareable += 1;
        let (fd, out) = if handle_type == HANDLE_TYPE_POSIX_FD {
            // A real descriptor, as the driver writes one (fact 27): one end of a socket pair,
            // known by its inode; the model keeps the other end to learn when it is closed.
            let flags = SocketFlags::CLOEXEC;
            let pair =
                rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, flags, None);
            let Ok((watch, handed)) = pair else {
                return Err(CuError::OUT_OF_MEMORY);
            };
            let Ok(st) = rustix::fs::fstat(handed.as_fd()) else {
                return Err(CuError::OUT_OF_MEMORY);
            };
            let ino = identity(&st);
            (Some(Watched { watch, ino }), ShareableHandle::Fd(handed))
        } else {
            (None, ShareableHandle::Opaque(key))
        };
        let kind = handle_type;
        self.shareables.insert(
            key,
            Shared {
                allocation,
                kind,
                fd,
            },
        );
        *self.holders.entry(allocation).or_insert(0) += 1;
        Ok(out)
    }

    /// `cuMemImportFromShareableHandle` of `shareable` as `handle_type`: a new handle.
    pub(super) fn import(&mut self, shareable: u64, handle_type: u32) -> CuResult<u64> {
        self.reap_shareables();
        // A value that names no open shareable handle of that type: refused, as the driver
        // refuses a descriptor it cannot use. A POSIX descriptor is known by its inode (any
        // copy of it, whatever its number), an opaque value by its.
        let found = if handle_type == HANDLE_TYPE_POSIX_FD {
            let ino = inode_of(shareable);
            self.shareables
                .values()
                .find(|sh| ino.is_some() && sh.fd.as_ref().map(|w| w.ino) == ino)
        } else {
            self.shareables.get(&shareable).filter(|sh| sh.fd.is_none())
        };
        let Some(&Shared {
            allocation: source,
            kind,
            ..
        }) = found
        else {
            return Err(CuError::INVALID_VALUE);
        };
        if kind != handle_type {
            return Err(CuError::INVALID_VALUE);
        }
        let len = self.book.phys_len_any(source);
        let device = self.owners.get(&source).copied().unwrap_or(0);
        let granule = self.granules.get(&source).copied();
        let handle = self.new_handle();
        let allocation = self.next_allocation;
        self.next_allocation += 1;
        self.handles.insert(handle, allocation);
        self.owners.insert(allocation, device);
        self.aliases.insert(allocation, source);
        if let Some(granule) = granule {
            self.granules.insert(allocation, granule);
        }
        *self.holders.entry(source).or_insert(0) += 1;
        self.book.apply_create(allocation, len);
        Ok(handle)
    }
}
