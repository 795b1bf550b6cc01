//! Feature `nixl`: a block table offered to a peer moves into the offer, which lends nothing —
//! no byte of a block the peer may write is read until the peer's proof hands the table back.
use memtoken::backend::HostBackend;
use memtoken::kv::{KvCache, Layout};
use memtoken::nixl::Agent;
use memtoken::{make_guard, Budget, Device};

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let agent = Agent::new(&device, "decode")?;
    let prefill = agent.id();
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &Layout::new(64, 16).plane(4096))?;
    cache.replenish()?;
    let mut table = cache.table();
    cache.push(&mut table)?;
    let (offered, _metadata) = agent.offer_table(&prefill, table).map_err(memtoken::Error::from)?;
    let mut bytes = [0; 16];
    table.read(0, 0, 0, &mut bytes)?; // error: `table` moved into the offer
    drop(offered);
    Ok(())
}
