//! What a refused load leaves loaded in NIXL (its own record of remote metadata, which the
//! public API does not show). NIXL installed (`scripts/install-nixl.sh`), on one thread as CI
//! runs them: `cargo test --features nixl --lib nixl:: -- --test-threads=1`.

use super::{Agent, NixlError, PeerMetadata};
use crate::backend::HostBackend;
use crate::{Budget, Device, make_guard, nixl_wire};
use std::time::Duration;

const LEN: usize = 64 << 10;

/// `offer` with its connection information or its regions' descriptors replaced by `conn` or
/// `md` (another agent's).
fn spliced(offer: &PeerMetadata, conn: Option<&[u8]>, md: Option<&[u8]>) -> Vec<u8> {
    let a = nixl_wire::decode(offer.as_bytes()).unwrap();
    nixl_wire::encode(
        [a.epoch, a.instance, a.for_instance, a.mailbox],
        &a.regions,
        [
            a.offered_to,
            a.offered_by,
            conn.unwrap_or(a.conn),
            md.unwrap_or(a.md),
            a.mailbox_md,
        ],
    )
}

/// An offer of `by` whose connection information or descriptors are a third agent's is
/// refused, and what its load put in NIXL is invalidated again — unless a live `Peer` of the
/// third agent uses it: then it stays, and the `Peer` still transfers. The third agent's part
/// is its offer's (descriptors without connection information, which NIXL itself refuses,
/// `NotFound`, while the agent's connection is not loaded) or its whole metadata (which loads).
/// Fails if a refused load leaves any agent's metadata loaded (the whole-metadata case, found
/// by review, did), or invalidates a live Peer's.
#[test]
fn a_refused_load_leaves_loaded_only_what_a_live_peer_uses()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let loader = Agent::new(&device, "loader-u")?;
    let by = Agent::new(&device, "by-u")?;
    let third = Agent::new(&device, "third-u")?;
    let mut offered = by.register(binding.reserve(LEN)?.commit()?)?;
    let mut theirs = third.register(binding.reserve(LEN)?.commit()?)?;
    let offer = by.offer(&loader.id(), &mut [&mut offered])?;
    let other = third.offer(&loader.id(), &mut [&mut theirs])?;
    let other = nixl_wire::decode(other.as_bytes()).unwrap();
    let whole = third.raw.get_local_md()?;
    let loaded = |name| loader.raw.check_remote_metadata(name, None);
    let refused = |conn, md| match loader.load(&spliced(&offer, conn, md)) {
        Err(e) => e,
        Ok(_) => panic!("a spliced offer loaded"),
    };
    let another_conn = "its connection information is another agent's";
    let two_agents = "its two parts name different agents";

    let e = refused(Some(other.conn), None);
    assert!(matches!(e, NixlError::Wire(w) if w == another_conn), "{e}");
    assert!(!loaded("by-u") && !loaded("third-u"), "conn part");
    let e = refused(None, Some(other.md));
    assert!(matches!(e, NixlError::Engine { .. }), "{e}");
    assert!(!loaded("by-u") && !loaded("third-u"), "descriptors");
    let e = refused(None, Some(&whole));
    assert!(matches!(e, NixlError::Wire(w) if w == two_agents), "{e}");
    assert!(!loaded("by-u") && !loaded("third-u"), "whole metadata");

    let other_offer = third.offer(&loader.id(), &mut [&mut theirs])?;
    let peer = loader.load(other_offer.as_bytes())?;
    let e = refused(Some(other.conn), None);
    assert!(matches!(e, NixlError::Wire(w) if w == another_conn), "{e}");
    assert!(loaded("third-u") && !loaded("by-u"), "conn part, live");
    let e = refused(None, Some(other.md));
    assert!(matches!(e, NixlError::Wire(w) if w == two_agents), "{e}");
    assert!(loaded("third-u") && !loaded("by-u"), "descriptors, live");
    let source = loader.register(binding.reserve(LEN)?.commit()?)?;
    loader
        .write(&source, &[(0, 64)], &peer, &[peer.range(0, 0, 64)?], None)?
        .wait(Duration::from_secs(10))?;
    peer.done()?;
    assert!(!loaded("third-u"), "done");
    // The offer of `by` itself still loads: the refusals left its record free.
    loader.load(offer.as_bytes())?.done()?;
    drop(source.release()?);
    Ok(())
}
