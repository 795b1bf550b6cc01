//! Blocks with more than one holder: forks, shares and copy-on-write, and the idle cached
//! blocks a [`PrefixCache`](super::PrefixCache) keeps in least-recently-used order.
//!
//! One word per block (`Blocks::words`): its extra holders in the low 30 bits, [`CACHED`] and
//! [`IDLE`] above — 0 for a block free, or held once and not cached. A table that never had a
//! block shared or cached (its mark, `BlockTable::shared`) is cleared without a look at the
//! words; a marked table's clear reads each block's word. The eviction order links blocks
//! through a per-block array made when a prefix cache is attached. Each operation on blocks
//! (fork and share per block, copy-on-write, release, a hit, an eviction) costs the same
//! whatever the cache's size; sleeping without saving, and attaching or dropping a prefix
//! cache, are O(blocks).

use super::{BlockTable, Blocks, KvCache, KvError};
use crate::backend::Backend;
use crate::unwind::Scope;

/// A block's word: a prefix cache holds it (read-only until it is evicted).
pub(super) const CACHED: u32 = 1 << 31;
/// A block's word: cached and held by no table — in the eviction order.
pub(super) const IDLE: u32 = 1 << 30;
/// A block's word: its extra holders.
pub(super) const COUNT: u32 = IDLE - 1;
/// No block (the ends of the eviction order).
const NIL: u32 = u32::MAX;

/// A block's neighbours in the eviction order.
#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

/// Idle cached blocks, least recently let go first: a doubly linked list through a per-block
/// array, so that taking one out (a prefix cache hit) is O(1).
#[derive(Debug)]
pub(super) struct Lru {
    links: Vec<Link>,
    head: u32,
    tail: u32,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            links: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }
}

impl Lru {
    /// Room for `blocks` blocks.
    pub(super) fn attach(&mut self, blocks: usize) {
        self.links = vec![
            Link {
                prev: NIL,
                next: NIL
            };
            blocks
        ];
    }

    /// Idle blocks: O(idle blocks) (a count kept would cost every hit and every release).
    pub(super) fn len(&self) -> usize {
        std::iter::successors((self.head != NIL).then_some(self.head), |&b| {
            let next = self.link(b).next;
            (next != NIL).then_some(next)
        })
        .count()
    }

    /// Block `block`'s links, with no bounds check.
    #[inline(always)]
    fn link(&self, block: u32) -> &Link {
        debug_assert!(
            (block as usize) < self.links.len(),
            "block {block} has no links"
        );
        // SAFETY: every block given to the list (`push_back`, `remove`) is an id this cache
        // handed out, below its blocks, and every link stored is such a block or `NIL`, which
        // is tested before it is followed; `links` has one entry per block from `attach`, made
        // when the prefix cache is attached — before any block can be cached, so before any
        // block enters the list.
        unsafe { self.links.get_unchecked(block as usize) }
    }

    /// Block `block`'s links, with no bounds check.
    #[inline(always)]
    fn link_mut(&mut self, block: u32) -> &mut Link {
        debug_assert!(
            (block as usize) < self.links.len(),
            "block {block} has no links"
        );
        // SAFETY: as in `link`.
        unsafe { self.links.get_unchecked_mut(block as usize) }
    }

    /// Puts `block` last: evicted after every block let go before it.
    #[inline(always)]
    fn push_back(&mut self, block: u32) {
        *self.link_mut(block) = Link {
            prev: self.tail,
            next: NIL,
        };
        match self.tail {
            NIL => self.head = block,
            tail => self.link_mut(tail).next = block,
        }
        self.tail = block;
    }

    /// Takes `block`, idle, out of the order.
    #[inline(always)]
    fn remove(&mut self, block: u32) {
        let Link { prev, next } = *self.link(block);
        match prev {
            NIL => self.head = next,
            prev => self.link_mut(prev).next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.link_mut(next).prev = prev,
        }
    }

    /// Takes the block let go least recently.
    fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        (head != NIL).then(|| {
            self.remove(head);
            head
        })
    }
}

impl<F> Blocks<F> {
    /// One holder of each of `blocks` lets it go, the last first (so that of a cached
    /// sequence its later blocks are evicted before its earlier ones): the last holder frees a
    /// block (at once if `at_once`, else after the next fence), or makes a cached one idle.
    #[inline(always)]
    pub(super) fn release(&mut self, blocks: &[u32], at_once: bool, shift: u32) {
        // Two loops, so that the loop of the hot case tests one word a block and nothing else.
        if at_once {
            for &block in blocks.iter().rev() {
                match self.word(block) {
                    0 => self.free_one(block, shift),
                    word => self.let_go_shared(block, word),
                }
            }
        } else {
            for &block in blocks.iter().rev() {
                match self.word(block) {
                    0 => self.unfenced.push(block),
                    word => self.let_go_shared(block, word),
                }
            }
        }
    }

    /// Block `block`'s word, with no bounds check: the loops of releases and forks do one load
    /// a block.
    #[inline(always)]
    fn word(&self, block: u32) -> u32 {
        debug_assert!(
            (block as usize) < self.words.len(),
            "block {block} is past the cache"
        );
        // SAFETY: `block` is an id some holder of this cache holds (a table's entry, a prefix
        // cache's entry made from one): every such id was handed out from a group's free list,
        // whose ids are all below the cache's blocks, and `words` has one word per block from
        // the cache's making on.
        unsafe { *self.words.get_unchecked(block as usize) }
    }

    /// Block `block`'s word, to change, with no bounds check.
    #[inline(always)]
    fn word_mut(&mut self, block: u32) -> &mut u32 {
        debug_assert!(
            (block as usize) < self.words.len(),
            "block {block} is past the cache"
        );
        // SAFETY: as in `word`.
        unsafe { self.words.get_unchecked_mut(block as usize) }
    }

    /// One holder of `block`, whose `word` is not 0, lets it go: one holder fewer, or, the last
    /// one of a cached block, idle.
    #[inline(always)]
    fn let_go_shared(&mut self, block: u32, word: u32) {
        if word & COUNT != 0 {
            *self.word_mut(block) = word - 1;
        } else {
            // No extra holder and not 0: cached, its last holder.
            *self.word_mut(block) = CACHED | IDLE;
            self.lru.push_back(block);
        }
    }

    /// One more holder of each of `blocks` (a table's, so held).
    ///
    /// # Panics
    ///
    /// If a block already has 2^30 holders (the counts are as they were).
    pub(super) fn hold_all(&mut self, blocks: &[u32]) {
        for (i, &block) in blocks.iter().enumerate() {
            let word = &mut self.words[block as usize];
            if *word & COUNT == COUNT {
                for &undo in &blocks[..i] {
                    self.words[undo as usize] -= 1;
                }
                panic!("a KV block has 2^30 holders");
            }
            *word += 1;
        }
    }

    /// One more holder of `block` if it is cached — idle (then out of the eviction order) or
    /// held; whether it was.
    ///
    /// # Panics
    ///
    /// If it already has 2^30 holders.
    #[inline(always)]
    pub(super) fn hold_if_cached(&mut self, block: u32) -> bool {
        // A block a prefix cache's entry names was entered from a table: an id the cache
        // handed out (`word`'s proof).
        let word = self.word(block);
        if word & IDLE != 0 {
            *self.word_mut(block) = CACHED; // idle: cached, no holder

            self.lru.remove(block);
        } else if word & CACHED != 0 {
            self.hold_all(&[block]);
        } else {
            return false;
        }
        true
    }

    /// Marks `block`, held (a table's), cached.
    #[inline(always)]
    pub(super) fn cache(&mut self, block: u32) {
        *self.word_mut(block) |= CACHED;
    }

    /// Whether `block`, held (a table's), is cached.
    #[inline(always)]
    pub(super) fn is_cached(&self, block: u32) -> bool {
        self.word(block) & CACHED != 0
    }

    /// `block` is cached no more (its prefix cache is told at its next look).
    fn uncache(&mut self, block: u32) {
        self.words[block as usize] &= !CACHED;
        self.evicted.push(block);
    }

    /// Evicts the idle block let go least recently: kept live for the caller if `reuse`, else
    /// given back (freed at once if `at_once`).
    pub(super) fn evict_lru(&mut self, reuse: bool, at_once: bool, shift: u32) -> Option<u32> {
        let block = self.lru.pop_front()?;
        self.words[block as usize] = 0;
        self.evicted.push(block);
        if !reuse {
            self.release(&[block], at_once, shift);
        }
        Some(block)
    }

    /// Every cached block is cached no more: the idle ones freed (at once if `at_once`), the
    /// held ones writable again by a sole holder; O(blocks).
    pub(super) fn uncache_all(&mut self, at_once: bool, shift: u32) {
        while self.evict_lru(false, at_once, shift).is_some() {}
        for block in 0..self.words.len() as u32 {
            if self.words[block as usize] & CACHED != 0 {
                self.uncache(block);
            }
        }
    }
}

impl<'c, 'b, 'id, B: Backend> KvCache<'c, 'b, 'id, B> {
    /// A table holding the same blocks as `table`, in O(blocks): each block counts one more
    /// holder, and no byte is copied. Before a kernel writes a block that more than one table
    /// holds, [`copy_on_write`](Self::copy_on_write) gives the writer a block of its own.
    ///
    /// # Panics
    ///
    /// If a block already has 2^30 holders (the counts are as they were).
    pub fn fork<'t>(
        &'t self,
        table: &BlockTable<'_, 'c, 'b, 'id, B>,
    ) -> BlockTable<'t, 'c, 'b, 'id, B> {
        self.with(|s| s.hold_all(table.ids()));
        let mut fork = BlockTable::new(self);
        fork.ids_mut().extend_from_slice(table.ids());
        table.mark_shared();
        fork.mark_shared();
        fork
    }

    /// Appends the block at `position` of `from` to `into`, which becomes one more of its
    /// holders; returns its id.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds, or the block already has 2^30 holders.
    pub fn share(
        &self,
        from: &BlockTable<'_, 'c, 'b, 'id, B>,
        position: usize,
        into: &mut BlockTable<'_, 'c, 'b, 'id, B>,
    ) -> u32 {
        let block = from.ids()[position];
        self.with(|s| s.hold_all(&[block]));
        into.ids_mut().push(block);
        from.mark_shared();
        into.mark_shared();
        block
    }

    /// How many tables hold block `block` (a block a prefix cache keeps but no table holds
    /// answers 0). Exact for a block handed out; a free block answers 1, so ask only of blocks
    /// some table holds.
    ///
    /// # Panics
    ///
    /// If there is no such block.
    pub fn holders(&self, block: u32) -> u32 {
        self.with(|s| match s.words[block as usize] {
            w if w & IDLE != 0 => 0,
            w => (w & COUNT) + 1,
        })
    }

    /// Whether a prefix cache holds block `block` (read-only until evicted).
    ///
    /// # Panics
    ///
    /// If there is no such block.
    pub fn is_cached(&self, block: u32) -> bool {
        self.with(|s| s.words[block as usize] & CACHED != 0)
    }

    /// Cached blocks no table holds: found again by their keys until the cache needs them.
    /// O(those blocks): it walks the eviction order.
    pub fn idle_cached_blocks(&self) -> usize {
        self.with(|s| s.lru.len())
    }

    /// Whether the block at `position` of `table` can be written through it: no other table
    /// holds it and no prefix cache does.
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn is_writable(&self, table: &BlockTable<'_, 'c, 'b, 'id, B>, position: usize) -> bool {
        let block = table.ids()[position];
        self.with(|s| s.words[block as usize] == 0)
    }

    /// Makes the block at `position` of `table` writable through it: if another table or a
    /// prefix cache holds it, copies it, in every plane, into a new block (a device-to-device
    /// copy on CUDA, ordered like any use of the memory) that replaces it in the table, and
    /// lets the old one go. Whether it copied.
    ///
    /// # Errors
    ///
    /// [`KvError::NoRoom`] or [`KvError::Asleep`] when no block can be had (as for
    /// [`push`](Self::push), an idle cached block may have been evicted on the way),
    /// [`KvError::Copy`] when a copy fails: the table is unchanged (the new block goes back).
    ///
    /// # Panics
    ///
    /// If `position` is out of bounds.
    pub fn copy_on_write(
        &self,
        table: &mut BlockTable<'_, 'c, 'b, 'id, B>,
        position: usize,
    ) -> Result<bool, KvError> {
        if self.is_writable(table, position) {
            return Ok(false);
        }
        let old = table.ids()[position];
        Scope::run::<B, _>(move || {
            let new = self.take()?;
            for (plane, layout) in self.layout.planes().iter().enumerate() {
                let (to, from) = (self.block_addr(plane, new), self.block_addr(plane, old));
                if let Err(e) = self.backend().copy_within(to, from, layout.block_bytes) {
                    self.give_back(&[new], false); // fresh: this call's alone
                    return Err(KvError::Copy(Box::new(e)));
                }
            }
            table.ids_mut()[position] = new;
            self.give_back(&[old], true);
            Ok(true)
        })
    }

    /// Evicts every idle cached block (their keys leave the prefix cache at its next call);
    /// how many. They are free at once on an [`IMMEDIATE`](Backend::IMMEDIATE) backend while
    /// the cache is awake, after the next [`replenish`](Self::replenish)'s fence otherwise (or
    /// the wake-up, asleep); the groups they leave idle go back to the device at the high
    /// watermark.
    pub fn evict_idle(&self) -> usize {
        let mut n = 0;
        while self.evict_lru(false).is_some() {
            n += 1;
        }
        n
    }

    /// Evicts the idle cached block let go least recently: kept live for the caller if
    /// `reuse`, else given back as any block (free at once on an immediate backend while
    /// awake, after a fence otherwise).
    pub(super) fn evict_lru(&self, reuse: bool) -> Option<u32> {
        let shift = self.group_shift;
        self.with(|s| {
            let at_once = B::IMMEDIATE && s.asleep.is_none();
            s.evict_lru(reuse, at_once, shift)
        })
    }
}
