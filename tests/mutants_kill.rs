//! Tests written to kill mutants that `cargo mutants` (`.cargo/mutants.toml`) found surviving
//! the other suites: each names the mutant it catches (as cargo-mutants names it) in its
//! comment. `.cargo/mutants-survivors.md` lists the mutants that survive everything, with why
//! each cannot change behaviour.
