//! Feature `nixl`: only a committed allocation is offered to peers — a shared prefix's bytes
//! are read by its sharers through `&[u8]`, which a peer's write would change under them.
use memtoken::backend::HostBackend;
use memtoken::nixl::Agent;
use memtoken::{make_guard, Budget, Device};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let agent = Agent::new(&device, "a")?;
    let prefix = binding.reserve(device.granularity())?.commit_prefix()?;
    let mut registered = agent.register(prefix)?;
    let _offer = agent.offer(&agent.id(), &mut [&mut registered])?; // error: not `Offered`
    Ok(())
}
