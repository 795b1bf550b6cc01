//! The examples' one command-line grammar (`examples/common/cli.rs`), run on their binaries:
//! `--help` prints a usage that names the example's flags and exits 0; an unknown flag, or a
//! flag that does not apply, is named on stderr with the usage and exits 2; a failure while
//! running prints `error: …` (Display, not Debug) and exits 1.
//!
//! The examples are the ones cargo finds in `examples/` (`NAME.rs`, `NAME/main.rs`), less those
//! with `required-features` in Cargo.toml (they need a native library). Their binaries
//! are built first with `cargo build --examples` in this test's profile: a no-op after
//! `cargo test`, which builds them; after `cargo test --test examples` alone, it builds what is
//! missing or stale.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How long one run of an example may take: each run here stops at its command line.
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// The names of the `[[example]]` targets of `manifest` that have `required-features`.
fn feature_gated(manifest: &str) -> Vec<String> {
    manifest
        .split("[[example]]")
        .skip(1)
        .filter_map(|rest| {
            // The table ends where the next one starts.
            let table = rest.split("\n[").next().unwrap_or(rest);
            let field = |key: &str| {
                table
                    .lines()
                    .map(str::trim)
                    .find_map(|l| l.strip_prefix(key)?.trim_start().strip_prefix('='))
                    .map(|v| v.trim().trim_matches('"').to_string())
            };
            field("required-features")?;
            field("name")
        })
        .collect()
}

/// Each example that builds with default features: its name and its source files.
fn examples() -> &'static [(String, Vec<PathBuf>)] {
    static EXAMPLES: OnceLock<Vec<(String, Vec<PathBuf>)>> = OnceLock::new();
    EXAMPLES.get_or_init(|| {
        let manifest = std::fs::read_to_string(Path::new(ROOT).join("Cargo.toml")).unwrap();
        let gated = feature_gated(&manifest);
        assert!(
            gated.iter().any(|g| g == "nixl_cycle"),
            "Cargo.toml's feature-gated examples were not read: {gated:?}"
        );
        let mut found = Vec::new();
        for entry in std::fs::read_dir(Path::new(ROOT).join("examples")).unwrap() {
            let path = entry.unwrap().path();
            let (name, sources) = if path.extension().is_some_and(|e| e == "rs") {
                let name = path.file_stem().unwrap().to_string_lossy().into_owned();
                (name, vec![path])
            } else if path.join("main.rs").is_file() {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                let sources = std::fs::read_dir(&path)
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .filter(|p| p.extension().is_some_and(|e| e == "rs"))
                    .collect();
                (name, sources)
            } else {
                continue; // shared code (common/) or data (kernels/)
            };
            if !gated.contains(&name) {
                found.push((name, sources));
            }
        }
        found.sort();
        assert!(
            found.iter().any(|(name, _)| name == "kv_cache"),
            "no examples found: {found:?}"
        );
        found
    })
}

/// The directory of the example binaries of this test's profile (`target/<profile>/examples`,
/// next to the `deps/` this test runs from), built there by `cargo build --examples`.
fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().and_then(Path::parent).unwrap();
        let profile = match profile_dir.file_name().unwrap().to_str().unwrap() {
            "debug" => "dev",
            other => other,
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let built = Command::new(&cargo)
            .current_dir(ROOT)
            .args(["build", "--examples", "--profile", profile, "--target-dir"])
            .arg(profile_dir.parent().unwrap())
            .output()
            .unwrap_or_else(|e| panic!("{cargo} did not start: {e}"));
        assert!(
            built.status.success(),
            "cargo build --examples --profile {profile}: {}\n{}",
            built.status,
            String::from_utf8_lossy(&built.stderr)
        );
        let dir = profile_dir.join("examples");
        for (name, _) in examples() {
            assert!(dir.join(name).is_file(), "no binary of {name} in {dir:?}");
        }
        dir
    })
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs example `name` with `args`, to its end (or fails the test past [`RUN_LIMIT`]).
fn run(name: &str, args: &[&str]) -> Run {
    let mut child = Command::new(binaries().join(name))
        .args(args)
        .env_remove("MEMTOKEN_PREFIX_WORKER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{name} did not start: {e}"));
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            pipe.read_to_string(&mut text).unwrap();
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > RUN_LIMIT {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("`{name} {}` still ran after {RUN_LIMIT:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Run {
        code: status.code(),
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// Whether `usage` describes `flag` on a line of its own: a line that opens with its options
/// (`--sequences N`, `-h, --help`), then two spaces or more and what they do.
fn describes(usage: &str, flag: &str) -> bool {
    usage.lines().any(|line| {
        let line = line.trim_start();
        let options = line.split("  ").next().unwrap_or_default();
        line.starts_with('-')
            && options
                .split_whitespace()
                .any(|word| word.trim_end_matches(',') == flag)
    })
}

/// The flags an example's sources match on: their string literals `"--name"`.
fn flags_in(sources: &[PathBuf]) -> Vec<String> {
    let mut flags = Vec::new();
    for source in sources {
        let text = std::fs::read_to_string(source).unwrap();
        for (at, _) in text.match_indices("\"--") {
            let rest = &text[at + 1..];
            let end = rest[2..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .map_or(rest.len(), |i| i + 2);
            if end > 2 && rest[end..].starts_with('"') && !flags.iter().any(|f| f == &rest[..end]) {
                flags.push(rest[..end].to_string());
            }
        }
    }
    flags
}

#[test]
fn every_example_prints_its_usage_describing_its_flags_on_help_and_exits_0() {
    for (name, sources) in examples() {
        let flags = flags_in(sources);
        for help in ["--help", "-h"] {
            let out = run(name, &[help]);
            assert_eq!(out.code, Some(0), "`{name} {help}`: {}", out.stderr);
            assert!(
                out.stdout.starts_with(&format!("usage: {name}")),
                "`{name} {help}` printed no usage on stdout:\n{}",
                out.stdout
            );
            for flag in flags.iter().map(String::as_str).chain(["--help", "-h"]) {
                assert!(
                    describes(&out.stdout, flag),
                    "`{name} {help}`: the usage does not describe {flag}:\n{}",
                    out.stdout
                );
            }
        }
    }
}

#[test]
fn every_example_refuses_an_unknown_flag_by_name_with_exit_code_2() {
    for (name, _) in examples() {
        let out = run(name, &["--no-such-flag"]);
        assert_eq!(out.code, Some(2), "`{name} --no-such-flag`: {}", out.stderr);
        assert!(
            out.stderr.contains("--no-such-flag") && out.stderr.contains(&format!("usage: {name}")),
            "`{name} --no-such-flag`: stderr names neither the flag nor the usage:\n{}",
            out.stderr
        );
        assert!(
            out.stdout.is_empty(),
            "`{name} --no-such-flag` ran:\n{}",
            out.stdout
        );
    }
}

#[test]
fn kv_cache_refuses_tail_without_elastic_with_exit_code_2() {
    let out = run("kv_cache", &["--tail"]);
    assert_eq!(out.code, Some(2), "`kv_cache --tail`: {}", out.stderr);
    assert!(
        out.stderr.contains("--tail") && out.stderr.contains("--elastic"),
        "`kv_cache --tail`: {}",
        out.stderr
    );
    assert!(
        out.stdout.is_empty(),
        "`kv_cache --tail` ran:\n{}",
        out.stdout
    );
}

#[test]
fn a_flags_bad_value_is_named_with_the_flag_and_exit_code_2() {
    let out = run("kv_cache", &["--sequences", "abc"]);
    assert_eq!(
        out.code,
        Some(2),
        "`kv_cache --sequences abc`: {}",
        out.stderr
    );
    assert!(
        out.stderr.contains("--sequences") && out.stderr.contains("abc"),
        "`kv_cache --sequences abc`: {}",
        out.stderr
    );
}

#[test]
fn a_failure_while_running_prints_its_display_and_exits_1() {
    // Zero elements: the reservation of `x` (zero bytes) is refused.
    let out = run("kernel_executor", &["--n", "0"]);
    assert_eq!(out.code, Some(1), "`kernel_executor --n 0`: {}", out.stderr);
    assert!(
        out.stderr.starts_with("error: ") && !out.stderr.contains("\nError: "),
        "`kernel_executor --n 0` printed no `error: ` line (or a Debug one):\n{}",
        out.stderr
    );
}

/// The line of `kv_cache`'s output that counts the blocks taken and given back.
fn blocks_summary(out: &Run) -> &str {
    out.stdout
        .lines()
        .find(|l| l.contains("blocks taken and"))
        .unwrap_or_else(|| panic!("no summary line:\n{}", out.stdout))
}

/// The whole numbers in `text`, in order.
fn numbers(text: &str) -> Vec<u64> {
    text.split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect()
}

/// `kv_cache --model`: the KV cache of a real model's per-layer size on the CUDA driver model
/// takes blocks, gives every one back, and ends with the ledger at zero (a short run).
#[test]
fn kv_cache_on_the_driver_model_takes_blocks_and_ends_at_zero() {
    let out = run("kv_cache", &["--model", "--sequences", "6"]);
    assert_eq!(out.code, Some(0), "`kv_cache --model`: {}", out.stderr);
    let summary = blocks_summary(&out);
    let counts = numbers(summary);
    // "{steps} steps: {taken} blocks taken and {given} given back, ..."
    assert!(counts[1] > 0, "{summary}");
    assert_eq!(counts[1], counts[2], "every block given back: {summary}");
    assert!(
        out.stdout.contains("ledger at the end: zero"),
        "{}",
        out.stdout
    );
}

/// `kv_footprint`: a limit on the prefix cache keeps fewer groups mapped than no limit, and every
/// row is printed.
#[test]
fn kv_footprint_maps_fewer_groups_under_a_limit() {
    let out = run("kv_footprint", &["150"]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let peak = |limit: &str| -> usize {
        let row = out
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {limit} |")))
            .unwrap_or_else(|| panic!("no row for {limit}:\n{}", out.stdout));
        let cell = row.split('|').nth(2).unwrap().trim();
        cell.split(' ').next().unwrap().parse().unwrap()
    };
    let (none, limited) = (peak("none"), peak("512 blocks"));
    assert!(
        limited < none,
        "peak groups: {limited} under a limit, {none} without"
    );
}

/// `kv_cache --model-no-vmm --prefix`: on a device without virtual memory management the
/// prompt cannot be shared by mapping (the refusal is printed, by cause), so each sequence gets
/// its own copy of it; every byte is still checked and the ledger ends at zero.
#[test]
fn kv_cache_with_a_prompt_on_a_device_without_vmm_copies_it_per_sequence() {
    let out = run(
        "kv_cache",
        &["--model-no-vmm", "--prefix", "--sequences", "6"],
    );
    assert_eq!(
        out.code,
        Some(0),
        "`kv_cache --model-no-vmm --prefix`: {}",
        out.stderr
    );
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("prefix sharing: refused") && l.contains("share a prefix")),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("6 sequences, each with its own copy of"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("6 sequences in ") && out.stdout.contains("every byte checked"),
        "the sequences did not all run: {}",
        out.stdout
    );
    assert!(out.stdout.contains("ledger ends at zero"), "{}", out.stdout);
}

/// `kv_cache --prefix`: a system prompt shared by mapping into every sequence, their tokens in
/// KV blocks — every block taken is given back, each sequence copies the prompt's last granule
/// on write, and the ledger ends at zero (a short run).
#[test]
fn kv_cache_with_a_shared_prompt_gives_every_block_back_and_ends_at_zero() {
    let out = run("kv_cache", &["--prefix", "--sequences", "6"]);
    assert_eq!(out.code, Some(0), "`kv_cache --prefix`: {}", out.stderr);
    let summary = blocks_summary(&out);
    // "{n} sequences in {steps} steps ({time}): {taken} KV blocks taken and {given} given
    // back, {cow} prompt granules copied on write, ..."
    let counts = numbers(summary.split_once("): ").map_or("", |(_, counts)| counts));
    let [taken, given, cow, ..] = counts[..] else {
        panic!("no counts in: {summary}")
    };
    assert!(taken > 0, "{summary}");
    assert_eq!(taken, given, "every block given back: {summary}");
    assert_eq!(cow, 6, "one copy on write per sequence: {summary}");
    assert!(out.stdout.contains("ledger ends at zero"), "{}", out.stdout);
}
