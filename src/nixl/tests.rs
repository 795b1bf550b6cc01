//! What a refused load leaves loaded in NIXL (its own record of remote metadata, which the
//! public API does not show). NIXL installed (`scripts/install-nixl.sh`), on one thread as CI
//! runs them: `cargo test --features nixl --lib nixl:: -- --test-threads=1`.

use super::{Agent, NixlError, PeerMetadata};
use crate::backend::HostBackend;
use crate::{Budget, Device, make_guard, nixl_wire};
use std::time::Duration;

const LEN: usize = 64 << 10;

/// `offer` with its connection information (`conn`) or else its regions' descriptors taken
/// from `other`, another agent's offer to the same loader.
fn spliced(offer: &PeerMetadata, other: &PeerMetadata, conn: bool) -> Vec<u8> {
    let (a, b) = (
        nixl_wire::decode(offer.as_bytes()).unwrap(),
        nixl_wire::decode(other.as_bytes()).unwrap(),
    );
    let (c, md) = if conn { (b.conn, a.md) } else { (a.conn, b.md) };
    nixl_wire::encode(
        [a.epoch, a.instance, a.for_instance, a.mailbox],
        &a.regions,
        [a.offered_to, a.offered_by, c, md, a.mailbox_md],
    )
}

/// An offer of `by` whose connection information or descriptors are a third agent's is
/// refused, and what its load put in NIXL is invalidated again — unless a live `Peer` of the
/// third agent uses it: then it stays, and the `Peer` still transfers. (Descriptors of an agent
/// whose connection information is not loaded are refused by NIXL itself, `NotFound`: only a
/// live Peer's agent can have them loaded by a spliced offer.) Fails if a refused load leaves
/// any agent's metadata loaded, or invalidates a live Peer's.
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
    let loaded = |name| loader.raw.check_remote_metadata(name, None);
    let refused = |conn| match loader.load(&spliced(&offer, &other, conn)) {
        Err(e) => e,
        Ok(_) => panic!("a spliced offer (conn: {conn}) loaded"),
    };
    let e = refused(true);
    assert!(
        matches!(
            e,
            NixlError::Wire("its connection information is another agent's")
        ),
        "{e}"
    );
    assert!(!loaded("by-u") && !loaded("third-u"), "conn part");
    let e = refused(false);
    assert!(matches!(e, NixlError::Engine { .. }), "{e}");
    assert!(!loaded("by-u") && !loaded("third-u"), "descriptors");

    let peer = loader.load(other.as_bytes())?;
    let e = refused(true);
    assert!(matches!(e, NixlError::Wire(_)), "{e}");
    assert!(loaded("third-u") && !loaded("by-u"), "conn part, live");
    let e = refused(false);
    assert!(
        matches!(e, NixlError::Wire("its two parts name different agents")),
        "{e}"
    );
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
