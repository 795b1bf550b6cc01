//! The driver model's checks of the rules a call must keep (misuse panics): VMM calls on a
//! device that has it, on VMM memory, and access descriptors (peers asked first, none lost
//! across a remap).

use super::state::ModelState;
use super::{DriverModel, misuse};
use crate::backend::Addr;
#[cfg(doc)]
use crate::backend::cuda::driver::Driver;
use crate::backend::cuda::driver::DriverCall;

/// The checks of `cuMemSetAccess` (see [`Driver::mem_set_access`]).
impl DriverModel {
    /// One descriptor per device (fact 18): none, a device twice or an unknown device is
    /// misuse.
    /// Fact 14: a VMM call on a device without attribute 102 is misuse — the backend must ask
    /// it first and refuse the device.
    pub(super) fn check_vmm(&self, call: DriverCall) {
        if !self.config.vmm {
            misuse(
                call,
                "a VMM call on a device without virtual memory management (attribute 102 is 0)",
            );
        }
    }

    /// Fact 59: a VMM call on `cuMemAlloc` memory is misuse.
    pub(super) fn check_not_plain(s: &ModelState, call: DriverCall, addr: Addr, len: usize) {
        if s.overlaps_plain(addr, len.max(1)) {
            misuse(call, "a VMM call on memory cuMemAlloc made");
        }
    }

    pub(super) fn check_descriptors(&self, call: DriverCall, access: &[(i32, bool)]) {
        if access.is_empty() {
            misuse(call, "no access descriptor");
        }
        for (i, &(device, _)) in access.iter().enumerate() {
            self.check_device(call, device);
            if access[..i].iter().any(|&(d, _)| d == device) {
                misuse(
                    call,
                    format_args!("device {device} is named twice in one descriptor list"),
                );
            }
        }
    }

    /// Whether access for a peer is refused (fact 32: `cuDeviceCanAccessPeer(device, owner)`
    /// said 0). Misuse: access for a device other than the memory's owner that was never asked
    /// about, or a new mapping's first access that leaves out a device given access in its
    /// reservation before (see [`DriverModel`]).
    pub(super) fn peer_refused(
        s: &ModelState,
        call: DriverCall,
        access: &[(i32, bool)],
        mappings: &[(Addr, usize, u64)],
    ) -> bool {
        let named = |device: i32| access.iter().any(|&(d, _)| d == device);
        let mut refused = false;
        for &(start, _, allocation) in mappings {
            let owner = s.owners[&allocation];
            for &(device, _) in access.iter().filter(|&&(d, _)| d != owner) {
                match s.peers_asked.get(&(device, owner)) {
                    None => misuse(
                        call,
                        format_args!(
                            "access for device {device} to memory on device {owner} without \
                             asking cuDeviceCanAccessPeer({device}, {owner}) first"
                        ),
                    ),
                    Some(false) => refused = true,
                    Some(true) => {}
                }
            }
            if s.grants.contains_key(&start) {
                continue; // not a new mapping: devices not named keep what they have
            }
            let reservation = s.reservation_of(start);
            let had = s.granted_in.get(&reservation);
            if let Some(lost) = had.and_then(|had| had.iter().find(|&&d| !named(d))) {
                misuse(
                    call,
                    format_args!(
                        "the new mapping at {start:#x} is given access without device {lost}, \
                         which had access in its reservation at {reservation:#x}: a peer lost \
                         access across a remap (openxla/xla#40852)"
                    ),
                );
            }
        }
        refused
    }
}
