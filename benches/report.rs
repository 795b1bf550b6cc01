//! Runs the hot-path benches (`benches/hot_paths.rs`), counts the instructions of four cycles
//! with `valgrind --tool=callgrind`, and prints every ratio `memtoken / reference` as one
//! markdown table (lower is better; 1.0: the same cost as the hand-written reference). It draws
//! every row of that table into an SVG picture, in three titled groups: instructions per cycle,
//! time per cycle, and time at scale (N blocks held against 1 Ki held).
//!
//! ```text
//! cargo run --release --bin bench_report            # full run (a few minutes)
//! cargo run --release --bin bench_report -- --quick # shorter measurements
//! cargo run --release --bin bench_report -- --save  # also writes docs/benchmarks.svg and
//!                                                       # the table into README.md
//! ```
//!
//! - **Where it writes.** The picture goes to `target/bench_report/report.svg` (the path is
//!   printed): a run leaves the source tree as it found it. Only `--save` writes into the tree:
//!   the picture to `docs/benchmarks.svg`, and the table of the same run into `README.md`, in
//!   place of whatever stands between the lines `<!-- bench_report:begin -->` and
//!   `<!-- bench_report:end -->` — so the README's picture and table always come from one run.
//!   Without those markers `--save` says so in one line and exits 1 before measuring anything,
//!   leaving `README.md` untouched.
//! - **What is judged.** Instruction counts are exact on any machine, however loaded: an
//!   instruction ratio over its bound makes the exit status 1, with one line saying which ratio,
//!   its value and its bound. Timings are reported, not judged: on a noisy machine a time ratio
//!   swings by ±20 % between runs, so one over its bound is marked "over (timing, not judged)"
//!   in the table and never changes the exit status.
//! - **Without valgrind** it says in one line that the instruction counts were not measured,
//!   and judges nothing (exit 0, if nothing else failed).
//! - **Otherwise exit 1**, with one line saying why: the benches failed, the counted examples
//!   did not build, callgrind gave no count, or a file could not be written. Exit 2: a bad
//!   argument (with the usage).
//!
//! The instruction counts are those of `examples/granule_cycle.rs`, `block_cycle.rs`, `region_cycle.rs` and `kv_prefix_cycle.rs` (the functions `cycles_*`
//! only), each the difference between runs of N and 2N cycles, so that what runs once cancels
//! out.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, SystemTime};

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde::de::DeserializeOwned;

const USAGE: &str =
    "usage: cargo run --release --bin bench_report [-- [--quick] [--save] [--profiles]]
  --quick     shorter measurements (1 s warm-up, 2 s per bench)
  --save      also write docs/benchmarks.svg and this run's table into README.md (between
              <!-- bench_report:begin --> and <!-- bench_report:end -->), and the profile
              table into docs/benchmarks.md (between <!-- bench_report:profiles:begin --> and
              <!-- bench_report:profiles:end -->)
  --profiles  only the profile table: the block and granule cycles' instructions built with
              memtoken's profile, with 16 codegen units, and with 16 units and fat LTO
  -h, --help  this text";

const BEGIN: &str = "<!-- bench_report:begin -->";
const END: &str = "<!-- bench_report:end -->";

/// What a row measures, and the group of the picture it is drawn in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Group {
    /// Instructions per cycle (callgrind): judged.
    Instructions,
    /// Time per cycle, memtoken against a reference: reported.
    Time,
    /// Time of one block taken and given back with many blocks held against 1 Ki held: reported.
    Scale,
}

impl Group {
    const ALL: [Group; 3] = [Group::Instructions, Group::Time, Group::Scale];

    fn title(self) -> &'static str {
        match self {
            Group::Instructions => {
                "Instructions per cycle (callgrind), memtoken / by hand: judged (over its bound: exit 1)"
            }
            Group::Time => "Time per cycle, memtoken / reference: reported, not judged",
            Group::Scale => {
                "Time of a block taken and given back, N blocks held / 1 Ki held: reported, not judged"
            }
        }
    }

    fn measured_by(self) -> &'static str {
        match self {
            Group::Instructions => "instructions",
            Group::Time | Group::Scale => "time",
        }
    }
}

/// A timed ratio: the mean time of bench `bench` over that of bench `reference`.
struct Timed {
    group: Group,
    label: &'static str,
    bench: &'static str,
    reference: &'static str,
    bound: Option<f64>,
}

/// The timed ratios. Every one is memtoken's cost over a reference's, lower is better; the
/// bounds are the targets a quiet machine meets, reported but not judged.
const TIMED: &[Timed] = &[
    Timed {
        group: Group::Time,
        label: "block cycle / by hand",
        bench: "block_cycle/memtoken",
        reference: "block_cycle/raw",
        bound: Some(1.02),
    },
    Timed {
        group: Group::Time,
        label: "block cycle / slab",
        bench: "block_cycle/memtoken",
        reference: "block_cycle/slab",
        bound: None,
    },
    Timed {
        group: Group::Time,
        label: "block cycle / malloc",
        bench: "block_cycle/memtoken",
        reference: "block_cycle/malloc",
        bound: None,
    },
    Timed {
        group: Group::Time,
        label: "granule cycle / by hand",
        bench: "granule_cycle/memtoken",
        reference: "granule_cycle/raw",
        bound: Some(1.05),
    },
    Timed {
        group: Group::Time,
        label: "region cycle / by hand",
        bench: "region_cycle/memtoken",
        reference: "region_cycle/raw",
        bound: Some(1.05),
    },
    Timed {
        group: Group::Time,
        label: "region cycle in its tail / by hand",
        bench: "region_cycle/tail",
        reference: "region_cycle/raw",
        bound: None,
    },
    Timed {
        group: Group::Time,
        label: "sleep/wake 64 MiB / by hand",
        bench: "sleep_wake/memtoken",
        reference: "sleep_wake/raw",
        bound: Some(1.05),
    },
    Timed {
        group: Group::Time,
        label: "GPU block cycle / by hand",
        bench: "gpu/block_cycle/memtoken",
        reference: "gpu/block_cycle/raw",
        bound: Some(1.02),
    },
    Timed {
        group: Group::Time,
        label: "GPU granule cycle / by hand",
        bench: "gpu/granule_cycle/memtoken",
        reference: "gpu/granule_cycle/raw",
        bound: Some(1.05),
    },
    Timed {
        group: Group::Scale,
        label: "64 Ki blocks held / 1 Ki held",
        bench: "block_scale/memtoken/65536",
        reference: "block_scale/memtoken/1024",
        bound: Some(1.2),
    },
    Timed {
        group: Group::Scale,
        label: "1 Mi blocks held / 1 Ki held",
        bench: "block_scale/memtoken/1048576",
        reference: "block_scale/memtoken/1024",
        bound: Some(1.2),
    },
];

/// A counted ratio: the instructions per cycle of `examples/{example}.rs` run as `memtoken`
/// over those of the same example run as `reference`, over `cycles` (and twice as many). A
/// mode of several words is passed as several arguments, the count last.
struct Counted {
    label: &'static str,
    example: &'static str,
    memtoken: &'static str,
    reference: &'static str,
    cycles: u64,
    bound: Option<f64>,
}

/// The counted ratios. These are judged: an instruction count does not depend on the
/// machine's load.
const COUNTED: &[Counted] = &[
    // 4,750 against 4,490 (1.058). Parity (≤ 1.00) was aimed at and not reached. The
    // hand-written cycle's own code is some 60 instructions beside the backend's calls; memtoken adds about 300 — the money (the budget's and the
    // device's charges and their refunds) and the teardown of the residual — which is what it is
    // for. 1.06 holds that and fails on anything more.
    Counted {
        label: "granule cycle / by hand",
        example: "granule_cycle",
        memtoken: "memtoken",
        reference: "raw",
        cycles: 2_000,
        bound: Some(1.06),
    },
    // 38,014 against 38,066 (0.999).
    Counted {
        label: "region cycle / by hand",
        example: "region_cycle",
        memtoken: "memtoken",
        reference: "raw",
        cycles: 1_000,
        bound: Some(1.00),
    },
    // 907 against 963 (0.942): the KV cache's 16 blocks pushed into a table and one clear,
    // against the hand-written block cache committed before it (examples/common/raw_blocks.rs).
    Counted {
        label: "block cycle / by hand",
        example: "block_cycle",
        memtoken: "cache",
        reference: "raw",
        cycles: 20_000,
        bound: Some(1.00),
    },
    // 1,464 against 1,574 (0.930): 16 prefix-cache hits into a table and its clear, keys that
    // are keyed hashes, against vLLM's block pool algorithm written by hand
    // (examples/common/raw_prefix.rs). The same at 16 Ki blocks (scripts/kv-scale).
    Counted {
        label: "16 prefix hits / vLLM's algorithm by hand",
        example: "kv_prefix_cycle",
        memtoken: "cache hit16 16384",
        reference: "raw hit16 16384",
        cycles: 20_000,
        bound: Some(1.10),
    },
    // 4,773 against 4,453 (1.072): 16 fresh blocks entered under new keys (each evicting an
    // idle cached block) and the clear.
    Counted {
        label: "16 keys entered / vLLM's algorithm by hand",
        example: "kv_prefix_cycle",
        memtoken: "cache enter16 16384",
        reference: "raw enter16 16384",
        cycles: 20_000,
        bound: Some(1.10),
    },
    // 159 against 38,066 (0.004): within its mapped tail a region makes no backend call.
    Counted {
        label: "region cycle in its tail / by hand",
        example: "region_cycle",
        memtoken: "tail",
        reference: "raw",
        cycles: 1_000,
        bound: None,
    },
];

/// A release profile a user's program may build memtoken with: the hot paths are counted under
/// each (every memtoken function inlines into its caller, so the caller's profile decides the
/// code), in a target directory of its own.
struct Profile {
    label: &'static str,
    /// Cargo's `CARGO_PROFILE_RELEASE_*` settings over this repository's `[profile.release]`.
    env: &'static [(&'static str, &'static str)],
    /// The target directory's name under `target/` (`None`: the usual one).
    dir: Option<&'static str>,
}

/// memtoken's own profile, cargo's default unit split, and that split with fat LTO.
const PROFILES: &[Profile] = &[
    Profile {
        label: "memtoken's: `codegen-units = 1`",
        env: &[],
        dir: None,
    },
    Profile {
        label: "cargo's default: 16 codegen units",
        env: &[("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")],
        dir: Some("profile-cgu16"),
    },
    Profile {
        label: "16 codegen units, `lto = \"fat\"`",
        env: &[
            ("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16"),
            ("CARGO_PROFILE_RELEASE_LTO", "fat"),
        ],
        dir: Some("profile-cgu16-fat-lto"),
    },
];

/// The rows of [`COUNTED`] counted under every profile of [`PROFILES`].
const BY_PROFILE: &[&str] = &["granule cycle / by hand", "block cycle / by hand"];

const PROFILES_BEGIN: &str = "<!-- bench_report:profiles:begin -->";
const PROFILES_END: &str = "<!-- bench_report:profiles:end -->";

/// The counted rows of [`BY_PROFILE`] under each profile, as a markdown table.
fn count_by_profile() -> Result<String, String> {
    let mut out = String::from(
        "| cycle | profile | memtoken | by hand | ratio |\n| --- | --- | ---: | ---: | ---: |\n",
    );
    let counted: Vec<&Counted> = COUNTED
        .iter()
        .filter(|c| BY_PROFILE.contains(&c.label))
        .collect();
    let mut lines = vec![String::new(); counted.len() * PROFILES.len()];
    for (p, profile) in PROFILES.iter().enumerate() {
        let target = profile
            .dir
            .map_or_else(target_dir, |d| target_dir().join(d));
        eprintln!("building the counted examples with {} ...", profile.label);
        let mut build = cargo();
        build.args(["build", "--release", "--example", "granule_cycle"]);
        build.args(["--example", "block_cycle"]);
        build
            .env("CARGO_TARGET_DIR", &target)
            .envs(profile.env.iter().copied());
        let built = build
            .status()
            .map_err(|e| format!("cargo did not start: {e}"))?;
        if !built.success() {
            return Err(format!(
                "the counted examples did not build with {} (cargo build: {built})",
                profile.label
            ));
        }
        for (i, c) in counted.iter().enumerate() {
            eprintln!("counting instructions: {} {} ...", c.example, profile.label);
            let memtoken = callgrind_in(&target, c.example, c.memtoken, c.cycles)?;
            let reference = callgrind_in(&target, c.example, c.reference, c.cycles)?;
            let cycle = c.label.trim_end_matches(" / by hand");
            lines[i * PROFILES.len() + p] = format!(
                "| {cycle} | {} | {} | {} | {} |\n",
                profile.label,
                instructions(memtoken),
                instructions(reference),
                ratio(memtoken / reference)
            );
        }
    }
    out.extend(lines);
    Ok(out)
}

/// One row of the table and of the picture.
struct Row {
    group: Group,
    label: &'static str,
    /// memtoken's cost: nanoseconds, or instructions per cycle.
    memtoken: f64,
    /// The reference's cost, in the same unit.
    reference: f64,
    bound: Option<f64>,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.memtoken / self.reference
    }

    fn over(&self) -> bool {
        self.bound.is_some_and(|b| self.ratio() > b)
    }

    /// The verdict as the table says it.
    fn verdict(&self) -> &'static str {
        match (self.bound, self.over(), self.group) {
            (None, _, _) => "",
            (Some(_), false, _) => "ok",
            (Some(_), true, Group::Instructions) => "**over**",
            (Some(_), true, _) => "over (timing, not judged)",
        }
    }

    fn cost(&self, value: f64) -> String {
        match self.group {
            Group::Instructions => instructions(value),
            Group::Time | Group::Scale => time(value),
        }
    }
}

/// A ratio as the table and the picture show it: three decimals, or two significant digits
/// below 0.01 (the tail's time, 0.0002, is not 0.000).
fn ratio(r: f64) -> String {
    if r >= 0.01 || r == 0.0 || !r.is_finite() {
        format!("{r:.3}")
    } else {
        let decimals = 1 - r.log10().floor() as i32;
        format!("{r:.*}", decimals.max(3) as usize)
    }
}

/// Nanoseconds as the table shows them.
fn time(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.2} ns")
    }
}

/// Instructions per cycle as the table shows them: one decimal below 1,000, else whole and
/// grouped by thousands.
fn instructions(n: f64) -> String {
    if n < 1000.0 {
        return format!("{n:.1}");
    }
    let digits = format!("{n:.0}");
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What the counting found.
enum Counts {
    Measured(Vec<Row>),
    /// Valgrind is not installed: nothing is judged.
    NoValgrind,
}

/// The repository's root: where the library's `Cargo.toml`, `README.md` and `docs/` are (this
/// program's package is the `benches/` member below it), whatever the working directory.
fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

fn cargo() -> Command {
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo.current_dir(root());
    cargo
}

/// The part of criterion's `new/benchmark.json` read here.
#[derive(Deserialize)]
struct Benchmark {
    full_id: String,
}

/// The part of criterion's `new/estimates.json` read here.
#[derive(Deserialize)]
struct Estimates {
    mean: Estimate,
}

#[derive(Deserialize)]
struct Estimate {
    /// Nanoseconds.
    point_estimate: f64,
}

/// The JSON file at `path`: `None` if it cannot be read; a warning too if it is not what
/// criterion writes.
fn read_json<T: DeserializeOwned>(path: &Path) -> Option<T> {
    let bytes = std::fs::read(path).ok()?;
    serde_json::from_slice(&bytes)
        .map_err(|e| eprintln!("skipping {}: {e}", path.display()))
        .ok()
}

/// Mean time in nanoseconds of every bench criterion wrote results for since `since` (this
/// run's, not an earlier run's left in `target/criterion`), by full id.
fn read_results(dir: &Path, since: SystemTime, out: &mut BTreeMap<String, f64>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            read_results(&path, since, out);
        } else if path.file_name().is_some_and(|n| n == "benchmark.json")
            && path.parent().is_some_and(|p| p.ends_with("new"))
        {
            let estimates = path.with_file_name("estimates.json");
            let fresh = std::fs::metadata(&estimates)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if !fresh {
                continue;
            }
            let Some(meta) = read_json::<Benchmark>(&path) else {
                continue;
            };
            let Some(estimates) = read_json::<Estimates>(&estimates) else {
                continue;
            };
            out.insert(meta.full_id, estimates.mean.point_estimate);
        }
    }
}

/// Instructions per cycle of `examples/{example}.rs` run as `which`, from callgrind: the
/// difference between runs of `cycles` and twice as many, so that what runs once cancels out.
fn callgrind(example: &str, which: &str, cycles: u64) -> Result<f64, String> {
    callgrind_in(&target_dir(), example, which, cycles)
}

/// [`callgrind`] of the example built in the target directory `target`.
fn callgrind_in(target: &Path, example: &str, which: &str, cycles: u64) -> Result<f64, String> {
    let count = |n: u64| -> Result<f64, String> {
        let exe = target.join("release/examples").join(example);
        let name = which.replace(' ', "-");
        let out = std::env::temp_dir().join(format!("memtoken-callgrind-{example}-{name}.out"));
        let run = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--toggle-collect={example}::cycles_*"))
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args(which.split(' '))
            .arg(n.to_string())
            .output()
            .map_err(|e| format!("valgrind did not start: {e}"))?;
        let _ = std::fs::remove_file(&out);
        let log = String::from_utf8_lossy(&run.stderr);
        let collected = log
            .lines()
            .find_map(|l| l.split("Collected :").nth(1))
            .filter(|_| run.status.success())
            .ok_or_else(|| {
                format!(
                    "callgrind gave no count for `{example} {which} {n}` ({})",
                    run.status
                )
            })?;
        collected
            .trim()
            .replace(',', "")
            .parse()
            .map_err(|e| format!("callgrind's count for `{example} {which} {n}`: {e}"))
    };
    // Each count is the median of three runs: the host backend's rule book hashes with std's
    // randomly keyed SipHash, whose collisions move a count by up to about 0.2 % between runs.
    let median = |n: u64| -> Result<f64, String> {
        let mut runs = [count(n)?, count(n)?, count(n)?];
        runs.sort_by(f64::total_cmp);
        Ok(runs[1])
    };
    Ok((median(2 * cycles)? - median(cycles)?) / cycles as f64)
}

/// The rows of [`COUNTED`], or why there are none.
fn count_instructions() -> Result<Counts, String> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        return Ok(Counts::NoValgrind);
    }
    eprintln!(
        "building the counted examples (granule_cycle, region_cycle, block_cycle, \
         kv_prefix_cycle) ..."
    );
    let built = cargo()
        .args(["build", "--release"])
        .args(["--example", "granule_cycle"])
        .args(["--example", "region_cycle", "--example", "block_cycle"])
        .args(["--example", "kv_prefix_cycle"])
        .status()
        .map_err(|e| format!("cargo did not start: {e}"))?;
    if !built.success() {
        return Err(format!(
            "the counted examples did not build (cargo build: {built})"
        ));
    }
    // A reference counted once serves every row it is the reference of.
    let mut counted: BTreeMap<(&str, &str), f64> = BTreeMap::new();
    let mut rows = Vec::new();
    for c in COUNTED {
        let mut get = |which| -> Result<f64, String> {
            let (example, cycles) = (c.example, c.cycles);
            if let Some(&n) = counted.get(&(example, which)) {
                return Ok(n);
            }
            eprintln!("counting instructions: {example} {which} ...");
            let n = callgrind(example, which, cycles)?;
            counted.insert((example, which), n);
            Ok(n)
        };
        let (memtoken, reference) = (get(c.memtoken)?, get(c.reference)?);
        rows.push(Row {
            group: Group::Instructions,
            label: c.label,
            memtoken,
            reference,
            bound: c.bound,
        });
    }
    Ok(Counts::Measured(rows))
}

/// The table of every row, in markdown.
fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| ratio (memtoken / reference) | measured | memtoken | reference | ratio | bound | |\n\
         | --- | --- | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in rows {
        let bound = r
            .bound
            .map_or_else(|| "—".to_string(), |b| format!("≤ {b:.2}"));
        out += &format!(
            "| {} | {} | {} | {} | {} | {bound} | {} |\n",
            r.label,
            r.group.measured_by(),
            r.cost(r.memtoken),
            r.cost(r.reference),
            ratio(r.ratio()),
            r.verdict()
        );
    }
    out
}

/// Width of the picture, the height of one bar's row, and the widths of the names' column
/// (left of the bars) and of the values' column (right of them), in pixels.
const WIDTH: u32 = 980;
const ROW_HEIGHT: u32 = 26;
const NAMES: u32 = 250;
const VALUES: u32 = 280;
/// A group's caption and x axis, in pixels.
const CAPTION: u32 = 34;
const AXIS: u32 = 44;
/// A note (a group not measured) and the picture's title, in pixels.
const NOTE: u32 = 30;
const TITLE: u32 = 34;
/// Font sizes as plotters takes them: its SVG backend writes `size / 1.24` pixels (12 and 14).
const FONT: f64 = 15.0;
const TITLE_FONT: f64 = 17.5;
/// Ratios (and bounds) above this do not widen a group's axis: their bars are cut at its end.
const LARGEST_SHOWN: f64 = 3.0;

fn group_height(rows: usize) -> u32 {
    CAPTION + ROW_HEIGHT * rows as u32 + AXIS
}

/// The end of a group's ratio axis: its largest ratio or bound up to [`LARGEST_SHOWN`] and a
/// little room, rounded up to a multiple of 0.5, and at least 1.5.
fn axis_end(rows: &[&Row]) -> f64 {
    let largest = rows
        .iter()
        .flat_map(|r| [Some(r.ratio()), r.bound])
        .flatten()
        .filter(|v| *v <= LARGEST_SHOWN)
        .fold(1.0, f64::max);
    ((largest * 1.04 / 0.5).ceil() * 0.5).max(1.5)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One group's ratios as horizontal bars, one row each, first row on top. The dashed line is
/// 1.0 (parity), a black tick on a bar marks its bound, a bar longer than the axis is cut at its
/// end. The values stand in a column of their own right of the bars, where no bar, line or tick
/// reaches.
fn draw_group(root: &Area, area: &Area, group: Group, rows: &[&Row]) -> Result<(), Box<dyn Error>> {
    let n = rows.len() as i32;
    let end = axis_end(rows);
    // The y axis points up and gives each row 10 units: row `i`'s centre.
    let centre = |i: usize| 10 * (n - i as i32) - 5;
    let y_ticks = (0..rows.len()).map(centre).collect();
    let row_label = |y: &i32| {
        let i = (n - (y + 5) / 10) as usize;
        rows.get(i)
            .map_or_else(String::new, |r| r.label.to_string())
    };
    let font = ("sans-serif", FONT);
    // The caption in a strip of its own, so that every group's rows are ROW_HEIGHT apart.
    let (caption, area) = area.split_vertically(CAPTION);
    caption.draw(&Text::new(
        group.title(),
        (10, CAPTION as i32 / 2 + 2),
        ("sans-serif", TITLE_FONT)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center)),
    ))?;
    let mut chart = ChartBuilder::on(&area)
        .margin_left(10)
        .margin_right(VALUES as i32)
        .x_label_area_size(AXIS)
        .y_label_area_size(NAMES)
        .build_cartesian_2d(0.0..end, (0..10 * n).with_key_points(y_ticks))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_labels((end * 2.0) as usize + 1)
        .light_line_style(TRANSPARENT)
        .label_style(font)
        .axis_desc_style(font)
        .x_label_formatter(&|x| format!("{x:.1}"))
        .y_label_formatter(&row_label)
        .x_desc("memtoken / reference (dashed: 1.0, the same cost; black tick: the row's bound)")
        .draw()?;

    let blue = RGBColor(0x3b, 0x7d, 0xd8);
    let red = RGBColor(0xd8, 0x50, 0x3b);
    let orange = RGBColor(0xe8, 0xa2, 0x3a);
    let colour = |r: &Row| match (r.over(), r.group) {
        (false, _) => blue,
        (true, Group::Instructions) => red,
        (true, _) => orange,
    };
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        // `min` takes `end` for a NaN ratio too.
        let to = r.ratio().min(end);
        Rectangle::new(
            [(0.0, centre(i) - 3), (to, centre(i) + 3)],
            colour(r).filled(),
        )
    }))?;
    chart.draw_series(std::iter::once(DashedPathElement::new(
        [(1.0, 0), (1.0, 10 * n)],
        4,
        3,
        BLACK.stroke_width(1),
    )))?;
    chart.draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
        let bound = r.bound.filter(|b| *b <= end)?;
        Some(PathElement::new(
            [(bound, centre(i) - 4), (bound, centre(i) + 4)],
            BLACK.stroke_width(2),
        ))
    }))?;

    // The values' column, in the picture's pixels.
    let column = chart.plotting_area().get_pixel_range().0.end + 14;
    for (i, r) in rows.iter().enumerate() {
        let value = r.ratio();
        let cut = value > end || value.is_nan();
        let (bar_end, y) = chart.backend_coord(&(value.min(end), centre(i)));
        let mut text = ratio(value);
        if let Some(bound) = r.bound {
            text += &format!("  ≤ {bound:.2}");
        }
        match r.verdict() {
            "" => {}
            "**over**" => text += "  over: fails the report",
            verdict => text += &format!("  {verdict}"),
        }
        if cut {
            text += &format!(", bar cut at {end:.1}");
            // Two white strokes across the bar's end: the cut.
            let half = y - chart.backend_coord(&(end, centre(i) + 3)).1;
            for dx in [-14, -9] {
                root.draw(&PathElement::new(
                    [(bar_end + dx - 3, y + half), (bar_end + dx + 3, y - half)],
                    WHITE.stroke_width(2),
                ))?;
            }
        }
        let style = font
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Left, VPos::Center));
        root.draw(&Text::new(text, (column, y), style))?;
    }
    Ok(())
}

/// The picture: every row, in its group; a line for a group not measured (`missing`).
fn svg(rows: &[Row], missing: &[String]) -> Result<String, Box<dyn Error>> {
    let groups: Vec<(Group, Vec<&Row>)> = Group::ALL
        .into_iter()
        .map(|g| (g, rows.iter().filter(|r| r.group == g).collect::<Vec<_>>()))
        .filter(|(_, rows)| !rows.is_empty())
        .collect();
    let height = TITLE
        + groups
            .iter()
            .map(|(_, rows)| group_height(rows.len()))
            .sum::<u32>()
        + NOTE * missing.len() as u32
        + 10;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let body = root.titled(
            "memtoken's hot paths against hand-written references: lower is better",
            ("sans-serif", TITLE_FONT + 2.0),
        )?;
        let mut rest = body;
        for (group, rows) in &groups {
            let (area, below) = rest.split_vertically(group_height(rows.len()));
            draw_group(&root, &area, *group, rows)?;
            rest = below;
        }
        // What was not measured, below the groups.
        for line in missing {
            let (note, below) = rest.split_vertically(NOTE);
            note.draw(&Text::new(
                line.clone(),
                (10, NOTE as i32 / 2),
                ("sans-serif", FONT)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
            rest = below;
        }
        root.present()?;
    }
    Ok(out)
}

/// `readme` with the text between the markers replaced by `block`; `None` without the markers.
fn replace_block(readme: &str, block: &str) -> Option<String> {
    replace_between(readme, BEGIN, END, block)
}

/// `text` with what stands between the lines `begin` and `end` replaced by `block`; `None` if
/// either line is missing.
fn replace_between(readme: &str, begin: &str, end: &str, block: &str) -> Option<String> {
    let start = readme.find(begin)? + begin.len();
    let end = start + readme[start..].find(end)?;
    Some(format!(
        "{}\n{}\n{}",
        &readme[..start],
        block.trim_end(),
        &readme[end..]
    ))
}

/// Writes `contents` to `path`, making its folder first.
fn write(path: &Path, contents: &str) -> Result<(), String> {
    let made = path.parent().map_or(Ok(()), std::fs::create_dir_all);
    made.and_then(|()| std::fs::write(path, contents))
        .map_err(|e| format!("{} not written: {e}", path.display()))
}

/// Counts the profile table and prints it; with `save`, writes it into `doc` between its
/// markers. Without valgrind, says so and counts nothing.
fn profile_table(save: bool, doc: &Path) -> Result<(), String> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("Profile table: not measured (valgrind is not installed).");
        return Ok(());
    }
    let table = count_by_profile()?;
    println!("\nInstructions per cycle by the caller's release profile:\n\n{table}");
    if save {
        let text = std::fs::read_to_string(doc).unwrap_or_default();
        let text = replace_between(&text, PROFILES_BEGIN, PROFILES_END, &table).ok_or_else(|| {
            format!(
                "the lines {PROFILES_BEGIN} and {PROFILES_END} left {} during the run; not touched",
                doc.display()
            )
        })?;
        write(doc, &text)?;
        println!("{}: the profile table replaced", doc.display());
    }
    Ok(())
}

/// Prints `why` as the one line that explains a non-zero exit status.
fn fail(why: &str) -> ExitCode {
    println!("bench_report: exit status 1: {why}");
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let (mut quick, mut save, mut profiles_only) = (false, false, false);
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            "--save" => save = true,
            "--profiles" => profiles_only = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("bench_report: unknown argument {other:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let benchmarks_path = root().join("docs/benchmarks.md");
    if save {
        let doc = std::fs::read_to_string(&benchmarks_path).unwrap_or_default();
        if replace_between(&doc, PROFILES_BEGIN, PROFILES_END, "").is_none() {
            return fail(&format!(
                "--save needs the lines {PROFILES_BEGIN} and {PROFILES_END} in docs/benchmarks.md; \
                 nothing touched, nothing measured"
            ));
        }
    }
    if profiles_only {
        return match profile_table(save, &benchmarks_path) {
            Ok(()) => ExitCode::SUCCESS,
            Err(why) => fail(&why),
        };
    }
    let readme_path = root().join("README.md");
    if save {
        let readme = std::fs::read_to_string(&readme_path).unwrap_or_default();
        if replace_block(&readme, "").is_none() {
            return fail(&format!(
                "--save needs the lines {BEGIN} and {END} in README.md (to put the table between \
                 them); README.md not touched, nothing measured"
            ));
        }
    }

    // Timings.
    let (warm, measure) = if quick { ("1", "2") } else { ("3", "8") };
    eprintln!("running the benches (cargo bench --bench hot_paths) ...");
    // Results written from now on are this run's (a second of slack for the file system's clock).
    let since = SystemTime::now() - Duration::from_secs(1);
    let benched = cargo()
        .args(["bench", "--bench", "hot_paths", "--", "--noplot"])
        .args(["--warm-up-time", warm, "--measurement-time", measure])
        .status();
    match benched {
        Ok(s) if s.success() => {}
        Ok(s) => {
            return fail(&format!(
                "the benches failed (cargo bench: {s}); nothing reported"
            ));
        }
        Err(e) => return fail(&format!("cargo did not start: {e}")),
    }
    let mut results = BTreeMap::new();
    read_results(&target_dir().join("criterion"), since, &mut results);
    let mut rows = Vec::new();
    let mut not_run = Vec::new();
    for t in TIMED {
        match (results.get(t.bench), results.get(t.reference)) {
            (Some(&memtoken), Some(&reference)) => rows.push(Row {
                group: t.group,
                label: t.label,
                memtoken,
                reference,
                bound: t.bound,
            }),
            _ => not_run.push(t.label),
        }
    }

    // Instruction counts.
    let counts = match count_instructions() {
        Ok(counts) => counts,
        Err(why) => return fail(&format!("instruction counts not measured: {why}")),
    };
    let mut missing = Vec::new();
    match counts {
        Counts::Measured(mut counted) => {
            counted.append(&mut rows);
            rows = counted;
        }
        Counts::NoValgrind => missing.push(
            "Instruction counts: not measured (valgrind is not installed), so nothing is judged"
                .to_string(),
        ),
    }
    if !not_run.is_empty() {
        missing.push(format!(
            "Not run here (no results from this run; the GPU rows need a CUDA device): {}",
            not_run.join(", ")
        ));
    }

    let mut table = table(&rows);
    for line in &missing {
        table += &format!("\n{line}.\n");
    }
    println!("\n{table}");

    let picture = match svg(&rows, &missing) {
        Ok(picture) => picture,
        Err(e) => return fail(&format!("the picture could not be drawn: {e}")),
    };
    let plot = if save {
        root().join("docs/benchmarks.svg")
    } else {
        target_dir().join("bench_report/report.svg")
    };
    if let Err(why) = write(&plot, &picture) {
        return fail(&why);
    }
    println!("picture: {}", plot.display());
    if save {
        let readme = std::fs::read_to_string(&readme_path).unwrap_or_default();
        let Some(readme) = replace_block(&readme, &table) else {
            return fail(&format!(
                "the lines {BEGIN} and {END} left README.md during the run; README.md not touched"
            ));
        };
        if let Err(why) = write(&readme_path, &readme) {
            return fail(&why);
        }
        println!("README.md: the table between {BEGIN} and {END} replaced");
    }

    if let Err(why) = profile_table(save, &benchmarks_path) {
        return fail(&why);
    }

    // The verdict: the instruction counts only.
    let over: Vec<String> = rows
        .iter()
        .filter(|r| r.group == Group::Instructions && r.over())
        .map(|r| {
            format!(
                "the instruction ratio \"{}\" is {:.4}, over its bound {:.2}",
                r.label,
                r.ratio(),
                r.bound.unwrap_or(f64::NAN)
            )
        })
        .collect();
    if !over.is_empty() {
        return fail(&format!(
            "{} (instruction counts do not depend on the machine's load: memtoken's code costs \
             more than its bound allows)",
            over.join("; ")
        ));
    }
    ExitCode::SUCCESS
}
