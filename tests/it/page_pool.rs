//! The page pool: O(1) pages that are never handed out twice, and free + live = capacity.

use crate::common::{self, GRANULE};
use memtoken::backend::{
    HostBackend, HostConfig, Op,
    doubles::{Faulty, SimBackend},
};
use memtoken::{Budget, CommitFailure, Device, Page, PagePool, PoolError, make_guard};
use proptest::prelude::*;
use std::collections::HashSet;

#[derive(Clone, Debug)]
enum Step {
    Alloc,
    Free(usize),
    Write(usize),
    Grow,
    Shrink,
    FailNextGrow,
    /// A page appended to the sequence's page table.
    TablePush,
    /// The table's last page taken out as a token of its own.
    TablePop,
    /// Every page of the table given back.
    TableClear,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::Alloc),
        4 => any::<usize>().prop_map(Step::Free),
        2 => any::<usize>().prop_map(Step::Write),
        1 => Just(Step::Grow),
        1 => Just(Step::Shrink),
        1 => Just(Step::FailNextGrow),
        3 => Just(Step::TablePush),
        1 => Just(Step::TablePop),
        1 => Just(Step::TableClear),
    ]
}

fn cases() -> u32 {
    common::proptest_cases(1000)
}

/// Writes the page's index into its first and last bytes; reads it back.
fn stamp(page: &mut Page<'_, '_, '_, '_, Faulty<HostBackend>>) {
    let i = page.index().to_le_bytes();
    let bytes = page.as_mut_slice();
    let n = bytes.len();
    bytes[..4].copy_from_slice(&i);
    bytes[n - 4..].copy_from_slice(&i);
}

fn stamped(page: &Page<'_, '_, '_, '_, Faulty<HostBackend>>) -> bool {
    let i = page.index().to_le_bytes();
    let bytes = page.as_slice();
    bytes[..4] == i && bytes[bytes.len() - 4..] == i
}

fn run(steps: &[Step]) {
    make_guard!(guard);
    // 4 KiB chunks of 1 KiB pages: growth and shrinking happen often.
    let backend = Faulty::new(HostBackend::new(HostConfig::default()).unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::bytes(64 << 10)).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 1024).unwrap();
    let mut live: Vec<(Page<'_, '_, '_, '_, _>, bool)> = Vec::new();
    let mut table = pool.table();
    for step in steps {
        match *step {
            Step::Alloc => match pool.alloc() {
                Ok(page) => live.push((page, false)),
                Err(PoolError::Commit(_) | PoolError::Reserve(_)) => {} // budget or fault
                Err(e) => panic!("{e}"),
            },
            Step::Free(i) if !live.is_empty() => {
                let (page, _) = live.swap_remove(i % live.len());
                pool.free(page);
            }
            Step::Write(i) if !live.is_empty() => {
                let n = live.len();
                let (page, written) = &mut live[i % n];
                stamp(page);
                *written = true;
            }
            Step::Grow => {
                let _ = pool.grow();
            }
            Step::Shrink => {
                pool.shrink();
            }
            Step::FailNextGrow => faults.fail_nth(Op::Create, 1),
            Step::TablePush => {
                let _ = pool.push(&mut table); // may fail: budget or an injected fault
            }
            Step::TablePop => live.extend(table.pop().map(|p| (p, false))),
            Step::TableClear => pool.clear(&mut table),
            _ => {}
        }
        let indices: HashSet<u32> = live.iter().map(|(p, _)| p.index()).collect();
        assert_eq!(indices.len(), live.len(), "a page was handed out twice");
        let in_use = live.len() + table.len();
        let addrs: HashSet<usize> = live
            .iter()
            .map(|(p, _)| p.addr())
            .chain((0..table.len()).map(|i| table.addr(i)))
            .collect();
        assert_eq!(addrs.len(), in_use, "two pages in use share an address");
        assert_eq!(
            pool.free_pages() + in_use,
            pool.capacity(),
            "free + live != capacity"
        );
        assert_eq!(pool.live_pages(), in_use);
        assert_eq!(device.ledger().owned_bytes, pool.capacity() as u64 * 1024);
        for (page, written) in &live {
            assert!(
                !written || stamped(page),
                "page {} lost its bytes",
                page.index()
            );
        }
    }
    drop(live);
    drop(table);
    pool.shrink();
    assert_eq!(pool.capacity(), 0);
    assert!(device.ledger().is_zero());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn pages_are_never_handed_out_twice_and_free_plus_live_is_capacity(
        steps in prop::collection::vec(step(), 1..120)
    ) {
        run(&steps);
    }
}

#[test]
fn the_hot_path_makes_no_backend_call() {
    make_guard!(guard);
    let sim = SimBackend::strict();
    let device = Device::new(guard, sim.clone());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    pool.grow().unwrap();
    let calls = sim.calls().len();
    for _ in 0..common::unless_miri(10, 2) {
        let pages: Vec<_> = (0..pool.capacity())
            .map(|_| pool.alloc().unwrap())
            .collect();
        drop(pages);
    }
    assert_eq!(
        sim.calls().len(),
        calls,
        "alloc and free called the backend"
    );
}

#[test]
fn a_pool_grows_by_chunks_and_gives_idle_chunks_back() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::strict());
    let binding = device.bind(Budget::unlimited()).unwrap();
    let g = device.granularity();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, g / 4).unwrap();
    let a: Vec<_> = (0..5).map(|_| pool.alloc().unwrap()).collect();
    assert_eq!(
        (pool.capacity(), pool.live_pages()),
        (8, 5),
        "two chunks of four pages"
    );
    assert_eq!(device.ledger().owned_bytes, 2 * g as u64);
    assert_eq!(pool.shrink(), 0, "both chunks have live pages");
    let mut a = a.into_iter();
    for page in a.by_ref().take(4) {
        drop(page);
    }
    // Pages 0..4 came from the first chunk; it is idle now.
    assert_eq!(pool.shrink(), 1);
    assert_eq!(
        (pool.capacity(), device.ledger().owned_bytes),
        (4, g as u64)
    );
    drop(a);
    assert_eq!(pool.shrink(), 1);
    assert!(device.ledger().is_zero());
}

#[test]
fn an_invalid_page_size_and_a_refused_growth_are_errors() {
    make_guard!(guard);
    let device = Device::new(guard, SimBackend::strict());
    let binding = device.bind(Budget::bytes(0)).unwrap();
    make_guard!(g3000);
    assert!(matches!(
        PagePool::new(g3000, &binding, 3000),
        Err(PoolError::PageSize(3000))
    ));
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let err = pool.alloc().unwrap_err();
    // The pool's message says growing failed; the budget's refusal is its source.
    assert!(
        matches!(&err, PoolError::Commit(c) if matches!(**c, CommitFailure::Budget { .. })),
        "{err:?}"
    );
    let cause = std::error::Error::source(&err).expect("the budget's refusal");
    assert!(
        cause.to_string().contains("exceed the binding's budget"),
        "{err}: {cause}"
    );
    assert_eq!(
        (pool.capacity(), device.ledger().reserved_bytes),
        (0, 0),
        "nothing kept"
    );
}

/// Kills `src/page_pool.rs: replace - with + in PagePool<'pool, 'b, 'id, B>::push`,
/// `src/page_pool.rs: replace PageTable<'p, 'pool, 'b, 'id, B>::is_empty -> bool with true` and
/// `src/page_pool.rs: replace <impl fmt::Debug for PageTable<'_, '_, '_, '_, B>>::fmt ->
/// fmt::Result with Ok(Default::default())` and `replace PageTable<'p, 'pool, 'b, 'id,
/// B>::pop -> Option<Page<'p, 'pool, 'b, 'id, B>> with None` (and the pool's and the page's
/// `fmt::Debug`):
/// `push` answers the new page's position in the table, which is then not empty, debugs as its
/// pages, and pops the last; the pool debugs as its page size.
#[test]
fn a_pushed_page_is_at_the_position_push_answers() {
    make_guard!(guard);
    let device = Device::new(guard, common::sim(16 * GRANULE as u64));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, 4096).unwrap();
    let mut table = pool.table();
    assert!(table.is_empty());
    assert_eq!(pool.push(&mut table).unwrap(), 0);
    assert!(!table.is_empty());
    assert_eq!(pool.push(&mut table).unwrap(), 1);
    assert_eq!(table.len(), 2);
    assert_ne!(table.addr(0), table.addr(1));
    let debug = format!("{table:?}");
    assert!(debug.starts_with("PageTable { pages: ["), "{debug}");
    let debug = format!("{pool:?}");
    assert!(debug.starts_with("PagePool { page_size: 4096, "), "{debug}");
    let last = table.pop().expect("two pages in the table");
    assert_eq!(table.len(), 1);
    let debug = format!("{last:?}");
    assert!(debug.starts_with("Page { index: "), "{debug}");
    let (live, free) = (pool.live_pages(), pool.free_pages());
    pool.free(last);
    assert_eq!(
        (pool.live_pages(), pool.free_pages() + pool.cooling_pages()),
        (live - 1, free + 1),
        "freed: free, or cooling until its fence completes"
    );
    pool.clear(&mut table);
    assert!(table.is_empty());
}

/// A page whose fence has completed goes back to the free list only if the backend does not
/// withhold it; where that question panics, the answer taken is "withheld" (the safe side:
/// memory a graph may still use goes to no new owner), the pool hands out another page, and
/// the panic reaches the caller once the pool is whole again. The panic is planned at the
/// last call of an allocation that reclaims a page, which a first such allocation counts.
/// Fails if `Faulty` answers `withheld` without making it a call (no panic can be planned
/// there).
#[test]
fn a_page_whose_withheld_question_panics_goes_to_no_new_owner() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    make_guard!(guard);
    let backend = Faulty::new(SimBackend::strict()); // its fences complete at once
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    // One page per chunk: an allocation with no page free reclaims the cooling one.
    let pool = PagePool::new(pool_guard, &binding, device.granularity()).unwrap();
    let used = pool.alloc().unwrap().addr(); // given back at once: it cools
    let before = faults.any_calls();
    assert_eq!(pool.alloc().unwrap().addr(), used, "reclaimed");
    let reclaim = faults.any_calls() - before;
    faults.panic_at_call(reclaim);
    let panic = catch_unwind(AssertUnwindSafe(|| pool.alloc().map(|p| p.addr())))
        .expect_err("the injected panic resumes");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    let planned = format!("call #{} of any kind (\"withheld\")", before + 2 * reclaim);
    assert!(
        message.ends_with(&planned),
        "the reclaim's last call is not the question whether the page is withheld: {message}"
    );
    assert_eq!(pool.withheld_pages(), 1);
    let other = pool.alloc().unwrap();
    assert_ne!(other.addr(), used, "handed out again");
    assert_eq!(pool.withheld_pages(), 1);
}
