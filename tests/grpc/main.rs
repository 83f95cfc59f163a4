//! gRPC on tonic (#30): the contract over a real tonic client and server on loopback, the
//! conformance service (src/grpc.rs) behind `idempotent_runtime::tonic::IdempotencyLayer`.
//!
//! - `calls`: replay (status, metadata, message and trailers byte for byte), 16 concurrent
//!   duplicates, reuse, the refusals and their details, released statuses, a cancelled call and
//!   one past its deadline, streaming methods, compressed messages — on the memory store;
//! - `stores`: the same guarantees on PostgreSQL (also behind the cache), Redis and SQLite, and
//!   two replicas sharing PostgreSQL or Redis, 1,000 keys × 8 duplicates (skipped without them,
//!   as the other groups do);
//! - `server`: the `conformance_grpc` and `orders_grpc` examples as processes.

#[path = "../support/mod.rs"]
mod support;

mod calls;
mod server;
#[cfg(any(feature = "postgres", feature = "redis", feature = "sqlite"))]
mod stores;

use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::Pin;

use bytes::Bytes;
use http_body::Body as _;
use idempotent_examples::grpc::{AuthLayer, Client, Conformance};
use idempotent_runtime::store::memory::MemoryStore;
use idempotent_runtime::test_helpers::tonic::RpcStatus;
use idempotent_runtime::tonic::IdempotencyLayer;
use idempotent_runtime::{Idempotency, config::Config};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

/// A handle on a fresh memory store, with strict mode off: the tests of this binary each run a
/// server of their own in one process, which strict mode would take for a setup mistake.
pub fn memory() -> Idempotency {
    let config = Config::builder().strict(false).build();
    Idempotency::builder(MemoryStore::builder().build())
        .config(config)
        .build()
}

/// A tonic server on a free loopback port: the identity layer, then `layer` around `service`.
/// Its task ends with the test's runtime.
pub async fn serve<S>(layer: IdempotencyLayer, service: S) -> SocketAddr
where
    S: tower_service::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let server = Server::builder()
        .layer(AuthLayer)
        .layer(layer)
        .add_service(service)
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)));
    tokio::spawn(async move { server.await.expect("the test server serves") });
    addr
}

/// The conformance service behind its layer over `idempotency`.
pub async fn conformance(idempotency: Idempotency) -> (SocketAddr, Client) {
    let layer = Conformance::idempotency_layer(idempotency);
    let addr = serve(
        layer,
        Conformance::new(idempotent_examples::conformance::RunLog::from_env()),
    )
    .await;
    let client = Client::connect(format!("http://{addr}"))
        .await
        .expect("connect to the test server");
    (addr, client)
}

/// How many times `method`'s handler really ran.
pub async fn runs(client: &mut Client, method: &str) -> u64 {
    let reply: tonic::Response<idempotent_examples::grpc::ExecutionsReply> = client
        .call(
            "Executions",
            tonic::Request::new(idempotent_examples::grpc::Empty {}),
        )
        .await
        .expect("Executions answers");
    reply.into_inner().executions[method]
}

/// Asserts `status` is the refusal `code` with the crate's stable `reason`: the code at the
/// start of `grpc-message`, and a `google.rpc.ErrorInfo` in the details.
pub fn assert_refusal(status: &tonic::Status, code: tonic::Code, reason: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().starts_with(reason),
        "grpc-message {:?} names {reason}",
        status.message()
    );
    let details = RpcStatus::from_status(status).expect("google.rpc.Status details");
    assert_eq!(details.code, code as i32);
    let info = details.error_info().expect("google.rpc.ErrorInfo");
    assert_eq!(info.reason, reason);
    assert_eq!(info.domain, "idempotent-runtime");
}

/// Whether a response's metadata says it is a replay.
pub fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get("idempotency-replayed").map(|v| v.as_bytes()) == Some(b"true")
}

/// A raw answer: status, headers, the body's bytes and its trailers.
pub struct Raw {
    pub headers: http::HeaderMap,
    pub body: Bytes,
    pub trailers: Option<http::HeaderMap>,
}

/// One unary call over HTTP/2 as bytes: `message` framed, `headers` beside the gRPC ones.
pub async fn raw_call(
    addr: SocketAddr,
    path: &str,
    message: &[u8],
    headers: &[(&str, &str)],
) -> Raw {
    raw_frames(addr, path, &[message], headers).await
}

/// A call over HTTP/2 as bytes whose body is `messages`, each in a frame of its own.
pub async fn raw_frames(
    addr: SocketAddr,
    path: &str,
    messages: &[&[u8]],
    headers: &[(&str, &str)],
) -> Raw {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut framed = Vec::new();
    for message in messages {
        framed.push(0);
        framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
        framed.extend_from_slice(message);
    }
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = tonic::body::Body::new(http_body_util::Full::new(Bytes::from(framed)));
    let request = request.body(body).expect("request");
    let mut channel = channel;
    poll_fn(|cx| tower_service::Service::poll_ready(&mut channel, cx))
        .await
        .expect("ready");
    let response = tower_service::Service::call(&mut channel, request)
        .await
        .expect("an answer");
    let (parts, mut body) = response.into_parts();
    let mut data = Vec::new();
    let mut trailers = None;
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.expect("a whole body");
        match frame.into_data() {
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(frame) => trailers = frame.into_trailers().ok(),
        }
    }
    Raw {
        headers: parts.headers,
        body: Bytes::from(data),
        trailers,
    }
}
