//! Blocks lent to a transfer engine (NIXL): counted while a transfer or an offer holds them,
//! withheld for good when one may still touch them, and the engine told before a group's
//! memory is unmapped.
//!
//! - A lent block is held by a table the engine holds (a transfer's, an offer's): its group is
//!   never unmapped by [`replenish`](KvCache::replenish) (it holds a live block), and
//!   [`sleep`](KvCache::sleep) refuses while any block is lent ([`KvError::Lent`]).
//! - A block the engine may still touch (a transfer that did not finish, an offer whose peer
//!   never said it was done) is withheld: its table's hold is never let go, so it is never
//!   handed out again, and it stays lent. A cache dropped with a block lent withholds its
//!   planes whole — their addresses and physical memory kept, never reused — and the device's
//!   report names who may touch them
//!   ([`Device::withheld_for_peers`](crate::Device::withheld_for_peers)).
//! - Registrations of a group (NIXL's, of each plane's part of it) are let go before the group
//!   is unmapped: the cache calls its [`GroupWatch`] first.

use super::{BlockTable, KvCache, KvError, PlaneMemory};
use crate::backend::Backend;
use std::sync::Arc;

/// What must hear of a group before its memory is unmapped: a transfer engine's registrations
/// of it.
pub(crate) trait GroupWatch: Send + Sync {
    /// Group `group` is about to be unmapped: nothing may stay registered over it.
    fn unmapping(&self, group: usize);
    /// The cache drops with no block lent: its planes go, and every registration with them.
    fn released(&self);
    /// The cache drops with blocks lent (an engine may still touch them): its planes are
    /// withheld, and every registration stays for good.
    fn withheld(&self);
}

impl<'c, 'b, 'id, B: Backend> KvCache<'c, 'b, 'id, B> {
    /// Blocks lent to a transfer engine now — held by a transfer or an offer — or withheld for
    /// good because one may still touch them. While any is, the cache does not sleep
    /// ([`KvError::Lent`]), and a cache dropped with one withholds its planes for good.
    pub fn lent_blocks(&self) -> usize {
        self.with(|s| s.lent)
    }

    /// `blocks` more blocks are lent to a transfer engine.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn lend(&self, blocks: usize) {
        self.with(|s| s.lent += blocks);
    }

    /// `blocks` lent blocks came back: no engine touches them any more.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn unlend(&self, blocks: usize) {
        self.with(|s| s.lent -= blocks);
    }

    /// Withholds `table`'s blocks for good: `who` may still touch them. The table's holds are
    /// never let go (its blocks never handed out again) and they stay lent.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn withhold(&self, mut table: BlockTable<'_, 'c, 'b, 'id, B>, who: String) {
        drop(std::mem::take(table.ids_mut())); // its drop lets nothing go
        self.with(|s| {
            let why = s.withheld_for.get_or_insert_with(String::new);
            if !why.split(", ").any(|w| w == who) {
                if !why.is_empty() {
                    why.push_str(", ");
                }
                why.push_str(&who);
            }
        });
    }

    /// Sets what hears of a group before it is unmapped; `false` (nothing changed) if another
    /// watch is set.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn set_watch(&self, watch: Arc<dyn GroupWatch>) -> bool {
        let mut slot = self.watch.borrow_mut();
        if slot.is_some() {
            return false;
        }
        *slot = Some(watch);
        true
    }

    /// Takes the watch off.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn clear_watch(&self) {
        self.watch.borrow_mut().take();
    }

    /// Tells the watch, if any, that group `group` is about to be unmapped.
    pub(super) fn unmapping(&self, group: usize) {
        let watch = self.watch.borrow().clone();
        if let Some(watch) = watch {
            watch.unmapping(group);
        }
    }

    /// The group block `block` lies in.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn group_of(&self, block: u32) -> usize {
        (block >> self.group_shift) as usize
    }

    /// Refuses while a block is lent.
    pub(super) fn refuse_if_lent(&self) -> Result<(), KvError> {
        match self.lent_blocks() {
            0 => Ok(()),
            blocks => Err(KvError::Lent { blocks }),
        }
    }

    /// As the cache drops: with a block lent, its planes are withheld for good (the engine may
    /// still touch them), not released, and the registrations over them stay; with none, the
    /// registrations go before the planes.
    pub(super) fn withhold_planes(&mut self) {
        let watch = self.watch.get_mut().take();
        let state = self.state.get_mut();
        if state.lent == 0 {
            if let Some(watch) = watch {
                watch.released(); // a registration forgotten, or left by a poisoned one
            }
            return;
        }
        if let Some(watch) = watch {
            watch.withheld();
        }
        let who = state
            .withheld_for
            .take()
            .unwrap_or_else(|| "a transfer in flight or forgotten".to_owned());
        for plane in self.planes.get_mut().drain(..) {
            match plane {
                PlaneMemory::Sparse(plane) => plane.withhold_for_peer(who.clone()),
                PlaneMemory::Whole(plane) => plane.withhold_for_peer(who.clone()),
            }
        }
    }
}
