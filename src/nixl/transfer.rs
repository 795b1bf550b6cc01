//! [`Transfer`]: a WRITE or READ in flight, and what waits for it.

use super::{DROP_WAIT, Marks, NixlError, Transfer, engine};
use nixl_sys::XferStatus;
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl<'t> Transfer<'t> {
    /// Posts `req`, counted in flight on `local` and `remote` from before the post until a
    /// poll sees it complete.
    ///
    /// # Errors
    ///
    /// NIXL's error; what the request may have started counts as unfinished (poisoned).
    pub(super) fn post(
        raw: &'t nixl_sys::Agent,
        req: nixl_sys::XferRequest,
        local: &'t Marks,
        remote: &'t Marks,
        bytes: usize,
    ) -> Result<Self, NixlError> {
        local.in_flight.fetch_add(1, Ordering::AcqRel);
        remote.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut transfer = Self {
            raw,
            req: Some(req),
            local,
            remote,
            bytes,
            done: false,
            failed: false,
            counted: true,
        };
        match raw.post_xfer_req(transfer.req.as_ref().expect("just made"), None) {
            Ok(true) => Ok(transfer),
            Ok(false) => {
                transfer.complete();
                Ok(transfer)
            }
            Err(e) => {
                // Whether the engine started part of it is not said: unfinished, and the
                // request is leaked rather than released under it.
                transfer.give_up(true);
                Err(engine("postXferReq")(e))
            }
        }
    }

    /// Seen complete: no longer in flight.
    pub(super) fn complete(&mut self) {
        self.done = true;
        if std::mem::take(&mut self.counted) {
            self.local.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.remote.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Transfer<'_> {
    /// The bytes it moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether it is done, asking NIXL once.
    ///
    /// # Errors
    ///
    /// NIXL's error: the transfer failed, and its local registration is poisoned.
    pub fn poll(&mut self) -> Result<bool, NixlError> {
        if self.done {
            return if self.failed {
                Err(NixlError::Failed)
            } else {
                Ok(true)
            };
        }
        let req = self.req.as_ref().expect("held until done");
        match self.raw.get_xfer_status(req) {
            Ok(XferStatus::Success) => {
                self.complete();
                Ok(true)
            }
            Ok(XferStatus::InProgress) => Ok(false),
            Err(e) => {
                self.give_up(false);
                Err(engine("getXferStatus")(e))
            }
        }
    }

    /// Waits until it is done, for at most `limit`; hands the borrows back.
    ///
    /// # Errors
    ///
    /// NIXL's error, or [`NixlError::TimedOut`]: the local registration is poisoned.
    pub fn wait(mut self, limit: Duration) -> Result<(), NixlError> {
        if !self.finish_within(limit)? {
            self.give_up(true);
            return Err(NixlError::TimedOut(limit));
        }
        Ok(())
    }

    /// Polls until done or `limit` has passed: whether done. Each poll drives the engine's
    /// progress, so polls come back to back for the first 100 µs (a transfer of a few pages is
    /// done by then; the clock is read once every 64 polls), then the thread yields between
    /// polls up to a millisecond, then sleeps between them (200 µs at most).
    pub(super) fn finish_within(&mut self, limit: Duration) -> Result<bool, NixlError> {
        let start = Instant::now();
        let mut polls = 0u32;
        let mut waited = Duration::ZERO;
        while !self.poll()? {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) || waited >= Duration::from_micros(100) {
                waited = start.elapsed();
                if waited >= limit {
                    return Ok(false);
                }
            }
            if waited < Duration::from_micros(100) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200).min(limit - waited));
            }
        }
        Ok(true)
    }

    /// Poisons the local memory's marks and the remote agent's (it stays counted in flight); a
    /// request still in progress is leaked, never released under the engine.
    pub(super) fn give_up(&mut self, in_progress: bool) {
        self.local.poisoned.store(true, Ordering::Release);
        self.remote.poisoned.store(true, Ordering::Release);
        self.done = true;
        self.failed = true;
        if in_progress {
            std::mem::forget(self.req.take());
        }
    }

    /// Waits, as a drop does, for at most [`DROP_WAIT`].
    pub(super) fn wait_in_drop(&mut self) -> Result<(), NixlError> {
        if !self.finish_within(DROP_WAIT)? {
            self.give_up(true);
            return Err(NixlError::TimedOut(DROP_WAIT));
        }
        Ok(())
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.wait_in_drop();
        }
    }
}

impl fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("bytes", &self.bytes)
            .field("done", &self.done)
            .finish()
    }
}
