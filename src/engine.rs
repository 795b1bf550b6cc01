//! [`Engine`]: a device, its bindings and a KV cache owned together with what a program keeps
//! over them (tokens, regions, block tables, a prefix cache) — a value a constructor returns and a
//! struct can hold, torn down in order when it goes.
#![allow(unsafe_code)] // the owned device's brand is erased and re-branded per call, each block with its `// SAFETY:` proof

use crate::backend::Backend;
use crate::device::{Binding, CloseReport, Device};
use crate::kv::{KvCache, Layout};
use crate::ledger::Budget;
use generativity::{Guard, Id};
use std::fmt;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;

/// What an [`Engine`] keeps over its device: a family of types, one for each lifetime `'e`
/// the engine lends its parts for (`'e` stands for the device's brand, the binding's and the
/// cache's borrows at once). Implement it on a marker type:
///
/// ```
/// use memtoken::{Allocation, Committed, Engine, Keeps};
/// use memtoken::backend::HostBackend;
/// use memtoken::kv::{BlockTable, Layout};
///
/// struct Serving;
/// struct Kept<'e> {
///     weights: Allocation<'e, 'e, HostBackend, Committed>,
///     sequence: BlockTable<'e, 'e, 'e, 'e, HostBackend>,
/// }
/// impl Keeps<HostBackend> for Serving {
///     type Of<'e> = Kept<'e>;
/// }
///
/// fn start() -> Result<Engine<HostBackend, Serving>, memtoken::Error> {
///     // A KV cache of 64 blocks of 16 tokens, one plane of 4 KiB a block.
///     let layout = Layout::new(64, 16).plane(4096);
///     Engine::new(HostBackend::with_defaults()?, memtoken::Budget::unlimited(), &layout, |parts| {
///         let g = parts.device.granularity();
///         let mut weights = parts.binding.reserve(g)?.commit()?;
///         weights.as_mut_slice()[0] = 7;
///         parts.cache.replenish()?;
///         Ok(Kept { weights, sequence: parts.cache.table() })
///     })
/// }
///
/// let mut engine = start()?; // returned from a constructor: it owns its device
/// engine.with(|parts, kept| -> Result<(), memtoken::Error> {
///     parts.cache.push(&mut kept.sequence)?;
///     assert_eq!(kept.weights.as_slice()[0], 7);
///     Ok(())
/// })?;
/// assert!(engine.close().is_clean());
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub trait Keeps<B: Backend> {
    /// What is kept, for parts lent for `'e`.
    type Of<'e>;
}

/// The parts an [`Engine`] lends for `'e`: its device, its bindings and its KV cache.
pub struct Parts<'e, B: Backend> {
    /// The device.
    pub device: &'e Device<'e, B>,
    /// The first binding (its budget and context pin): the KV cache draws from it.
    pub binding: &'e Binding<'e, 'e, B>,
    /// Every binding, in the order of the budgets given to
    /// [`with_bindings`](Engine::with_bindings) (the first is [`binding`](Self::binding)).
    pub bindings: &'e [Binding<'e, 'e, B>],
    /// The KV cache, drawing from the binding.
    pub cache: &'e KvCache<'e, 'e, 'e, B>,
}

impl<B: Backend> Clone for Parts<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Parts<'_, B> {}

/// A device, its bindings and a KV cache, owned together with what the program keeps over
/// them (`K::Of`): made by a constructor ([`new`](Self::new)) and returned, held in a struct,
/// moved to another thread and back — with the block tables it keeps (a table is `Send` only
/// as part of an engine: see [`BlockTable`](crate::kv::BlockTable)), tokens and regions; not
/// with a [`PrefixCache`](crate::kv::PrefixCache) (see [`OneThread`](crate::kv::OneThread)). Its parts are lent to closures
/// ([`with`](Self::with)) for a lifetime the closure cannot name beyond the call — as
/// [`make_guard!`](crate::make_guard) brands a device, each call brands them afresh — so
/// nothing borrowed from an engine outlives the call, and one engine's tokens never meet
/// another's (a compile error; `ui-tests/engine_mix.rs`):
///
/// ```compile_fail,E0521
/// use memtoken::{Allocation, Budget, Engine, Keeps, Reserved};
/// use memtoken::backend::HostBackend;
/// struct Tokens;
/// impl Keeps<HostBackend> for Tokens {
///     type Of<'e> = Vec<Allocation<'e, 'e, HostBackend, Reserved>>;
/// }
/// let new = || Engine::<HostBackend, Tokens>::new(
///     HostBackend::with_defaults().unwrap(), Budget::unlimited(),
///     &memtoken::kv::Layout::new(64, 16).plane(4096), |_| Ok(Vec::new()),
/// ).unwrap();
/// let (mut a, mut b) = (new(), new());
/// a.with(|pa, _| b.with(|_, kept| kept.push(pa.binding.reserve(4096).unwrap())));
/// ```
///
/// **Teardown order** is the type system's elsewhere and the engine's here: what it keeps goes
/// first (each token released as when dropped), then the KV cache, then the bindings, then the
/// device — [`close`](Self::close) says what the device's close saw.
pub struct Engine<B: Backend + 'static, K: Keeps<B>> {
    kept: ManuallyDrop<K::Of<'static>>,
    /// Owned (from `Box::leak`): freed in `Drop`, after `kept`, before `bindings`.
    cache: NonNull<KvCache<'static, 'static, 'static, B>>,
    /// Owned (a leaked boxed slice, at least one): freed after `cache`, before `device`.
    bindings: NonNull<[Binding<'static, 'static, B>]>,
    /// Owned: freed (or closed) last.
    device: NonNull<Device<'static, B>>,
}

// SAFETY: the engine owns its device, bindings and KV cache (through the pointers) and what it
// keeps: it may move to another thread when each of them may, which the bounds require.
unsafe impl<B: Backend + 'static, K: Keeps<B>> Send for Engine<B, K>
where
    Device<'static, B>: Send,
    Binding<'static, 'static, B>: Send,
    KvCache<'static, 'static, 'static, B>: Send,
    K::Of<'static>: Send,
{
}

impl<B: Backend + 'static, K: Keeps<B>> Engine<B, K> {
    /// An engine over `backend`: a device, a binding of `budget`, a KV cache of `layout`
    /// drawing from it (its planes reserved, nothing mapped but the null block's group until
    /// [`KvCache::replenish`]), and what `build` makes with them.
    ///
    /// # Errors
    ///
    /// The binding's, the cache's or `build`'s error; what was made is torn down first.
    pub fn new(
        backend: B,
        budget: Budget,
        layout: &Layout,
        build: impl for<'e> FnOnce(Parts<'e, B>) -> Result<K::Of<'e>, crate::Error>,
    ) -> Result<Self, crate::Error> {
        Self::with_bindings(backend, budget, &[], layout, build)
    }

    /// As [`new`](Self::new), with a binding of `budget` and one more for each of `more`:
    /// tenants, or weights and KV cache, each under its own budget. The KV cache draws from
    /// the first; [`Parts::bindings`] lends them all, in this order.
    ///
    /// # Errors
    ///
    /// As for [`new`](Self::new).
    pub fn with_bindings(
        backend: B,
        budget: Budget,
        more: &[Budget],
        layout: &Layout,
        build: impl for<'e> FnOnce(Parts<'e, B>) -> Result<K::Of<'e>, crate::Error>,
    ) -> Result<Self, crate::Error> {
        // SAFETY: the brand `'static` is never seen outside the engine: every part is lent to
        // a closure generic over `'e` (`for<'e>`), which is as unique as `make_guard!`'s brand
        // for the length of the call, so no token of another device can meet this one's.
        let guard = unsafe { Guard::new(Id::new()) };
        let device = NonNull::from(Box::leak(Box::new(Device::new(guard, backend))));
        // Frees what is made so far if a step fails or panics (a bind, the cache, `build`): by
        // then what borrowed the parts is dropped (or forgotten: leaked, never freed under a
        // borrow), so nothing borrows them.
        let mut unbuilt = FreeParts {
            cache: None,
            bindings: None,
            device: Some(device),
        };
        // SAFETY: `device` was just leaked from a box and is freed only by `Drop`/`close` (or
        // the guard), after everything that borrows it.
        let d: &'static Device<'static, B> = unsafe { device.as_ref() };
        let budgets = std::iter::once(&budget).chain(more);
        // The bindings made before a failing one are dropped by `collect`.
        let made = budgets
            .map(|&budget| d.bind(budget))
            .collect::<Result<Vec<_>, _>>()?;
        let bindings = NonNull::from(Box::leak(made.into_boxed_slice()));
        unbuilt.bindings = Some(bindings);
        // SAFETY: as for `device`: freed only after what borrows them.
        let bs: &'static [Binding<'static, 'static, B>] = unsafe { bindings.as_ref() };
        // SAFETY: as for the device's brand.
        let cache_guard = unsafe { Guard::new(Id::new()) };
        let cache = NonNull::from(Box::leak(Box::new(KvCache::new(
            cache_guard,
            &bs[0],
            layout,
        )?)));
        unbuilt.cache = Some(cache);
        // SAFETY: as for `device`.
        let c: &'static KvCache<'static, 'static, 'static, B> = unsafe { cache.as_ref() };
        let kept = build(Parts {
            device: d,
            binding: &bs[0],
            bindings: bs,
            cache: c,
        })?;
        unbuilt.disarm(); // the engine owns them now
        Ok(Self {
            kept: ManuallyDrop::new(kept),
            cache,
            bindings,
            device,
        })
    }

    /// Lends the parts and what is kept to `f`, for a lifetime `f` cannot name outside the
    /// call (it is generic over `'e`), so nothing borrowed escapes it
    /// (`ui-tests/engine_part_escapes.rs`):
    ///
    /// ```compile_fail
    /// # use memtoken::{Budget, Engine, Keeps};
    /// # use memtoken::backend::HostBackend;
    /// # struct Nothing;
    /// # impl Keeps<HostBackend> for Nothing { type Of<'e> = (); }
    /// let mut engine = Engine::<HostBackend, Nothing>::new(
    ///     HostBackend::with_defaults().unwrap(), Budget::unlimited(),
    ///     &memtoken::kv::Layout::new(64, 16).plane(4096), |_| Ok(()),
    /// ).unwrap();
    /// let token = engine.with(|parts, _| parts.binding.reserve(4096).unwrap()); // error
    /// drop(engine);
    /// drop(token);
    /// ```
    pub fn with<R>(&mut self, f: impl for<'e> FnOnce(Parts<'e, B>, &mut K::Of<'e>) -> R) -> R {
        // SAFETY: the parts live until the engine is dropped, which `&mut self` excludes for
        // the call; `f` is generic over `'e`, so what it is lent cannot outlive the call.
        let parts = unsafe { self.parts() };
        f(parts, &mut self.kept)
    }

    /// Tears everything down in order — what is kept, the KV cache, the bindings — and closes the
    /// device: what it left, if anything.
    pub fn close(self) -> CloseReport {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: taken once (`this` is never dropped); nothing borrows what is kept after.
        drop(unsafe { ManuallyDrop::take(&mut this.kept) });
        // SAFETY: the cache and the bindings are freed once, after what borrowed them.
        unsafe {
            drop(Box::from_raw(this.cache.as_ptr()));
            drop(Box::from_raw(this.bindings.as_ptr()));
        }
        // SAFETY: nothing borrows the device any more; freed once.
        let device = unsafe { Box::from_raw(this.device.as_ptr()) };
        device.close()
    }

    /// The parts, branded `'e`.
    ///
    /// # Safety
    ///
    /// The returned references are valid while the engine is not dropped; the caller lends
    /// them only to a closure generic over `'e`.
    unsafe fn parts<'e>(&self) -> Parts<'e, B> {
        // SAFETY: the caller's promise; each pointer came from a box this engine owns, and
        // the bindings are at least one (`with_bindings` makes the first).
        unsafe {
            let bindings = &*(self.bindings.as_ptr() as *const [Binding<'e, 'e, B>]);
            Parts {
                device: &*self.device.as_ptr().cast::<Device<'e, B>>(),
                binding: &bindings[0],
                bindings,
                cache: &*self.cache.as_ptr().cast::<KvCache<'e, 'e, 'e, B>>(),
            }
        }
    }
}

/// Frees, when it goes — also while a panic unwinds — the parts it holds: the KV cache, the
/// bindings and the device, in that order.
struct FreeParts<B: Backend + 'static> {
    cache: Option<NonNull<KvCache<'static, 'static, 'static, B>>>,
    bindings: Option<NonNull<[Binding<'static, 'static, B>]>>,
    device: Option<NonNull<Device<'static, B>>>,
}

impl<B: Backend + 'static> FreeParts<B> {
    /// Frees nothing: whoever armed it keeps the parts.
    fn disarm(&mut self) {
        (self.cache, self.bindings, self.device) = (None, None, None);
    }
}

impl<B: Backend + 'static> Drop for FreeParts<B> {
    fn drop(&mut self) {
        // SAFETY: each pointer came from `Box::leak` and is freed once (taken); whoever armed
        // the guard made sure nothing borrows the parts any more when it goes (what borrowed
        // them was dropped first), and disarms it where they live on.
        unsafe {
            if let Some(cache) = self.cache.take() {
                drop(Box::from_raw(cache.as_ptr()));
            }
            if let Some(bindings) = self.bindings.take() {
                drop(Box::from_raw(bindings.as_ptr()));
            }
            if let Some(device) = self.device.take() {
                drop(Box::from_raw(device.as_ptr()));
            }
        }
    }
}

impl<B: Backend + 'static, K: Keeps<B>> Drop for Engine<B, K> {
    fn drop(&mut self) {
        // The parts go after what is kept — also if dropping it panics (its other fields are
        // dropped while the panic unwinds, before this guard).
        let _parts = FreeParts {
            cache: Some(self.cache),
            bindings: Some(self.bindings),
            device: Some(self.device),
        };
        // SAFETY: dropped once; nothing uses it after.
        unsafe { ManuallyDrop::drop(&mut self.kept) };
    }
}

impl<B: Backend + 'static, K: Keeps<B>> fmt::Debug for Engine<B, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}
