//! Feature `nixl`: a registration under an in-flight transfer cannot be released (nor its
//! token taken back): the transfer borrows it until it is done.
use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, DROP_WAIT};
use memtoken::{make_guard, Budget, Device};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let agent = Agent::new(&device, "a")?;
    let peer = agent.load(&[])?;
    let source = agent.register(binding.reserve(4096)?.commit()?)?;
    let write = agent.write(&source, &[(0, 4096)], &peer, &[peer.range(0, 0, 4096)?], None)?;
    let token = source.release()?; // error: `source` is borrowed by the transfer
    write.wait(DROP_WAIT)?;
    drop(token);
    Ok(())
}
