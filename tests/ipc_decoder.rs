//! Property test of the prefix message decoder and the host import: arbitrary bytes and
//! arbitrary descriptors give an error value or a valid import — never a panic, never a
//! mapping larger than the memory the descriptors hold (every byte of an import is read, so a
//! mapping past the end of its file would fault the test).

use memtoken::backend::{Faulty, HandleType, HostBackend};
use memtoken::{Budget, Device, MESSAGE_LEN, Offer, PrefixMessage, make_guard};
use proptest::prelude::*;
use rustix::fd::OwnedFd;
use rustix::fs::{MemfdFlags, SealFlags};

const PAGE: u64 = 4096;

/// A descriptor to send: a memfd of `pages` pages (its bytes `seed`), sealed against shrinking
/// and writes or not, or a socket (not a file).
#[derive(Clone, Debug)]
enum Fd {
    Memfd { pages: u64, sealed: bool, seed: u8 },
    Pipe,
}

impl Fd {
    fn make(&self) -> OwnedFd {
        match *self {
            Fd::Memfd {
                pages,
                sealed,
                seed,
            } => {
                let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
                let fd = rustix::fs::memfd_create("prop", flags).unwrap();
                let bytes = vec![seed; (pages * PAGE) as usize];
                rustix::io::pwrite(&fd, &bytes, 0).unwrap();
                if sealed {
                    let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE;
                    rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
                }
                fd
            }
            Fd::Pipe => std::os::unix::net::UnixStream::pair().unwrap().0.into(),
        }
    }

    fn size(&self) -> u64 {
        match *self {
            Fd::Memfd { pages, .. } => pages * PAGE,
            Fd::Pipe => 0,
        }
    }
}

fn fd() -> impl Strategy<Value = Fd> {
    prop_oneof![
        4 => (0u64..6, prop::bool::weighted(0.8), any::<u8>())
            .prop_map(|(pages, sealed, seed)| Fd::Memfd { pages, sealed, seed }),
        1 => Just(Fd::Pipe),
    ]
}

/// A field near the values that matter: 0, pages, a little off, or anything.
fn field() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        (1u64..6).prop_map(|n| n * PAGE),
        (0u64..6 * PAGE),
        any::<u64>(),
    ]
}

/// A message: a well-formed layout of 1 to 5 pages at small offsets, or fields near the
/// values that matter.
fn message() -> impl Strategy<Value = Vec<u8>> {
    let offset = || prop_oneof![Just(0), Just(PAGE), field()];
    let layout = (1u64..4, 1u64..1000, offset(), offset()).prop_map(
        |(pages, generation, body_offset, boundary_offset)| {
            let len = pages * PAGE;
            PrefixMessage {
                len,
                body_len: len - PAGE,
                granularity: PAGE,
                kind: HandleType::PosixFd,
                generation,
                body_offset: if pages > 1 { body_offset } else { 0 },
                boundary_offset,
            }
            .encode()
            .to_vec()
        },
    );
    prop_oneof![layout, fields()]
}

/// A message from fields near the values that matter.
fn fields() -> impl Strategy<Value = Vec<u8>> {
    (
        field(),
        field(),
        prop_oneof![Just(PAGE), field()],
        field(),
        field(),
        field(),
    )
        .prop_map(
            |(len, body_len, granularity, generation, body_offset, boundary_offset)| {
                PrefixMessage {
                    len,
                    body_len,
                    granularity,
                    kind: HandleType::PosixFd,
                    generation,
                    body_offset,
                    boundary_offset,
                }
                .encode()
                .to_vec()
            },
        )
}

/// Bytes: a message from plausible fields, then perhaps a byte changed or the tail cut; or
/// anything at all.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => message(),
        2 => (message(), 0..MESSAGE_LEN, any::<u8>()).prop_map(|(mut b, at, v)| {
            b[at] = v;
            b
        }),
        1 => (message(), 0..=MESSAGE_LEN + 2).prop_map(|(mut b, n)| {
            b.resize(n, 0);
            b
        }),
        1 => proptest::collection::vec(any::<u8>(), 0..=MESSAGE_LEN + 2),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(1000)
    ))]

    #[test]
    fn any_message_and_descriptors_give_an_error_or_a_valid_import(
        bytes in bytes(),
        fds in prop_oneof![
            1 => proptest::collection::vec(fd(), 0..4),
            3 => proptest::collection::vec(fd(), 1..3),
        ],
    ) {
        make_guard!(guard);
        let backend = Faulty::new(HostBackend::with_defaults().unwrap());
        let faults = backend.handle();
        let device = Device::new(guard, backend);
        let binding = device.bind(Budget::bytes(0)).unwrap();
        let sizes: Vec<u64> = fds.iter().map(Fd::size).collect();
        let seeds: Vec<Option<u8>> = fds
            .iter()
            .map(|f| match *f { Fd::Memfd { seed, .. } => Some(seed), Fd::Pipe => None })
            .collect();
        let owned = fds.iter().map(Fd::make).collect();
        if let Ok(offer) = Offer::new(&bytes, owned) {
            let m = *offer.message();
            // Each piece fits in its descriptor's file: checked before anything is mapped. A
            // descriptor that is not a file (a pipe here, a CUDA driver's descriptor elsewhere)
            // is let through to the backend, which checks it: the host refuses it.
            let pieces: Vec<(u64, u64)> = if m.body_len > 0 {
                vec![(m.body_offset, m.body_len), (m.boundary_offset, m.granularity)]
            } else {
                vec![(m.boundary_offset, m.granularity)]
            };
            prop_assert_eq!(pieces.len(), sizes.len());
            for ((&(offset, len), &size), seed) in pieces.iter().zip(&sizes).zip(&seeds) {
                if seed.is_some() {
                    prop_assert!(offset.checked_add(len).is_some_and(|end| end <= size));
                }
            }
            let any_pipe = seeds.iter().any(Option::is_none);
            let import = binding.import(offer);
            prop_assert!(!(any_pipe && import.is_ok()), "the host imported a pipe");
            if let Ok(imported) = import {
                prop_assert_eq!(imported.len() as u64, m.len);
                prop_assert_eq!(m.len, pieces.iter().map(|p| p.1).sum::<u64>());
                // Every byte is read: a mapping past the end of its file would fault here.
                let bytes = imported.as_slice();
                let mut at = 0;
                for (&(_, len), seed) in pieces.iter().zip(&seeds) {
                    let len = len as usize;
                    prop_assert!(bytes[at..at + len].iter().all(|b| Some(*b) == *seed));
                    at += len;
                }
                prop_assert_eq!(device.ledger().owned_bytes, 0);
            }
        }
        let o = faults.outstanding();
        prop_assert!(o.physical == 0 && o.mappings == 0 && o.reservations == 0, "{:?}", o);
        drop(binding);
        prop_assert!(device.close().is_clean());
    }
}
