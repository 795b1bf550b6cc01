//! The backend seam: the mechanism of virtual memory management and nothing else.
//! Guide: [`guide::backends`](crate::guide::backends).
//!
//! A [`Backend`] reserves and frees virtual address (VA) ranges, creates and releases physical
//! memory, maps and unmaps physical memory into reserved ranges with an [`Access`] mode, and
//! records fences for stream-ordered release. It knows nothing about tokens, states, budgets or
//! ledgers: those live above it, in [`Device`](crate::Device) and the token types.
//!
//! Every backend call is *safe* to make, with any argument: a backend validates each address,
//! length and handle against its own record of what it handed out, and refuses (with
//! [`Cause::Violation`]) a call that breaks the VMM rules instead of touching memory it does not
//! own — a handle it never created (another backend's included) or released, a zero, unaligned
//! or huge length, a range whose end `addr + len` overflows. No such call panics or wraps
//! around, in a debug build or a release one. All `unsafe` system calls of the crate live
//! behind this trait.
//!
//! Backends shipped here:
//! - [`HostBackend`]: real host VMM on Linux over `rustix` (`mmap`, a `memfd`, hole punching);
//! - [`cuda::CudaBackend`]: CUDA VMM over a thin driver seam — the real driver through `cudarc`
//!   (feature `cuda`), or the driver model.
//!
//! Test doubles, in [`doubles`]: [`SimBackend`](doubles::SimBackend), a pure-Rust strict model
//! of the VMM rules; [`Faulty`](doubles::Faulty), a wrapper around any backend that injects
//! failures and counts what is outstanding; [`DriverModel`](doubles::DriverModel), a strict
//! model of the CUDA driver's rules.

/// Declares a fieldless enum and its `ALL`, every variant in declaration order, from one list
/// (so the list cannot miss a variant).
macro_rules! listed {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident,)+
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every kind, in declaration order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];
        }
    };
}

pub mod cuda;
pub mod doubles;
mod export;
mod host;
mod host_visible;
mod rules;

pub use export::{Exportable, Fabric, HandleKind, HandleType, PosixFd, Shareable};
pub use host::{HostBackend, HostConfig, HostMemory, HostPhys};
pub use host_visible::HostVisible;
pub(crate) use host_visible::{host_slice, host_slice_mut};
pub use rules::Violation;

use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A number never handed out before in this process, by any backend or device: the one source
/// of every identity memtoken makes — the backends' serials of physical memory and fences, and
/// the devices' generations — so two devices, or two backends, never make equal ones.
pub(crate) fn unique() -> NonZeroU64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // 2^64 numbers at one per nanosecond last 584 years: the counter never wraps to 0.
    NonZeroU64::new(n).expect("the process-wide counter never wraps")
}

/// Locks `m`, and goes on through poison: a panic in one call (a strict model refusing it,
/// say) does not make every later call panic too. The one poison-tolerant lock of the crate.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a backend could not be made from its configuration. Nothing was created: fix the value
/// named in the message and make the backend again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The granularity is not a power of two.
    #[error(
        "granularity {granularity:#x} is not a power of two: use a power of two such as \
         4 KiB (0x1000) or 2 MiB (0x200000)"
    )]
    GranularityNotPowerOfTwo {
        /// The granularity given.
        granularity: usize,
    },
    /// The granularity is smaller than the OS page size (host backend).
    #[error(
        "granularity {granularity:#x} is smaller than the OS page size {page_size:#x}: use a \
         power of two of at least {page_size:#x}"
    )]
    GranularityBelowPageSize {
        /// The granularity given.
        granularity: usize,
        /// The OS page size.
        page_size: usize,
    },
    /// A size that must be a positive multiple of the granularity is not.
    #[error(
        "{what} is {value:#x} bytes, which is not a positive multiple of the granularity \
         ({granularity:#x}): set it to a non-zero multiple of the granularity"
    )]
    NotAGranularityMultiple {
        /// Which setting.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The granularity.
        granularity: usize,
    },
    /// A size that must be positive is zero.
    #[error("{what} is zero: give it a positive number of bytes")]
    Zero {
        /// Which setting.
        what: &'static str,
    },
    /// The address space is larger than one mapping of the OS may be (host backend).
    #[error(
        "address space {address_space:#x} is larger than one mapping may be ({max:#x}): \
         use at most {max:#x}"
    )]
    AddressSpaceTooLarge {
        /// The address space given.
        address_space: usize,
        /// The largest allowed.
        max: usize,
    },
    /// The OS could not create or size the host backend's `memfd` (its physical memory).
    #[error(
        "the OS refused the memfd of {physical_capacity:#x} bytes that holds the host \
         backend's physical memory: check the process's file and memory limits, or lower \
         the physical capacity"
    )]
    Memfd {
        /// The physical capacity asked for.
        physical_capacity: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The OS could not map the host backend's anonymous store (its physical memory where
    /// there is no `memfd`, see [`HostMemory`]).
    #[error(
        "the OS refused the anonymous store of {physical_capacity:#x} bytes that holds the host \
         backend's physical memory: check the process's address-space and memory limits, or \
         lower the physical capacity"
    )]
    AnonymousStore {
        /// The physical capacity asked for.
        physical_capacity: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl ConfigError {
    /// Checks that `granularity` is a power of two.
    pub(crate) fn check_granularity(granularity: usize) -> Result<(), Self> {
        if granularity.is_power_of_two() {
            Ok(())
        } else {
            Err(Self::GranularityNotPowerOfTwo { granularity })
        }
    }

    /// Checks that `value` (the setting `what`) is a positive multiple of `granularity`.
    pub(crate) fn check_multiple(
        what: &'static str,
        value: u64,
        granularity: usize,
    ) -> Result<(), Self> {
        if value > 0 && value.is_multiple_of(granularity as u64) {
            Ok(())
        } else {
            Err(Self::NotAGranularityMultiple {
                what,
                value,
                granularity,
            })
        }
    }

    /// Checks that `value` (the setting `what`) is not zero.
    pub(crate) fn check_positive(what: &'static str, value: u64) -> Result<(), Self> {
        if value > 0 {
            Ok(())
        } else {
            Err(Self::Zero { what })
        }
    }
}

/// Checks that a reservation of `len` bytes fits in an address space of `address_space` bytes
/// (the largest single reservation): [`Cause::AddressSpace`] if it does not. Every backend's
/// `reserve` makes this check before it reserves anything.
pub(crate) fn check_address_space(len: usize, address_space: usize) -> Result<(), BackendError> {
    if len <= address_space {
        Ok(())
    } else {
        Err(address_space_exhausted(len, address_space))
    }
}

/// The error of a reservation of `len` bytes that does not fit in `address_space` bytes.
pub(crate) fn address_space_exhausted(len: usize, address_space: usize) -> BackendError {
    let cause = Cause::AddressSpace {
        requested: len,
        limit: address_space,
    };
    BackendError::new(Op::Reserve, 0, len, cause)
}

/// A virtual address, as the backend hands it out (a host pointer or a `CUdeviceptr`).
pub type Addr = usize;

/// `len` bytes of addresses from `addr`: the one place where the end of a span is computed, so
/// an end that overflows the address space is never wrapped around by accident.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: Addr,
    pub(crate) len: usize,
}

impl Span {
    #[inline]
    pub(crate) const fn new(addr: Addr, len: usize) -> Self {
        Self { addr, len }
    }

    /// One past its last byte, or `None` when that is past the top of the address space.
    #[inline]
    pub(crate) const fn end(self) -> Option<Addr> {
        self.addr.checked_add(self.len)
    }

    /// Its end, or the top of the address space when the end is past it (for range queries,
    /// where nothing lies past the top).
    #[inline]
    pub(crate) const fn end_or_top(self) -> Addr {
        self.addr.saturating_add(self.len)
    }
}

listed! {
    /// The kinds of backend calls, used to name a failed call and to aim injected faults.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum Op {
        /// Reserve a VA range.
        Reserve,
        /// Free a VA range.
        Free,
        /// Create physical memory.
        Create,
        /// Release physical memory.
        Release,
        /// Map physical memory into a reserved range.
        Map,
        /// Unmap a mapped range (the VA stays reserved).
        Unmap,
        /// Pin the context (a binding's hold on the device).
        Pin,
        /// Unpin the context.
        Unpin,
        /// Copy mapped memory into physical memory (copy-on-write), or to or from the host.
        Copy,
        /// Record or query a fence.
        Fence,
        /// Capture, instantiate, launch or destroy a CUDA graph.
        Graph,
    }
}

/// Where a backend's memory lives: what a transfer engine needs to know besides its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory.
    Host,
    /// Memory of a CUDA device (`CUdevice`).
    Cuda {
        /// The device.
        device: i32,
    },
    /// Memory of the simulator: nothing real.
    Simulated,
}

/// How a mapping may be accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Readable and writable (the owner of physical memory).
    ReadWrite,
    /// Readable only (a sharer of someone else's physical memory).
    ReadOnly,
}

/// Why a backend call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Cause {
    /// The operating system refused the call.
    #[error("the OS returned errno {errno} ({})", std::io::Error::from_raw_os_error(*errno))]
    Os {
        /// The raw `errno`.
        errno: i32,
    },
    /// The call broke a VMM rule; the backend refused it without touching memory.
    #[error("rule violated: {0}")]
    Violation(Violation),
    /// Physical memory is exhausted.
    #[error(
        "out of physical memory: requested {requested} bytes, {available} of {capacity} available"
    )]
    Exhausted {
        /// Bytes requested.
        requested: u64,
        /// Bytes still available.
        available: u64,
        /// Total physical capacity.
        capacity: u64,
    },
    /// A reservation larger than the address space allows.
    #[error(
        "out of address space: requested {requested} bytes, the largest reservation is {limit} bytes"
    )]
    AddressSpace {
        /// Bytes requested.
        requested: usize,
        /// The largest reservation.
        limit: usize,
    },
    /// The CUDA driver returned an error.
    #[error("the driver returned {name} ({code})")]
    Driver {
        /// The `CUresult`.
        code: i32,
        /// Its name.
        name: &'static str,
    },
    /// The context is lost: no call was made.
    #[error("the context is lost, so no driver call was made")]
    ContextLost,
    /// The backend panicked in this call (one whose [`Backend::MAY_PANIC`] is true). memtoken
    /// took the call's failure path (nothing was lost; what could not be undone is
    /// quarantined), and the panic resumes when the public call that made it returns, so a
    /// caller normally sees the panic, not this error — unless its thread was unwinding
    /// already (a token dropped during a panic, say): the second panic is then dropped, and
    /// this error is what is left of it.
    #[error("the backend panicked: {message}")]
    Panicked {
        /// The panic's message.
        message: String,
    },
    /// A fault injected by [`Faulty`](crate::backend::doubles::Faulty) (the Nth call of its kind).
    #[error("fault injected into call #{nth} of this kind")]
    Injected {
        /// Which call of its kind (1-based) was failed.
        nth: u64,
    },
    /// The backend's mechanism cannot do this at all (not a failure that may pass): a host
    /// backend without a `memfd` cannot export, say. Nothing was done.
    #[error("{mechanism} cannot {capability}")]
    Unsupported {
        /// What was asked, as a capability ("export memory to another process").
        capability: &'static str,
        /// The mechanism that cannot, and why ("the host's anonymous store (no memfd)").
        mechanism: &'static str,
    },
}

listed! {
    /// What a backend's mechanism may be unable to do at all. A backend that lacks one says so
    /// once ([`Backend::lacks`]), and every call that would need it is refused with
    /// [`Cause::Unsupported`] naming it — never emulated.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Ability {
        /// Map memory at an address reserved before it was made: a reservation's address is where
        /// its memory will be, and a region grows in place. Without it (CUDA's plain
        /// `cuMemAlloc` mechanism), a reservation is a claim on nothing but its length, and a
        /// commit puts the memory where the allocator places it: the committed token's address.
        MapAtReservedAddress,
        /// Map one physical allocation at two addresses: prefix sharing.
        MapTwice,
        /// Give memory back while its addresses stay reserved: suspend and resume.
        SuspendInPlace,
        /// Export memory to another process.
        Export,
        /// Map memory read-only.
        MapReadOnly,
        /// Give peer devices access to the memory.
        PeerAccess,
    }
}

impl Ability {
    /// What is asked, as [`Cause::Unsupported`]'s `capability` says it.
    pub const fn capability(self) -> &'static str {
        match self {
            Ability::MapAtReservedAddress => {
                "map memory at a reserved address (grow a region in place)"
            }
            Ability::MapTwice => "map one physical allocation at two addresses (share a prefix)",
            Ability::SuspendInPlace => {
                "give memory back while its addresses stay reserved (suspend)"
            }
            Ability::Export => "export memory to another process",
            Ability::MapReadOnly => "map memory read-only",
            Ability::PeerAccess => "give peer devices access to its memory",
        }
    }

    /// The index of this ability in [`ALL`](Self::ALL).
    pub(crate) const fn index(self) -> usize {
        self as usize
    }

    /// The error of a call `op` on `len` bytes at `addr` that needs this ability, which
    /// `mechanism` lacks.
    pub(crate) fn refused(
        self,
        op: Op,
        addr: Addr,
        len: usize,
        mechanism: &'static str,
    ) -> BackendError {
        let capability = self.capability();
        BackendError::new(
            op,
            addr,
            len,
            Cause::Unsupported {
                capability,
                mechanism,
            },
        )
    }
}

/// A failed backend call: which call, on which range, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("backend call {op:?} ({len} bytes at {addr:#x}) failed: {cause}")]
pub struct BackendError {
    /// The call that failed.
    pub op: Op,
    /// The address the call was about (0 where it has none, e.g. `Create`).
    pub addr: Addr,
    /// The length the call was about.
    pub len: usize,
    /// Why it failed.
    pub cause: Cause,
}

impl BackendError {
    /// Whether the call failed because the device's context is lost: refused without a call
    /// ([`Cause::ContextLost`]), or the driver's error that found the loss (a sticky or
    /// context-gone code, which marks the backend lost: no call is made after it).
    pub fn is_context_lost(&self) -> bool {
        match self.cause {
            Cause::ContextLost => true,
            Cause::Driver { code, .. } => cuda::CuError(code).is_context_loss(),
            _ => false,
        }
    }

    /// A new error for `op` on `len` bytes at `addr`.
    pub fn new(op: Op, addr: Addr, len: usize, cause: Cause) -> Self {
        Self {
            op,
            addr,
            len,
            cause,
        }
    }

    /// The error of a call refused because it breaks a VMM rule: nothing was touched.
    pub(crate) fn refused(op: Op, addr: Addr, len: usize, violation: Violation) -> Self {
        Self::new(op, addr, len, Cause::Violation(violation))
    }

    /// True when the fault was injected by [`Faulty`](crate::backend::doubles::Faulty).
    pub fn is_injected(&self) -> bool {
        matches!(self.cause, Cause::Injected { .. })
    }
}

/// A rule book's verdict as a backend's result: `book.check_map(…).refused(Op::Map, addr,
/// len)?` — the call refused, nothing touched ([`BackendError::refused`]).
pub(crate) trait Refuse<T> {
    /// The verdict, a violation made the error of call `op` on `len` bytes at `addr`.
    fn refused(self, op: Op, addr: Addr, len: usize) -> Result<T, BackendError>;
}

impl<T> Refuse<T> for Result<T, Violation> {
    #[inline(always)]
    fn refused(self, op: Op, addr: Addr, len: usize) -> Result<T, BackendError> {
        self.map_err(|v| BackendError::refused(op, addr, len, v))
    }
}

/// The mechanism of virtual memory management: what the typed layer above calls, one-to-one.
///
/// Lengths and addresses are multiples of [`granularity`](Backend::granularity); the layer above
/// rounds requests before it calls. Implementations validate every argument against what they
/// handed out and return [`Cause::Violation`] on a call that breaks the rules (a
/// [`SimBackend`](crate::backend::doubles::SimBackend) made
/// [`strict`](crate::backend::doubles::SimBackend::strict) panics instead, for tests), so that no
/// safe call can touch memory the backend does not own, whatever its arguments: no call panics or
/// wraps around on an address, length or handle, however wrong (`tests/it/backend_input.rs` throws
/// arbitrary ones at each backend).
pub trait Backend {
    /// A handle on physical memory (a `memfd` range on the host, a `CUmemGenericAllocationHandle`
    /// on CUDA). Handles are never reused, so a stale one is always refused.
    type Phys: Copy + Eq + fmt::Debug;
    /// A fence marking the end of the work submitted so far (a CUDA event; `()` on the host).
    type Fence;
    /// Whether nothing can use this backend's memory asynchronously, so every fence is done as
    /// soon as it is recorded (the host). Lets the KV cache hand a block given back out again at once;
    /// elsewhere such a block waits behind a fence.
    const IMMEDIATE: bool = false;
    /// Whether a call may panic. Inside memtoken every call of a backend that may is
    /// **contained**: a panic is taken as that call's failure (the typed layer's error path runs,
    /// nothing is lost), and resumes when the public call that made it returns. `false`
    /// promises that no call panics on any input (the host backend: a failed allocation aborts
    /// instead), so its calls skip the containment's cost, a few dozen instructions each; a
    /// panic from such a backend unwinds at once, which is never unsafe, but may leave the
    /// ledger charged for what it interrupted.
    const MAY_PANIC: bool = true;

    /// The allocation granularity in bytes: every address and length is a multiple of it.
    ///
    /// This getter and the three after it are read once, when a [`Device`](crate::Device) is
    /// made, and kept: they must not change over the backend's life, and none of them is called
    /// inside a transition (where a panic could strand what it had built).
    fn granularity(&self) -> usize;
    /// The largest VA range one reservation may ask for.
    fn address_space(&self) -> usize;
    /// The total physical memory this backend can create.
    fn physical_capacity(&self) -> u64;
    /// Where this backend's memory lives.
    fn location(&self) -> Location {
        Location::Host
    }

    /// Reserves `len` bytes of VA, aligned to the granularity. Nothing is accessible yet.
    fn reserve(&self, len: usize) -> Result<Addr, BackendError>;
    /// Frees exactly a range returned by [`reserve`](Backend::reserve); nothing may be mapped in it.
    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError>;
    /// Creates `len` bytes of physical memory.
    fn create(&self, len: usize) -> Result<Self::Phys, BackendError>;
    /// Releases physical memory created by [`create`](Backend::create) with the same `len`.
    fn release(&self, phys: Self::Phys, len: usize) -> Result<(), BackendError>;
    /// Maps all of `phys` — `len` bytes, its whole length — at `addr` inside a reservation,
    /// with `access`. Nothing may already be mapped there. A mapping is always one whole
    /// physical allocation from its start: the CUDA driver documents no other (`cuMemMap`'s
    /// offset "currently must be zero"), so no backend offers one and the typed layer never
    /// depends on one.
    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: Self::Phys,
        access: Access,
    ) -> Result<(), BackendError>;
    /// Unmaps `[addr, addr + len)`, which must be exactly covered by whole mappings. The VA stays
    /// reserved.
    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError>;

    /// Copies `len` mapped bytes at `src` into all of `phys` (which has exactly `len` bytes; a
    /// device-to-device copy on CUDA). Used by copy-on-write before the copy is mapped.
    fn copy_into_phys(&self, phys: Self::Phys, src: Addr, len: usize) -> Result<(), BackendError>;

    /// Copies `dst.len()` bytes of mapped memory at `src` to the host (what a suspend saves).
    /// Every byte must be mapped. An empty `dst` copies nothing and succeeds, whatever `src`
    /// (no system or driver call sees it).
    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError>;
    /// Copies `src` from the host into memory at `dst` (what a resume restores). Every byte
    /// must be mapped read-write. An empty `src` copies nothing and succeeds, whatever `dst`.
    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError>;
    /// Copies `len` bytes of mapped memory at `src` to mapped read-write memory at `dst`, the
    /// two ranges apart (a KV block's copy-on-write); returns once the bytes have landed. On CUDA a
    /// device-to-device copy, ordered after the work that may use either range. By default
    /// through a host buffer (`copy_to_host`, then `copy_from_host`). `len == 0` copies
    /// nothing and succeeds.
    fn copy_within(&self, dst: Addr, src: Addr, len: usize) -> Result<(), BackendError> {
        if len == 0 {
            return Ok(());
        }
        let mut bytes = vec![0u8; len];
        self.copy_to_host(&mut bytes, src)?;
        self.copy_from_host(dst, &bytes)
    }

    /// Records a fence after all work submitted so far. Infallible: a backend that cannot record
    /// one returns a fence that reports done only once the work is known to be finished.
    fn fence(&self) -> Self::Fence;
    /// A fence after the work submitted so far that may use the memory of the reservations
    /// holding `at` (one address in each): what their release waits for. A backend that knows
    /// which streams used which memory (CUDA) records less than [`fence`](Backend::fence);
    /// by default, that fence.
    fn fence_for(&self, at: &[Addr]) -> Self::Fence {
        let _ = at;
        self.fence()
    }
    /// Whether the work before `fence` has finished. Never blocks.
    fn fence_done(&self, fence: &Self::Fence) -> bool;
    /// Blocks until the work before `fence` has finished, if the backend can wait for it;
    /// returns whether it has. Only a [`Device`](crate::Device) dropped while its context lives
    /// on waits, so that it can free everything it still holds, and `Allocation::wait` and
    /// `Device::flush` wait when asked to; nothing else waits for a fence.
    fn wait_fence(&self, fence: &Self::Fence) -> bool {
        self.fence_done(fence)
    }
    /// Gives back a fence that is no longer needed (destroys a CUDA event).
    fn retire_fence(&self, fence: Self::Fence) {
        let _ = fence;
    }

    /// Pins the context for a new binding (`cuDevicePrimaryCtxRetain` on CUDA).
    fn pin(&self) -> Result<(), BackendError>;
    /// Releases one pin taken by [`pin`](Backend::pin); with no pin held, refused with
    /// [`Violation::NotPinned`]. A call that fails (or panics) must have released nothing, as
    /// for every other call: the [`Device`](crate::Device) tries that pin again as it drops.
    fn unpin(&self) -> Result<(), BackendError>;

    /// Whether part of `[addr, addr + len)` must not go to a new owner although its token gave
    /// it back: memory a graph may still use (CUDA: lent to work on a stream while it
    /// captured). A pool handing parts of its memory to new owners keeps such parts out of
    /// its free list; memtoken's KV cache does not ask (a plane used in a graph memtoken did
    /// not capture is held mapped, and which blocks that graph's kernels touch is theirs to
    /// know: see `KvCache::plane_view`). None by default.
    fn withheld(&self, _addr: Addr, _len: usize) -> bool {
        false
    }
    /// `[addr, addr + len)` is withheld for good (memory a peer may still touch): never hand
    /// any of it out again nor unmap it, not even as the backend drops. Nothing by default (a
    /// backend whose ranges outlive it in the driver, as CUDA's do until the context goes).
    fn keep_for_good(&self, _addr: Addr, _len: usize) {}
    /// Whether this backend's mechanism lacks `ability`: `None` if it has it, else the
    /// mechanism, named for an error ("the CUDA plain-allocation mechanism"). Read once for
    /// each ability when a [`Device`](crate::Device) is made, and kept: it must not change over
    /// the backend's life. Every ability by default.
    fn lacks(&self, _ability: Ability) -> Option<&'static str> {
        None
    }
    /// Where memory mapped by the first [`map`](Backend::map) of `phys` over the whole
    /// reservation at `reserved` lives: `reserved` itself unless the backend lacks
    /// [`Ability::MapAtReservedAddress`] (it places memory where its allocator does; only a
    /// commit then maps, and the committed token takes this address). Must not panic.
    ///
    /// Such a backend's placed memory lives with its reservation: once unmapped, a
    /// [`free`](Backend::free) of the reservation frees it and releases `phys` too, in one
    /// call, and the typed layer makes no [`release`](Backend::release) of it (a release
    /// before the free marks it released; its memory still goes with the free).
    fn placed(&self, reserved: Addr, _phys: Self::Phys) -> Addr {
        reserved
    }
    /// Whether the context is confirmed lost (destroyed, or taken down by a sticky error):
    /// everything it held is freed by the driver, so quarantined residuals may be discharged,
    /// and no call is made any more.
    fn context_lost(&self) -> bool {
        false
    }
}
