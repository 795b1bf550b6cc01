//! What the examples share.

/// `cargo test --no-run` builds examples too, and some runners then start every binary it built
/// with the test harness's flags: an example started so says what it is, and does nothing.
pub fn started_by_test_harness() -> bool {
    let harness =
        std::env::args().any(|a| a == "--include-ignored" || a.starts_with("--test-threads"));
    if harness {
        eprintln!("an example, not a test binary: run it with `cargo run --release --example`");
    }
    harness
}
