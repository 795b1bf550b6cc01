//! The guides: how to use memtoken, one topic a page, with runnable examples.
//!
//! Each module here is empty: it only carries a guide as its documentation (the repository's
//! `docs/<name>.md`, included as it is). Every Rust snippet in them is compiled, and run, as a
//! doc test (`cargo test --doc`).
//!
//! - [`tokens`]: the tokens, their states and verbs, how a release finishes, the public API.
//! - [`sharing`]: shared prefixes, copy-on-write, prefixes exported to other processes.
//! - [`kv_cache`]: the KV cache: block ids, block tables, sharing, the prefix cache, sleep.
//! - [`regions`]: elastic growth, the granule cache, the mapped tail.
//! - [`sleep_wake`]: suspending memory and resuming it at the same addresses.
//! - [`cuda`]: streams, fences, graph captures, peers, typed views and the GPU tests.
//! - [`backends`]: the host backend, the simulator, fault injection and the CUDA backend.
//! - [`mechanisms`]: several allocation mechanisms for one device, chosen at run time.
//! - [`engines`]: structuring a program: engines, worker threads, errors, kept graphs.
//! - [`transfer_engines`]: registrations for transfer engines (NIXL, UCX, Mooncake).
//! - [`nixl`](https://docs.rs/memtoken/latest/memtoken/guide/nixl/index.html) (feature `nixl`):
//!   moving bytes between processes and machines through NVIDIA NIXL.
//!
//! The CUDA driver facts the CUDA backend relies on are the documentation of
//! [`backend::cuda::facts`](crate::backend::cuda::facts).
//!
//! A link from one guide to another is an absolute docs.rs address, so that it works both here
//! and where the Markdown file is read on its own (`tests/it/doc_links.rs` refuses a relative
//! one).

#[doc = include_str!("../docs/tokens.md")]
pub mod tokens {}

#[doc = include_str!("../docs/sharing.md")]
pub mod sharing {}

#[doc = include_str!("../docs/kv-cache.md")]
pub mod kv_cache {}

#[doc = include_str!("../docs/regions.md")]
pub mod regions {}

#[doc = include_str!("../docs/sleep-wake.md")]
pub mod sleep_wake {}

// Its snippets run on the CUDA driver model: anywhere, with no GPU.
#[doc = include_str!("../docs/cuda.md")]
pub mod cuda {}

#[doc = include_str!("../docs/backends.md")]
pub mod backends {}

#[doc = include_str!("../docs/mechanisms.md")]
pub mod mechanisms {}

#[doc = include_str!("../docs/engines.md")]
pub mod engines {}

#[doc = include_str!("../docs/transfer-engines.md")]
pub mod transfer_engines {}

// Its snippets need NIXL's library (`cargo test --features nixl --doc nixl`, after
// `scripts/install-nixl.sh`): the guide exists where the feature is on, as docs.rs builds it.
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
#[doc = include_str!("../docs/nixl.md")]
pub mod nixl {}
