//! Compile-time behaviour of actix-web's `#[idempotent]`: what compiles, and the errors of what
//! does not (`.stderr` files reviewed in the diff; regenerate with `TRYBUILD=overwrite`).
//! Run on stable only: compiler messages change between releases.
#![cfg(all(feature = "actix", feature = "axum"))]

#[test]
fn actix_ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/actix/pass/*.rs");
    t.compile_fail("tests/ui/actix/fail/*.rs");
}
