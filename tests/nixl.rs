//! Feature `nixl` (issue 26): typed NIXL transfers over UCX on the loopback, between two agents
//! in one process and in two (this binary re-run as the peer). Needs NIXL's library:
//! `scripts/install-nixl.sh`, then `source target/nixl/env.sh`; without it every test fails
//! with that instruction (never skips). Run with `--test-threads=1`: NIXL may deadlock when its
//! agents are made on several threads at once.

use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, DROP_WAIT, NixlError};
use memtoken::{Budget, Device, make_guard};

const LEN: usize = 1 << 21;

/// The byte at `i` of a request's K/V: every byte differs from its neighbours.
fn pattern(seed: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8
}

fn fill(bytes: &mut [u8], seed: u8) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(seed, i);
    }
}

fn check(bytes: &[u8], seed: u8) {
    let bad = bytes
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(seed, i))
        .count();
    assert_eq!(bad, 0, "{bad} of {} bytes differ", bytes.len());
}

/// An agent, or the instruction that makes one possible.
fn agent<'d, 'id>(device: &'d Device<'id, HostBackend>, name: &str) -> Agent<'d, 'id, HostBackend> {
    match Agent::new(device, name) {
        Ok(agent) => agent,
        Err(e) => panic!("{e}"),
    }
}

/// A WRITE of a token's memory from one agent into another's, then a notification after the
/// bytes; the target cannot look at its memory until the initiator is done (the peer could
/// still write it), then sees every byte; both give their tokens back and both ledgers end at
/// zero.
#[test]
fn a_write_lands_byte_for_byte_with_its_notification()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(gp);
    let prefill_device = Device::new(gp, HostBackend::with_defaults()?);
    make_guard!(gd);
    let decode_device = Device::new(gd, HostBackend::with_defaults()?);
    let (pb, db) = (
        prefill_device.bind(Budget::unlimited())?,
        decode_device.bind(Budget::unlimited())?,
    );
    let prefill = agent(&prefill_device, "prefill-w");
    let decode = agent(&decode_device, "decode-w");

    let mut kv = pb.reserve(LEN)?.commit()?;
    fill(kv.as_mut_slice(), 3);
    let source = prefill.register(kv)?;
    let mut target = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer("prefill-w", &mut [&mut target])?;

    let peer = prefill.load(offer.as_bytes())?;
    assert_eq!(peer.name(), "decode-w");
    let write = prefill.write(
        &source,
        &[(0, LEN / 2), (LEN / 2, LEN / 2)],
        &peer,
        &[peer.range(0, 0, LEN / 2)?, peer.range(0, LEN / 2, LEN / 2)?],
        Some(b"kv-ready"),
    )?;
    assert_eq!(write.bytes(), LEN);
    write.wait(DROP_WAIT)?;

    let seen = wait_for_notification(&decode);
    assert_eq!(seen.from, "prefill-w");
    assert_eq!(seen.message, b"kv-ready");
    match target.token() {
        Err(NixlError::Exposed { peers, poisoned }) => {
            assert_eq!(peers, ["prefill-w"]);
            assert!(!poisoned);
        }
        other => panic!("the peer may still write: no token lent, got {other:?}"),
    }
    peer.done()?;
    wait_until(|| target.token().is_ok());
    check(target.token()?.as_slice(), 3);

    drop(target.release()?);
    drop(source.release()?);
    assert!(decode_device.withheld_for_peers().is_empty());
    drop((db, pb));
    drop((decode, prefill));
    assert!(decode_device.close().is_clean());
    assert!(prefill_device.close().is_clean());
    Ok(())
}

/// Waits (up to DROP_WAIT) for one notification on `agent`.
fn wait_for_notification(agent: &Agent<'_, '_, HostBackend>) -> memtoken::nixl::Notification {
    let start = std::time::Instant::now();
    loop {
        let mut got = agent.notifications().expect("notifications");
        if let Some(n) = got.pop() {
            assert!(got.is_empty(), "one notification: {got:?}");
            return n;
        }
        assert!(start.elapsed() < DROP_WAIT, "no notification arrived");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn wait_until(mut ready: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !ready() {
        assert!(start.elapsed() < DROP_WAIT, "not within {DROP_WAIT:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
