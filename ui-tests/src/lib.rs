//! Nothing: this package's library exists so that trybuild's build of the cases gets the
//! package's features (trybuild passes a feature on only through the package's own library),
//! and through them memtoken's. The cases are the `*.rs` files beside `Cargo.toml`; their
//! driver is `tests/ui.rs`.
