//! Compile-fail cases: each `*.rs` file of this package's directory (`ui-tests/`) is a misuse
//! the type system must reject; the compiler's message is in the `*.stderr` file beside it.

/// Cases about the CUDA device views, which exist only with feature `cuda`.
const CUDA_ONLY: &[&str] = &["device_view_of_non_pod.rs", "view_across_release.rs"];
/// Cases about NIXL transfers, which exist only with feature `nixl`.
const NIXL_ONLY: &[&str] = &[
    "offer_shared_prefix.rs",
    "offered_table_has_no_bytes.rs",
    "offered_table_lends_nothing.rs",
    "peer_exited_from_safe_code.rs",
    "release_under_transfer.rs",
];

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    // Cargo runs this test in the package's directory: the cases are named from there.
    let mut cases: Vec<_> = std::fs::read_dir(".")
        .expect("ui-tests/ is read")
        .map(|entry| std::path::PathBuf::from(entry.expect("ui-tests/ is listed").file_name()))
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            // With feature `nixl`, only its cases: rustc names some types differently when
            // the crate holds more (`memtoken::Reserved` for `Reserved`), and the others are
            // checked by the default build's run.
            if cfg!(feature = "nixl") {
                NIXL_ONLY.contains(&name)
            } else {
                (cfg!(feature = "cuda") || !CUDA_ONLY.contains(&name)) && !NIXL_ONLY.contains(&name)
            }
        })
        .collect();
    cases.sort();
    assert!(
        !cases.is_empty(),
        "no compile-fail case found under ui-tests/"
    );
    for case in cases {
        t.compile_fail(case);
    }
}
