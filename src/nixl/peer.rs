//! [`Peer`]: another agent's exposed memory, loaded from its offer; its proof of being done.

#[cfg(doc)]
use super::Agent;
use super::{DONE, DROP_WAIT, Marks, NixlError, Peer, RemoteRange, Transfer, engine};
#[cfg(feature = "test-hooks")]
use super::{kind, remote_list};
use crate::backend::Backend;
use crate::nixl_wire;
use nixl_sys::{MemType, XferDescList, XferOp};
use std::fmt;
use std::sync::atomic::Ordering;

impl<B: Backend> Peer<'_, '_, '_, B> {
    /// Its agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The regions it offered: start and length of each.
    pub fn regions(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + '_ {
        self.regions.iter().map(|r| (r.addr, r.len))
    }

    /// `len` bytes at `offset` of its `region`-th offered region, in that region's memory kind
    /// and device (as the peer offered it).
    ///
    /// # Errors
    ///
    /// [`NixlError::NoRegion`] past the last region, [`NixlError::Range`] outside it.
    pub fn range(
        &self,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<RemoteRange, NixlError> {
        Ok(nixl_wire::remote_desc(&self.regions, region, offset, len)?)
    }

    /// NIXL's descriptor list of the peer's side of a transfer over `remote`, as a transfer
    /// with this peer builds it — built, not posted (feature `test-hooks`: memtoken's tests).
    ///
    /// # Errors
    ///
    /// [`NixlError::MixedKinds`]; NIXL's error.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn remote_list(&self, remote: &[RemoteRange]) -> Result<XferDescList<'static>, NixlError> {
        let (local, _) = kind(self.agent.device.backend().location())?;
        remote_list(remote, local)
    }

    /// Done with the peer's memory: its metadata is invalidated here (no transfer can reach
    /// it any more), then the peer is told so — the acknowledgement its agent takes as the
    /// proof that this agent will not touch what it offered. No transfer with it can run: each
    /// borrows the peer.
    ///
    /// # Errors
    ///
    /// [`NixlError::Tainted`] if a transfer with it did not finish (nothing is acknowledged:
    /// the peer withholds what it offered); NIXL's error.
    pub fn done(mut self) -> Result<(), NixlError> {
        self.finish()
    }

    /// Adds a later offer of the same agent (its regions follow those offered before, in
    /// [`regions`](Self::regions) and [`range`](Self::range)); [`done`](Self::done) then
    /// acknowledges it too. Taking the peer mutably, it waits for no transfer with it.
    ///
    /// # Errors
    ///
    /// As for [`Agent::load`], and [`NixlError::Wire`] for an offer of another agent; the
    /// peer is unchanged then.
    pub fn extend(&mut self, metadata: &[u8]) -> Result<(), NixlError> {
        let decoded = self.agent.check(metadata)?;
        if decoded.offered_by != self.name.as_bytes()
            || decoded.instance != self.remote.instance.load(Ordering::Acquire)
        {
            return Err(NixlError::Wire("an offer of another agent than the peer's"));
        }
        if decoded.epoch <= self.epoch {
            return Err(NixlError::NotNewer {
                epoch: decoded.epoch,
                loaded: self.epoch,
            });
        }
        let again = self.agent.load_md(decoded.md)?;
        if again != self.name {
            // Not this peer's: its descriptors go again (unless a Peer of that agent is live).
            self.agent.forget_loaded([again.as_str()], None);
            return Err(NixlError::Wire("its descriptors are another agent's"));
        }
        self.epoch = decoded.epoch;
        self.regions.extend(decoded.regions);
        self.mailbox = decoded.mailbox;
        self.mailbox_md = decoded.mailbox_md.to_vec();
        Ok(())
    }

    pub(super) fn finish(&mut self) -> Result<(), NixlError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        // First: these offers can never be loaded again, whatever happens below.
        let instance = self.remote.instance.load(Ordering::Acquire);
        let mut acked = crate::backend::lock(&self.remote.acked);
        let last = acked.entry(instance).or_insert(0);
        *last = (*last).max(self.epoch);
        drop(acked);
        let acknowledged = self.acknowledge();
        // Sent or not, the metadata goes (connection included) and the name may be loaded
        // afresh from now on: one step under the book's lock.
        self.agent
            .forget_loaded([self.name.as_str()], Some(&self.remote));
        acknowledged
    }

    /// Invalidates the peer's metadata, then acknowledges its offers with a write into its
    /// mailbox whose completion says it went out, unless a transfer with it may still run.
    pub(super) fn acknowledge(&self) -> Result<(), NixlError> {
        let raw = &self.agent.raw;
        raw.invalidate_remote_md(&self.name)
            .map_err(engine("invalidateRemoteMD"))?;
        // A transfer in flight, forgotten or unfinished may still touch the peer's memory.
        if self.remote.marks.busy() {
            return Err(NixlError::Tainted(self.name.clone()));
        }
        // Connection information and the mailbox only: no region of the peer's is reachable.
        let sent = [&self.conn, &self.mailbox_md]
            .into_iter()
            .try_for_each(|part| self.agent.load_md(part).map(drop))
            .and_then(|()| self.send_acknowledgement());
        // The caller invalidates the metadata again, connection included, sent or not, so
        // that an agent of the name (this one or a new incarnation) can be loaded afresh.
        sent
    }

    /// The acknowledgement: a write into the peer's mailbox, with the notification, waited
    /// for (its completion says it went out).
    pub(super) fn send_acknowledgement(&self) -> Result<(), NixlError> {
        let raw = &self.agent.raw;
        // Which incarnation says so, and up to which offer.
        let mut message = DONE.to_vec();
        let said = format!("{}/{}", self.agent.instance, self.epoch);
        message.extend_from_slice(said.as_bytes());
        let own = &self.agent.mailbox;
        let mut mine = XferDescList::new(MemType::Dram).map_err(engine("createXferDlist"))?;
        mine.add_desc(own.addr, 8, 0);
        let mut theirs = XferDescList::new(MemType::Dram).map_err(engine("createXferDlist"))?;
        theirs.add_desc(self.mailbox as usize, 8, 0);
        let mut args = nixl_sys::OptArgs::new().map_err(engine("createOptArgs"))?;
        args.set_has_notification(true)
            .map_err(engine("optArgsSetHasNotif"))?;
        args.set_notification_message(&message)
            .map_err(engine("optArgsSetNotifMsg"))?;
        let req = raw
            .create_xfer_req(XferOp::Write, &mine, &theirs, &self.name, Some(&args))
            .map_err(engine("createXferReq"))?;
        // The mailboxes are never given back: nothing for the acknowledgement to mark.
        let (own_marks, their_marks) = (Marks::default(), Marks::default());
        let ack = Transfer::post(raw, req, &own_marks, &their_marks, 8)?;
        ack.wait(DROP_WAIT)
    }
}

impl<B: Backend> Drop for Peer<'_, '_, '_, B> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl<B: Backend> fmt::Debug for Peer<'_, '_, '_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer")
            .field("name", &self.name)
            .field("epoch", &self.epoch)
            .field("regions", &self.regions.len())
            .finish()
    }
}
