//! # memtoken
//!
//! Linear ownership tokens for virtual memory on GPUs and on the host. An allocation is a token
//! whose **state is part of its type**; the compiler, not a runtime registry, checks the
//! lifecycle:
//!
//! ```text
//!   reserve(len)         commit                release (begin)         complete
//! ───────────────▶ Reserved ──────────▶ Committed ───────────────▶ Releasing ──────────────▶ Released
//!                    │  ▲ error: the same                ▲             │  error: Pending (same token)
//!                    │  └─ Reserved token back           │             ▼  or a backend call failed
//!                    │ release (no fence to wait for)    │         Quarantined ── retry ──▶ Released
//!                    └───────────────────────────────────┘             └── discharge (context lost)
//! ```
//!
//! Every verb means one thing on every token: `release` starts a release and returns the
//! [`Releasing`] token; `complete` (or `retry`, on a [`Quarantined`](crate::report::Quarantined) token) finishes it and
//! returns a [`Released`] receipt, or a token inside a [`TransitionError`].
//!
//! ## Quick start
//!
//! ```
//! use memtoken::{make_guard, Budget, Device};
//! use memtoken::backend::HostBackend;
//!
//! make_guard!(guard); // a brand unique to this device
//! let device = Device::new(guard, HostBackend::with_defaults()?);
//! let session = device.bind(Budget::bytes(1 << 20))?; // a context pin and a budget
//!
//! let reserved = session.reserve(64 << 10)?; // VA only: no access methods
//! let mut kv = reserved.commit()?; // mapped read-write, charged
//! kv.as_mut_slice()[..5].copy_from_slice(b"hello");
//! assert_eq!(&kv.as_slice()[..5], b"hello");
//! assert_eq!(device.ledger().owned_bytes, 64 << 10);
//!
//! let receipt = kv.release().complete()?; // consumes the token
//! assert_eq!(receipt.len, 64 << 10);
//! assert_eq!(device.ledger().owned_bytes, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Guides
//!
//! One topic a page, each with examples that run as doc tests: [`guide`] — tokens and their
//! verbs, shared prefixes, the KV cache and its prefix cache, elastic regions, sleep and wake,
//! CUDA (streams, fences, captures, peers), the backends, mechanisms chosen at run time,
//! structuring a program (engines, threads, errors), transfer engines and NIXL.
//!
//! ## Where things are
//!
//! The root holds what a first program needs: the [`Device`], its [`Binding`] and [`Budget`],
//! the token ([`Allocation`]), its states and its receipt ([`Released`]), [`Error`] and
//! [`TransitionError`], the brand ([`make_guard!`], [`Guard`]), the [`Engine`] that owns them
//! ([`Keeps`], [`Parts`]), the byte traits ([`Bytes`], [`BytesMut`]), and `cudarc` (feature
//! `cuda`). The rest is in modules named for what they are: [`kv`] (the KV cache),
//! [`sharing`] (shared prefixes, across processes too), [`region`] (elastic regions),
//! [`sleep`] (sleep and wake), [`interop`] (CUDA captures and views), [`transfer`] and
//! `nixl` (transfer engines, feature `nixl`), [`report`] (what a device reports), [`errors`] (every cause in
//! detail), [`backend`] (the mechanisms) and [`mechanism`] (choosing one at run time).
//!
//! ## Guarantees
//!
//! At compile time (each one has a `compile_fail` example in these docs and a `trybuild` case):
//! no access to reserved or releasing memory, no use after release, no double release, no
//! clone or copy of a token, no dropping of a device or binding while its tokens live, no slice
//! or typed view kept across a release (nor a region's slice across a shrink), no mixing of two devices' tokens, no state added
//! outside the crate, no ignored fallible transition.
//!
//! At run time (each one proven by tests, property tests with injected faults among them):
//! a fallible transition hands the original token back; a VA range is never handed out again
//! while anything under it is mapped or owned (a failed release **quarantines** exactly what is
//! left); the ledger's two axes — **mapped** and **owned** bytes — are each refunded exactly
//! once, owned only once the backend confirms the release; a binding's budget is enforced with
//! an error naming the bytes requested, used and the limit; allocations are identified by
//! generations, never by addresses; the device never calls the backend while holding one of
//! its own locks.
//!
//! `mem::forget` is safe Rust, so "exactly once" means at most once by construction; a forgotten
//! token shows as bytes still charged in [`Device::close`]'s report, never as undefined behaviour.
//!
//! ## Layers
//!
//! [`backend`] is the mechanism (host VMM over `rustix`, CUDA VMM over `cudarc` or a strict
//! driver model, a strict simulator, fault injection). On top of it, lowest first: the
//! identities, the ledger, residuals and states; the [`Device`] (its ledger and custody:
//! quarantine and deferred queue); the [`Binding`]; the tokens ([`Allocation`] in each
//! [`State`], [`Quarantined`](crate::report::Quarantined)); the policies — shared prefixes ([`Prefix`](crate::sharing::Prefix), [`PrefixMapping`](crate::sharing::PrefixMapping),
//! [`DivergedMapping`](crate::sharing::DivergedMapping), which are allocations in states of their own) and the KV cache
//! ([`kv::KvCache`], [`kv::BlockTable`], [`kv::PrefixCache`]); and interop: typed views — host tokens lend
//! `&[T]` / `&mut [T]` of plain-old-data `T` (`as_slice_of`, checked by `bytemuck`), CUDA
//! tokens lend cudarc device memory of `T` (`DeviceView`, `DeviceViewMut`, feature `cuda`) —
//! and the CUDA tokens' host copies. Each layer names only the ones below it.
//!
//! ## Writing code generic over tokens
//!
//! A token carries two lifetimes: `'b`, the borrow of its [`Binding`], and `'id`, its device's
//! brand. A function that only borrows a token elides both; one that takes or returns a token by
//! value names them, because the result borrows the same binding:
//!
//! ```
//! use memtoken::backend::{Backend, HostVisible};
//! use memtoken::{Allocation, Committed, Releasing};
//!
//! fn checksum<B: HostVisible>(kv: &Allocation<'_, '_, B, Committed>) -> u64 {
//!     kv.as_slice().iter().map(|&b| u64::from(b)).sum()
//! }
//!
//! fn retire<'b, 'id, B: Backend>(
//!     kv: Allocation<'b, 'id, B, Committed>,
//! ) -> Allocation<'b, 'id, B, Releasing> {
//!     kv.release()
//! }
//! ```
//!
//! ## The hot path
//!
//! A KV cache takes a block every few tokens: [`kv::KvCache`] hands out block ids from
//! per-group free lists in O(1), with no system call and no allocation, and a
//! [`kv::BlockTable`] holds a sequence's blocks — the ids attention kernels read. Counted
//! against the same cache written by hand, the block cycle executes fewer instructions (907
//! against 963; the README's benchmark table).
//!
//! ```
//! use memtoken::{make_guard, Budget, Device};
//! use memtoken::backend::HostBackend;
//! use memtoken::kv::{KvCache, Layout};
//!
//! make_guard!(guard);
//! let device = Device::new(guard, HostBackend::with_defaults()?);
//! let session = device.bind(Budget::unlimited())?;
//! make_guard!(cache_guard);
//! // 1,024 blocks of 16 tokens, one plane of 256 bytes a block.
//! let cache = KvCache::new(cache_guard, &session, &Layout::new(1024, 16).plane(256))?;
//! cache.replenish()?; // maps groups between steps: the only backend calls
//! let mut table = cache.table();
//! for _ in 0..16 {
//!     cache.push(&mut table)?; // the 16 blocks of a 256-token sequence
//! }
//! table.write(0, 0, 0, &[1])?;
//! cache.clear(&mut table); // all 16 back, O(1) each
//! assert_eq!(cache.live_blocks(), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Shared prefixes
//!
//! ```
//! use memtoken::{make_guard, Budget, Device};
//! use memtoken::backend::HostBackend;
//!
//! make_guard!(guard);
//! let device = Device::new(guard, HostBackend::with_defaults()?);
//! let (system, session) = (device.bind(Budget::unlimited())?, device.bind(Budget::bytes(4096))?);
//!
//! let mut prompt = system.reserve(8192)?.commit_prefix()?;
//! prompt.as_mut_slice().expect("not shared yet").fill(7);
//! let seq = session.reserve(8192)?.map_prefix(&prompt)?;
//! assert_eq!(seq.as_slice()[0], 7); // the same physical page, mapped read-only
//! assert_eq!(session.used(), 0); // a sharer owns nothing
//!
//! let mut seq = seq.diverge()?; // private copy of the last granule
//! seq.boundary_mut()[0] = 9;
//! assert_eq!(prompt.as_slice()[4096], 7); // the original is untouched
//! assert_eq!(session.used(), 4096); // exactly one granule
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))] // docs.rs: each item says the feature it needs
#![deny(unsafe_code)] // allowed only in the modules that need it (rustix's gate)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::too_many_lines)]
#![warn(missing_docs)]

mod allocation;
pub mod backend;
mod device;
mod engine;
mod error;
pub mod errors;
pub mod guide;
mod ids;
pub mod interop;
pub mod kv;
mod ledger;
pub mod mechanism;
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub mod nixl;
// NIXL offers' wire format: pure Rust, built and unit-tested without feature `nixl` too.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
mod nixl_wire;
pub mod region;
pub mod report;
mod residual;
pub mod sharing;
pub mod sleep;
mod state;
mod sync;
mod token;
pub mod transfer;
mod unwind;

pub use allocation::Allocation;
/// The cudarc memtoken links (0.19.10, feature `cuda`): its streams, contexts and device
/// memory traits are the ones memtoken's typed views take and implement. Use it rather than a
/// cudarc of your own, whose types would be other types ("expected `CudaContext`, found
/// `CudaContext`").
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cudarc;
pub use device::{Binding, Device};
pub use engine::{Engine, Keeps, Parts};
pub use error::{Error, TransitionError};
pub use generativity::{Guard, make_guard};
pub use ids::Released;
pub use interop::{Bytes, BytesMut};
pub use ledger::Budget;
pub use state::{Committed, Live, Readable, Releasing, Reserved, State};

// The README's snippets are compiled (and run) as doc tests (`cargo test --doc`), as the
// guides' are in `guide`. The README is not part of the crate's documentation: it is written for
// GitHub and crates.io (its benchmark table, links to docs.rs), and these docs say the same in
// their own words, with links to the items. This item exists only while rustdoc collects doc
// tests.
/// The README's snippets.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
