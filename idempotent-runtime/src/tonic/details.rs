//! The `google.rpc` messages a refusal carries in its `grpc-status-details-bin`, written with
//! prost's derive (the three messages and the two well-known types they use, field for field as
//! `google/rpc/status.proto`, `google/rpc/error_details.proto`, `google/protobuf/any.proto` and
//! `google/protobuf/duration.proto` declare them), so a client decodes them with any protobuf
//! library, or with these types.

use std::collections::HashMap;

use bytes::Bytes;
use prost::Message as _;

/// The domain of every refusal's [`ErrorInfo`]: this crate's name.
pub const ERROR_DOMAIN: &str = "idempotent-runtime";

const ERROR_INFO_URL: &str = "type.googleapis.com/google.rpc.ErrorInfo";
const RETRY_INFO_URL: &str = "type.googleapis.com/google.rpc.RetryInfo";

/// `google.rpc.Status`: what `grpc-status-details-bin` holds.
#[derive(Clone, PartialEq, prost::Message)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct RpcStatus {
    /// The status code (`google.rpc.Code`, the same numbers as `grpc-status`).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// The developer-facing message, as in `grpc-message`.
    #[prost(string, tag = "2")]
    pub message: String,
    /// The details: an [`ErrorInfo`], and for a refusal worth retrying a [`RetryInfo`].
    #[prost(message, repeated, tag = "3")]
    pub details: Vec<Any>,
}

/// `google.protobuf.Any`: a message and the URL of its type.
#[derive(Clone, PartialEq, prost::Message)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct Any {
    /// `type.googleapis.com/<full message name>`.
    #[prost(string, tag = "1")]
    pub type_url: String,
    /// The encoded message.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `google.rpc.ErrorInfo`: why a call was refused, as a stable machine-readable `reason` (the
/// crate's code, e.g. `IDEMPOTENCY_IN_PROGRESS`) within `domain` ([`ERROR_DOMAIN`]).
#[derive(Clone, PartialEq, prost::Message)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct ErrorInfo {
    /// The stable code ([`ProblemCode::as_str`](crate::problem::ProblemCode::as_str)).
    #[prost(string, tag = "1")]
    pub reason: String,
    /// [`ERROR_DOMAIN`].
    #[prost(string, tag = "2")]
    pub domain: String,
    /// Nothing this crate sets; kept so the message decodes whole.
    #[prost(map = "string, string", tag = "3")]
    pub metadata: HashMap<String, String>,
}

/// `google.rpc.RetryInfo`: how long to wait before retrying (a call in progress, a store
/// unavailable): the HTTP answer's `Retry-After`.
#[derive(Clone, PartialEq, prost::Message)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct RetryInfo {
    /// The delay.
    #[prost(message, optional, tag = "1")]
    pub retry_delay: Option<ProtoDuration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct ProtoDuration {
    /// Whole seconds.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds past `seconds`.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
#[cfg_attr(
    not(any(test, feature = "testing")),
    allow(dead_code, reason = "decoding is for the tests, through test_helpers")
)]
impl RpcStatus {
    /// The status a `tonic::Status`'s details hold; `None` when it has none or they are not a
    /// `google.rpc.Status`.
    pub fn from_status(status: &::tonic::Status) -> Option<Self> {
        let details = status.details();
        if details.is_empty() {
            return None;
        }
        Self::decode(details).ok()
    }

    /// The first detail of the [`ErrorInfo`] type.
    pub fn error_info(&self) -> Option<ErrorInfo> {
        self.unpack(ERROR_INFO_URL)
    }

    /// The first detail of the [`RetryInfo`] type.
    pub fn retry_info(&self) -> Option<RetryInfo> {
        self.unpack(RETRY_INFO_URL)
    }

    fn unpack<M: prost::Message + Default>(&self, url: &str) -> Option<M> {
        let any = self.details.iter().find(|any| any.type_url == url)?;
        M::decode(&any.value[..]).ok()
    }
}

/// The details of a refusal: `google.rpc.Status` with an `ErrorInfo` (`reason` = `code`) and,
/// when the refusal says when to retry, a `RetryInfo`.
pub(super) fn refusal_details(
    code: i32,
    message: &str,
    reason: &str,
    retry_after: Option<u64>,
) -> Bytes {
    let info = ErrorInfo {
        reason: reason.to_owned(),
        domain: ERROR_DOMAIN.to_owned(),
        metadata: HashMap::new(),
    };
    let mut details = vec![Any {
        type_url: ERROR_INFO_URL.to_owned(),
        value: info.encode_to_vec(),
    }];
    if let Some(seconds) = retry_after {
        let retry = RetryInfo {
            retry_delay: Some(ProtoDuration {
                seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
                nanos: 0,
            }),
        };
        details.push(Any {
            type_url: RETRY_INFO_URL.to_owned(),
            value: retry.encode_to_vec(),
        });
    }
    let status = RpcStatus {
        code,
        message: message.to_owned(),
        details,
    };
    Bytes::from(status.encode_to_vec())
}
