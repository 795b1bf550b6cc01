//! Feature `nixl`: typed NIXL transfers over UCX on the loopback, between two agents
//! in one process and in two (this binary re-run as the peer). Needs NIXL's library:
//! `scripts/install-nixl.sh`, then `source target/nixl/env.sh`; without it every test fails
//! with that instruction (never skips). Run with `--test-threads=1`: NIXL may deadlock when its
//! agents are made on several threads at once.

use memtoken::backend::HostBackend;
use memtoken::nixl::{Agent, AgentId, DROP_WAIT, NixlError};
use memtoken::{Budget, Device, make_guard};

const LEN: usize = 1 << 21;

/// The byte at `i` of a request's K/V: every byte differs from its neighbours.
fn pattern(seed: u8, i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8
}

fn fill(bytes: &mut [u8], seed: u8) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(seed, i);
    }
}

fn check(bytes: &[u8], seed: u8) {
    let bad = bytes
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(seed, i))
        .count();
    assert_eq!(bad, 0, "{bad} of {} bytes differ", bytes.len());
}

/// An agent, or the instruction that makes one possible.
fn agent<'d, 'id>(device: &'d Device<'id, HostBackend>, name: &str) -> Agent<'d, 'id, HostBackend> {
    match Agent::new(device, name) {
        Ok(agent) => agent,
        Err(e) => panic!("{e}"),
    }
}

/// A WRITE of a token's memory from one agent into another's, then a notification after the
/// bytes; the target cannot look at its memory until the initiator is done (the peer could
/// still write it), then sees every byte; both give their tokens back and both ledgers end at
/// zero.
#[test]
fn a_write_lands_byte_for_byte_with_its_notification()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(gp);
    let prefill_device = Device::new(gp, HostBackend::with_defaults()?);
    make_guard!(gd);
    let decode_device = Device::new(gd, HostBackend::with_defaults()?);
    let (pb, db) = (
        prefill_device.bind(Budget::unlimited())?,
        decode_device.bind(Budget::unlimited())?,
    );
    let prefill = agent(&prefill_device, "prefill-w");
    let decode = agent(&decode_device, "decode-w");
    assert_eq!((prefill.name(), decode.name()), ("prefill-w", "decode-w"));
    assert_eq!(format!("{prefill:?}"), "Agent { name: \"prefill-w\", .. }");

    let mut kv = pb.reserve(LEN)?.commit()?;
    fill(kv.as_mut_slice(), 3);
    let source = prefill.register(kv)?;
    let mut target = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut target])?;

    let peer = prefill.load(offer.as_bytes())?;
    assert_eq!(peer.name(), "decode-w");
    let write = prefill.write(
        &source,
        &[(0, LEN / 2), (LEN / 2, LEN / 2)],
        &peer,
        &[peer.range(0, 0, LEN / 2)?, peer.range(0, LEN / 2, LEN / 2)?],
        Some(b"kv-ready"),
    )?;
    assert_eq!(write.bytes(), LEN);
    write.wait(DROP_WAIT)?;

    let seen = wait_for_notification(&decode);
    assert_eq!(seen.from, "prefill-w");
    assert_eq!(seen.message, b"kv-ready");
    match target.token() {
        Err(NixlError::Exposed { peers, poisoned }) => {
            assert_eq!(peers, ["prefill-w"]);
            assert!(!poisoned);
        }
        other => panic!("the peer may still write: no token lent, got {other:?}"),
    }
    peer.done()?;
    wait_until(|| target.token().is_ok());
    check(target.token()?.as_slice(), 3);

    drop(target.release()?);
    drop(source.release()?);
    assert!(decode_device.withheld_for_peers().is_empty());
    drop((db, pb));
    drop((decode, prefill));
    assert!(decode_device.close().is_clean());
    assert!(prefill_device.close().is_clean());
    Ok(())
}

/// Waits (up to DROP_WAIT) for one notification on `agent`.
fn wait_for_notification(agent: &Agent<'_, '_, HostBackend>) -> memtoken::nixl::Notification {
    for _ in 0..POLLS {
        let mut got = agent.notifications().expect("notifications");
        if let Some(n) = got.pop() {
            assert!(got.is_empty(), "one notification: {got:?}");
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("no notification arrived in {POLLS} polls");
}

/// How many times a test asks before it gives up on what must arrive: a guard against hanging,
/// not a measure of speed.
const POLLS: usize = 5_000;

/// The id of an agent that never exists (an offer to it is never loaded).
fn stranger(name: &str) -> AgentId {
    AgentId::from_bytes(&[&7u64.to_le_bytes()[..], name.as_bytes()].concat()).unwrap()
}

fn wait_until(mut ready: impl FnMut() -> bool) {
    for _ in 0..POLLS {
        if ready() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("not ready in {POLLS} polls");
}

/// Two devices, their bindings and an agent on each, for one test.
macro_rules! two_sides {
    ($pd:ident, $pb:ident, $prefill:ident, $dd:ident, $db:ident, $decode:ident, $suffix:expr) => {
        make_guard!(gp);
        let $pd = Device::new(gp, HostBackend::with_defaults()?);
        make_guard!(gd);
        let $dd = Device::new(gd, HostBackend::with_defaults()?);
        let $pb = $pd.bind(Budget::unlimited())?;
        let $db = $dd.bind(Budget::unlimited())?;
        let $prefill = agent(&$pd, &format!("prefill-{}", $suffix));
        let $decode = agent(&$dd, &format!("decode-{}", $suffix));
    };
}

/// A READ: the decode side pulls a prefill token's memory (vLLM's usual direction) into its
/// own, mutably borrowed while the transfer runs, then checks every byte; the prefill side
/// gives its token back once decode is done.
#[test]
fn a_read_pulls_a_peers_memory_byte_for_byte()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "r");
    let mut kv = pb.reserve(LEN)?.commit()?;
    fill(kv.as_mut_slice(), 9);
    let at = kv.addr();
    let mut offered = prefill.register(kv)?;
    assert_eq!((offered.len(), offered.is_empty()), (LEN, false));
    assert_eq!(
        format!("{offered:?}"),
        format!("Registered {{ addr: {at:#x}, len: {LEN}, poisoned: false }}")
    );
    let offer = prefill.offer(&decode.id(), &mut [&mut offered])?;

    let peer = decode.load(offer.as_bytes())?;
    assert_eq!(
        format!("{peer:?}"),
        r#"Peer { name: "prefill-r", epoch: 1, regions: 1 }"#
    );
    let mut into = decode.register(db.reserve(LEN)?.commit()?)?;
    let read = decode.read(
        &mut into,
        &[(0, LEN)],
        &peer,
        &[peer.range(0, 0, LEN)?],
        None,
    )?;
    read.wait(DROP_WAIT)?;
    check(into.token()?.as_slice(), 9); // never offered: lent at once
    peer.done()?;
    wait_until(|| offered.token().is_ok());
    drop(offered.release()?);
    drop(into.release()?);
    drop((pb, db));
    drop((prefill, decode));
    assert!(pd.close().is_clean());
    assert!(dd.close().is_clean());
    Ok(())
}

/// Memory offered to a peer that never says it is done is withheld for good when released:
/// the error and the device name the peer, the ledger counts it quarantined, and no later
/// reservation of the device ever lands on it. An acknowledgement covers the offers made up to
/// it, not a later one. The same release after the peer's acknowledgement gives the token back.
/// Fails if a release ignores the exposure (the token comes back, and its address is handed out
/// again), or if an acknowledgement covers later offers.
#[test]
fn memory_offered_without_the_peers_proof_is_withheld_and_never_reused()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "q");
    let mut acked = decode.register(db.reserve(LEN)?.commit()?)?;
    let mut reoffered = decode.register(db.reserve(LEN)?.commit()?)?;
    let mut stray = decode.register(db.reserve(LEN)?.commit()?)?;

    let offer = decode.offer(&prefill.id(), &mut [&mut acked, &mut reoffered])?;
    let peer = prefill.load(offer.as_bytes())?;
    assert_eq!(peer.regions().len(), 2);
    peer.done()?; // invalidated, then acknowledged: covers this offer
    wait_until(|| acked.token().is_ok());
    // Offered again after the acknowledgement: exposed again, and not covered by it.
    let _again = decode.offer(&prefill.id(), &mut [&mut reoffered])?;
    // Offered to a peer that never loads it nor says anything.
    let _never = decode.offer(&stranger("stray"), &mut [&mut stray])?;

    drop(acked.release()?);
    let e = reoffered
        .release()
        .expect_err("the later offer was never acknowledged");
    assert!(e.to_string().contains("peer prefill-q"), "{e}");
    let e = stray.release().expect_err("never acknowledged");
    assert!(e.to_string().contains("peer stray"), "{e}");

    let withheld = dd.withheld_for_peers();
    let peers: Vec<_> = withheld.iter().map(|w| w.peer.as_str()).collect();
    assert_eq!(peers, ["prefill-q", "stray"]);
    assert_eq!(dd.ledger().quarantined, 2);
    let later = (0..64)
        .map(|_| Ok(db.reserve(LEN)?.commit()?))
        .collect::<Result<Vec<_>, memtoken::Error>>()?;
    for w in &withheld {
        assert!(
            later
                .iter()
                .all(|t| t.addr() + t.len() <= w.addr || w.addr + w.len <= t.addr()),
            "a later allocation landed on memory withheld for {}",
            w.peer
        );
    }
    drop(later);
    drop((pb, db));
    drop((prefill, decode));
    let report = dd.close();
    assert!(!report.is_clean(), "withheld memory stays counted");
    assert_eq!(report.withheld_for_peers, withheld);
    assert!(pd.close().is_clean());
    Ok(())
}

// ---- Two processes: this binary re-run as the peer, talking over a Unix socket (the test
// harness owns stdout). ----

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};

/// Set in a child run as the peer: the socket to connect to.
const ROLE: &str = "MEMTOKEN_NIXL_PEER";

fn send(to: &mut impl Write, bytes: &[u8]) {
    to.write_all(&(bytes.len() as u32).to_le_bytes()).unwrap();
    to.write_all(bytes).unwrap();
    to.flush().unwrap();
}

fn recv(from: &mut impl Read) -> Vec<u8> {
    let mut len = [0; 4];
    from.read_exact(&mut len).unwrap();
    let mut bytes = vec![0; u32::from_le_bytes(len) as usize];
    from.read_exact(&mut bytes).unwrap();
    bytes
}

/// This binary again, running only `test` as its peer, and the socket to it.
fn peer_process(test: &str) -> (Child, UnixStream) {
    peer_process_with(test, &[])
}

/// As [`peer_process`], with more environment for the child. Gives up, loudly, if the child
/// exits or does not connect within [`PEER_CONNECTS`] (a child that panicked before it connected
/// left its test waiting in `accept` for ever), and listens at a path of its own per call (one
/// path per process let two tests run side by side — without `--test-threads=1`, which the
/// suite asks for — take each other's child), removed however this ends.
fn peer_process_with(test: &str, env: &[(&str, &str)]) -> (Child, UnixStream) {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("memtoken-nixl-{}-{call}.sock", std::process::id()));
    /// Removes the socket's path as it drops, a panic included.
    struct Listening(std::path::PathBuf);
    impl Drop for Listening {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let listening = Listening(path.clone());
    listener.set_nonblocking(true).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, &path)
        .envs(env.iter().copied())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let socket = loop {
        match listener.accept() {
            Ok((socket, _)) => break socket,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("the peer process of {test} exited without connecting: {status}");
                }
                if start.elapsed() >= PEER_CONNECTS {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("the peer process of {test} did not connect within {PEER_CONNECTS:?}");
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("accepting the peer process of {test}: {e}"),
        }
    };
    socket.set_nonblocking(false).unwrap();
    drop(listening);
    (child, socket)
}

/// How long a peer process may take to start and connect (its NIXL agent is made after it
/// connects; a loaded machine starts a process in well under a second).
const PEER_CONNECTS: std::time::Duration = std::time::Duration::from_secs(120);

/// The socket to the parent, in a child run as the peer.
fn parent() -> Option<UnixStream> {
    std::env::var(ROLE)
        .ok()
        .map(|path| UnixStream::connect(path).unwrap())
}

/// The peer a test kills: in the child, an agent `name` offers `len` bytes to the agent whose
/// id it receives, sends the offer, and waits to be killed.
fn parked_target(
    mut socket: UnixStream,
    name: &str,
    len: usize,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let target = agent(&device, name);
    let mut offered = target.register(binding.reserve(len)?.commit()?)?;
    let initiator = AgentId::from_bytes(&recv(&mut socket))?;
    let offer = target.offer(&initiator, &mut [&mut offered])?;
    send(&mut socket, offer.as_bytes());
    loop {
        std::thread::park(); // killed here
    }
}

/// A device, its binding and an agent named `$name` whose UCX moves bytes over TCP (in the
/// background: a large transfer is still in flight when its post returns).
macro_rules! tcp_initiator {
    ($device:ident, $binding:ident, $initiator:ident, $name:literal) => {
        // SAFETY: the NIXL tests run on one thread (`--test-threads=1`), and no agent exists in
        // this process while the variable changes; UCX reads it as the agent is made.
        unsafe { std::env::set_var("UCX_TLS", "tcp") };
        make_guard!(guard);
        let $device = Device::new(guard, HostBackend::with_defaults()?);
        let $binding = $device.bind(Budget::unlimited())?;
        let $initiator = agent(&$device, $name);
        // SAFETY: as above.
        unsafe { std::env::remove_var("UCX_TLS") };
    };
}

/// [`tcp_initiator!`], and `$test`'s [`parked_target`] process (`$child`, running) loaded as
/// `$peer` from its offer.
macro_rules! parked_peer {
    ($test:expr, $name:literal, $device:ident, $binding:ident, $initiator:ident, $peer:ident, $child:ident) => {
        tcp_initiator!($device, $binding, $initiator, $name);
        let ($child, offer) = offer_of_a_parked_target($test, &$initiator);
        let $peer = $initiator.load(&offer)?;
    };
}

/// [`parked_peer!`], then a READ (`$read`) of the peer's first `$len` bytes into `$into`, a
/// registration of its own, posted once the peer process (`$child`, a [`Stopped`]) has stopped:
/// it cannot finish before the peer is killed.
macro_rules! read_from_a_stopped_peer {
    ($test:expr, $name:literal, $len:expr =>
     $device:ident, $binding:ident, $initiator:ident, $peer:ident, $into:ident, $child:pat, $read:ident) => {
        parked_peer!($test, $name, $device, $binding, $initiator, $peer, running);
        let mut $into = $initiator.register($binding.reserve($len)?.commit()?)?;
        let $child = stop(running);
        let $read = $initiator.read(
            &mut $into,
            &[(0, $len)],
            &$peer,
            &[$peer.range(0, 0, $len)?],
            None,
        )?;
    };
}

/// A peer process stopped (SIGSTOP) until it is killed. Over TCP a READ's bytes are sent by
/// the peer's own UCX progress, so a transfer posted to a stopped peer cannot finish before the
/// kill: without the stop, a fast machine finished a 32 MiB READ before the kill landed (CI:
/// "the READ did not fail: Ok(true)"). Killed and reaped as it drops too, so that a test that
/// fails early leaves no stopped process behind.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Stops `child`, and returns once it has stopped (`waitpid` with `WUNTRACED` reports the stop
/// without reaping it).
fn stop(child: Child) -> Stopped {
    use rustix::process::{Pid, Signal, WaitOptions, kill_process, waitpid};
    let pid = Pid::from_child(&child);
    let stopped = Stopped(child);
    kill_process(pid, Signal::STOP).expect("SIGSTOP to the peer");
    let status = waitpid(Some(pid), WaitOptions::UNTRACED).expect("waitpid");
    assert!(
        status.is_some_and(|(_, s)| s.stopped()),
        "the peer did not stop: {status:?}"
    );
    stopped
}

/// Runs `test`'s [`parked_target`] (over TCP too) and returns it with its offer to
/// `initiator`.
fn offer_of_a_parked_target(
    test: &str,
    initiator: &Agent<'_, '_, HostBackend>,
) -> (Child, Vec<u8>) {
    let (child, mut socket) = peer_process_with(test, &[("UCX_TLS", "tcp")]);
    send(&mut socket, &initiator.id().to_bytes());
    let offer = recv(&mut socket);
    (child, offer)
}

/// Prefill and decode in two processes (disaggregated serving): prefill offers its K/V and a
/// region for decode's answer; decode READs the K/V into a token and checks every byte, WRITEs
/// the first half of its answer from the token, READs the K/V's second half into blocks of its
/// KV cache by id and checks them, WRITEs the answer's second half from those blocks with a
/// notification, and says it is done; prefill receives the notification, sees the answer byte
/// for byte once decode is done, and gives everything back.
#[test]
fn two_processes_read_and_write_each_others_memory()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const TEST: &str = "two_processes_read_and_write_each_others_memory";
    if let Some(socket) = parent() {
        return decode_process(socket);
    }
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let prefill = agent(&device, "prefill-2p");
    let mut kv = binding.reserve(LEN)?.commit()?;
    fill(kv.as_mut_slice(), 21);
    let mut kv = prefill.register(kv)?;
    let mut answer = prefill.register(binding.reserve(LEN)?.commit()?)?;

    let (mut child, mut socket) = peer_process(TEST);
    let decode = AgentId::from_bytes(&recv(&mut socket))?; // the offer is made to that agent
    let offer = prefill.offer(&decode, &mut [&mut kv, &mut answer])?;
    send(&mut socket, offer.as_bytes());
    let n = wait_for_notification(&prefill);
    assert_eq!(
        (n.from.as_str(), n.message.as_slice()),
        ("decode-2p", &b"answered"[..])
    );
    let said = recv(&mut socket);
    assert_eq!(said, b"ok");
    assert!(
        child.wait()?.success(),
        "the decode process's checks failed"
    );
    wait_until(|| answer.token().is_ok());
    check(answer.token()?.as_slice(), 77);
    drop(kv.release()?);
    drop(answer.release()?);
    drop(binding);
    drop(prefill);
    assert!(device.close().is_clean());
    Ok(())
}

/// The decode side of the test above, in the child.
fn decode_process(mut socket: UnixStream) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let decode = agent(&device, "decode-2p");
    send(&mut socket, &decode.id().to_bytes());
    let offer = recv(&mut socket);
    let peer = decode.load(&offer)?;
    let mut into = decode.register(binding.reserve(LEN)?.commit()?)?;
    decode
        .read(
            &mut into,
            &[(0, LEN)],
            &peer,
            &[peer.range(0, 0, LEN)?],
            None,
        )?
        .wait(DROP_WAIT)?;
    check(into.token()?.as_slice(), 21);
    let mut mine = into.release()?;
    fill(mine.as_mut_slice(), 77);
    let mine = decode.register(mine)?;
    decode
        .write(
            &mine,
            &[(0, LEN / 2)],
            &peer,
            &[peer.range(1, 0, LEN / 2)?],
            None,
        )?
        .wait(DROP_WAIT)?;
    // The second half of the answer from KV blocks: READ from the K/V into blocks by id,
    // rewritten, then WRITTEN as a list.
    const BLOCK: usize = 64 << 10;
    let blocks = LEN / 2 / BLOCK;
    make_guard!(cache_guard);
    let cache = memtoken::kv::KvCache::new(
        cache_guard,
        &binding,
        &memtoken::kv::Layout::new(blocks + 1, 16).plane(BLOCK),
    )?;
    cache.set_watermarks(cache.groups(), cache.groups());
    cache.replenish()?;
    let registered = decode.register_cache(&cache)?;
    let mut table = cache.table();
    for _ in 0..blocks {
        cache.push(&mut table)?;
    }
    let positions: Vec<usize> = (0..blocks).collect();
    let from_kv = (0..blocks)
        .map(|i| peer.range(0, LEN / 2 + i * BLOCK, BLOCK))
        .collect::<Result<Vec<_>, _>>()?;
    let mut table = decode
        .read_blocks(&registered, table, &positions, &peer, &from_kv, None)
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    let mut read = vec![0; BLOCK];
    for i in 0..blocks {
        let at = LEN / 2 + i * BLOCK;
        let expected: Vec<u8> = (at..at + BLOCK).map(|b| pattern(21, b)).collect();
        table.read(0, i, 0, &mut read)?;
        assert_eq!(read, expected, "block {i} read from the K/V");
        let answer: Vec<u8> = (at..at + BLOCK).map(|b| pattern(77, b)).collect();
        table.write(0, i, 0, &answer)?;
    }
    let into_answer = (0..blocks)
        .map(|i| peer.range(1, LEN / 2 + i * BLOCK, BLOCK))
        .collect::<Result<Vec<_>, _>>()?;
    let table = decode
        .write_blocks(
            &registered,
            table,
            &positions,
            &peer,
            &into_answer,
            Some(b"answered"),
        )
        .map_err(memtoken::Error::from)?
        .wait(DROP_WAIT)?;
    drop(table);
    drop(registered);
    drop(cache);
    peer.done()?;
    drop(mine.release()?);
    drop(binding);
    drop(decode);
    assert!(device.close().is_clean());
    send(&mut socket, b"ok");
    Ok(())
}

/// A peer process killed in the middle of a large READ (over TCP, where UCX moves the bytes in
/// the background; the default shared-memory path copies within the post): the transfer's drop
/// returns within DROP_WAIT (and a margin), its local registration is poisoned, and releasing it
/// withholds the memory — no later allocation lands on it. Fails if the drop leaves the
/// registration clean (the token comes back under an engine that may still write it).
#[test]
fn a_peer_killed_mid_transfer_leaves_the_memory_withheld()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const TEST: &str = "a_peer_killed_mid_transfer_leaves_the_memory_withheld";
    const BIG: usize = 256 << 20;
    if let Some(socket) = parent() {
        return parked_target(socket, "target-k", BIG);
    }
    read_from_a_stopped_peer! {
        TEST, "initiator-k", BIG => device, binding, initiator, peer, into, mut child, read
    }
    child.0.kill()?;
    // The drop returns — its wait is bounded by DROP_WAIT by construction — and how long it
    // took is printed, not asserted: what is asserted is what it leaves.
    let start = std::time::Instant::now();
    drop(read);
    eprintln!("the dropped READ returned after {:?}", start.elapsed());
    assert!(
        into.is_poisoned(),
        "the READ did not finish: the registration is poisoned"
    );
    child.0.wait()?;
    assert!(
        matches!(peer.done(), Err(NixlError::Tainted(_))),
        "no acknowledgement after an unfinished transfer"
    );
    let e = into.release().expect_err("withheld");
    assert!(e.to_string().contains("forgotten or unfinished"), "{e}");
    let withheld = device.withheld_for_peers();
    assert_eq!(withheld.len(), 1);
    let later = binding.reserve(BIG)?.commit()?;
    let w = &withheld[0];
    assert!(later.addr() + later.len() <= w.addr || w.addr + w.len <= later.addr());
    let kept = (w.addr, w.len);
    drop(later);
    drop(binding);
    drop(initiator);
    let report = device.close();
    assert_eq!(report.withheld_for_peers.len(), 1);
    assert!(
        all_mapped(kept.0, kept.1),
        "the backend unmapped memory withheld for good as it dropped"
    );
    Ok(())
}

/// Whether every page of `[addr, addr + len)` is mapped in this process.
fn all_mapped(addr: usize, len: usize) -> bool {
    let page = rustix::param::page_size();
    (addr..addr + len).step_by(page).all(|at| {
        // SAFETY: an asynchronous `msync` only schedules write-back of what is mapped there; it
        // changes no mapping and no byte (and fails with ENOMEM where nothing is mapped).
        unsafe { rustix::mm::msync(at as *mut _, page, rustix::mm::MsyncFlags::ASYNC) }.is_ok()
    })
}

// ---- From the review: what a forgotten transfer, a second load, a spoofed acknowledgement
// or a stale offer must not do. ----

/// Two agents over TCP (where UCX moves the bytes in the background, so a large transfer is
/// still in flight when its post returns), for one test.
macro_rules! two_sides_over_tcp {
    ($pd:ident, $pb:ident, $prefill:ident, $dd:ident, $db:ident, $decode:ident, $suffix:expr) => {
        // SAFETY: the NIXL tests run on one thread (`--test-threads=1`), and no agent exists in
        // this process while the variable changes; UCX reads it as each agent is made.
        unsafe { std::env::set_var("UCX_TLS", "tcp") };
        two_sides!($pd, $pb, $prefill, $dd, $db, $decode, $suffix);
        // SAFETY: as above.
        unsafe { std::env::remove_var("UCX_TLS") };
    };
}

/// How [`a_big_read_that_does_not_finish`] leaves its READ.
#[derive(Clone, Copy, Debug)]
enum Unfinished {
    /// `mem::forget`.
    Forgotten,
    /// A wait whose limit (zero) passes first.
    TimedOut,
}

/// A 64 MiB READ from a peer process stopped before the post (over TCP its bytes are sent by
/// the peer's own progress, so the READ cannot finish; in one process a quiet machine finished
/// it within the polls a zero limit allows: CI, "Ok(())"), left unfinished as `how` says: the
/// registration is poisoned, lends no token, and its release withholds it; the peer cannot
/// acknowledge. `test` is the calling test's name (its child runs the peer).
fn a_big_read_that_does_not_finish(
    how: Unfinished,
    test: &str,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const BIG: usize = 64 << 20;
    if let Some(socket) = parent() {
        return parked_target(socket, "target-u", BIG);
    }
    read_from_a_stopped_peer! {
        test, "initiator-u", BIG => device, binding, initiator, peer, into, child, read
    }
    let why = match how {
        Unfinished::Forgotten => {
            std::mem::forget(read);
            "forgotten"
        }
        Unfinished::TimedOut => {
            let waited = read.wait(std::time::Duration::ZERO);
            assert!(matches!(waited, Err(NixlError::TimedOut(_))), "{waited:?}");
            "unfinished"
        }
    };
    assert!(into.is_poisoned(), "{how:?}: the READ stays in flight");
    assert!(
        into.token().is_err(),
        "{how:?}: no bytes lent under the engine"
    );
    assert!(matches!(peer.done(), Err(NixlError::Tainted(_))));
    let e = into.release().expect_err("withheld");
    assert!(e.to_string().contains(why), "{e}");
    assert_eq!(device.withheld_for_peers().len(), 1);
    drop(child); // killed and reaped
    Ok(())
}

/// A READ forgotten (`mem::forget`) in flight: its borrow ends, but the registration stays
/// marked in flight — it lends no token, its release withholds it — and the peer cannot
/// acknowledge. Fails if the marks are set only as a transfer drops (the review's break: the
/// bytes behind a lent `&[u8]` changed).
#[test]
fn a_forgotten_transfer_keeps_its_memory_withheld()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_big_read_that_does_not_finish(
        Unfinished::Forgotten,
        "a_forgotten_transfer_keeps_its_memory_withheld",
    )
}

/// A wait whose limit passes before the READ is done says so (`TimedOut`), and leaves what a
/// failed transfer leaves: the registration poisoned, its release withheld, the peer unable to
/// acknowledge. Fails if the wait returns `Ok` without waiting.
#[test]
fn a_wait_whose_limit_passes_first_times_out_and_withholds()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    a_big_read_that_does_not_finish(
        Unfinished::TimedOut,
        "a_wait_whose_limit_passes_first_times_out_and_withholds",
    )
}

/// A block READ forgotten in flight, then its registered cache and the cache dropped: its
/// blocks stay lent (the cache does not sleep) and the cache withholds its planes for good (the
/// review's break of the page pool's: its memory was unmapped under the engine, and the
/// process took SIGSEGV).
#[test]
fn a_forgotten_block_transfer_keeps_its_caches_planes()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    const BLOCK: usize = 1 << 20;
    const BLOCKS: usize = 64;
    two_sides_over_tcp!(pd, pb, prefill, dd, db, decode, "g");
    let mut offered = prefill.register(pb.reserve(BLOCK * BLOCKS)?.commit()?)?;
    let offer = prefill.offer(&decode.id(), &mut [&mut offered])?;
    let peer = decode.load(offer.as_bytes())?;
    make_guard!(cache_guard);
    let cache = memtoken::kv::KvCache::new(
        cache_guard,
        &db,
        &memtoken::kv::Layout::new(BLOCKS + 1, 16).plane(BLOCK),
    )?;
    cache.set_watermarks(cache.groups(), cache.groups());
    cache.replenish()?;
    let registered = decode.register_cache(&cache)?;
    let mut table = cache.table();
    for _ in 0..BLOCKS {
        cache.push(&mut table)?;
    }
    let remote = (0..BLOCKS)
        .map(|i| peer.range(0, i * BLOCK, BLOCK))
        .collect::<Result<Vec<_>, _>>()?;
    let positions: Vec<usize> = (0..BLOCKS).collect();
    let read = decode
        .read_blocks(&registered, table, &positions, &peer, &remote, None)
        .map_err(memtoken::Error::from)?;
    std::mem::forget(read);
    assert_eq!(cache.lent_blocks(), BLOCKS);
    assert!(matches!(
        cache.sleep(),
        Err(memtoken::kv::KvError::Lent { .. })
    ));
    drop(registered);
    drop(cache);
    assert!(
        dd.withheld_for_peers()
            .iter()
            .any(|w| w.peer.contains("forgotten")),
        "the cache's planes are withheld: {:?}",
        dd.withheld_for_peers()
    );
    std::thread::sleep(std::time::Duration::from_millis(200)); // let the leaked READ land
    Ok(())
}

/// One `Peer` of an agent at a time (NIXL keeps one metadata per agent): a second load is
/// refused and a later offer is added with `extend`; after `done`, the same offer cannot be
/// loaded again (the review's break: reloaded, it reached memory the target had lent as bytes).
#[test]
fn an_offer_acknowledged_cannot_be_loaded_again()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "s");
    let mut first = decode.register(db.reserve(LEN)?.commit()?)?;
    let mut second = decode.register(db.reserve(LEN)?.commit()?)?;
    let one = decode.offer(&prefill.id(), &mut [&mut first])?;
    let two = decode.offer(&prefill.id(), &mut [&mut second])?;
    let mut peer = prefill.load(one.as_bytes())?;
    assert!(matches!(
        prefill.load(two.as_bytes()),
        Err(NixlError::AlreadyLoaded(_))
    ));
    peer.extend(two.as_bytes())?;
    assert_eq!(peer.regions().len(), 2);
    assert!(matches!(
        peer.range(2, 0, 1),
        Err(NixlError::NoRegion { .. })
    ));
    assert!(matches!(
        peer.range(0, usize::MAX, 2),
        Err(NixlError::Range { .. })
    ));
    peer.done()?;
    wait_until(|| first.token().is_ok() && second.token().is_ok());
    match prefill.load(one.as_bytes()) {
        Err(NixlError::Stale { epoch, acked, .. }) => assert!(epoch <= acked),
        other => panic!("an acknowledged offer loaded again: {other:?}"),
    }
    drop((first.release()?, second.release()?));
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    Ok(())
}

/// A transfer dropped without a wait, which finishes within the drop's wait, leaves nothing
/// poisoned: the registration lends its token, and the peer can say it is done. Fails if the
/// drop takes a transfer that finished for one that did not (the NIXL run's `delete !` in
/// `Transfer::wait_in_drop`).
#[test]
fn a_transfer_dropped_unwaited_that_finishes_poisons_nothing()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "w");
    let mut target = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut target])?;
    let peer = prefill.load(offer.as_bytes())?;
    let source = prefill.register(pb.reserve(LEN)?.commit()?)?;
    drop(prefill.write(&source, &[(0, 64)], &peer, &[peer.range(0, 0, 64)?], None)?);
    assert!(
        !source.is_poisoned(),
        "a finished WRITE poisoned its memory"
    );
    peer.done()?;
    wait_until(|| target.token().is_ok());
    drop((target.release()?, source.release()?));
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    Ok(())
}

/// A notification cannot pose as the acknowledgement (the review's break: a WRITE whose
/// notification read `memtoken/done/1` made the target lend its bytes while the writer still
/// held its metadata); an offer names the agent it is for.
#[test]
fn an_acknowledgement_cannot_be_spoofed_nor_an_offer_taken_by_another()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "a");
    let source = prefill.register(pb.reserve(LEN)?.commit()?)?;
    let mut target = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut target])?;
    let peer = prefill.load(offer.as_bytes())?;
    let spoof = prefill.write(
        &source,
        &[(0, 8)],
        &peer,
        &[peer.range(0, 0, 8)?],
        Some(b"memtoken/done/1"),
    );
    assert!(matches!(spoof, Err(NixlError::Reserved)), "{spoof:?}");
    drop(spoof);
    assert!(target.token().is_err(), "still exposed");
    make_guard!(gt);
    let third_device = Device::new(gt, HostBackend::with_defaults()?);
    let third = agent(&third_device, "third-a");
    match third.load(offer.as_bytes()) {
        Err(NixlError::NotForUs { offered_to, loader }) => {
            assert_eq!(
                (offered_to.as_str(), loader.as_str()),
                ("prefill-a", "third-a")
            );
        }
        other => panic!("an offer to prefill-a loaded by third-a: {other:?}"),
    }
    peer.done()?;
    wait_until(|| target.token().is_ok());
    drop((target.release()?, source.release()?));
    drop(third);
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    Ok(())
}

/// From the second review: a failed `done` still makes its offers unloadable; a load refused
/// while a `Peer` of the agent lives leaves that `Peer` working; an agent made again under the
/// same name is loaded afresh (its offers number from 1 again), and its peer is not extended by
/// the old incarnation's offer (refused as another agent's, not as an old epoch: `extend`'s
/// `||` → `&&`); that peer, dropped instead of `done`, acknowledges all the same (`Peer`'s drop
/// emptied: the offered memory was never lent back).
#[test]
fn loads_never_touch_a_live_peer_and_a_new_incarnation_loads_afresh()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "i");
    let source = prefill.register(pb.reserve(LEN)?.commit()?)?;
    let mut first = decode.register(db.reserve(LEN)?.commit()?)?;
    let one = decode.offer(&prefill.id(), &mut [&mut first])?;
    let peer = prefill.load(one.as_bytes())?;
    // A refused load (the agent's Peer lives) leaves the live Peer's metadata alone.
    assert!(matches!(
        prefill.load(one.as_bytes()),
        Err(NixlError::AlreadyLoaded(_))
    ));
    prefill
        .write(&source, &[(0, 64)], &peer, &[peer.range(0, 0, 64)?], None)?
        .wait(DROP_WAIT)?;
    peer.done()?;
    wait_until(|| first.token().is_ok());
    // An agent made again under the loader's name cannot load the offer its namesake said it
    // is done with (the third review's break: it wrote behind the bytes just lent).
    let prefill_again = agent(&pd, "prefill-i");
    assert!(
        matches!(
            prefill_again.load(one.as_bytes()),
            Err(NixlError::NotForUs { .. })
        ),
        "an old offer loaded by a new incarnation of its loader"
    );
    drop(prefill_again);
    drop(first.release()?);
    drop(decode);

    // The same name again, a new agent: its first offer is epoch 1 again.
    let again = agent(&dd, "decode-i");
    let mut second = again.register(db.reserve(LEN)?.commit()?)?;
    let offer = again.offer(&prefill.id(), &mut [&mut second])?;
    let mut peer = prefill.load(offer.as_bytes())?;
    // The earlier incarnation's offer, of the same name, does not extend this one's peer.
    let e = peer.extend(one.as_bytes()).unwrap_err();
    assert!(
        matches!(e, NixlError::Wire(w) if w == "an offer of another agent than the peer's"),
        "{e}"
    );
    prefill
        .write(&source, &[(0, LEN)], &peer, &[peer.range(0, 0, LEN)?], None)?
        .wait(DROP_WAIT)?;
    // Dropped, not `done`: a peer's drop acknowledges as `done` does.
    drop(peer);
    wait_until(|| second.token().is_ok());
    drop((second.release()?, source.release()?));
    drop((pb, db));
    drop((prefill, again));
    assert!(dd.close().is_clean());
    Ok(())
}

/// From the fourth review: proofs are per incarnation. A peer process's end covers the offers
/// made to that agent, not those made to a new agent of the same name (a restart: the old
/// process reaped after its replacement loaded an offer); and one incarnation's
/// acknowledgement does not cover another's offers.
#[test]
fn proofs_cover_one_incarnation_of_a_name() -> Result<(), Box<dyn std::error::Error + Send + Sync>>
{
    const TEST: &str = "proofs_cover_one_incarnation_of_a_name";
    if let Some(mut socket) = parent() {
        make_guard!(guard);
        let device = Device::new(guard, HostBackend::with_defaults()?);
        let loader = agent(&device, "loader-x");
        send(&mut socket, &loader.id().to_bytes());
        let offer = recv(&mut socket);
        let peer = loader.load(&offer)?;
        send(&mut socket, b"loaded");
        std::mem::forget(peer); // no acknowledgement: the process just ends
        std::process::exit(0);
    }
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let offering = agent(&device, "offering-x");
    let mut first = offering.register(binding.reserve(LEN)?.commit()?)?;
    let mut second = offering.register(binding.reserve(LEN)?.commit()?)?;
    let mut third = offering.register(binding.reserve(LEN)?.commit()?)?;

    let (mut child, mut socket) = peer_process(TEST);
    let old = AgentId::from_bytes(&recv(&mut socket))?;
    let offer = offering.offer(&old, &mut [&mut first])?;
    send(&mut socket, offer.as_bytes());
    assert_eq!(recv(&mut socket), b"loaded");

    // Its replacement, same name, another incarnation, loads an offer of its own.
    make_guard!(guard2);
    let device2 = Device::new(guard2, HostBackend::with_defaults()?);
    let replacement = agent(&device2, "loader-x");
    let offer = offering.offer(&replacement.id(), &mut [&mut second])?;
    let peer = replacement.load(offer.as_bytes())?;
    // A third incarnation of the name, which loads and acknowledges its own offer.
    make_guard!(guard3);
    let device3 = Device::new(guard3, HostBackend::with_defaults()?);
    let another = agent(&device3, "loader-x");
    let offer = offering.offer(&another.id(), &mut [&mut third])?;
    another.load(offer.as_bytes())?.done()?;
    wait_until(|| third.token().is_ok());
    assert!(
        second.token().is_err(),
        "another incarnation's acknowledgement covered this one's offer"
    );

    // SAFETY: `child` runs the agent `old`: it is this binary re-run as the peer
    // (`peer_process`), which made the agent "loader-x" and sent this id, and passed the offer
    // to no other process. It is this process's own child on this machine, waited for nowhere
    // else. It posted no transfer — it loaded the offer and exited — so no write of its can
    // land in this process after its end.
    unsafe { offering.peer_exited(&old, &mut child)? };
    assert!(
        first.token().is_ok(),
        "the old process ended: its offer is done"
    );
    assert!(
        second.token().is_err(),
        "the replacement still holds its offer: the old process's end is no proof for it"
    );
    peer.done()?;
    wait_until(|| second.token().is_ok());
    drop((first.release()?, second.release()?, third.release()?));
    drop(binding);
    drop((offering, replacement, another));
    assert!(device.close().is_clean());
    Ok(())
}

/// From the fifth review: metadata whose NIXL parts name an agent that is not UTF-8 is an
/// error, not a panic (nixl-sys unwraps the name), and the genuine offer loads afterwards; an
/// offer to the offering agent's own name is refused (NIXL would never load it).
#[test]
fn malformed_metadata_is_an_error_and_a_self_offer_is_refused()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "m");
    let mut target = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut target])?;
    let mut bytes = offer.as_bytes().to_vec();
    let name = b"decode-m";
    let at: Vec<usize> = (0..bytes.len() - name.len())
        .filter(|&i| &bytes[i..i + name.len()] == name)
        .collect();
    assert!(at.len() >= 2, "the name in the header and in NIXL's parts");
    for &i in &at[1..] {
        bytes[i] = 0xff; // NIXL's parts only: the header's name stays
    }
    let refused = prefill.load(&bytes);
    assert!(refused.is_err(), "malformed metadata loaded");
    drop(refused);
    let peer = prefill.load(offer.as_bytes())?; // the genuine one, afterwards
    peer.done()?;
    wait_until(|| target.token().is_ok());
    assert!(matches!(
        decode.offer(&decode.id(), &mut [&mut target]),
        Err(NixlError::SelfOffer(_))
    ));
    drop(target.release()?);
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    Ok(())
}

/// Where memtoken's offer (format `MTNIXL02`) keeps its regions: after the magic, four
/// numbers and the count; each region's record is its address, length, memory kind (`u32`: 0
/// DRAM, 1 VRAM) and device (`u64`).
const REGIONS_AT: usize = 8 + 32 + 4;
const REGION_BYTES: usize = 8 + 8 + 4 + 8;

/// `offer` as a peer whose `region`-th region is memory of `kind` (the wire's code) on device
/// `dev` would make it: what a GPU peer offers, which this machine cannot register.
fn offered_as(offer: &[u8], region: usize, kind: u32, dev: u64) -> Vec<u8> {
    assert_eq!(&offer[..8], b"MTNIXL02", "the format this helper knows");
    let at = REGIONS_AT + region * REGION_BYTES + 16;
    let mut bytes = offer.to_vec();
    assert_eq!(
        bytes[at..at + 12],
        [0; 12],
        "a host region: DRAM on device 0"
    );
    bytes[at..at + 4].copy_from_slice(&kind.to_le_bytes());
    bytes[at + 4..at + 12].copy_from_slice(&dev.to_le_bytes());
    bytes
}

/// The peer's side of a transfer is built with the peer's memory kind and
/// device, as its offer carries them, not with the loading agent's. A host agent loading an
/// offer whose first region is VRAM on device 1 (a GPU peer's) builds a VRAM list on device 1
/// for it, and a DRAM list on device 0 for the offer's host region; a transfer mixing the two
/// is refused by name before anything is posted; the host region still moves bytes. Before,
/// every remote list was the loading agent's DRAM on device 0: NIXL finds no such descriptor
/// in a GPU peer (`NOT_FOUND` on every transfer).
#[test]
fn the_remote_side_of_a_transfer_takes_the_peers_memory_kind_and_device()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use nixl_sys::MemType;
    two_sides!(pd, pb, prefill, dd, db, decode, "k");
    let mut gpu_region = decode.register(db.reserve(LEN)?.commit()?)?;
    let mut host_region = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut gpu_region, &mut host_region])?;
    let peer = prefill.load(&offered_as(offer.as_bytes(), 0, 1, 1))?;
    let regions: Vec<_> = peer.regions().collect();

    let gpu = peer.range(0, 4096, 8192)?;
    let list = peer.remote_list(&[gpu])?;
    assert_eq!(
        list.get_type()?,
        MemType::Vram,
        "the peer's kind, not this agent's DRAM"
    );
    let desc = list.get(0)?;
    assert_eq!(
        (desc.addr, desc.len, desc.dev_id),
        (regions[0].0 as usize + 4096, 8192, 1),
        "the peer's device"
    );
    let host = peer.range(1, 0, 4096)?;
    let list = peer.remote_list(&[host, peer.range(1, 4096, 4096)?])?;
    assert_eq!(list.get_type()?, MemType::Dram);
    assert_eq!((list.len()?, list.get(1)?.dev_id), (2, 0));

    let mut kv = pb.reserve(LEN)?.commit()?;
    fill(kv.as_mut_slice(), 5);
    let source = prefill.register(kv)?;
    let mixed = prefill
        .write(
            &source,
            &[(0, 4096), (4096, 4096)],
            &peer,
            &[peer.range(0, 0, 4096)?, host],
            None,
        )
        .err();
    match mixed {
        Some(NixlError::MixedKinds { first, other }) => {
            assert_eq!((first, other), ("VRAM", "DRAM"));
        }
        other => panic!("a transfer mixing VRAM and DRAM was not refused: {other:?}"),
    }
    assert!(!source.is_poisoned(), "nothing was posted");
    prefill
        .write(&source, &[(0, 4096)], &peer, &[host], None)?
        .wait(DROP_WAIT)?;
    peer.done()?;
    wait_until(|| host_region.token().is_ok());
    check(&host_region.token()?.as_slice()[..4096], 5);
    drop((
        gpu_region.release()?,
        host_region.release()?,
        source.release()?,
    ));
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    assert!(pd.close().is_clean());
    Ok(())
}

/// `offer` in memtoken's old format, `MTNIXL01`: the same header and parts, each region only
/// its address and length (no memory kind, no device).
fn in_format_01(offer: &[u8]) -> Vec<u8> {
    assert_eq!(&offer[..8], b"MTNIXL02", "the format this helper knows");
    let n = u32::from_le_bytes(offer[REGIONS_AT - 4..REGIONS_AT].try_into().unwrap()) as usize;
    let mut old = b"MTNIXL01".to_vec();
    old.extend_from_slice(&offer[8..REGIONS_AT]);
    for region in 0..n {
        let at = REGIONS_AT + region * REGION_BYTES;
        old.extend_from_slice(&offer[at..at + 16]);
    }
    old.extend_from_slice(&offer[REGIONS_AT + n * REGION_BYTES..]);
    old
}

/// An offer in the old format (`MTNIXL01`, from a memtoken before regions
/// carried their kind and device) is refused by name — `NixlError::Version`, by `load` and by
/// `extend` — never read as the new format; nothing of it stays loaded (the genuine offer
/// loads afterwards).
#[test]
fn an_offer_in_the_old_format_is_refused_by_name()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    two_sides!(pd, pb, prefill, dd, db, decode, "v");
    let mut first = decode.register(db.reserve(LEN)?.commit()?)?;
    let mut second = decode.register(db.reserve(LEN)?.commit()?)?;
    let offer = decode.offer(&prefill.id(), &mut [&mut first])?;
    let old = in_format_01(offer.as_bytes());
    match prefill.load(&old) {
        Err(NixlError::Version { found }) => assert_eq!(found, "MTNIXL01"),
        other => panic!("an offer in the old format was not refused by name: {other:?}"),
    }
    let e = prefill.load(&old).expect_err("refused again");
    assert!(e.to_string().contains("MTNIXL01"), "{e}");

    let mut peer = prefill.load(offer.as_bytes())?; // the genuine one, afterwards
    let later = decode.offer(&prefill.id(), &mut [&mut second])?;
    match peer.extend(&in_format_01(later.as_bytes())) {
        Err(NixlError::Version { found }) => assert_eq!(found, "MTNIXL01"),
        other => panic!("extended with an offer in the old format: {other:?}"),
    }
    assert_eq!(peer.regions().len(), 1, "the peer is unchanged");
    peer.extend(later.as_bytes())?;
    assert_eq!(peer.regions().len(), 2);
    peer.done()?;
    wait_until(|| first.token().is_ok() && second.token().is_ok());
    drop((first.release()?, second.release()?));
    drop((pb, db));
    drop((prefill, decode));
    assert!(dd.close().is_clean());
    assert!(pd.close().is_clean());
    Ok(())
}

/// A NIXL failure converted into the crate's [`memtoken::Error`] opens its message with its
/// summary, then its own words.
#[test]
fn a_nixl_failure_opens_its_message_with_its_summary() {
    let message = memtoken::Error::from(NixlError::OtherAgent).to_string();
    assert!(
        message.starts_with("a NIXL transfer step failed: a registration"),
        "{message}"
    );
}

/// A transfer posted by one agent with memory another agent of the same device registered is
/// refused (`OtherAgent`): nothing is posted; the offer then ends as usual and both ledgers end at
/// zero.
#[test]
fn a_registration_of_another_agent_of_the_same_device_is_refused()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(g);
    let device = Device::new(g, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let a = agent(&device, "same-device-a");
    let b = agent(&device, "same-device-b");
    let source = a.register(binding.reserve(LEN)?.commit()?)?;
    let mut target = a.register(binding.reserve(LEN)?.commit()?)?;
    let offer = a.offer(&b.id(), &mut [&mut target])?;
    let peer = b.load(offer.as_bytes())?;
    let refused = b
        .write(&source, &[(0, LEN)], &peer, &[peer.range(0, 0, LEN)?], None)
        .map(|t| t.bytes());
    assert!(matches!(refused, Err(NixlError::OtherAgent)), "{refused:?}");
    peer.done()?;
    wait_until(|| target.token().is_ok());
    drop(target.release()?);
    drop(source.release()?);
    drop(binding);
    drop((b, a));
    assert!(device.close().is_clean());
    Ok(())
}

/// An offer to a peer replaces that peer's earlier exposure of the memory and keeps the other
/// peers': offered to x, to y, then to x again, the memory is exposed to x and y, once each —
/// and stays withheld for them, never acknowledged. An agent's id says its name.
#[test]
fn a_second_offer_to_a_peer_replaces_its_exposure_and_keeps_the_others()
-> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    make_guard!(g);
    let device = Device::new(g, HostBackend::with_defaults()?);
    let binding = device.bind(Budget::unlimited())?;
    let offering = agent(&device, "offering");
    assert_eq!(offering.id().name(), "offering");
    assert_eq!(offering.id().to_string(), "offering");
    let mut target = offering.register(binding.reserve(LEN)?.commit()?)?;
    for peer in ["x", "y", "x"] {
        let _never_loaded = offering.offer(&stranger(peer), &mut [&mut target])?;
    }
    match target.token() {
        Err(NixlError::Exposed { mut peers, .. }) => {
            peers.sort();
            assert_eq!(peers, ["x", "y"]);
        }
        other => panic!("exposed to two peers: no token lent, got {other:?}"),
    }
    let e = target.release().expect_err("never acknowledged");
    assert!(e.to_string().contains("peer x"), "{e}");
    drop(binding);
    drop(offering);
    assert!(!device.close().is_clean(), "withheld memory stays counted");
    Ok(())
}

#[path = "nixl/blocks.rs"]
mod blocks;
