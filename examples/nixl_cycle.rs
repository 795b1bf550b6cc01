//! The cost of a typed NIXL transfer against nixl-sys used directly (feature `nixl`): two
//! agents in one process, a 64 KiB WRITE from one to the other, over and over — through
//! `memtoken::nixl` (`typed`), or through nixl-sys's own calls on the same kind of memory
//! (`raw`). Each run prints the microseconds per transfer of its timed transfers (after as many
//! warm-up transfers): run both as separate processes, alternating, for a paired run; or count
//! instructions with callgrind, collection toggled on the cycle functions.
//!
//! ```text
//! bash scripts/install-nixl.sh && source target/nixl/env.sh
//! cargo build --release --features nixl --example nixl_cycle
//! valgrind --tool=callgrind --toggle-collect='nixl_cycle::cycles_*' \
//!     target/release/examples/nixl_cycle typed 2000
//! valgrind --tool=callgrind --toggle-collect='nixl_cycle::cycles_*' \
//!     target/release/examples/nixl_cycle raw 2000
//! ```

#[path = "common/cli.rs"]
mod cli;

use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, DROP_WAIT, Peer, Registered};
use memtoken::{Budget, Committed, Device, make_guard};
use nixl_sys::{MemType, XferDescList, XferOp, XferStatus};
use std::time::Instant;

/// The bytes of each transfer.
const BYTES: usize = 64 << 10;

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "\
usage: nixl_cycle [MODE] [TRANSFERS]

A 64 KiB WRITE between two NIXL agents in one process, TRANSFERS times (after as many warm-up
transfers), for paired timing runs and instruction counts (see the top of
examples/nixl_cycle.rs); prints the microseconds per transfer. Needs feature `nixl`.

  MODE         typed (through memtoken::nixl, the default) or raw (nixl-sys's own calls)
  TRANSFERS    a whole number (default 2000)
  -h, --help   print this usage";

#[inline(never)]
fn cycles_typed<'id>(
    agent: &Agent<'_, 'id, HostBackend>,
    source: &Registered<'_, '_, 'id, HostBackend, Committed>,
    peer: &Peer<'_, '_, 'id, HostBackend>,
    n: u64,
) -> Result<(), Error> {
    let remote = [peer.range(0, 0, BYTES)?];
    for _ in 0..n {
        agent
            .write(source, &[(0, BYTES)], peer, &remote, None)?
            .wait(DROP_WAIT)?;
    }
    Ok(())
}

#[inline(never)]
fn cycles_raw(
    agent: &nixl_sys::Agent,
    from: usize,
    to: usize,
    peer: &str,
    n: u64,
) -> Result<(), Error> {
    for _ in 0..n {
        let mut mine = XferDescList::new(MemType::Dram)?;
        mine.add_desc(from, BYTES, 0);
        let mut theirs = XferDescList::new(MemType::Dram)?;
        theirs.add_desc(to, BYTES, 0);
        let req = agent.create_xfer_req(XferOp::Write, &mine, &theirs, peer, None)?;
        if agent.post_xfer_req(&req, None)? {
            while agent.get_xfer_status(&req)? == XferStatus::InProgress {
                std::hint::spin_loop();
            }
        }
    }
    Ok(())
}

/// A memory region nixl-sys registers: the same host memory as the typed side's, a token's.
#[derive(Debug)]
struct Buffer(usize);

impl nixl_sys::MemoryRegion for Buffer {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0 as *const u8
    }

    fn size(&self) -> usize {
        BYTES
    }
}

impl nixl_sys::NixlDescriptor for Buffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

fn typed(n: u64) -> Result<f64, Error> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let a = Agent::new(&device, "cycle-a")?;
    let b = Agent::new(&device, "cycle-b")?;
    let mut kv = binding.reserve(BYTES)?.commit()?;
    kv.as_mut_slice().fill(5);
    let source = a.register(kv)?;
    let mut target = b.register(binding.reserve(BYTES)?.commit()?)?;
    let offer = b.offer(&a.id(), &mut [&mut target])?;
    let peer = a.load(offer.as_bytes())?;
    cycles_typed(&a, &source, &peer, n)?; // warm-up
    let start = Instant::now();
    cycles_typed(&a, &source, &peer, n)?;
    let per = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    peer.done()?;
    let start = Instant::now();
    while target.token().is_err() {
        assert!(start.elapsed() < DROP_WAIT, "no acknowledgement");
        std::thread::yield_now();
    }
    assert!(target.token()?.as_slice().iter().all(|&b| b == 5));
    drop(target.release()?);
    drop(source.release()?);
    Ok(per)
}

fn raw(n: u64) -> Result<f64, Error> {
    let agent = |name: &str| -> Result<(nixl_sys::Agent, nixl_sys::Backend), Error> {
        let agent = nixl_sys::Agent::new(name)?;
        let (_mems, params) = agent.get_plugin_params("UCX")?;
        let backend = agent.create_backend("UCX", &params)?;
        Ok((agent, backend))
    };
    let (a, _ua) = agent("cycle-raw-a")?;
    let (b, _ub) = agent("cycle-raw-b")?;
    // The same kind of memory as the typed side's: host tokens (only their addresses are used).
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let mut kv = binding.reserve(BYTES)?.commit()?;
    kv.as_mut_slice().fill(5);
    let target = binding.reserve(BYTES)?.commit()?;
    let (f, t) = (kv.addr(), target.addr());
    let _rf = a.register_memory(&Buffer(f), None)?;
    let _rt = b.register_memory(&Buffer(t), None)?;
    let md = b.get_local_md()?;
    let peer = a.load_remote_md(&md)?;
    cycles_raw(&a, f, t, &peer, n)?; // warm-up
    let start = Instant::now();
    cycles_raw(&a, f, t, &peer, n)?;
    let per = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    assert!(target.as_slice().iter().all(|&b| b == 5));
    Ok(per)
}

fn main() -> std::process::ExitCode {
    let (which, n) = cli::mode_and_count(USAGE, &["typed", "raw"], "TRANSFERS", ("typed", 2000));
    cli::exit(run(which, n))
}

fn run(which: &str, n: u64) -> Result<(), Error> {
    let per = match which {
        "typed" => typed(n)?,
        "raw" => raw(n)?,
        _ => unreachable!("a mode of the command line"),
    };
    println!("{which}: {n} WRITEs of {BYTES} bytes, {per:.3} us per transfer");
    Ok(())
}
