//! Compile-time behaviour of `#[idempotent]` for axum: what compiles (pass/) and the errors for
//! each mistake (fail/, one per file, named after it). Regenerate the expected errors with
//! `TRYBUILD=overwrite cargo test --all-features -p idempotent-examples --test ui` and review
//! them in the diff. Compiler messages shift between releases: run on stable only.
//!
//! No expected error names the runtime's `__private` types: the streaming-body probe fails as a
//! constant whose message is the whole explanation, and a fail case whose mistake would also
//! break code around it (routing a handler whose state lacks the store) stops at the handler.

#[test]
fn axum() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/axum/pass/*.rs");
    t.compile_fail("tests/ui/axum/fail/*.rs");
}

/// actix-web's `#[idempotent]`. Its short-path cases need both features on, as `--all-features`
/// has (this file already requires `axum`).
#[cfg(feature = "actix")]
#[test]
fn actix() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/actix/pass/*.rs");
    t.compile_fail("tests/ui/actix/fail/*.rs");
}
