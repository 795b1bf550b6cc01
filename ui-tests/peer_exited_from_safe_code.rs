//! Feature `nixl`: `Agent::peer_exited` takes the caller's word that the process is the peer's,
//! local, and that none of its writes lands after its end: safe code cannot give it.
use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, AgentId};
use memtoken::{make_guard, Device};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let agent = Agent::new(&device, "a")?;
    let peer = AgentId::from_bytes(&[0; 9])?;
    let mut child = std::process::Command::new("true").spawn()?; // not the peer
    agent.peer_exited(&peer, &mut child)?; // error: a call to an unsafe fn needs `unsafe`
    Ok(())
}
