//! [`TransitionError`], the one shape of every error that hands a token back, and [`Error`],
//! what `?` turns every memtoken error into.

use super::Failure;
use crate::backend::BackendError;
use std::fmt;

/// A failed transition: the token it hands back — nothing is lost — and why.
///
/// Every fallible transition returns this shape (through an alias such as
/// [`CommitError`](crate::errors::CommitError)); its `Display` says what failed, why (the cause's
/// whole chain), and what the token is now.
///
/// **`?` converts it** into [`memtoken::Error`](Error) or a
/// `Box<dyn std::error::Error + Send + Sync>` (or `Box<dyn std::error::Error>`), dropping the
/// token it hands back — which tears
/// down as any dropped token does: nothing is lost, its release is deferred if it must wait.
/// To keep the token (to retry), match on the error instead. With feature `anyhow`, `?`
/// converts it into an `anyhow::Error` the same way.
///
/// It is deliberately **not** a `std::error::Error` itself: it borrows its binding (the token
/// does), so it is not `'static`, and as an `Error` it would fall under std's blanket
/// `From<E: Error>` for boxes, which keeps the borrow — `?` would then fail with "cannot
/// return value referencing local variable". Not being one, it converts by these `From`
/// impls instead, which drop the token and keep the message and the cause.
///
/// ```
/// use memtoken::{make_guard, Budget, Device, sharing::Offer};
/// use memtoken::backend::{HostBackend, PosixFd};
///
/// fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     make_guard!(guard);
///     let device = Device::new(guard, HostBackend::with_defaults()?);
///     let g = device.granularity();
///     let session = device.bind(Budget::unlimited())?;
///     let mut kv = session.reserve(g)?.commit()?; // plain `?`
///     kv.as_mut_slice()[0] = 1;
///     let mut region = session.reserve(4 * g)?.into_region();
///     region.grow(2)?;
///     let asleep = region.suspend_saving()?;
///     let _region = asleep.resume()?;
///     let prompt = session.reserve(2 * g)?.commit_prefix_exportable::<PosixFd>()?;
///     let export = prompt.export()?;
///     let (a, b) = std::os::unix::net::UnixStream::pair()?;
///     export.send(&a)?;
///     let _imported = session.import(Offer::recv(&b)?)?;
///     let _receipt = kv.release().complete()?;
///     Ok(())
/// }
/// run().unwrap();
/// ```
pub struct TransitionError<T, C> {
    /// What the transition hands back: the same token, or what is left of it.
    pub token: T,
    /// Why it failed.
    pub cause: C,
}

impl<T, C> TransitionError<T, C> {
    /// The token, to retry the transition, release it, or retry the quarantine.
    pub fn into_token(self) -> T {
        self.token
    }

    pub(crate) fn map_token<U>(self, f: impl FnOnce(T) -> U) -> TransitionError<U, C> {
        TransitionError {
            token: f(self.token),
            cause: self.cause,
        }
    }
}

/// What a transition that can fail two ways hands back.
#[derive(Debug)]
pub enum Returned<T, Q> {
    /// Everything was undone: the same token, unchanged — retry, or release it.
    Unchanged(T),
    /// What could not be undone is quarantined — retry it, or discharge it once the context is
    /// lost.
    Quarantined(Q),
}

impl<T: fmt::Display, Q: fmt::Display> fmt::Display for Returned<T, Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unchanged(t) => write!(f, "{t}, unchanged"),
            Self::Quarantined(q) => q.fmt(f),
        }
    }
}

impl<T: fmt::Display, C: Failure> fmt::Display for TransitionError<T, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}; the error hands back {}",
            self.cause.summary(),
            Chain(&self.cause),
            self.token
        )
    }
}

/// An error and its whole chain of sources, joined by ": ".
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

/// A failed transition's error with its token dropped (see [`TransitionError`]): `'static`,
/// `Send` and `Sync`, so it goes into any error type. Its message says what failed and why —
/// the whole chain — and what the token was; [`cause`](Self::cause) is the cause, and
/// [`is_context_lost`](Self::is_context_lost) asks it.
#[derive(Debug)]
pub struct Error {
    message: String,
    cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    context_lost: bool,
}

impl Error {
    /// Whether it failed because the device's context is lost (see
    /// [`Failure::is_context_lost`]).
    pub fn is_context_lost(&self) -> bool {
        self.context_lost
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error {
    /// The cause: the failed transition's own error, whose chain the message already says.
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.cause
    }
}

/// No `source`: the message says the whole chain already (a chain walker would print each
/// cause twice); [`cause`](Error::cause) is there for the structured question.
impl std::error::Error for Error {}

impl<T: fmt::Display, C: Failure + Send + Sync> From<TransitionError<T, C>> for Error {
    /// Keeps the message and the cause; drops the token, which tears down as any dropped
    /// token does.
    fn from(e: TransitionError<T, C>) -> Self {
        let message = format!(
            "{}: {}; the token it handed back ({}) was dropped",
            e.cause.summary(),
            Chain(&e.cause),
            e.token
        );
        let context_lost = e.cause.is_context_lost();
        Self {
            message,
            cause: Box::new(e.cause),
            context_lost,
        }
    }
}

impl<E: Failure + Send + Sync> From<E> for Error {
    /// Any other failure of the crate's (a reservation, a KV cache, a view, an import, a
    /// backend call): its message and chain, as [`Error`]'s.
    fn from(e: E) -> Self {
        Self {
            message: format!("{}: {}", e.summary(), Chain(&e)),
            context_lost: e.is_context_lost(),
            cause: Box::new(e),
        }
    }
}

impl Error {
    /// One of the crate's errors that is not a failure of a token (a backend's settings, a
    /// message on the wire, opening a CUDA device), its chain in the message.
    pub(crate) fn plain(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self {
            message: Chain(&e).to_string(),
            context_lost: false,
            cause: Box::new(e),
        }
    }
}

impl From<crate::backend::ConfigError> for Error {
    fn from(e: crate::backend::ConfigError) -> Self {
        Self::plain(e)
    }
}

impl From<crate::backend::cuda::CudaError> for Error {
    fn from(e: crate::backend::cuda::CudaError) -> Self {
        Self::plain(e)
    }
}

/// Whether `error` — any error, as `?` converted it (a [`memtoken::Error`](Error), a box, an
/// `anyhow::Error` through `as_ref()`) — says that the device's context is lost: an [`Error`]
/// that says so, or a chain of sources with a [`BackendError`] that does. The question to ask
/// before discharging what is left with the proof from `Device::confirm_context_lost`.
pub fn is_context_lost(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(ours) = e.downcast_ref::<Error>() {
            return ours.is_context_lost();
        }
        if let Some(backend) = e.downcast_ref::<BackendError>() {
            return backend.is_context_lost();
        }
        // A failure's source is often its boxed backend error.
        if let Some(backend) = e.downcast_ref::<Box<BackendError>>() {
            return backend.is_context_lost();
        }
        next = e.source();
    }
    false
}

impl<T: fmt::Display, C: Failure + Send + Sync> From<TransitionError<T, C>>
    for Box<dyn std::error::Error + Send + Sync>
{
    fn from(e: TransitionError<T, C>) -> Self {
        Box::new(Error::from(e))
    }
}

impl<T: fmt::Display, C: Failure + Send + Sync> From<TransitionError<T, C>>
    for Box<dyn std::error::Error>
{
    fn from(e: TransitionError<T, C>) -> Self {
        Box::new(Error::from(e))
    }
}

#[cfg(feature = "anyhow")]
#[cfg_attr(docsrs, doc(cfg(feature = "anyhow")))]
impl<T: fmt::Display, C: Failure + Send + Sync> From<TransitionError<T, C>> for anyhow::Error {
    fn from(e: TransitionError<T, C>) -> Self {
        anyhow::Error::new(Error::from(e))
    }
}

impl<T: fmt::Display, C: Failure> fmt::Debug for TransitionError<T, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("token", &format_args!("{}", self.token))
            .field("cause", &self.cause)
            .finish()
    }
}
