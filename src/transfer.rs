//! Descriptors for transfer engines (NIXL, UCX, Mooncake, …): a transfer engine registers
//! memory by address and length, and keeps its registration in a cache keyed by address. A
//! [`Registration`] borrows the token it describes, so the memory stays mapped while the
//! registration lives, and its [`Descriptor`] carries the allocation's generation, so a
//! registration cache can refuse a recycled address: a new allocation at the same address has
//! another generation.

use crate::allocation::Allocation;
use crate::backend::{Addr, Backend, Location};
use crate::ids::Generation;
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
    _token: PhantomData<&'t ()>,
}

impl Registration<'_> {
    /// What the transfer engine registers.
    pub fn descriptor(&self) -> Descriptor {
        self.descriptor
    }
}

fn describe<B: Backend, S: crate::state::State>(
    token: &Allocation<'_, '_, B, S>,
    writable: bool,
) -> Descriptor {
    Descriptor {
        addr: token.addr(),
        len: token.len(),
        location: token.binding().device().backend().raw().location(),
        generation: token.generation(),
        writable,
    }
}

impl<B: Backend, S: Readable> Allocation<'_, '_, B, S> {
    /// Registers the memory for a transfer engine to read: the registration borrows this token,
    /// which stays mapped (and cannot be released) while it lives.
    pub fn register(&self) -> Registration<'_> {
        Registration {
            descriptor: describe(self, false),
            _token: PhantomData,
        }
    }
}

impl<B: Backend> Allocation<'_, '_, B, Committed> {
    /// Registers the memory for a transfer engine to read and write: the registration borrows
    /// this allocation mutably, so nothing else reads or writes it through the token while the
    /// engine may.
    pub fn register_mut(&mut self) -> Registration<'_> {
        Registration {
            descriptor: describe(self, true),
            _token: PhantomData,
        }
    }
}
