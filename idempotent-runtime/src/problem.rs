//! RFC 9457 `application/problem+json` refusals with the stable `code`s of [the contract](crate::design) §2.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

/// The media type of every refusal.
pub const CONTENT_TYPE: &str = "application/problem+json";

/// The stable machine-readable reason of a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemCode {
    /// The first request with this key is still running.
    InProgress,
    /// The key was used before with a different request.
    KeyReused,
    /// The endpoint requires a key and none was sent.
    KeyRequired,
    /// The key is malformed, empty, too long, or sent twice.
    KeyInvalid,
    /// The request body is larger than `max_body`.
    PayloadTooLarge,
    /// The request body arrived slower than `body_timeout`.
    BodyTimeout,
    /// The request body broke off mid-read (a connection error, bad chunking).
    BodyInvalid,
    /// No identity could be established for the caller.
    ScopeUnresolved,
    /// The store could not be reached.
    StoreUnavailable,
    /// The store, or the caller's share of it, is full.
    StoreFull,
    /// The handler panicked; the key was released.
    HandlerPanicked,
    /// Enlisted mode: the response could not be recorded, so the request's changes were
    /// rolled back; the key is free.
    NotRecorded,
    /// Enlisted mode: the endpoint needs the PostgreSQL store and another one is configured.
    StoreNotEnlistable,
    /// Strict mode ([`Config::strict`](crate::Config::strict)): this request showed a setup
    /// mistake that turns protection off (a router-level layer outside the router, two
    /// in-memory stores serving one route, a `require_key` attribute under a layer whose key is
    /// optional). The log line says the fix; nothing was claimed.
    Misconfigured,
}

/// [`ProblemCode::ALL`] from one list, with an exhaustive match over the same list: a variant
/// added to the enum and not here fails to compile, so no table built from `ALL` (the OpenAPI
/// schema's `code` enum among them) can miss a code.
macro_rules! every_code {
    ($($variant:ident),+ $(,)?) => {
        impl ProblemCode {
            /// Every stable code, in the order of [the contract](crate::design) §2.
            ///
            /// ```
            /// use idempotent_runtime::problem::ProblemCode;
            ///
            /// assert!(ProblemCode::ALL.contains(&ProblemCode::InProgress));
            /// ```
            pub const ALL: &'static [ProblemCode] = &[$(ProblemCode::$variant),+];
        }

        const _: fn(ProblemCode) = |code| match code {
            $(ProblemCode::$variant => {})+
        };
    };
}

every_code!(
    InProgress,
    KeyReused,
    KeyRequired,
    KeyInvalid,
    PayloadTooLarge,
    BodyTimeout,
    BodyInvalid,
    ScopeUnresolved,
    StoreUnavailable,
    StoreFull,
    HandlerPanicked,
    NotRecorded,
    StoreNotEnlistable,
    Misconfigured,
);

impl ProblemCode {
    /// The stable `code` member.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "IDEMPOTENCY_IN_PROGRESS",
            Self::KeyReused => "IDEMPOTENCY_KEY_REUSED",
            Self::KeyRequired => "IDEMPOTENCY_KEY_REQUIRED",
            Self::KeyInvalid => "IDEMPOTENCY_KEY_INVALID",
            Self::PayloadTooLarge => "IDEMPOTENCY_PAYLOAD_TOO_LARGE",
            Self::BodyTimeout => "IDEMPOTENCY_BODY_TIMEOUT",
            Self::BodyInvalid => "IDEMPOTENCY_BODY_INVALID",
            Self::ScopeUnresolved => "IDEMPOTENCY_SCOPE_UNRESOLVED",
            Self::StoreUnavailable => "IDEMPOTENCY_STORE_UNAVAILABLE",
            Self::StoreFull => "IDEMPOTENCY_STORE_FULL",
            Self::HandlerPanicked => "IDEMPOTENCY_HANDLER_PANICKED",
            Self::NotRecorded => "IDEMPOTENCY_NOT_RECORDED",
            Self::StoreNotEnlistable => "IDEMPOTENCY_STORE_NOT_ENLISTABLE",
            Self::Misconfigured => "IDEMPOTENCY_MISCONFIGURED",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::InProgress => "A request with this Idempotency-Key is in progress",
            Self::KeyReused => "Idempotency-Key reused with a different request",
            Self::KeyRequired => "Idempotency-Key required",
            Self::KeyInvalid => "Invalid Idempotency-Key",
            Self::PayloadTooLarge => "Request body too large",
            Self::BodyTimeout => "Request body timed out",
            Self::BodyInvalid => "Request body could not be read",
            Self::ScopeUnresolved => "Caller identity could not be established",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::StoreFull => "Idempotency store full",
            Self::HandlerPanicked => "The request failed",
            Self::NotRecorded => "The response could not be recorded",
            Self::StoreNotEnlistable => "Enlisted endpoint without a PostgreSQL store",
            Self::Misconfigured => "Idempotency is misconfigured on this server",
        }
    }

    /// The rustdoc anchor of this code's variant, so a problem's `type` lands on its docs.
    fn anchor(self) -> &'static str {
        match self {
            Self::InProgress => "variant.InProgress",
            Self::KeyReused => "variant.KeyReused",
            Self::KeyRequired => "variant.KeyRequired",
            Self::KeyInvalid => "variant.KeyInvalid",
            Self::PayloadTooLarge => "variant.PayloadTooLarge",
            Self::BodyTimeout => "variant.BodyTimeout",
            Self::BodyInvalid => "variant.BodyInvalid",
            Self::ScopeUnresolved => "variant.ScopeUnresolved",
            Self::StoreUnavailable => "variant.StoreUnavailable",
            Self::StoreFull => "variant.StoreFull",
            Self::HandlerPanicked => "variant.HandlerPanicked",
            Self::NotRecorded => "variant.NotRecorded",
            Self::StoreNotEnlistable => "variant.StoreNotEnlistable",
            Self::Misconfigured => "variant.Misconfigured",
        }
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal, rendered as `application/problem+json`.
///
/// ```
/// use idempotent_runtime::problem::{Problem, ProblemCode};
///
/// let p = Problem::new(409, ProblemCode::InProgress, "retry later").with_retry_after(1);
/// let json: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
/// assert_eq!(json["code"], "IDEMPOTENCY_IN_PROGRESS");
/// assert_eq!(json["status"], 409);
/// assert_eq!(p.retry_after(), Some(1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    status: u16,
    code: ProblemCode,
    detail: Cow<'static, str>,
    retry_after: Option<u64>,
}

impl Problem {
    /// A refusal with `status`, `code` and a human-readable `detail`.
    pub fn new(status: u16, code: ProblemCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds a `Retry-After` in whole seconds.
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// The stable code.
    pub fn code(&self) -> ProblemCode {
        self.code
    }

    /// The `detail` member.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// `Retry-After`, in whole seconds, when the client should retry.
    pub fn retry_after(&self) -> Option<u64> {
        self.retry_after
    }

    /// The JSON document.
    pub fn body(&self) -> Bytes {
        let doc = serde_json::json!({
            "type": format!("https://docs.rs/idempotent-runtime/latest/idempotent_runtime/problem/enum.ProblemCode.html#{}", self.code.anchor()),
            "title": self.code.title(),
            "status": self.status,
            "detail": self.detail,
            "code": self.code.as_str(),
        });
        Bytes::from(serde_json::to_vec(&doc).expect("a JSON value always serializes"))
    }
}

/// A refusal as the application renders it: the body and its content type. The status and
/// `Retry-After` stay the crate's ([the contract](crate::design) §2), so clients' retry logic
/// keeps working whatever the envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedRefusal {
    /// The `Content-Type` of `body`.
    pub content_type: Cow<'static, str>,
    /// The body.
    pub body: Bytes,
}

impl RenderedRefusal {
    /// The default rendering: `application/problem+json`.
    pub fn problem_json(problem: &Problem) -> Self {
        Self {
            content_type: Cow::Borrowed(CONTENT_TYPE),
            body: problem.body(),
        }
    }
}

/// Renders refusals in the application's own format, set with
/// [`Builder::refusal_renderer`](crate::handle::Builder::refusal_renderer). Any
/// `Fn(&Problem) -> RenderedRefusal` is one.
///
/// ```
/// use idempotent_runtime::Idempotency;
/// use idempotent_runtime::problem::{Problem, RenderedRefusal};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let idempotency = Idempotency::builder(idempotent_runtime::store::memory::MemoryStore::default())
///     .refusal_renderer(|p: &Problem| RenderedRefusal {
///         content_type: "application/json".into(),
///         body: serde_json::to_vec(&serde_json::json!({
///             "error": {"code": p.code().as_str(), "message": p.detail()}
///         }))
///         .unwrap()
///         .into(),
///     })
///     .build();
/// # let _ = idempotency;
/// # }
/// ```
pub trait RefusalRenderer: Send + Sync + 'static {
    /// The body and content type for `problem`.
    fn render(&self, problem: &Problem) -> RenderedRefusal;
}

impl<F> RefusalRenderer for F
where
    F: Fn(&Problem) -> RenderedRefusal + Send + Sync + 'static,
{
    fn render(&self, problem: &Problem) -> RenderedRefusal {
        self(problem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_uri_names_its_variant_in_the_rendered_docs() {
        use ProblemCode::*;
        let all = [
            InProgress,
            KeyReused,
            KeyRequired,
            KeyInvalid,
            PayloadTooLarge,
            BodyTimeout,
            BodyInvalid,
            ScopeUnresolved,
            StoreUnavailable,
            StoreFull,
            HandlerPanicked,
            NotRecorded,
            StoreNotEnlistable,
            Misconfigured,
        ];
        for code in all {
            // rustdoc's anchor for an enum variant is `variant.<Name>`.
            assert_eq!(code.anchor(), format!("variant.{code:?}"));
            let doc: serde_json::Value =
                serde_json::from_slice(&Problem::new(400, code, "d").body()).unwrap();
            let uri = doc["type"].as_str().unwrap();
            assert!(
                uri.ends_with(&format!("enum.ProblemCode.html#variant.{code:?}")),
                "{uri}"
            );
        }
    }
}
