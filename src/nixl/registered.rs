//! [`Registered`]: a token registered with NIXL, and its release.

#[cfg(doc)]
use super::{Agent, Peer};
use super::{NixlError, Registered};
use crate::allocation::Allocation;
use crate::backend::Backend;
use crate::transfer::Registrable;
use std::fmt;
use std::mem::ManuallyDrop;

impl<'a, 'b, 'id, B: Backend, S: Registrable> Registered<'a, 'b, 'id, B, S> {
    /// The registered memory's length.
    pub fn len(&self) -> usize {
        self.span.len
    }

    /// Whether it is empty (never: a token holds at least a granule).
    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }

    /// Whether a transfer that used it did not finish, is still in flight or was forgotten
    /// (`mem::forget`): the engine may still touch it, and it can only be withheld.
    pub fn is_poisoned(&self) -> bool {
        self.marks.busy()
    }

    /// Why the memory may still be touched: peers offered it that are not done, or a transfer
    /// in flight, forgotten or unfinished. `None` when nothing can touch it.
    pub(super) fn exposure(&self) -> Option<NixlError> {
        let _ = self.agent.collect(); // acknowledgements that arrived count
        let peers = self.agent.book().pending(self.id);
        let poisoned = self.is_poisoned();
        (poisoned || !peers.is_empty()).then_some(NixlError::Exposed { peers, poisoned })
    }

    /// The token — its bytes, through its views — while nothing else can touch the memory: no
    /// peer it was offered to is still holding it and no transfer of it runs (a READ borrows
    /// the registration mutably; a new offer too).
    ///
    /// # Errors
    ///
    /// [`NixlError::Exposed`]: which peers may still touch it, or an unfinished transfer.
    pub fn token(&self) -> Result<&Allocation<'b, 'id, B, S>, NixlError> {
        match self.exposure() {
            None => Ok(&self.token),
            Some(e) => Err(e),
        }
    }

    /// Deregisters the memory and gives the token back, once every peer it was offered to is
    /// done with it (see [`Peer::done`], [`Agent::peer_exited`]) and every transfer of it has
    /// finished. Otherwise the memory is withheld for good — never reused, its VA and
    /// physical memory kept — and the error says which peers (and whether a transfer) may
    /// still touch it; [`Device::withheld_for_peers`](crate::Device::withheld_for_peers) and
    /// the device's close report name them too.
    ///
    /// # Errors
    ///
    /// [`NixlError::Exposed`], the memory withheld.
    pub fn release(self) -> Result<Allocation<'b, 'id, B, S>, NixlError> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so `settle` runs once.
        unsafe { this.settle() }
    }

    /// Deregisters and gives the token back, or withholds it (see
    /// [`release`](Self::release)).
    ///
    /// # Safety
    ///
    /// Called once; the registration is not used after (its token and handle are taken).
    pub(super) unsafe fn settle(&mut self) -> Result<Allocation<'b, 'id, B, S>, NixlError> {
        let exposure = self.exposure();
        // SAFETY: the caller's promise: taken once.
        let (token, handle) = unsafe {
            (
                ManuallyDrop::take(&mut self.token),
                ManuallyDrop::take(&mut self.handle),
            )
        };
        self.agent.book().exposed.remove(&self.id);
        let Some(e) = exposure else {
            drop(handle); // deregistered (nixl-sys discards NIXL's status)
            return Ok(token);
        };
        let peers = match &e {
            NixlError::Exposed { peers, .. } if !peers.is_empty() => peers.join(", "),
            _ => "a transfer in flight, forgotten or unfinished".to_owned(),
        };
        if self.is_poisoned() {
            // The engine may still run a request over it: NIXL's registration stays.
            std::mem::forget(handle);
        } else {
            drop(handle);
        }
        token.withhold_for_peer(peers);
        Err(e)
    }
}

impl<B: Backend, S: Registrable> Drop for Registered<'_, '_, '_, B, S> {
    fn drop(&mut self) {
        // SAFETY: once, here; nothing uses `self` after. The token is dropped or withheld.
        let _ = unsafe { self.settle() };
    }
}

impl<B: Backend, S: Registrable> fmt::Debug for Registered<'_, '_, '_, B, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("addr", &format_args!("{:#x}", self.span.addr))
            .field("len", &self.span.len)
            .field("poisoned", &self.is_poisoned())
            .finish()
    }
}
