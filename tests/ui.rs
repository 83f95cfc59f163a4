//! Compile-time behaviour of `#[idempotent]` for axum: what compiles (pass/) and the errors for
//! each mistake (fail/, one per file, named after it). Regenerate the expected errors with
//! `TRYBUILD=overwrite cargo test --all-features -p idempotent-examples --test ui` and review
//! them in the diff. Compiler messages shift between releases: run on stable only.

#[test]
fn axum() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/axum/pass/*.rs");
    t.compile_fail("tests/ui/axum/fail/*.rs");
}
