//! Where in the host device's store each piece of physical memory lies: bump allocation from
//! the top, and released ranges reused by their exact size — O(1) a create and a release in the
//! common case (a device's creates come in few sizes: its granule, a reservation's whole), so
//! that growing a pool costs the same per granule at any size. Only when neither has room are
//! the released ranges merged and searched (O(ranges), and rare: the store is fragmented into
//! ranges of other sizes).

use std::collections::BTreeMap;

/// The store's ranges: below `top`, each byte is live or in `free`; from `top` on, nothing is.
#[derive(Debug, Default)]
pub(super) struct Ranges {
    top: u64,
    /// Released ranges below `top`, by length: their offsets (a stack: the last released is
    /// reused first).
    free: BTreeMap<u64, Vec<u64>>,
}

impl Ranges {
    /// An offset for `len` bytes within `capacity`, taken; `None` if no range has room.
    pub(super) fn take(&mut self, len: u64, capacity: u64) -> Option<u64> {
        if let Some(offset) = self.free.get_mut(&len).and_then(Vec::pop) {
            return Some(offset);
        }
        if self.top.checked_add(len)? <= capacity {
            let offset = self.top;
            self.top += len;
            return Some(offset);
        }
        self.take_merged(len, capacity)
    }

    /// The `len` bytes at `offset`, taken before, are free again.
    pub(super) fn give(&mut self, offset: u64, len: u64) {
        if offset + len == self.top {
            self.top = offset;
        } else {
            self.free.entry(len).or_default().push(offset);
        }
    }

    /// Merges the released ranges (and lowers the top over those that reach it), then takes
    /// the first that holds `len` bytes, its rest released again.
    #[cold]
    fn take_merged(&mut self, len: u64, capacity: u64) -> Option<u64> {
        let mut holes: Vec<(u64, u64)> = std::mem::take(&mut self.free)
            .into_iter()
            .flat_map(|(hole, offsets)| offsets.into_iter().map(move |o| (o, hole)))
            .collect();
        holes.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(holes.len());
        for (offset, hole) in holes {
            match merged.last_mut() {
                Some((start, n)) if *start + *n == offset => *n += hole,
                _ => merged.push((offset, hole)),
            }
        }
        if let Some(&(start, n)) = merged.last()
            && start + n == self.top
        {
            self.top = start;
            merged.pop();
        }
        let fit = merged.iter().position(|&(_, n)| n >= len);
        for (i, &(start, n)) in merged.iter().enumerate() {
            match Some(i) == fit {
                true if n > len => self.free.entry(n - len).or_default().push(start + len),
                true => {}
                false => self.free.entry(n).or_default().push(start),
            }
        }
        match fit {
            Some(i) => Some(merged[i].0),
            None if self.top + len <= capacity => {
                let offset = self.top;
                self.top += len;
                Some(offset)
            }
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Ranges;

    #[test]
    fn ranges_are_bumped_reused_by_size_and_merged_when_nothing_else_has_room() {
        let mut r = Ranges::default();
        assert_eq!(r.take(4, 16), Some(0));
        assert_eq!(r.take(4, 16), Some(4));
        assert_eq!(r.take(4, 16), Some(8));
        r.give(0, 4);
        r.give(4, 4);
        assert_eq!(r.take(4, 16), Some(4), "the last released, by its size");
        r.give(4, 4);
        // 8 bytes: the top has 4, the holes 4 and 4 — merged, they hold it.
        assert_eq!(r.take(8, 16), Some(0));
        assert_eq!(r.take(4, 16), Some(12));
        assert_eq!(r.take(1, 16), None, "full");
        r.give(12, 4);
        r.give(8, 4);
        r.give(0, 8);
        assert_eq!(r.take(16, 16), Some(0), "all merged back to the top");
    }

    #[test]
    fn a_merged_hole_larger_than_asked_keeps_its_rest() {
        let mut r = Ranges::default();
        for at in [0, 4, 8, 12] {
            assert_eq!(r.take(4, 16), Some(at));
        }
        r.give(0, 4);
        r.give(4, 4);
        assert_eq!(r.take(6, 16), Some(0));
        assert_eq!(r.take(2, 16), Some(6), "the rest of the merged hole");
        assert_eq!(r.take(1, 16), None);
    }

    /// A hole left just under the top when the range above it went (the top fell only by that
    /// range) is merged into the top, which then has room, and the top moves on by what was
    /// taken. Fails if the merge's bump from the lowered top is refused, or moves the top by
    /// anything else (`self.top += len` → `*=`: the next take, in a larger store, found no room).
    #[test]
    fn a_hole_under_the_top_goes_back_to_the_top() {
        let mut r = Ranges::default();
        for at in [0, 4, 8, 12] {
            assert_eq!(r.take(4, 16), Some(at));
        }
        r.give(8, 4);
        r.give(12, 4); // the top falls to 12; the hole at 8 stays a hole
        assert_eq!(
            r.take(8, 16),
            Some(8),
            "8..16, from the top lowered over the hole"
        );
        assert_eq!(r.take(1, 16), None, "full");
        assert_eq!(
            r.take(4, 20),
            Some(16),
            "on from the top, in a store grown to 20"
        );
    }

    #[test]
    fn holes_apart_are_never_merged() {
        let mut r = Ranges::default();
        for at in [0, 4, 8, 12] {
            assert_eq!(r.take(4, 16), Some(at));
        }
        r.give(0, 4);
        r.give(8, 4); // 4..8 still live between them
        assert_eq!(r.take(8, 16), None, "two holes of 4, apart, do not hold 8");
        let mut got = [r.take(4, 16), r.take(4, 16)];
        got.sort_unstable();
        assert_eq!(got, [Some(0), Some(8)], "each hole whole, as it was");
    }
}
