//! Money moves in one place: no module outside the ledger (`src/ledger.rs`) and the
//! device (`src/device/`) charges or refunds a ledger axis or a budget itself. Policies
//! (sharing, regions, sleep, pools, import) and the token core call the device's steps
//! (`src/device/steps.rs`), which move the money with the backend call.
//!
//! The compiler enforces it too (the charge and refund methods, and the device's shared
//! totals, are visible only inside the device's module); this test lists the call sites by
//! name, so that a widened visibility cannot bring a hand-placed move back unnoticed. The
//! device's custody steps that take an amount or a residual from the token core (a release, a
//! drop, quarantined remains) are allowed where [`STEPS`] says, and nowhere else. The other
//! steps (`discard`, `Build::budget`, `give_back`, the teardown of a record) move money with
//! the memory they are handed, by the device's rules; the scan does not judge what they are
//! handed.

use std::fs;
use std::path::{Path, PathBuf};

/// The ledger's, the device's and the binding's charge and refund API, as called: a call site
/// is a `.` before the name and a `(` after it (an axis named in a policy counts as well).
const MONEY: &[&str] = &[
    ".charge(",
    ".refund(",
    ".uncharge(",
    ".charge_budget(",
    ".charge_owned(",
    ".charge_owned_or_trim(",
    ".try_charge(",
    ".charge_up_to(",
    ".cache_taken(",
    ".cache_admit(",
    ".shared()",
    "Axis::",
];

/// Custody steps of the device that move money with what they are given, each allowed only at
/// the call sites counted here (file, call, how many, why).
const STEPS: &[(&str, &str, usize, &str)] = &[
    (
        "src/allocation.rs",
        ".retire(",
        1,
        "a token's release: what its state says it no longer owns leaves the budget",
    ),
    (
        "src/allocation.rs",
        ".hand_over(",
        1,
        "a token's drop: its residual and its charge go to the device's custody",
    ),
    (
        "src/sharing/mod.rs",
        "Quarantined::new(",
        2,
        "the remains of a half-made prefix or copy-on-write become a quarantined token",
    ),
];

/// Where money may move: the ledger and the device (`src/ledger.rs`, `src/device/`).
fn allowed(path: &Path) -> bool {
    let parts: Vec<_> = path.components().map(|c| c.as_os_str()).collect();
    path.ends_with("src/ledger.rs") || parts.windows(2).any(|w| w[0] == "src" && w[1] == "device")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `file:line: text` of every money call site in `files` that is not allowed, and of every
/// custody step past the count [`STEPS`] allows in its file.
fn call_sites(files: &[PathBuf]) -> Vec<String> {
    let mut sites = Vec::new();
    for path in files.iter().filter(|p| !allowed(p)) {
        let text = fs::read_to_string(path).expect("a source file");
        let mut steps = vec![0; STEPS.len()];
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let site = || format!("{}:{}: {}", path.display(), i + 1, line.trim());
            if MONEY.iter().any(|m| code.contains(m)) {
                sites.push(site());
            }
            for (k, &(file, call, allowed, _)) in STEPS.iter().enumerate() {
                if code.contains(call) {
                    steps[k] += 1;
                    if !path.ends_with(file) || steps[k] > allowed {
                        sites.push(site());
                    }
                }
            }
        }
    }
    sites
}

#[test]
#[cfg_attr(
    miri,
    ignore = "reads and scans the source text, no memory of memtoken's: nothing for Miri to check, and slow under it"
)]
fn no_module_outside_the_ledger_and_the_device_moves_money() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let outside = files.iter().filter(|p| !allowed(p)).count();
    assert!(
        outside >= 10,
        "the scan reads the policy modules ({outside} files outside the ledger and the device)"
    );
    // Each allowed custody step is still made where the list says, as often: the list is not
    // stale.
    for &(file, call, allowed, why) in STEPS {
        let text = fs::read_to_string(src.parent().unwrap().join(file)).expect(file);
        let made = text
            .lines()
            .filter(|l| l.split("//").next().unwrap_or("").contains(call))
            .count();
        assert_eq!(made, allowed, "{file}: {call} ({why})");
    }
    let sites = call_sites(&files);
    assert!(
        sites.is_empty(),
        "money moved outside the ledger and the device ({} call sites):\n{}",
        sites.len(),
        sites.join("\n")
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "reads and scans the source text, no memory of memtoken's: nothing for Miri to check, and slow under it"
)]
fn the_scan_finds_a_hand_placed_move() {
    let dir = std::env::temp_dir().join(format!("memtoken-money-{}", std::process::id()));
    fs::create_dir_all(dir.join("src").join("device")).unwrap();
    let policy = dir.join("policy.rs");
    fs::write(
        &policy,
        "fn f() {\n    device.charge(Axis::Mapped, n); // hand-placed\n    // binding.refund(n) in a comment\n}\n",
    )
    .unwrap();
    let inside = dir.join("src").join("device").join("steps.rs");
    // A folder named `device` elsewhere is no exemption.
    fs::create_dir_all(dir.join("device")).unwrap();
    let elsewhere = dir.join("device").join("policy.rs");
    fs::write(&elsewhere, "fn h() { binding.uncharge(n); }\n").unwrap();
    fs::write(&inside, "fn g() { self.refund(n); }\n").unwrap();
    // A custody step where it is allowed, once too often, and in another file.
    fs::create_dir_all(dir.join("src")).unwrap();
    let core = dir.join("src").join("allocation.rs");
    fs::write(&core, "a.retire(c, &h);\nb.retire(c, &h);\n").unwrap();
    let other = dir.join("src").join("sleep.rs");
    fs::write(&other, "binding.retire(len, &Held::va());\n").unwrap();
    let files = [
        policy.clone(),
        inside,
        elsewhere.clone(),
        core.clone(),
        other.clone(),
    ];
    let sites = call_sites(&files);
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        sites,
        [
            format!(
                "{}:2: device.charge(Axis::Mapped, n); // hand-placed",
                policy.display()
            ),
            format!(
                "{}:1: fn h() {{ binding.uncharge(n); }}",
                elsewhere.display()
            ),
            format!("{}:2: b.retire(c, &h);", core.display()),
            format!("{}:1: binding.retire(len, &Held::va());", other.display()),
        ]
    );
}
