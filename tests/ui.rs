//! Compile-fail cases: each file under `ui-tests/` is a misuse the type system must reject.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-tests/*.rs");
}
