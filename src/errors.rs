//! Why a transition failed, in detail: the cause each fallible transition hands back beside
//! its token ([`TransitionError`](crate::TransitionError)`<token, cause>`), the aliases of the
//! common ones, and the errors returned bare. Most code needs none of these names: `?`
//! turns every one into [`memtoken::Error`](crate::Error) (or `anyhow::Error`, or a boxed
//! `std::error::Error`); match on a cause to keep the token it hands back (to retry). Errors of
//! one policy live with it ([`sharing::ShareError`](crate::sharing::ShareError),
//! [`sleep::SuspendError`](crate::sleep::SuspendError), [`kv::KvError`](crate::kv::KvError),
//! …). Guide: [`guide::engines`](crate::guide::engines) ("Errors and `?`").

pub use crate::allocation::{CommitError, CompleteError};
pub use crate::device::QuarantineError;
pub use crate::error::{
    CommitFailure, CowFailure, Failure, GrowError, ReleaseFailure, ReserveError, ResumeFailure,
    Returned, ShareFailure, ShrinkError, SuspendFailure, ViewError, is_context_lost,
};
