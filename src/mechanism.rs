//! Mechanisms chosen at run time: [`Mechanisms`], a registry of the
//! allocation mechanisms a program holds for one GPU (or the host) — each a [`Device`] over its
//! own backend (a VMM backend, a plain-allocation one, a host fallback) — with a lifecycle
//! each, and the **selection**: the mechanism new bindings go to.
//!
//! - A mechanism is [`Active`](Lifecycle::Active) until it is
//!   [retired](Mechanisms::retire) (no new work; its tokens still release) or
//!   [lost](Mechanisms::lose) (its context went; its tokens are discharged as after any
//!   loss); then [terminated](Mechanisms::terminate) once nothing of it is left, and
//!   [unregistered](Mechanisms::unregister).
//! - A binding stays on the mechanism it was made on, whatever is selected later: each
//!   mechanism is a device of its own, whose tokens carry its brand, so a token of one can never
//!   be handed to another (the compiler refuses it, as for any two devices).
//! - The selection is never a dead or unregistered mechanism. Every change to it, and to a
//!   lifecycle, is made under one lock (they are rare: a selection, a retirement), and each
//!   leaves it valid; binders read it without the lock ([`selected`](Mechanisms::selected) is
//!   one atomic load). Retiring or losing the selected mechanism makes its lifecycle terminal
//!   first, then moves the selection back to the most recently confirmed mechanism that is
//!   still registered and active — from a recency list of distinct mechanisms, so select a, b,
//!   c, retire c, retire b ends on a — else clears it.
//! - A selection may be **probed** ([`select_probed`](Mechanisms::select_probed)): it is
//!   published, then the probe runs outside the lock (a trial create, say, which may take the
//!   driver's time), then it is confirmed. If the probe fails, or the candidate became inactive
//!   meanwhile, the prior mechanism is restored only if it is still registered and active (else
//!   the selection clears) — and only if the selection is still this one: a newer selection,
//!   or a retirement that already moved it, is never overwritten.
//!
//! **Where it sits.** Nothing in the crate uses it: it is the registry a program holds around
//! the devices it opens. [`CudaBackend::open_auto`](crate::backend::cuda::CudaBackend::open_auto)
//! chooses one mechanism for one device, once, at open time (VMM where the device has it, else
//! plain); `Mechanisms` is for a program that keeps several — a VMM device and a plain one, a
//! host fallback — and moves new bindings between them while it runs. Guide:
//! [`guide::mechanisms`](crate::guide::mechanisms).
//!
//! ```
//! use memtoken::mechanism::{Lifecycle, Mechanisms};
//!
//! let mechanisms = Mechanisms::new();
//! let vmm = mechanisms.register("cuda-vmm")?;
//! let plain = mechanisms.register("cuda-plain")?;
//! mechanisms.select(vmm)?;
//! // The VMM mechanism's creates start failing for good: no new work on it.
//! mechanisms.retire(vmm)?;
//! assert_eq!(mechanisms.lifecycle(vmm), Some(Lifecycle::Retired));
//! assert_eq!(mechanisms.selected(), None, "nothing healthy was selected before it");
//! mechanisms.select(plain)?;
//! assert_eq!(mechanisms.selected(), Some(plain));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Device`]: crate::Device

use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};
use std::fmt;

/// Mechanisms a registry holds at most.
pub const MAX_MECHANISMS: usize = 16;

/// Where a mechanism stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lifecycle {
    /// New bindings may go to it.
    Active,
    /// No new work: its tokens still release on it.
    Retired,
    /// Its context is lost: its tokens are discharged, as after any loss.
    Lost,
    /// Nothing of it is left; it may be unregistered.
    Terminated,
}

impl Lifecycle {
    const fn code(self) -> u64 {
        match self {
            Self::Active => 1,
            Self::Retired => 2,
            Self::Lost => 3,
            Self::Terminated => 4,
        }
    }

    const fn from_code(code: u64) -> Option<Self> {
        match code {
            1 => Some(Self::Active),
            2 => Some(Self::Retired),
            3 => Some(Self::Lost),
            4 => Some(Self::Terminated),
            _ => None,
        }
    }
}

/// A registered mechanism: its registry, its slot there and the generation of that slot (a slot
/// unregistered and registered again is another mechanism, and an id of one registry is
/// nothing to another).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MechanismId {
    registry: u32,
    index: u8,
    generation: u64,
}

/// The largest generation a slot takes (56 bits, beside the lifecycle's 8 in a slot's word): a
/// slot that reaches it is never reused.
const MAX_GENERATION: u64 = (1 << 56) - 1;

/// Registries made so far in this process: each one's ids carry its number.
static REGISTRIES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl MechanismId {
    /// The selection's encoding, within its registry: 0 is none.
    const fn encode(self) -> u64 {
        (self.generation << 8) | (self.index as u64 + 1)
    }
}

impl fmt::Display for MechanismId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "mechanism {}#{} of registry {}",
            self.index, self.generation, self.registry
        )
    }
}

/// Why a registry refused a change.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum MechanismError {
    /// The registry holds [`MAX_MECHANISMS`] already.
    #[error("the registry holds {MAX_MECHANISMS} mechanisms already: unregister a terminated one")]
    Full,
    /// Not registered (never, or unregistered since).
    #[error("{0} is not registered")]
    Unregistered(MechanismId),
    /// The mechanism is not active (for a selection), or not in a state the change starts from.
    #[error("{id} is {now:?}")]
    Inactive {
        /// The mechanism.
        id: MechanismId,
        /// Where it stands.
        now: Lifecycle,
    },
    /// A probed selection was refused — its probe failed, or its candidate became inactive
    /// before it was confirmed; the selection is `now` (the prior mechanism restored, cleared,
    /// or a newer selection left as it is).
    #[error("the selection of {candidate} was refused ({why}); the selection is now {now:?}")]
    Refused {
        /// The candidate.
        candidate: MechanismId,
        /// Why: its probe's message, or its lifecycle.
        why: String,
        /// The selection after the refusal.
        now: Option<MechanismId>,
    },
}

/// The phases of a probed selection, where memtoken's own tests hold a thread (feature
/// `test-hooks`) to play the races with the registry's other changes in a set order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The candidate is published as the selection; its probe has not run.
    Published,
    /// The probe ran; the selection is not confirmed yet.
    Probed,
}

#[cfg(feature = "test-hooks")]
type Hook = std::sync::Arc<dyn Fn(Phase) + Send + Sync>;

/// What only writers change, under the lock.
#[derive(Debug, Default)]
struct Writers {
    /// Each slot's name, while registered.
    names: Vec<Option<String>>,
    /// The selections confirmed (by a plain selection, or a probe that passed), distinct,
    /// the most recent last: a refused probe or a retirement falls back to the most recent
    /// one still active. Selecting one again moves it to the end; a retired, lost or
    /// unregistered one leaves it. At most [`MAX_MECHANISMS`] (one per slot).
    confirmed: Vec<MechanismId>,
    /// Changes to the selection so far: a probed selection settles only if none came since.
    epoch: u64,
}

/// The allocation mechanisms of one GPU (or the host), their lifecycles, and the one selected
/// for new bindings (see the [module docs](self)).
pub struct Mechanisms {
    /// This registry's number: its ids carry it.
    serial: u32,
    /// Each slot: its generation << 8 | its lifecycle's code (0: vacant).
    slots: [AtomicU64; MAX_MECHANISMS],
    /// The selection, as [`MechanismId::encode`] writes it (0: none). Written under `writers`.
    selected: AtomicU64,
    writers: Mutex<Writers>,
    #[cfg(feature = "test-hooks")]
    hook: Mutex<Option<Hook>>,
}

impl Default for Mechanisms {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Mechanisms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Read under the lock, formatted after it (a formatter may call back into the registry).
        let entries: Vec<(usize, String, Option<Lifecycle>)> = {
            let writers = self.lock();
            let named = writers.names.iter().enumerate();
            named
                .filter_map(|(i, name)| {
                    let slot = self.slots[i].load(Ordering::SeqCst);
                    Some((i, name.clone()?, Lifecycle::from_code(slot & 0xff)))
                })
                .collect()
        };
        let mut list = f.debug_map();
        for (i, name, lifecycle) in entries {
            list.entry(&(i, name), &lifecycle);
        }
        list.finish()?;
        write!(f, " selected: {:?}", self.selected())
    }
}

impl Mechanisms {
    /// An empty registry: nothing registered, nothing selected.
    pub fn new() -> Self {
        Self {
            serial: REGISTRIES.fetch_add(1, Ordering::Relaxed),
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
            selected: AtomicU64::new(0),
            writers: Mutex::new(Writers {
                names: vec![None; MAX_MECHANISMS],
                ..Writers::default()
            }),
            #[cfg(feature = "test-hooks")]
            hook: Mutex::new(None),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Writers> {
        // Every section under the lock leaves the registry valid before anything can panic:
        // no user code runs under it.
        self.writers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a mechanism, active and not selected.
    ///
    /// # Errors
    ///
    /// [`MechanismError::Full`] when [`MAX_MECHANISMS`] are registered (or the free slots have
    /// run through their generations).
    pub fn register(&self, name: impl Into<String>) -> Result<MechanismId, MechanismError> {
        // The caller's conversion runs before the lock: it may panic.
        let name = name.into();
        let mut writers = self.lock();
        let index = (0..MAX_MECHANISMS)
            .find(|&i| {
                let slot = self.slots[i].load(Ordering::SeqCst);
                slot & 0xff == 0 && slot >> 8 < MAX_GENERATION
            })
            .ok_or(MechanismError::Full)?;
        let generation = (self.slots[index].load(Ordering::SeqCst) >> 8) + 1;
        let id = MechanismId {
            registry: self.serial,
            index: index as u8,
            generation,
        };
        self.slots[index].store(
            (generation << 8) | Lifecycle::Active.code(),
            Ordering::SeqCst,
        );
        writers.names[index] = Some(name);
        Ok(id)
    }

    /// Where `id` stands; `None` if it is not registered (here).
    pub fn lifecycle(&self, id: MechanismId) -> Option<Lifecycle> {
        if id.registry != self.serial {
            return None;
        }
        let slot = self
            .slots
            .get(usize::from(id.index))?
            .load(Ordering::SeqCst);
        if slot >> 8 != id.generation {
            return None;
        }
        Lifecycle::from_code(slot & 0xff)
    }

    /// The name `id` was registered with, while it is registered.
    pub fn name(&self, id: MechanismId) -> Option<String> {
        let writers = self.lock();
        self.lifecycle(id)?;
        writers.names[usize::from(id.index)].clone()
    }

    /// Whether `id` is registered and active.
    fn active(&self, id: MechanismId) -> bool {
        self.lifecycle(id) == Some(Lifecycle::Active)
    }

    /// The selection as published, active or not.
    fn published(&self) -> Option<MechanismId> {
        match self.selected.load(Ordering::SeqCst) {
            0 => None,
            bits => Some(MechanismId {
                registry: self.serial,
                index: ((bits & 0xff) - 1) as u8,
                generation: bits >> 8,
            }),
        }
    }

    /// The mechanism selected for new bindings, if any: registered and active as this call
    /// reads it (two atomic loads; no lock). A mechanism retired at this moment reads as none.
    pub fn selected(&self) -> Option<MechanismId> {
        self.published().filter(|&id| self.active(id))
    }

    /// Publishes `id` (or none) as the selection; returns the new epoch.
    fn publish(&self, writers: &mut Writers, id: Option<MechanismId>) -> u64 {
        self.selected
            .store(id.map_or(0, MechanismId::encode), Ordering::SeqCst);
        writers.epoch += 1;
        writers.epoch
    }

    /// Records `id` as the most recent confirmed selection: moved to the end of the recency
    /// list, never entered twice.
    fn confirm(writers: &mut Writers, id: MechanismId) {
        writers.confirmed.retain(|&c| c != id);
        if writers.confirmed.len() == MAX_MECHANISMS {
            writers.confirmed.remove(0); // unreachable while ids are distinct per slot
        }
        writers.confirmed.push(id);
    }

    /// The last confirmed selection.
    fn last_confirmed(writers: &Writers) -> Option<MechanismId> {
        writers.confirmed.last().copied()
    }

    /// The most recent confirmed selection that is still active, other than `not`.
    fn fallback(&self, writers: &Writers, not: MechanismId) -> Option<MechanismId> {
        let mut recent = writers.confirmed.iter().rev().copied();
        recent.find(|&c| c != not && self.active(c))
    }

    /// Checks that `id` may be selected.
    fn check_active(&self, id: MechanismId) -> Result<(), MechanismError> {
        match self.lifecycle(id) {
            None => Err(MechanismError::Unregistered(id)),
            Some(Lifecycle::Active) => Ok(()),
            Some(now) => Err(MechanismError::Inactive { id, now }),
        }
    }

    /// Selects `id` for new bindings, confirmed at once; those made before stay where they are.
    ///
    /// # Errors
    ///
    /// [`MechanismError::Unregistered`] or [`MechanismError::Inactive`]: nothing changed.
    pub fn select(&self, id: MechanismId) -> Result<(), MechanismError> {
        let mut writers = self.lock();
        self.check_active(id)?;
        if self.published() == Some(id) && Self::last_confirmed(&writers) == Some(id) {
            return Ok(()); // selected and confirmed already
        }
        self.publish(&mut writers, Some(id));
        Self::confirm(&mut writers, id);
        Ok(())
    }

    /// Selects `id` for new bindings once `probe` (a trial create, opening its backend) says
    /// it works: the selection is published, `probe` runs outside the registry's lock, then the
    /// selection is confirmed — or, if the probe failed (or panicked) or `id` became inactive
    /// meanwhile, the most recent confirmed selection still registered and active (never the
    /// candidate) is restored, else the selection clears; a change made since (a newer selection, a
    /// retirement that moved it already) is left as it is.
    ///
    /// # Errors
    ///
    /// [`MechanismError::Unregistered`] or [`MechanismError::Inactive`] (nothing changed);
    /// [`MechanismError::Refused`] with the selection it leaves.
    pub fn select_probed<E: fmt::Display>(
        &self,
        id: MechanismId,
        probe: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), MechanismError> {
        let mine = {
            let mut writers = self.lock();
            self.check_active(id)?;
            if self.published() == Some(id) && Self::last_confirmed(&writers) == Some(id) {
                return Ok(()); // selected and confirmed already: nothing to probe
            }
            self.publish(&mut writers, Some(id))
        };
        // A probe that panics refuses the selection as it unwinds.
        let pending = Pending {
            registry: self,
            mine,
            candidate: id,
        };
        self.at(Phase::Published);
        let probed = probe().map_err(|e| e.to_string());
        self.at(Phase::Probed);
        std::mem::forget(pending);
        let mut writers = self.lock();
        let why = match (probed, self.lifecycle(id)) {
            (Ok(()), Some(Lifecycle::Active)) => {
                if writers.epoch == mine {
                    Self::confirm(&mut writers, id);
                }
                return Ok(());
            }
            (Err(message), _) => message,
            (Ok(()), now) => format!("it became {now:?} before it was confirmed"),
        };
        self.refuse(&mut writers, mine, id);
        Err(MechanismError::Refused {
            candidate: id,
            why,
            now: self.selected(),
        })
    }

    /// A probed selection of `candidate` published at epoch `mine` is refused: if the selection
    /// is still that one, the most recent confirmed selection still active (never the
    /// candidate) comes back, else none.
    fn refuse(&self, writers: &mut Writers, mine: u64, candidate: MechanismId) {
        if writers.epoch == mine {
            let back = self.fallback(writers, candidate);
            self.publish(writers, back);
        }
    }

    /// Retires `id`: no new work goes to it, and its tokens still release on it. Its lifecycle
    /// is terminal first; then, if it is selected, the selection goes back to the most recently
    /// confirmed mechanism that is still registered and active (select a, b, c; retire c: b;
    /// retire b: a), else it clears.
    ///
    /// # Errors
    ///
    /// [`MechanismError::Unregistered`], or [`MechanismError::Inactive`] if it is not active.
    pub fn retire(&self, id: MechanismId) -> Result<(), MechanismError> {
        self.end(id, Lifecycle::Retired)
    }

    /// Marks `id` lost (its context went): as [`retire`](Self::retire), and its tokens are
    /// discharged as after any loss.
    ///
    /// # Errors
    ///
    /// As for [`retire`](Self::retire).
    pub fn lose(&self, id: MechanismId) -> Result<(), MechanismError> {
        self.end(id, Lifecycle::Lost)
    }

    /// Makes `id`'s lifecycle `to` (retired or lost) — terminal for new work — and only then
    /// drops it from the selection (a lock-free reader in between reads no selection: see
    /// [`selected`](Self::selected)).
    fn end(&self, id: MechanismId, to: Lifecycle) -> Result<(), MechanismError> {
        let mut writers = self.lock();
        self.move_lifecycle(id, Lifecycle::Active, to)?;
        writers.confirmed.retain(|&c| c != id); // never fallen back to again
        if self.published() == Some(id) {
            let back = self.fallback(&writers, id);
            self.publish(&mut writers, back);
        }
        Ok(())
    }

    /// Moves `id` from `from` to `to`.
    fn move_lifecycle(
        &self,
        id: MechanismId,
        from: Lifecycle,
        to: Lifecycle,
    ) -> Result<(), MechanismError> {
        match self.lifecycle(id) {
            None => Err(MechanismError::Unregistered(id)),
            Some(now) if now != from => Err(MechanismError::Inactive { id, now }),
            Some(_) => {
                let slot = &self.slots[usize::from(id.index)];
                slot.store((id.generation << 8) | to.code(), Ordering::SeqCst);
                Ok(())
            }
        }
    }

    /// Terminates `id`, retired or lost, once nothing of it is left (its device closed).
    ///
    /// # Errors
    ///
    /// [`MechanismError::Unregistered`], or [`MechanismError::Inactive`] if it is active or
    /// terminated already.
    pub fn terminate(&self, id: MechanismId) -> Result<(), MechanismError> {
        let _writers = self.lock();
        match self.lifecycle(id) {
            Some(Lifecycle::Retired) => {
                self.move_lifecycle(id, Lifecycle::Retired, Lifecycle::Terminated)
            }
            Some(Lifecycle::Lost) => {
                self.move_lifecycle(id, Lifecycle::Lost, Lifecycle::Terminated)
            }
            None => Err(MechanismError::Unregistered(id)),
            Some(now) => Err(MechanismError::Inactive { id, now }),
        }
    }

    /// Unregisters `id`, terminated: its slot may hold another mechanism (with another id).
    ///
    /// # Errors
    ///
    /// [`MechanismError::Unregistered`], or [`MechanismError::Inactive`] if it is not
    /// terminated.
    pub fn unregister(&self, id: MechanismId) -> Result<(), MechanismError> {
        let mut writers = self.lock();
        match self.lifecycle(id) {
            None => return Err(MechanismError::Unregistered(id)),
            Some(Lifecycle::Terminated) => {}
            Some(now) => return Err(MechanismError::Inactive { id, now }),
        }
        let slot = &self.slots[usize::from(id.index)];
        slot.store(id.generation << 8, Ordering::SeqCst);
        writers.names[usize::from(id.index)] = None;
        writers.confirmed.retain(|&c| c != id);
        Ok(())
    }

    /// Makes something on the selected mechanism with `make` (a binding on its device, say), and
    /// returns it with the mechanism it is on: it stays there, whatever is selected later. If the
    /// mechanism stopped being active while `make` ran, what it made is dropped and the next
    /// selection is tried (a few times).
    ///
    /// # Errors
    ///
    /// `make`'s error; [`BindError::NoneSelected`] when nothing is selected (or every mechanism
    /// tried stopped being active as `make` ran).
    pub fn on_selected<T, E>(
        &self,
        mut make: impl FnMut(MechanismId) -> Result<T, E>,
    ) -> Result<OnMechanism<T>, BindError<E>> {
        for _ in 0..MAX_MECHANISMS {
            let Some(id) = self.selected() else {
                return Err(BindError::NoneSelected);
            };
            match make(id) {
                Ok(value) if self.active(id) => {
                    return Ok(OnMechanism {
                        mechanism: id,
                        value,
                    });
                }
                // It stopped being active as `make` ran (and maybe made it fail): what it made
                // is dropped, and the selection now is tried.
                Ok(_) => {}
                Err(_) if !self.active(id) => {}
                Err(e) => return Err(BindError::Make(e)),
            }
        }
        Err(BindError::NoneSelected)
    }

    /// Holds this thread at `phase` if a test asked to.
    #[inline]
    fn at(&self, phase: Phase) {
        #[cfg(feature = "test-hooks")]
        {
            let hook = self.hook.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(hook) = hook {
                hook(phase);
            }
        }
        let _ = phase;
    }

    /// Calls `hook` at each [`Phase`] of every probed selection (feature `test-hooks`, for
    /// memtoken's own tests).
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn set_hook(&self, hook: impl Fn(Phase) + Send + Sync + 'static) {
        *self.hook.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::sync::Arc::new(hook));
    }
}

/// A probed selection in flight: dropped while its probe unwinds, it refuses the selection.
struct Pending<'a> {
    registry: &'a Mechanisms,
    mine: u64,
    candidate: MechanismId,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut writers = self.registry.lock();
        self.registry
            .refuse(&mut writers, self.mine, self.candidate);
    }
}

/// Something made on a mechanism ([`Mechanisms::on_selected`]), with the mechanism it is on.
#[derive(Debug)]
pub struct OnMechanism<T> {
    /// The mechanism.
    pub mechanism: MechanismId,
    /// What was made on it.
    pub value: T,
}

/// Why [`Mechanisms::on_selected`] made nothing.
#[derive(Debug, thiserror::Error)]
pub enum BindError<E> {
    /// No mechanism is selected.
    #[error("no mechanism is selected")]
    NoneSelected,
    /// What made it failed.
    #[error("on the selected mechanism: {0}")]
    Make(#[source] E),
}

#[cfg(test)]
#[cfg(loom)]
mod loom_tests;

#[cfg(test)]
#[cfg(not(loom))]
mod tests;
