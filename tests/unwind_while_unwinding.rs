//! Regression test (found in review, fixed): `Scope::exit` (the close of every `Scope::run`) assumes that dropping the outermost
//! scope resumes the kept panic, and follows it with `unreachable!`. While the thread is already
//! unwinding, `resume` drops the payload instead of resuming it — so `unreachable!` panics while
//! panicking and the process aborts. Any public `Scope::run` operation that is the outermost
//! scope and meets a backend panic during an unwind does this: a device dropped while a panic
//! unwinds (its `shutdown` polls before `Device::drop` opens its scope), or a caller's own
//! `Drop` that polls or completes a release.
//!
//! Each case runs in a child process (this binary again), since an abort cannot be caught.

use memtoken::backend::{
    Op,
    doubles::{Faulty, SimBackend, SimConfig},
};
use memtoken::{Budget, Device, make_guard};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;

const CHILD: &str = "MEMTOKEN_REVIEW_ABORT_CHILD";

fn sim() -> SimBackend {
    SimBackend::new(SimConfig {
        granularity: 4096,
        fences_complete_at_once: false,
        ..SimConfig::strict()
    })
    .unwrap()
}

/// Runs `case` in a child process; the child's exit status and output.
fn in_child(case: &str) -> (std::process::ExitStatus, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([case, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status, text)
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// A device with one release waiting for its fence (completed), whose next fence query panics,
/// dropped while the caller's own panic unwinds.
#[test]
#[cfg_attr(miri, ignore = "the body of a child run: only a child process runs it")]
fn child_device_dropped_while_unwinding() {
    if !is_child() {
        return;
    }
    let sim = sim();
    let faulty = Faulty::new(sim.clone());
    let faults = faulty.handle();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        make_guard!(guard);
        let device = Device::new(guard, faulty);
        let binding = device.bind(Budget::unlimited()).unwrap();
        drop(binding.reserve(4096).unwrap().commit().unwrap());
        drop(binding);
        sim.complete_fences();
        faults.panic_nth(Op::Fence, 1);
        let _device = device;
        panic!("the caller's own panic");
    }));
    assert!(caught.is_err());
    println!("CHILD SURVIVED");
}

/// A guard of the caller's that polls its device when dropped, dropped while unwinding.
struct PollOnDrop<'d, 'id>(&'d Device<'id, Faulty<SimBackend>>);

impl Drop for PollOnDrop<'_, '_> {
    fn drop(&mut self) {
        let _ = self.0.poll();
    }
}

#[test]
#[cfg_attr(miri, ignore = "the body of a child run: only a child process runs it")]
fn child_poll_from_a_drop_while_unwinding() {
    if !is_child() {
        return;
    }
    let sim = sim();
    let faulty = Faulty::new(sim.clone());
    let faults = faulty.handle();
    make_guard!(guard);
    let device = Device::new(guard, faulty);
    let binding = device.bind(Budget::unlimited()).unwrap();
    drop(binding.reserve(4096).unwrap().commit().unwrap());
    sim.complete_fences();
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let _guard = PollOnDrop(&device);
        faults.panic_nth(Op::Fence, 1);
        panic!("the caller's own panic");
    }));
    assert!(caught.is_err());
    println!("CHILD SURVIVED");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn a_device_dropped_while_unwinding_does_not_abort_the_process() {
    if is_child() {
        return;
    }
    let (status, text) = in_child("child_device_dropped_while_unwinding");
    assert!(
        status.success() && text.contains("CHILD SURVIVED"),
        "the child died: {status}\n{text}"
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "starts child processes (this binary run again), which Miri cannot"
)]
fn a_poll_from_a_drop_while_unwinding_does_not_abort_the_process() {
    if is_child() {
        return;
    }
    let (status, text) = in_child("child_poll_from_a_drop_while_unwinding");
    assert!(
        status.success() && text.contains("CHILD SURVIVED"),
        "the child died: {status}\n{text}"
    );
}
