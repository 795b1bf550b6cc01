//! One plane's memory on a mechanism that maps at reserved addresses: a reservation whose
//! granules are mapped anywhere in it, a group's at a time, each granule a physical allocation
//! of its own taken from (and given back to) the device's granule cache — the same granules,
//! budgets and ledger axes as an elastic region's, with holes.

use crate::allocation::Allocation;
use crate::backend::{Backend, BackendError, Op};
use crate::device::GiveBack;
use crate::error::CommitFailure;
use crate::residual::{Granule, Held};
use crate::state::{
    Reserved, Retired, Retiring, State, Wait,
    sealed::{self, Repr},
};

/// State of a plane's reservation: granules mapped read-write anywhere in it.
#[derive(Debug)]
pub(crate) enum Sparse {}

/// What a sparse reservation owns: per granule of the range, its physical memory while mapped.
/// A granule whose unmap failed stays here, still mapped, owned and charged (a later unmap, or
/// the release, tries again).
#[derive(Debug)]
pub(crate) struct Slots<P> {
    pub(crate) granules: Vec<Option<P>>,
}

impl sealed::Sealed for Sparse {}

impl Repr for Sparse {
    type Parts<B: Backend> = Slots<B::Phys>;

    fn retire<B: Backend>(parts: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let backend = at.backend;
        let g = backend.granularity();
        // Each mapped granule is unmapped on its own: they need not be next to each other.
        let granules: Vec<Granule<B::Phys>> = parts
            .granules
            .into_iter()
            .enumerate()
            .filter_map(|(i, phys)| {
                phys.map(|phys| Granule {
                    offset: i * g,
                    len: g,
                    phys,
                    mapped: true,
                })
            })
            .collect();
        let charged = granules.len() * g;
        Retired {
            fence: Wait::unless(granules.is_empty(), || backend.fence_for(&[at.addr])),
            held: Held {
                granules,
                ..Held::va()
            },
            charged,
            tail: 0,
        }
    }
}

impl State for Sparse {
    const NAME: &'static str = "KV plane";
}

impl<'b, 'id, B: Backend> Allocation<'b, 'id, B, Reserved> {
    /// This reservation, nothing mapped, ready to map granules anywhere in it. No backend call.
    pub(crate) fn into_sparse(self) -> Allocation<'b, 'id, B, Sparse> {
        let (core, ()) = self.into_core();
        let g = core.device().granularity();
        let slots = Slots {
            granules: (0..core.len / g).map(|_| None).collect(),
        };
        Allocation::from_core(core, slots)
    }
}

impl<B: Backend> Allocation<'_, '_, B, Sparse> {
    /// Maps the granules of `first..first + n` not mapped yet, read-write, all or nothing: each
    /// from the device's cache while it has one, else created (charged to the budgets first).
    /// Returns the granules it mapped. On failure every granule this call mapped is unmapped and
    /// given back (one whose unmap fails too stays mapped in its slot), and the binding is
    /// charged nothing more.
    pub(crate) fn map_granules(
        &mut self,
        first: usize,
        n: usize,
    ) -> Result<Vec<usize>, CommitFailure> {
        let core = self.core();
        let (binding, device) = (core.binding, core.device());
        let g = device.granularity();
        let missing: Vec<usize> = (first..first + n)
            .filter(|&i| self.parts().granules[i].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(missing);
        }
        let at = |i: usize| core.addr + i * g;
        device
            .ensure_live(Op::Map, at(missing[0]), missing.len() * g)
            .map_err(CommitFailure::Backend)?;
        let mut got = Vec::with_capacity(missing.len());
        let mut growth = binding.grow(missing.len(), &mut got)?;
        let mut failed = None;
        for k in 0..growth.taken() {
            if let Err(e) = growth.map_cached(at(missing[k]), got[k]) {
                growth.put_back(&mut got, k);
                failed = Some(CommitFailure::Backend(e));
                break;
            }
        }
        if failed.is_none() {
            for &i in &missing[got.len()..] {
                match growth.map_new(at(i)) {
                    Ok(phys) => got.push(phys),
                    Err((cause, _quarantined)) => {
                        failed = Some(cause);
                        break;
                    }
                }
            }
        }
        let from_cache = growth.cached();
        growth.finish();
        let Some(cause) = failed else {
            for (&i, phys) in missing.iter().zip(got) {
                self.parts_mut().granules[i] = Some(phys);
            }
            return Ok(missing);
        };
        // `got` holds exactly the granules mapped, those from the cache first.
        let mut back = binding.give_back(from_cache);
        for (k, phys) in got.into_iter().enumerate().rev() {
            match back.unmap(at(missing[k])) {
                Ok(()) if k < from_cache => back.give(phys),
                Ok(()) => back.release(phys, g),
                // Still mapped: it stays in its slot, owned and charged.
                Err(_) => self.parts_mut().granules[missing[k]] = Some(phys),
            }
        }
        back.finish();
        Err(cause)
    }

    /// Unmaps the mapped granules among `granules` (no work may still use them) and gives them
    /// back through `back`; one whose unmap fails stays mapped in its slot, and the last such
    /// failure is returned (the others went).
    pub(crate) fn unmap_granules(
        &mut self,
        granules: impl IntoIterator<Item = usize>,
        back: &mut GiveBack<'_, '_, '_, B>,
    ) -> Result<(), BackendError> {
        let core = self.core();
        let g = core.device().granularity();
        let mut failed = None;
        for i in granules {
            let Some(phys) = self.parts().granules[i] else {
                continue;
            };
            match back.unmap(core.addr + i * g) {
                Ok(()) => {
                    self.parts_mut().granules[i] = None;
                    back.give(phys);
                }
                Err(e) => failed = Some(e),
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// How many of granules `first..first + n` are mapped.
    pub(crate) fn mapped_in(&self, first: usize, n: usize) -> usize {
        self.parts().granules[first..first + n]
            .iter()
            .filter(|g| g.is_some())
            .count()
    }
}
