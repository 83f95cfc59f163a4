//! gRPC services on [tonic](https://docs.rs/tonic) 0.14 (feature `tonic`): the contract for
//! unary methods, through a tower layer put on the server ([`IdempotencyLayer`]).
//!
//! What changes from HTTP is only the wire ([the contract](crate::design) §1, gRPC):
//!
//! - **Key**: the `idempotency-key` metadata entry (the key header setting applies).
//! - **Scope**: the [`Identity`](crate::scope::Identity) a tower layer outside this one put in the
//!   request extensions (an auth layer added to the server *before* this one), else the peer
//!   address of the connection (`TcpConnectInfo`).
//! - **Fingerprint**: `POST`, the method path `/package.Service/Method` as the route, the
//!   `content-type` as received, the identity, and the request *message*: the body with its
//!   5-byte gRPC frame header removed and, when the compressed flag is set under
//!   `grpc-encoding: gzip`, inflated. The same message sent compressed and uncompressed is
//!   the same request. `max_body` counts the same bytes. A message compressed in another
//!   encoding is refused (`INVALID_ARGUMENT`, `IDEMPOTENCY_BODY_INVALID`).
//! - **Recorded**: an answer whose gRPC status the method records (by
//!   default: `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `FAILED_PRECONDITION`,
//!   `OUT_OF_RANGE`; [`MethodConfig::recorded_codes`] changes it) and whose message fits
//!   `max_response`: its metadata through the allowlist (`recorded_headers`), the message
//!   (inflated if the server compressed it), and its trailers (`grpc-status`, `grpc-message`
//!   and `grpc-status-details-bin` always, others through the same allowlist). Every other
//!   status, and an answer past `max_response` (counted with its 5-byte frame header),
//!   releases the key, whatever `oversized` says: a gRPC answer without its message is no
//!   answer. A replay carries `idempotency-replayed: true` in its metadata.
//! - **Refusals** are trailers-only gRPC statuses whose `grpc-message` is
//!   `<CODE>: <detail>` and whose details are a `google.rpc.Status` (read it with
//!   `tonic-types`' `StatusExt`) holding a `google.rpc.ErrorInfo` (`reason` = the code, `domain` = [`ERROR_DOMAIN`]):
//!
//!   | refusal | gRPC status |
//!   |---|---|
//!   | in progress (`IDEMPOTENCY_IN_PROGRESS`) | `ABORTED`, with `google.rpc.RetryInfo` |
//!   | key reused (`IDEMPOTENCY_KEY_REUSED`) | `FAILED_PRECONDITION` |
//!   | key missing or invalid, message unreadable | `INVALID_ARGUMENT` |
//!   | too large (`IDEMPOTENCY_PAYLOAD_TOO_LARGE`) | `RESOURCE_EXHAUSTED` |
//!   | message slower than `body_timeout` | `DEADLINE_EXCEEDED` |
//!   | store unavailable or full | `UNAVAILABLE`, with `google.rpc.RetryInfo` |
//!   | scope unresolved, handler panicked, misconfigured | `INTERNAL` |
//!
//! - **Streaming** methods are never claimed: leave them out of a listed service with
//!   [`IdempotencyLayer::except`]. A listed method seen streaming (a second request or answer
//!   message) is said once in the log with that fix; its call is refused
//!   (`INVALID_ARGUMENT`) or, when the answer streams, passed on unrecorded.
//! - A claimed handler runs to its end when the client cancels the call; the retry is a replay.
//!
//! Enlisted mode is not offered on gRPC: a tonic handler has no parameter the runtime could
//! hand a transaction through.

pub(crate) mod details;
mod layer;
mod reply;
mod request;

pub use details::ERROR_DOMAIN;
pub use layer::{IdempotencyLayer, IdempotencyService, MethodConfig};
