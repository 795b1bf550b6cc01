//! A host backend's settings: its granularity, capacity, address space and store.

/// Settings of a [`HostBackend`](super::HostBackend).
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Allocation granularity in bytes: a power of two, at least the OS page size.
    /// Default: 4 KiB; use 2 MiB to mirror a GPU.
    pub granularity: usize,
    /// Total physical memory the device may create (the size of its store: the `memfd`, or the
    /// anonymous mapping): a positive multiple of the granularity. Default: 1 GiB.
    pub physical_capacity: u64,
    /// Largest single reservation: a positive multiple of the granularity, at most
    /// `isize::MAX` bytes rounded down to the granularity (the largest mapping the OS takes).
    /// Default: 1 TiB.
    pub address_space: usize,
    /// Where physical memory lives. Default: [`HostMemory::Auto`].
    pub memory: HostMemory,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            granularity: 4 << 10,
            physical_capacity: 1 << 30,
            address_space: 1 << 40,
            memory: HostMemory::Auto,
        }
    }
}

/// Where a [`HostBackend`](super::HostBackend)'s physical memory lives: the mechanism it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostMemory {
    /// A `memfd` if the OS gives one, else (a sandbox that refuses `memfd_create`)
    /// [`Anonymous`](Self::Anonymous).
    Auto,
    /// A `memfd` of the physical capacity (sparse): a map is an `mmap` of its range, a release
    /// punches a hole in it; memory created exportable gets a sealed `memfd` of its own.
    Memfd,
    /// One shared anonymous mapping of the physical capacity (no file): a map is a new mapping
    /// of its pages at the address (`mremap` with an old size of 0, which the kernel takes for
    /// shared mappings), a release gives the pages back (`MADV_REMOVE`). Every call works as on
    /// a `memfd` — sharing a granule at two addresses included — except what needs a file:
    /// export to another process (so [`create_exportable`](crate::backend::Exportable::create_exportable))
    /// is refused with [`Cause::Unsupported`](crate::backend::Cause::Unsupported) naming it. Chosen by `Auto` when `memfd_create` is
    /// refused, or asked for (as the tests do, to run without a `memfd`).
    Anonymous,
    /// No system call at all: a reservation is a heap allocation aligned to the granularity,
    /// and physical memory a heap buffer whose bytes are copied in where it is mapped and back
    /// out as it is unmapped. What needs one memory at two addresses is refused with
    /// [`Cause::Unsupported`](crate::backend::Cause::Unsupported) naming it: a second mapping of the same memory (so prefix
    /// sharing) and export. Chosen by `Auto` under Miri, which has neither `memfd_create` nor
    /// shared or fixed mappings, so that the typed views of host memory run there.
    Heap,
}
