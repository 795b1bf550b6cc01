//! A simulated backend: a strict model of the VMM rules in pure Rust, with no system calls.

use super::rules::Book;
use super::{
    Access, Addr, Backend, BackendError, Cause, ConfigError, Location, Op, Violation,
    check_address_space, lock,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Settings of a [`SimBackend`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Allocation granularity in bytes (a power of two). Default: 2 MiB, like a GPU.
    pub granularity: usize,
    /// Largest single reservation: a positive multiple of the granularity. Default: 1 TiB.
    pub address_space: usize,
    /// Total physical memory: not zero. Default: 16 GiB (simulated: nothing is allocated for
    /// real).
    pub physical_capacity: u64,
    /// Whether physical memory may be released while mapped (CUDA: yes, the memory goes with the
    /// last unmap; host: no). Default: false.
    pub release_while_mapped: bool,
    /// Whether fences complete as soon as they are recorded. Default: true.
    pub fences_complete_at_once: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            granularity: 2 << 20,
            address_space: 1 << 40,
            physical_capacity: 16 << 30,
            release_while_mapped: false,
            fences_complete_at_once: true,
        }
    }
}

/// A physical handle of the simulated backend: a serial number, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimPhys(u64);

/// One call the simulated backend received (see [`SimBackend::calls`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimCall {
    /// The kind of call.
    pub op: Op,
    /// The address it was about (0 where none).
    pub addr: Addr,
    /// The length it was about.
    pub len: usize,
}

#[derive(Debug)]
struct SimState {
    book: Book<SimPhys>,
    next_phys: u64,
    phys_used: u64,
    fences_issued: u64,
    fences_done: u64,
    lost: bool,
    pins: u64,
    calls: Vec<SimCall>,
    /// The bytes of physical memory written so far (through copies; memory never written
    /// reads as zeros), so that what a suspend saves and a resume restores can be checked.
    contents: HashMap<SimPhys, Vec<u8>>,
}

/// A strict, deterministic model of CUDA-style VMM: it hands out addresses (lowest free range
/// first, so freed VA is reused at once), tracks physical memory and mappings, and **panics** on
/// any illegal call sequence: a map over a mapping, an unmap of something not mapped, a free of a
/// range with mappings under it, a release of physical memory still mapped (unless configured
/// like CUDA), a size or address that is not a multiple of the granularity, an unpin without a
/// pin, any call after the context is lost.
///
/// Cloning gives another handle on the same simulated device, to inspect or steer it (fences,
/// context loss, the call log) while a [`Device`](crate::Device) owns the backend.
#[derive(Clone, Debug)]
pub struct SimBackend {
    config: Arc<SimConfig>,
    state: Arc<Mutex<SimState>>,
}

/// Where simulated reservations start.
const VA_BASE: Addr = 0x7000_0000_0000;

impl SimBackend {
    /// A simulated device with `config`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the setting if the granularity is not a power of two, the
    /// address space not a positive multiple of it, or the physical capacity zero.
    pub fn new(config: SimConfig) -> Result<Self, ConfigError> {
        let g = config.granularity;
        ConfigError::check_granularity(g)?;
        ConfigError::check_multiple("address space", config.address_space as u64, g)?;
        ConfigError::check_positive("physical capacity", config.physical_capacity)?;
        let state = SimState {
            book: Book::new(config.granularity, config.release_while_mapped),
            next_phys: 1,
            phys_used: 0,
            fences_issued: 0,
            fences_done: 0,
            lost: false,
            pins: 0,
            calls: Vec::new(),
            contents: HashMap::new(),
        };
        Ok(Self {
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
        })
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        lock(&self.state)
    }

    /// Locks the state for a call, logs it, and panics if the context is lost.
    fn call(&self, op: Op, addr: Addr, len: usize) -> MutexGuard<'_, SimState> {
        let mut s = self.state();
        assert!(
            !s.lost,
            "SimBackend: {op:?} called after the context is lost"
        );
        s.calls.push(SimCall { op, addr, len });
        s
    }

    /// Reads the mapped bytes at `src` into `dst` (checked mapped by the caller).
    fn read(s: &SimState, dst: &mut [u8], src: Addr) {
        let mut at = 0;
        while at < dst.len() {
            let (phys, into, run, _) = s.book.resolve(src + at).expect("checked");
            let n = run.min(dst.len() - at);
            let out = &mut dst[at..at + n];
            match s.contents.get(&phys) {
                Some(bytes) => out.copy_from_slice(&bytes[into..into + n]),
                None => out.fill(0),
            }
            at += n;
        }
    }

    /// Marks every fence recorded so far as complete (the stream caught up).
    pub fn complete_fences(&self) {
        let mut s = self.state();
        s.fences_done = s.fences_issued;
    }

    /// Loses the context (as a sticky error would): from now on any VMM call panics, and
    /// [`Backend::context_lost`] is true.
    pub fn lose_context(&self) {
        self.state().lost = true;
    }

    /// Every call received so far, in order.
    pub fn calls(&self) -> Vec<SimCall> {
        self.state().calls.clone()
    }

    /// Live reservations.
    pub fn reservations(&self) -> usize {
        self.state().book.reservations()
    }

    /// Physical bytes currently created.
    pub fn physical_in_use(&self) -> u64 {
        self.state().phys_used
    }

    /// Pins currently held.
    pub fn pins(&self) -> u64 {
        self.state().pins
    }
}

impl Default for SimBackend {
    fn default() -> Self {
        Self::new(SimConfig::default()).expect("the default settings are valid")
    }
}

fn illegal(op: Op, v: impl std::fmt::Display) -> ! {
    panic!("SimBackend: illegal {op:?}: {v}")
}

impl Backend for SimBackend {
    type Phys = SimPhys;
    type Fence = u64;

    fn granularity(&self) -> usize {
        self.config.granularity
    }

    fn address_space(&self) -> usize {
        self.config.address_space
    }

    fn physical_capacity(&self) -> u64 {
        self.config.physical_capacity
    }

    fn location(&self) -> Location {
        Location::Simulated
    }

    fn reserve(&self, len: usize) -> Result<Addr, BackendError> {
        let mut s = self.call(Op::Reserve, 0, len);
        s.book
            .check_reserve(len)
            .unwrap_or_else(|v| illegal(Op::Reserve, v));
        check_address_space(len, self.config.address_space)?;
        let addr = s.book.lowest_gap(VA_BASE, len);
        s.book.apply_reserve(addr, len);
        Ok(addr)
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.call(Op::Free, addr, len);
        s.book
            .check_free(addr, len)
            .unwrap_or_else(|v| illegal(Op::Free, v));
        s.book.apply_free(addr);
        Ok(())
    }

    fn create(&self, len: usize) -> Result<SimPhys, BackendError> {
        let mut s = self.call(Op::Create, 0, len);
        s.book
            .check_create(len)
            .unwrap_or_else(|v| illegal(Op::Create, v));
        let capacity = self.config.physical_capacity;
        let available = capacity - s.phys_used;
        if len as u64 > available {
            let cause = Cause::Exhausted {
                requested: len as u64,
                available,
                capacity,
            };
            return Err(BackendError::new(Op::Create, 0, len, cause));
        }
        let phys = SimPhys(s.next_phys);
        s.next_phys += 1;
        s.phys_used += len as u64;
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    fn release(&self, phys: SimPhys, len: usize) -> Result<(), BackendError> {
        let mut s = self.call(Op::Release, 0, len);
        s.book
            .check_release(phys, len)
            .unwrap_or_else(|v| illegal(Op::Release, v));
        let mapped = s.book.is_mapped(phys);
        s.book.apply_release(phys);
        s.phys_used -= len as u64;
        if !mapped {
            s.contents.remove(&phys);
        }
        Ok(())
    }

    fn map(
        &self,
        addr: Addr,
        len: usize,
        phys: SimPhys,
        access: Access,
    ) -> Result<(), BackendError> {
        let mut s = self.call(Op::Map, addr, len);
        s.book
            .check_map(addr, len, phys, 0)
            .unwrap_or_else(|v| illegal(Op::Map, v));
        s.book.apply_map(addr, len, phys, access);
        Ok(())
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.call(Op::Unmap, addr, len);
        s.book
            .check_unmap(addr, len)
            .unwrap_or_else(|v| illegal(Op::Unmap, v));
        for (phys, _) in s.book.handles_in(addr, len) {
            s.contents.remove(&phys);
        }
        s.book.apply_unmap(addr, len);
        Ok(())
    }

    fn copy_into_phys(&self, phys: SimPhys, src: Addr, len: usize) -> Result<(), BackendError> {
        let mut s = self.call(Op::Copy, src, len);
        s.book
            .check_copy(phys, src, len)
            .unwrap_or_else(|v| illegal(Op::Copy, v));
        let mut bytes = vec![0; len];
        Self::read(&s, &mut bytes, src);
        s.contents.insert(phys, bytes);
        Ok(())
    }

    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let s = self.call(Op::Copy, src, dst.len());
        s.book
            .check_access(src, dst.len(), false)
            .unwrap_or_else(|v| illegal(Op::Copy, v));
        Self::read(&s, dst, src);
        Ok(())
    }

    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let mut s = self.call(Op::Copy, dst, src.len());
        s.book
            .check_access(dst, src.len(), true)
            .unwrap_or_else(|v| illegal(Op::Copy, v));
        let mut at = 0;
        while at < src.len() {
            let (phys, into, run, _) = s.book.resolve(dst + at).expect("checked");
            let phys_len = into + run;
            let n = run.min(src.len() - at);
            let bytes = s.contents.entry(phys).or_insert_with(|| vec![0; phys_len]);
            bytes[into..into + n].copy_from_slice(&src[at..at + n]);
            at += n;
        }
        Ok(())
    }

    fn fence(&self) -> u64 {
        let mut s = self.state();
        s.fences_issued += 1;
        if self.config.fences_complete_at_once {
            s.fences_done = s.fences_issued;
        }
        s.fences_issued
    }

    fn fence_done(&self, fence: &u64) -> bool {
        *fence <= self.state().fences_done
    }

    fn pin(&self) -> Result<(), BackendError> {
        self.call(Op::Pin, 0, 0).pins += 1;
        Ok(())
    }

    fn unpin(&self) -> Result<(), BackendError> {
        let mut s = self.call(Op::Unpin, 0, 0);
        if s.pins == 0 {
            illegal(Op::Unpin, Violation::NotPinned);
        }
        s.pins -= 1;
        Ok(())
    }

    fn context_lost(&self) -> bool {
        self.state().lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_configuration_is_an_error_not_a_panic() {
        let bad = |config: SimConfig| SimBackend::new(config).unwrap_err();
        let e = bad(SimConfig {
            granularity: 3 << 20,
            ..SimConfig::default()
        });
        assert!(
            matches!(e, ConfigError::GranularityNotPowerOfTwo { granularity } if granularity == 3 << 20)
        );
        assert!(e.to_string().contains("power of two"), "{e}");
        let e = bad(SimConfig {
            granularity: 0,
            ..SimConfig::default()
        });
        assert!(matches!(e, ConfigError::GranularityNotPowerOfTwo { .. }));
        let e = bad(SimConfig {
            address_space: (1 << 30) + 4096,
            ..SimConfig::default()
        });
        assert!(
            matches!(
                e,
                ConfigError::NotAGranularityMultiple {
                    what: "address space",
                    ..
                }
            ),
            "{e}"
        );
        let e = bad(SimConfig {
            address_space: 0,
            ..SimConfig::default()
        });
        assert!(matches!(
            e,
            ConfigError::NotAGranularityMultiple { value: 0, .. }
        ));
        let e = bad(SimConfig {
            physical_capacity: 0,
            ..SimConfig::default()
        });
        assert!(
            matches!(
                e,
                ConfigError::Zero {
                    what: "physical capacity"
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_reservation_past_the_address_space_is_exhausted_not_illegal() {
        let sim = SimBackend::new(SimConfig {
            address_space: 4 << 20,
            ..SimConfig::default()
        })
        .unwrap();
        let e = sim.reserve(6 << 20).unwrap_err();
        assert!(matches!(e.cause, Cause::AddressSpace { requested, .. } if requested == 6 << 20));
        assert_eq!(sim.reservations(), 0);
        let addr = sim.reserve(4 << 20).unwrap();
        sim.free(addr, 4 << 20).unwrap();
    }
}
