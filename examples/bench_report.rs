//! Runs the hot-path benches and prints the zero-cost ratios as a table; counts instructions
//! of the page cycle with `valgrind --tool=callgrind` when valgrind is installed; draws the
//! ratios into `benches/report.svg`.
//!
//! ```text
//! cargo run --release --example bench_report            # full run (a few minutes)
//! cargo run --release --example bench_report -- --quick # shorter measurements
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

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

/// The text after `key` up to the next `"`, or the number after it.
fn field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let at = json.find(key)? + key.len();
    let rest = &json[at..];
    let end = rest.find(['"', ',', '}'])?;
    Some(&rest[..end])
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
            let Ok(meta) = std::fs::read_to_string(&path) else {
                continue;
            };
            let Ok(estimates) = std::fs::read_to_string(path.with_file_name("estimates.json"))
            else {
                continue;
            };
            let id = field(&meta, "\"full_id\":\"");
            let mean = estimates
                .find("\"mean\"")
                .and_then(|at| field(&estimates[at..], "\"point_estimate\":"))
                .and_then(|v| v.parse::<f64>().ok());
            if let (Some(id), Some(mean)) = (id, mean) {
                out.insert(id.to_string(), mean);
            }
        }
    }
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Instructions per page cycle of `examples/page_cycle.rs` for `which`, from callgrind.
fn callgrind(which: &str, cycles: u64) -> Option<f64> {
    let exe = target_dir().join("release/examples/page_cycle");
    let out = std::env::temp_dir().join(format!("memtoken-callgrind-{which}.out"));
    let run = Command::new("valgrind")
        .args(["--tool=callgrind", "--toggle-collect=page_cycle::cycles_*"])
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(&exe)
        .args([which, &cycles.to_string()])
        .output()
        .ok()?;
    let log = String::from_utf8_lossy(&run.stderr);
    let collected = log.lines().find_map(|l| l.split("Collected :").nth(1))?;
    let n: f64 = collected.trim().replace(',', "").parse().ok()?;
    Some(n / cycles as f64)
}

fn svg(rows: &[(String, f64, f64)]) -> String {
    let (w, bar_h, left, scale) = (760.0, 26.0, 300.0, 180.0);
    let h = 40.0 + bar_h * rows.len() as f64 + 30.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\">memtoken hot paths: time ratio (lower is better; 1.0 = the reference)</text>\n"
    );
    let x1 = left + scale;
    for (i, (label, ratio, bound)) in rows.iter().enumerate() {
        let y = 35.0 + bar_h * i as f64;
        let len = (ratio.min(3.0) * scale).max(1.0);
        let ok = bound.is_nan() || ratio <= bound;
        let color = if ok { "#3b7dd8" } else { "#d8503b" };
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{label}</text>\n\
             <rect x=\"{left}\" y=\"{}\" width=\"{len:.1}\" height=\"{}\" fill=\"{color}\"/>\n\
             <text x=\"{:.1}\" y=\"{}\">{ratio:.3}{}</text>\n",
            left - 8.0,
            y + 16.0,
            y + 4.0,
            bar_h - 8.0,
            left + len + 6.0,
            y + 16.0,
            if bound.is_nan() {
                String::new()
            } else {
                format!(" (≤ {bound})")
            },
        );
    }
    s += &format!(
        "<line x1=\"{x1}\" y1=\"30\" x2=\"{x1}\" y2=\"{}\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n\
         <text x=\"{x1}\" y=\"{}\" text-anchor=\"middle\">1.0</text>\n</svg>\n",
        h - 25.0,
        h - 10.0
    );
    s
}

fn main() {
    // `cargo test --no-run` builds examples too, and some runners then start every binary it
    // built with the test harness's flags: this is a program, not a test binary.
    if std::env::args().any(|a| a == "--include-ignored" || a.starts_with("--test-threads")) {
        eprintln!("an example, not a test binary: run it with `cargo run --release --example`");
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

    let built = cargo()
        .args(["build", "--release", "--example", "page_cycle"])
        .status()
        .is_ok_and(|s| s.success());
    match (
        built,
        callgrind("memtoken", 100_000),
        callgrind("raw", 100_000),
    ) {
        (true, Some(tokens), Some(raw)) => {
            let ratio = tokens / raw;
            println!(
                "\ncallgrind, page cycle: {tokens:.1} instructions with tokens, {raw:.1} raw: ratio {ratio:.4} ({})",
                if (ratio - 1.0).abs() <= 0.02 {
                    "within 2%"
                } else {
                    "**more than 2% apart**"
                }
            );
            failed |= (ratio - 1.0).abs() > 0.02;
        }
        _ => println!(
            "\ncallgrind: skipped (valgrind is not installed, or the example did not build)"
        ),
    }

    let plot = Path::new("benches/report.svg");
    match std::fs::write(plot, svg(&rows)) {
        Ok(()) => println!("plot: {}", plot.display()),
        Err(e) => println!("plot not written: {e}"),
    }
    if failed {
        std::process::exit(1);
    }
}
