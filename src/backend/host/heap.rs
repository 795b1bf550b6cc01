//! The heap store ([`HostMemory::Heap`](super::HostMemory::Heap)): a reservation is one heap
//! allocation, aligned to the granularity, and physical memory a heap buffer whose bytes are
//! copied in where it is mapped and back out as it is unmapped. No system call at all — so it
//! runs under Miri, which checks every byte the typed layer lends — at the price of what needs
//! one memory at two addresses: no memory is mapped twice (sharing) and none is exported.
#![allow(unsafe_code)] // this module allocates and copies raw memory, each with its `// SAFETY:`

use super::{HostPhys, HostState};
use crate::backend::{Ability, Addr, BackendError, Cause, Op};
use std::alloc::Layout;
use std::collections::HashMap;

/// The heap store, named in its refusals.
pub(super) const HEAP: &str = "the host's heap store (one heap buffer per allocation: no memory \
                               at two addresses, no file)";

/// The heap store's own record, kept beside the book (under the backend's lock).
#[derive(Debug, Default)]
pub(super) struct Heap {
    /// Live reservations: start → the layout they were allocated with.
    reservations: HashMap<Addr, Layout>,
    /// Physical memory by serial: its bytes while it is not mapped (while mapped, the bytes
    /// at its mapping are its own, and these are stale).
    bytes: HashMap<u64, Box<[u8]>>,
}

impl Heap {
    /// Its live reservations and buffers of physical memory (for the tests).
    #[cfg(test)]
    pub(super) fn live(&self) -> (usize, usize) {
        (self.reservations.len(), self.bytes.len())
    }
}

/// The refusal of an ability the heap store lacks.
fn unsupported(op: Op, addr: Addr, len: usize, ability: Ability) -> BackendError {
    let cause = Cause::Unsupported {
        capability: ability.capability(),
        mechanism: HEAP,
    };
    BackendError::new(op, addr, len, cause)
}

/// Out of memory: the allocator refused `len` bytes.
fn exhausted(op: Op, len: usize) -> BackendError {
    let errno = rustix::io::Errno::NOMEM.raw_os_error();
    BackendError::new(op, 0, len, Cause::Os { errno })
}

/// A reservation of `len` bytes (checked by the book: positive, a multiple of `granularity`),
/// aligned to `granularity`, zeroed.
pub(super) fn reserve(
    s: &mut HostState,
    len: usize,
    granularity: usize,
) -> Result<Addr, BackendError> {
    let layout =
        Layout::from_size_align(len, granularity).map_err(|_| exhausted(Op::Reserve, len))?;
    // SAFETY: `layout` has a non-zero size (the book refuses an empty reservation).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(exhausted(Op::Reserve, len));
    }
    let addr = ptr as Addr;
    s.heap.reservations.insert(addr, layout);
    Ok(addr)
}

/// Gives the reservation at `addr` back to the allocator (checked by the book: one of ours,
/// with nothing mapped).
pub(super) fn free(s: &mut HostState, addr: Addr) {
    let layout = s
        .heap
        .reservations
        .remove(&addr)
        .expect("checked by the book");
    // SAFETY: allocated by `reserve` with this layout, and freed once (its entry just left);
    // nothing is mapped in it, so the typed layer lends no reference into it.
    unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
}

/// Physical memory of `len` bytes, zeroed, under a new handle.
pub(super) fn create(s: &mut HostState, len: usize) -> Result<HostPhys, BackendError> {
    let mut bytes = Vec::<u8>::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|_| exhausted(Op::Create, len))?;
    // One `memset` (a byte loop would take Miri a step per byte).
    // SAFETY: the capacity is at least `len` (reserved just above); the `len` bytes are
    // written (zeroed) before the length covers them.
    unsafe {
        std::ptr::write_bytes(bytes.as_mut_ptr(), 0, len);
        bytes.set_len(len);
    }
    let phys = super::HostBackend::next_phys(0);
    s.heap.bytes.insert(phys.serial, bytes.into_boxed_slice());
    Ok(phys)
}

/// Lets `phys` go (checked by the book: live, mapped nowhere).
pub(super) fn release(s: &mut HostState, phys: HostPhys) {
    s.heap.bytes.remove(&phys.serial);
}

/// Maps `phys` at `[addr, addr + len)` (checked by the book: inside a reservation, nothing
/// mapped there, `len` the whole of `phys`): its bytes are copied there. Refused where `phys`
/// is mapped already: the heap store has no memory at two addresses.
pub(super) fn map(
    s: &mut HostState,
    addr: Addr,
    len: usize,
    phys: HostPhys,
) -> Result<(), BackendError> {
    if s.book.is_mapped(phys) {
        return Err(unsupported(Op::Map, addr, len, Ability::MapTwice));
    }
    let bytes = &s.heap.bytes[&phys.serial];
    // SAFETY: `[addr, addr + len)` lies inside a live reservation (a heap allocation of ours)
    // with nothing mapped in it, so no reference points into it; `bytes` holds `len` bytes (the
    // book checked the length) in another allocation.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, len) };
    Ok(())
}

/// Before an unmap of `[addr, addr + len)` (checked by the book: exactly covered by mappings,
/// every borrow of them ended): each mapping's bytes are copied back into its memory.
pub(super) fn unmap(s: &mut HostState, addr: Addr, len: usize) {
    let HostState { book, heap, .. } = s;
    for (start, n, phys) in book.mappings_within(addr, len) {
        let bytes = heap
            .bytes
            .get_mut(&phys.serial)
            .expect("mapped memory is live");
        // SAFETY: `[start, start + n)` is a mapping of `phys`, inside a live reservation, with
        // no borrow of it left (the caller's check); `bytes` is `phys`'s own buffer of `n`
        // bytes, another allocation.
        unsafe { std::ptr::copy_nonoverlapping(start as *const u8, bytes.as_mut_ptr(), n) };
    }
}

/// Copies `len` bytes mapped at `src` into all of `phys` (checked by the book: mapped, not
/// `phys` itself): where `phys` is mapped, at its mapping.
pub(super) fn copy_into_phys(s: &mut HostState, phys: HostPhys, src: Addr, len: usize) {
    let HostState { book, heap, .. } = s;
    let to = match book.mappings_of(phys).first() {
        Some(&(at, ..)) => at as *mut u8,
        None => heap
            .bytes
            .get_mut(&phys.serial)
            .expect("live memory")
            .as_mut_ptr(),
    };
    // SAFETY: `[src, src + len)` is mapped readable (checked), `to` holds `len` bytes of
    // `phys` (its mapping, or its buffer), and the two never overlap: the book refuses a copy
    // of memory into itself, and no memory is mapped twice here. The typed layer copies into
    // memory it holds exclusively, which lends no slice meanwhile.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, to, len) };
}

/// Gives every reservation back, as the backend drops — those kept for good too: on the heap
/// store nothing outside the process can reach them (no export, no peer), and no token can
/// reference them any more.
pub(super) fn drop_all(heap: &mut Heap) {
    for (addr, layout) in heap.reservations.drain() {
        // SAFETY: allocated by `reserve` with this layout and freed once (drained); no token
        // can reference it (tokens borrow the device that owns the backend).
        unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
    }
}
