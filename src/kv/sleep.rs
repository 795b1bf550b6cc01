//! Sleep and wake for the whole KV cache: its groups unmapped and their memory given back while
//! every plane keeps its addresses — the bytes dropped (vLLM's sleep level 1) or saved to the
//! host — and mapped again at the same addresses, every table as it was.

use super::{KvCache, KvError, Memory};
use crate::backend::{Ability, Backend};
use crate::unwind::Scope;

/// A group's saved bytes: the group, and each plane's part of it.
type Saved = (usize, Vec<Vec<u8>>);

/// What a sleeping cache puts aside.
pub(super) struct Asleep {
    /// The groups mapped when it fell asleep, each with its free list.
    groups: Vec<(usize, Vec<u32>)>,
    /// The bytes saved, per group holding a live block: each plane's part of the group.
    saved: Vec<Saved>,
}

impl<B: Backend> KvCache<'_, '_, '_, B> {
    /// Whether the cache sleeps.
    pub fn is_asleep(&self) -> bool {
        self.with(|s| s.asleep.is_some())
    }

    /// Falls asleep, its blocks' bytes dropped (vLLM's sleep level 1): every group is unmapped
    /// and its memory given to the device's granule cache (released once that is full, or
    /// trimmed), while each plane keeps its reservation — the same addresses after
    /// [`wake`](Self::wake). Tables keep their ids; their blocks' bytes are undefined after the
    /// wake-up. Asleep, [`push`](Self::push), [`replenish`](Self::replenish) and a table's
    /// copies fail with [`KvError::Asleep`]; blocks given back wait for the wake-up.
    ///
    /// # Errors
    ///
    /// [`KvError::Asleep`] if it sleeps already; [`KvError::Lent`] while a transfer engine holds
    /// a block (or one is withheld for good); [`KvError::SleepUnsupported`] where the planes
    /// are allocated whole; [`KvError::Pending`] while work that may use the planes still runs
    /// (nothing done); [`KvError::Unmap`] when a group could not be unmapped whole (the cache
    /// sleeps all the same; what could not be unmapped stays mapped, and `wake` maps the rest).
    pub fn sleep(&self) -> Result<(), KvError> {
        Scope::run::<B, _>(move || self.fall_asleep(false))
    }

    /// Falls asleep as [`sleep`](Self::sleep) does, its blocks' bytes saved to the host first:
    /// after [`wake`](Self::wake) every table is valid and every byte of its blocks equal.
    ///
    /// # Errors
    ///
    /// As for [`sleep`](Self::sleep); [`KvError::Copy`] when a save fails (awake, nothing
    /// unmapped; the blocks given back whose work had completed are free).
    pub fn sleep_saving(&self) -> Result<(), KvError> {
        Scope::run::<B, _>(move || self.fall_asleep(true))
    }

    fn fall_asleep(&self, save: bool) -> Result<(), KvError> {
        if self.is_asleep() {
            return Err(KvError::Asleep);
        }
        self.refuse_if_lent()?;
        if !self.maps_on_demand() {
            let why = self.binding.device().lacks(Ability::MapAtReservedAddress);
            return Err(KvError::SleepUnsupported(
                why.unwrap_or("no virtual memory management"),
            ));
        }
        let backend = self.backend();
        if !B::IMMEDIATE && !backend.idle(&self.bases) {
            return Err(KvError::Pending);
        }
        // No work may use the planes: every fence has completed, every block given back is free.
        self.complete_fences();
        let shift = self.group_shift;
        self.with(|s| {
            s.free_unfenced(shift);
            if !save && s.prefixed {
                // The bytes go: no key may find them again.
                s.uncache_all(true, shift);
            }
        });
        let mapped: Vec<usize> = self.with(|s| {
            (0..s.groups.len())
                .filter(|&g| s.groups[g].memory == Memory::Mapped)
                .collect()
        });
        let saved = if save {
            self.save(&mapped)?
        } else {
            Vec::new()
        };
        // Asleep from here: the free lists put aside, so nothing is handed out, and no graph
        // over the planes launches.
        self.awake.set(false);
        self.with(|s| {
            let groups = mapped
                .iter()
                .map(|&g| (g, std::mem::take(&mut s.groups[g].free)))
                .collect();
            s.asleep = Some(Box::new(Asleep { groups, saved }));
        });
        // The groups left partly mapped (no live block, never handed out) go too.
        let partial: Vec<usize> = self.with(|s| {
            (0..s.groups.len())
                .filter(|&g| s.groups[g].memory == Memory::Partial)
                .collect()
        });
        let mut failed = None;
        for &group in mapped.iter().chain(&partial) {
            if let Err(cause) = self.unmap_memory(group) {
                failed.get_or_insert(KvError::Unmap {
                    group,
                    cause: Box::new(cause),
                });
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// The bytes of each group of `groups` holding a live block, copied to the host.
    fn save(&self, groups: &[usize]) -> Result<Vec<Saved>, KvError> {
        let mut saved = Vec::new();
        for &group in groups {
            if self.with(|s| s.groups[group].live == 0) {
                continue;
            }
            let mut planes = Vec::with_capacity(self.bases.len());
            for plane in 0..self.bases.len() {
                let (at, len) = self.group_span(plane, group);
                let mut bytes = vec![0; len];
                self.backend()
                    .copy_to_host(&mut bytes, at)
                    .map_err(|e| KvError::Copy(Box::new(e)))?;
                planes.push(bytes);
            }
            saved.push((group, planes));
        }
        Ok(saved)
    }

    /// Wakes the cache: the groups mapped when it fell asleep are mapped again at the same
    /// addresses (from the device's granule cache first), the saved bytes copied back, and
    /// the free lists and every table are as they were. Blocks given back while it slept are
    /// free again (after a fence, on a backend that is not immediate).
    ///
    /// # Errors
    ///
    /// [`KvError::Awake`] unless it sleeps; [`KvError::Map`] or [`KvError::Copy`] when a group
    /// cannot be mapped or restored: it sleeps still (the groups woken so far stay mapped), and
    /// a later `wake` goes on from there.
    pub fn wake(&self) -> Result<(), KvError> {
        Scope::run::<B, _>(move || {
            let Some(mut asleep) = self.with(|s| s.asleep.take()) else {
                return Err(KvError::Awake);
            };
            let woken = self.wake_groups(&mut asleep);
            if let Err(e) = woken {
                self.with(|s| s.asleep = Some(asleep));
                return Err(e);
            }
            let Asleep { groups, .. } = *asleep;
            let shift = self.group_shift;
            self.with(|s| {
                for (g, free) in groups {
                    debug_assert_eq!(s.groups[g].memory, Memory::Mapped, "woken whole");
                    s.groups[g].free = free;
                }
                s.lowest = 0;
                self.awake.set(true);
                if B::IMMEDIATE {
                    s.free_unfenced(shift);
                }
            });
            Ok(())
        })
    }

    /// Maps each group of `asleep` not mapped yet, and copies its saved bytes back (those
    /// copied back leave `asleep`).
    fn wake_groups(&self, asleep: &mut Asleep) -> Result<(), KvError> {
        let backend = self.backend();
        for &(group, _) in &asleep.groups {
            // Unmapped, or partly (an unmap failed as it fell asleep): mapped whole again.
            if self.with(|s| s.groups[group].memory) != Memory::Mapped {
                self.map_memory(group).map_err(|cause| KvError::Map {
                    group,
                    cause: Box::new(cause),
                })?;
            }
            let Some(i) = asleep.saved.iter().position(|(g, _)| *g == group) else {
                continue;
            };
            for (plane, bytes) in asleep.saved[i].1.iter().enumerate() {
                let (at, _) = self.group_span(plane, group);
                backend
                    .copy_from_host(at, bytes)
                    .map_err(|e| KvError::Copy(Box::new(e)))?;
            }
            asleep.saved.swap_remove(i);
        }
        Ok(())
    }
}
