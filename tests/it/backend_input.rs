//! Property test: no `Backend` method panics, wraps around or touches what it handed out, on any
//! input — the host backend, the simulator (its default, non-strict configuration) and the CUDA
//! backend over the driver model.
//!
//! Each case sets up a few legitimate resources on a backend (reservations, physical memory
//! mapped read-write and read-only, memory left unmapped, a released handle) and on a second
//! instance of the same backend (whose addresses and handles are foreign to the first), writes a
//! byte pattern into every mapping, then throws a random sequence of calls at the first one:
//! any call, with arbitrary addresses, lengths and handles, and with near misses derived from
//! the legitimate ones (± bytes and granules), overflowing ends (`addr + len` past `usize::MAX`),
//! zero, unaligned and huge lengths. An oracle that knows the VMM rules and the legitimate state
//! says which calls are legal.
//!
//! Each call runs inside `catch_unwind`. Checked after each: it did not panic; an illegal call
//! returned `Err` (a rule violation, or out of address space for a reservation that is too
//! large); a legal copy returned the expected bytes; nothing the backends hold changed (the
//! counts of [`Faulty`] and the backend's own, and on the simulator one violation recorded per
//! illegal call). Legal calls that would change the legitimate state (an unmap of a legitimate
//! mapping, say) are not made; legal reservations and creations are given back at once. At the
//! end of the case every legitimate byte reads back as written (on the host also straight from
//! memory) on both instances, and everything tears down cleanly to nothing outstanding.
//!
//! 256 cases per backend by default; `PROPTEST_CASES=N` for more.

use crate::common;
use memtoken::backend::{
    Access, Addr, Backend, BackendError, Cause, HostBackend, HostConfig,
    doubles::{FaultHandle, Faulty, SimBackend, SimConfig},
};
use memtoken::backend::{
    cuda::CudaBackend,
    doubles::{DriverModel, ModelConfig},
};
use proptest::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: common::proptest_cases(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// An address: an anchor (a legitimate address, a foreign one, or an extreme value) moved by
/// whole granules and a few bytes, or any value at all.
#[derive(Clone, Debug)]
enum AddrSel {
    Near {
        anchor: u8,
        granules: i8,
        bytes: i16,
    },
    Any(usize),
}

/// A length: a special value, a few granules ± bytes, one that runs past the top of the address
/// space from the call's address, or any value at all.
#[derive(Clone, Debug)]
enum LenSel {
    Special(u8),
    Granules(u8, i16),
    PastTop(u8),
    Any(usize),
}

/// A host buffer's length for a copy (kept small: an overflowing end comes from the address).
#[derive(Clone, Debug)]
enum BufSel {
    Small(u16),
    Granules(u8, i8),
}

/// One call, in terms of the selectors above; a handle is an index into the legitimate handles,
/// a released one and a foreign one.
#[derive(Clone, Debug)]
enum Call {
    Reserve(LenSel),
    Free(AddrSel, LenSel),
    Create(LenSel),
    Release(u8, LenSel),
    Map(AddrSel, LenSel, u8, bool),
    Unmap(AddrSel, LenSel),
    CopyIntoPhys(u8, AddrSel, LenSel),
    CopyToHost(AddrSel, BufSel),
    CopyFromHost(AddrSel, BufSel),
    Unpin,
    PinUnpin,
    Fence,
}

fn addr_sel() -> impl Strategy<Value = AddrSel> {
    let bytes = prop_oneof![
        4 => Just(0i16),
        1 => Just(1),
        1 => Just(-1),
        1 => Just(8),
        1 => any::<i16>(),
    ];
    prop_oneof![
        6 => (any::<u8>(), -3i8..=3, bytes)
            .prop_map(|(anchor, granules, bytes)| AddrSel::Near { anchor, granules, bytes }),
        1 => any::<usize>().prop_map(AddrSel::Any),
    ]
}

fn len_sel() -> impl Strategy<Value = LenSel> {
    let bytes = prop_oneof![4 => Just(0i16), 1 => Just(1), 1 => Just(-1), 1 => any::<i16>()];
    prop_oneof![
        3 => any::<u8>().prop_map(LenSel::Special),
        4 => (0u8..8, bytes).prop_map(|(k, b)| LenSel::Granules(k, b)),
        2 => (0u8..4).prop_map(LenSel::PastTop),
        1 => any::<usize>().prop_map(LenSel::Any),
    ]
}

fn buf_sel() -> impl Strategy<Value = BufSel> {
    prop_oneof![
        3 => (0u16..64).prop_map(BufSel::Small),
        1 => any::<u16>().prop_map(BufSel::Small),
        1 => (0u8..2, -1i8..=1).prop_map(|(k, d)| BufSel::Granules(k, d)),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    let handle = any::<u8>();
    prop_oneof![
        2 => len_sel().prop_map(Call::Reserve),
        3 => (addr_sel(), len_sel()).prop_map(|(a, l)| Call::Free(a, l)),
        2 => len_sel().prop_map(Call::Create),
        3 => (handle, len_sel()).prop_map(|(p, l)| Call::Release(p, l)),
        4 => (addr_sel(), len_sel(), handle, any::<bool>())
            .prop_map(|(a, l, p, rw)| Call::Map(a, l, p, rw)),
        4 => (addr_sel(), len_sel()).prop_map(|(a, l)| Call::Unmap(a, l)),
        3 => (handle, addr_sel(), len_sel()).prop_map(|(p, a, l)| Call::CopyIntoPhys(p, a, l)),
        3 => (addr_sel(), buf_sel()).prop_map(|(a, b)| Call::CopyToHost(a, b)),
        3 => (addr_sel(), buf_sel()).prop_map(|(a, b)| Call::CopyFromHost(a, b)),
        1 => Just(Call::Unpin),
        1 => Just(Call::PinUnpin),
        1 => Just(Call::Fence),
    ]
}

/// A byte pattern of `len` bytes with period `period` (prime, so that bytes moved by any whole
/// number of granules read differently), shifted by `tag`. Made once per length and kept: the
/// simulator's and the model's granules are 2 MiB, and every case needs the same ones.
fn pattern(len: usize, period: usize, tag: u8) -> &'static [u8] {
    type Made = Vec<((usize, usize, u8), &'static [u8])>;
    static MADE: Mutex<Made> = Mutex::new(Vec::new());
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, bytes)) = made.iter().find(|(key, _)| *key == (len, period, tag)) {
        return bytes;
    }
    let cycle: Vec<u8> = (0..period)
        .map(|i| (i as u8).wrapping_mul(7) ^ tag)
        .collect();
    let mut out = Vec::with_capacity(len + period);
    while out.len() < len {
        out.extend_from_slice(&cycle);
    }
    out.truncate(len);
    let bytes: &'static [u8] = Vec::leak(out);
    made.push(((len, period, tag), bytes));
    bytes
}

/// A legitimate mapping: where, how long, which legitimate physical allocation, how.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    addr: Addr,
    len: usize,
    phys: usize,
    access: Access,
}

/// What the oracle says of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// It keeps every rule: made, and must succeed (or fail for want of resources only).
    Legal,
    /// It keeps every rule but would change the legitimate state: not made.
    LegalButDestructive,
    /// It breaks a rule: must be refused with a violation.
    Illegal,
    /// A reservation larger than the address space: must fail with `Cause::AddressSpace`.
    TooLarge,
}

/// Two instances of one backend with legitimate resources on both, and what the oracle knows.
struct World<B: Backend> {
    main: Faulty<B>,
    faults: FaultHandle,
    other: B,
    g: usize,
    release_while_mapped: bool,
    reservations: Vec<(Addr, usize)>,
    /// Legitimate physical allocations of `main`: handle, length, pattern.
    phys: Vec<(B::Phys, usize, &'static [u8])>,
    mappings: Vec<Mapping>,
    /// The legitimate handles, then a released one, then one of `other`.
    handles: Vec<B::Phys>,
    /// `other`'s reservation, mapping (at its start) and pattern.
    foreign: (Addr, usize, B::Phys, &'static [u8]),
    anchors: Vec<Addr>,
    specials: Vec<usize>,
}

impl<B: Backend> World<B> {
    /// Sets up the legitimate state (see the module docs).
    fn new(main: B, other: B, release_while_mapped: bool) -> Self {
        let main = Faulty::new(main);
        let faults = main.handle();
        let g = main.granularity();
        let r0 = main.reserve(4 * g).unwrap();
        let r1 = main.reserve(2 * g).unwrap();
        let r2 = main.reserve(g).unwrap();
        let p0 = main.create(2 * g).unwrap();
        let p1 = main.create(g).unwrap();
        let p2 = main.create(g).unwrap();
        let stale = main.create(g).unwrap();
        main.release(stale, g).unwrap();
        let phys = vec![
            (p0, 2 * g, pattern(2 * g, 251, 0x00)),
            (p1, g, pattern(g, 241, 0x5a)),
            (p2, g, pattern(g, 239, 0xc3)),
        ];
        let mappings = vec![
            Mapping {
                addr: r0,
                len: 2 * g,
                phys: 0,
                access: Access::ReadWrite,
            },
            Mapping {
                addr: r1,
                len: g,
                phys: 1,
                access: Access::ReadWrite,
            },
            Mapping {
                addr: r0 + 2 * g,
                len: g,
                phys: 1,
                access: Access::ReadOnly,
            },
        ];
        for m in &mappings {
            main.map(m.addr, m.len, phys[m.phys].0, m.access).unwrap();
        }
        main.copy_from_host(r0, phys[0].2).unwrap();
        main.copy_from_host(r1, phys[1].2).unwrap();
        // p2 is written through a mapping at r2 that is taken down again: it stays unmapped.
        main.map(r2, g, p2, Access::ReadWrite).unwrap();
        main.copy_from_host(r2, phys[2].2).unwrap();
        main.unmap(r2, g).unwrap();
        let fr = other.reserve(2 * g).unwrap();
        let fp = other.create(g).unwrap();
        other.map(fr, g, fp, Access::ReadWrite).unwrap();
        let foreign_bytes = pattern(g, 233, 0x3c);
        other.copy_from_host(fr, foreign_bytes).unwrap();
        let mut anchors = vec![
            0,
            g,
            usize::MAX,
            usize::MAX - g + 1,
            1 << 63,
            isize::MAX as usize,
        ];
        for &(a, l) in &[(r0, 4 * g), (r1, 2 * g), (r2, g), (fr, 2 * g)] {
            anchors.extend([a, a + l / 2, a + l]);
        }
        anchors.extend(mappings.iter().flat_map(|m| [m.addr, m.addr + m.len]));
        let space = main.address_space();
        let capacity = main.physical_capacity() as usize;
        let specials = vec![
            0,
            1,
            g - 1,
            g,
            g + 1,
            2 * g,
            4 * g,
            usize::MAX,
            usize::MAX - g + 1,
            usize::MAX / 2 + 1,
            isize::MAX as usize,
            space,
            space + g,
            space - g,
            capacity,
            capacity + g,
            capacity.next_power_of_two() << 1,
        ];
        Self {
            handles: vec![p0, p1, p2, stale, fp],
            main,
            faults,
            other,
            g,
            release_while_mapped,
            reservations: vec![(r0, 4 * g), (r1, 2 * g), (r2, g)],
            phys,
            mappings,
            foreign: (fr, 2 * g, fp, foreign_bytes),
            anchors,
            specials,
        }
    }

    fn addr(&self, sel: &AddrSel) -> Addr {
        match *sel {
            AddrSel::Near {
                anchor,
                granules,
                bytes,
            } => {
                let base = self.anchors[anchor as usize % self.anchors.len()];
                let shift = granules as isize * self.g as isize + bytes as isize;
                base.wrapping_add_signed(shift)
            }
            AddrSel::Any(a) => a,
        }
    }

    /// A length for a call at `addr` (0 where the call has none).
    fn len(&self, sel: &LenSel, addr: Addr) -> usize {
        match *sel {
            LenSel::Special(i) => self.specials[i as usize % self.specials.len()],
            LenSel::Granules(k, bytes) => (k as usize * self.g).wrapping_add_signed(bytes as isize),
            // `addr + len` is 2^64 + k granules: it overflows.
            LenSel::PastTop(k) => (usize::MAX - addr).wrapping_add(1 + k as usize * self.g),
            LenSel::Any(l) => l,
        }
    }

    fn buf(&self, sel: &BufSel) -> usize {
        match *sel {
            BufSel::Small(n) => n as usize,
            BufSel::Granules(k, d) => (k as usize * self.g).saturating_add_signed(d as isize),
        }
    }

    fn handle(&self, i: u8) -> B::Phys {
        self.handles[i as usize % self.handles.len()]
    }

    /// The legitimate physical allocation `phys` is: index, length, mappings.
    fn live(&self, phys: B::Phys) -> Option<(usize, usize, usize)> {
        let i = self.phys.iter().position(|p| p.0 == phys)?;
        let maps = self.mappings.iter().filter(|m| m.phys == i).count();
        Some((i, self.phys[i].1, maps))
    }

    fn mapping_at(&self, at: Addr) -> Option<&Mapping> {
        self.mappings
            .iter()
            .find(|m| m.addr <= at && at - m.addr < m.len)
    }

    /// The pieces of `[addr, addr + len)` (mapping, offset into it, length), if every byte is
    /// mapped (read-write if `write`).
    fn pieces(&self, addr: Addr, len: usize, write: bool) -> Option<Vec<(&Mapping, usize, usize)>> {
        let end = addr.checked_add(len)?;
        let mut out = Vec::new();
        let mut at = addr;
        while at < end {
            let m = self.mapping_at(at)?;
            if write && m.access != Access::ReadWrite {
                return None;
            }
            let into = at - m.addr;
            let n = (m.len - into).min(end - at);
            out.push((m, into, n));
            at += n;
        }
        Some(out)
    }

    /// Whether every byte of `[addr, addr + len)` is mapped (read-write if `write`).
    fn mapped(&self, addr: Addr, len: usize, write: bool) -> bool {
        self.pieces(addr, len, write).is_some()
    }

    /// The bytes `[addr, addr + len)` hold, if every one is mapped (read-write if `write`).
    fn expected(&self, addr: Addr, len: usize, write: bool) -> Option<Vec<u8>> {
        let pieces = self.pieces(addr, len, write)?;
        let mut out = Vec::with_capacity(len);
        for (m, into, n) in pieces {
            out.extend_from_slice(&self.phys[m.phys].2[into..into + n]);
        }
        Some(out)
    }

    /// Whether `[addr, addr + len)` (not overflowing) is exactly covered by whole mappings.
    fn exactly_mapped(&self, addr: Addr, len: usize) -> bool {
        let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
            return false;
        };
        let mut at = addr;
        while at < end {
            match self.mappings.iter().find(|m| m.addr == at) {
                Some(m) => at += m.len,
                None => return false,
            }
        }
        at == end
    }

    fn aligned(&self, value: usize) -> bool {
        value.is_multiple_of(self.g)
    }

    fn verdict(&self, call: &Concrete<B::Phys>) -> Verdict {
        use Verdict::*;
        let legal = |ok: bool, destructive: bool| match (ok, destructive) {
            (false, _) => Illegal,
            (true, false) => Legal,
            (true, true) => LegalButDestructive,
        };
        let sized = |len: usize| len > 0 && self.aligned(len);
        match *call {
            Concrete::Reserve(len) if !sized(len) => Illegal,
            Concrete::Reserve(len) if len > self.main.address_space() => TooLarge,
            Concrete::Reserve(_) => Legal,
            Concrete::Create(len) => legal(sized(len), false),
            Concrete::Free(addr, len) => {
                let exact = self.reservations.contains(&(addr, len));
                let empty = !self
                    .mappings
                    .iter()
                    .any(|m| addr <= m.addr && m.addr - addr < len);
                legal(exact && empty, true)
            }
            Concrete::Release(phys, len) => {
                let ok = self.live(phys).is_some_and(|(_, plen, maps)| {
                    plen == len && (maps == 0 || self.release_while_mapped)
                });
                legal(ok, true)
            }
            Concrete::Map(addr, len, phys, _) => {
                let inside = addr.checked_add(len).is_some_and(|end| {
                    self.reservations
                        .iter()
                        .any(|&(r, rl)| r <= addr && end <= r + rl)
                });
                let free = !self
                    .mappings
                    .iter()
                    .any(|m| m.addr < addr.saturating_add(len) && addr < m.addr + m.len);
                let whole = self.live(phys).is_some_and(|(_, plen, _)| plen == len);
                let ok = self.aligned(addr) && sized(len) && inside && free && whole;
                legal(ok, true)
            }
            Concrete::Unmap(addr, len) => legal(self.exactly_mapped(addr, len), true),
            Concrete::CopyIntoPhys(phys, src, len) => {
                let mapped = self.mapped(src, len, false);
                let end = src.saturating_add(len);
                let from_itself = self.live(phys).is_some_and(|(i, _, _)| {
                    self.mappings
                        .iter()
                        .any(|m| m.phys == i && m.addr < end && src < m.addr + m.len)
                });
                let whole = self.live(phys).is_some_and(|(_, plen, _)| plen == len);
                let ok = sized(len) && self.aligned(src) && mapped && !from_itself && whole;
                legal(ok, true)
            }
            Concrete::CopyToHost(src, len) => {
                legal(len == 0 || self.mapped(src, len, false), false)
            }
            Concrete::CopyFromHost(dst, len) => {
                legal(len == 0 || self.mapped(dst, len, true), false)
            }
            Concrete::Unpin => Illegal, // no pin is held between calls
            Concrete::PinUnpin | Concrete::Fence => Legal,
        }
    }

    fn concrete(&self, call: &Call) -> Concrete<B::Phys> {
        match call {
            Call::Reserve(l) => Concrete::Reserve(self.len(l, 0)),
            Call::Free(a, l) => {
                let addr = self.addr(a);
                Concrete::Free(addr, self.len(l, addr))
            }
            Call::Create(l) => Concrete::Create(self.len(l, 0)),
            Call::Release(p, l) => Concrete::Release(self.handle(*p), self.len(l, 0)),
            Call::Map(a, l, p, rw) => {
                let addr = self.addr(a);
                let access = if *rw {
                    Access::ReadWrite
                } else {
                    Access::ReadOnly
                };
                Concrete::Map(addr, self.len(l, addr), self.handle(*p), access)
            }
            Call::Unmap(a, l) => {
                let addr = self.addr(a);
                Concrete::Unmap(addr, self.len(l, addr))
            }
            Call::CopyIntoPhys(p, a, l) => {
                let addr = self.addr(a);
                Concrete::CopyIntoPhys(self.handle(*p), addr, self.len(l, addr))
            }
            Call::CopyToHost(a, b) => Concrete::CopyToHost(self.addr(a), self.buf(b)),
            Call::CopyFromHost(a, b) => Concrete::CopyFromHost(self.addr(a), self.buf(b)),
            Call::Unpin => Concrete::Unpin,
            Call::PinUnpin => Concrete::PinUnpin,
            Call::Fence => Concrete::Fence,
        }
    }

    /// Makes the call; what a legal reservation or creation handed out is given back at once.
    /// `Ok` of a copy to the host carries the bytes read.
    fn make(&self, call: &Concrete<B::Phys>) -> Result<Option<Vec<u8>>, BackendError> {
        let b = &self.main;
        match *call {
            Concrete::Reserve(len) => {
                let addr = b.reserve(len)?;
                let clash = self
                    .reservations
                    .iter()
                    .any(|&(r, rl)| r < addr + len && addr < r + rl);
                assert!(!clash, "reserve({len:#x}) handed out {addr:#x} again");
                b.free(addr, len).expect("a fresh reservation frees");
            }
            Concrete::Create(len) => {
                let phys = b.create(len)?;
                assert!(
                    !self.handles.contains(&phys),
                    "create handed out {phys:?} again"
                );
                b.release(phys, len)
                    .expect("fresh physical memory releases");
            }
            Concrete::Free(addr, len) => b.free(addr, len)?,
            Concrete::Release(phys, len) => b.release(phys, len)?,
            Concrete::Map(addr, len, phys, access) => b.map(addr, len, phys, access)?,
            Concrete::Unmap(addr, len) => b.unmap(addr, len)?,
            Concrete::CopyIntoPhys(phys, src, len) => b.copy_into_phys(phys, src, len)?,
            Concrete::CopyToHost(src, len) => {
                let mut buf = vec![0xee; len];
                b.copy_to_host(&mut buf, src)?;
                return Ok(Some(buf));
            }
            Concrete::CopyFromHost(dst, len) => {
                // Legal: the bytes already there, so that nothing changes. Illegal: anything.
                let bytes = self
                    .expected(dst, len, true)
                    .unwrap_or_else(|| vec![0xee; len]);
                b.copy_from_host(dst, &bytes)?;
            }
            Concrete::Unpin => b.unpin()?,
            Concrete::PinUnpin => {
                b.pin()?;
                b.unpin().expect("the pin just taken is given back");
            }
            Concrete::Fence => {
                let fence = b.fence();
                assert!(b.wait_fence(&fence) || !b.fence_done(&fence));
                b.retire_fence(fence);
            }
        }
        Ok(None)
    }

    /// Reads every legitimate byte of both instances back; with `direct`, straight from memory
    /// too (host memory).
    fn check_bytes(&self, direct: Option<fn(Addr, usize) -> Vec<u8>>) -> Result<(), TestCaseError> {
        for m in &self.mappings {
            let want = self.phys[m.phys].2;
            let mut got = vec![0; m.len];
            self.main.copy_to_host(&mut got, m.addr).unwrap();
            prop_assert!(got == want, "bytes of the mapping at {:#x} changed", m.addr);
            if let Some(read) = direct {
                prop_assert!(
                    read(m.addr, m.len) == want,
                    "memory at {:#x} changed",
                    m.addr
                );
            }
        }
        // The unmapped allocation, through a mapping made for the check.
        let (r2, g) = (self.reservations[2].0, self.g);
        self.main
            .map(r2, g, self.phys[2].0, Access::ReadOnly)
            .unwrap();
        let mut got = vec![0; g];
        self.main.copy_to_host(&mut got, r2).unwrap();
        self.main.unmap(r2, g).unwrap();
        prop_assert!(
            got == self.phys[2].2,
            "bytes of the unmapped allocation changed"
        );
        let (fr, _, _, want) = self.foreign;
        let mut got = vec![0; g];
        self.other.copy_to_host(&mut got, fr).unwrap();
        prop_assert!(got == want, "bytes of the other backend changed");
        if let Some(read) = direct {
            prop_assert!(read(fr, g) == want, "memory of the other backend changed");
        }
        Ok(())
    }

    /// Tears every legitimate resource down; each call must succeed.
    fn tear_down(self) {
        for m in &self.mappings {
            self.main.unmap(m.addr, m.len).unwrap();
        }
        for (phys, len, _) in &self.phys {
            self.main.release(*phys, *len).unwrap();
        }
        for &(addr, len) in &self.reservations {
            self.main.free(addr, len).unwrap();
        }
        let (fr, flen, fp, _) = self.foreign;
        self.other.unmap(fr, self.g).unwrap();
        self.other.release(fp, self.g).unwrap();
        self.other.free(fr, flen).unwrap();
        assert!(
            self.faults.outstanding().is_zero(),
            "{:?}",
            self.faults.outstanding()
        );
    }
}

/// A call with its arguments resolved.
#[derive(Clone, Copy, Debug)]
enum Concrete<P> {
    Reserve(usize),
    Free(Addr, usize),
    Create(usize),
    Release(P, usize),
    Map(Addr, usize, P, Access),
    Unmap(Addr, usize),
    CopyIntoPhys(P, Addr, usize),
    CopyToHost(Addr, usize),
    CopyFromHost(Addr, usize),
    Unpin,
    PinUnpin,
    Fence,
}

/// A backend's own counts, by name.
type Counts<B> = dyn Fn(&World<B>) -> Vec<(&'static str, u64)>;

/// What a backend reports of itself besides [`Faulty`]'s counts, how many violations it
/// recorded (the simulator only), and how to read its memory straight (the host only).
struct Probe<B: Backend> {
    counts: Box<Counts<B>>,
    violations: Option<Box<dyn Fn() -> usize>>,
    direct: Option<fn(Addr, usize) -> Vec<u8>>,
}

/// Runs `calls` against `world`; see the module docs for what is checked.
fn run<B: Backend>(world: World<B>, probe: &Probe<B>, calls: &[Call]) -> Result<(), TestCaseError> {
    let counts = || (world.faults.outstanding(), (probe.counts)(&world));
    let before = counts();
    let mut violations = probe.violations.as_ref().map_or(0, |v| v());
    for (i, call) in calls.iter().enumerate() {
        let call = world.concrete(call);
        let verdict = world.verdict(&call);
        if verdict == Verdict::LegalButDestructive {
            continue;
        }
        let made = catch_unwind(AssertUnwindSafe(|| world.make(&call)));
        let Ok(result) = made else {
            return Err(TestCaseError::fail(format!(
                "call #{i} {call:?} ({verdict:?}) panicked"
            )));
        };
        match (verdict, &result) {
            (Verdict::Illegal, Err(e)) => prop_assert!(
                matches!(e.cause, Cause::Violation(_)),
                "call #{i} {call:?} refused, but not as a violation: {e}"
            ),
            (Verdict::TooLarge, Err(e)) => prop_assert!(
                matches!(e.cause, Cause::AddressSpace { .. }),
                "call #{i} {call:?} too large, but refused otherwise: {e}"
            ),
            (Verdict::Illegal | Verdict::TooLarge, Ok(_)) => {
                return Err(TestCaseError::fail(format!(
                    "call #{i} {call:?} is illegal ({verdict:?}) but succeeded"
                )));
            }
            (_, Ok(Some(bytes))) => {
                let Concrete::CopyToHost(src, len) = call else {
                    unreachable!("only a copy to the host returns bytes")
                };
                let want = if len == 0 {
                    Vec::new()
                } else {
                    world.expected(src, len, false).unwrap()
                };
                prop_assert!(bytes == &want, "call #{i} {call:?} read the wrong bytes");
            }
            (_, Ok(None)) => {}
            (_, Err(e)) => prop_assert!(
                matches!(
                    e.cause,
                    Cause::Exhausted { .. }
                        | Cause::AddressSpace { .. }
                        | Cause::Os { .. }
                        | Cause::Driver { .. }
                ) && matches!(call, Concrete::Reserve(_) | Concrete::Create(_)),
                "legal call #{i} {call:?} failed: {e}"
            ),
        }
        if let Some(v) = &probe.violations {
            let now = v();
            let expected = violations + usize::from(verdict == Verdict::Illegal);
            prop_assert_eq!(now, expected, "call #{} {:?}: violations recorded", i, call);
            violations = now;
        }
        prop_assert_eq!(
            counts(),
            before.clone(),
            "call #{} {:?} changed what is held",
            i,
            call
        );
    }
    world.check_bytes(probe.direct)?;
    prop_assert_eq!(counts(), before, "the byte check changed what is held");
    world.tear_down();
    Ok(())
}

/// Reads `len` bytes of host memory at `addr`.
fn read_host(addr: Addr, len: usize) -> Vec<u8> {
    // SAFETY: only called on a legitimate mapping of a live host backend, read-write or
    // read-only (`HostVisible`: such a range is readable host memory until unmapped), which
    // nothing writes meanwhile (the test is single-threaded per backend).
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

/// A host backend with granularity `g`: the page size, or more (then `reserve` over-reserves
/// and trims). A small physical capacity, so that a legal creation of all of it stays cheap.
fn host(g: usize) -> HostBackend {
    HostBackend::new(HostConfig {
        granularity: g,
        physical_capacity: 64 * g as u64,
        ..HostConfig::default()
    })
    .unwrap()
}

/// The simulator's and the driver model's granularity here: 64 KiB rather than their default
/// 2 MiB, which would make every case copy megabytes (the rules do not depend on it).
const GRANULE: usize = 64 << 10;

fn simulator() -> SimBackend {
    // Otherwise the default settings: not strict, so an illegal call is refused and recorded.
    SimBackend::new(SimConfig {
        granularity: GRANULE,
        ..SimConfig::default()
    })
    .unwrap()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    #[cfg_attr(miri, ignore = "maps one memory at two addresses: the heap store (Miri's) maps none twice")]
    fn host_backend_takes_any_input(
        page_granules in any::<bool>(),
        calls in prop::collection::vec(call(), 1..48),
    ) {
        // The default granule (a page), or 16 of them: then `reserve` over-reserves and trims.
        let page = HostConfig::default().granularity;
        let g = if page_granules { page } else { 16 * page };
        let world = World::new(host(g), host(g), false);
        let probe = Probe {
            counts: Box::new(|w: &World<HostBackend>| {
                vec![
                    ("other's physical bytes", w.other.physical_in_use()),
                    ("other's files", w.other.open_files() as u64),
                ]
            }),
            violations: None,
            direct: Some(read_host),
        };
        run(world, &probe, &calls)?;
    }

    #[test]
    fn simulator_takes_any_input(calls in prop::collection::vec(call(), 1..48)) {
        let sim = simulator();
        let world = World::new(sim.clone(), simulator(), false);
        let seen = sim.clone();
        let probe = Probe {
            counts: Box::new(move |_: &World<SimBackend>| {
                vec![
                    ("reservations", seen.reservations() as u64),
                    ("mappings", seen.mappings() as u64),
                    ("physical bytes", seen.physical_in_use()),
                    ("pins", seen.pins()),
                ]
            }),
            violations: Some(Box::new({
                let sim = sim.clone();
                move || sim.violations().len()
            })),
            direct: None,
        };
        run(world, &probe, &calls)?;
        prop_assert!(
            sim.violations().iter().all(|e| matches!(e.cause, Cause::Violation(_))),
            "{:?}",
            sim.violations()
        );
        prop_assert_eq!(
            (sim.reservations(), sim.mappings(), sim.physical_in_use(), sim.pins()),
            (0, 0, 0, 0)
        );
    }

    #[test]
    fn cuda_backend_takes_any_input(calls in prop::collection::vec(call(), 1..48)) {
        let model = DriverModel::new(ModelConfig {
            granularity: GRANULE,
            ..ModelConfig::default()
        })
        .unwrap();
        let open = || CudaBackend::new(model.clone(), 0).unwrap();
        let world = World::new(open(), open(), true);
        let seen = model.clone();
        let probe = Probe {
            counts: Box::new(move |_: &World<CudaBackend<DriverModel>>| {
                let o = seen.outstanding();
                vec![
                    ("reservations", o.reservations as u64),
                    ("mappings", o.mappings as u64),
                    ("physical bytes", o.physical_bytes as u64),
                    ("events", o.events as u64),
                    ("retains", u64::from(o.retains)),
                ]
            }),
            violations: None,
            direct: None,
        };
        run(world, &probe, &calls)?;
        let o = model.outstanding();
        prop_assert_eq!((o.reservations, o.mappings, o.physical_bytes, o.retains), (0, 0, 0, 0));
    }
}
