//! KV blocks by id over NIXL: a table offered to one peer, written by id and read only after
//! the peer's proof; blocks pulled into a table; registrations by group, let go before a group
//! is unmapped; tables withheld when a peer or a transfer may still touch them.

use super::*;
use memtoken::kv::{BlockTable, KvCache, KvError, Layout};
use memtoken::nixl::OfferedTable;

/// Bytes per block in each plane: a quarter of the host's 4 KiB granule, so groups hold four
/// blocks, and a table's blocks are not adjacent in memory.
const BLOCK: usize = 1024;
const PLANES: usize = 2;

fn layout() -> Layout {
    Layout::new(64, 16).plane(BLOCK).plane(BLOCK)
}

/// The byte at `i` of block `position`'s part of plane `plane` in request `seed`'s K/V.
fn seed(request: u8, position: usize, plane: usize) -> u8 {
    request
        .wrapping_mul(7)
        .wrapping_add((position * PLANES + plane) as u8)
}

/// Writes every plane of every block of `table` with request `request`'s bytes.
fn fill_table<B: memtoken::backend::Backend>(
    table: &mut BlockTable<'_, '_, '_, '_, B>,
    request: u8,
) -> Result<(), KvError> {
    let mut bytes = vec![0; BLOCK];
    for position in 0..table.len() {
        for plane in 0..PLANES {
            fill(&mut bytes, seed(request, position, plane));
            table.write(plane, position, 0, &bytes)?;
        }
    }
    Ok(())
}

/// Checks every plane of every block of `table` against request `request`'s bytes.
fn check_table<B: memtoken::backend::Backend>(
    table: &BlockTable<'_, '_, '_, '_, B>,
    request: u8,
) -> Result<(), KvError> {
    let mut bytes = vec![0; BLOCK];
    for position in 0..table.len() {
        for plane in 0..PLANES {
            table.read(plane, position, 0, &mut bytes)?;
            check(&bytes, seed(request, position, plane));
        }
    }
    Ok(())
}

/// `n` blocks, every other block of the cache (the others pushed into a table dropped), so that
/// no two are adjacent.
fn scattered<'t, 'c, 'b, 'id, B: memtoken::backend::Backend>(
    cache: &'t KvCache<'c, 'b, 'id, B>,
    n: usize,
) -> Result<BlockTable<'t, 'c, 'b, 'id, B>, KvError> {
    let mut table = cache.table();
    let mut spacer = cache.table();
    for _ in 0..n {
        cache.push(&mut spacer)?;
        cache.push(&mut table)?;
    }
    Ok(table)
}

/// The table of `offered` back once its peer's acknowledgement has arrived.
fn taken_back<'p, 'c, 'b, 'id>(
    mut offered: OfferedTable<'_, 'p, 'c, 'b, 'id, HostBackend>,
) -> BlockTable<'p, 'c, 'b, 'id, HostBackend> {
    for _ in 0..POLLS {
        match offered.take_back() {
            Ok(table) => return table,
            Err(e) => offered = e.token,
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("the peer's acknowledgement did not arrive in {POLLS} polls");
}

/// A cache of [`layout`] with enough groups mapped for `blocks` blocks.
macro_rules! cache {
    ($cache:ident, $binding:expr, $blocks:expr) => {
        make_guard!(cache_guard);
        let $cache = KvCache::new(cache_guard, &$binding, &layout())?;
        $cache.set_watermarks(
            ($blocks as usize).div_ceil($cache.blocks_per_group()) + 1,
            64,
        );
        $cache.replenish()?;
    };
}

/// Decode offers a table of six scattered blocks to prefill; prefill WRITEs six of its own
/// blocks by id (both planes of each) into it with a notification. The offered table lends
/// nothing and is not handed back before prefill says it is done; then every byte of every
/// plane reads as prefill wrote it. Nothing is lent after, and both ledgers end at zero.
#[test]
fn blocks_written_by_id_into_an_offered_table_are_read_only_after_the_proof()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "kv");
    cache!(decode_cache, db, 12);
    cache!(prefill_cache, pb, 12);

    let offered_table = scattered(&decode_cache, 6)?;
    let (offered, offer) = decode
        .offer_table(&prefill.id(), offered_table)
        .map_err(memtoken::Error::from)?;
    assert_eq!(offered.len(), 6);
    assert!(!offered.is_empty());
    assert_eq!(
        offered.to_string(),
        "a block table of 6 blocks offered to a peer"
    );
    assert_eq!(format!("{offered:?}"), "OfferedTable { blocks: 6, .. }");
    assert_eq!(decode_cache.lent_blocks(), 6);
    let peer = prefill.load(offer.as_bytes())?;
    assert_eq!(
        peer.regions().len(),
        6 * PLANES,
        "each block's part of each plane"
    );
    assert!(
        peer.regions().all(|(_, len)| len == BLOCK as u64),
        "only the blocks are offered"
    );

    let mut table = scattered(&prefill_cache, 6)?;
    fill_table(&mut table, 5)?;
    let registered = prefill.register_cache(&prefill_cache)?;
    assert_eq!(
        format!("{registered:?}"),
        format!(
            "RegisteredCache {{ groups: {}, poisoned: false }}",
            registered.registered_groups()
        )
    );
    let positions: Vec<usize> = (0..6).collect();
    let write = prefill
        .write_blocks(
            &registered,
            table,
            &positions,
            &peer,
            &peer.whole(0..6 * PLANES)?,
            Some(b"blocks"),
        )
        .map_err(memtoken::Error::from)?;
    assert_eq!(write.bytes(), 6 * PLANES * BLOCK);
    let said = format!("{write:?}");
    assert!(
        said.starts_with(&format!(
            "BlockTransfer {{ transfer: Transfer {{ bytes: {}, done: ",
            6 * PLANES * BLOCK
        )),
        "{said}"
    );
    assert_eq!(
        prefill_cache.lent_blocks(),
        6,
        "the transfer holds the table"
    );
    let table = write.wait(DROP_WAIT)?;
    assert_eq!(prefill_cache.lent_blocks(), 0);
    assert_eq!(wait_for_notification(&decode).message, b"blocks");

    // Prefill has not said it is done: the table stays offered.
    let offered = match offered.take_back() {
        Err(e) => {
            assert!(
                matches!(&e.cause, NixlError::Exposed { peers, .. } if peers == &["prefill-kv"]),
                "{:?}",
                e.cause
            );
            e.token
        }
        Ok(_) => panic!("an offered table came back before its peer's proof"),
    };
    peer.done()?;
    let back = taken_back(offered);
    assert_eq!(decode_cache.lent_blocks(), 0);
    check_table(&back, 5)?;

    drop((back, table));
    drop(registered);
    drop((prefill_cache, decode_cache));
    drop((pb, db));
    drop((prefill, decode));
    assert!(pd.close().is_clean());
    assert!(dd.close().is_clean());
    Ok(())
}

/// Each offered table is its own offer: a table offered to a peer after the peer loaded an
/// earlier one stays offered when the peer says it is done with what it loaded, and the
/// earlier table comes back. An offer of no blocks exposes nothing. Fails if two offers share an id
/// (the later offer's record replaced the earlier's, and the earlier never came back).
#[test]
fn a_table_offered_after_the_peer_loaded_another_is_its_own_offer()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "ids");
    cache!(decode_cache, db, 12);
    let (first, offer) = decode
        .offer_table(&prefill.id(), scattered(&decode_cache, 2)?)
        .map_err(memtoken::Error::from)?;
    let peer = prefill.load(offer.as_bytes())?;
    let (later, _never_loaded) = decode
        .offer_table(&prefill.id(), scattered(&decode_cache, 1)?)
        .map_err(memtoken::Error::from)?;
    // An offer of no blocks exposes nothing: it comes back at once.
    let (empty, _) = decode
        .offer_table(&prefill.id(), decode_cache.table())
        .map_err(memtoken::Error::from)?;
    assert_eq!((empty.len(), empty.is_empty()), (0, true));
    assert!(!later.is_empty());
    let empty = empty
        .take_back()
        .map_err(|e| memtoken::Error::from(e.cause))?;
    peer.done()?;
    let back = taken_back(first);
    assert_eq!(back.len(), 2);
    let later = match later.take_back() {
        Err(e) => {
            assert!(
                matches!(&e.cause, NixlError::Exposed { peers, .. } if peers == &["prefill-ids"]),
                "{:?}",
                e.cause
            );
            e.token
        }
        Ok(_) => panic!("a table came back before its peer loaded its offer"),
    };
    drop((later, back, empty)); // the later offer is withheld: its peer never said it was done
    drop(decode_cache);
    drop((pb, db));
    drop((prefill, decode));
    assert!(pd.close().is_clean());
    drop(dd);
    Ok(())
}

/// Decode READs blocks of prefill's offered table into blocks of its own: a table with a block
/// another table shares is refused (the READ would write it) and handed back whole; one of its
/// own blocks reads every byte.
#[test]
fn blocks_read_by_id_land_only_in_blocks_the_table_owns()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "kr");
    cache!(prefill_cache, pb, 8);
    cache!(decode_cache, db, 16);
    let mut source = scattered(&prefill_cache, 4)?;
    fill_table(&mut source, 9)?;
    let (offered, offer) = prefill
        .offer_table(&decode.id(), source)
        .map_err(memtoken::Error::from)?;
    let peer = decode.load(offer.as_bytes())?;
    let registered = decode.register_cache(&decode_cache)?;
    let remote = peer.whole(0..4 * PLANES)?;
    let positions = [0, 1, 2, 3];

    let into = scattered(&decode_cache, 4)?;
    let fork = decode_cache.fork(&into);
    let refused = decode
        .read_blocks(&registered, into, &positions, &peer, &remote, None)
        .expect_err("a shared block is not read into");
    assert!(
        matches!(&refused.cause, NixlError::Kv(e) if matches!(**e, KvError::ReadOnly { position: 0 })),
        "{:?}",
        refused.cause
    );
    let into = refused.into_token();
    assert_eq!(into.len(), 4, "handed back whole");
    assert_eq!(decode_cache.lent_blocks(), 0, "nothing lent by a refusal");
    drop(fork);
    // A position past the table's end is refused by name (not asked whether it is shared: an
    // index past the end), and a post refused before anything is posted (a notification that
    // poses as the acknowledgement) hands the table back whole, nothing withheld.
    let refused = decode
        .read_blocks(&registered, into, &[4], &peer, &remote[..PLANES], None)
        .expect_err("no block at position 4");
    assert!(
        matches!(
            refused.cause,
            NixlError::Position {
                position: 4,
                blocks: 4
            }
        ),
        "{:?}",
        refused.cause
    );
    let refused = decode
        .read_blocks(
            &registered,
            refused.into_token(),
            &positions,
            &peer,
            &remote,
            Some(b"memtoken/done/1"),
        )
        .expect_err("a notification that poses as the acknowledgement");
    assert!(
        matches!(refused.cause, NixlError::Reserved),
        "{:?}",
        refused.cause
    );
    let into = refused.into_token();
    assert_eq!(into.len(), 4, "handed back whole after a refused post");
    assert_eq!(
        decode_cache.lent_blocks(),
        0,
        "nothing withheld by a refused post"
    );

    let into = decode
        .read_blocks(&registered, into, &positions, &peer, &remote, None)
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    check_table(&into, 9)?;
    assert_eq!(
        registered.registered_groups(),
        into.ids()
            .iter()
            .map(|&b| b as usize / decode_cache.blocks_per_group())
            .collect::<std::collections::HashSet<_>>()
            .len(),
        "a registration per group the transfer used"
    );
    peer.done()?;
    drop(taken_back(offered));
    drop(into);
    drop(registered);
    drop((prefill_cache, decode_cache));
    drop((pb, db));
    drop((prefill, decode));
    assert!(pd.close().is_clean());
    assert!(dd.close().is_clean());
    Ok(())
}

/// A group's registrations go before the group is unmapped — by a replenish over the high
/// watermark, by a sleep — and a cache is registered once at a time (again once let go). A
/// cache with a block lent does not sleep; a block WRITE dropped unwaited lends its blocks no
/// more once its drop saw it done.
#[test]
fn a_groups_registrations_go_before_it_is_unmapped()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "kg");
    cache!(decode_cache, db, 8);
    cache!(prefill_cache, pb, 8);
    let (offered, offer) = decode
        .offer_table(&prefill.id(), scattered(&decode_cache, 4)?)
        .map_err(memtoken::Error::from)?;
    assert!(
        matches!(decode_cache.sleep(), Err(KvError::Lent { blocks: 4 })),
        "no sleep while a peer may write a block"
    );
    let peer = prefill.load(offer.as_bytes())?;
    let registered = prefill.register_cache(&prefill_cache)?;
    assert!(matches!(
        prefill.register_cache(&prefill_cache),
        Err(NixlError::CacheRegistered)
    ));
    let remote = peer.whole(0..4 * PLANES)?;
    let mut table = scattered(&prefill_cache, 4)?;
    fill_table(&mut table, 1)?;
    let table = prefill
        .write_blocks(&registered, table, &[0, 1, 2, 3], &peer, &remote, None)
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    let before = registered.registered_groups();
    assert!(
        before >= 2,
        "four blocks of eight span two groups: {before}"
    );

    // Every group with no live block is unmapped: its registrations went first.
    drop(table);
    prefill_cache.set_watermarks(0, 0);
    prefill_cache.replenish()?;
    assert_eq!(
        prefill_cache.mapped_groups(),
        1,
        "the null block's group stays"
    );
    assert!(
        registered.registered_groups() <= 1,
        "{} groups registered, one mapped",
        registered.registered_groups()
    );

    // A sleep unmaps every group: no registration stays.
    prefill_cache.set_watermarks(3, 64);
    prefill_cache.replenish()?;
    let table = scattered(&prefill_cache, 4)?;
    // Dropped, not waited for: its drop waits, and the WRITE done, its blocks are lent no more
    // (`BlockTransfer`'s drop emptied: they stayed lent, and the cache could not sleep).
    drop(
        prefill
            .write_blocks(&registered, table, &[0, 1, 2, 3], &peer, &remote, None)
            .map_err(memtoken::Error::from)?,
    );
    assert_eq!(prefill_cache.lent_blocks(), 0);
    assert!(registered.registered_groups() >= 2);
    prefill_cache.sleep()?;
    assert_eq!(registered.registered_groups(), 0);
    prefill_cache.wake()?;

    peer.done()?;
    drop(taken_back(offered));
    decode_cache.sleep()?;
    drop(registered);
    // A registration let go lets the cache be registered again.
    drop(prefill.register_cache(&prefill_cache)?);
    drop((prefill_cache, decode_cache));
    drop((pb, db));
    drop((prefill, decode));
    assert!(pd.close().is_clean());
    assert!(dd.close().is_clean());
    Ok(())
}

/// An offered table whose peer never said it was done is withheld as it drops: its blocks stay
/// lent, never handed out again; the cache does not sleep; dropped, it withholds its planes and
/// the device names the peer. A table with a shared block is never offered.
#[test]
fn an_offered_table_dropped_before_the_proof_is_withheld()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(g);
    let device = Device::new(g, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let offering = agent(&device, "offering-kv");
    cache!(cache, binding, 8);

    let table = scattered(&cache, 4)?;
    let fork = cache.fork(&table);
    let refused = offering
        .offer_table(&stranger("stray-kv"), table)
        .expect_err("a shared block is never offered");
    assert!(
        matches!(&refused.cause, NixlError::Kv(e) if matches!(**e, KvError::ReadOnly { position: 0 })),
        "{:?}",
        refused.cause
    );
    assert_eq!(cache.lent_blocks(), 0, "nothing lent by a refusal");
    drop(fork);
    let table = refused.into_token();
    let ids = table.ids().to_vec();

    let (offered, _never_loaded) = offering
        .offer_table(&stranger("stray-kv"), table)
        .map_err(memtoken::Error::from)?;
    let offered = match offered.take_back() {
        Err(e) => e.token,
        Ok(_) => panic!("taken back without a proof"),
    };
    drop(offered);
    assert_eq!(cache.lent_blocks(), 4, "withheld blocks stay lent");
    assert!(matches!(cache.sleep(), Err(KvError::Lent { blocks: 4 })));
    let mut later = cache.table();
    while cache.push(&mut later).is_ok() {}
    assert!(
        later.ids().iter().all(|b| !ids.contains(b)),
        "a withheld block was handed out again"
    );
    drop(later);
    drop(cache);
    let withheld = device.withheld_for_peers();
    assert!(!withheld.is_empty(), "the planes are withheld");
    assert!(
        withheld.iter().all(|w| w.peer == "stray-kv"),
        "{withheld:?}"
    );
    drop(binding);
    drop(offering);
    assert!(!device.close().is_clean(), "withheld memory stays counted");
    Ok(())
}

/// How a test lets a failed block transfer end.
#[derive(Clone, Copy, Debug)]
enum End {
    /// Polled until the failure shows, then `wait` (which hands no table back).
    PollThenWait,
    /// Polled until the failure shows, then dropped.
    PollThenDrop,
    /// `wait` alone: it sees the failure itself.
    Wait,
    /// Dropped in flight: the drop's wait sees the failure.
    Drop,
}

/// A READ into a table's blocks from a peer stopped before the post and killed after it (so
/// the READ cannot finish first) fails, however it ends (`end`): the table is never handed
/// back, its blocks stay lent (withheld), the cache does not sleep, and the peer cannot say it
/// is done; once a poll saw the failure, a second READ posted to the dead peer is refused by
/// NIXL's post, and its blocks stay lent too. `test` is the calling test's name (its child runs the peer).
fn a_failed_block_read_ends(
    test: &str,
    end: End,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const BIG: usize = 256 << 10;
    const BLOCKS: usize = 64;
    // Blocks of a second READ, posted after the first failed.
    const MORE: usize = 4;
    if let Some(socket) = parent() {
        return parked_target(socket, "target-kv", BIG * PLANES * BLOCKS);
    }
    parked_peer!(
        test,
        "initiator-kv",
        device,
        binding,
        initiator,
        peer,
        child
    );
    make_guard!(cache_guard);
    let cache = KvCache::new(
        cache_guard,
        &binding,
        &Layout::new(BLOCKS + MORE + 1, 16).plane(BIG).plane(BIG),
    )?;
    cache.set_watermarks(BLOCKS + MORE + 1, BLOCKS + MORE + 1);
    cache.replenish()?;
    let registered = initiator.register_cache(&cache)?;
    let mut table = cache.table();
    for _ in 0..BLOCKS {
        cache.push(&mut table)?;
    }
    let remote = (0..BLOCKS * PLANES)
        .map(|i| peer.range(0, i * BIG, BIG))
        .collect::<Result<Vec<_>, _>>()?;
    let positions: Vec<usize> = (0..BLOCKS).collect();
    let mut child = stop(child);
    let mut read = initiator
        .read_blocks(&registered, table, &positions, &peer, &remote, None)
        .map_err(memtoken::Error::from)?;
    child.0.kill()?;
    child.0.wait()?;
    if matches!(end, End::PollThenWait | End::PollThenDrop) {
        let mut polled = Ok(false);
        for _ in 0..POLLS {
            polled = read.poll();
            if !matches!(polled, Ok(false)) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(polled.is_err(), "the READ did not fail: {polled:?}");
    }
    match end {
        End::PollThenWait | End::Wait => assert!(
            read.wait(DROP_WAIT).is_err(),
            "a wait of a failed READ hands no table back ({end:?})"
        ),
        End::PollThenDrop | End::Drop => drop(read),
    }
    assert_eq!(
        cache.lent_blocks(),
        BLOCKS,
        "the table's blocks are withheld ({end:?})"
    );
    assert!(matches!(cache.sleep(), Err(KvError::Lent { .. })));
    assert!(registered.is_poisoned());
    // After a poll saw the READ fail (its UCX endpoint is marked failed then; a wait that
    // timed out first would not tell), a READ posted to the dead peer: NIXL refuses the post
    // itself, after memtoken counted the READ in flight. What the refused post may have
    // started keeps its blocks: they stay lent and the error hands back an empty table. Fails
    // if such a refusal is taken for one before the post (`>` → `<` in `Agent::blocks`: the
    // table handed back whole, its blocks no longer lent).
    if matches!(end, End::PollThenWait | End::PollThenDrop) {
        let mut more = cache.table();
        for _ in 0..MORE {
            cache.push(&mut more)?;
        }
        let positions: Vec<usize> = (0..MORE).collect();
        let refused = match initiator.read_blocks(
            &registered,
            more,
            &positions,
            &peer,
            &remote[..MORE * PLANES],
            None,
        ) {
            Ok(_) => panic!("a READ from a dead peer was posted ({end:?})"),
            Err(refused) => refused,
        };
        assert!(
            matches!(
                refused.cause,
                NixlError::Engine {
                    call: "postXferReq",
                    ..
                }
            ),
            "{} ({end:?})",
            refused.cause
        );
        assert!(
            refused.token.is_empty(),
            "the refused post's table came back ({end:?})"
        );
        assert_eq!(
            cache.lent_blocks(),
            BLOCKS + MORE,
            "its blocks stay lent ({end:?})"
        );
    }
    assert!(matches!(peer.done(), Err(NixlError::Tainted(_))));
    Ok(())
}

/// [`a_failed_block_read_ends`], polled until it fails, then waited for.
#[test]
fn a_failed_block_transfer_never_hands_its_table_back()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_failed_block_read_ends(
        "blocks::a_failed_block_transfer_never_hands_its_table_back",
        End::PollThenWait,
    )
}

/// [`a_failed_block_read_ends`], polled until it fails, then dropped. Fails if the poll does
/// not remember the failure (the drop handed the table back to the cache: a mutant of the NIXL
/// run, `|=` → `&=` in `BlockTransfer::poll`).
#[test]
fn a_block_transfer_dropped_after_a_failed_poll_keeps_its_table()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_failed_block_read_ends(
        "blocks::a_block_transfer_dropped_after_a_failed_poll_keeps_its_table",
        End::PollThenDrop,
    )
}

/// [`a_failed_block_read_ends`], waited for alone. Fails if the wait does not remember the
/// failure it saw (`|=` → `&=` in `BlockTransfer::wait`).
#[test]
fn a_block_transfer_whose_wait_fails_keeps_its_table()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_failed_block_read_ends(
        "blocks::a_block_transfer_whose_wait_fails_keeps_its_table",
        End::Wait,
    )
}

/// [`a_failed_block_read_ends`], dropped in flight. Fails if the drop does not remember the
/// failure its wait saw (`|=` → `&=` in `BlockTransfer`'s drop).
#[test]
fn a_block_transfer_dropped_in_flight_after_its_peer_died_keeps_its_table()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_failed_block_read_ends(
        "blocks::a_block_transfer_dropped_in_flight_after_its_peer_died_keeps_its_table",
        End::Drop,
    )
}

/// From the review: a registered cache poisoned by a transfer that did not finish still lets a
/// group's registrations go before the cache unmaps it — only what the cache holds as it drops
/// stays registered (a group with the transfer's withheld blocks is never unmapped). Fails if a
/// poisoned registration takes the watch away (an idle group unmapped under NIXL's registration).
#[test]
fn a_poisoned_registration_still_lets_a_group_go_before_it_is_unmapped()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const BIG: usize = 1 << 20;
    two_sides_over_tcp!(pd, pb, prefill, dd, db, decode, "kp");
    let _ = (&pd, &dd);
    let mut target = decode.register(db.reserve(4 * BIG)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut target])?;
    let peer = prefill.load(offer.as_bytes())?;
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &pb, &Layout::new(16, 16).plane(BIG))?;
    assert_eq!(cache.blocks_per_group(), 1);
    cache.set_watermarks(12, 64);
    cache.replenish()?;
    let (mut a, mut b) = (cache.table(), cache.table());
    cache.push(&mut a)?;
    cache.push(&mut b)?;
    let span = (cache.block_addr(0, b.ids()[0]), BIG);
    let first = (cache.block_addr(0, a.ids()[0]), BIG);
    let registered = prefill.register_cache(&cache)?;
    let remote = [peer.range(0, 0, BIG)?];
    let b = prefill
        .write_blocks(&registered, b, &[0], &peer, &remote, None)
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    assert!(prefill.holds_registration(span.0, span.1), "b's group");
    // A WRITE forgotten in flight poisons the registration; one the engine finished within
    // its post does not: another block, until one is still in flight.
    let mut a = Some(a);
    for _ in 0..6 {
        let table = match a.take() {
            Some(table) => table,
            None => {
                let mut table = cache.table();
                cache.push(&mut table)?;
                table
            }
        };
        let forgotten = prefill
            .write_blocks(&registered, table, &[0], &peer, &remote, None)
            .map_err(memtoken::Error::from)?;
        std::mem::forget(forgotten);
        if registered.is_poisoned() {
            break;
        }
    }
    assert!(registered.is_poisoned(), "no WRITE was still in flight");
    drop(registered);
    assert!(matches!(
        prefill.register_cache(&cache),
        Err(NixlError::CacheRegistered)
    ));
    drop(b);
    let before = cache.mapped_groups();
    cache.set_watermarks(0, 0);
    cache.replenish()?;
    assert!(cache.mapped_groups() < before, "b's group was unmapped");
    assert!(
        !prefill.holds_registration(span.0, span.1),
        "b's group was unmapped while NIXL still held its registration"
    );
    // The cache drops with blocks lent: its planes are withheld, and what is registered over
    // them (the forgotten WRITE's block among it) stays registered for good.
    drop(a);
    drop(cache);
    assert!(
        prefill.holds_registration(first.0, first.1),
        "a group under a forgotten WRITE was deregistered"
    );
    std::thread::sleep(std::time::Duration::from_millis(200)); // let the leaked WRITE land
    Ok(())
}

/// A registration forgotten (`mem::forget`) with nothing lent: the cache lets its groups'
/// registrations go with its planes as it drops — none is left over memory given back.
#[test]
fn a_forgotten_registration_goes_with_the_caches_planes()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "kf");
    let _ = (&pd, &dd);
    cache!(decode_cache, db, 4);
    cache!(prefill_cache, pb, 4);
    let (offered, offer) = decode
        .offer_table(&prefill.id(), scattered(&decode_cache, 2)?)
        .map_err(memtoken::Error::from)?;
    let peer = prefill.load(offer.as_bytes())?;
    let registered = prefill.register_cache(&prefill_cache)?;
    let table = scattered(&prefill_cache, 2)?;
    // The first block's group in plane 0: where the cache registered it.
    let per_group = prefill_cache.blocks_per_group();
    let group_bytes = per_group * prefill_cache.stride(0);
    let group = table.ids()[0] as usize / per_group;
    let span = (prefill_cache.base(0) + group * group_bytes, group_bytes);
    let table = prefill
        .write_blocks(
            &registered,
            table,
            &[0, 1],
            &peer,
            &peer.whole(0..2 * PLANES)?,
            None,
        )
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    assert!(
        prefill.holds_registration(span.0, span.1),
        "the group is registered"
    );
    drop(table);
    std::mem::forget(registered);
    peer.done()?;
    drop(taken_back(offered));
    drop(prefill_cache);
    assert!(
        !prefill.holds_registration(span.0, span.1),
        "a registration outlived the cache's planes"
    );
    Ok(())
}
