//! Block-level sharing: pages shared by reference, forks with copy-on-write, and a
//! prefix cache — behaviours one by one, then a property test over random steps with faults
//! injected, on the host and on the CUDA backend over the driver model.

use crate::common;
use memtoken::backend::cuda::{CudaBackend, DriverCall};
use memtoken::backend::doubles::{DriverModel, FaultHandle, Faulty};
use memtoken::backend::{Backend, Op};
use memtoken::make_guard;
use memtoken::{Budget, Device, PagePool, PoolError, PrefixCache, SharedPage, SharedTable};
use proptest::prelude::*;
use std::collections::HashMap;

const PAGE: usize = 4096;

/// The first bytes of a page, which the tests write and read back.
const HEAD: usize = 16;

fn write<B: Backend>(table: &mut SharedTable<'_, '_, '_, '_, B>, position: usize, byte: u8) {
    table
        .copy_page_from_host(position, 0, &[byte; HEAD])
        .expect("the page is writable");
}

fn read<B: Backend>(table: &SharedTable<'_, '_, '_, '_, B>, position: usize) -> u8 {
    let mut head = [0u8; HEAD];
    table.copy_page_to_host(position, 0, &mut head).unwrap();
    assert!(head.iter().all(|&b| b == head[0]), "{head:?}");
    head[0]
}

/// A fork holds the same pages (counted once more each, no byte copied); writing one of them
/// copies that page only, and the prompt keeps its bytes.
#[test]
fn a_fork_shares_every_page_and_a_write_copies_one() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut prompt = pool.shared_table();
    for byte in 1..=4 {
        let at = pool.push(&mut prompt).unwrap();
        write(&mut prompt, at, byte);
    }
    let live = pool.live_pages();
    let mut fork = pool.fork(&prompt);
    assert_eq!(pool.live_pages(), live, "no page copied by the fork");
    for position in 0..4 {
        assert_eq!(fork.index(position), prompt.index(position));
        assert_eq!(pool.holders(prompt.index(position)), 2);
        assert!(fork.page_mut(position).is_none(), "shared: read-only");
    }
    assert!(matches!(
        fork.copy_page_from_host(2, 0, &[9]),
        Err(PoolError::Shared(2))
    ));
    assert!(pool.copy_on_write(&mut fork, 2).unwrap());
    assert!(
        !pool.copy_on_write(&mut fork, 2).unwrap(),
        "private already"
    );
    write(&mut fork, 2, 9);
    assert_eq!(pool.live_pages(), live + 1, "one page copied");
    assert_eq!((read(&prompt, 2), read(&fork, 2)), (3, 9));
    assert_eq!(read(&fork, 1), 2, "the other pages are still shared");
    assert_eq!(pool.holders(prompt.index(2)), 1);
    drop(prompt);
    assert_eq!(
        pool.holders(fork.index(0)),
        1,
        "the fork holds them alone now"
    );
    assert!(fork.page_mut(0).is_some());
    drop(fork);
    assert_eq!(pool.live_pages(), 0);
}

/// A shared page is one more holder: its table's page is read-only while it lives; dropping
/// it lets the page go, and the last holder frees it.
#[test]
fn a_shared_page_counts_as_a_holder() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    write(&mut table, 0, 5);
    let page = pool.share(&table, 0);
    let again = page.clone();
    assert_eq!(pool.holders(page.index()), 3);
    // A read at an offset into the page reads there.
    table
        .copy_page_from_host(0, 8, &[6, 7])
        .expect_err("shared: read-only");
    let mut two = [0u8; 2];
    page.copy_to_host(HEAD - 2, &mut two).unwrap();
    assert_eq!(two, [5, 5]);
    page.copy_to_host(HEAD, &mut two).unwrap();
    assert_eq!(two, [0, 0], "past the bytes written");
    assert!(table.page_mut(0).is_none());
    assert_eq!(again.as_slice()[0], 5);
    drop(table);
    drop(again);
    assert_eq!(pool.holders(page.index()), 1);
    assert_eq!(pool.live_pages(), 1);
    let mut other = pool.shared_table();
    pool.push(&mut other).unwrap();
    let position = pool.push_shared(&mut other, page);
    assert_eq!(position, 1, "the position it was appended at");
    assert!(other.page_mut(position).is_some(), "its only holder now");
    drop(other);
    assert_eq!(pool.live_pages(), 0);
}

/// A page entered in the cache is read-only even with one holder; freed, it stays findable
/// and idle; a hit takes it out of the eviction order; the pool evicts idle pages — the one
/// let go least recently first, a sequence's later pages before its earlier ones — only when
/// it has no free page, never a held one.
#[test]
fn the_prefix_cache_keeps_freed_pages_findable_and_evicts_later_pages_first() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut cache = PrefixCache::new(&pool);
    let mut seq = pool.shared_table();
    for key in 0..3u32 {
        pool.push(&mut seq).unwrap();
        write(&mut seq, key as usize, key as u8 + 1);
        assert!(cache.enter(&seq, key as usize, key));
    }
    assert!(!cache.enter(&seq, 0, 7), "cached already");
    assert!(
        seq.page_mut(2).is_none(),
        "cached: read-only with one holder"
    );
    assert!(pool.copy_on_write(&mut seq, 2).unwrap(), "a write copies");
    assert!(pool.is_cached(cache.lookup(&2).unwrap().index()));
    let held = cache.lookup(&0).unwrap(); // held through the whole test
    drop(seq);
    // Idle now: key 1 (the middle page) and key 2 (the cached copy-on-write source); 0 held.
    assert_eq!(pool.idle_pages(), 2);
    assert_eq!(cache.len(), 3);
    // Fill the pool's free pages, then one more page: the least recently let go idle page
    // is evicted — of the sequence, the later page (key 2) before the earlier one (key 1).
    let mut filler = pool.shared_table();
    while pool.free_pages() > 0 {
        pool.push(&mut filler).unwrap();
    }
    let capacity = pool.capacity();
    pool.push(&mut filler).unwrap();
    assert_eq!(
        pool.capacity(),
        capacity,
        "an idle page was evicted, no chunk added"
    );
    assert!(
        !cache.contains(&2) && cache.contains(&1),
        "the later page went first"
    );
    // A hit takes key 1 out of the order: the next page needs a new chunk.
    let hit = cache.lookup(&1).unwrap();
    assert_eq!(hit.as_slice()[0], 2);
    assert_eq!(pool.idle_pages(), 0);
    pool.push(&mut filler).unwrap();
    assert!(pool.capacity() > capacity, "held pages are never evicted");
    assert!(cache.contains(&0) && cache.contains(&1));
    assert_eq!(held.as_slice()[0], 1);
    drop((hit, held, filler));
    assert_eq!(pool.idle_pages(), 2);
    assert_eq!(pool.evict_idle(), 2);
    assert!(cache.is_empty());
    assert_eq!(pool.live_pages(), 0);
}

/// A failed copy-on-write leaves the table as it was, and gives the new page back.
#[test]
fn a_failed_copy_on_write_changes_nothing() {
    make_guard!(guard);
    let backend = Faulty::new(crate::common::host());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    write(&mut table, 0, 3);
    let fork = pool.fork(&table);
    let (index, live) = (table.index(0), pool.live_pages());
    faults.fail_nth(Op::Copy, 1);
    let e = pool.copy_on_write(&mut table, 0).unwrap_err();
    assert!(matches!(e, PoolError::Copy(_)), "{e}");
    assert_eq!((table.index(0), pool.live_pages()), (index, live));
    assert_eq!(pool.holders(index), 2);
    assert!(pool.copy_on_write(&mut table, 0).unwrap());
    drop((table, fork));
    assert_eq!(pool.live_pages(), 0);
}

/// On CUDA a copy-on-write is a device-to-device copy (`cuMemcpyDtoD`), ordered after a
/// kernel writing the source through a view on another stream.
#[test]
fn on_cuda_a_copy_on_write_is_a_device_copy_after_the_sources_writer() {
    let model = DriverModel::new(memtoken::backend::doubles::ModelConfig {
        events_complete_at_once: false,
        ..common::model_config()
    })
    .unwrap();
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    write(&mut table, 0, 4);
    let fork = pool.fork(&table);
    // A kernel writing the chunk (through a page of it) on another stream, still running.
    let mut other = pool.alloc().unwrap();
    let ptr = other
        .stream_view_mut::<u8>(stream)
        .unwrap()
        .device_ptr_mut();
    model.submit_work_touching(stream, &[(ptr, PAGE)]);
    let kernel = {
        use memtoken::backend::cuda::Driver;
        let done = model.event_create().unwrap();
        // SAFETY: a live event and stream of the model.
        unsafe { model.event_record(done, stream) }.unwrap();
        done
    };
    let copies = model.count(DriverCall::MemcpyDtoD);
    assert!(pool.copy_on_write(&mut table, 0).unwrap());
    assert_eq!(model.count(DriverCall::MemcpyDtoD), copies + 1);
    {
        use memtoken::backend::cuda::Driver;
        // SAFETY: a live event of the model.
        let finished = unsafe { model.event_query(kernel) }.unwrap();
        assert!(
            finished,
            "the copy ran before the kernel on the chunk finished"
        );
    }
    assert_eq!(read(&table, 0), 4);
    drop((other, fork, table));
    model.complete_work();
    drop(pool);
    drop(binding);
    model.complete_work();
    assert!(device.close().is_clean());
}

/// On the driver model, at its budget, a pool whose pages are all
/// idle in the cache evicts one — which cools behind a fence like a freed page — and hands it
/// out once the work that may use it has finished; it does not grow past the budget.
#[test]
fn on_cuda_at_the_budget_an_evicted_page_is_reused_once_it_has_cooled() {
    let model = DriverModel::new(memtoken::backend::doubles::ModelConfig {
        events_complete_at_once: false,
        ..common::model_config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let g = common::MODEL_GRANULARITY;
    let binding = device.bind(Budget::bytes(g as u64)).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, g / 64).unwrap();
    let mut cache = PrefixCache::new(&pool);
    let mut seq = pool.shared_table();
    for key in 0..64usize {
        pool.push(&mut seq).unwrap();
        assert!(cache.enter(&seq, key, key));
    }
    drop(seq);
    assert_eq!((pool.idle_pages(), pool.free_pages()), (64, 0));
    let mut next = pool.shared_table();
    // No work may use the idle pages: one is evicted and handed out at once, within budget.
    pool.push(&mut next).unwrap();
    assert_eq!(pool.capacity(), 64, "no chunk past the budget");
    // The sequence let its last page go first: that one was evicted, and only it.
    assert!(
        !cache.contains(&63usize),
        "the page let go least recently was evicted"
    );
    assert_eq!(cache.len(), 63);
    // With a kernel that may still read them, the next evicted page cools first.
    model.submit_work();
    assert!(
        pool.push(&mut next).is_err(),
        "at the budget, nothing free yet"
    );
    assert_eq!(pool.capacity(), 64);
    model.complete_work();
    pool.push(&mut next).unwrap();
    assert_eq!((pool.capacity(), cache.len()), (64, 62));
    drop((next, cache));
    model.complete_work();
    drop(pool);
    drop(binding);
    assert!(device.close().is_clean());
}

/// A dropped cache lets its pages go — cached no more, so a sole
/// holder may write one again, and an idle one goes back to the pool.
#[test]
fn a_dropped_cache_lets_its_pages_go() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut cache = PrefixCache::new(&pool);
    let mut seq = pool.shared_table();
    pool.push(&mut seq).unwrap();
    pool.push(&mut seq).unwrap();
    cache.enter(&seq, 0, 0u8);
    cache.enter(&seq, 1, 1u8);
    let kept = pool.share(&seq, 1);
    drop(seq);
    assert_eq!(pool.idle_pages(), 1);
    drop(cache);
    assert_eq!(pool.idle_pages(), 0, "the idle page went back to the pool");
    assert!(!pool.is_cached(kept.index()));
    let mut other = pool.shared_table();
    pool.push_shared(&mut other, kept);
    assert!(
        other.page_mut(0).is_some(),
        "cached no more: its sole holder writes it"
    );
    drop(other);
    assert_eq!(pool.live_pages(), 0);
}

/// On CUDA a shared table's page lends a stream view for reading always, and for writing only
/// while the table holds it alone, uncached.
#[test]
fn on_cuda_a_shared_page_lends_a_writable_view_only_to_its_sole_holder() {
    let model = common::model();
    common::known_device!(model, device, stream);
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE).unwrap();
    let mut table = pool.shared_table();
    pool.push(&mut table).unwrap();
    assert!(table.page_stream_view_mut::<u32>(0, stream).is_some());
    let fork = pool.fork(&table);
    assert_eq!(
        fork.page_stream_view::<u32>(0, stream).unwrap().len(),
        PAGE / 4
    );
    assert!(
        table.page_stream_view_mut::<u32>(0, stream).is_none(),
        "shared"
    );
    drop(fork);
    let view = table
        .page_stream_view_mut::<u32>(0, stream)
        .unwrap()
        .unwrap();
    assert_eq!(view.len(), PAGE / 4);
    drop(view);
    drop(table);
    drop(pool);
    drop(binding);
    assert!(device.close().is_clean());
}

// ---- The property test ----

#[derive(Clone, Debug)]
enum Step {
    /// A new sequence of 1-4 fresh pages, each written.
    New(usize),
    /// A fork of a sequence.
    Fork(usize),
    /// One more holder of a sequence's page.
    Share(usize, usize),
    /// A shared page goes.
    Unshare(usize),
    /// A shared page joins a sequence.
    Adopt(usize, usize),
    /// A write to a sequence's page (a copy-on-write first if it is shared or cached).
    Write(usize, usize, u8),
    /// One more fresh page at a sequence's end.
    Push(usize),
    /// A sequence goes.
    Free(usize),
    /// A sequence's page is entered in the cache under a new key.
    Enter(usize, usize),
    /// A key is looked up; a hit joins a sequence (or is held alone).
    Lookup(usize, usize),
    /// Every idle page is evicted.
    EvictIdle,
    /// The nth backend call of a kind fails.
    Fault(Op, u64),
}

fn step() -> impl Strategy<Value = Step> {
    let op = prop::sample::select(vec![Op::Reserve, Op::Create, Op::Map, Op::Copy]);
    prop_oneof![
        3 => (1usize..5).prop_map(Step::New),
        2 => any::<usize>().prop_map(Step::Fork),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(s, p)| Step::Share(s, p)),
        2 => any::<usize>().prop_map(Step::Unshare),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(p, s)| Step::Adopt(p, s)),
        4 => (any::<usize>(), any::<usize>(), any::<u8>()).prop_map(|(s, p, b)| Step::Write(s, p, b)),
        2 => any::<usize>().prop_map(Step::Push),
        3 => any::<usize>().prop_map(Step::Free),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(s, p)| Step::Enter(s, p)),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(k, s)| Step::Lookup(k, s)),
        1 => Just(Step::EvictIdle),
        2 => (op, 1u64..4).prop_map(|(op, n)| Step::Fault(op, n)),
    ]
}

/// What the test expects: each sequence's pages and the byte each holds; shared pages held
/// alone and their bytes; each key's page and its bytes when entered; the idle pages in the
/// order they were let go.
struct World<'p, 'pool, 'b, 'id, B: Backend> {
    pool: &'p PagePool<'pool, 'b, 'id, B>,
    cache: PrefixCache<'p, 'pool, 'b, 'id, B, u64>,
    faults: FaultHandle,
    seqs: Vec<(SharedTable<'p, 'pool, 'b, 'id, B>, Vec<u8>)>,
    pages: Vec<(SharedPage<'p, 'pool, 'b, 'id, B>, u8)>,
    /// Key → (page index, its byte when entered).
    keys: HashMap<u64, (u32, u8)>,
    next_key: u64,
    /// Idle pages, least recently let go first (as the test believes).
    idle: Vec<u32>,
    /// Cached pages (as the test believes).
    cached: Vec<u32>,
}

impl<'p, 'pool, 'b, 'id, B: Backend> World<'p, 'pool, 'b, 'id, B> {
    /// Holders of each page, counted from what the test holds.
    fn holders(&self) -> HashMap<u32, u32> {
        let mut held = HashMap::new();
        for (table, _) in &self.seqs {
            for position in 0..table.len() {
                *held.entry(table.index(position)).or_default() += 1;
            }
        }
        for (page, _) in &self.pages {
            *held.entry(page.index()).or_default() += 1;
        }
        held
    }

    /// One holder of page `index` let it go (`held`: the holders just before): with none
    /// left, a cached page becomes idle, last in the eviction order.
    fn let_go(&mut self, held: &mut HashMap<u32, u32>, index: u32) {
        let n = held.get_mut(&index).expect("a held page");
        *n -= 1;
        if *n == 0 {
            held.remove(&index);
            if self.cached.contains(&index) {
                self.idle.push(index);
            }
        }
    }

    /// Reads a page's bytes, with no fault planned.
    fn read_now(&self, table: &SharedTable<'_, '_, '_, '_, B>, position: usize) -> u8 {
        self.faults.clear();
        read(table, position)
    }

    /// A fresh page just handed out: held by no one before, not idle.
    fn check_fresh(&self, index: u32, holders_before: &HashMap<u32, u32>) {
        assert!(
            !holders_before.contains_key(&index),
            "page {index} handed out twice"
        );
        assert!(
            !self.idle.contains(&index),
            "idle page {index} handed out without eviction"
        );
    }

    fn apply(&mut self, step: &Step) {
        let pool = self.pool;
        match *step {
            Step::New(n) => {
                let mut table = pool.shared_table();
                let mut bytes = Vec::new();
                for i in 0..n {
                    let before = self.holders();
                    let pushed = pool.push(&mut table);
                    self.sync_evictions(&before);
                    let Ok(at) = pushed else { break };
                    self.check_fresh(table.index(at), &before);
                    let byte = (self.next_key as u8).wrapping_add(i as u8) | 1;
                    if table.copy_page_from_host(at, 0, &[byte; HEAD]).is_err() {
                        // Faulted: the page holds what it held; the test reads it to know.
                        bytes.push(self.read_now(&table, at));
                        continue;
                    }
                    bytes.push(byte);
                }
                self.seqs.push((table, bytes));
            }
            Step::Fork(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    let fork = pool.fork(&self.seqs[s].0);
                    let bytes = self.seqs[s].1.clone();
                    self.seqs.push((fork, bytes));
                }
            }
            Step::Share(s, p) => {
                if let Some((s, p)) = self.position(s, p) {
                    let page = pool.share(&self.seqs[s].0, p);
                    self.pages.push((page, self.seqs[s].1[p]));
                }
            }
            Step::Unshare(i) => {
                if let Some(i) = pick(i, self.pages.len()) {
                    let mut held = self.holders();
                    let (page, _) = self.pages.swap_remove(i);
                    let index = page.index();
                    drop(page);
                    self.let_go(&mut held, index);
                }
            }
            Step::Adopt(i, s) => {
                if let (Some(i), Some(s)) = (pick(i, self.pages.len()), pick(s, self.seqs.len())) {
                    let (page, byte) = self.pages.swap_remove(i);
                    let (table, bytes) = &mut self.seqs[s];
                    pool.push_shared(table, page);
                    bytes.push(byte);
                }
            }
            Step::Write(s, p, byte) => {
                if let Some((s, p)) = self.position(s, p) {
                    let before = self.holders();
                    let old = self.seqs[s].0.index(p);
                    match pool.copy_on_write(&mut self.seqs[s].0, p) {
                        Ok(copied) => {
                            self.sync_evictions(&before);
                            if copied {
                                self.check_fresh(self.seqs[s].0.index(p), &before);
                                let mut held = before;
                                self.let_go(&mut held, old);
                            }
                            let table = &mut self.seqs[s].0;
                            assert!(table.is_writable(p));
                            if table.copy_page_from_host(p, 0, &[byte; HEAD]).is_ok() {
                                self.seqs[s].1[p] = byte;
                            }
                        }
                        Err(_) => {
                            self.sync_evictions(&before);
                            assert_eq!(
                                self.seqs[s].0.index(p),
                                old,
                                "a failed copy-on-write changed the table"
                            );
                        }
                    }
                }
            }
            Step::Push(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    let before = self.holders();
                    let pushed = pool.push(&mut self.seqs[s].0);
                    self.sync_evictions(&before);
                    if let Ok(at) = pushed {
                        self.check_fresh(self.seqs[s].0.index(at), &before);
                        let byte = self.read_now(&self.seqs[s].0, at);
                        self.seqs[s].1.push(byte);
                    }
                }
            }
            Step::Free(s) => {
                if let Some(s) = pick(s, self.seqs.len()) {
                    let mut held = self.holders();
                    let (table, _) = self.seqs.swap_remove(s);
                    let order: Vec<u32> = (0..table.len()).rev().map(|p| table.index(p)).collect();
                    drop(table);
                    // Let go last page first: the later pages become idle first.
                    for index in order {
                        self.let_go(&mut held, index);
                    }
                }
            }
            Step::Enter(s, p) => {
                if let Some((s, p)) = self.position(s, p) {
                    let key = self.next_key;
                    self.next_key += 1;
                    let index = self.seqs[s].0.index(p);
                    let entered = self.cache.enter(&self.seqs[s].0, p, key);
                    assert_eq!(entered, !self.cached.contains(&index));
                    if entered {
                        self.cached.push(index);
                        self.keys.insert(key, (index, self.seqs[s].1[p]));
                    }
                }
            }
            Step::Lookup(k, s) => {
                if self.next_key == 0 {
                    return;
                }
                let key = (k as u64) % self.next_key;
                let hit = self.cache.lookup(&key);
                match (hit, self.keys.get(&key).copied()) {
                    (Some(page), Some((index, byte))) => {
                        assert_eq!(page.index(), index);
                        let mut head = [0u8; HEAD];
                        self.faults.clear();
                        page.copy_to_host(0, &mut head).unwrap();
                        assert_eq!(
                            head[0], byte,
                            "a hit returned other bytes than were entered"
                        );
                        self.idle.retain(|&i| i != index);
                        match pick(s, self.seqs.len()).filter(|_| s % 2 == 0) {
                            Some(s) => {
                                pool.push_shared(&mut self.seqs[s].0, page);
                                self.seqs[s].1.push(byte);
                            }
                            None => self.pages.push((page, byte)),
                        }
                    }
                    (None, None) => {}
                    (hit, expected) => panic!(
                        "key {key}: the cache answered {:?}, the test expected {expected:?}",
                        hit.map(|p| p.index())
                    ),
                }
            }
            Step::EvictIdle => {
                let before = self.holders();
                let n = pool.evict_idle();
                assert_eq!(n, self.idle.len());
                self.sync_evictions(&before);
            }
            Step::Fault(op, n) => self.faults.fail_nth(op, n),
        }
    }

    /// Pages the pool evicted since the last look (`held`: the holders before the step): they
    /// were held by no one, and are the idle pages let go least recently (a prefix of the
    /// test's order); their keys go stale. (An evicted page may be handed out at once.)
    fn sync_evictions(&mut self, held: &HashMap<u32, u32>) {
        let evicted: Vec<u32> = self
            .cached
            .iter()
            .copied()
            .filter(|&i| !self.pool.is_cached(i))
            .collect();
        if evicted.is_empty() {
            return;
        }
        for &index in &evicted {
            assert!(!held.contains_key(&index), "held page {index} was evicted");
        }
        let prefix: Vec<u32> = self.idle[..evicted.len()].to_vec();
        let mut sorted_prefix = prefix.clone();
        sorted_prefix.sort_unstable();
        let mut sorted_evicted = evicted.clone();
        sorted_evicted.sort_unstable();
        assert_eq!(
            sorted_evicted, sorted_prefix,
            "eviction took {evicted:?}, not the least recently let go {:?}",
            self.idle
        );
        self.idle.drain(..evicted.len());
        self.cached.retain(|i| !evicted.contains(i));
        self.keys.retain(|_, (i, _)| !evicted.contains(i));
    }

    fn position(&self, s: usize, p: usize) -> Option<(usize, usize)> {
        let s = pick(s, self.seqs.len())?;
        let p = pick(p, self.seqs[s].0.len())?;
        Some((s, p))
    }

    fn check(&self) {
        let held = self.holders();
        for (&index, &n) in &held {
            assert_eq!(
                self.pool.holders(index),
                u64::from(n),
                "page {index}: count vs live holders"
            );
        }
        assert_eq!(self.pool.idle_pages(), self.idle.len());
        for &index in &self.idle {
            assert_eq!(self.pool.holders(index), 0);
            assert!(self.pool.is_cached(index));
        }
        assert_eq!(self.pool.live_pages(), held.len());
        for (table, bytes) in &self.seqs {
            assert_eq!(table.len(), bytes.len());
            for (position, &byte) in bytes.iter().enumerate() {
                assert_eq!(
                    read(table, position),
                    byte,
                    "a sequence read back other bytes"
                );
            }
        }
        for (page, byte) in &self.pages {
            let mut head = [0u8; HEAD];
            page.copy_to_host(0, &mut head).unwrap();
            assert_eq!(head[0], *byte);
        }
    }
}

fn pick(i: usize, len: usize) -> Option<usize> {
    (len > 0).then(|| i % len)
}

fn run<B: Backend>(
    device: &Device<'_, B>,
    faults: FaultHandle,
    steps: &[Step],
    page: usize,
    budget: Budget,
) {
    let binding = device.bind(budget).unwrap();
    {
        make_guard!(pool_guard);
        let pool = PagePool::new(pool_guard, &binding, page).unwrap();
        let mut world = World {
            pool: &pool,
            cache: PrefixCache::new(&pool),
            faults: faults.clone(),
            seqs: Vec::new(),
            pages: Vec::new(),
            keys: HashMap::new(),
            next_key: 0,
            idle: Vec::new(),
            cached: Vec::new(),
        };
        for step in steps {
            world.apply(step);
            faults.clear();
            world.check();
        }
        let World {
            seqs, pages, cache, ..
        } = world;
        drop((seqs, pages, cache));
        pool.evict_idle();
        assert_eq!(pool.live_pages(), 0, "every page is free at the end");
    }
    drop(binding);
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: common::proptest_cases(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn shared_pages_on_the_host_keep_counts_bytes_and_eviction_order(steps in prop::collection::vec(step(), 1..60)) {
        make_guard!(guard);
        let backend = Faulty::new(crate::common::host());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        run(&device, faults.clone(), &steps, PAGE, Budget::unlimited());
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero());
    }

    #[test]
    fn shared_pages_on_the_driver_model_keep_counts_bytes_and_eviction_order(steps in prop::collection::vec(step(), 1..60)) {
        let model = common::model();
        make_guard!(guard);
        let backend = Faulty::new(CudaBackend::new(model.clone(), 0).unwrap());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        // Two chunks of 16 pages at most: the pool evicts (and cools what it evicts) often.
        let budget = Budget::bytes(2 * common::MODEL_GRANULARITY as u64);
        run(&device, faults.clone(), &steps, common::MODEL_GRANULARITY / 16, budget);
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
        assert!(device.close().is_clean());
        assert!(faults.outstanding().is_zero());
        assert!(model.outstanding().is_zero());
    }
}
