//! The KV cache asleep: its memory given back while every plane keeps its addresses; with its
//! bytes saved every table is valid and every byte equal after the wake-up, without them the
//! bytes are gone; asleep nothing is handed out, copied or mapped; refused by name on the plain
//! mechanism and under running work.

use crate::common::{self, Rng, says_first};
use memtoken::backend::cuda::{CudaBackend, Driver};
use memtoken::backend::doubles::{DriverModel, ModelConfig};
use memtoken::backend::{Addr, Backend};
use memtoken::kv::{BlockTable, KvCache, KvError, Layout};
use memtoken::{Budget, Device, make_guard};

/// Fills `tables` with `blocks` blocks each, every block's bytes in every plane random; returns
/// the bytes, per table, per block, per plane.
fn fill<'c, 'b, 'id, B: Backend>(
    cache: &KvCache<'c, 'b, 'id, B>,
    tables: &mut [BlockTable<'_, 'c, 'b, 'id, B>],
    blocks: usize,
    rng: &mut Rng,
) -> Vec<Vec<Vec<Vec<u8>>>> {
    let planes = cache.layout().planes().to_vec();
    tables
        .iter_mut()
        .map(|table| {
            (0..blocks)
                .map(|position| {
                    if cache.push(table).is_err() {
                        cache.replenish().unwrap();
                        cache.push(table).unwrap();
                    }
                    planes
                        .iter()
                        .enumerate()
                        .map(|(p, plane)| {
                            let bytes: Vec<u8> =
                                (0..plane.block_bytes).map(|_| rng.next() as u8).collect();
                            table.write(p, position, 0, &bytes).unwrap();
                            bytes
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Reads every block of `tables` at `base(p) + b × stride(p)` through `read_at` and compares
/// it with `bytes`.
fn all_equal<B: Backend>(
    cache: &KvCache<'_, '_, '_, B>,
    tables: &[BlockTable<'_, '_, '_, '_, B>],
    bytes: &[Vec<Vec<Vec<u8>>>],
    read_at: impl Fn(Addr, &mut [u8]),
) -> bool {
    tables.iter().zip(bytes).all(|(table, blocks)| {
        table.ids().iter().zip(blocks).all(|(&b, planes)| {
            planes.iter().enumerate().all(|(p, expected)| {
                let mut got = vec![0; expected.len()];
                read_at(cache.base(p) + b as usize * cache.stride(p), &mut got);
                &got == expected
            })
        })
    })
}

fn host_read(addr: Addr, dst: &mut [u8]) {
    // SAFETY: the tests read only blocks their tables hold while the cache is awake: mapped.
    let src = unsafe { std::slice::from_raw_parts(addr as *const u8, dst.len()) };
    dst.copy_from_slice(src);
}

#[test]
fn asleep_with_its_bytes_saved_the_cache_wakes_at_the_same_addresses_with_every_table_valid() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(1024, 16)
        .plane(1024)
        .plane_with_stride(512, 2048);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    let bases = [cache.base(0), cache.base(1)];
    let mut tables: Vec<_> = (0..4).map(|_| cache.table()).collect();
    let bytes = fill(&cache, &mut tables, 9, &mut Rng(3));
    let mapped = device.ledger().mapped_bytes;
    assert!(mapped > 0);

    cache.sleep_saving().unwrap();
    assert!(cache.is_asleep());
    assert_eq!(device.ledger().mapped_bytes, 0, "every group unmapped");
    assert_eq!(cache.mapped_groups(), 0);
    let mut other = cache.table();
    assert_eq!(cache.push(&mut other), Err(KvError::Asleep));
    assert_eq!(cache.replenish(), Err(KvError::Asleep));
    assert_eq!(tables[0].write(0, 0, 0, &[1]), Err(KvError::Asleep));
    assert_eq!(tables[0].read(0, 0, 0, &mut [0]), Err(KvError::Asleep));
    assert_eq!(cache.sleep(), Err(KvError::Asleep));
    // A table cleared while asleep: its blocks wait for the wake-up.
    let given: Vec<u32> = tables[3].ids().to_vec();
    cache.clear(&mut tables[3]);

    cache.wake().unwrap();
    assert!(!cache.is_asleep());
    assert_eq!([cache.base(0), cache.base(1)], bases, "the same addresses");
    assert_eq!(device.ledger().mapped_bytes, mapped);
    assert!(all_equal(&cache, &tables[..3], &bytes[..3], host_read));
    for _ in 0..given.len() {
        cache.push(&mut other).unwrap();
    }
    assert!(
        other.ids().iter().all(|b| given.contains(b)),
        "the lowest free blocks first"
    );
    assert_eq!(cache.wake(), Err(KvError::Awake));
    drop((tables, other));
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// Without saving, the bytes are gone: with the granule cache trimmed while it sleeps, the
/// wake-up maps new memory (zeroed on the host) at the same addresses.
#[test]
fn asleep_without_saving_the_cache_wakes_at_the_same_addresses_with_its_bytes_gone() {
    make_guard!(guard);
    let device = Device::new(guard, common::host());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(256, 16).plane(1024)).unwrap();
    let base = cache.base(0);
    let mut tables = vec![cache.table()];
    let bytes = fill(&cache, &mut tables, 6, &mut Rng(5));
    assert!(all_equal(&cache, &tables, &bytes, host_read));
    cache.sleep().unwrap();
    assert!(
        device.trim_cache() > 0,
        "the memory went to the granule cache"
    );
    assert_eq!(
        device.ledger().owned_bytes,
        0,
        "nothing owned while it sleeps"
    );
    cache.wake().unwrap();
    assert_eq!(cache.base(0), base);
    assert_eq!(tables[0].len(), 6, "the ids stay the table's");
    let zeros: Vec<Vec<Vec<Vec<u8>>>> = vec![vec![vec![vec![0; 1024]]; 6]];
    assert!(
        all_equal(&cache, &tables, &zeros, host_read),
        "the bytes are gone"
    );
    tables[0].write(0, 0, 0, b"again").unwrap();
    drop(tables);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
}

/// On the driver model: refused while a kernel may still use the planes (nothing unmapped),
/// then asleep and awake with every byte equal, read by the driver.
#[test]
fn on_the_driver_model_sleep_waits_for_running_work_and_wakes_with_every_byte() {
    let model = common::held_fences();
    make_guard!(guard);
    let device = Device::new(guard, common::cuda(&model));
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let layout = Layout::new(512, 16).plane(64 << 10).plane(32 << 10);
    let cache = KvCache::new(cache_guard, &binding, &layout).unwrap();
    let mut tables: Vec<_> = (0..3).map(|_| cache.table()).collect();
    let bytes = fill(&cache, &mut tables, 5, &mut Rng(9));
    model.submit_work(); // a kernel reading the cache
    let mapped = device.ledger().mapped_bytes;
    let e = cache.sleep_saving().unwrap_err();
    says_first(&e, "the KV cache cannot sleep yet");
    assert_eq!(device.ledger().mapped_bytes, mapped, "nothing unmapped");
    model.complete_work();
    cache.sleep_saving().unwrap();
    assert_eq!(device.ledger().mapped_bytes, 0);
    cache.wake().unwrap();
    let read = |addr: Addr, dst: &mut [u8]| {
        // SAFETY: blocks the tables hold, mapped since the wake-up.
        unsafe { model.memcpy_dtoh(dst, addr as u64) }.unwrap();
    };
    assert!(all_equal(&cache, &tables, &bytes, read));
    drop(tables);
    drop(cache);
    drop(binding);
    assert!(device.close().is_clean());
    assert!(model.outstanding().is_zero(), "{:?}", model.outstanding());
}

/// Where the planes are allocated whole (no virtual memory management) sleep is refused by
/// name, and the cache goes on as before.
#[test]
fn without_vmm_sleep_is_refused_by_name() {
    let model = DriverModel::new(ModelConfig {
        vmm: false,
        ..common::model_config()
    })
    .unwrap();
    make_guard!(guard);
    let device = Device::new(guard, CudaBackend::new_plain(model.clone(), 0).unwrap());
    let binding = device.bind(Budget::unlimited()).unwrap();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(64 << 10)).unwrap();
    let e = cache.sleep_saving().unwrap_err();
    assert!(matches!(e, KvError::SleepUnsupported(_)), "{e:?}");
    says_first(&e, "the KV cache cannot sleep");
    assert!(e.to_string().contains("allocated whole"), "{e}");
    assert!(!cache.is_asleep());
    let mut table = cache.table();
    cache.push(&mut table).unwrap();
}
