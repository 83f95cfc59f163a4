//! The `#[idempotent(...)]` argument parser of idempotent-macros on arbitrary text: it never
//! panics, and the runtime's duration and size grammar (which the expansion evaluates) accepts
//! only values above zero. The parser is compiled in from the macros
//! crate's source (a proc-macro crate can export nothing but macros).
#![no_main]

use idempotent_runtime::config::grammar;
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../idempotent-macros/src/args.rs"]
mod args;

const ITEM: &str = "async fn handler(body: String) -> String { body }";

fuzz_target!(|text: &str| {
    // The one grammar of durations and sizes, which the expansion evaluates in a `const` and the
    // file form reads through: a value it accepts is above zero.
    if let Ok(duration) = grammar::parse_duration(text) {
        assert!(!duration.is_zero(), "zero duration accepted from {text:?}");
    }
    if let Ok(bytes) = grammar::parse_size(text) {
        assert!(bytes > 0, "zero size accepted from {text:?}");
    }
    if let Ok(parsed) = syn::parse_str::<args::Args>(text) {
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
