//! Property test of the prefix message decoder and the host import: arbitrary bytes and
//! arbitrary descriptors give an error value or a valid import — never a panic, never a
//! mapping larger than the memory the descriptors hold (every byte of an import is read, so a
//! mapping past the end of its file would fault the test).

use crate::common::{self, GRANULE};
use memtoken::backend::{HandleType, HostBackend, doubles::Faulty};
use memtoken::{
    Budget, Device, make_guard, sharing::MESSAGE_LEN, sharing::Offer, sharing::PrefixMessage,
    sharing::WireError,
};
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
    #![proptest_config(ProptestConfig::with_cases(common::proptest_cases(1000)))]

    #[test]
    #[cfg_attr(miri, ignore = "imports a memfd, which Miri lacks")]
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

// ---------------------------------------------------------------------------------------------
// The decoder's checks, one by one
// ---------------------------------------------------------------------------------------------

/// Kills `src/sharing/ipc.rs: replace || with && in PrefixMessage::decode`: a message whose
/// length is no whole number of granules is malformed.
#[test]
fn a_message_of_no_whole_number_of_granules_is_malformed() {
    let g = GRANULE as u64;
    let message = PrefixMessage {
        len: 3 * g + 1,
        body_len: 2 * g + 1,
        granularity: g,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    };
    let bytes = message.encode();
    assert_eq!(bytes.len(), MESSAGE_LEN);
    assert!(
        matches!(
            PrefixMessage::decode(&bytes),
            Err(WireError::Malformed(m)) if m.contains("whole number of granules")
        ),
        "{:?}",
        PrefixMessage::decode(&bytes)
    );
}

/// Kills `src/sharing/ipc.rs: replace > with >= in PrefixMessage::decode`: lengths up to
/// `isize::MAX` decode (with a granularity of one byte it is a whole number of granules); one
/// byte more is malformed.
#[test]
fn a_message_may_claim_up_to_isize_max_bytes() {
    let most = isize::MAX as u64;
    let claiming = |len: u64| {
        PrefixMessage::decode(
            &PrefixMessage {
                len,
                body_len: len - 1,
                granularity: 1,
                kind: HandleType::PosixFd,
                generation: 1,
                body_offset: 0,
                boundary_offset: 0,
            }
            .encode(),
        )
    };
    assert_eq!(claiming(most).map(|m| m.len).ok(), Some(most));
    assert!(
        matches!(claiming(most + 1), Err(WireError::Malformed(m)) if m.contains("whole number")),
        "{:?}",
        claiming(most + 1)
    );
}

/// Kills `src/sharing/ipc.rs: replace == with != in PrefixMessage::decode`: a message with no
/// body may not name a body offset; one with a body may.
#[test]
fn only_a_message_with_a_body_names_a_body_offset() {
    let g = GRANULE as u64;
    let decoded = |len: u64, body_offset: u64| {
        PrefixMessage::decode(
            &PrefixMessage {
                len,
                body_len: len - g,
                granularity: g,
                kind: HandleType::PosixFd,
                generation: 1,
                body_offset,
                boundary_offset: 0,
            }
            .encode(),
        )
    };
    assert!(
        matches!(decoded(g, g), Err(WireError::Malformed(m)) if m.contains("body offset")),
        "{:?}",
        decoded(g, g)
    );
    assert_eq!(decoded(3 * g, g).map(|m| m.body_offset).ok(), Some(g));
}

/// Kills `src/sharing/ipc.rs: replace || with && in PrefixMessage::decode`: a granularity that
/// is no power of two is malformed.
#[test]
fn a_granularity_that_is_no_power_of_two_is_malformed() {
    let bytes = PrefixMessage {
        len: 3,
        body_len: 0,
        granularity: 3,
        kind: HandleType::PosixFd,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
    .encode();
    assert!(matches!(
        PrefixMessage::decode(&bytes),
        Err(WireError::Malformed("granularity is not a power of two"))
    ));
}

/// Kills `src/backend/export.rs: delete match arm 8 in HandleType::from_code` and `replace
/// HandleType::code -> u8 with 1`: the code of a fabric handle (8) names it, so a message of
/// fabric handles is refused as not descriptors, not as malformed.
#[test]
fn a_message_of_fabric_handles_is_refused_as_not_descriptors() {
    assert_eq!(HandleType::from_code(8), Some(HandleType::Fabric));
    assert_eq!(HandleType::Fabric.code(), 8);
    let g = GRANULE as u64;
    let bytes = PrefixMessage {
        len: g,
        body_len: 0,
        granularity: g,
        kind: HandleType::Fabric,
        generation: 1,
        body_offset: 0,
        boundary_offset: 0,
    }
    .encode();
    assert!(matches!(
        PrefixMessage::decode(&bytes),
        Err(WireError::NotADescriptor(HandleType::Fabric))
    ));
}

/// Kills `src/sharing/ipc.rs: replace match guard bytes.len() < MESSAGE_LEN with true in
/// PrefixMessage::decode`: bytes longer than a message are malformed, not truncated.
#[test]
fn bytes_longer_than_a_message_are_malformed() {
    assert!(matches!(
        PrefixMessage::decode(&[0; MESSAGE_LEN + 1]),
        Err(WireError::Malformed("longer than a message"))
    ));
}
