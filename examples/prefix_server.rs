//! One process computes a system prompt's KV once, as an exportable shared prefix, and N worker
//! processes (this binary again, with `MEMTOKEN_PREFIX_WORKER` set) import it read-only over a
//! Unix domain socket. The owner releases its prefix first; the workers still read the right
//! bytes (each export keeps the memory), print that they own 0 bytes, and exit; the exports
//! end, and the host's memfd space is given back.
//!
//! `cargo run --example prefix_server [-- WORKERS]` (default 3); `-- --help` prints the usage.

#[path = "common/cli.rs"]
mod cli;
mod common;

use cli::Arg;
use memtoken::backend::{HostBackend, PosixFd};
use memtoken::{Budget, Device, make_guard, sharing::Offer};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

const WORKER_ENV: &str = "MEMTOKEN_PREFIX_WORKER";
const USAGE: &str = "\
usage: prefix_server [WORKERS]

One process computes a system prompt's KV once and WORKERS processes import it read-only
(cargo run --example prefix_server -- ARGS).

  WORKERS      how many worker processes import the shared prefix (a whole number, default 3)
  -h, --help   print this usage";
/// The system prompt's KV: 64 tokens of 1 KiB each, plus a partly filled boundary granule.
const PROMPT_BYTES: usize = 66 << 10;

/// The KV of token position `i`'s byte, as the server computes it.
fn kv(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 10)) as u8
}

fn worker(path: &str, id: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut socket = UnixStream::connect(path)?;
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let session = device.bind(Budget::bytes(0))?; // it will own nothing
    let offer = Offer::recv(&socket)?;
    let prompt = session.import(offer)?;
    // Wait until the server says its owner has released the prefix.
    let mut go = [0u8; 1];
    socket.read_exact(&mut go)?;
    let wrong = (0..prompt.len())
        .filter(|&i| prompt.as_slice()[i] != kv(i))
        .count();
    let owned = device.ledger().owned_bytes;
    println!(
        "worker {id}: imported {} bytes read-only, {wrong} wrong after the owner released, \
         owns {owned} bytes",
        prompt.len()
    );
    writeln!(socket, "{}", u8::from(wrong == 0 && owned == 0))?;
    drop(prompt);
    drop(session);
    assert!(device.close().is_clean());
    Ok(())
}

/// The number of workers the command line asks for; `--help` prints the usage and exits 0, a bad
/// argument says which and prints the usage, and exits 2.
fn workers() -> usize {
    let mut cli = cli::Args::new(USAGE);
    let mut workers = None;
    while let Some(arg) = cli.next_arg() {
        match arg {
            Arg::Positional(n) if workers.is_none() => workers = Some(cli.parse("WORKERS", &n)),
            other => cli.unknown(other),
        }
    }
    workers.unwrap_or(3)
}

fn main() -> std::process::ExitCode {
    if common::started_by_test_harness() {
        return std::process::ExitCode::SUCCESS;
    }
    if let Ok(path) = std::env::var(WORKER_ENV) {
        let id = std::env::args().nth(1).unwrap_or_default();
        return cli::exit(worker(&path, &id));
    }
    let workers = workers();
    cli::exit(serve(workers))
}

/// The server: the prefix computed, exported to `workers` processes, released first.
fn serve(workers: usize) -> Result<(), Box<dyn std::error::Error>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let system = device.bind(Budget::unlimited())?;
    let mut prompt = system
        .reserve(PROMPT_BYTES)?
        .commit_prefix_exportable::<PosixFd>()?;
    for (i, b) in prompt
        .as_mut_slice()
        .ok_or("not shared yet")?
        .iter_mut()
        .enumerate()
    {
        *b = kv(i);
    }
    println!(
        "server: computed the system prompt's KV once: {} bytes",
        prompt.len()
    );

    let path = std::env::temp_dir().join(format!("memtoken-prefix-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    let mut exports = Vec::new();
    for id in 0..workers {
        let child = Command::new(&exe)
            .arg(id.to_string())
            .env(WORKER_ENV, &path)
            .spawn()?;
        let (socket, _) = listener.accept()?;
        let export = prompt.export()?;
        export.send(&socket)?;
        children.push((child, socket));
        exports.push(export);
    }
    std::fs::remove_file(&path)?;
    println!(
        "server: {workers} exports outstanding, owned {} bytes",
        device.ledger().owned_bytes
    );
    prompt.release().complete()?;
    println!("server: the owner released its prefix first");
    let mut all_ok = true;
    for (child, socket) in &mut children {
        socket.write_all(b"g")?;
        let mut verdict = String::new();
        socket.read_to_string(&mut verdict)?;
        all_ok &= verdict.trim() == "1" && child.wait()?.success();
    }
    for export in exports {
        export.end(); // each worker has exited: its export ends
    }
    assert!(all_ok, "a worker read wrong bytes or owned memory");
    drop(system);
    let outstanding = device.outstanding_exports();
    let report = device.close();
    // Each exportable allocation is a memfd of its own: none is open any more.
    let memfds = std::fs::read_dir("/proc/self/fd")?
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("memtoken-export"))
        .count();
    println!(
        "server: exports outstanding {outstanding}; host memfd space given back: owned {} \
         bytes, {memfds} prefix memfds open, clean {}",
        report.ledger.owned_bytes,
        report.is_clean()
    );
    Ok(())
}
