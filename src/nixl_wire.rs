//! The wire format of a NIXL offer (`nixl::PeerMetadata`, feature `nixl`) and the peer's side
//! of a transfer as computed from a decoded offer: pure Rust, with no NIXL type in it, so that
//! it is built and unit-tested without feature `nixl` too (a plain `cargo test`). `crate::nixl`
//! maps its memory kinds to NIXL's `MemType` and its errors to `NixlError`.
//!
//! **The format** (little-endian, fixed-size fields; each part length-prefixed with a `u32`):
//! [`MAGIC`] (`MTNIXL` and the version, `02`); the offer's epoch, the offering agent's
//! incarnation, the loading agent's incarnation and the offering agent's mailbox (`u64` each);
//! the number of regions (`u32`), then each region's address and length (`u64` each), its
//! memory kind ([`MemKind`], a `u32`) and its device (`u64`); then the parts: the names of the
//! agent it is offered to and of the offering agent, NIXL's connection information, the
//! regions' descriptors and the mailbox's descriptor.
//!
//! Version `01` had no memory kind and no device per region: the peer's side of every transfer
//! was built with the *loading* agent's kind and device, which NIXL cannot find in a peer of
//! another kind or on another device. An offer of another version is refused
//! ([`WireError::Version`]), never read as this one.

/// The first bytes of an offer: memtoken's NIXL metadata ([`FAMILY`]), then the format's
/// version.
pub(crate) const MAGIC: &[u8; 8] = b"MTNIXL02";
/// What every version of the format begins with.
const FAMILY: &[u8; 6] = b"MTNIXL";
/// The bytes of a region's record: address, length, kind, device.
const REGION_BYTES: usize = 8 + 8 + 4 + 8;

/// A region's memory kind, as an offer carries it: NIXL's `DRAM_SEG` or `VRAM_SEG`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Host memory (device id 0).
    Dram,
    /// GPU memory (the device id is the CUDA device's ordinal).
    Vram,
}

impl MemKind {
    /// Its code on the wire.
    fn code(self) -> u32 {
        match self {
            MemKind::Dram => 0,
            MemKind::Vram => 1,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(MemKind::Dram),
            1 => Some(MemKind::Vram),
            _ => None,
        }
    }

    /// Its name in NIXL's terms.
    pub(crate) fn name(self) -> &'static str {
        match self {
            MemKind::Dram => "DRAM",
            MemKind::Vram => "VRAM",
        }
    }
}

/// A region an offer exposes: its start and length in the offering process, its memory kind
/// and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) kind: MemKind,
    pub(crate) dev: u64,
}

/// A range of a peer's offered region (`Peer::range`): one descriptor of the peer's side of a
/// transfer — where, how long, and in which of the peer's memories: the memory kind and device
/// of the region it lies in, as the peer offered them. A transfer's remote side is built with
/// the peer's kind and device, not the loading agent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRange {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) kind: MemKind,
    pub(crate) dev: u64,
}

/// Why an offer cannot be read, or a range of it used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WireError {
    /// Not an offer, or a damaged one.
    Malformed(&'static str),
    /// memtoken's NIXL metadata in another version of the format (`found`: its first 8 bytes).
    Version { found: String },
    /// A region index past the regions offered.
    NoRegion { region: usize, regions: usize },
    /// A range outside its region.
    Range {
        offset: usize,
        len: usize,
        size: usize,
    },
    /// A transfer's remote ranges in two memory kinds.
    MixedKinds { first: MemKind, other: MemKind },
}

/// A decoded offer, borrowing its bytes.
#[derive(Debug)]
pub(crate) struct Decoded<'m> {
    pub(crate) epoch: u64,
    /// The offering agent's incarnation.
    pub(crate) instance: u64,
    /// The incarnation of the agent it is offered to.
    pub(crate) for_instance: u64,
    pub(crate) mailbox: u64,
    pub(crate) regions: Vec<Region>,
    pub(crate) offered_to: &'m [u8],
    pub(crate) offered_by: &'m [u8],
    pub(crate) conn: &'m [u8],
    pub(crate) md: &'m [u8],
    pub(crate) mailbox_md: &'m [u8],
}

/// An offer's bytes: `numbers` (epoch, the offering and the loading agents' incarnations, the
/// mailbox), the `regions`, then the `parts` (the agent it is offered to, the offering agent,
/// connection information, the regions' descriptors, the mailbox's descriptor).
pub(crate) fn encode(numbers: [u64; 4], regions: &[Region], parts: [&[u8]; 5]) -> Vec<u8> {
    let n = parts.iter().map(|p| 4 + p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(MAGIC.len() + 36 + regions.len() * REGION_BYTES + n);
    out.extend_from_slice(MAGIC);
    for number in numbers {
        out.extend_from_slice(&number.to_le_bytes());
    }
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for region in regions {
        out.extend_from_slice(&region.addr.to_le_bytes());
        out.extend_from_slice(&region.len.to_le_bytes());
        out.extend_from_slice(&region.kind.code().to_le_bytes());
        out.extend_from_slice(&region.dev.to_le_bytes());
    }
    for part in parts {
        out.extend_from_slice(&(part.len() as u32).to_le_bytes());
        out.extend_from_slice(part);
    }
    out
}

/// Reads an offer: [`WireError::Version`] for memtoken's metadata in another version of the
/// format (checked before anything else is read), [`WireError::Malformed`] for anything else
/// that is not an offer of this format.
pub(crate) fn decode(bytes: &[u8]) -> Result<Decoded<'_>, WireError> {
    let mut at = Reader(bytes);
    let magic = at.take(MAGIC.len())?;
    if magic != MAGIC {
        return Err(if magic.starts_with(FAMILY) {
            WireError::Version {
                found: String::from_utf8_lossy(magic).into_owned(),
            }
        } else {
            WireError::Malformed("not memtoken's NIXL metadata")
        });
    }
    let epoch = at.u64()?;
    let instance = at.u64()?;
    let for_instance = at.u64()?;
    let mailbox = at.u64()?;
    let n = at.u32()? as usize;
    if n > bytes.len() / REGION_BYTES {
        return Err(WireError::Malformed("more regions than bytes"));
    }
    let regions = (0..n)
        .map(|_| {
            let (addr, len) = (at.u64()?, at.u64()?);
            let kind = MemKind::from_code(at.u32()?)
                .ok_or(WireError::Malformed("a region of an unknown memory kind"))?;
            let dev = at.u64()?;
            Ok(Region {
                addr,
                len,
                kind,
                dev,
            })
        })
        .collect::<Result<_, WireError>>()?;
    let mut part = || {
        let len = at.u32()? as usize;
        at.take(len)
    };
    let (offered_to, offered_by, conn, md, mailbox_md) =
        (part()?, part()?, part()?, part()?, part()?);
    if !at.0.is_empty() {
        return Err(WireError::Malformed("trailing bytes"));
    }
    Ok(Decoded {
        epoch,
        instance,
        for_instance,
        mailbox,
        regions,
        offered_to,
        offered_by,
        conn,
        md,
        mailbox_md,
    })
}

/// The descriptor of `len` bytes at `offset` of the `region`-th of `regions` (a decoded
/// offer's): the address in the peer, and the memory kind and device of that region — the
/// peer's, whatever the loading agent's own.
pub(crate) fn remote_desc(
    regions: &[Region],
    region: usize,
    offset: usize,
    len: usize,
) -> Result<RemoteRange, WireError> {
    let r = *regions.get(region).ok_or(WireError::NoRegion {
        region,
        regions: regions.len(),
    })?;
    let out = || WireError::Range {
        offset,
        len,
        size: r.len as usize,
    };
    let end = (offset as u64).checked_add(len as u64).ok_or_else(out)?;
    if end > r.len {
        return Err(out());
    }
    let addr = r.addr.checked_add(offset as u64).ok_or_else(out)?;
    Ok(RemoteRange {
        addr,
        len,
        kind: r.kind,
        dev: r.dev,
    })
}

/// The peer's side of a transfer over `ranges`, as NIXL takes it: their one memory kind
/// (`local`'s for an empty list, where no range says one) and each descriptor's address,
/// length and device — the peer's, as it offered them, whatever the loading agent's own. A
/// NIXL descriptor list has one kind: ranges in two kinds are refused
/// ([`WireError::MixedKinds`]) — post one transfer per kind.
pub(crate) fn remote_side(
    ranges: &[RemoteRange],
    local: MemKind,
) -> Result<
    (
        MemKind,
        impl ExactSizeIterator<Item = (usize, usize, u64)> + '_,
    ),
    WireError,
> {
    let kind = ranges.first().map_or(local, |r| r.kind);
    if let Some(other) = ranges.iter().find(|r| r.kind != kind) {
        return Err(WireError::MixedKinds {
            first: kind,
            other: other.kind,
        });
    }
    Ok((kind, ranges.iter().map(|r| (r.addr as usize, r.len, r.dev))))
}

/// Reads an offer front to back.
struct Reader<'m>(&'m [u8]);

impl<'m> Reader<'m> {
    fn take(&mut self, n: usize) -> Result<&'m [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Malformed("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARTS: [&[u8]; 5] = [b"loader", b"offerer", b"conn", b"md", b"mailbox"];

    fn region(addr: u64, len: u64, kind: MemKind, dev: u64) -> Region {
        Region {
            addr,
            len,
            kind,
            dev,
        }
    }

    /// An offer carries each region's kind and device, and the peer's side of a
    /// transfer is built from them — a VRAM region on device 1 gives VRAM descriptors on
    /// device 1 even where the loading agent is host memory (before, it got the loader's DRAM
    /// and device 0, which NIXL never finds: `NOT_FOUND` on every transfer).
    #[test]
    fn remote_descriptors_take_the_offered_regions_kind_and_device() {
        let regions = [
            region(0x7000_0000, 1 << 20, MemKind::Vram, 1),
            region(0x9000_0000, 1 << 20, MemKind::Vram, 3),
            region(0x5000, 4096, MemKind::Dram, 0),
        ];
        let bytes = encode([7, 11, 13, 0xabc0], &regions, PARTS);
        let offer = decode(&bytes).expect("an offer of this format");
        assert_eq!(
            offer.regions, regions,
            "each region's kind and device travel"
        );
        assert_eq!(
            (
                offer.epoch,
                offer.instance,
                offer.for_instance,
                offer.mailbox
            ),
            (7, 11, 13, 0xabc0)
        );
        assert_eq!(
            [
                offer.offered_to,
                offer.offered_by,
                offer.conn,
                offer.md,
                offer.mailbox_md
            ],
            PARTS
        );

        let first = remote_desc(&offer.regions, 0, 4096, 8192).unwrap();
        assert_eq!(
            first,
            RemoteRange {
                addr: 0x7000_1000,
                len: 8192,
                kind: MemKind::Vram,
                dev: 1
            }
        );
        let second = remote_desc(&offer.regions, 1, 0, 4096).unwrap();
        assert_eq!((second.kind, second.dev), (MemKind::Vram, 3));
        // The loading agent is host memory: the peer's side is still VRAM, each on its device.
        let ranges = [first, second];
        let (kind, descs) = remote_side(&ranges, MemKind::Dram).unwrap();
        assert_eq!(kind, MemKind::Vram);
        assert_eq!(
            descs.collect::<Vec<_>>(),
            [(0x7000_1000, 8192, 1), (0x9000_0000, 4096, 3)]
        );

        let host = [remote_desc(&offer.regions, 2, 0, 4096).unwrap()];
        assert_eq!((host[0].kind, host[0].dev), (MemKind::Dram, 0));
        let (kind, descs) = remote_side(&host, MemKind::Vram).unwrap();
        assert_eq!(
            (kind, descs.collect::<Vec<_>>()),
            (MemKind::Dram, vec![(0x5000, 4096, 0)])
        );
    }

    /// A NIXL descriptor list has one memory kind: a transfer whose remote ranges lie in two
    /// is refused by name, not built with one kind for both.
    #[test]
    fn a_transfer_mixing_memory_kinds_is_refused() {
        let regions = [
            region(0x1000, 4096, MemKind::Dram, 0),
            region(0x2000, 4096, MemKind::Vram, 0),
        ];
        let host = remote_desc(&regions, 0, 0, 4096).unwrap();
        let gpu = remote_desc(&regions, 1, 0, 4096).unwrap();
        assert_eq!(
            remote_side(&[host, gpu], MemKind::Dram).map(|side| side.0),
            Err(WireError::MixedKinds {
                first: MemKind::Dram,
                other: MemKind::Vram
            })
        );
        assert_eq!(
            remote_side(&[gpu, host], MemKind::Vram).map(|side| side.0),
            Err(WireError::MixedKinds {
                first: MemKind::Vram,
                other: MemKind::Dram
            })
        );
        // An empty side has no range to say a kind: the local one.
        assert_eq!(remote_side(&[], MemKind::Vram).unwrap().0, MemKind::Vram);
        assert_eq!(
            remote_desc(&regions, 2, 0, 1),
            Err(WireError::NoRegion {
                region: 2,
                regions: 2
            })
        );
        assert_eq!(
            remote_desc(&regions, 0, 1, 4096),
            Err(WireError::Range {
                offset: 1,
                len: 4096,
                size: 4096
            })
        );
        assert!(matches!(
            remote_desc(&regions, 0, usize::MAX, 2),
            Err(WireError::Range { .. })
        ));
    }

    /// An offer in format 01 — as memtoken wrote it before regions carried their kind and
    /// device — in the layout it had then.
    fn offer_of_format_01(regions: &[(u64, u64)]) -> Vec<u8> {
        let mut out = b"MTNIXL01".to_vec();
        for number in [7u64, 11, 13, 0xabc0] {
            out.extend_from_slice(&number.to_le_bytes());
        }
        out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        for &(addr, len) in regions {
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        for part in PARTS {
            out.extend_from_slice(&(part.len() as u32).to_le_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    /// An offer of the old format is refused as such, never read as the new
    /// one (its regions have no kind or device: read as this format, their bytes would be
    /// taken for other fields).
    #[test]
    fn an_offer_of_the_old_format_is_refused_by_its_version() {
        for regions in [
            &[][..],
            &[(0x1000, 4096)],
            &[(0x1000, 4096), (0x9000, 8192)],
        ] {
            let old = offer_of_format_01(regions);
            assert_eq!(
                decode(&old).map(|d| d.regions),
                Err(WireError::Version {
                    found: "MTNIXL01".to_owned()
                })
            );
        }
        // A later version is refused alike; bytes that are no offer are malformed.
        let mut later = encode([1, 2, 3, 4], &[], PARTS);
        later[..8].copy_from_slice(b"MTNIXL03");
        assert!(matches!(decode(&later), Err(WireError::Version { found }) if found == "MTNIXL03"));
        assert_eq!(
            decode(b"not an offer at all").map(|d| d.epoch),
            Err(WireError::Malformed("not memtoken's NIXL metadata"))
        );
        assert_eq!(
            decode(b"MTNIX").map(|d| d.epoch),
            Err(WireError::Malformed("truncated"))
        );
    }

    /// A region's kind is one the format knows; a damaged offer is an error, not a region of
    /// some kind.
    #[test]
    fn a_region_of_an_unknown_kind_is_malformed() {
        let region = region(0x1000, 4096, MemKind::Vram, 2);
        let mut bytes = encode([1, 2, 3, 4], &[region], PARTS);
        // The kind's field: after the magic, four numbers, the count, an address and a length.
        let at = MAGIC.len() + 32 + 4 + 16;
        assert_eq!(bytes[at..at + 4], 1u32.to_le_bytes(), "VRAM's code");
        bytes[at..at + 4].copy_from_slice(&9u32.to_le_bytes());
        assert_eq!(
            decode(&bytes).map(|d| d.regions),
            Err(WireError::Malformed("a region of an unknown memory kind"))
        );
        let mut trailing = encode([1, 2, 3, 4], &[region], PARTS);
        trailing.push(0);
        assert_eq!(
            decode(&trailing).map(|d| d.regions),
            Err(WireError::Malformed("trailing bytes"))
        );
    }

    /// A count of regions that the offer's bytes cannot hold, at a region's 28 bytes (address,
    /// length, kind, device), is refused before any region is read (and before anything is
    /// allocated for them); a count within that bound is read, and fails only where its bytes
    /// do.
    #[test]
    fn a_count_of_regions_past_what_the_bytes_hold_is_refused_by_name() {
        let regions = [region(0x1000, 4096, MemKind::Dram, 0); 3];
        let mut bytes = encode([1, 2, 3, 4], &regions, PARTS);
        let fits = bytes.len() / (8 + 8 + 4 + 8);
        let at = MAGIC.len() + 32;
        for count in [fits + 1, fits] {
            bytes[at..at + 4].copy_from_slice(&(count as u32).to_le_bytes());
            let refused = decode(&bytes).map(|d| d.regions);
            let by_count = refused == Err(WireError::Malformed("more regions than bytes"));
            assert_eq!(
                by_count,
                count > fits,
                "{count} regions in {} bytes",
                bytes.len()
            );
            assert!(refused.is_err(), "{count} regions decoded");
        }
    }

    /// An offer of more regions than a region's record has bytes (a KV cache registers a
    /// region per plane: 64 layers' K and V are 128) decodes whole: the bound on the count is
    /// what the bytes hold, not less. Fails if the bound is the bytes' remainder past whole
    /// records (which the test above cannot tell apart where the two happen to be equal).
    #[test]
    fn an_offer_of_many_regions_decodes_whole() {
        let regions: Vec<Region> = (0..128)
            .map(|i| region(0x1000_0000 + (i << 20), 1 << 20, MemKind::Vram, 0))
            .collect();
        let bytes = encode([1, 2, 3, 4], &regions, PARTS);
        assert_eq!(decode(&bytes).map(|d| d.regions), Ok(regions));
    }
}
