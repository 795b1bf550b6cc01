//! A simulated backend: a strict model of the VMM rules in pure Rust, with no system calls.
//!
//! An illegal call is refused with [`Cause::Violation`] (a call after the context is lost with
//! [`Cause::ContextLost`]) and touches nothing, like on the real backends; the simulator also
//! records it ([`SimBackend::violations`]), so a test can assert that none happened. A strict
//! simulator ([`SimBackend::strict`], [`SimConfig::panic_on_violation`]) panics at the first
//! one instead, for a backtrace at the fault.

use crate::backend::rules::Book;
use crate::backend::{
    Access, Addr, Backend, BackendError, Cause, ConfigError, Location, Op, Violation,
    address_space_exhausted, check_address_space, lock,
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
    /// Whether an illegal call panics, at the call, instead of being refused with an error
    /// (it is recorded in [`SimBackend::violations`] either way). Default: false, like every
    /// other backend; [`SimConfig::strict`] sets it, for tests that want a backtrace at the
    /// first violation.
    pub panic_on_violation: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            granularity: 2 << 20,
            address_space: 1 << 40,
            physical_capacity: 16 << 30,
            release_while_mapped: false,
            fences_complete_at_once: true,
            panic_on_violation: false,
        }
    }
}

impl SimConfig {
    /// The default settings, strict: the first illegal call panics (see
    /// [`panic_on_violation`](Self::panic_on_violation)).
    ///
    /// ```
    /// use memtoken::backend::{doubles::{SimBackend, SimConfig}};
    /// let sim = SimBackend::new(SimConfig {
    ///     granularity: 4096,
    ///     ..SimConfig::strict()
    /// })
    /// .unwrap();
    /// # let _ = sim;
    /// ```
    pub fn strict() -> Self {
        Self {
            panic_on_violation: true,
            ..Self::default()
        }
    }
}

/// A physical handle of the simulated backend: a serial number, never reused, and unique among
/// every simulator of the process (so a handle of one simulator is refused by another).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimPhys(u64);

/// The next serial number of a [`SimPhys`], unique in the process.
fn next_phys() -> SimPhys {
    SimPhys(crate::backend::unique().get())
}

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
    phys_used: u64,
    fences_issued: u64,
    fences_done: u64,
    lost: bool,
    pins: u64,
    calls: Vec<SimCall>,
    /// Every call refused for breaking a rule or coming after the context loss, as refused.
    violations: Vec<BackendError>,
    /// The bytes of physical memory written so far (through copies; memory never written
    /// reads as zeros), so that what a suspend saves and a resume restores can be checked.
    contents: HashMap<SimPhys, Vec<u8>>,
}

/// A strict, deterministic model of CUDA-style VMM: it hands out addresses (lowest free range
/// first, so freed VA is reused at once), tracks physical memory and mappings, and **refuses**
/// any illegal call sequence with [`Cause::Violation`], touching nothing: a map over a mapping,
/// an unmap of something not mapped, a free of a range with mappings under it, a release of
/// physical memory still mapped (unless configured like CUDA), a size or address that is not a
/// multiple of the granularity, a range whose end overflows, a handle it never created (or
/// another simulator's, or one released), an unpin without a pin. Any VMM call (all but the
/// fence calls) after the context is lost is refused with [`Cause::ContextLost`].
///
/// Each refused call is recorded ([`violations`](Self::violations)): a test that means to make
/// only legal calls asserts that none is recorded, or uses a strict simulator
/// ([`SimBackend::strict`], [`SimConfig::strict`]), which panics at the first one — the
/// backtrace then points at the faulty call.
///
/// ```
/// use memtoken::backend::{Backend, Cause, Violation, doubles::SimBackend};
/// let sim = SimBackend::default();
/// let g = sim.granularity();
/// let addr = sim.reserve(g).unwrap();
/// let e = sim.unmap(addr, g).unwrap_err(); // nothing is mapped there
/// assert!(matches!(e.cause, Cause::Violation(Violation::NotMapped { .. })));
/// assert_eq!(sim.violations(), vec![e]);
/// sim.free(addr, g).unwrap();
/// ```
///
/// ```should_panic
/// use memtoken::backend::{Backend, doubles::SimBackend};
/// let sim = SimBackend::strict();
/// let _ = sim.free(0x1000, 4096); // panics: "SimBackend: illegal Free: ..."
/// ```
///
/// Cloning gives another handle on the same simulated device, to inspect or steer it (fences,
/// context loss, the call log, the violations) while a [`Device`](crate::Device) owns the
/// backend.
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
            phys_used: 0,
            fences_issued: 0,
            fences_done: 0,
            lost: false,
            pins: 0,
            calls: Vec::new(),
            violations: Vec::new(),
            contents: HashMap::new(),
        };
        Ok(Self {
            config: Arc::new(config),
            state: Arc::new(Mutex::new(state)),
        })
    }

    /// A simulated device with the default settings that panics at the first illegal call
    /// ([`SimConfig::strict`]).
    pub fn strict() -> Self {
        Self::new(SimConfig::strict()).expect("the default settings are valid")
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        lock(&self.state)
    }

    /// Locks the state for a call and logs it; refuses it if the context is lost.
    fn call(
        &self,
        op: Op,
        addr: Addr,
        len: usize,
    ) -> Result<MutexGuard<'_, SimState>, BackendError> {
        let mut s = self.state();
        s.calls.push(SimCall { op, addr, len });
        if s.lost {
            let error = BackendError::new(op, addr, len, Cause::ContextLost);
            return Err(self.refuse(s, error));
        }
        Ok(s)
    }

    /// Refuses an illegal call: records `error`, lets go of the state, and panics if strict.
    fn refuse(&self, mut s: MutexGuard<'_, SimState>, error: BackendError) -> BackendError {
        s.violations.push(error.clone());
        drop(s); // a strict panic leaves the state unlocked and sound
        if self.config.panic_on_violation {
            let op = error.op;
            match &error.cause {
                Cause::Violation(v) => panic!("SimBackend: illegal {op:?}: {v}"),
                _ => panic!("SimBackend: {op:?} called after the context is lost"),
            }
        }
        error
    }

    /// Refuses the call if `check` found a violation.
    fn checked<'a>(
        &self,
        s: MutexGuard<'a, SimState>,
        (op, addr, len): (Op, Addr, usize),
        check: impl FnOnce(&SimState) -> Result<(), Violation>,
    ) -> Result<MutexGuard<'a, SimState>, BackendError> {
        match check(&s) {
            Ok(()) => Ok(s),
            Err(v) => Err(self.refuse(s, BackendError::refused(op, addr, len, v))),
        }
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

    /// Loses the context (as a sticky error would): from now on every VMM call is refused
    /// with [`Cause::ContextLost`] (and recorded as a violation: nothing may call a lost
    /// context), and [`Backend::context_lost`] is true.
    pub fn lose_context(&self) {
        self.state().lost = true;
    }

    /// Every call received so far, in order, refused ones included.
    pub fn calls(&self) -> Vec<SimCall> {
        self.state().calls.clone()
    }

    /// Every call refused so far, in order, as the error it returned: its cause is a
    /// [`Cause::Violation`] (it broke a VMM rule) or [`Cause::ContextLost`] (it came after
    /// [`lose_context`](Self::lose_context)). Empty as long as every call was legal; a call
    /// that failed for want of resources ([`Cause::Exhausted`], [`Cause::AddressSpace`]) is no
    /// violation and is not recorded.
    pub fn violations(&self) -> Vec<BackendError> {
        self.state().violations.clone()
    }

    /// Live reservations.
    pub fn reservations(&self) -> usize {
        self.state().book.reservations()
    }

    /// Live mappings.
    pub fn mappings(&self) -> usize {
        self.state().book.mappings()
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
    /// The default settings ([`SimConfig::default`]): illegal calls are refused and recorded,
    /// not panicked on.
    fn default() -> Self {
        Self::new(SimConfig::default()).expect("the default settings are valid")
    }
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
        let call = (Op::Reserve, 0, len);
        let s = self.call(Op::Reserve, 0, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_reserve(len))?;
        check_address_space(len, self.config.address_space)?;
        let space = self.config.address_space;
        let addr = s
            .book
            .lowest_gap(VA_BASE, len)
            .ok_or_else(|| address_space_exhausted(len, space))?;
        s.book.apply_reserve(addr, len);
        Ok(addr)
    }

    fn free(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let call = (Op::Free, addr, len);
        let s = self.call(Op::Free, addr, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_free(addr, len))?;
        s.book.apply_free(addr);
        Ok(())
    }

    fn create(&self, len: usize) -> Result<SimPhys, BackendError> {
        let call = (Op::Create, 0, len);
        let s = self.call(Op::Create, 0, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_create(len))?;
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
        let phys = next_phys();
        s.phys_used += len as u64;
        s.book.apply_create(phys, len);
        Ok(phys)
    }

    fn release(&self, phys: SimPhys, len: usize) -> Result<(), BackendError> {
        let call = (Op::Release, 0, len);
        let s = self.call(Op::Release, 0, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_release(phys, len))?;
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
        let call = (Op::Map, addr, len);
        let s = self.call(Op::Map, addr, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_map(addr, len, phys, 0))?;
        s.book.apply_map(addr, len, phys, access);
        Ok(())
    }

    fn unmap(&self, addr: Addr, len: usize) -> Result<(), BackendError> {
        let call = (Op::Unmap, addr, len);
        let s = self.call(Op::Unmap, addr, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_unmap(addr, len))?;
        for (phys, _) in s.book.handles_in(addr, len) {
            s.contents.remove(&phys);
        }
        s.book.apply_unmap(addr, len);
        Ok(())
    }

    fn copy_into_phys(&self, phys: SimPhys, src: Addr, len: usize) -> Result<(), BackendError> {
        let call = (Op::Copy, src, len);
        let s = self.call(Op::Copy, src, len)?;
        let mut s = self.checked(s, call, |s| s.book.check_copy(phys, src, len))?;
        let mut bytes = vec![0; len];
        Self::read(&s, &mut bytes, src);
        s.contents.insert(phys, bytes);
        Ok(())
    }

    fn copy_to_host(&self, dst: &mut [u8], src: Addr) -> Result<(), BackendError> {
        let call = (Op::Copy, src, dst.len());
        let s = self.call(Op::Copy, src, dst.len())?;
        let s = self.checked(s, call, |s| s.book.check_access(src, dst.len(), false))?;
        Self::read(&s, dst, src);
        Ok(())
    }

    fn copy_from_host(&self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        let call = (Op::Copy, dst, src.len());
        let s = self.call(Op::Copy, dst, src.len())?;
        let mut s = self.checked(s, call, |s| s.book.check_access(dst, src.len(), true))?;
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
        self.call(Op::Pin, 0, 0)?.pins += 1;
        Ok(())
    }

    fn unpin(&self) -> Result<(), BackendError> {
        let s = self.call(Op::Unpin, 0, 0)?;
        let check = |s: &SimState| match s.pins {
            0 => Err(Violation::NotPinned),
            _ => Ok(()),
        };
        let mut s = self.checked(s, (Op::Unpin, 0, 0), check)?;
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
    fn a_reservation_whose_end_would_pass_the_top_of_the_address_space_is_exhausted() {
        let g = 4096;
        let sim = SimBackend::new(SimConfig {
            granularity: g,
            address_space: usize::MAX & !(g - 1),
            ..SimConfig::strict()
        })
        .unwrap();
        let len = usize::MAX - VA_BASE + 1; // VA_BASE + len is 2^64
        let e = sim.reserve(len).unwrap_err();
        assert!(matches!(e.cause, Cause::AddressSpace { requested, .. } if requested == len));
        assert_eq!((sim.reservations(), sim.violations().len()), (0, 0));
    }
}
