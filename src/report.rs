//! What a device reports: what its close and drop saw ([`CloseReport`], [`DropReport`]), what
//! a failed release left in custody ([`Custody`], [`Quarantined`], [`Residual`],
//! [`Holdings`], [`WithheldForPeer`]), how far a flush of the custody got ([`Progress`]),
//! what forgotten tokens and tables still hold ([`Forgotten`]), the ledger
//! ([`LedgerSnapshot`]), and the identities it names ([`Generation`], [`ContextLost`]). Guide:
//! [`guide::tokens`](crate::guide::tokens).

pub use crate::device::{
    CloseReport, Custody, DropReport, Forgotten, Progress, Quarantined, WithheldForPeer,
};
pub use crate::ids::{ContextLost, Generation};
pub use crate::ledger::LedgerSnapshot;
pub use crate::residual::{Holdings, Residual};
