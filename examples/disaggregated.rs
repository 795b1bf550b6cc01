//! Disaggregated prefill and decode over NIXL (feature `nixl`), in two processes on the
//! loopback: the decode process offers a landing region for the K/V of its requests; the
//! prefill process (this program again) computes each prompt's K/V into pages of its page pool
//! and WRITEs the pages into the request's slot, with a notification per request; then it says
//! it is done with decode's memory. Decode waits for every request, checks every byte once
//! prefill is done, and reports the bytes moved and the rate; both ledgers end at zero.
//!
//! ```text
//! bash scripts/install-nixl.sh && source target/nixl/env.sh
//! cargo run --release --features nixl --example disaggregated -- --requests 16 --pages 32
//! ```
//!
//! `--prefill SOCKET` is how decode starts the prefill process; `--help` prints the usage.

#[path = "common/cli.rs"]
mod cli;

use cli::Arg;
use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, AgentId, DROP_WAIT};
use memtoken::{Budget, Device, PagePool, make_guard};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// The bytes of a page of K/V.
const PAGE: usize = 64 << 10;

/// The K/V byte at `at` of request `request`'s prompt (what prefill computes).
fn kv_byte(request: usize, at: usize) -> u8 {
    (at as u8).wrapping_mul(29).wrapping_add(request as u8) ^ (at >> 10) as u8
}

fn send(to: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    to.write_all(&(bytes.len() as u32).to_le_bytes())?;
    to.write_all(bytes)?;
    to.flush()
}

fn recv(from: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0; 4];
    from.read_exact(&mut len)?;
    let mut bytes = vec![0; u32::from_le_bytes(len) as usize];
    from.read_exact(&mut bytes)?;
    Ok(bytes)
}

struct Shape {
    requests: usize,
    pages: usize,
}

impl Shape {
    fn slot(&self) -> usize {
        self.pages * PAGE
    }

    fn bytes(&self) -> usize {
        self.requests * self.slot()
    }
}

/// The prefill process: K/V into pool pages, WRITTEN into decode's slots.
fn prefill(socket: &str, shape: &Shape) -> Result<(), Error> {
    let mut socket = UnixStream::connect(socket)?;
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    make_guard!(pool_guard);
    let pool = PagePool::new(pool_guard, &binding, PAGE)?;
    let agent = Agent::new(&device, "prefill")?;
    send(&mut socket, &agent.id().to_bytes())?; // whom decode makes its offer to
    let offer = recv(&mut socket)?;
    let peer = agent.load(&offer)?;
    let registered = agent.register_pool(&pool)?;
    let positions: Vec<usize> = (0..shape.pages).collect();
    let mut moving = Duration::ZERO;
    for request in 0..shape.requests {
        let mut table = pool.table();
        for page in 0..shape.pages {
            pool.push(&mut table)?;
            for (i, b) in table.page_mut(page).iter_mut().enumerate() {
                *b = kv_byte(request, page * PAGE + i);
            }
        }
        let remote = (0..shape.pages)
            .map(|page| peer.range(0, request * shape.slot() + page * PAGE, PAGE))
            .collect::<Result<Vec<_>, _>>()?;
        let note = format!("kv {request}");
        let start = Instant::now();
        let table = agent
            .write_pages(
                &registered,
                table,
                &positions,
                &peer,
                &remote,
                Some(note.as_bytes()),
            )
            .map_err(memtoken::Error::from)?
            .wait(DROP_WAIT)?;
        moving += start.elapsed();
        drop(table); // the request's pages go back to the pool
    }
    peer.done()?; // decode's memory: invalidated, then acknowledged
    drop(registered);
    drop(pool);
    drop(binding);
    drop(agent);
    let report = device.close();
    if !report.is_clean() {
        return Err(format!("prefill's device did not close clean: {report:?}").into());
    }
    send(&mut socket, &moving.as_nanos().to_le_bytes())?;
    Ok(())
}

/// The decode process: offers the slots, spawns prefill, checks what lands.
fn decode(shape: &Shape) -> Result<(), Error> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let agent = Agent::new(&device, "decode")?;
    let mut slots = agent.register(binding.reserve(shape.bytes())?.commit()?)?;

    let path = std::env::temp_dir().join(format!("memtoken-disagg-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--prefill",
            path.to_str().ok_or("a temp path that is UTF-8")?,
        ])
        .args(["--requests", &shape.requests.to_string()])
        .args(["--pages", &shape.pages.to_string()])
        .spawn()?;
    let (mut socket, _) = listener.accept()?;
    let _ = std::fs::remove_file(&path);
    let prefill = AgentId::from_bytes(&recv(&mut socket)?)?;
    let offer = agent.offer(&prefill, &mut [&mut slots])?;
    send(&mut socket, offer.as_bytes())?;

    let mut arrived = vec![false; shape.requests];
    let start = Instant::now();
    while arrived.iter().any(|a| !a) {
        for n in agent.notifications()? {
            let text = String::from_utf8_lossy(&n.message);
            let request: usize = text
                .strip_prefix("kv ")
                .and_then(|r| r.parse().ok())
                .ok_or_else(|| format!("an unexpected notification: {text}"))?;
            arrived[request] = true;
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err("not every request arrived within a minute".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    let moving = u128::from_le_bytes(recv(&mut socket)?.try_into().map_err(|_| "a time")?);
    if !child.wait()?.success() {
        return Err("the prefill process failed".into());
    }
    // Prefill said it is done before it reported: its acknowledgement is on its way.
    let start = Instant::now();
    while slots.token().is_err() && start.elapsed() < DROP_WAIT {
        std::thread::sleep(Duration::from_micros(100));
    }
    let bytes = slots.token()?.as_slice();
    let bad = bytes
        .iter()
        .enumerate()
        .filter(|&(at, &b)| b != kv_byte(at / shape.slot(), at % shape.slot()))
        .count();
    if bad > 0 {
        return Err(format!("{bad} of {} bytes differ", bytes.len()).into());
    }
    drop(slots.release()?);
    drop(binding);
    drop(agent);
    let report = device.close();
    if !report.is_clean() {
        return Err(format!("decode's device did not close clean: {report:?}").into());
    }
    let secs = moving as f64 / 1e9;
    let mib = shape.bytes() as f64 / (1 << 20) as f64;
    println!(
        "decode: {} requests of {} pages of {} KiB each, {mib:.1} MiB moved by WRITEs of pool pages \
         in {:.1} ms ({:.2} GiB/s); every byte checked; both ledgers at zero",
        shape.requests,
        shape.pages,
        PAGE >> 10,
        secs * 1e3,
        mib / 1024.0 / secs
    );
    Ok(())
}

const USAGE: &str = "\
usage: disaggregated [--requests N] [--pages N]

Disaggregated prefill and decode over NIXL, in two processes on the loopback
(cargo run --release --features nixl --example disaggregated -- ARGS).

  --requests N       requests whose K/V prefill writes into decode's slots (default 16)
  --pages N          pages of 64 KiB per request (default 32)
  --prefill SOCKET   (how decode starts this program as its prefill process)
  -h, --help         print this usage";

fn main() -> std::process::ExitCode {
    let mut shape = Shape {
        requests: 16,
        pages: 32,
    };
    let mut prefill_at: Option<String> = None;
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        let Arg::Flag(flag) = arg else {
            cli.unknown(arg)
        };
        match flag.as_str() {
            "--requests" => shape.requests = cli.value(&flag),
            "--pages" => shape.pages = cli.value(&flag),
            "--prefill" => prefill_at = Some(cli.value(&flag)),
            _ => cli.unknown(Arg::Flag(flag)),
        }
    }
    for (flag, n) in [("--requests", shape.requests), ("--pages", shape.pages)] {
        if n == 0 {
            cli.error(format_args!("{flag} must be at least 1"));
        }
    }
    cli::exit(match prefill_at {
        Some(socket) => prefill(&socket, &shape),
        None => decode(&shape),
    })
}
