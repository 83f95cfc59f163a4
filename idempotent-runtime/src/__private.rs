//! What the `#[idempotent]` expansions name, through `::idempotent_runtime::__private::…` (or
//! the `crate = path` argument). Not a stable API: it changes with the macros, which are pinned
//! to this exact version.

pub use crate::config::{Endpoint, EndpointConfig, FailureMode, Methods, Oversized, ReuseStatus};
pub use core::time::Duration;

/// A duration in [the grammar](crate::config::grammar), for the expansion's `const`: a bad
/// value panics there, which is a compile error at the caller, the attribute's literal.
#[track_caller]
pub const fn duration(text: &str) -> Duration {
    match crate::config::grammar::parse_duration(text) {
        Ok(d) => d,
        Err(e) => panic!("{}", e.message()),
    }
}

/// A size in [the grammar](crate::config::grammar), as [`duration`].
#[track_caller]
pub const fn size(text: &str) -> usize {
    match crate::config::grammar::parse_size(text) {
        Ok(n) => n,
        Err(e) => panic!("{}", e.message()),
    }
}

/// `lease = "…"`: as [`duration`], and at least 30 ms (renewed every third of it).
#[track_caller]
pub const fn lease(text: &str) -> Duration {
    let lease = duration(text);
    if let Some(why) = crate::config::lease_refusal(lease) {
        panic!("{}", why);
    }
    lease
}

/// One status of `non_replayable = [...]`, checked where it is written.
#[track_caller]
pub const fn status(status: u16) -> u16 {
    if let Some(why) = crate::config::status_refusal(status) {
        panic!("{}", why);
    }
    status
}

/// One name of `recorded_headers = [...]`, checked where it is written.
#[track_caller]
pub const fn header(name: &'static str) -> &'static str {
    if let Some(why) = crate::config::header_refusal(name) {
        panic!("{}", why);
    }
    name
}

pub use crate::fingerprint::BodySubset;
pub use crate::key::{JsonPointer, KeySource};

/// `key = header("…")`: the name, lowercased by the macro, checked where it is written.
#[track_caller]
pub const fn key_header(name: &'static str) -> KeySource {
    KeySource::header_static(name)
}

/// `key = body("/…")`: the JSON Pointer, checked where it is written.
#[track_caller]
pub const fn key_body(pointer: &'static str) -> KeySource {
    KeySource::body_static(pointer)
}

/// One pointer of `fingerprint = [...]`, checked where it is written.
#[track_caller]
pub const fn pointer(pointer: &'static str) -> JsonPointer {
    JsonPointer::from_static(pointer)
}

pub use crate::probe::{BodyProbe, NotStreaming, StreamingBody};

/// The axum expansion's helpers.
#[cfg(feature = "axum")]
pub mod axum {
    pub use crate::axum::__private::*;
}

/// The actix-web expansion's helpers.
#[cfg(feature = "actix")]
pub mod actix {
    pub use crate::actix::__private::*;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expansion's path and the file form's read the same strings the same way: each
    /// accepts what the grammar accepts and refuses the rest (the expansion by panicking in
    /// its `const`, a compile error; the ui tests show it at the literal).
    #[test]
    fn the_expansion_reads_the_grammar() {
        for text in [
            "30s", "1.5m", "64KiB", "64KB", "512", "30", "30 s", "64kib", "1.3B", "0s",
        ] {
            let expanded = std::panic::catch_unwind(|| duration(text));
            let parsed = crate::config::grammar::parse_duration(text);
            assert_eq!(expanded.ok(), parsed.ok(), "{text:?}");
            let expanded = std::panic::catch_unwind(|| size(text));
            let parsed = crate::config::grammar::parse_size(text);
            assert_eq!(expanded.ok(), parsed.ok(), "{text:?}");
        }
        assert!(std::panic::catch_unwind(|| lease("10ms")).is_err());
        assert_eq!(lease("30ms"), Duration::from_millis(30));
        assert!(std::panic::catch_unwind(|| status(500)).is_err());
        assert!(std::panic::catch_unwind(|| header("X-Trace")).is_err());
        assert_eq!(header("x-trace"), "x-trace");
    }
}
