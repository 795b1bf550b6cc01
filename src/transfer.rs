//! Descriptors for transfer engines (NIXL, UCX, Mooncake, …): a transfer engine registers
//! memory by address and length, and keeps its registration in a cache keyed by address. A
//! [`Registration`] borrows the token it describes, so the memory stays mapped while the
//! registration lives, and its [`Descriptor`] carries the allocation's generation, so a
//! registration cache can refuse a recycled address: a new allocation at the same address has
//! another generation.
//!
//! **What one descriptor covers.** [`Registration::descriptor`] covers the token's whole VA
//! range, which is contiguous but not always one physical allocation: a shared prefix longer
//! than one granule (its owner's [`Prefix`](crate::sharing::Prefix), a sharer's mapping, a diverged one,
//! an imported one) is two — the body and the boundary granule — mapped side by side.
//! [`Registration::segments`] gives one descriptor per physical allocation, in address order,
//! together covering exactly the whole range. An engine that registers by address range (host
//! memory, `ibv_reg_mr` of a host range) may register the whole descriptor; one that resolves a
//! device range to its allocation — with `cuMemGetAddressRange`, which on VMM memory reports
//! only one mapped segment (fact 24 of `docs/cuda-facts.md`), or by exporting the allocation
//! (dma-buf) — must register each segment.
//!
//! Guide: [`guide::transfer_engines`](crate::guide::transfer_engines).

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, Location};
use crate::ids::Generation;
use crate::sharing::Imported;
use crate::sharing::{Capability, Diverged, Owner, Sharer};
use crate::state::{Committed, Readable};
use std::marker::PhantomData;

/// What a transfer engine registers: where the memory is, how long, on which device, and the
/// allocation's generation (never derived from the address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Descriptor {
    /// The memory's start (a host pointer, or a `CUdeviceptr`).
    pub addr: Addr,
    /// Its length in bytes.
    pub len: usize,
    /// The device the memory lives on.
    pub location: Location,
    /// The allocation the memory belongs to: a registration cache that keys on it refuses an
    /// entry whose address was recycled by another allocation.
    pub generation: Generation,
    /// Whether the engine may write the memory (a registration made from `&mut`).
    pub writable: bool,
}

/// A live registration of a token's memory with a transfer engine: it borrows the token, so the
/// memory stays mapped (and the token cannot be released) while it lives. Drop it once the
/// engine has deregistered the memory.
///
/// Releasing under a live registration does not compile:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// let a = binding.reserve(4096).unwrap().commit().unwrap();
/// let registration = a.register();
/// let released = a.release();
/// println!("{:?}", registration.descriptor());
/// ```
#[derive(Debug)]
pub struct Registration<'t> {
    descriptor: Descriptor,
    /// Bytes of the first physical allocation where the range holds two (a prefix's body);
    /// 0 where one allocation backs the whole range.
    body: usize,
    _token: PhantomData<&'t ()>,
}

impl Registration<'_> {
    /// What the transfer engine registers: the token's whole VA range, contiguous, which may
    /// span two physical allocations (see [`segments`](Self::segments)).
    pub fn descriptor(&self) -> Descriptor {
        self.descriptor
    }

    /// One descriptor per physical allocation behind the range, in address order: each covers
    /// exactly one allocation's mapping (what `cuMemGetAddressRange` resolves an address in it
    /// to), and together they cover [`descriptor`](Self::descriptor)'s range exactly, without
    /// gap or overlap. Each has the registration's location, generation and writability.
    ///
    /// One for a committed allocation and for a prefix of one granule; two — the body, then the
    /// boundary granule — for a prefix longer than one granule, whoever maps it (owner, sharer,
    /// diverged or imported).
    pub fn segments(&self) -> impl Iterator<Item = Descriptor> {
        let whole = self.descriptor;
        let piece = move |offset: usize, len: usize| Descriptor {
            addr: whole.addr + offset,
            len,
            ..whole
        };
        let (first, boundary) = match self.body {
            0 => (whole.len, None),
            body => (body, Some(piece(body, whole.len - body))),
        };
        std::iter::once(piece(0, first)).chain(boundary)
    }
}

/// A state whose tokens a transfer engine can register: every [`Readable`] state (sealed: no
/// other crate can add a readable state). It knows how the token's range lies in physical
/// allocations, for [`Registration::segments`].
pub trait Registrable: Readable + Sized {
    /// Bytes of the first of two physical allocations behind `token`'s range (a prefix's
    /// body), or 0 where one allocation backs it all.
    #[doc(hidden)]
    fn body_len<B: Backend>(token: &Allocation<'_, '_, B, Self>) -> usize;
}

impl Registrable for Committed {
    /// A commit creates one physical allocation for its whole range.
    fn body_len<B: Backend>(_: &Allocation<'_, '_, B, Self>) -> usize {
        0
    }
}

/// A prefix and every mapping of it share the prefix's layout: the body (absent for one
/// granule), then the boundary granule (for a diverged mapping, its private copy, as long).
fn shared_body_len<B: Backend, S: Readable>(token: &Allocation<'_, '_, B, S>) -> usize {
    S::shared::<B>(token.parts()).map_or(0, |shared| shared.split().body_len())
}

impl<K: Capability> Registrable for Owner<K> {
    fn body_len<B: Backend>(token: &Allocation<'_, '_, B, Self>) -> usize {
        shared_body_len(token)
    }
}

impl Registrable for Sharer {
    fn body_len<B: Backend>(token: &Allocation<'_, '_, B, Self>) -> usize {
        shared_body_len(token)
    }
}

impl Registrable for Diverged {
    fn body_len<B: Backend>(token: &Allocation<'_, '_, B, Self>) -> usize {
        shared_body_len(token)
    }
}

impl Registrable for Imported {
    /// One imported handle per exported allocation: the body's (if any) and the boundary's.
    fn body_len<B: Backend>(token: &Allocation<'_, '_, B, Self>) -> usize {
        token.parts().0.map_or(0, |(_, len)| len)
    }
}

fn register<'t, B: Backend, S: Registrable>(
    token: &'t Allocation<'_, '_, B, S>,
    writable: bool,
) -> Registration<'t> {
    Registration {
        descriptor: Descriptor {
            addr: token.addr(),
            len: token.len(),
            location: token.binding().device().backend().location(),
            generation: token.generation(),
            writable,
        },
        body: S::body_len(token),
        _token: PhantomData,
    }
}

impl<B: Backend, S: Registrable> Allocation<'_, '_, B, S> {
    /// Registers the memory for a transfer engine to read: the registration borrows this token,
    /// which stays mapped (and cannot be released) while it lives.
    pub fn register(&self) -> Registration<'_> {
        register(self, false)
    }
}

impl<B: Backend> Allocation<'_, '_, B, Committed> {
    /// Registers the memory for a transfer engine to read and write: the registration borrows
    /// this allocation mutably, so nothing else reads or writes it through the token while the
    /// engine may.
    pub fn register_mut(&mut self) -> Registration<'_> {
        register(self, true)
    }
}
