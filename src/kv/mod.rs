//! The KV cache in the shape attention kernels read: block ids over one reservation per plane,
//! physical memory mapped a group at a time as blocks are used.
//! Guide: [`guide::kv_cache`](crate::guide::kv_cache).
//!
//! - [`Layout`]: the planes (one per layer, or per layer and per K or V), their bytes per
//!   block, the most blocks. Block `b` of plane `p` is at `base(p) + b × stride(p)`, for the
//!   cache's whole life.
//! - [`KvCache`]: reserves each plane's whole size once; hands out block ids into
//!   [`BlockTable`]s and takes them back, never calling the backend; maps and unmaps groups
//!   (the blocks whose bytes share granules, in every plane) only in
//!   [`replenish`](KvCache::replenish), which an engine calls between steps.
//! - [`BlockTable`]: a sequence's block ids, as `&[u32]` and as `&[i32]` (what kernels take),
//!   with vLLM's slot mapping (`block × block_tokens + offset`, `i64`). It borrows its cache,
//!   and carries its brand: it cannot outlive the cache, and no other cache takes it.
//!
//! ```
//! use memtoken::{make_guard, Budget, Device};
//! use memtoken::backend::HostBackend;
//! use memtoken::kv::{KvCache, Layout};
//!
//! make_guard!(guard);
//! let device = Device::new(guard, HostBackend::with_defaults()?);
//! let binding = device.bind(Budget::unlimited())?;
//! make_guard!(cache_guard);
//! // Two layers, K and V of 16 tokens × 64 bytes in each block: 2 KiB per block.
//! let cache = KvCache::new(cache_guard, &binding, &Layout::per_layer(2, 16, 64, 1024))?;
//! cache.replenish()?; // maps groups up to the low watermark: the only backend calls
//! let mut table = cache.table();
//! for _ in 0..3 {
//!     cache.push(&mut table)?; // a block id, no backend call
//! }
//! assert_eq!(table.ids(), &[1, 2, 3]); // block 0 is the null block
//! assert_eq!(table.slot(17), 2 * 16 + 1); // token 17: block 2, offset 1
//! cache.clear(&mut table);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![allow(unsafe_code)] // this module makes `unsafe` calls, each with its `// SAFETY:` proof

use crate::allocation::Allocation;
use crate::backend::{Ability, Addr, Backend};
use crate::device::Binding;
use crate::interop::Awake;
use crate::state::Committed;
use crate::unwind::{Guarded, Scope};
use generativity::{Guard, Id};
use std::cell::{RefCell, UnsafeCell};
use std::fmt;
use std::sync::Arc;

mod error;
mod graph;
mod groups;
mod layout;
mod lend;
mod plane;
mod prefix;
mod share;
mod sleep;
mod table;
#[cfg(all(test, feature = "test-hooks"))]
mod tests;

pub use error::KvError;
pub use graph::KvPlanes;
pub use groups::Replenished;
pub use layout::{Layout, Plane};
pub(crate) use lend::GroupWatch;
use plane::Sparse;
pub use prefix::{CacheEvent, KeyHasher, PrefixCache, PrehashedKeys};
use share::Lru;
pub use table::BlockTable;

/// The null block's id: block 0, taken when the cache is made and never handed out, its group
/// always mapped — vLLM's padding block for tables shorter than the batch's longest.
pub const NULL_BLOCK: u32 = 0;

/// A plane's memory.
enum PlaneMemory<'b, 'id, B: Backend> {
    /// Granules mapped a group at a time (a mechanism that maps at reserved addresses).
    Sparse(Allocation<'b, 'id, B, Sparse>),
    /// Allocated whole when the cache is made (CUDA's plain mechanism): every group mapped.
    Whole(Allocation<'b, 'id, B, Committed>),
}

/// Where a group's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    Unmapped,
    Mapped,
    /// Partly mapped (a map or an unmap failed halfway): never handed out until a later
    /// `replenish` (or `wake`) maps it whole.
    Partial,
}

/// One group's blocks: its free list and its count side by side, so that a take or a give-back
/// reads one place.
struct Group {
    /// Its free blocks (a stack: the last given back is the next taken). Empty unless mapped;
    /// its capacity, once mapped, holds every block of the group.
    free: Vec<u32>,
    /// Its blocks not free: held, cached (idle ones too), or waiting for a fence (the null
    /// block's counts). A group with a cached block is never given back.
    live: u32,
    memory: Memory,
    /// Its last unmap failed (some of its memory held for good, say): given back last, and a
    /// failure to give it back again is not reported again.
    pinned: bool,
}

/// A batch of blocks given back, behind one fence.
struct Batch<F> {
    /// `None`: recording it panicked; one recorded later covers the same work.
    fence: Option<F>,
    blocks: Vec<u32>,
    /// The replenish that recorded it.
    serial: u64,
}

/// The cache's blocks: the hot path's state.
struct Blocks<F> {
    groups: Vec<Group>,
    /// No group below this one has a free block.
    lowest: usize,
    /// Blocks given back since the last fence (a backend that is not immediate); its capacity
    /// holds every mapped block, so giving back never allocates.
    unfenced: Vec<u32>,
    /// Batches waiting for their fence.
    cooling: Vec<Batch<F>>,
    /// Replenishes so far.
    serial: u64,
    /// Groups above the high watermark wait for the work recorded up to this replenish.
    shrink_after: Option<u64>,
    /// Watermarks of mapped groups with no live block (see [`KvCache::set_watermarks`]).
    low: usize,
    high: usize,
    /// While the cache sleeps: what it had mapped, and the free lists it put aside.
    asleep: Option<Box<sleep::Asleep>>,
    /// Per block: its extra holders and whether a prefix cache holds it (see
    /// [`share`](share)); 0 for a block free, or held once and not cached.
    words: Vec<u32>,
    /// Cached blocks no one holds, least recently let go first (links per block, made when a
    /// prefix cache is attached).
    lru: Lru,
    /// Blocks evicted (cached no more) since the prefix cache last looked: it drops their keys.
    /// Its capacity holds every block, so evicting never allocates.
    evicted: Vec<u32>,
    /// Whether a prefix cache is attached.
    prefixed: bool,
    /// Groups mapped, whole or partly.
    mapped: usize,
    /// Blocks lent to a transfer engine, or withheld for good (see [`lend`](lend)).
    lent: usize,
    /// Who may still touch the blocks withheld (none: `None`).
    withheld_for: Option<String>,
}

impl<F> Blocks<F> {
    /// `groups` groups of `per_group` blocks, none mapped, watermarks 1 and 2.
    fn new(groups: usize, per_group: usize) -> Self {
        Self {
            groups: (0..groups)
                .map(|_| Group {
                    free: Vec::new(),
                    live: 0,
                    memory: Memory::Unmapped,
                    pinned: false,
                })
                .collect(),
            lowest: 0,
            unfenced: Vec::new(),
            cooling: Vec::new(),
            serial: 0,
            shrink_after: None,
            low: 1,
            high: 2,
            asleep: None,
            words: vec![0; per_group * groups],
            lru: Lru::default(),
            evicted: Vec::new(),
            prefixed: false,
            mapped: 0,
            lent: 0,
            withheld_for: None,
        }
    }
}

/// A KV cache: block ids over one reservation per plane, physical memory by group (see the
/// [module](self)).
///
/// **The hot path** — [`push`](Self::push) a block into a table, [`clear`](Self::clear) a table
/// — pops from and pushes onto per-group free lists, whose capacity is set when a group is
/// mapped: no backend call, no allocation (a table's own `Vec` grows as any). A new block comes
/// from the lowest mapped group with room, so the mapped footprint stays compact without moving
/// blocks. With no room it fails with [`KvError::NoRoom`], the table unchanged.
///
/// **Between steps**, [`replenish`](Self::replenish) does every backend call: one fence over
/// the blocks given back since the last call (on a backend that is not
/// [`IMMEDIATE`](Backend::IMMEDIATE): they become free once it has completed), maps groups up to
/// the low watermark of mapped groups with no live block, and gives groups above the high
/// watermark back to the device's granule cache. Mapping a group costs, per plane, one map per
/// granule and one access call (CUDA: `cuMemMap` and `cuMemSetAccess`, facts 47 and 48 of
/// `docs/cuda-facts.md`), and one create per granule the granule cache did not have.
///
/// **Without virtual memory management** (CUDA's plain mechanism) every plane is allocated
/// whole when the cache is made: the same block ids and addresses, every group mapped, and
/// `replenish` only fences.
///
/// A table borrows its cache, so it cannot outlive it:
///
/// ```compile_fail,E0505
/// # use memtoken::{make_guard, Budget, Device};
/// # use memtoken::backend::HostBackend;
/// # use memtoken::kv::{KvCache, Layout};
/// # make_guard!(guard);
/// # let device = Device::new(guard, HostBackend::with_defaults().unwrap());
/// # let binding = device.bind(Budget::unlimited()).unwrap();
/// make_guard!(g);
/// let cache = KvCache::new(g, &binding, &Layout::new(64, 16).plane(1024)).unwrap();
/// let table = cache.table();
/// drop(cache);
/// drop(table);
/// ```
///
/// and each cache is branded, so a table of one cache is neither filled nor cleared by another:
///
/// ```compile_fail
/// use memtoken::kv::{BlockTable, KvCache};
/// use memtoken::backend::doubles::SimBackend;
/// fn mix<'ca, 'cb, 'b, 'id>(
///     table_of_a: &mut BlockTable<'_, 'ca, 'b, 'id, SimBackend>,
///     cache_b: &KvCache<'cb, 'b, 'id, SimBackend>,
/// ) {
///     cache_b.push(table_of_a).unwrap(); // error: lifetime may not live long enough
/// }
/// ```
///
/// ```compile_fail
/// use memtoken::kv::{BlockTable, KvCache};
/// use memtoken::backend::doubles::SimBackend;
/// fn mix<'ca, 'cb, 'b, 'id>(
///     table_of_a: &mut BlockTable<'_, 'ca, 'b, 'id, SimBackend>,
///     cache_b: &KvCache<'cb, 'b, 'id, SimBackend>,
/// ) {
///     cache_b.clear(table_of_a); // error: lifetime may not live long enough
/// }
/// ```
///
/// The cache is single-threaded (`!Sync`): its free lists are not locked.
pub struct KvCache<'c, 'b, 'id, B: Backend> {
    _brand: Id<'c>,
    binding: &'b Binding<'b, 'id, B>,
    /// Each plane's base address, stride and bytes per block.
    bases: Vec<Addr>,
    layout: Layout,
    /// Blocks per group, as a shift.
    group_shift: u32,
    planes: Unshared<RefCell<Vec<PlaneMemory<'b, 'id, B>>>>,
    state: Unshared<UnsafeCell<Blocks<B::Fence>>>,
    awake: Awake,
    /// What hears of a group before it is unmapped (a transfer engine's registrations).
    watch: Unshared<RefCell<Option<Arc<dyn GroupWatch>>>>,
    /// What makes the cache `!Sync` (and its tables `!Send`, but inside an [`Engine`]).
    ///
    /// [`Engine`]: crate::Engine
    _one_thread: OneThread,
}

/// The mark of a [`KvCache`]: the cache is used from one thread at a time — its free lists
/// are not locked, so that a block's take and give-back cost a few instructions — so it is not
/// `Sync`, and what borrows it ([`BlockTable`], [`PrefixCache`]) is not `Send`.
///
/// A compiler error that names `OneThread` ("`Cell<()>` cannot be shared between threads
/// safely … within `memtoken::kv::OneThread`") says that something borrowing a KV cache was
/// to move to, or be shared with, another thread. Two ways out:
///
/// - Keep the cache and its tables together in an [`Engine`](crate::Engine): an engine moves
///   to another thread with the block tables it keeps (`BlockTable` is `Send` there, and only
///   there: see its docs).
/// - Give each thread a cache of its own (`examples/serving_engine`).
///
/// A [`PrefixCache`] does not move, even in an engine: its hook may hold anything (an `Rc`,
/// the cache itself). An engine that keeps one is made on the thread that uses it
/// (`ui-tests/engine_prefix_cache_stays.rs`):
///
/// ```compile_fail,E0277
/// use memtoken::backend::HostBackend;
/// use memtoken::kv::{Layout, PrefixCache};
/// use memtoken::{Budget, Engine, Keeps};
/// struct Serving;
/// impl Keeps<HostBackend> for Serving {
///     type Of<'e> = PrefixCache<'e, 'e, 'e, 'e, HostBackend, u64>;
/// }
/// let engine = Engine::<HostBackend, Serving>::new(
///     HostBackend::with_defaults().unwrap(), Budget::unlimited(),
///     &Layout::new(64, 16).plane(4096), |parts| Ok(PrefixCache::new(parts.cache)?),
/// ).unwrap();
/// std::thread::spawn(move || drop(engine)); // error: `Cell<()>` … within `OneThread`
/// ```
#[derive(Debug, Default)]
pub struct OneThread(std::marker::PhantomData<std::cell::Cell<()>>);

/// A cache's state, `Sync` to the compiler so that the only part of a [`KvCache`] it finds
/// not `Sync` is the public [`OneThread`], which its errors then name (not a private type).
struct Unshared<T>(T);

// SAFETY: an `Unshared` is only ever a private field of a `KvCache`, which is `!Sync` through
// its `OneThread` field, so no `&Unshared` is ever reachable from two threads at once; the
// bound keeps moving the cache (`Send`) as sound as it was.
unsafe impl<T: Send> Sync for Unshared<T> {}

impl<T> std::ops::Deref for Unshared<T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Unshared<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<'c, 'b, 'id, B: Backend> KvCache<'c, 'b, 'id, B> {
    /// A cache of `layout`'s planes, each reserved whole through `binding`, branded by `guard`
    /// (from [`make_guard!`](crate::make_guard); never `'static`, a brand only an
    /// [`Engine`](crate::Engine) makes: see [`BlockTable`]). The null block's group is mapped (on CUDA's
    /// plain mechanism, every plane is allocated whole); nothing else until
    /// [`replenish`](Self::replenish). Watermarks start at 1 and 2.
    ///
    /// # Errors
    ///
    /// [`KvError::Layout`] before anything is done; [`KvError::Reserve`], or [`KvError::Commit`]
    /// (a plane allocated whole, or the null block's group mapped), with everything reserved or
    /// mapped so far given back.
    pub fn new(
        guard: Guard<'c>,
        binding: &'b Binding<'b, 'id, B>,
        layout: &Layout,
    ) -> Result<Self, KvError> {
        Scope::run::<B, _>(move || {
            let device = binding.device();
            let (per_group, groups) = layout.groups(device.granularity())?;
            let whole = device.lacks(Ability::MapAtReservedAddress).is_some();
            let planes = reserve_planes(binding, layout, per_group * groups, whole)?;
            let bases = planes
                .iter()
                .map(|p| match p {
                    PlaneMemory::Sparse(a) => a.addr(),
                    PlaneMemory::Whole(a) => a.addr(),
                })
                .collect();
            let cache = Self {
                _brand: guard.into(),
                binding,
                bases,
                layout: layout.clone(),
                group_shift: per_group.trailing_zeros(),
                planes: Unshared(RefCell::new(planes)),
                state: Unshared(UnsafeCell::new(Blocks::new(groups, per_group))),
                awake: Awake::new(),
                watch: Unshared(RefCell::new(None)),
                _one_thread: OneThread::default(),
            };
            if whole {
                for group in 0..groups {
                    cache.add_group(group);
                }
            } else {
                cache
                    .map_group(0)
                    .map_err(|e| KvError::Commit(Box::new(e)))?;
            }
            let null = cache.with(Blocks::take);
            debug_assert_eq!(null, Some(NULL_BLOCK));
            Ok(cache)
        })
    }

    /// Runs `f` on the blocks.
    #[inline(always)]
    fn with<R>(&self, f: impl FnOnce(&mut Blocks<B::Fence>) -> R) -> R {
        // SAFETY: the cache is `!Sync`, so only this thread reaches the state, and no `f` passed
        // here calls back into the cache, so this is the only reference to it while `f` runs.
        f(unsafe { &mut *self.state.get() })
    }

    fn backend(&self) -> &'b Guarded<B> {
        self.binding.device().backend()
    }

    /// An empty table drawing from this cache.
    pub fn table(&self) -> BlockTable<'_, 'c, 'b, 'id, B> {
        BlockTable::new(self)
    }

    /// Takes a free block of the lowest mapped group with room and appends it to `table`;
    /// returns its id. Makes no backend call. With no free block, and a prefix cache holding
    /// idle blocks, it evicts the one let go least recently: on an
    /// [`IMMEDIATE`](Backend::IMMEDIATE) backend that block is the one handed out; on another
    /// it waits for the next [`replenish`](Self::replenish)'s fence, as any block given back,
    /// and this push fails (each failing push evicts one more: call `replenish` before pushing
    /// again).
    ///
    /// # Errors
    ///
    /// [`KvError::NoRoom`] when no mapped group has a free block: the table is unchanged.
    #[inline]
    pub fn push(&self, table: &mut BlockTable<'_, 'c, 'b, 'id, B>) -> Result<u32, KvError> {
        let block = self.take()?;
        table.ids_mut().push(block);
        Ok(block)
    }

    /// A free block, counted live: of the lowest mapped group with room, or else the idle
    /// cached block let go least recently, evicted (on a backend that is not immediate it
    /// waits for a fence, and this fails).
    #[inline(always)]
    pub(super) fn take(&self) -> Result<u32, KvError> {
        match self.with(Blocks::take) {
            Some(block) => Ok(block),
            None => self.take_evicting(),
        }
    }

    #[cold]
    fn take_evicting(&self) -> Result<u32, KvError> {
        if !self.is_asleep() {
            // Not immediate: the evicted block waits for a fence, as any block given back.
            let evicted = self.evict_lru(B::IMMEDIATE);
            if let Some(block) = evicted.filter(|_| B::IMMEDIATE) {
                return Ok(block);
            }
        }
        Err(self.no_room())
    }

    #[cold]
    fn no_room(&self) -> KvError {
        if self.is_asleep() {
            return KvError::Asleep;
        }
        KvError::NoRoom {
            mapped: self.mapped_groups(),
            groups: self.groups(),
            cooling: self.cooling_blocks(),
        }
    }

    /// Lets every block of `table` go, in one pass, the last first; the table can be reused.
    /// A block's last holder frees it — on a backend that is not
    /// [`IMMEDIATE`](Backend::IMMEDIATE), once the fence the next
    /// [`replenish`](Self::replenish) records has completed — or, if a prefix cache holds it,
    /// leaves it idle there. Makes no backend call.
    #[inline]
    pub fn clear(&self, table: &mut BlockTable<'_, 'c, 'b, 'id, B>) {
        let shared = table.take_shared();
        let ids = table.ids_mut();
        self.give_back(ids, shared);
        ids.clear();
    }

    /// One holder of each of `blocks` lets it go (see [`clear`](Self::clear)): a block's last
    /// holder frees it — at once on an [`IMMEDIATE`](Backend::IMMEDIATE) backend, after the
    /// next fence otherwise — or, if a prefix cache holds it, makes it idle. `shared`: whether
    /// any of them may have another holder or be cached (if not, each is freed with no look at
    /// its word: see `BlockTable::shared`).
    #[inline]
    pub(crate) fn give_back(&self, blocks: &[u32], shared: bool) {
        let shift = self.group_shift;
        self.with(|s| {
            // Asleep, a block given back waits for the wake-up: no group is mapped.
            let at_once = B::IMMEDIATE && s.asleep.is_none();
            match (shared, at_once) {
                (true, _) => s.release(blocks, at_once, shift),
                (false, true) => s.free_all(blocks, shift),
                (false, false) => s.unfenced.extend_from_slice(blocks),
            }
        });
    }

    /// The layout the cache was made from.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Plane `plane`'s base address: block `b` is at `base(plane) + b × stride(plane)`. (On
    /// CUDA, the device pointer a kernel reads the plane's tensor at: the raw path. Prefer
    /// `plane_view`, which orders the use and follows the pointer rule of stream views, or, in a
    /// captured step, `Capture::kv_planes`; a raw base used in a capture memtoken did not make
    /// leaves keeping the plane mapped to the launch.)
    ///
    /// # Panics
    ///
    /// If there is no such plane.
    pub fn base(&self, plane: usize) -> Addr {
        self.bases[plane]
    }

    /// Plane `plane`'s stride: the bytes from one block's start to the next's.
    ///
    /// # Panics
    ///
    /// If there is no such plane.
    pub fn stride(&self, plane: usize) -> usize {
        self.layout.planes()[plane].stride
    }

    /// The address of block `block` in plane `plane`.
    ///
    /// # Panics
    ///
    /// If there is no such plane or block.
    pub fn block_addr(&self, plane: usize, block: u32) -> Addr {
        assert!(
            (block as usize) < self.blocks(),
            "block {block} is past the cache"
        );
        self.base(plane) + block as usize * self.stride(plane)
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> usize {
        self.layout.block_tokens()
    }

    /// Blocks in all (whole groups: at least the layout's), the null block among them.
    pub fn blocks(&self) -> usize {
        self.groups() << self.group_shift
    }

    /// Blocks per group: the blocks whose bytes share granules, in every plane.
    pub fn blocks_per_group(&self) -> usize {
        1 << self.group_shift
    }

    /// Groups in all.
    pub fn groups(&self) -> usize {
        self.with(|s| s.groups.len())
    }

    /// Groups mapped now, whole or partly (after a failed map or unmap).
    pub fn mapped_groups(&self) -> usize {
        self.with(|s| s.mapped_groups())
    }

    /// Mapped groups with no live block (none handed out or waiting for a fence).
    pub fn idle_groups(&self) -> usize {
        self.with(|s| s.idle_groups())
    }

    /// Free blocks of mapped groups: what [`push`](Self::push) can hand out now without an
    /// eviction.
    pub fn free_blocks(&self) -> usize {
        self.with(|s| s.groups.iter().map(|g| g.free.len()).sum())
    }

    /// Blocks given back that wait for a fence (recorded, or to be recorded by the next
    /// [`replenish`](Self::replenish)).
    pub fn cooling_blocks(&self) -> usize {
        self.with(|s| s.unfenced.len() + s.cooling.iter().map(|b| b.blocks.len()).sum::<usize>())
    }

    /// Blocks held by tables now (not the null block; a block several tables share counts
    /// once, and an idle cached block not at all).
    pub fn live_blocks(&self) -> usize {
        let live: usize = self.with(|s| s.groups.iter().map(|g| g.live as usize).sum());
        live - 1 - self.cooling_blocks() - self.idle_cached_blocks()
    }

    /// The bytes of the planes backed by memory now, in every plane: the mapped footprint
    /// (whole groups, and what is mapped of a group left partly mapped; every plane whole on
    /// CUDA's plain mechanism). It counts the planes' granules: a figure for reports, not for
    /// a hot path.
    pub fn mapped_bytes(&self) -> usize {
        let g = self.binding.device().granularity();
        let planes = self.planes.borrow();
        planes
            .iter()
            .map(|plane| match plane {
                PlaneMemory::Sparse(a) => a.mapped_in(0, a.len() / g) * g,
                PlaneMemory::Whole(a) => a.len(),
            })
            .sum()
    }

    /// Checks that every block of every group is counted once: each block of a group mapped
    /// whole is free or live (held, cached or cooling), a group not mapped whole has none
    /// free, and no block is free twice (feature `test-hooks`: memtoken's tests).
    ///
    /// # Errors
    ///
    /// What is wrong, and in which group.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn check_blocks(&self) -> Result<(), String> {
        let per_group = 1usize << self.group_shift;
        let shift = self.group_shift;
        self.with(|s| {
            if s.asleep.is_some() {
                return Ok(()); // the free lists are put aside
            }
            let mut seen = vec![false; s.words.len()];
            for (i, g) in s.groups.iter().enumerate() {
                let free = g.free.len();
                match g.memory {
                    Memory::Mapped if free + g.live as usize != per_group => {
                        return Err(format!(
                            "group {i}: {free} free and {} live of {per_group} blocks",
                            g.live
                        ));
                    }
                    Memory::Mapped => {}
                    _ if free > 0 => return Err(format!("group {i}: not mapped, {free} free")),
                    _ => {}
                }
                for &b in &g.free {
                    let twice = std::mem::replace(&mut seen[b as usize], true);
                    if (b >> shift) as usize != i || twice {
                        return Err(format!("group {i}: block {b} free twice or elsewhere"));
                    }
                }
            }
            Ok(())
        })
    }

    /// Whether groups are mapped on demand (`false`: every plane allocated whole, as on CUDA's
    /// plain mechanism).
    pub fn maps_on_demand(&self) -> bool {
        matches!(self.planes.borrow().first(), Some(PlaneMemory::Sparse(_)))
    }
}

/// Each plane of `layout` for `blocks` blocks, reserved (and allocated whole if `whole`).
fn reserve_planes<'b, 'id, B: Backend>(
    binding: &'b Binding<'b, 'id, B>,
    layout: &Layout,
    blocks: usize,
    whole: bool,
) -> Result<Vec<PlaneMemory<'b, 'id, B>>, KvError> {
    let mut planes = Vec::with_capacity(layout.planes().len());
    for (p, plane) in layout.planes().iter().enumerate() {
        let reserved = binding
            .reserve(plane.stride * blocks)
            .map_err(|e| KvError::Reserve {
                plane: p,
                cause: Box::new(e),
            })?;
        planes.push(if whole {
            let whole = reserved
                .commit()
                .map_err(|e| KvError::Commit(Box::new(e.cause)))?;
            PlaneMemory::Whole(whole)
        } else {
            PlaneMemory::Sparse(reserved.into_sparse())
        });
    }
    Ok(planes)
}

impl<F> Blocks<F> {
    /// A free block of the lowest mapped group with room, counted live.
    #[inline(always)]
    fn take(&mut self) -> Option<u32> {
        loop {
            let group = self.lowest;
            let g = self.groups.get_mut(group)?;
            match g.free.pop() {
                Some(block) => {
                    g.live += 1;
                    return Some(block);
                }
                None => self.lowest += 1,
            }
        }
    }

    /// `blocks`, live, become free.
    #[inline(always)]
    fn free_all(&mut self, blocks: &[u32], shift: u32) {
        for &block in blocks {
            self.free_one(block, shift);
        }
    }

    /// `block`, live, becomes free.
    #[inline(always)]
    fn free_one(&mut self, block: u32, shift: u32) {
        let group = (block >> shift) as usize;
        let g = &mut self.groups[group];
        g.free.push(block);
        g.live -= 1;
        if group < self.lowest {
            self.lowest = group;
        }
    }

    /// The blocks given back since the last fence become free at once (no work may use them),
    /// the list keeping its capacity.
    fn free_unfenced(&mut self, shift: u32) {
        let unfenced = std::mem::take(&mut self.unfenced);
        self.free_all(&unfenced, shift);
        self.unfenced = unfenced;
        self.unfenced.clear();
    }

    /// Mapped groups with no live block.
    fn idle_groups(&self) -> usize {
        self.groups.iter().filter(|g| g.is_idle()).count()
    }

    /// Groups mapped, whole or partly.
    fn mapped_groups(&self) -> usize {
        debug_assert_eq!(
            self.mapped,
            self.groups
                .iter()
                .filter(|g| g.memory != Memory::Unmapped)
                .count()
        );
        self.mapped
    }

    /// Group `group`'s memory is now `memory`.
    fn set_memory(&mut self, group: usize, memory: Memory) {
        let was = std::mem::replace(&mut self.groups[group].memory, memory);
        match (was == Memory::Unmapped, memory == Memory::Unmapped) {
            (true, false) => self.mapped += 1,
            (false, true) => self.mapped -= 1,
            _ => {}
        }
    }
}

impl Group {
    /// Mapped, with no live block.
    fn is_idle(&self) -> bool {
        self.memory == Memory::Mapped && self.live == 0
    }
}

impl<B: Backend> Drop for KvCache<'_, '_, '_, B> {
    fn drop(&mut self) {
        let _scope = Scope::open::<B>();
        // Blocks still held but not waiting for a fence: a table or a prefix cache forgotten
        // (the null block aside). With blocks lent to a transfer engine the planes are withheld
        // for its peer, and no count is made (a lent table counts its positions, which forks
        // may share: the two counts would not compare).
        let state = self.state.get_mut();
        if state.lent == 0 {
            let held: usize = state.groups.iter().map(|g| g.live as usize).sum();
            let cooling: usize = state.cooling.iter().map(|b| b.blocks.len()).sum();
            let forgotten = held.saturating_sub(1 + state.unfenced.len() + cooling);
            if forgotten > 0 {
                self.binding
                    .device()
                    .note_forgotten_blocks(forgotten as u64);
            }
        }
        // The planes' releases wait for a fence over all their work: these are not needed.
        let backend = self.backend();
        for batch in std::mem::take(&mut self.state.get_mut().cooling) {
            if let Some(fence) = batch.fence {
                backend.retire_fence(fence);
            }
        }
        // Blocks lent to a transfer engine: the planes are withheld, not released.
        self.withhold_planes();
    }
}

impl<B: Backend> fmt::Debug for KvCache<'_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCache")
            .field("planes", &self.bases.len())
            .field("blocks", &self.blocks())
            .field("mapped_groups", &self.mapped_groups())
            .field("live_blocks", &self.live_blocks())
            .finish_non_exhaustive()
    }
}
