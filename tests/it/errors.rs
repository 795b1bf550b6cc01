//! Errors that `?`: every fallible transition with plain `?` in a function returning
//! the crate's `'static` error, a boxed `dyn Error + Send + Sync`, or `anyhow::Result`; the
//! conversion drops the token handed back, which tears down as any drop does (nothing lost);
//! printed whole, the message says what failed and why.

use memtoken::backend::doubles::Faulty;
use memtoken::backend::{HostBackend, Op, PosixFd};
use memtoken::{Binding, Budget, Device, make_guard, sharing::Offer};
use std::os::unix::net::UnixStream;

/// Reserve, commit, grow, suspend and resume, export and import, release and complete: each
/// with plain `?`.
macro_rules! transitions {
    ($binding:expr) => {{
        let binding = $binding;
        let g = binding.device().granularity();
        let mut kv = binding.reserve(g)?.commit()?;
        kv.as_mut_slice()[0] = 7;
        let mut region = binding.reserve(4 * g)?.into_region();
        region.grow(2)?;
        let asleep = region.suspend_saving()?;
        let region = asleep.resume()?;
        let exportable = binding
            .reserve(2 * g)?
            .commit_prefix_exportable::<PosixFd>()?;
        let export = exportable.export()?;
        let (x, y) = UnixStream::pair()?;
        export.send(&x)?;
        let imported = binding.import(Offer::recv(&y)?)?;
        imported.release().complete()?;
        drop(export);
        exportable.release().complete()?;
        region.release().complete()?;
        kv.release().complete()?;
    }};
}

fn with_anyhow(binding: &Binding<'_, '_, Faulty<HostBackend>>) -> anyhow::Result<()> {
    transitions!(binding);
    Ok(())
}

fn with_a_box(
    binding: &Binding<'_, '_, Faulty<HostBackend>>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    transitions!(binding);
    Ok(())
}

fn with_the_crates_error(
    binding: &Binding<'_, '_, Faulty<HostBackend>>,
) -> Result<(), memtoken::Error> {
    let g = binding.device().granularity();
    let mut kv = binding.reserve(g)?.commit()?;
    kv.as_mut_slice()[0] = 7;
    let mut region = binding.reserve(4 * g)?.into_region();
    region.grow(2)?;
    let region = region.suspend_saving()?.resume()?;
    region.release().complete()?;
    kv.release().complete()?;
    Ok(())
}

#[test]
#[cfg_attr(miri, ignore = "exports: a memfd, which Miri lacks")]
fn every_transition_takes_plain_question_marks() {
    make_guard!(guard);
    // It exports: a memfd whatever MEMTOKEN_HOST_MEMORY says.
    let backend = Faulty::new(memtoken::backend::HostBackend::with_defaults().unwrap());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    with_anyhow(&binding).unwrap();
    with_a_box(&binding).unwrap();
    with_the_crates_error(&binding).unwrap();
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

/// A failed commit through `?`: the error says what failed and why, the reservation it handed
/// back was dropped — released like any dropped token — and nothing is left.
#[test]
fn a_failed_transition_through_question_mark_loses_nothing_and_says_why() {
    make_guard!(guard);
    let backend = Faulty::new(crate::common::host());
    let faults = backend.handle();
    let device = Device::new(guard, backend);
    let binding = device.bind(Budget::unlimited()).unwrap();
    for round in 0..3 {
        faults.fail_nth(Op::Create, 1);
        let message = match round {
            0 => with_anyhow(&binding).unwrap_err().to_string(),
            1 => with_a_box(&binding).unwrap_err().to_string(),
            _ => with_the_crates_error(&binding).unwrap_err().to_string(),
        };
        assert!(message.starts_with("commit failed: "), "{message}");
        assert!(message.contains("fault injected"), "the why: {message}");
        assert!(message.contains("was dropped"), "the token: {message}");
        assert!(device.ledger().is_zero(), "{:?}", device.ledger());
    }
    with_the_crates_error(&binding).expect("no fault planned: it goes through");
    drop(binding);
    assert!(device.close().is_clean());
    assert!(faults.outstanding().is_zero());
}

/// `memtoken::cudarc` is the cudarc memtoken links — this compiles only if the
/// context type it names is the one `CudaBackend::from_context` takes.
#[cfg(feature = "cuda")]
#[allow(dead_code)]
fn memtokens_cudarc_is_the_one_it_links(
    ctx: std::sync::Arc<memtoken::cudarc::driver::CudaContext>,
) -> Result<
    memtoken::backend::cuda::CudaBackend<memtoken::backend::cuda::SysDriver>,
    memtoken::backend::cuda::CudaError,
> {
    memtoken::backend::cuda::CudaBackend::from_context(ctx)
}

/// Opening a context through memtoken where there is no driver is an error, not
/// cudarc's panic; where there is one, it opens (or the driver says why not).
#[cfg(feature = "cuda")]
#[test]
#[cfg_attr(miri, ignore = "loads the CUDA driver (dlopen), which Miri cannot")]
fn opening_a_context_without_a_driver_is_an_error() {
    use memtoken::backend::cuda::{CudaError, SysDriver, open_context};
    let opened = open_context(0);
    match SysDriver::load() {
        Err(_) => assert!(matches!(opened, Err(CudaError::NoDriver(_))), "{opened:?}"),
        Ok(_) => assert!(
            matches!(opened, Ok(_) | Err(CudaError::Driver { .. })),
            "{opened:?}"
        ),
    }
    assert!(open_context(-1).is_err());
}

/// The crate's errors that are not a token's failures convert
/// too, and whether the context is lost can be asked of any converted error (a refusal of bad
/// input says it is not).
#[test]
fn a_lost_context_is_found_in_any_converted_error() {
    use memtoken::backend::doubles::DriverModel;
    fn open() -> Result<(), memtoken::Error> {
        let _ = HostBackend::with_defaults()?; // a ConfigError
        Ok(())
    }
    open().unwrap();
    let model = DriverModel::default();
    make_guard!(guard);
    let device = Device::new(
        guard,
        memtoken::backend::cuda::CudaBackend::new(model.clone(), 0).unwrap(),
    );
    let binding = device.bind(Budget::unlimited()).unwrap();
    let reserved = binding.reserve(2 << 20).unwrap();
    let empty = || -> anyhow::Result<()> {
        let _ = binding.reserve(0)?;
        Ok(())
    };
    let e = empty().unwrap_err();
    assert!(!memtoken::errors::is_context_lost(e.as_ref()), "{e:#}");
    model.lose_context();
    let commit = |r| -> anyhow::Result<()> {
        let _ = memtoken::Allocation::commit(r)?;
        Ok(())
    };
    let e = commit(reserved).unwrap_err();
    assert!(memtoken::errors::is_context_lost(e.as_ref()), "{e}");
    let reserve = || -> anyhow::Result<()> {
        let _ = binding.reserve(2 << 20)?;
        Ok(())
    };
    let e = reserve().unwrap_err();
    assert!(memtoken::errors::is_context_lost(e.as_ref()), "{e:#}");
    drop(binding);
    let _ = device.close();
}

/// Converted into the crate's [`memtoken::Error`], every kind of failure opens its message
/// with its own summary — what failed, in a few words — then its chain. Fails if a summary is
/// lost (the message would open with ": ") or replaced.
#[test]
fn every_failure_opens_its_message_with_its_own_summary() {
    use memtoken::backend::{BackendError, Cause};
    use memtoken::{
        Error, errors::CommitFailure, errors::CowFailure, errors::GrowError,
        errors::ReleaseFailure, errors::ReserveError, errors::ResumeFailure, errors::ShareFailure,
        errors::ShrinkError, errors::SuspendFailure, errors::ViewError,
    };
    let backend = || BackendError {
        op: Op::Map,
        addr: 0x1000,
        len: 4096,
        cause: Cause::Os { errno: 12 },
    };
    let budget = || CommitFailure::Budget {
        requested: 2,
        used: 1,
        limit: 2,
    };
    let cases: Vec<(&str, Error)> = vec![
        (
            "the view could not be made",
            ViewError::Length { bytes: 3, size: 2 }.into(),
        ),
        (
            "the KV cache refused, or could not map or copy",
            memtoken::kv::KvError::Asleep.into(),
        ),
        (
            "the region could not shrink",
            ShrinkError::TooMany {
                requested: 2,
                committed: 1,
            }
            .into(),
        ),
        (
            "the reservation was refused",
            ReserveError::ZeroLength { granularity: 4096 }.into(),
        ),
        ("a backend call failed", backend().into()),
        (
            "the memory cannot be suspended yet",
            SuspendFailure::Pending.into(),
        ),
        (
            "suspending the memory failed",
            SuspendFailure::Backend(Box::new(backend())).into(),
        ),
        (
            "resuming the memory failed",
            ResumeFailure::Restore(Box::new(backend())).into(),
        ),
        (
            "the region could not grow",
            GrowError::Full {
                requested: 2,
                committed: 1,
                room: 2,
            }
            .into(),
        ),
        ("commit failed", budget().into()),
        (
            "mapping the prefix failed",
            ShareFailure::SizeMismatch {
                reservation: 1,
                prefix: 2,
            }
            .into(),
        ),
        (
            "copy-on-write of the boundary granule cannot start yet",
            CowFailure::Pending.into(),
        ),
        (
            "copy-on-write of the boundary granule failed",
            CowFailure::Private(Box::new(budget())).into(),
        ),
        (
            "the release cannot complete yet",
            ReleaseFailure::Pending.into(),
        ),
        (
            "the release cannot complete yet",
            ReleaseFailure::Stuck.into(),
        ),
        (
            "the release failed",
            ReleaseFailure::Backend(Box::new(backend())).into(),
        ),
        (
            "the prefix could not be imported",
            memtoken::sharing::ImportError::Granularity {
                offer: 4096,
                device: 8192,
            }
            .into(),
        ),
    ];
    for (summary, error) in &cases {
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("{summary}: ")) && message.len() > summary.len() + 2,
            "{message:?} does not open with {summary:?}"
        );
    }
}
