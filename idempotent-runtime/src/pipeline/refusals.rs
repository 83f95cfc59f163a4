//! Every refusal the pipeline answers, each counted and logged in one place, as
//! framework-free [`Problem`]s ([the contract](crate::design) §2): plain functions of the
//! settings they quote, so they belong to no type.

use crate::config::Config;
use crate::fingerprint::SubsetError;
use crate::key::{BodyKeyError, KeyError, KeySource};
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemCode};
use crate::record;
use crate::scope::ScopeError;

/// The refusal for an invalid key (never echoing it).
pub(crate) fn key_invalid(error: KeyError, route: &str) -> Problem {
    observe::count(Event::KeyInvalid, route);
    observe::decided(Event::KeyInvalid.name());
    tracing::debug!(route, %error, "idempotency key refused");
    Problem::new(400, ProblemCode::KeyInvalid, error.to_string())
}

/// The refusal for a missing key on a `require_key` endpoint (`at`: where it reads the key,
/// `None` for the default header).
pub(crate) fn key_missing(config: &Config, route: &str, at: Option<&KeySource>) -> Problem {
    observe::count(Event::KeyMissing, route);
    observe::decided(Event::KeyMissing.name());
    let detail = match at {
        // The configured header (`Config::key_header`, kept lowercase), in the contract's
        // spelling when it is the default one.
        None if config
            .key_header()
            .eq_ignore_ascii_case(crate::key::HEADER_NAME) =>
        {
            "this endpoint requires an Idempotency-Key header".to_owned()
        }
        None => format!(
            "this endpoint requires an idempotency key in the {} header",
            config.key_header()
        ),
        Some(at) => match at.body_pointer() {
            Some(pointer) => {
                format!("this endpoint requires an idempotency key in the JSON body at {pointer}")
            }
            None => format!(
                "this endpoint requires an idempotency key in the {} header",
                at.header_name().unwrap_or(crate::key::HEADER_NAME)
            ),
        },
    };
    Problem::new(
        config.missing_key_status().code(),
        ProblemCode::KeyRequired,
        detail,
    )
}

/// The refusal for a key the body holds but that cannot be one (or a body that is not JSON).
pub(crate) fn body_key_invalid(error: &BodyKeyError, route: &str) -> Problem {
    observe::count(Event::KeyInvalid, route);
    observe::decided(Event::KeyInvalid.name());
    tracing::debug!(route, %error, "idempotency key in the body refused");
    error.problem()
}

/// The refusal for a body a fingerprint over its fields cannot read.
pub(crate) fn subset_invalid(error: &SubsetError, route: &str) -> Problem {
    tracing::debug!(route, %error, "request body is not JSON the fingerprint can read");
    observe::decided("body_invalid");
    error.problem()
}

/// The refusal for a body over its cap.
pub(crate) fn payload_too_large(max_body: usize, route: &str) -> Problem {
    observe::count(Event::PayloadTooLarge, route);
    observe::decided(Event::PayloadTooLarge.name());
    Problem::new(
        413,
        ProblemCode::PayloadTooLarge,
        format!("the request body is larger than {max_body} bytes"),
    )
}

/// The refusal for a body that arrived too slowly.
pub(crate) fn body_timeout(config: &Config, route: &str) -> Problem {
    observe::count(Event::BodyTimeout, route);
    observe::decided(Event::BodyTimeout.name());
    Problem::new(
        408,
        ProblemCode::BodyTimeout,
        format!(
            "the request body did not arrive within {} s",
            config.body_timeout().as_secs_f64()
        ),
    )
}

/// The refusal when no identity could be established: a setup mistake, logged with its fix.
pub(crate) fn scope_unresolved(error: ScopeError, route: &str) -> Problem {
    observe::count(Event::ScopeUnresolved, route);
    observe::decided(Event::ScopeUnresolved.name());
    tracing::error!(route, "idempotency scope unresolved: {}", error.remedy());
    Problem::new(
        500,
        ProblemCode::ScopeUnresolved,
        "the caller's identity could not be established for this request",
    )
}

/// A refusal the identity resolver chose, counted as an unresolved scope.
pub(crate) fn resolver_refused(problem: Problem, route: &str) -> Problem {
    observe::count(Event::ScopeUnresolved, route);
    tracing::debug!(
        route,
        status = problem.status(),
        "the identity resolver refused the request"
    );
    problem
}

/// The refusal when the buffer budget is exhausted.
pub(crate) fn buffers_full(config: &Config, route: &str) -> Problem {
    observe::count(Event::StoreFull, route);
    observe::decided(Event::StoreFull.name());
    Problem::new(
        503,
        ProblemCode::StoreFull,
        "too many request bodies are buffered right now",
    )
    .with_retry_after(record::ceil_secs(config.store_retry_after()).max(1))
}

/// The response to a panicked handler: 500, key released.
pub(crate) fn panicked(route: &str) -> Problem {
    observe::count(Event::HandlerPanicked, route);
    tracing::error!(route, "idempotent handler panicked; its key was released");
    Problem::new(
        500,
        ProblemCode::HandlerPanicked,
        "the request failed; it may be retried with the same Idempotency-Key",
    )
}

/// The refusal for a body broken mid-read (a connection error, bad chunking): nothing was
/// claimed.
pub(crate) fn body_invalid(route: &str) -> Problem {
    tracing::debug!(route, "request body broken mid-read");
    observe::decided("body_invalid");
    Problem::new(
        400,
        ProblemCode::BodyInvalid,
        "the request body could not be read to its end",
    )
}

/// The answer when the task running a claimed handler failed without a panic the
/// reservation saw (the runtime is shutting down): 500, the key released by its guard.
pub(crate) fn task_failed(route: &str) -> Problem {
    observe::count(Event::HandlerPanicked, route);
    tracing::error!(route, "idempotent handler task failed; its key is released");
    Problem::new(
        500,
        ProblemCode::HandlerPanicked,
        "the request failed; it may be retried with the same Idempotency-Key",
    )
}

/// The answer to a request that shows a setup mistake in strict mode; the log line says the
/// fix, the client only that the server is misconfigured.
pub(crate) fn misconfigured() -> Problem {
    Problem::new(
        500,
        ProblemCode::Misconfigured,
        "idempotency is misconfigured on this server (strict mode); its log names the fix",
    )
}
