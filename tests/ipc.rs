//! Shared prefixes across processes: export, the message over a Unix domain socket, import in
//! a child process (this test binary run again), read-only mappings there, and the physical
//! memory given back once the owner, the export and the child are gone.

use memtoken::backend::{HostBackend, Op, PosixFd, doubles::Faulty};
use memtoken::{
    Budget, Device, make_guard, sharing::ImportError, sharing::MESSAGE_LEN, sharing::Offer,
    sharing::PrefixMessage, sharing::WireError,
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
fn nothing_left(o: memtoken::backend::doubles::Outstanding) -> bool {
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
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "a_child_imports_a_prefix_read_only_and_the_pages_go_back_after_it",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD_ENV, &path)
        // Its own run's lines ("running 1 test", "… filtered out") would mix into this one's:
        // kept, and shown only if it fails.
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
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
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the child's checks failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
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
    let mut buf = [0u8; memtoken::sharing::MESSAGE_LEN];
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
                let seals = SealFlags::SHRINK | SealFlags::WRITE;
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

/// A one-page message for `fd`-less tests and hand-made peers: `len` bytes in one granule of
/// a page, generation 1.
fn one_page_message() -> PrefixMessage {
    PrefixMessage {
        len: PAGE as u64,
        body_len: 0,
        granularity: PAGE as u64,
        kind: memtoken::backend::HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
}

/// A hostile peer's memfd of one page holding `byte`, sealed with `seals`, and its own
/// writable shared mapping made before the seals (unmapped by the caller with `munmap`).
fn peer_memfd(byte: u8, seals: rustix::fs::SealFlags) -> (rustix::fd::OwnedFd, *mut u8) {
    use rustix::fs::MemfdFlags;
    use rustix::mm::{MapFlags, ProtFlags};
    let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    let fd = rustix::fs::memfd_create("peer", flags).unwrap();
    rustix::fs::ftruncate(&fd, PAGE as u64).unwrap();
    let prot = ProtFlags::READ | ProtFlags::WRITE;
    // SAFETY: a new shared mapping where the kernel chooses, of a file this test owns.
    let map =
        unsafe { rustix::mm::mmap(std::ptr::null_mut(), PAGE, prot, MapFlags::SHARED, &fd, 0) }
            .unwrap()
            .cast::<u8>();
    // SAFETY: `map` is the page mapped read-write just above.
    unsafe { std::ptr::write_bytes(map, byte, PAGE) };
    rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    (fd, map)
}

/// `F_SEAL_FUTURE_WRITE` leaves the peer's writable mapping made before it writable: it could
/// change bytes lent here as `&[u8]`, so an import of such a file is refused. The peer's
/// mapping really still writes (the hazard is real); the same file sealed with `F_SEAL_WRITE`
/// (which the kernel grants only with no writable mapping left) imports.
#[test]
fn an_import_of_memory_sealed_only_against_future_writes_is_refused() {
    use rustix::fs::SealFlags;
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let binding = device.bind(Budget::bytes(0)).unwrap();
    let weak = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
    let (fd, map) = peer_memfd(0x01, weak);
    // SAFETY: the peer's own writable mapping, still live.
    unsafe { map.write(0x42) };
    let mut byte = [0u8];
    rustix::io::pread(&fd, &mut byte, 0).unwrap();
    assert_eq!(
        byte,
        [0x42],
        "the mapping made before the seal still writes"
    );
    let offer = Offer::new(&one_page_message().encode(), vec![fd]).unwrap();
    let e = binding.import(offer).unwrap_err();
    assert!(format!("{e:?}").contains("F_SEAL_WRITE"), "{e:?}");
    assert_eq!(device.ledger().reserved_bytes, 0, "nothing left reserved");
    // SAFETY: the mapping made by `peer_memfd`, unmapped once.
    unsafe { rustix::mm::munmap(map.cast(), PAGE) }.unwrap();

    // With no writable mapping left, the peer can seal against every write: imported.
    let (fd, map) = peer_memfd(0x07, SealFlags::SHRINK | SealFlags::GROW);
    // SAFETY: the mapping made by `peer_memfd`, unmapped once.
    unsafe { rustix::mm::munmap(map.cast(), PAGE) }.unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE | SealFlags::SEAL).unwrap();
    let offer = Offer::new(&one_page_message().encode(), vec![fd]).unwrap();
    let imported = binding.import(offer).expect("sealed against every write");
    assert!(imported.as_slice().iter().all(|&b| b == 0x07));
    drop(imported);
    drop(binding);
    assert!(device.close().is_clean());
}

/// The descriptors of one message received raw, as a peer holds them.
fn recv_raw_fds(socket: &UnixStream) -> Vec<rustix::fd::OwnedFd> {
    let mut buf = [0u8; MESSAGE_LEN];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let flags = rustix::net::RecvFlags::CMSG_CLOEXEC;
    rustix::net::recvmsg(socket, &mut iov, &mut control, flags).unwrap();
    let mut fds = Vec::new();
    for message in control.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    fds
}

/// An export makes the memory immutable for good (`F_SEAL_WRITE`), after making every mapping
/// of it in this process read-only — the owner's and an in-process sharer's made before it —
/// and no byte either of them reads changes.
#[test]
fn an_export_seals_writes_with_an_in_process_sharer_and_changes_no_byte() {
    use rustix::fs::SealFlags;
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let len = 3 * PAGE; // a body and a boundary: two files
    let mut prefix = owner
        .reserve(len)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    for (i, b) in prefix.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = pattern(i);
    }
    let sharer = owner
        .reserve(len)
        .unwrap()
        .map_prefix(&prefix)
        .map_err(|e| e.cause)
        .unwrap();
    assert!(perms(prefix.addr()).starts_with("rw"), "writable before");
    let export = prefix.export().unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    export.send(&a).unwrap();
    let fds = recv_raw_fds(&b);
    assert_eq!(fds.len(), 2);
    for fd in &fds {
        let seals = rustix::fs::fcntl_get_seals(fd).unwrap();
        assert!(
            seals.contains(SealFlags::WRITE | SealFlags::SEAL),
            "{seals:?}"
        );
    }
    for token_bytes in [prefix.as_slice(), sharer.as_slice()] {
        let wrong = token_bytes
            .iter()
            .enumerate()
            .filter(|&(i, &b)| b != pattern(i))
            .count();
        assert_eq!(wrong, 0, "every byte unchanged");
    }
    for addr in [prefix.addr(), prefix.addr() + len - 1, sharer.addr()] {
        assert!(perms(addr).starts_with("r-"), "{addr:#x}: {}", perms(addr));
    }
    // A second export of sealed memory sends the same memory again.
    let again = prefix.export().unwrap();
    again.send(&a).unwrap();
    assert_eq!(recv_raw_fds(&b).len(), 2);
    drop((again, export, sharer, prefix));
    drop(owner);
    assert!(device.close().is_clean());
}

/// A pipe holding references on the pages of `bytes` (`vmsplice` into its write end), as an
/// RDMA registration pins them, until its bytes are read out or it is closed: (read end, write
/// end).
fn hold_pages(bytes: &[u8]) -> (rustix::fd::OwnedFd, rustix::fd::OwnedFd) {
    let (read, write) = rustix::pipe::pipe().unwrap();
    let bufs = [rustix::pipe::IoSliceRaw::from_slice(bytes)];
    // SAFETY: `write` is the pipe's write end, so the pipe only reads the bytes (it holds
    // references on their pages until they are read out).
    let held = unsafe { rustix::pipe::vmsplice(&write, &bufs, rustix::pipe::SpliceFlags::empty()) };
    assert_eq!(held.unwrap(), bytes.len(), "every page held");
    (read, write)
}

/// Memory whose pages are held by someone else (a pipe's `vmsplice` reference here, an RDMA
/// registration's pin in a serving engine) cannot be sealed against writes: the export is
/// refused with a clear error before anything changed — the owner still writes it, its
/// mapping is writable again — and succeeds once the pages are let go.
#[test]
fn an_export_of_pinned_memory_is_refused_and_changes_nothing() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = owner
        .reserve(PAGE)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    prefix.as_mut_slice().unwrap().fill(3);
    let (read, write) = hold_pages(prefix.as_slice());
    let e = prefix.export().unwrap_err();
    assert!(
        matches!(
            e.cause,
            memtoken::backend::Cause::Violation(memtoken::backend::Violation::Unsealable { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("sealed against writes"), "{e}");
    assert!(perms(prefix.addr()).starts_with("rw"), "writable again");
    prefix
        .as_mut_slice()
        .expect("not exported: still writable")
        .fill(4);
    // Let the pages go: the export goes through now.
    let mut out = vec![0u8; PAGE];
    rustix::io::read(&read, &mut out).unwrap();
    assert!(
        out.iter().all(|&b| b == 4),
        "the pipe referenced the owner's pages"
    );
    drop((read, write));
    let export = prefix.export().expect("nothing pins the pages any more");
    assert!(perms(prefix.addr()).starts_with("r-"));
    drop((export, prefix));
    drop(owner);
    assert!(device.close().is_clean());
}

/// A connected pair of Unix domain sockets of `kind`, the receiver's wait bounded by 10 s so
/// that a receiver that waits for a second record fails the test instead of hanging it.
fn record_pair(kind: rustix::net::SocketType) -> (rustix::fd::OwnedFd, rustix::fd::OwnedFd) {
    use rustix::net::{AddressFamily, SocketFlags, sockopt};
    let (a, b) =
        rustix::net::socketpair(AddressFamily::UNIX, kind, SocketFlags::CLOEXEC, None).unwrap();
    let bound = Some(std::time::Duration::from_secs(10));
    sockopt::set_socket_timeout(&b, sockopt::Timeout::Recv, bound).unwrap();
    (a, b)
}

/// Sends `bytes` as one record (or one piece of a stream), with `fds`.
fn send_record(socket: &rustix::fd::OwnedFd, bytes: &[u8], fds: &[rustix::fd::BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    let iov = [std::io::IoSlice::new(bytes)];
    let sent = rustix::net::sendmsg(socket, &iov, &mut control, SendFlags::empty()).unwrap();
    assert_eq!(sent, bytes.len());
}

/// A page-sized memfd, as the descriptor of a one-page message.
fn page_file() -> rustix::fd::OwnedFd {
    let fd = rustix::fs::memfd_create("record", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, PAGE as u64).unwrap();
    fd
}

const RECORD_KINDS: [rustix::net::SocketType; 2] = [
    rustix::net::SocketType::SEQPACKET,
    rustix::net::SocketType::DGRAM,
];

/// On a record socket a lone short record is a truncated message at once: the receiver does
/// not wait for more.
#[test]
fn a_short_record_is_an_error_without_blocking() {
    use std::os::fd::AsFd;
    for kind in RECORD_KINDS {
        let (a, b) = record_pair(kind);
        let file = page_file();
        send_record(&a, &one_page_message().encode()[..8], &[file.as_fd()]);
        let e = Offer::recv(&b).unwrap_err();
        assert!(
            matches!(e, WireError::Truncated { got: 8 }),
            "{kind:?}: {e}"
        );
    }
}

/// Two records are never read as one message: the first 8 bytes of a message in one record
/// and the rest (with 55 bytes more) in the next are a short record and a long one, not a
/// message; a whole record after them is read as itself.
#[test]
fn two_records_are_never_read_as_one() {
    use std::os::fd::AsFd;
    let bytes = one_page_message().encode();
    let mut long = bytes[8..].to_vec();
    long.extend([0u8; 55]); // 111 bytes
    for kind in RECORD_KINDS {
        let (a, b) = record_pair(kind);
        let file = page_file();
        send_record(&a, &bytes[..8], &[file.as_fd()]);
        send_record(&a, &long, &[]);
        send_record(&a, &bytes, &[file.as_fd()]);
        let first = Offer::recv(&b).unwrap_err();
        assert!(
            matches!(first, WireError::Truncated { got: 8 }),
            "{kind:?}: {first}"
        );
        let second = Offer::recv(&b).unwrap_err();
        assert!(
            matches!(second, WireError::Malformed(_)),
            "{kind:?}: {second}"
        );
        let third = Offer::recv(&b).expect("a whole record is a whole message");
        assert_eq!(*third.message(), one_page_message());
    }
}

/// A record longer than a message is malformed, and the descriptors that came with it are
/// closed, not kept.
#[test]
fn a_record_longer_than_a_message_is_malformed_and_its_descriptors_closed() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let mut bytes = one_page_message().encode().to_vec();
    bytes.push(0);
    for kind in RECORD_KINDS {
        let (a, b) = record_pair(kind);
        let file = page_file();
        let inode = std::fs::File::from(rustix::io::dup(&file).unwrap())
            .metadata()
            .unwrap()
            .ino();
        send_record(&a, &bytes, &[file.as_fd()]);
        drop(file);
        let e = Offer::recv(&b).unwrap_err();
        assert!(matches!(e, WireError::Malformed(_)), "{kind:?}: {e}");
        assert_eq!(open_descriptors_of(&[inode]), 0, "{kind:?}: closed");
    }
}

/// A peer that sends part of a message on a stream socket and then stalls keeps a blocking
/// receiver waiting — as long as the socket's own receive timeout, which bounds it: the
/// receiver then gets an I/O error (`WouldBlock`), and the descriptors that came are closed.
#[test]
fn a_stalled_peer_on_a_stream_socket_is_bounded_by_the_receive_timeout() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(std::time::Duration::from_millis(100)))
        .unwrap();
    let file = page_file();
    let inode = std::fs::File::from(rustix::io::dup(&file).unwrap())
        .metadata()
        .unwrap()
        .ino();
    let a = rustix::fd::OwnedFd::from(a);
    send_record(&a, &one_page_message().encode()[..8], &[file.as_fd()]);
    drop(file);
    let e = Offer::recv(&b).unwrap_err();
    assert!(
        matches!(&e, WireError::Io(io) if io.kind() == std::io::ErrorKind::WouldBlock),
        "{e:?}"
    );
    assert_eq!(open_descriptors_of(&[inode]), 0, "closed");
    drop(a); // the peer is still connected until here: the receiver was not woken by a close
}

/// A prefix whose body is sealed by an export whose boundary is then refused (its pages held)
/// is never written by its owner again: the body is read-only for good, so `as_mut_slice`
/// must not lend it — a write there would fault.
#[test]
fn an_export_refused_after_its_body_was_sealed_leaves_the_prefix_read_only() {
    make_guard!(guard);
    let device = Device::new(guard, HostBackend::with_defaults().unwrap());
    let owner = device.bind(Budget::unlimited()).unwrap();
    let mut prefix = owner
        .reserve(3 * PAGE)
        .unwrap()
        .commit_prefix_exportable::<PosixFd>()
        .unwrap();
    prefix.as_mut_slice().unwrap().fill(5);
    let _held = hold_pages(&prefix.as_slice()[2 * PAGE..]);
    let e = prefix.export().unwrap_err();
    assert!(e.to_string().contains("sealed against writes"), "{e}");
    assert!(perms(prefix.addr()).starts_with("r-"), "the body is sealed");
    assert!(
        perms(prefix.addr() + 2 * PAGE).starts_with("rw"),
        "the boundary as it was"
    );
    assert!(
        prefix.as_mut_slice().is_none(),
        "never lends the sealed body as &mut"
    );
    assert!(prefix.as_slice().iter().all(|&b| b == 5));
    drop(prefix);
    drop(owner);
    assert!(device.close().is_clean());
}

/// After an export the backend's record agrees with the kernel: the mappings it made read-only
/// are recorded read-only, so a write through them is refused as an error, never attempted
/// (it would fault), and the sealed memory is never mapped read-write again.
#[test]
fn after_an_export_the_backend_refuses_every_write_to_the_sealed_memory() {
    use memtoken::backend::{Access, Backend, Cause, Exportable, Violation};
    let backend = HostBackend::with_defaults().unwrap();
    let phys = Exportable::<PosixFd>::create_exportable(&backend, PAGE).unwrap();
    let (a, b) = (
        backend.reserve(PAGE).unwrap(),
        backend.reserve(PAGE).unwrap(),
    );
    backend.map(a, PAGE, phys, Access::ReadWrite).unwrap();
    backend
        .copy_from_host(a, &[1])
        .expect("writable before the export");
    let handle = Exportable::<PosixFd>::export(&backend, phys, PAGE).unwrap();
    let read_only = |r: Result<(), memtoken::backend::BackendError>| matches!(r, Err(e) if matches!(e.cause, Cause::Violation(Violation::ReadOnly { .. })));
    assert!(
        read_only(backend.copy_from_host(a, &[2])),
        "recorded read-only"
    );
    assert!(read_only(backend.map(b, PAGE, phys, Access::ReadWrite)));
    let other = backend.create(PAGE).unwrap();
    let c = backend.reserve(PAGE).unwrap();
    backend.map(c, PAGE, other, Access::ReadWrite).unwrap();
    assert!(read_only(backend.copy_into_phys(phys, c, PAGE)));
    backend.unmap(c, PAGE).unwrap();
    backend.free(c, PAGE).unwrap();
    backend.release(other, PAGE).unwrap();
    backend
        .map(b, PAGE, phys, Access::ReadOnly)
        .expect("read-only maps go on");
    let mut byte = [0u8];
    backend.copy_to_host(&mut byte, b).unwrap();
    assert_eq!(byte, [1], "the bytes written before the export");
    drop(handle);
    for addr in [a, b] {
        backend.unmap(addr, PAGE).unwrap();
        backend.free(addr, PAGE).unwrap();
    }
    backend.release(phys, PAGE).unwrap();
}
