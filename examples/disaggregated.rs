//! Disaggregated prefill and decode over NIXL (feature `nixl`), in two processes on the
//! loopback, on KV block ids: the decode process takes a table of blocks of its KV cache for
//! each request and offers it to the prefill process (this program again) — only those
//! blocks, each layer's K and V planes; prefill computes each prompt's K/V into blocks of its
//! own KV cache and WRITEs them by id into the request's offered table, with a notification
//! per request; then it says it is done with decode's memory. Decode's offered tables lend
//! nothing until then: it takes each table back after prefill's proof, reads every byte of
//! every plane of every block, and reports the bytes moved and the rate; both ledgers end at
//! zero.
//!
//! ```text
//! bash scripts/install-nixl.sh && source target/nixl/env.sh
//! cargo run --release --features nixl --example disaggregated -- --requests 16 --blocks 16
//! ```
//!
//! `--prefill SOCKET` is how decode starts the prefill process; `--help` prints the usage.

#[path = "common/cli.rs"]
mod cli;

use cli::Arg;
use memtoken::backend::HostBackend;
use memtoken::kv::{KvCache, Layout};
use memtoken::nixl::{Agent, AgentId, DROP_WAIT, OfferedTable};
use memtoken::{Budget, Device, make_guard};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Layers of the model: a K and a V plane each.
const LAYERS: usize = 4;
/// Tokens per block.
const BLOCK_TOKENS: usize = 16;
/// One token's K (or V) bytes in one layer: 4 KV heads of 64 × bf16.
const TOKEN_BYTES: usize = 4 * 64 * 2;
/// Bytes of a block in one plane.
const BLOCK: usize = BLOCK_TOKENS * TOKEN_BYTES;
const PLANES: usize = 2 * LAYERS;

/// The K/V byte at `at` of block `position` of plane `plane` of request `request`'s prompt
/// (what prefill computes).
fn kv_byte(request: usize, position: usize, plane: usize, at: usize) -> u8 {
    (at as u8)
        .wrapping_mul(29)
        .wrapping_add((request * 7 + position * 3 + plane) as u8)
        ^ (at >> 8) as u8
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
    blocks: usize,
}

impl Shape {
    fn bytes(&self) -> usize {
        self.requests * self.blocks * PLANES * BLOCK
    }
}

/// A KV cache of `blocks` blocks (and the null block), every group of them mapped.
fn layout(blocks: usize) -> Layout {
    Layout::per_layer_k_v(LAYERS, BLOCK_TOKENS, TOKEN_BYTES, blocks + 1)
}

/// The prefill process: each prompt's K/V into blocks of its cache, WRITTEN by id into the
/// request's table offered by decode.
fn prefill(socket: &str, shape: &Shape) -> Result<(), Error> {
    let mut socket = UnixStream::connect(socket)?;
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    make_guard!(cache_guard);
    let cache = KvCache::new(cache_guard, &binding, &layout(shape.blocks))?;
    cache.set_watermarks(cache.groups(), cache.groups());
    cache.replenish()?;
    let agent = Agent::new(&device, "prefill")?;
    send(&mut socket, &agent.id().to_bytes())?; // whom decode makes its offers to
    let mut peer = agent.load(&recv(&mut socket)?)?;
    for _ in 1..shape.requests {
        peer.extend(&recv(&mut socket)?)?; // one peer, each request's offer added
    }
    let registered = agent.register_cache(&cache)?;
    let positions: Vec<usize> = (0..shape.blocks).collect();
    let regions = shape.blocks * PLANES; // each offered block's part of each plane
    let mut bytes = vec![0; BLOCK];
    let mut moving = Duration::ZERO;
    for request in 0..shape.requests {
        let mut table = cache.table();
        for position in 0..shape.blocks {
            cache.push(&mut table)?;
            for plane in 0..PLANES {
                for (at, b) in bytes.iter_mut().enumerate() {
                    *b = kv_byte(request, position, plane, at);
                }
                table.write(plane, position, 0, &bytes)?;
            }
        }
        let remote = peer.whole(request * regions..(request + 1) * regions)?;
        let note = format!("kv {request}");
        let start = Instant::now();
        let table = agent
            .write_blocks(
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
        drop(table); // the request's blocks go back to the cache
    }
    peer.done()?; // decode's memory: invalidated, then acknowledged
    drop(registered);
    drop(cache);
    drop(binding);
    drop(agent);
    let report = device.close();
    if !report.is_clean() {
        return Err(format!("prefill's device did not close clean: {report:?}").into());
    }
    send(&mut socket, &moving.as_nanos().to_le_bytes())?;
    Ok(())
}

/// The decode process: offers each request's table of blocks, spawns prefill, takes the tables
/// back after prefill's proof and checks what landed.
fn decode(shape: &Shape) -> Result<(), Error> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    make_guard!(cache_guard);
    let cache = KvCache::new(
        cache_guard,
        &binding,
        &layout(shape.requests * shape.blocks),
    )?;
    cache.set_watermarks(cache.groups(), cache.groups());
    cache.replenish()?;
    let agent = Agent::new(&device, "decode")?;

    let path = std::env::temp_dir().join(format!("memtoken-disagg-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--prefill",
            path.to_str().ok_or("a temp path that is UTF-8")?,
        ])
        .args(["--requests", &shape.requests.to_string()])
        .args(["--blocks", &shape.blocks.to_string()])
        .spawn()?;
    let (mut socket, _) = listener.accept()?;
    let _ = std::fs::remove_file(&path);
    let prefill = AgentId::from_bytes(&recv(&mut socket)?)?;
    let mut offered: Vec<OfferedTable<'_, '_, '_, '_, '_, HostBackend>> = Vec::new();
    for _ in 0..shape.requests {
        let mut table = cache.table();
        for _ in 0..shape.blocks {
            cache.push(&mut table)?;
        }
        // The table moves into the offer: no byte of it is read while prefill may write it.
        let (table, offer) = agent
            .offer_table(&prefill, table)
            .map_err(memtoken::Error::from)?;
        send(&mut socket, offer.as_bytes())?;
        offered.push(table);
    }

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
    // Prefill said it is done before it reported: its acknowledgement is on its way, and
    // each table comes back once it has arrived.
    let mut tables = Vec::with_capacity(shape.requests);
    let start = Instant::now();
    for mut table in offered {
        loop {
            match table.take_back() {
                Ok(back) => break tables.push(back),
                Err(e) if start.elapsed() < DROP_WAIT => table = e.into_token(),
                Err(e) => return Err(memtoken::Error::from(e).into()),
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    let mut bytes = vec![0; BLOCK];
    let mut bad = 0;
    for (request, table) in tables.iter().enumerate() {
        for position in 0..table.len() {
            for plane in 0..PLANES {
                table.read(plane, position, 0, &mut bytes)?;
                bad += bytes
                    .iter()
                    .enumerate()
                    .filter(|&(at, &b)| b != kv_byte(request, position, plane, at))
                    .count();
            }
        }
    }
    if bad > 0 {
        return Err(format!("{bad} of {} bytes differ", shape.bytes()).into());
    }
    drop(tables);
    drop(cache);
    drop(binding);
    drop(agent);
    let report = device.close();
    if !report.is_clean() {
        return Err(format!("decode's device did not close clean: {report:?}").into());
    }
    let secs = moving as f64 / 1e9;
    let mib = shape.bytes() as f64 / (1 << 20) as f64;
    println!(
        "decode: {} requests of {} KV blocks ({LAYERS} layers, K and V: {PLANES} planes of {} KiB \
         a block), {mib:.1} MiB WRITTEN by block id into offered tables in {:.1} ms ({:.2} GiB/s); \
         each table taken back after prefill's proof, every byte checked; both ledgers at zero",
        shape.requests,
        shape.blocks,
        BLOCK >> 10,
        secs * 1e3,
        mib / 1024.0 / secs
    );
    Ok(())
}

const USAGE: &str = "\
usage: disaggregated [--requests N] [--blocks N]

Disaggregated prefill and decode over NIXL, in two processes on the loopback
(cargo run --release --features nixl --example disaggregated -- ARGS).

  --requests N       requests whose K/V prefill writes into decode's offered tables (default 16)
  --blocks N         KV blocks per request, 8 planes of 8 KiB each (default 16)
  --prefill SOCKET   (how decode starts this program as its prefill process)
  -h, --help         print this usage";

fn main() -> std::process::ExitCode {
    let mut shape = Shape {
        requests: 16,
        blocks: 16,
    };
    let mut prefill_at: Option<String> = None;
    let mut cli = cli::Args::new(USAGE);
    while let Some(arg) = cli.next_arg() {
        let Arg::Flag(flag) = arg else {
            cli.unknown(arg)
        };
        match flag.as_str() {
            "--requests" => shape.requests = cli.value(&flag),
            "--blocks" => shape.blocks = cli.value(&flag),
            "--prefill" => prefill_at = Some(cli.value(&flag)),
            _ => cli.unknown(Arg::Flag(flag)),
        }
    }
    for (flag, n) in [("--requests", shape.requests), ("--blocks", shape.blocks)] {
        if n == 0 {
            cli.error(format_args!("{flag} must be at least 1"));
        }
    }
    cli::exit(match prefill_at {
        Some(socket) => prefill(&socket, &shape),
        None => decode(&shape),
    })
}
