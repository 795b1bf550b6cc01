//! Host VMM over `rustix`: a faithful analog of CUDA's virtual memory management on Linux.
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

mod config;
mod files;
mod heap;
mod ranges;

use super::rules::{Book, Violation};
use super::{
    Ability, Access, Addr, Backend, BackendError, Cause, ConfigError, HostVisible, Op,
    address_space_exhausted, check_address_space, lock,
};
use crate::backend::Refuse;
pub use config::{HostConfig, HostMemory};
use files::{FileKind, HostFile};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// Physical memory on the host: a range of the device's store (its `memfd`, or its anonymous
/// mapping: see [`HostMemory`]) — or, for memory created
/// exportable or imported from another process, a file of its own — with a serial number,
/// unique in the process, so a stale handle is refused even when its offset has been reused,
/// and another host backend's handle is refused too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostPhys {
    offset: u64,
    serial: u64,
}

#[derive(Debug)]
struct HostState {
    book: Book<HostPhys>,
    /// Where the store's physical memory lies, live and free.
    ranges: ranges::Ranges,
    used: u64,
    /// Pins taken by [`Backend::pin`] and not yet given back.
    pins: u64,
    /// Physical memory in a file of its own, by serial: memory created exportable (its own
    /// sealed `memfd`) and memory imported from another process (the descriptor received).
    files: HashMap<u64, HostFile>,
    /// The heap store's reservations and buffers (empty on the other stores).
    heap: heap::Heap,
}

/// Host virtual memory management through `rustix`:
///
/// | CUDA                    | host                                                          |
/// | ----------------------- | ------------------------------------------------------------- |
/// | `cuMemAddressReserve`   | anonymous `PROT_NONE` mapping, aligned to the granularity     |
/// | `cuMemCreate`           | a range of the device's `memfd`, allocated with `fallocate`   |
/// | `cuMemMap` + `SetAccess`| `mmap(MAP_SHARED \| MAP_FIXED)` of the `memfd` range          |
/// | `cuMemUnmap`            | `PROT_NONE` anonymous mapping put back (the VA stays reserved)|
/// | `cuMemRelease`          | `fallocate(PUNCH_HOLE)`: the pages go back to the OS          |
/// | `cuMemAddressFree`      | `munmap`                                                      |
///
/// Because physical memory is a file range, the same page can be mapped at two addresses: real
/// sharing and real read-only views. Where there is no `memfd` ([`HostMemory::Anonymous`]),
/// physical memory is a range of one shared anonymous mapping instead: created with
/// `MADV_POPULATE_WRITE`, mapped with `mremap` (an old size of 0: a new mapping of the same
/// pages) and `mprotect` for read-only access, released with `MADV_REMOVE`; sharing and
/// read-only views are as real, and only export is refused.
///
/// Every call is checked against the backend's record of what it handed out (the same rules as
/// [`SimBackend`](crate::backend::doubles::SimBackend)); a call that breaks them is refused with
/// [`Cause::Violation`] before any system call, so no safe call can unmap or overwrite memory the
/// backend does not own.
#[derive(Debug)]
pub struct HostBackend {
    config: HostConfig,
    page_size: usize,
    store: Store,
    state: Mutex<HostState>,
}

/// Where the physical memory lives (see [`HostMemory`]).
#[derive(Debug)]
enum Store {
    Memfd(OwnedFd),
    /// The shared anonymous mapping's address and length.
    Anonymous(Addr, usize),
    /// Heap buffers ([`HostMemory::Heap`]), recorded in the state.
    Heap,
}

/// Where physical memory lies, for a map or a copy: a range of a file, or pages of the
/// anonymous store (at this address of its mapping).
#[derive(Clone, Copy)]
pub(super) enum Place<'a> {
    File(BorrowedFd<'a>, u64),
    Pages(Addr),
}

/// The protection `mprotect` takes for the protection `mmap` takes.
fn prot_of(prot: ProtFlags) -> rustix::mm::MprotectFlags {
    rustix::mm::MprotectFlags::from_bits_truncate(prot.bits())
}

/// How many times [`Backend::reserve`] asks the kernel for a range before it gives up because
/// every range offered lay over a poisoned reservation.
const RESERVE_ATTEMPTS: usize = 64;

fn os_error(op: Op, addr: Addr, len: usize, errno: rustix::io::Errno) -> BackendError {
    let errno = errno.raw_os_error();
    BackendError::new(op, addr, len, Cause::Os { errno })
}

impl HostBackend {
    /// A host device with `config`: creates its store of `physical_capacity` bytes (sparse:
    /// nothing is allocated until created) — a `memfd`, or the anonymous mapping (see
    /// [`HostMemory`]).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the setting if the granularity is not a power of two of at
    /// least the page size, or the physical capacity or address space is not a positive
    /// multiple of it (or the address space is larger than one mapping may be);
    /// [`ConfigError::Memfd`] with the OS error if the `memfd` cannot be created or sized
    /// (with [`HostMemory::Auto`], only for another error than a refused `memfd_create`);
    /// [`ConfigError::AnonymousStore`] if the anonymous store cannot be mapped.
    pub fn new(config: HostConfig) -> Result<Self, ConfigError> {
        let page_size = rustix::param::page_size();
        let g = config.granularity;
        ConfigError::check_granularity(g)?;
        if g < page_size {
            return Err(ConfigError::GranularityBelowPageSize {
                granularity: g,
                page_size,
            });
        }
        let capacity = config.physical_capacity;
        ConfigError::check_multiple("physical capacity", capacity, g)?;
        ConfigError::check_multiple("address space", config.address_space as u64, g)?;
        // Reserving over-allocates by up to one granule: that sum stays below `usize::MAX`.
        let max = isize::MAX as usize & !(g - 1);
        if config.address_space > max {
            return Err(ConfigError::AddressSpaceTooLarge {
                address_space: config.address_space,
                max,
            });
        }
        let memfd_error = |e: rustix::io::Errno| ConfigError::Memfd {
            physical_capacity: capacity,
            source: e.into(),
        };
        let create = || rustix::fs::memfd_create("memtoken", MemfdFlags::CLOEXEC);
        let sized = |created: rustix::io::Result<OwnedFd>| -> Result<OwnedFd, ConfigError> {
            let fd = created.map_err(memfd_error)?;
            rustix::fs::ftruncate(&fd, capacity).map_err(memfd_error)?;
            Ok(fd)
        };
        let store = match config.memory {
            HostMemory::Memfd => Store::Memfd(sized(create())?),
            HostMemory::Anonymous => Self::anonymous(capacity)?,
            HostMemory::Heap => Store::Heap,
            // Miri has no `memfd_create` (nor shared mappings): asking would end the run.
            HostMemory::Auto if cfg!(miri) => Store::Heap,
            HostMemory::Auto => match create() {
                // `memfd_create` missing or refused by policy (a sandbox): the anonymous store.
                // Any other error (out of descriptors, say) is the memfd's, said as such.
                Err(
                    rustix::io::Errno::NOSYS | rustix::io::Errno::PERM | rustix::io::Errno::ACCESS,
                ) => Self::anonymous(capacity)?,
                created => Store::Memfd(sized(created)?),
            },
        };
        let state = HostState {
            book: Book::new(g, false),
            ranges: ranges::Ranges::default(),
            used: 0,
            pins: 0,
            files: HashMap::new(),
            heap: heap::Heap::default(),
        };
        Ok(Self {
            config,
            page_size,
            store,
            state: Mutex::new(state),
        })
    }

    /// The anonymous store: one shared anonymous mapping of `capacity` bytes, reserved lazily
    /// (pages exist once touched).
    fn anonymous(capacity: u64) -> Result<Store, ConfigError> {
        let len = usize::try_from(capacity).map_err(|_| ConfigError::AnonymousStore {
            physical_capacity: capacity,
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        })?;
        let flags = MapFlags::SHARED | MapFlags::NORESERVE;
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a new mapping where the kernel chooses: it replaces nothing.
        let base = unsafe { rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, prot, flags) }
            .map_err(|e| ConfigError::AnonymousStore {
                physical_capacity: capacity,
                source: e.into(),
            })?;
        Ok(Store::Anonymous(base as Addr, len))
    }

    /// Where this backend's physical memory lives.
    pub fn memory(&self) -> HostMemory {
        match self.store {
            Store::Memfd(_) => HostMemory::Memfd,
            Store::Anonymous(..) => HostMemory::Anonymous,
            Store::Heap => HostMemory::Heap,
        }
    }

    /// A host device with the default settings (4 KiB granularity, 1 GiB physical).
    ///
    /// # Errors
    ///
    /// As [`HostBackend::new`] (the default settings are valid: only the `memfd` can fail).
    pub fn with_defaults() -> Result<Self, ConfigError> {
        Self::new(HostConfig::default())
    }

    /// The OS page size.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Bytes of physical memory created and not yet released (the device's `memfd` ranges and
    /// exportable files; imported memory is the exporter's and is not counted).
    pub fn physical_in_use(&self) -> u64 {
        self.state().used
    }

    /// How many files of their own this backend holds open: exportable allocations and
    /// imported handles not yet released.
    pub fn open_files(&self) -> usize {
        self.state().files.len()
    }

    /// Where `phys` lives, and whether it may be written: a file of its own, or the device's
    /// store.
    fn place_of<'a>(&'a self, s: &'a HostState, phys: HostPhys) -> (Place<'a>, bool) {
        match (s.files.get(&phys.serial), &self.store) {
            (Some(f), _) => (Place::File(f.fd.as_fd(), f.offset), f.kind.writable()),
            (None, Store::Memfd(fd)) => (Place::File(fd.as_fd(), phys.offset), true),
            (None, Store::Anonymous(base, _)) => (Place::Pages(base + phys.offset as usize), true),
            (None, Store::Heap) => unreachable!("the heap store maps and copies by itself"),
        }
    }

    fn next_phys(offset: u64) -> HostPhys {
        HostPhys {
            offset,
            serial: super::unique().get(),
        }
    }

    /// The error of an exhausted capacity for `len` more bytes, if it is.
    fn check_capacity(&self, s: &HostState, len: usize) -> Result<(), BackendError> {
        let capacity = self.config.physical_capacity;
        let after = s.used.checked_add(len as u64);
        if after.is_none_or(|after| after > capacity) {
            let cause = Cause::Exhausted {
                requested: len as u64,
                available: capacity - s.used,
                capacity,
            };
            return Err(BackendError::new(Op::Create, 0, len, cause));
        }
        Ok(())
    }

    // Backend calls hold this lock across their system call: the record and the address space
    // change together, so two racing calls can never both pass a check on the same range.
    fn state(&self) -> MutexGuard<'_, HostState> {
        lock(&self.state)
    }

    /// Maps the `len` bytes of physical memory at `place` at exactly `addr`, shared, with
    /// `access`, over whatever is mapped there.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must lie inside a reservation of this backend, and every reference
    /// into it must stay valid: no reference may point into it, or it is already a mapping of
    /// the same `len` bytes of the same memory (so the bytes seen there do not change: the
    /// kernel swaps the mappings under its lock of the address space, and a read racing with
    /// it sees the same pages). `place` must hold `len` bytes.
    unsafe fn map_place(
        addr: Addr,
        len: usize,
        place: Place<'_>,
        access: Access,
    ) -> rustix::io::Result<()> {
        let prot = match access {
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
            Access::ReadOnly => ProtFlags::READ,
        };
        match place {
            Place::File(fd, offset) => {
                let flags = MapFlags::SHARED | MapFlags::FIXED;
                // SAFETY: the caller guarantees the range is ours and that every reference into
                // it stays valid.
                unsafe { rustix::mm::mmap(addr as *mut _, len, prot, flags, fd, offset) }.map(drop)
            }
            Place::Pages(from) => {
                let flags = rustix::mm::MremapFlags::MAYMOVE;
                // SAFETY: as above for the destination, which `MREMAP_FIXED` replaces; `from`
                // is a range of the store's shared mapping, so an old size of 0 makes a new
                // mapping of the same pages and leaves the store's untouched.
                unsafe { rustix::mm::mremap_fixed(from as *mut _, 0, len, flags, addr as *mut _) }?;
                if access == Access::ReadWrite {
                    return Ok(()); // the store's own protection, inherited
                }
                // SAFETY: the new mapping covers exactly `[addr, addr + len)`, ours; taking its
                // write access away invalidates no reference (nothing points into it yet).
                unsafe { rustix::mm::mprotect(addr as *mut _, len, prot_of(prot)) }
            }
        }
    }

    /// Puts an inaccessible anonymous mapping at `[addr, addr + len)`.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must lie inside a reservation of this backend, and no reference may
    /// point into it.
    unsafe fn make_inaccessible(addr: Addr, len: usize) -> rustix::io::Result<()> {
        let flags = MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE;
        // SAFETY: the caller guarantees the range is ours and unreferenced, so replacing its
        // mapping cannot invalidate memory anyone else uses.
        unsafe { rustix::mm::mmap_anonymous(addr as *mut _, len, ProtFlags::empty(), flags) }
            .map(drop)
    }
}

impl Backend for HostBackend {
    type Phys = HostPhys;
    type Fence = ();
    const IMMEDIATE: bool = true;
    /// Every argument is checked against the backend's records and refused with an error
    /// (`tests/it/backend_input.rs` throws arbitrary calls at it); its system calls report errors
    /// as values.
    const MAY_PANIC: bool = false;

    fn granularity(&self) -> usize {
        self.config.granularity
    }

    fn address_space(&self) -> usize {
        self.config.address_space
    }

    fn physical_capacity(&self) -> u64 {
        self.config.physical_capacity
    }

    /// Reserves through an anonymous `PROT_NONE` mapping where the kernel chooses. The kernel
    /// never places it over a live mapping, but a poisoned reservation (a failed `MAP_FIXED`
    /// whose placeholder could not be put back) may have a hole that it fills: a range that
    /// overlaps any reservation of the record is never handed out (it would be VA handed out
    /// twice). It is kept where it is instead, as a plug that fills the hole with an
    /// inaccessible mapping of this backend's (so nobody else's memory lands there later), the
    /// reservations it overlaps are poisoned, and the kernel is asked again, up to
    /// 64 times (`RESERVE_ATTEMPTS`).
    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        let mut s = self.state();
        s.book.check_reserve(len).refused(Op::Reserve, 0, len)?;
        let (g, space) = (self.config.granularity, self.config.address_space);
        check_address_space(len, space)?;
        // Over-reserve by one granule when it exceeds the page size, then trim to alignment.
        // (`new` bounds the address space so that this cannot overflow; checked all the same.)
        if let Store::Heap = self.store {
            let addr = heap::reserve(&mut s, len, g)?;
            s.book.apply_reserve(addr, len);
            return Ok(addr);
        }
        let slack = if g > self.page_size { g } else { 0 };
        let total = len
            .checked_add(slack)
            .ok_or_else(|| address_space_exhausted(len, space))?;
        let flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        let mut offered = 0;
        for _ in 0..RESERVE_ATTEMPTS {
            // SAFETY: a null hint lets the kernel pick unused addresses; nothing existing is
            // touched.
            let base = unsafe {
                rustix::mm::mmap_anonymous(std::ptr::null_mut(), total, ProtFlags::empty(), flags)
            }
            .map_err(|e| os_error(Op::Reserve, 0, len, e))? as Addr;
            if s.book.overlaps_reservation(base, total) {
                // In the hole of a poisoned reservation: a plug, never handed out or unmapped.
                s.book.poison(base, total);
                offered = base;
                continue;
            }
            let addr = base.next_multiple_of(g);
            let (head, tail) = (addr - base, total - len - (addr - base));
            for (start, n) in [(base, head), (addr + len, tail)] {
                if n > 0 {
                    // SAFETY: `[start, start + n)` is slack of the mapping made just above,
                    // never handed out.
                    unsafe { rustix::mm::munmap(start as *mut _, n) }
                        .map_err(|e| os_error(Op::Reserve, start, n, e))?;
                }
            }
            s.book.apply_reserve(addr, len);
            return Ok(addr);
        }
        let v = Violation::Poisoned {
            addr: offered,
            len: total,
        };
        Err(BackendError::refused(Op::Reserve, offered, len, v))
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.state();
        s.book.check_free(addr, len).refused(Op::Free, addr, len)?;
        if let Store::Heap = self.store {
            heap::free(&mut s, addr);
            s.book.apply_free(addr);
            return Ok(());
        }
        // SAFETY: the book says `[addr, addr + len)` is exactly one of our reservations with
        // nothing mapped in it, so no reference can point into it.
        unsafe { rustix::mm::munmap(addr as *mut _, len) }
            .map_err(|e| os_error(Op::Free, addr, len, e))?;
        s.book.apply_free(addr);
        Ok(())
    }

    fn create(&self, len: usize) -> Result<HostPhys, BackendError> {
        let mut s = self.state();
        s.book.check_create(len).refused(Op::Create, 0, len)?;
        self.check_capacity(&s, len)?;
        if let Store::Heap = self.store {
            let phys = heap::create(&mut s, len)?;
            s.used += len as u64;
            s.book.apply_create(phys, len);
            return Ok(phys);
        }
        let capacity = self.config.physical_capacity;
        let Some(offset) = s.ranges.take(len as u64, capacity) else {
            let cause = Cause::Exhausted {
                requested: len as u64,
                available: capacity - s.used,
                capacity,
            };
            return Err(BackendError::new(Op::Create, 0, len, cause));
        };
        let allocated = match &self.store {
            Store::Memfd(fd) => {
                rustix::fs::fallocate(fd, FallocateFlags::KEEP_SIZE, offset, len as u64)
                    .map_err(|e| os_error(Op::Create, 0, len, e))
            }
            Store::Anonymous(base, _) => {
                let at = (base + offset as usize) as *mut std::ffi::c_void;
                // Allocated now, as `fallocate` does on a memfd: a shortage is this call's
                // error, not a fault at first touch. (Kernels before 5.14 lack the advice:
                // `EINVAL`, and the pages come at first touch.)
                // SAFETY: `[at, at + len)` is a free range of the store, mapped by no one:
                // populating its pages writes nothing anyone reads.
                match unsafe {
                    rustix::mm::madvise(at, len, rustix::mm::Advice::LinuxPopulateWrite)
                } {
                    Ok(()) | Err(rustix::io::Errno::INVAL) => Ok(()),
                    Err(e) => Err(os_error(Op::Create, 0, len, e)),
                }
            }
            Store::Heap => unreachable!("made above"),
        };
        if let Err(e) = allocated {
            s.ranges.give(offset, len as u64);
            return Err(e);
        }
        let phys = Self::next_phys(offset);
        s.used += len as u64;
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    fn release(&self, phys: HostPhys, len: usize) -> Result<(), BackendError> {
        let mut s = self.state();
        s.book
            .check_release(phys, len)
            .refused(Op::Release, 0, len)?;
        if let Some(file) = s.files.remove(&phys.serial) {
            // A file of its own: closing this process's descriptor is the release. Another
            // process that imported it keeps its pages until it unmaps and closes them too
            // (the kernel counts); imported memory was never counted here.
            if file.kind != FileKind::Imported {
                s.used -= len as u64;
            }
            drop(file);
            s.book.apply_release(phys);
            return Ok(());
        }
        match &self.store {
            Store::Heap => heap::release(&mut s, phys),
            Store::Memfd(fd) => {
                let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
                rustix::fs::fallocate(fd, mode, phys.offset, len as u64)
                    .map_err(|e| os_error(Op::Release, 0, len, e))?;
            }
            Store::Anonymous(base, _) => {
                let at = (base + phys.offset as usize) as *mut _;
                // SAFETY: `[at, at + len)` is this allocation's range of the store, which the
                // book says is mapped nowhere now: giving its pages back (they read as zeros
                // after) touches no memory anyone references.
                unsafe { rustix::mm::madvise(at, len, rustix::mm::Advice::LinuxRemove) }
                    .map_err(|e| os_error(Op::Release, 0, len, e))?;
            }
        }
        if !matches!(self.store, Store::Heap) {
            s.ranges.give(phys.offset, len as u64);
        }
        s.used -= len as u64;
        s.book.apply_release(phys);
        Ok(())
    }

    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: HostPhys,
        access: Access,
    ) -> Result<(), BackendError> {
        let mut s = self.state();
        s.book
            .check_map(addr, len, phys, 0)
            .refused(Op::Map, addr, len)?;
        if let Store::Heap = self.store {
            heap::map(&mut s, addr, len, phys)?;
            s.book.apply_map(addr, len, phys, access);
            return Ok(());
        }
        let (place, writable) = self.place_of(&s, phys);
        if !writable && access == Access::ReadWrite {
            return Err(BackendError::refused(
                Op::Map,
                addr,
                len,
                Violation::ReadOnly { addr, len },
            ));
        }
        // SAFETY: the book says `[addr, addr + len)` lies inside one of our reservations with
        // nothing mapped there, so replacing its `PROT_NONE` placeholder touches no live memory.
        // The file holds `len` bytes from `offset` (created so, or checked by `import`); a file
        // that is not writable is only mapped read-only (checked above).
        let mapped = unsafe { Self::map_place(addr, len, place, access) };
        if let Err(e) = mapped {
            // A failed MAP_FIXED may leave a hole; put the reservation's placeholder back, and
            // if even that fails, never touch the reservation again.
            // SAFETY: as above, the range is ours and unreferenced.
            if unsafe { Self::make_inaccessible(addr, len) }.is_err() {
                s.book.poison(addr, len);
            }
            return Err(os_error(Op::Map, addr, len, e));
        }
        s.book.apply_map(addr, len, phys, access);
        Ok(())
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.state();
        s.book
            .check_unmap(addr, len)
            .refused(Op::Unmap, addr, len)?;
        if let Store::Heap = self.store {
            heap::unmap(&mut s, addr, len);
            s.book.apply_unmap(addr, len);
            return Ok(());
        }
        // SAFETY: the book says the range is exactly covered by our mappings; the typed layer
        // unmaps only after every borrow of the memory has ended.
        if let Err(e) = unsafe { Self::make_inaccessible(addr, len) } {
            // A failed MAP_FIXED may have removed the mapping and left a hole that the kernel
            // can fill with someone else's memory: never touch this reservation again.
            s.book.poison(addr, len);
            return Err(os_error(Op::Unmap, addr, len, e));
        }
        s.book.apply_unmap(addr, len);
        Ok(())
    }

    fn copy_into_phys(&self, phys: HostPhys, src: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.state();
        s.book
            .check_copy(phys, src, len)
            .refused(Op::Copy, src, len)?;
        if let Store::Heap = self.store {
            heap::copy_into_phys(&mut s, phys, src, len);
            return Ok(());
        }
        // SAFETY: the book says every byte of `[src, src + len)` is mapped readable by this
        // backend, and the lock keeps it mapped for the duration of the copy.
        let bytes = unsafe { super::host_slice(src, len) };
        let (place, writable) = self.place_of(&s, phys);
        if !writable {
            let v = Violation::ReadOnly { addr: src, len };
            return Err(BackendError::refused(Op::Copy, src, len, v));
        }
        let (fd, mut at) = match place {
            Place::File(fd, at) => (fd, at),
            Place::Pages(to) => {
                // SAFETY: `[to, to + len)` is the allocation's range of the store, mapped
                // read-write for good and `len` bytes long (the book checked the length);
                // `bytes` is mapped readable (above), and is not this allocation (the book
                // refuses a copy of an allocation into itself).
                unsafe { std::ptr::copy(bytes.as_ptr(), to as *mut u8, len) };
                return Ok(());
            }
        };
        let mut rest = bytes;
        while !rest.is_empty() {
            let n =
                rustix::io::pwrite(fd, rest, at).map_err(|e| os_error(Op::Copy, src, len, e))?;
            rest = &rest[n..];
            at += n as u64;
        }
        Ok(())
    }

    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let s = self.state();
        s.book
            .check_access(src, dst.len(), false)
            .map_err(|v| BackendError::refused(Op::Copy, src, dst.len(), v))?;
        if dst.is_empty() {
            return Ok(()); // nothing to copy: `src` may be any address, even null
        }
        // SAFETY: the book says every byte of `[src, src + dst.len())` is mapped readable by this
        // backend, and the lock keeps it mapped for the duration of the copy; `dst` is the
        // caller's own buffer (`ptr::copy` allows it to overlap the source).
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn copy_within(&self, dst: Addr, src: Addr, len: usize) -> Result<(), BackendError> {
        let s = self.state();
        s.book
            .check_access(src, len, false)
            .refused(Op::Copy, src, len)?;
        s.book
            .check_access(dst, len, true)
            .refused(Op::Copy, dst, len)?;
        if len == 0 {
            return Ok(()); // nothing to copy: either address may be any, even null
        }
        // SAFETY: the book says `[src, src + len)` is mapped readable and `[dst, dst + len)`
        // read-write by this backend, and the lock keeps both mapped for the copy; the typed
        // layer copies only into memory it holds exclusively, which lends no slice meanwhile
        // (`ptr::copy` allows the ranges to overlap, though they never do).
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }

    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let s = self.state();
        s.book
            .check_access(dst, src.len(), true)
            .map_err(|v| BackendError::refused(Op::Copy, dst, src.len(), v))?;
        if src.is_empty() {
            return Ok(()); // nothing to copy: `dst` may be any address, even null
        }
        // SAFETY: the book says every byte of `[dst, dst + src.len())` is mapped read-write by
        // this backend, and the lock keeps it mapped for the duration of the copy; the typed
        // layer copies only into memory of a token it holds by value, which lends no slice.
        unsafe { std::ptr::copy(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn fence(&self) {}

    fn fence_done(&self, _fence: &()) -> bool {
        true
    }

    fn pin(&self) -> Result<(), BackendError> {
        self.state().pins += 1;
        Ok(())
    }

    fn unpin(&self) -> Result<(), BackendError> {
        let mut s = self.state();
        if s.pins == 0 {
            return Err(BackendError::refused(Op::Unpin, 0, 0, Violation::NotPinned));
        }
        s.pins -= 1;
        Ok(())
    }

    fn keep_for_good(&self, addr: Addr, len: usize) {
        // A poisoned reservation is never handed out, freed nor unmapped again, not even as
        // the backend drops: the range stays this process's, whatever a late peer does to it.
        self.state().book.poison(addr, len);
    }

    /// The anonymous store cannot export (no descriptor names its memory); the memfd store
    /// lacks nothing.
    fn lacks(&self, ability: Ability) -> Option<&'static str> {
        match self.memory() {
            HostMemory::Anonymous => (ability == Ability::Export).then_some(ANONYMOUS),
            HostMemory::Heap => {
                matches!(ability, Ability::Export | Ability::MapTwice).then_some(heap::HEAP)
            }
            _ => None,
        }
    }
}

/// The anonymous store, named in its refusals.
pub(super) const ANONYMOUS: &str =
    "the host's anonymous store (memfd_create refused or not asked for)";

// SAFETY: a successful `map` places a `MAP_SHARED` mapping of the store — the `memfd`, or the
// pages of the anonymous store's shared mapping (`mremap`) — (or of the
// allocation's own file, exportable or imported and checked as long as it claims) with `PROT_READ`
// (and `PROT_WRITE` for `ReadWrite`) at exactly `[addr, addr + len)`, backed by pages that
// `create` allocated; only `unmap`, `free` and `Drop` change mappings, each after its checks —
// and an export, which makes the mappings of the memory it seals read-only from the same file
// at the same offset, bytes unchanged (`files::seal_against_writes`).
unsafe impl HostVisible for HostBackend {}

impl Drop for HostBackend {
    fn drop(&mut self) {
        // Tokens borrow the device that owns this backend, so none can observe these ranges any
        // more: whatever a forgotten token left reserved goes back to the OS now.
        let s = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Store::Heap = self.store {
            heap::drop_all(&mut s.heap);
            return;
        }
        for (addr, len, poisoned) in s.book.drain_reservations() {
            if poisoned {
                continue; // may hold a hole filled by someone else's mapping: leave it
            }
            // SAFETY: the range is one of our reservations and no token can reference it.
            let _ = unsafe { rustix::mm::munmap(addr as *mut _, len) };
        }
        if let Store::Anonymous(base, len) = self.store {
            // SAFETY: the store's own mapping: every mapping of its pages was in a reservation,
            // gone above (its pages go with the last mapping), and nothing else points into it.
            let _ = unsafe { rustix::mm::munmap(base as *mut _, len) };
        }
    }
}

#[cfg(test)]
mod tests;
