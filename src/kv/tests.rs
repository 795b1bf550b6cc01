//! The blocks' checker ([`KvCache::check_blocks`], feature `test-hooks`): memtoken's KV tests
//! take its word that every block is counted once, so it is shown to report each miscount.

use super::*;
use crate::backend::HostBackend;
use crate::{Budget, Device, make_guard};

/// A KV cache `$cache` on a host device, four blocks per granule (a group of four, four
/// groups), with the watermarks at two groups and replenished to them.
macro_rules! four_block_groups {
    ($cache:ident) => {
        make_guard!(guard);
        let device = Device::new(guard, HostBackend::with_defaults().unwrap());
        let binding = device.bind(Budget::unlimited()).unwrap();
        make_guard!(cache_guard);
        let layout = Layout::new(16, 16).plane(device.granularity() / 4);
        let $cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
        $cache.set_watermarks(2, 2);
        $cache.replenish().unwrap();
    };
}

/// Each way one group's counts can go wrong is reported (a block lost, one free twice, one
/// free in the wrong group's list, free blocks in a group not mapped), and a cache as it is
/// made passes. Fails if the checker passes any of them (`check_blocks` made `Ok(())`, or a
/// case of it dropped).
#[test]
fn the_block_checker_reports_every_miscount() {
    four_block_groups!(cache);
    assert!(cache.mapped_groups() >= 2, "{}", cache.mapped_groups());
    cache.check_blocks().unwrap();
    // The first mapped group with two free blocks, and a block of another group.
    let shift = cache.group_shift;
    let (i, elsewhere) = cache.with(|s| {
        let i = s.groups.iter().position(|g| g.free.len() >= 2).unwrap();
        (i, s.groups[i].free[0] ^ (1 << shift))
    });
    type Corrupt = fn(&mut Group, u32);
    let cases: [(&str, Corrupt); 4] = [
        ("free and", |g, _| {
            g.free.pop();
        }),
        ("free twice", |g, _| {
            let n = g.free.len();
            g.free[n - 1] = g.free[0];
        }),
        ("elsewhere", |g, other| g.free[0] = other),
        ("not mapped", |g, _| g.memory = Memory::Unmapped),
    ];
    for (said, corrupt) in cases {
        let kept = cache.with(|s| s.groups[i].free.clone());
        cache.with(|s| corrupt(&mut s.groups[i], elsewhere));
        let e = cache.check_blocks().expect_err(said);
        assert!(
            e.contains(&format!("group {i}")) && e.contains(said),
            "{said}: {e}"
        );
        cache.with(|s| {
            s.groups[i].free = kept;
            s.groups[i].memory = Memory::Mapped;
        });
        cache.check_blocks().unwrap();
    }
}

/// A fork that meets a block with 2^30 holders panics with every count as it was: the blocks
/// before it, counted once more already, are counted back. Fails if the undo counts them up
/// instead (`hold_all`'s `-= 1` → `+= 1`, or `/= 1`, which leaves them counted).
#[test]
fn a_fork_refused_at_the_holders_limit_leaves_every_count_as_it_was() {
    four_block_groups!(cache);
    let mut table = cache.table();
    for _ in 0..3 {
        cache.push(&mut table).unwrap();
    }
    let last = table.ids()[2] as usize;
    cache.with(|s| s.words[last] = share::COUNT); // 2^30 holders: one more is refused
    let before = cache.with(|s| s.words.clone());
    let fork = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(cache.fork(&table))));
    assert!(fork.is_err(), "a fork past 2^30 holders panics");
    assert_eq!(
        cache.with(|s| s.words.clone()),
        before,
        "the counts are as they were"
    );
    cache.with(|s| s.words[last] = 0);
    drop(table);
    cache.check_blocks().unwrap();
}
