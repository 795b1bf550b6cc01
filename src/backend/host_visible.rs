//! Memory a backend maps as ordinary host memory ([`HostVisible`]), and the two places where
//! memtoken makes a host slice of it.
#![allow(unsafe_code)] // an `unsafe` trait, and the two `from_raw_parts` of the crate

use super::{Addr, Backend};

/// A backend whose mapped memory is ordinary host memory at the mapped address.
///
/// # Safety
///
/// After a successful [`Backend::map`] of `len` bytes at `addr` with [`Access::ReadWrite`](super::Access::ReadWrite), the
/// bytes `[addr, addr + len)` must be readable and writable host memory, and with
/// [`Access::ReadOnly`](super::Access::ReadOnly) readable host memory, until the range is unmapped. The backend must never
/// unmap, remap or write a range except when asked to through [`Backend`] — or, for memory it
/// exports, through [`Exportable::export`](super::Exportable::export), which may make the mappings of the exported memory
/// read-only with their bytes unchanged (the typed layer never writes exported memory again).
pub unsafe trait HostVisible: Backend {}

/// `len` bytes of host memory at `addr`, read-only, for `'a`: one of the two places where
/// memtoken makes a host slice ([`host_slice_mut`] is the other); every token's `as_slice`
/// and the host backend's copy into physical memory go through them (its copies to and
/// from the host use `ptr::copy` between raw pointers, making no slice of mapped memory).
///
/// # Safety
///
/// For all of `'a`, `[addr, addr + len)` must be mapped readable by a [`HostVisible`]
/// backend — a token owns the mapping and the borrow of the token lasts `'a`, so only consuming
/// the token could unmap it; or the backend's lock is held for `'a` — and no one may write to
/// it. [`host_slice_mut`] also needs it mapped writable and no other access at all.
pub(crate) unsafe fn host_slice<'a>(addr: Addr, len: usize) -> &'a [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// `len` bytes of host memory at `addr`, writable, for `'a`.
///
/// # Safety
///
/// As for [`host_slice`], with the range mapped writable and no other reference to it for `'a`
/// (the token is borrowed mutably).
pub(crate) unsafe fn host_slice_mut<'a>(addr: Addr, len: usize) -> &'a mut [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}
