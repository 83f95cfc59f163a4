//! The `#[idempotent(...)]` argument parser of idempotent-macros on arbitrary text: it never
//! panics, and every value it accepts is in range. The parser is compiled in from the macros
//! crate's source (a proc-macro crate can export nothing but macros).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../idempotent-macros/src/args.rs"]
mod args;

const ITEM: &str = "async fn handler(body: String) -> String { body }";

fuzz_target!(|text: &str| {
    if let Ok(ms) = args::parse_duration(text) {
        assert!(ms > 0, "zero duration accepted from {text:?}");
    }
    if let Ok(bytes) = args::parse_size(text) {
        assert!(
            bytes > 0 && bytes <= u64::from(u32::MAX),
            "{bytes} accepted from {text:?}"
        );
    }
    if let Ok(parsed) = syn::parse_str::<args::Args>(text) {
        for ms in [parsed.lease_ms, parsed.retention_ms].into_iter().flatten() {
            assert!(ms > 0, "zero duration accepted from {text:?}");
        }
        for bytes in [parsed.max_body, parsed.max_response].into_iter().flatten() {
            assert!(
                bytes > 0 && bytes <= u64::from(u32::MAX),
                "{bytes} accepted from {text:?}"
            );
        }
        let _ = parsed.runtime();
    }
    // The macro's own entry: arguments and the function they sit on. On error, the untouched
    // function is emitted beside the error.
    if let Ok(attr) = text.parse::<proc_macro2::TokenStream>() {
        let item: proc_macro2::TokenStream = ITEM.parse().expect("item");
        if let Err(tokens) = args::parse(attr, item) {
            let out = tokens.to_string();
            assert!(
                out.contains("compile_error"),
                "an error without compile_error!: {out}"
            );
            assert!(
                out.contains("async fn handler"),
                "the function was dropped: {out}"
            );
        }
    }
});
