//! The outbound webhook publisher (feature `outbox-webhooks`): Standard Webhooks over HTTP.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::StatusCode;
use reqwest::header::{HeaderValue, RETRY_AFTER};

use super::{Delivery, PublishError, Publisher};
use crate::webhook::{ID_HEADER, SIGNATURE_HEADER, StandardWebhooks, TIMESTAMP_HEADER};

/// How long a webhook call may take by default, connection and answer included: 10 s.
const DEFAULT_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// The headers this publisher sets, which replace any of the same name in a message.
const OWN_HEADERS: [&str; 4] = [
    crate::key::HEADER_NAME,
    ID_HEADER,
    TIMESTAMP_HEADER,
    SIGNATURE_HEADER,
];

/// POSTs each delivery to its destination URL as a [Standard Webhooks](https://www.standardwebhooks.com/)
/// sender does: the payload as the body, the message's headers, and
///
/// - `Idempotency-Key` and `webhook-id`: the delivery's id, the same on every try, so that the
///   receiver ([`crate::webhook`] and an idempotent route, or any Standard Webhooks receiver)
///   applies it once;
/// - `webhook-timestamp`: this try's time, integer seconds;
/// - `webhook-signature`: `v1,<base64>`, the HMAC-SHA256 of `{id}.{timestamp}.{body}` with the
///   endpoint's secret ([`StandardWebhooks::sign`]).
///
/// Redirects are never followed (a webhook's signature and body are for the URL it was
/// registered at). Each call is bounded by a timeout (10 s by default, [`WebhookPublisherBuilder::timeout`]); keep it well
/// under the relay's lease.
///
/// # What an answer means
///
/// | answer | outcome |
/// | --- | --- |
/// | 2xx | delivered |
/// | 409, 429, 503 | retried, after `Retry-After` when it is given (seconds or an HTTP date; a date already past leaves the relay's backoff) |
/// | 408, any other 5xx, a timeout, a connection refused or reset | retried after the relay's backoff |
/// | 3xx | permanent: redirects are not followed; register the final URL |
/// | any other 4xx (400, 401, 403, 404, 410, 422, …) | permanent: the receiver refused this message, or the endpoint is gone or not authorised, and sending it again gets the same answer |
/// | a destination that is not an `http(s)` URL, an id containing `.` | permanent |
///
/// A permanent failure dead-letters the message at once, with the answer as its last error,
/// for an operator to [`retry`](super::PostgresOutbox::retry) once the endpoint is mended or
/// [`discard`](super::PostgresOutbox::discard).
///
/// # Transport
///
/// HTTP/1.1 over plain TCP: the crate turns on none of reqwest's optional features. For
/// `https` destinations, HTTP/2 or proxies, depend on reqwest 0.13 yourself with the features
/// you want (`reqwest = { version = "0.13", features = ["rustls"] }`; Cargo merges them) and,
/// for settings of your own, pass your `reqwest::ClientBuilder` to
/// [`WebhookPublisherBuilder::client`]. Without TLS, an `https` call fails with "scheme is not
/// http" and is retried: a build with TLS then delivers it, no operator needed.
///
/// An id containing `.` is refused: it would make the signed `{id}.{timestamp}.{body}`
/// ambiguous, and this crate's verifier rejects it.
///
/// A relay from PostgreSQL; over a `MySqlOutbox` the publisher is the same.
///
#[cfg_attr(feature = "postgres", doc = "```no_run")]
#[cfg_attr(not(feature = "postgres"), doc = "```ignore")]
/// use std::time::Duration;
/// use idempotent_runtime::outbox::{Message, PostgresOutbox, Relay, WebhookPublisher};
/// use idempotent_runtime::webhook::StandardWebhooks;
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let signer = StandardWebhooks::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
/// let publisher = WebhookPublisher::builder(signer)
///     .timeout(Duration::from_secs(5))
///     .build()?;
/// let outbox = PostgresOutbox::new(pool.clone());
///
/// let mut tx = pool.begin().await?;
/// let event = Message::new("order-42-paid", "http://partner.example/hooks", r#"{"order":42}"#)
///     .header("content-type", "application/json");
/// let _ = outbox.enqueue(&mut tx, event).await?;
/// tx.commit().await?;
///
/// let relay = Relay::new(outbox, publisher);
/// relay.run_until(async { tokio::signal::ctrl_c().await.unwrap_or(()) }).await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct WebhookPublisher {
    client: reqwest::Client,
    signer: StandardWebhooks,
    timeout: Duration,
}

/// Configures a [`WebhookPublisher`]; from [`WebhookPublisher::builder`].
#[must_use]
pub struct WebhookPublisherBuilder {
    client: reqwest::ClientBuilder,
    signer: StandardWebhooks,
    timeout: Duration,
}

impl WebhookPublisher {
    /// A publisher signing with `signer`'s first secret, with the default timeout and client.
    ///
    /// # Panics
    ///
    /// When reqwest cannot build its client (as `reqwest::Client::new` does); use
    /// [`builder`](Self::builder) to handle that.
    pub fn new(signer: StandardWebhooks) -> Self {
        Self::builder(signer)
            .build()
            .expect("reqwest builds a client without TLS")
    }

    /// Configures a publisher signing with `signer`'s first secret.
    pub fn builder(signer: StandardWebhooks) -> WebhookPublisherBuilder {
        WebhookPublisherBuilder {
            client: reqwest::Client::builder(),
            signer,
            timeout: DEFAULT_WEBHOOK_TIMEOUT,
        }
    }
}

impl WebhookPublisherBuilder {
    /// How long one call may take, connecting and receiving the answer's head included
    /// (default 10 s). A call still running then is abandoned and retried.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The application's own reqwest settings (TLS roots, proxies, a user agent, a connect
    /// timeout). Redirects are turned off whatever it says.
    pub fn client(mut self, client: reqwest::ClientBuilder) -> Self {
        self.client = client;
        self
    }

    /// The publisher; an `Err` when reqwest cannot build the client (its TLS backend failed).
    pub fn build(self) -> Result<WebhookPublisher, reqwest::Error> {
        Ok(WebhookPublisher {
            client: self
                .client
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
            signer: self.signer,
            timeout: self.timeout,
        })
    }
}

impl fmt::Debug for WebhookPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookPublisher")
            .field("signer", &self.signer)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for WebhookPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookPublisherBuilder")
            .field("signer", &self.signer)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Publisher for WebhookPublisher {
    async fn publish(&self, delivery: &Delivery) -> Result<(), PublishError> {
        let id = delivery.id();
        let what = format!(
            "webhook POST of outbox message {id} to {}",
            endpoint(delivery)
        );
        if id.contains('.') {
            return Err(PublishError::permanent(format!(
                "{what}: the id contains `.`, which Standard Webhooks signatures cannot carry \
                 unambiguously; not sent"
            )));
        }
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        let signature = self.signer.sign(id, timestamp, delivery.payload());
        let mut request = self
            .client
            .post(delivery.destination())
            .timeout(self.timeout);
        for (name, value) in delivery.headers() {
            if !OWN_HEADERS.iter().any(|own| name.eq_ignore_ascii_case(own)) {
                request = request.header(name, value);
            }
        }
        let response = request
            .header("Idempotency-Key", idempotency_key(id))
            .header(ID_HEADER, id)
            .header(TIMESTAMP_HEADER, timestamp.to_string())
            .header(SIGNATURE_HEADER, signature)
            .body(delivery.payload().clone())
            .send()
            .await
            .map_err(|e| {
                let permanent = e.is_builder();
                let e = Chain(e.without_url());
                let detail = if e.0.is_timeout() {
                    format!("no answer within {:?}: {e}; retried", self.timeout)
                } else if permanent {
                    format!("{e}; not sent, not retried (is the destination an http(s) URL?)")
                } else {
                    format!("{e}; retried")
                };
                let message = format!("{what}: {detail}");
                if permanent {
                    PublishError::permanent(message)
                } else {
                    PublishError::retry(message)
                }
            })?;
        outcome(
            response.status(),
            response.headers().get(RETRY_AFTER),
            SystemTime::now(),
        )
        .map_err(|(kind, detail)| kind.error(format!("{what}: {detail}")))
    }
}

/// An error and its sources, `: `-separated (reqwest's own says only "error sending request").
struct Chain<E>(E);

impl<E: std::error::Error> fmt::Display for Chain<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

/// Scheme, host, port and path of the destination: never its query, which may carry a token.
fn endpoint(delivery: &Delivery) -> String {
    match reqwest::Url::parse(delivery.destination()) {
        Ok(url) => format!(
            "{}://{}{}{}",
            url.scheme(),
            url.host_str().unwrap_or(""),
            url.port().map(|p| format!(":{p}")).unwrap_or_default(),
            url.path()
        ),
        Err(_) => "a destination that is not a URL".into(),
    }
}

/// The id as an `Idempotency-Key` value: bare, as most clients send it, unless a receiver
/// would read it otherwise (a leading `"` or a `,`), then a Structured-Field string.
fn idempotency_key(id: &str) -> String {
    if id.starts_with('"') || id.contains(',') {
        let mut quoted = String::with_capacity(id.len() + 2);
        quoted.push('"');
        for c in id.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        quoted
    } else {
        id.to_owned()
    }
}

/// How a failed call is to be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Permanent,
    Retry,
    RetryAfter(Duration),
}

impl Failure {
    fn error(self, message: String) -> PublishError {
        match self {
            Self::Permanent => PublishError::permanent(message),
            Self::Retry => PublishError::retry(message),
            Self::RetryAfter(after) => PublishError::retry_after(after, message),
        }
    }
}

/// What an answer means (the table in [`WebhookPublisher`]'s documentation).
fn outcome(
    status: StatusCode,
    retry_after: Option<&HeaderValue>,
    now: SystemTime,
) -> Result<(), (Failure, String)> {
    if status.is_success() {
        return Ok(());
    }
    let answered = format!("answered {status}");
    Err(match status.as_u16() {
        409 | 429 | 503 => match retry_after.and_then(|v| parse_retry_after(v, now)) {
            Some(after) => (
                Failure::RetryAfter(after),
                format!("{answered}; retried after its Retry-After ({after:?})"),
            ),
            None => (Failure::Retry, format!("{answered}; retried")),
        },
        300..=399 => (
            Failure::Permanent,
            format!("{answered}; redirects are not followed: register the final URL; not retried"),
        ),
        408 => (Failure::Retry, format!("{answered}; retried")),
        400..=499 => (
            Failure::Permanent,
            format!("{answered}: the receiver refused the message; not retried"),
        ),
        _ => (Failure::Retry, format!("{answered}; retried")),
    })
}

/// `Retry-After` as delay-seconds or an HTTP date (RFC 9110 §10.2.3); `None` when it is
/// neither, or a date already past.
fn parse_retry_after(value: &HeaderValue, now: SystemTime) -> Option<Duration> {
    let value = value.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    at.duration_since(now).ok().filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::Message;

    fn status(code: u16) -> StatusCode {
        StatusCode::from_u16(code).unwrap()
    }

    fn failure(code: u16, retry_after: Option<&str>) -> Option<Failure> {
        let header = retry_after.map(|v| HeaderValue::from_str(v).unwrap());
        outcome(status(code), header.as_ref(), SystemTime::UNIX_EPOCH)
            .err()
            .map(|(f, _)| f)
    }

    #[test]
    fn success_is_any_2xx() {
        for code in [200, 201, 202, 204] {
            assert_eq!(failure(code, None), None, "{code}");
        }
    }

    #[test]
    fn conflict_throttle_and_unavailable_honour_retry_after() {
        for code in [409, 429, 503] {
            assert_eq!(
                failure(code, Some("7")),
                Some(Failure::RetryAfter(Duration::from_secs(7)))
            );
            assert_eq!(failure(code, None), Some(Failure::Retry));
            assert_eq!(failure(code, Some("soon")), Some(Failure::Retry));
        }
        // An HTTP date, 90 s after the (test's) now.
        assert_eq!(
            failure(503, Some("Thu, 01 Jan 1970 00:01:30 GMT")),
            Some(Failure::RetryAfter(Duration::from_secs(90)))
        );
        // The obsolete RFC 850 form too.
        assert_eq!(
            failure(429, Some("Thursday, 01-Jan-70 00:00:05 GMT")),
            Some(Failure::RetryAfter(Duration::from_secs(5)))
        );
    }

    #[test]
    fn a_retry_after_date_already_past_leaves_the_backoff() {
        let header = HeaderValue::from_static("Thu, 01 Jan 1970 00:01:30 GMT");
        let later = SystemTime::UNIX_EPOCH + Duration::from_secs(3600);
        assert_eq!(parse_retry_after(&header, later), None);
    }

    #[test]
    fn other_server_errors_and_request_timeout_are_retried() {
        for code in [408, 500, 502, 504, 507] {
            assert_eq!(failure(code, Some("7")), Some(Failure::Retry), "{code}");
        }
    }

    #[test]
    fn refusals_and_redirects_are_permanent() {
        for code in [
            300, 301, 302, 303, 307, 308, 400, 401, 403, 404, 405, 410, 413, 422,
        ] {
            assert_eq!(failure(code, Some("7")), Some(Failure::Permanent), "{code}");
        }
    }

    #[test]
    fn the_idempotency_key_is_bare_unless_it_would_be_misread() {
        assert_eq!(idempotency_key("order-42-paid"), "order-42-paid");
        assert_eq!(idempotency_key("a,b"), r#""a,b""#);
        assert_eq!(idempotency_key(r#""q\"#), r#""\"q\\""#);
        for id in ["order-42-paid", "a,b", r#""q\"#] {
            let parsed = crate::key::parse_value(idempotency_key(id).as_bytes()).unwrap();
            assert_eq!(parsed.as_str(), id);
        }
    }

    #[test]
    fn errors_name_the_endpoint_but_never_its_query() {
        let d = Delivery::new(
            Message::new("m", "http://hooks.example:8080/in?token=secret", ""),
            1,
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(endpoint(&d), "http://hooks.example:8080/in");
    }
}
