//! Compile-time facts about the token types: sizes, niches, and which auto/marker traits hold.
//! A violated assertion fails the build of this test binary.

use memtoken::backend::{HostBackend, doubles::SimBackend};
use memtoken::{
    Allocation, Binding, Committed, Device, Releasing, Reserved, errors::QuarantineError,
    region::Elastic, report::ContextLost, report::Generation, report::Quarantined,
};
use static_assertions::{assert_eq_size, assert_impl_all, assert_not_impl_any};
use std::mem::size_of;

// Every type alias here is used only inside `const _` items (the assertions), which rustc 1.88,
// the crate's minimum Rust, does not count as uses: it warns that each is never used (later
// compilers do not). Hence the `allow`s.
#[allow(dead_code)]
type HostAlloc<S> = Allocation<'static, 'static, HostBackend, S>;
#[allow(dead_code)]
type SimAlloc<S> = Allocation<'static, 'static, SimBackend, S>;

// ---- state markers ----

// The state lives only in the type: a Reserved marker costs nothing at run time.
const _: () = assert!(size_of::<Reserved>() == 0);
// Likewise for Committed.
const _: () = assert!(size_of::<Committed>() == 0);
// Likewise for Releasing.
const _: () = assert!(size_of::<Releasing>() == 0);

// ---- exact token sizes ----

// Reserved = &Binding (8) + addr (8) + len (8) + generation (8); its parts are `()`.
const _: () = assert!(size_of::<HostAlloc<Reserved>>() == 32);
// Reserved carries no backend parts, so it is the same size on the simulator.
const _: () = assert!(size_of::<SimAlloc<Reserved>>() == 32);
// Committed on the host adds a HostPhys (offset + serial, 16 bytes).
const _: () = assert!(size_of::<HostAlloc<Committed>>() == 48);
// Committed on the simulator adds a SimPhys (8 bytes).
const _: () = assert!(size_of::<SimAlloc<Committed>>() == 40);
// Releasing adds what the token still holds (`Held`: reserved flag, mapped bytes, optional
// owned phys + length, optional shared reference, a region's granules and an imported prefix's
// handles as two `Vec`s (24 each, empty and unallocated for every other token)) and an optional
// fence, since any live state (Reserved, Committed, Prefix, mappings, Region, ImportedPrefix)
// can start a release. On the host: Held<HostPhys> is 104 (bool 1 + mapped 8 +
// Option<(HostPhys, usize)> 32, no niche + Option<Arc> 8 + 2 Vec 48, padded) and Option<()>
// pads to 8: 32 + 104 + 8.
const _: () = assert!(size_of::<HostAlloc<Releasing>>() == 144);
// On the simulator: Held<SimPhys> is 96 (bool 1 + mapped 8 + Option<(SimPhys, usize)> 24 +
// Option<Arc> 8 + 2 Vec 48, padded) and Option<u64> is 16 (a u64 has no niche): 32 + 96 + 16.
const _: () = assert!(size_of::<SimAlloc<Releasing>>() == 144);
// A region adds its mapped granules' handles and its withheld granules (two `Vec`s), how
// many of the mapped ones are committed and the tail's cap (two `usize`s), and the count of
// requests for the tails back it answered last (a `u64`).
const _: () = assert!(size_of::<HostAlloc<Elastic>>() == 104);
// The backend's parts are exactly as big as claimed above.
assert_eq_size!(memtoken::backend::HostPhys, [u64; 2]);
// SimPhys is one u64.
assert_eq_size!(memtoken::backend::doubles::SimPhys, u64);

// ---- niches: `Option<token>` costs nothing ----

// The binding reference (and the non-zero generation) give Option a niche: Reserved, host.
assert_eq_size!(Option<HostAlloc<Reserved>>, HostAlloc<Reserved>);
// Committed, host.
assert_eq_size!(Option<HostAlloc<Committed>>, HostAlloc<Committed>);
// Releasing, host.
assert_eq_size!(Option<HostAlloc<Releasing>>, HostAlloc<Releasing>);
// Reserved, simulator.
assert_eq_size!(Option<SimAlloc<Reserved>>, SimAlloc<Reserved>);
// Committed, simulator.
assert_eq_size!(Option<SimAlloc<Committed>>, SimAlloc<Committed>);
// Releasing, simulator.
assert_eq_size!(Option<SimAlloc<Releasing>>, SimAlloc<Releasing>);

// ---- linearity: nothing that owns memory or a pin can be duplicated ----

// A Reserved token cannot be cloned or copied (host).
assert_not_impl_any!(HostAlloc<Reserved>: Clone, Copy);
// A Committed token cannot be cloned or copied (host).
assert_not_impl_any!(HostAlloc<Committed>: Clone, Copy);
// A Releasing token cannot be cloned or copied (host).
assert_not_impl_any!(HostAlloc<Releasing>: Clone, Copy);
// A Reserved token cannot be cloned or copied (simulator, whose backend is itself Clone).
assert_not_impl_any!(SimAlloc<Reserved>: Clone, Copy);
// A Committed token cannot be cloned or copied (simulator).
assert_not_impl_any!(SimAlloc<Committed>: Clone, Copy);
// A Releasing token cannot be cloned or copied (simulator).
assert_not_impl_any!(SimAlloc<Releasing>: Clone, Copy);
// A device (its ledger, quarantine and brand) cannot be duplicated (host).
assert_not_impl_any!(Device<'static, HostBackend>: Clone, Copy);
// Nor on the simulator, although SimBackend is Clone.
assert_not_impl_any!(Device<'static, SimBackend>: Clone, Copy);
// A binding (a context pin and a budget) cannot be duplicated (host).
assert_not_impl_any!(Binding<'static, 'static, HostBackend>: Clone, Copy);
// Nor on the simulator.
assert_not_impl_any!(Binding<'static, 'static, SimBackend>: Clone, Copy);
// A proof that a context is gone cannot be duplicated either (it is handed out per call).
assert_not_impl_any!(ContextLost<'static>: Clone, Copy);
// The error carrying a quarantined token cannot be duplicated (host).
assert_not_impl_any!(QuarantineError<'static, 'static, HostBackend>: Clone, Copy);
// Nor on the simulator.
assert_not_impl_any!(QuarantineError<'static, 'static, SimBackend>: Clone, Copy);

// A quarantined residual has exactly one owner (host).
assert_not_impl_any!(Quarantined<'static, 'static, HostBackend>: Clone, Copy);
// Nor on the simulator.
assert_not_impl_any!(Quarantined<'static, 'static, SimBackend>: Clone, Copy);

// ---- threads ----

// A host device can be shared across threads (its ledger and queues are atomics and mutexes).
assert_impl_all!(Device<'static, HostBackend>: Send, Sync);
// A simulated device too.
assert_impl_all!(Device<'static, SimBackend>: Send, Sync);
// A host binding can move to, or be shared with, another thread.
assert_impl_all!(Binding<'static, 'static, HostBackend>: Send, Sync);
// A simulated binding too.
assert_impl_all!(Binding<'static, 'static, SimBackend>: Send, Sync);
// Host tokens in every state are Send + Sync: Reserved.
assert_impl_all!(HostAlloc<Reserved>: Send, Sync);
// Committed (Sync is sound: `&Allocation` only lends `&[u8]`).
assert_impl_all!(HostAlloc<Committed>: Send, Sync);
// Releasing.
assert_impl_all!(HostAlloc<Releasing>: Send, Sync);
// Simulated tokens in every state are Send + Sync: Reserved.
assert_impl_all!(SimAlloc<Reserved>: Send, Sync);
// Committed.
assert_impl_all!(SimAlloc<Committed>: Send, Sync);
// Releasing.
assert_impl_all!(SimAlloc<Releasing>: Send, Sync);
// A quarantined token can be retried from another thread.
assert_impl_all!(Quarantined<'static, 'static, HostBackend>: Send, Sync);
// Same for the simulator.
assert_impl_all!(Quarantined<'static, 'static, SimBackend>: Send, Sync);
// The proof of a lost context can be sent to the thread that discharges.
assert_impl_all!(ContextLost<'static>: Send, Sync);

// ---- shared prefixes, KV blocks, CUDA ----

#[allow(dead_code)] // used only in `const _` items (see above)
type HostCache = memtoken::kv::KvCache<'static, 'static, 'static, HostBackend>;
#[allow(dead_code)] // used only in `const _` items (see above)
type HostTable = memtoken::kv::BlockTable<'static, 'static, 'static, 'static, HostBackend>;
#[allow(dead_code)] // used only in `const _` items (see above)
type CudaModel = memtoken::backend::cuda::CudaBackend<memtoken::backend::doubles::DriverModel>;

// A block table is its cache's address, a Vec of 4-byte ids and its shared mark.
assert_eq_size!(HostTable, [usize; 5]);
// The shared-prefix tokens are allocations in states Owner / Sharer / Diverged: the core
// (binding reference, address, length, generation) and a reference (one Arc pointer) on the
// shared physical memory. A prefix (Owner):
assert_eq_size!(
    memtoken::sharing::Prefix<'static, 'static, HostBackend>,
    [usize; 5]
);
// A sharer's mapping is the same size.
assert_eq_size!(
    memtoken::sharing::PrefixMapping<'static, 'static, HostBackend>,
    [usize; 5]
);
// A diverged mapping adds its private granule's handle (HostPhys, two words).
assert_eq_size!(
    memtoken::sharing::DivergedMapping<'static, 'static, HostBackend>,
    [usize; 7]
);
// A committed CUDA token: its CudaPhys is two words, the driver's handle and the backend's
// serial (the driver may hand a released handle's value out again).
assert_eq_size!(
    Allocation<'static, 'static, CudaModel, Committed>,
    [usize; 6]
);
assert_eq_size!(memtoken::backend::cuda::CudaPhys, [u64; 2]);
// None of them can be duplicated.
assert_not_impl_any!(HostTable: Clone, Copy);
assert_not_impl_any!(HostCache: Clone, Copy);
assert_not_impl_any!(memtoken::sharing::Prefix<'static, 'static, HostBackend>: Clone, Copy);
assert_not_impl_any!(memtoken::sharing::PrefixMapping<'static, 'static, HostBackend>: Clone, Copy);
assert_not_impl_any!(memtoken::sharing::DivergedMapping<'static, 'static, HostBackend>: Clone, Copy);
// The cache's free lists are not locked: the cache is not Sync, so its tables (which hold a
// reference to it) are not Sync, and are Send only with the brands an engine gives what it
// keeps ('static: the engine moves with its cache); at any other brand a table stays on its
// thread (ui-tests/engine_table_to_thread.rs). A prefix cache never moves (its hook may hold
// anything).
assert_not_impl_any!(HostCache: Sync);
assert_not_impl_any!(HostTable: Sync);
assert_impl_all!(HostTable: Send);
assert_not_impl_any!(
    memtoken::kv::PrefixCache<'static, 'static, 'static, 'static, HostBackend, u64>: Send,
    Sync
);
// A cache with no table out may move to another thread.
assert_impl_all!(HostCache: Send);
// Mappings lend `&[u8]` only while their bytes cannot change: Send + Sync like allocations.
assert_impl_all!(memtoken::sharing::PrefixMapping<'static, 'static, HostBackend>: Send, Sync);
// What a failed release leaves may hold a reference on shared memory: it has one owner.
assert_not_impl_any!(memtoken::report::Residual<memtoken::backend::HostPhys>: Clone, Copy);
// A CUDA device and its tokens are shared across threads (the backend locks its record).
assert_impl_all!(Device<'static, CudaModel>: Send, Sync);
assert_impl_all!(Allocation<'static, 'static, CudaModel, Committed>: Send, Sync);

/// Generations are one word, and `Option<Generation>` uses the non-zero niche.
#[test]
fn generation_is_one_word_with_a_niche() {
    assert_eq!(size_of::<Generation>(), 8);
    assert_eq!(size_of::<Option<Generation>>(), 8);
}

// A capture is ended on the thread that began it, and its graph launches from there:
// neither is `Send` nor `Sync`.
assert_not_impl_any!(memtoken::interop::Capture<'static, 'static, memtoken::backend::doubles::DriverModel>: Send, Sync);
assert_not_impl_any!(memtoken::interop::CapturedGraph<'static, 'static, memtoken::backend::doubles::DriverModel>: Send, Sync);
