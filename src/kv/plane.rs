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

/// What a sparse reservation owns: per granule of the range, its physical memory while mapped;
/// and the granules whose unmap failed, still mapped, owned and charged (never mapped over
/// again; the release tries them once more).
#[derive(Debug)]
pub(crate) struct Slots<P> {
    pub(crate) granules: Vec<Option<P>>,
    pub(crate) withheld: Vec<Granule<P>>,
}

impl sealed::Sealed for Sparse {}

impl Repr for Sparse {
    type Parts<B: Backend> = Slots<B::Phys>;

    fn retire<B: Backend>(parts: Self::Parts<B>, at: Retiring<'_, B>) -> Retired<B> {
        let backend = at.backend;
        let g = backend.granularity();
        let Slots {
            granules,
            mut withheld,
        } = parts;
        // Each mapped granule is unmapped on its own: they need not be next to each other.
        withheld.extend(granules.into_iter().enumerate().filter_map(|(i, phys)| {
            phys.map(|phys| Granule {
                offset: i * g,
                len: g,
                phys,
                mapped: true,
            })
        }));
        let charged = withheld.len() * g;
        Retired {
            fence: Wait::unless(withheld.is_empty(), || backend.fence_for(&[at.addr])),
            held: Held {
                granules: withheld,
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
            withheld: Vec::new(),
        };
        Allocation::from_core(core, slots)
    }
}

impl<B: Backend> Allocation<'_, '_, B, Sparse> {
    /// Maps granules `first..first + n` (none of them mapped or withheld) read-write, all or
    /// nothing: each from the device's cache while it has one, else created (charged to the
    /// budgets first). On failure every granule this call mapped is unmapped and given back
    /// (one whose unmap fails too stays withheld), and the binding is charged nothing.
    pub(crate) fn map_granules(&mut self, first: usize, n: usize) -> Result<(), CommitFailure> {
        let core = self.core();
        let (binding, device) = (core.binding, core.device());
        let g = device.granularity();
        let at = |i: usize| core.addr + (first + i) * g;
        device
            .ensure_live(Op::Map, at(0), n * g)
            .map_err(CommitFailure::Backend)?;
        debug_assert!(
            self.parts().granules[first..first + n]
                .iter()
                .all(Option::is_none)
        );
        let mut got = Vec::with_capacity(n);
        let mut growth = binding.grow(n, &mut got)?;
        let mut failed = None;
        for i in 0..growth.taken() {
            if let Err(e) = growth.map_cached(at(i), got[i]) {
                growth.put_back(&mut got, i);
                failed = Some(CommitFailure::Backend(e));
                break;
            }
        }
        if failed.is_none() {
            for i in got.len()..n {
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
            let slots = &mut self.parts_mut().granules[first..first + n];
            for (slot, phys) in slots.iter_mut().zip(got) {
                *slot = Some(phys);
            }
            return Ok(());
        };
        // `got` holds exactly the granules mapped, those from the cache first.
        let mut back = binding.give_back(from_cache);
        for (i, phys) in got.into_iter().enumerate().rev() {
            match back.unmap(at(i)) {
                Ok(()) if i < from_cache => back.give(phys),
                Ok(()) => back.release(phys, g),
                Err(_) => self.parts_mut().withheld.push(Granule {
                    offset: (first + i) * g,
                    len: g,
                    phys,
                    mapped: true,
                }),
            }
        }
        back.finish();
        Err(cause)
    }

    /// Unmaps granules `first..first + n` (each mapped, and no work may still use them) and
    /// gives them back through `back`; one whose unmap fails stays withheld, still mapped, and
    /// the last such failure is returned (the others went).
    pub(crate) fn unmap_granules(
        &mut self,
        first: usize,
        n: usize,
        back: &mut GiveBack<'_, '_, '_, B>,
    ) -> Result<(), BackendError> {
        let core = self.core();
        let g = core.device().granularity();
        let mut failed = None;
        for i in first..first + n {
            let Some(phys) = self.parts_mut().granules[i].take() else {
                continue;
            };
            match back.unmap(core.addr + i * g) {
                Ok(()) => back.give(phys),
                Err(e) => {
                    self.parts_mut().withheld.push(Granule {
                        offset: i * g,
                        len: g,
                        phys,
                        mapped: true,
                    });
                    failed = Some(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}
