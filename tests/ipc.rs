//! Shared prefixes across processes: export, the message over a Unix domain socket, import in
//! a child process (this test binary run again), read-only mappings there, and the physical
//! memory given back once the owner, the export and the child are gone.

use memtoken::backend::{Faulty, HostBackend, Op, PosixFd};
use memtoken::{
    Budget, Device, ImportError, MESSAGE_LEN, Offer, PrefixMessage, WireError, make_guard,
};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;

const PAGE: usize = 4096;
/// The child's role: the path of the socket it connects to.
const CHILD_ENV: &str = "MEMTOKEN_IPC_CHILD";

/// The byte at `i` of the test prefix.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8 ^ 0x5a
}

/// `/proc/self/maps`' permissions of the mapping that holds `addr`.
fn perms(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("procfs");
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next().unwrap(), fields.next().unwrap());
        let (start, end) = range.split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        if (start..end).contains(&addr) {
            return perms.to_string();
        }
    }
    panic!("no mapping holds {addr:#x}");
}

/// The inode of the file mapped at `addr`, from `/proc/self/maps`.
fn inode_at(addr: usize) -> u64 {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("procfs");
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (start, end) = fields[0].split_once('-').unwrap();
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        if (start..end).contains(&addr) {
            return fields[4].parse().unwrap();
        }
    }
    panic!("no mapping holds {addr:#x}");
}

/// How many descriptors of this process name one of the files `inodes`.
fn open_descriptors_of(inodes: &[u64]) -> usize {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir("/proc/self/fd")
        .expect("procfs")
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .filter(|m| inodes.contains(&m.ino()))
        .count()
}

/// Nothing the backend handed out is left: no physical allocation or handle, no mapping.
fn nothing_left(o: memtoken::backend::Outstanding) -> bool {
    o.physical == 0 && o.mappings == 0 && o.reservations == 0
}

/// The child: imports the prefix offered on the socket at `path`, checks every byte, checks
/// that the mapping is read-only and cannot be made writable, and reports on the socket.
fn child(path: &str) {
    let mut socket = UnixStream::connect(path).expect("connect to the parent");
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::bytes(0)).unwrap(); // an importer owns nothing
    let offer = Offer::recv(&socket).expect("a valid offer");
    let imported = binding.import(offer).expect("imported");
    let bytes = imported.as_slice();
    let wrong = bytes
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(i))
        .count();
    assert_eq!(wrong, 0, "every byte as the exporter wrote it");
    let addr = imported.addr();
    let (first, last) = (perms(addr), perms(addr + imported.len() - 1));
    assert!(first.starts_with("r-") && first.ends_with('s'), "{first}");
    assert!(last.starts_with("r-") && last.ends_with('s'), "{last}");
    // The kernel refuses to make it writable: the descriptor behind it was opened read-only.
    let flags = rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE;
    // SAFETY: the range is the imported mapping, which this process holds; the call is expected
    // to fail, and if it did not the test fails before anything is written.
    let writable = unsafe { rustix::mm::mprotect(addr as *mut _, imported.len(), flags) };
    assert_eq!(writable, Err(rustix::io::Errno::ACCESS));
    let owned = device.ledger().owned_bytes;
    writeln!(socket, "ok owned={owned} len={}", imported.len()).unwrap();
    drop(imported);
    drop(binding);
    assert!(device.close().is_clean());
}

#[test]
fn a_child_imports_a_prefix_read_only_and_the_pages_go_back_after_it() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        return child(&path);
    }
    make_guard!(guard);
    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let owner = device.bind(Budget::unlimited()).unwrap();
    let len = 5 * PAGE;
    let mut prefix = owner
        .reserve(len)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    for (i, b) in prefix.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = pattern(i);
    }
    // The body's file and the boundary granule's.
    let inodes = [inode_at(prefix.addr()), inode_at(prefix.addr() + len - 1)];
    assert_ne!(inodes[0], inodes[1]);
    let export = prefix.export().unwrap();
    assert_eq!(device.outstanding_exports(), 1);
    assert!(
        prefix.as_mut_slice().is_none(),
        "exported: the owner cannot write"
    );
    assert_eq!(export.message().len, len as u64);

    let path = std::env::temp_dir().join(format!("memtoken-ipc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_child_imports_a_prefix_read_only_and_the_pages_go_back_after_it",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();
    let (mut socket, _) = listener.accept().unwrap();
    let _ = std::fs::remove_file(&path);
    export.send(&socket).unwrap();
    // The owner goes first: the export keeps the memory for the child.
    prefix.release().complete().unwrap();
    assert_eq!(device.custody().shared.count, 1, "still exported");
    let mut report = String::new();
    socket.read_to_string(&mut report).unwrap();
    assert!(child.wait().unwrap().success(), "the child's checks failed");
    assert_eq!(report.trim(), format!("ok owned=0 len={len}"));

    // The child is gone; the export ends: the pages go back.
    // Two descriptors each: the backend's and the export's read-only one.
    assert_eq!(open_descriptors_of(&inodes), 4);
    export.end();
    assert_eq!(device.outstanding_exports(), 0);
    // No process maps the files or holds a descriptor of them any more: the kernel frees them.
    assert_eq!(
        open_descriptors_of(&inodes),
        0,
        "a descriptor of the memory is left open"
    );
    assert!(
        nothing_left(faults.outstanding()),
        "{:?}",
        faults.outstanding()
    );
    drop(owner);
    assert!(device.close().is_clean());
}

/// An exporter and an importer in one process, over a socket pair.
#[test]
fn an_import_maps_exactly_the_export_owns_nothing_and_goes_once() {
    make_guard!(guard);
    let backend = Faulty::new(HostBackend::with_defaults().unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let owner = device.bind(Budget::unlimited()).unwrap();
    let importer = device.bind(Budget::bytes(0)).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    for len in [PAGE, 3 * PAGE] {
        let mut prefix = owner
            .reserve(len)
            .unwrap()
            .commit_prefix_exportable::<PosixFd>()
            .unwrap();
        prefix.as_mut_slice().unwrap().fill(7);
        let export = prefix.export().unwrap();
        export.send(&a).unwrap();
        let imported = importer.import(Offer::recv(&b).unwrap()).unwrap();
        assert_eq!(imported.len(), len);
        assert!(imported.as_slice().iter().all(|&x| x == 7));
        assert_eq!(importer.used(), 0);
        assert_eq!(
            device.ledger().owned_bytes,
            len as u64,
            "owned once, by the owner"
        );
        drop(prefix);
        drop(export);
        // The importer's handles keep the pages: its bytes are still there.
        assert!(imported.as_slice().iter().all(|&x| x == 7));
        let before = faults.calls(Op::Release);
        imported.release().complete().unwrap();
        assert_eq!(
            faults.calls(Op::Release) - before,
            1 + usize::from(len > PAGE) as u64
        );
        assert!(
            nothing_left(faults.outstanding()),
            "{:?}",
            faults.outstanding()
        );
    }
    drop((owner, importer));
    assert!(device.close().is_clean());
}

#[test]
fn a_wrong_or_short_message_is_an_error_value() {
    let (a, b) = UnixStream::pair().unwrap();
    (&a).write_all(&[0u8; MESSAGE_LEN]).unwrap();
    assert!(matches!(Offer::recv(&b), Err(WireError::Malformed(_))));
    (&a).write_all(b"MTPREFIX").unwrap();
    drop(a);
    assert!(matches!(
        Offer::recv(&b),
        Err(WireError::Truncated { got: 8 })
    ));
    let message = PrefixMessage::decode(&[1; 3]);
    assert!(matches!(message, Err(WireError::Truncated { got: 3 })));
}

/// A message whose bytes arrive in three pieces, the descriptor with the first, is read whole.
#[test]
fn a_message_sent_in_three_pieces_is_read_whole() {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::os::fd::AsFd;
    let file = rustix::fs::memfd_create("two-pieces", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&file, PAGE as u64).unwrap();
    let bytes = PrefixMessage {
        len: PAGE as u64,
        body_len: 0,
        granularity: PAGE as u64,
        kind: memtoken::backend::HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
    .encode();
    let (a, b) = UnixStream::pair().unwrap();
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [file.as_fd()];
    assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
    let first = [std::io::IoSlice::new(&bytes[..10])];
    rustix::net::sendmsg(&a, &first, &mut control, SendFlags::empty()).unwrap();
    // The rest comes later, in two pieces: each read can only have what came before it.
    let rest = std::thread::spawn(move || {
        for piece in [&bytes[10..30], &bytes[30..]] {
            std::thread::sleep(std::time::Duration::from_millis(50));
            (&a).write_all(piece).unwrap();
        }
        a
    });
    let offer = Offer::recv(&b).expect("the whole message, from three reads");
    assert_eq!(offer.message().len, PAGE as u64);
    drop(rest.join().unwrap());
}

/// A descriptor smaller than the message claims is refused before anything is mapped, and
/// one of another granularity is refused by the importer.
#[test]
fn a_descriptor_smaller_than_claimed_is_refused() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let prefix = owner
        .reserve(2 * PAGE)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    let export = prefix.export().unwrap();
    let mut message = *export.message();
    message.body_len = 2 * PAGE as u64; // claims 3 pages, the body's file holds 1
    message.len = 3 * PAGE as u64;
    let small = rustix::fs::memfd_create("small", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&small, PAGE as u64).unwrap();
    let other = rustix::fs::memfd_create("other", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&other, PAGE as u64).unwrap();
    let e = Offer::new(&message.encode(), vec![small, other]).unwrap_err();
    assert!(
        matches!(e, WireError::TooSmall { index: 0, size, .. } if size == PAGE as u64),
        "{e}"
    );

    // Another granularity: refused by the importer, nothing reserved.
    let mut message = *export.message();
    message.granularity = 2 * PAGE as u64;
    message.body_len = 0;
    let fd = rustix::fs::memfd_create("g", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 2 * PAGE as u64).unwrap();
    let offer = Offer::new(&message.encode(), vec![fd]).unwrap();
    let e = owner.import(offer).unwrap_err();
    assert!(matches!(e, ImportError::Granularity { .. }), "{e}");
    // An unsealed file is refused by the host backend: a shrink could make its mapping fault.
    let mut message = *export.message();
    message.len = PAGE as u64;
    message.body_len = 0;
    message.body_offset = 0;
    let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, PAGE as u64).unwrap();
    let offer = Offer::new(&message.encode(), vec![fd]).unwrap();
    let e = owner.import(offer).unwrap_err();
    assert!(e.to_string().contains("importing"), "{e}");
    assert_eq!(
        device.ledger().reserved_bytes,
        2 * PAGE as u64,
        "only the prefix"
    );
    drop((export, prefix));
    drop(owner);
    assert!(device.close().is_clean());
}

/// Exporting is one-way for writes: once the export ended, the owner still cannot write, since
/// an importer may still read the bytes (its `&[u8]` must not change).
#[test]
fn an_owner_never_writes_its_prefix_again_once_exported() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let importer = device.bind(Budget::bytes(0)).unwrap();
    let mut prefix = owner
        .reserve(PAGE)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    prefix.as_mut_slice().unwrap().fill(7);
    let export = prefix.export().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    export.send(&a).unwrap();
    let imported = importer.import(Offer::recv(&b).unwrap()).unwrap();
    export.end();
    assert!(prefix.as_mut_slice().is_none(), "never writable again");
    assert!(imported.as_slice().iter().all(|&b| b == 7));
    drop(imported);
    assert!(
        prefix.as_mut_slice().is_none(),
        "not even with no import left"
    );
}

/// The descriptor a peer receives cannot be used to write the memory, even opened again
/// read-write through `/proc/self/fd`: the file is sealed against every future write.
#[test]
fn a_peer_cannot_write_the_exported_memory_even_through_a_reopened_descriptor() {
    use rustix::fs::{Mode, OFlags};
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = owner
        .reserve(PAGE)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    prefix.as_mut_slice().unwrap().fill(7);
    let export = prefix.export().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    export.send(&a).unwrap();
    let offer = Offer::recv(&b).unwrap();
    let _ = offer;
    // The same descriptors again, as raw files, as a hostile peer would hold them.
    export.send(&a).unwrap();
    let mut buf = [0u8; memtoken::MESSAGE_LEN];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    rustix::net::recvmsg(
        &b,
        &mut iov,
        &mut control,
        rustix::net::RecvFlags::CMSG_CLOEXEC,
    )
    .unwrap();
    let mut fds = Vec::new();
    for message in control.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    assert!(!fds.is_empty());
    for fd in &fds {
        assert!(
            rustix::io::pwrite(fd, &[1], 0).is_err(),
            "read-only descriptor"
        );
        let path = format!("/proc/self/fd/{}", rustix::fd::AsRawFd::as_raw_fd(fd));
        if let Ok(rw) = rustix::fs::open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()) {
            assert!(
                rustix::io::pwrite(&rw, &[0xee], 0).is_err(),
                "sealed against future writes"
            );
        }
    }
    assert!(
        prefix.as_slice().iter().all(|&b| b == 7),
        "the owner's bytes unchanged"
    );
}

/// The seals are checked before the size: a peer that shrinks its file and seals it between
/// the two checks can never make the importer map past the end of the file.
#[test]
fn an_import_never_maps_past_a_file_shrunk_while_it_was_checked() {
    use memtoken::backend::{Backend, Exportable, Shareable};
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    const TRIALS: u64 = 20_000;
    let backend = Arc::new(HostBackend::with_defaults().unwrap());
    let (go, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let slot: Arc<Mutex<Option<rustix::fd::OwnedFd>>> = Arc::default();
    let attacker = {
        let (go, done, slot) = (go.clone(), done.clone(), slot.clone());
        std::thread::spawn(move || {
            for t in 1..=TRIALS {
                while go.load(Ordering::Acquire) != t {
                    std::hint::spin_loop();
                }
                let fd = slot.lock().unwrap().take().unwrap();
                for _ in 0..(t % 64) * 8 {
                    std::hint::spin_loop();
                }
                rustix::fs::ftruncate(&fd, 0).unwrap();
                let seals = SealFlags::SHRINK | SealFlags::FUTURE_WRITE;
                rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
                done.store(t, Ordering::Release);
            }
        })
    };
    let mut accepted_short = 0;
    for t in 1..=TRIALS {
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        let fd = rustix::fs::memfd_create("race", flags).unwrap();
        rustix::fs::ftruncate(&fd, 2 * PAGE as u64).unwrap();
        *slot.lock().unwrap() = Some(rustix::io::dup(&fd).unwrap());
        let size = || rustix::fs::fstat(&fd).unwrap().st_size;
        go.store(t, Ordering::Release);
        let mine = rustix::io::dup(&fd).unwrap();
        let imported = backend.import(Shareable {
            fd: mine,
            offset: 0,
            len: 2 * PAGE,
        });
        while done.load(Ordering::Acquire) != t {
            std::hint::spin_loop();
        }
        if let Ok(phys) = imported {
            accepted_short += u64::from(size() < 2 * PAGE as i64);
            backend.release(phys, 2 * PAGE).unwrap();
        }
    }
    attacker.join().unwrap();
    assert_eq!(
        accepted_short, 0,
        "imports of a file now shorter than the mapping"
    );
}
