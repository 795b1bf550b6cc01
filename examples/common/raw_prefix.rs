//! The hand-written reference for the KV cache's prefix-cached paths: vLLM's block pool
//! algorithm, written in Rust from its documented behaviour (vLLM v1's `BlockPool` and
//! `FreeKVCacheBlockQueue`), not from its code:
//!
//! - every block has a reference count and, once full and cached, its hash;
//! - one free queue, a doubly linked list through the blocks, holds every block no request
//!   holds — never-used blocks and cached ones alike — least recently freed first; a new block
//!   is popped from its front, and if it was cached its hash is evicted from the map;
//! - a hash map from block hash to block finds cached blocks; a hit on a free block takes it
//!   out of the queue ("touch");
//! - a request's blocks are freed in reverse order, so that its later blocks are evicted first.
//!
//! No memory is mapped: vLLM's pool is one tensor allocated whole. Plain integers, no tokens,
//! no fences. This is the bar `examples/kv_prefix_cycle.rs` counts the KV cache against.
#![allow(dead_code)]

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

const NIL: u32 = u32::MAX;

pub struct RawPrefix<K, S> {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<K>>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    map: HashMap<K, u32, S>,
}

impl<K: Hash + Eq + Clone, S: BuildHasher> RawPrefix<K, S> {
    /// A pool of `blocks` blocks, every one in the free queue but block 0 (the null block).
    pub fn new(blocks: usize, hasher: S) -> Self {
        let n = blocks as u32;
        let mut pool = Self {
            ref_cnt: vec![0; blocks],
            hash: vec![None; blocks],
            prev: (0..n).map(|i| i.wrapping_sub(1)).collect(),
            next: (0..n)
                .map(|i| if i + 1 == n { NIL } else { i + 1 })
                .collect(),
            head: 0,
            tail: n - 1,
            map: HashMap::with_hasher(hasher),
        };
        pool.prev[0] = NIL;
        let null = pool.pop_front();
        debug_assert_eq!(null, Some(0));
        pool.ref_cnt[0] = 1;
        pool
    }

    fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        (head != NIL).then(|| {
            self.remove(head);
            head
        })
    }

    fn remove(&mut self, block: u32) {
        let (prev, next) = (self.prev[block as usize], self.next[block as usize]);
        match prev {
            NIL => self.head = next,
            prev => self.next[prev as usize] = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.prev[next as usize] = prev,
        }
    }

    fn push_back(&mut self, block: u32) {
        self.prev[block as usize] = self.tail;
        self.next[block as usize] = NIL;
        match self.tail {
            NIL => self.head = block,
            tail => self.next[tail as usize] = block,
        }
        self.tail = block;
    }

    /// `get_new_blocks`: a block from the free queue's front (its hash evicted if it had one),
    /// appended to `table`.
    #[inline]
    pub fn take(&mut self, table: &mut Vec<u32>) -> Option<u32> {
        let block = self.pop_front()?;
        if let Some(key) = self.hash[block as usize].take() {
            self.map.remove(&key);
        }
        self.ref_cnt[block as usize] = 1;
        table.push(block);
        Some(block)
    }

    /// `get_cached_block`.
    #[inline]
    pub fn lookup(&self, key: &K) -> Option<u32> {
        self.map.get(key).copied()
    }

    /// `touch`: one more holder of a cached block (out of the free queue if none held it),
    /// appended to `table`.
    #[inline]
    pub fn touch(&mut self, block: u32, table: &mut Vec<u32>) {
        if self.ref_cnt[block as usize] == 0 {
            self.remove(block);
        }
        self.ref_cnt[block as usize] += 1;
        table.push(block);
    }

    /// `cache_full_blocks` for one block: its hash entered, unless one is entered already.
    #[inline]
    pub fn cache(&mut self, block: u32, key: K) -> bool {
        if self.hash[block as usize].is_some() || self.map.contains_key(&key) {
            return false;
        }
        self.hash[block as usize] = Some(key.clone());
        self.map.insert(key, block);
        true
    }

    /// `free_blocks` of a request's table, the last block first; the table emptied.
    #[inline]
    pub fn free(&mut self, table: &mut Vec<u32>) {
        for &block in table.iter().rev() {
            self.ref_cnt[block as usize] -= 1;
            if self.ref_cnt[block as usize] == 0 {
                self.push_back(block);
            }
        }
        table.clear();
    }

    /// Cached blocks.
    pub fn cached(&self) -> usize {
        self.map.len()
    }
}
