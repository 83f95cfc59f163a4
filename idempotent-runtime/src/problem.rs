//! RFC 9457 `application/problem+json` refusals with the stable `code`s of [the contract](crate::design) §2.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;

/// The media type of every refusal.
pub(crate) const CONTENT_TYPE: &str = "application/problem+json";

/// [`ProblemCode`] and everything said per code (`ALL`, the `code` member, the title, the
/// rustdoc anchor), generated from one list: a code added to the list is in every table, and
/// there is no second list to forget. Each anchor is written out, so CI can check that it lands
/// on the generated page, and is checked at compile time against the variant's name.
macro_rules! problem_codes {
    ($(
        $(#[$doc:meta])*
        $variant:ident => $code:literal, $title:literal, $anchor:literal;
    )+) => {
        /// The stable machine-readable reason of a refusal.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemCode {
            $($(#[$doc])* $variant,)+
        }

        impl ProblemCode {
            /// Every stable code, in the order of [the contract](crate::design) §2.
            ///
            /// ```
            /// use idempotent_runtime::problem::ProblemCode;
            ///
            /// assert!(ProblemCode::ALL.contains(&ProblemCode::InProgress));
            /// ```
            pub const ALL: &'static [ProblemCode] = &[$(ProblemCode::$variant),+];

            /// The stable `code` member.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $code,)+
                }
            }

            fn title(self) -> &'static str {
                match self {
                    $(Self::$variant => $title,)+
                }
            }

            /// The rustdoc anchor of this code's variant, so a problem's `type` lands on its docs.
            fn anchor(self) -> &'static str {
                match self {
                    $(Self::$variant => $anchor,)+
                }
            }
        }

        $(const _: () = assert!(
            same(
                $anchor,
                // Split so that CI's grep for the anchors finds only the ones written out.
                concat!("variant", ".", stringify!($variant)),
            ),
            concat!("the anchor of ProblemCode::", stringify!($variant), " is not its rustdoc anchor"),
        );)+
    };
}

/// String equality in a `const` (the anchors' check above).
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

problem_codes! {
    /// The first request with this key is still running.
    InProgress => "IDEMPOTENCY_IN_PROGRESS",
        "A request with this Idempotency-Key is in progress", "variant.InProgress";
    /// The key was used before with a different request.
    KeyReused => "IDEMPOTENCY_KEY_REUSED",
        "Idempotency-Key reused with a different request", "variant.KeyReused";
    /// The endpoint requires a key and none was sent.
    KeyRequired => "IDEMPOTENCY_KEY_REQUIRED",
        "Idempotency-Key required", "variant.KeyRequired";
    /// The key is malformed, empty, too long, or sent twice.
    KeyInvalid => "IDEMPOTENCY_KEY_INVALID",
        "Invalid Idempotency-Key", "variant.KeyInvalid";
    /// The request body is larger than `max_body`.
    PayloadTooLarge => "IDEMPOTENCY_PAYLOAD_TOO_LARGE",
        "Request body too large", "variant.PayloadTooLarge";
    /// The request body arrived slower than `body_timeout`.
    BodyTimeout => "IDEMPOTENCY_BODY_TIMEOUT",
        "Request body timed out", "variant.BodyTimeout";
    /// The request body broke off mid-read (a connection error, bad chunking).
    BodyInvalid => "IDEMPOTENCY_BODY_INVALID",
        "Request body could not be read", "variant.BodyInvalid";
    /// No identity could be established for the caller.
    ScopeUnresolved => "IDEMPOTENCY_SCOPE_UNRESOLVED",
        "Caller identity could not be established", "variant.ScopeUnresolved";
    /// The store could not be reached.
    StoreUnavailable => "IDEMPOTENCY_STORE_UNAVAILABLE",
        "Idempotency store unavailable", "variant.StoreUnavailable";
    /// The store, or the caller's share of it, is full.
    StoreFull => "IDEMPOTENCY_STORE_FULL",
        "Idempotency store full", "variant.StoreFull";
    /// The handler panicked; the key was released.
    HandlerPanicked => "IDEMPOTENCY_HANDLER_PANICKED",
        "The request failed", "variant.HandlerPanicked";
    /// Enlisted mode: the response could not be recorded, so the request's changes were
    /// rolled back; the key is free.
    NotRecorded => "IDEMPOTENCY_NOT_RECORDED",
        "The response could not be recorded", "variant.NotRecorded";
    /// Enlisted mode: the endpoint needs the PostgreSQL store and another one is configured.
    StoreNotEnlistable => "IDEMPOTENCY_STORE_NOT_ENLISTABLE",
        "Enlisted endpoint without a PostgreSQL store", "variant.StoreNotEnlistable";
    /// Strict mode ([`Config::strict`](crate::config::Config::strict)): this request showed a setup
    /// mistake that turns protection off (a router-level layer outside the router, two
    /// in-memory stores serving one route, a `require_key` attribute under a layer whose key is
    /// optional). The log line says the fix; nothing was claimed.
    Misconfigured => "IDEMPOTENCY_MISCONFIGURED",
        "Idempotency is misconfigured on this server", "variant.Misconfigured";
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
/// keeps working whatever the envelope. Built with [`new`](Self::new) (non-exhaustive, so that
/// a later version can carry more, such as extra headers).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RenderedRefusal {
    /// The `Content-Type` of `body`.
    pub content_type: Cow<'static, str>,
    /// The body.
    pub body: Bytes,
}

impl RenderedRefusal {
    /// A refusal rendered as `body`, sent with `Content-Type: content_type`.
    pub fn new(content_type: impl Into<Cow<'static, str>>, body: impl Into<Bytes>) -> Self {
        Self {
            content_type: content_type.into(),
            body: body.into(),
        }
    }

    /// The default rendering: `application/problem+json`.
    pub fn problem_json(problem: &Problem) -> Self {
        Self {
            content_type: Cow::Borrowed(CONTENT_TYPE),
            body: problem.body(),
        }
    }
}

/// Renders refusals in the application's own format, set with
/// [`Builder::refusal_renderer`](crate::IdempotencyBuilder::refusal_renderer). Any
/// `Fn(&Problem) -> RenderedRefusal` is one.
///
/// ```
/// use idempotent_runtime::Idempotency;
/// use idempotent_runtime::problem::{Problem, RenderedRefusal};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let idempotency = Idempotency::builder(idempotent_runtime::store::memory::MemoryStore::default())
///     .refusal_renderer(|p: &Problem| {
///         let body = serde_json::json!({
///             "error": {"code": p.code().as_str(), "message": p.detail()}
///         });
///         RenderedRefusal::new("application/json", serde_json::to_vec(&body).unwrap())
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
        for &code in ProblemCode::ALL {
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
