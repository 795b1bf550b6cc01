//! Runs the hot-path benches and prints the zero-cost ratios as a table; counts instructions
//! of the page cycle with `valgrind --tool=callgrind` when valgrind is installed; draws the
//! ratios into `benches/report.svg`.
//!
//! ```text
//! cargo run --release --example bench_report            # full run (a few minutes)
//! cargo run --release --example bench_report -- --quick # shorter measurements
//! ```

mod common;

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;

use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// (label, bench id, reference id, bound): a ratio `bench / reference` and the bound it must meet.
const RATIOS: &[(&str, &str, &str, f64)] = &[
    (
        "page cycle: tokens (page table) / raw",
        "page_cycle/memtoken",
        "page_cycle/raw",
        1.02,
    ),
    (
        "page cycle: one token per page / raw",
        "page_cycle/memtoken_pages",
        "page_cycle/raw",
        f64::NAN,
    ),
    (
        "page cycle: slab / tokens",
        "page_cycle/slab",
        "page_cycle/memtoken",
        f64::NAN,
    ),
    (
        "page cycle: malloc / tokens",
        "page_cycle/malloc",
        "page_cycle/memtoken",
        f64::NAN,
    ),
    (
        "granule cycle: tokens / raw",
        "granule_cycle/memtoken",
        "granule_cycle/raw",
        1.05,
    ),
    (
        "region cycle: tokens / raw",
        "region_cycle/memtoken",
        "region_cycle/raw",
        1.05,
    ),
    (
        "sleep/wake 64 MiB: tokens / raw",
        "sleep_wake/memtoken",
        "sleep_wake/raw",
        1.05,
    ),
    (
        "page scale: 64 Ki live / 1 Ki live",
        "page_scale/memtoken/65536",
        "page_scale/memtoken/1024",
        1.2,
    ),
    (
        "page scale: 1 Mi live / 1 Ki live",
        "page_scale/memtoken/1048576",
        "page_scale/memtoken/1024",
        1.2,
    ),
    (
        "fork of 1,000 pages + release: tokens / reference counts",
        "shared_fork/memtoken",
        "shared_fork/raw",
        f64::NAN, // callgrind is the judge: 0.859 (examples/share_cycle.rs)
    ),
    (
        "share + unshare of 16 pages: tokens / reference counts",
        "shared_share/memtoken",
        "shared_share/raw",
        f64::NAN, // callgrind is the judge: 0.990 (examples/share_cycle.rs)
    ),
    (
        "GPU page cycle: tokens / raw",
        "gpu/page_cycle/memtoken",
        "gpu/page_cycle/raw",
        1.02,
    ),
    (
        "GPU granule cycle: tokens / raw",
        "gpu/granule_cycle/memtoken",
        "gpu/granule_cycle/raw",
        1.05,
    ),
];

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from)
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

/// Mean time in nanoseconds of every bench criterion has results for, by full id.
fn read_results(dir: &Path, out: &mut BTreeMap<String, f64>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            read_results(&path, out);
        } else if path.file_name().is_some_and(|n| n == "benchmark.json")
            && path.parent().is_some_and(|p| p.ends_with("new"))
        {
            let Some(meta) = read_json::<Benchmark>(&path) else {
                continue;
            };
            let Some(estimates) = read_json::<Estimates>(&path.with_file_name("estimates.json"))
            else {
                continue;
            };
            out.insert(meta.full_id, estimates.mean.point_estimate);
        }
    }
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Instructions per cycle of `examples/{example}.rs` run as `which`, from callgrind: the
/// difference between runs of `cycles` and twice as many, so that what runs once cancels out.
fn callgrind(example: &str, which: &str, cycles: u64) -> Option<f64> {
    let count = |n: u64| -> Option<f64> {
        let exe = target_dir().join("release/examples").join(example);
        let out = std::env::temp_dir().join(format!("memtoken-callgrind-{example}-{which}.out"));
        let run = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--toggle-collect={example}::cycles_*"))
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args([which, &n.to_string()])
            .output()
            .ok()?;
        let log = String::from_utf8_lossy(&run.stderr);
        let collected = log.lines().find_map(|l| l.split("Collected :").nth(1))?;
        collected.trim().replace(',', "").parse().ok()
    };
    Some((count(2 * cycles)? - count(cycles)?) / cycles as f64)
}

/// A row of the chart: label, ratio and bound (NaN: none).
type Row = (String, f64, f64);

/// Width of the chart and (about) the height of one bar's row, in pixels.
const WIDTH: u32 = 760;
const ROW_HEIGHT: u32 = 26;
/// Font sizes as plotters takes them: its SVG backend writes `size / 1.24` pixels (12 and 14).
const FONT: f64 = 15.0;
const TITLE_FONT: f64 = 17.5;
/// Ratios (and bounds) above this do not widen the axis: their bars are cut at its end.
const LARGEST_SHOWN: f64 = 3.0;

/// Width in pixels of `text` at `size`, on the generous side: an SVG leaves the real width to
/// whatever renders it.
fn text_width(text: &str, size: f64) -> i32 {
    (text.chars().count() as f64 * size / 1.24 * 0.66).ceil() as i32
}

/// The end of the ratio axis: the largest ratio or bound up to [`LARGEST_SHOWN`], rounded up
/// to a multiple of 0.5, and at least 1.5.
fn axis_end(rows: &[Row]) -> f64 {
    let largest = rows
        .iter()
        .flat_map(|r| [r.1, r.2])
        .filter(|v| *v <= LARGEST_SHOWN)
        .fold(1.0, f64::max);
    ((largest / 0.5).ceil() * 0.5).max(1.5)
}

/// The ratios as horizontal bars, one row each, first row on top. A black tick on a bar marks
/// its bound, the dashed line 1.0; a bar longer than the axis is cut at its end, and every bar's
/// label gives its value (and bound).
fn svg(rows: &[Row]) -> Result<String, Box<dyn Error>> {
    let n = rows.len().max(1) as i32;
    let height = 40 + ROW_HEIGHT * n as u32 + 55;
    let end = axis_end(rows);
    // The y axis points up and gives each row 10 units: row `i`'s centre.
    let centre = |i: usize| 10 * (n - i as i32) - 5;
    let y_ticks = (0..rows.len()).map(centre).collect();
    let row_label = |y: &i32| {
        let i = (n - (y + 5) / 10) as usize;
        rows.get(i).map_or_else(String::new, |r| r.0.clone())
    };
    let font = ("sans-serif", FONT);

    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "memtoken hot paths: time ratio (lower is better; 1.0 = the reference)",
                ("sans-serif", TITLE_FONT),
            )
            .margin(10)
            .x_label_area_size(45)
            .y_label_area_size(290)
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
            .x_desc("time ratio (black tick: the bound a ratio must meet)")
            .draw()?;

        let blue = RGBColor(0x3b, 0x7d, 0xd8);
        let red = RGBColor(0xd8, 0x50, 0x3b);
        chart.draw_series(rows.iter().enumerate().map(|(i, &(_, ratio, bound))| {
            let ok = bound.is_nan() || ratio <= bound;
            let colour = if ok { blue } else { red };
            // `min` takes `end` for a NaN ratio too.
            let to = ratio.min(end);
            Rectangle::new([(0.0, centre(i) - 3), (to, centre(i) + 3)], colour.filled())
        }))?;
        chart.draw_series(std::iter::once(DashedPathElement::new(
            [(1.0, 0), (1.0, 10 * n)],
            4,
            3,
            BLACK.stroke_width(1),
        )))?;
        chart.draw_series(
            rows.iter()
                .enumerate()
                .filter(|(_, r)| r.2 <= end)
                .map(|(i, r)| {
                    PathElement::new(
                        [(r.2, centre(i) - 4), (r.2, centre(i) + 4)],
                        BLACK.stroke_width(2),
                    )
                }),
        )?;

        // Labels in pixels: right of the bar where they fit inside the plot, else inside it.
        let right = chart.plotting_area().get_pixel_range().0.end;
        for (i, &(_, ratio, bound)) in rows.iter().enumerate() {
            let cut = ratio > end || ratio.is_nan();
            let (bar_end, y) = chart.backend_coord(&(ratio.min(end), centre(i)));
            let mut text = format!("{ratio:.3}");
            if !bound.is_nan() {
                text += &format!(" (≤ {bound})");
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
            // Right of the bar, the dashed line and the bound's tick, so as not to cross them.
            let mut clear = bar_end.max(chart.backend_coord(&(1.0, 0)).0);
            if bound <= end {
                clear = clear.max(chart.backend_coord(&(bound, 0)).0 + 1);
            }
            let outside = clear + 6 + text_width(&text, FONT) <= right;
            let (x, anchor, colour) = if outside {
                (clear + 6, HPos::Left, BLACK)
            } else {
                (bar_end - if cut { 22 } else { 6 }, HPos::Right, WHITE)
            };
            let style = font
                .into_font()
                .color(&colour)
                .pos(Pos::new(anchor, VPos::Center));
            root.draw(&Text::new(text, (x, y), style))?;
        }
        root.present()?;
    }
    Ok(out)
}

fn main() {
    if common::started_by_test_harness() {
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (warm, measure) = if quick { ("1", "2") } else { ("3", "8") };
    eprintln!("running the benches (cargo bench --bench hot_paths) ...");
    let status = cargo()
        .args([
            "bench",
            "--bench",
            "hot_paths",
            "--",
            "--warm-up-time",
            warm,
        ])
        .args(["--measurement-time", measure])
        .status()
        .expect("cargo runs");
    assert!(status.success(), "the benches failed");

    let mut results = BTreeMap::new();
    read_results(&target_dir().join("criterion"), &mut results);

    println!("\n| ratio | value | bound | |");
    println!("| --- | ---: | ---: | --- |");
    let mut rows = Vec::new();
    let mut failed = false;
    for &(label, bench, reference, bound) in RATIOS {
        let (Some(&a), Some(&b)) = (results.get(bench), results.get(reference)) else {
            continue; // e.g. no GPU here
        };
        let ratio = a / b;
        let verdict = if bound.is_nan() {
            ""
        } else if ratio <= bound {
            "ok"
        } else {
            failed = true;
            "**over**"
        };
        let bound_text = if bound.is_nan() {
            "—".to_string()
        } else {
            format!("≤ {bound}")
        };
        println!("| {label} | {ratio:.3} | {bound_text} | {verdict} |");
        rows.push((label.to_string(), ratio, bound));
    }
    println!("\n| bench | mean |\n| --- | ---: |");
    for (id, ns) in &results {
        if RATIOS.iter().any(|r| r.1 == id || r.2 == id) {
            let shown = if *ns >= 1000.0 {
                format!("{:.2} µs", ns / 1000.0)
            } else {
                format!("{ns:.2} ns")
            };
            println!("| `{id}` | {shown} |");
        }
    }

    // Instruction counts: (what, example, tokens' mode, hand-written mode, cycles).
    let counted = [
        ("page cycle", "page_cycle", "memtoken", "raw", 20_000),
        ("granule cycle", "granule_cycle", "memtoken", "raw", 2_000),
        ("region cycle", "region_cycle", "memtoken", "raw", 1_000),
        (
            "region cycle in its tail",
            "region_cycle",
            "tail",
            "raw",
            1_000,
        ),
    ];
    let built = cargo()
        .args(["build", "--release"])
        .args(["--example", "page_cycle", "--example", "granule_cycle"])
        .args(["--example", "region_cycle"])
        .status()
        .is_ok_and(|s| s.success());
    for (what, example, tokens, raw, cycles) in counted {
        let counts = built
            .then(|| {
                Some((
                    callgrind(example, tokens, cycles)?,
                    callgrind(example, raw, cycles)?,
                ))
            })
            .flatten();
        let Some((tokens, raw)) = counts else {
            println!(
                "\ncallgrind: skipped (valgrind is not installed, or the examples did not build)"
            );
            break;
        };
        let ratio = tokens / raw;
        println!(
            "\ncallgrind, {what}: {tokens:.1} instructions with tokens, {raw:.1} by hand: ratio {ratio:.4}"
        );
        // The page cycle's parity is a promise: more than 2% apart fails the report.
        if example == "page_cycle" {
            if (ratio - 1.0).abs() > 0.02 {
                println!("**the page cycle is more than 2% apart**");
            }
            failed |= (ratio - 1.0).abs() > 0.02;
        }
    }

    let plot = Path::new("benches/report.svg");
    match svg(&rows).and_then(|s| Ok(std::fs::write(plot, s)?)) {
        Ok(()) => println!("plot: {}", plot.display()),
        Err(e) => println!("plot not written: {e}"),
    }
    if failed {
        std::process::exit(1);
    }
}
