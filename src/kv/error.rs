//! [`KvError`]: why the KV cache refused or could not do something.

use crate::backend::BackendError;
use crate::error::{CommitFailure, ReserveError};

/// Why a [`KvCache`](super::KvCache) could not be made, could not hand out a block, or could
/// not map or copy. Every refusal leaves the cache and the table as they were.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The layout cannot be laid out (no plane, no block, a block of 0 bytes, a stride below
    /// the block's bytes, more than 2^31 blocks): nothing was reserved.
    #[error("the KV cache's layout is refused: {0}")]
    Layout(&'static str),
    /// Reserving a plane's addresses failed: the planes reserved before it were released.
    #[error("reserving plane {plane} of the KV cache failed")]
    Reserve {
        /// The plane.
        plane: usize,
        /// Why.
        #[source]
        cause: Box<ReserveError>,
    },
    /// Committing memory for the cache failed — a plane allocated whole (a mechanism that
    /// cannot map at reserved addresses), or the null block's group: nothing is kept.
    #[error("committing the KV cache's first memory failed")]
    Commit(#[source] Box<CommitFailure>),
    /// No mapped group has a free block: the table is unchanged. Call
    /// [`replenish`](super::KvCache::replenish) between steps (it maps groups up to the low
    /// watermark), or raise the watermark.
    #[error(
        "no mapped group of the KV cache has a free block ({mapped} of {groups} groups mapped, {cooling} blocks waiting for their fence): call replenish() between steps, or raise its low watermark"
    )]
    NoRoom {
        /// Groups mapped.
        mapped: usize,
        /// Groups in all.
        groups: usize,
        /// Blocks given back whose fence has not completed yet.
        cooling: usize,
    },
    /// Mapping a group failed: what the call mapped of it was given back (a granule whose undo
    /// failed stays mapped, the group partly mapped and never handed out until mapped whole);
    /// the groups mapped before it in the same call stay mapped.
    #[error("mapping group {group} of the KV cache failed")]
    Map {
        /// The group.
        group: usize,
        /// Why.
        #[source]
        cause: Box<CommitFailure>,
    },
    /// Unmapping a group failed: its granules that could not be unmapped stay mapped (owned,
    /// charged), the others were given back; the group is partly mapped, never handed out until
    /// a later `replenish` or `wake` maps it whole (a later `replenish` also tries to give it
    /// back again).
    #[error("unmapping group {group} of the KV cache failed")]
    Unmap {
        /// The group.
        group: usize,
        /// Why.
        #[source]
        cause: Box<BackendError>,
    },
    /// The cache sleeps: no block is handed out, no byte copied, no group mapped until
    /// [`wake`](super::KvCache::wake) (blocks given back meanwhile wait for it).
    #[error("the KV cache is asleep: wake() it first")]
    Asleep,
    /// The cache is awake already.
    #[error("the KV cache is awake: wake() only after sleep")]
    Awake,
    /// Sleep is refused where the planes are allocated whole (CUDA's plain mechanism: no
    /// virtual memory management), before anything is done.
    #[error(
        "the KV cache cannot sleep: its planes are allocated whole ({0}), so their memory cannot go while their addresses stay"
    )]
    SleepUnsupported(&'static str),
    /// Work that may use the planes still runs: nothing was unmapped. Wait for it (a stream
    /// synchronize) and sleep again.
    #[error("the KV cache cannot sleep yet: work that may use its planes still runs")]
    Pending,
    /// The block is read-only through this table: another table or a prefix cache holds it.
    /// Nothing was written; [`copy_on_write`](super::KvCache::copy_on_write) gives the table a
    /// block of its own.
    #[error(
        "the KV block at position {position} is shared (another table or the prefix cache holds it): copy_on_write() it first"
    )]
    ReadOnly {
        /// The block's position in the table.
        position: usize,
    },
    /// Blocks are lent to a transfer engine — held by a transfer or an offer, or withheld for
    /// good because one may still touch them: the cache cannot sleep (nothing was done).
    #[error(
        "the KV cache cannot sleep: {blocks} of its blocks are lent to a transfer engine (a transfer or an offer holds them, or they are withheld for good)"
    )]
    Lent {
        /// Blocks lent.
        blocks: usize,
    },
    /// The KV cache has a prefix cache already (one per cache).
    #[error("the KV cache has a prefix cache already")]
    PrefixCacheTaken,
    /// A copy to or from a block failed: nothing changed in the cache.
    #[error("copying bytes of a KV block failed")]
    Copy(#[source] Box<BackendError>),
}

impl crate::error::sealed::Sealed for KvError {}

impl crate::error::Failure for KvError {
    fn summary(&self) -> &'static str {
        "the KV cache refused, or could not map or copy"
    }
}
