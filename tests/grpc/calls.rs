//! The contract over gRPC on the memory store.

use std::convert::Infallible;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Body as _;
use idempotent_examples::grpc::{
    BigReply, BigRequest, Client, Empty, ExecutionReply, NoteRequest, OrderReply, OrderRequest,
    SlowRequest, StatusRequest, WatchRequest, keyed,
};
use idempotent_runtime::config::EndpointConfig;
use idempotent_runtime::test_helpers::tonic::RpcStatus;
use idempotent_runtime::tonic::IdempotencyLayer;
use prost::Message as _;
use tonic::{Code, Request};

use crate::{assert_refusal, conformance, memory, raw_call, raw_frames, replayed, runs, serve};

fn order(sku: &str, quantity: i64) -> OrderRequest {
    OrderRequest {
        sku: sku.into(),
        quantity,
    }
}

/// A service written at the HTTP level, as tonic's generated code answers: metadata in the
/// headers, the message, then trailers with `grpc-status` and a trailer of its own.
#[derive(Clone, Default)]
struct Receipts {
    runs: Arc<AtomicU64>,
}

impl tonic::server::NamedService for Receipts {
    const NAME: &'static str = "test.v1.Receipts";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Receipts {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let runs = Arc::clone(&self.runs);
        Box::pin(async move {
            let mut body = request.into_body();
            while poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
                .await
                .is_some()
            {}
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let message = format!("receipt {n}");
            let mut framed = vec![0];
            framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
            framed.extend_from_slice(message.as_bytes());
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().expect("value"));
            trailers.insert("x-checksum", format!("sum-{n}").parse().expect("value"));
            trailers.insert("x-unlisted", "dropped".parse().expect("value"));
            let frames = futures_util::stream::iter([
                Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(framed))),
                Ok(http_body::Frame::trailers(trailers)),
            ]);
            let body = tonic::body::Body::new(http_body_util::StreamBody::new(frames));
            let response = http::Response::builder()
                .header("content-type", "application/grpc")
                .header("x-receipt", n.to_string())
                .body(body)
                .expect("response");
            Ok(response)
        })
    }
}

#[tokio::test]
async fn replays_status_metadata_message_and_trailers_byte_for_byte() {
    let receipts = Receipts::default();
    let endpoint =
        EndpointConfig::REQUIRED.recorded_headers(&["content-type", "x-receipt", "x-checksum"]);
    let layer = IdempotencyLayer::new(memory()).method("/test.v1.Receipts/Issue", endpoint);
    let addr = serve(layer, receipts.clone()).await;
    let path = "/test.v1.Receipts/Issue";
    let key = [("idempotency-key", "receipt-1")];
    let first = raw_call(addr, path, b"issue", &key).await;
    let replay = raw_call(addr, path, b"issue", &key).await;
    assert_eq!(
        receipts.runs.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );

    assert_eq!(
        first.body, replay.body,
        "the message, framed, byte for byte"
    );
    assert_eq!(&first.body[5..], b"receipt 1");
    assert_eq!(first.headers.get("idempotency-replayed"), None);
    assert_eq!(replay.headers["idempotency-replayed"], "true");
    for name in ["content-type", "x-receipt"] {
        assert_eq!(first.headers.get(name), replay.headers.get(name), "{name}");
    }
    assert_eq!(replay.headers["x-receipt"], "1");
    let (first, replay) = (
        first.trailers.expect("trailers"),
        replay.trailers.expect("trailers"),
    );
    assert_eq!(first["grpc-status"], "0");
    assert_eq!(first["x-checksum"], "sum-1");
    assert_eq!(
        first["x-unlisted"], "dropped",
        "the first answer carries every trailer"
    );
    assert_eq!(replay["grpc-status"], first["grpc-status"]);
    assert_eq!(replay["x-checksum"], first["x-checksum"]);
    assert_eq!(
        replay.get("x-unlisted"),
        None,
        "a trailer off the allowlist is not kept"
    );

    // The same key with another message is refused, and the handler does not run.
    let reused = raw_call(addr, path, b"another", &key).await;
    assert_eq!(
        reused.headers["grpc-status"],
        (Code::FailedPrecondition as i32).to_string()
    );
    assert_eq!(receipts.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_recorded_error_status_replays_with_its_message_and_metadata() {
    let (_, mut client) = conformance(memory()).await;
    let call = |c: &mut Client| {
        let mut c = c.clone();
        async move {
            c.call::<_, OrderReply>("Order", keyed(order("book", 0), "bad-1"))
                .await
        }
    };
    let first = call(&mut client).await.expect_err("INVALID_ARGUMENT");
    let replay = call(&mut client).await.expect_err("INVALID_ARGUMENT again");
    assert_eq!(first.code(), Code::InvalidArgument);
    assert_eq!(first.message(), "quantity must be positive");
    assert_eq!(replay.code(), first.code());
    assert_eq!(replay.message(), first.message());
    assert_eq!(
        replay.metadata().get("x-execution"),
        first.metadata().get("x-execution")
    );
    assert!(!replayed(first.metadata()));
    assert!(replayed(replay.metadata()));
    assert_eq!(runs(&mut client, "Order").await, 1);
}

#[tokio::test]
async fn an_ok_answer_replays_with_its_recorded_metadata_only() {
    let (_, mut client) = conformance(memory()).await;
    let first = client
        .call::<_, OrderReply>("Order", keyed(order("book", 2), "order-1"))
        .await
        .expect("OK");
    let replay = client
        .call::<_, OrderReply>("Order", keyed(order("book", 2), "order-1"))
        .await
        .expect("OK again");
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(first.get_ref().execution, 1);
    let (m1, m2) = (first.metadata(), replay.metadata());
    assert_eq!(m2.get("location"), m1.get("location"));
    assert_eq!(m2.get("x-execution"), m1.get("x-execution"));
    assert_eq!(
        m1.get("set-cookie").map(|v| v.as_bytes()),
        Some(&b"seen=1"[..])
    );
    assert_eq!(m2.get("set-cookie"), None, "set-cookie is never recorded");
    assert!(!replayed(m1) && replayed(m2));
    assert_eq!(runs(&mut client, "Order").await, 1);
}

#[tokio::test]
async fn sixteen_concurrent_duplicates_run_once_and_the_rest_are_aborted() {
    let (_, client) = conformance(memory()).await;
    let calls = (0..16).map(|_| {
        let mut client = client.clone();
        tokio::spawn(async move {
            client
                .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 400 }, "slow-1"))
                .await
        })
    });
    let results = futures_util::future::join_all(calls).await;
    let (mut ok, mut aborted) = (0, 0);
    for result in results {
        match result.expect("the call's task") {
            Ok(reply) => {
                assert_eq!(reply.get_ref().execution, 1);
                ok += 1;
            }
            Err(status) => {
                assert_refusal(&status, Code::Aborted, "IDEMPOTENCY_IN_PROGRESS");
                let details = RpcStatus::from_status(&status).expect("details");
                let retry = details.retry_info().expect("google.rpc.RetryInfo");
                let delay = retry.retry_delay.expect("a delay");
                assert!(delay.seconds >= 1, "{delay:?}");
                aborted += 1;
            }
        }
    }
    assert_eq!((ok, aborted), (1, 15));
    let mut client = client;
    assert_eq!(runs(&mut client, "Slow").await, 1);
}

#[tokio::test]
async fn a_reused_key_is_failed_precondition() {
    let (_, mut client) = conformance(memory()).await;
    client
        .call::<_, OrderReply>("Order", keyed(order("book", 1), "reuse-1"))
        .await
        .expect("OK");
    let reused = client
        .call::<_, OrderReply>("Order", keyed(order("pen", 1), "reuse-1"))
        .await
        .expect_err("refused");
    assert_refusal(&reused, Code::FailedPrecondition, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(runs(&mut client, "Order").await, 1);
}

#[tokio::test]
async fn a_missing_or_invalid_key_is_invalid_argument_and_an_optional_one_passes() {
    let (_, mut client) = conformance(memory()).await;
    let missing = client
        .call::<_, OrderReply>("Order", Request::new(order("book", 1)))
        .await
        .expect_err("refused");
    assert_refusal(&missing, Code::InvalidArgument, "IDEMPOTENCY_KEY_REQUIRED");
    let invalid = client
        .call::<_, OrderReply>("Order", keyed(order("book", 1), "a,b"))
        .await
        .expect_err("refused");
    assert_refusal(&invalid, Code::InvalidArgument, "IDEMPOTENCY_KEY_INVALID");
    assert_eq!(runs(&mut client, "Order").await, 0);
    // `Note` takes its key optionally: without one each call runs.
    for n in 1..=2 {
        let note = NoteRequest { text: "hi".into() };
        let reply = client
            .call::<_, ExecutionReply>("Note", Request::new(note))
            .await
            .expect("OK");
        assert_eq!(reply.get_ref().execution, n);
        assert!(!replayed(reply.metadata()));
    }
}

#[tokio::test]
async fn a_message_over_max_body_is_resource_exhausted() {
    let config = idempotent_runtime::config::Config::builder()
        .strict(false)
        .max_body(64)
        .build();
    let store = idempotent_runtime::store::memory::MemoryStore::builder().build();
    let handle = idempotent_runtime::Idempotency::builder(store)
        .config(config)
        .build();
    let (_, mut client) = conformance(handle).await;
    let big = order(&"x".repeat(100), 1);
    let refused = client
        .call::<_, OrderReply>("Order", keyed(big, "big-1"))
        .await
        .expect_err("refused");
    assert_refusal(
        &refused,
        Code::ResourceExhausted,
        "IDEMPOTENCY_PAYLOAD_TOO_LARGE",
    );
    // 62 bytes of message: under the cap, although its frame makes it 67 on the wire.
    let fits = order(&"x".repeat(58), 1);
    assert_eq!(fits.encoded_len(), 62);
    client
        .call::<_, OrderReply>("Order", keyed(fits, "big-2"))
        .await
        .expect("max_body counts the message, not its frame");
    assert_eq!(runs(&mut client, "Order").await, 1);
}

#[tokio::test]
async fn a_released_status_runs_again_and_a_recorded_one_does_not() {
    let (_, mut client) = conformance(memory()).await;
    for (code, key) in [
        (Code::Unavailable, "unavailable"),
        (Code::Internal, "internal"),
    ] {
        for n in 1..=2 {
            let request = keyed(StatusRequest { code: code as i32 }, key);
            let status = client
                .call::<_, ExecutionReply>("Status", request)
                .await
                .expect_err("the status asked for");
            assert_eq!(status.code(), code);
            assert!(!replayed(status.metadata()), "{code:?} is never replayed");
            assert!(status.message().starts_with("execution "), "{status:?}");
            let _ = n;
        }
    }
    assert_eq!(
        runs(&mut client, "Status").await,
        4,
        "each released call ran"
    );
    for _ in 0..2 {
        let request = keyed(
            StatusRequest {
                code: Code::NotFound as i32,
            },
            "not-found",
        );
        let status = client
            .call::<_, ExecutionReply>("Status", request)
            .await
            .expect_err("NOT_FOUND");
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "execution 5");
    }
    assert_eq!(
        runs(&mut client, "Status").await,
        5,
        "NOT_FOUND is recorded"
    );
}

#[tokio::test]
async fn a_panicking_handler_is_internal_and_its_key_runs_again() {
    let (_, mut client) = conformance(memory()).await;
    for _ in 0..2 {
        let status = client
            .call::<_, ExecutionReply>("Panic", keyed(Empty {}, "panic-1"))
            .await
            .expect_err("INTERNAL");
        assert_refusal(&status, Code::Internal, "IDEMPOTENCY_HANDLER_PANICKED");
    }
    assert_eq!(runs(&mut client, "Panic").await, 2);
}

#[tokio::test]
async fn a_cancelled_call_still_runs_to_its_end_and_its_retry_is_a_replay() {
    let (_, mut client) = conformance(memory()).await;
    let call = {
        let mut client = client.clone();
        async move {
            client
                .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 600 }, "cancel-1"))
                .await
        }
    };
    let cancelled = tokio::time::timeout(Duration::from_millis(150), call).await;
    assert!(cancelled.is_err(), "the client gave up mid-call");
    assert_eq!(runs(&mut client, "Slow").await, 0, "still running");
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(runs(&mut client, "Slow").await, 1, "the handler finished");
    let retry = client
        .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 600 }, "cancel-1"))
        .await
        .expect("the replay");
    assert_eq!(retry.get_ref().execution, 1);
    assert!(replayed(retry.metadata()));
    assert_eq!(runs(&mut client, "Slow").await, 1);
}

#[tokio::test]
async fn a_streaming_method_passes_through_untouched() {
    let (_, mut client) = conformance(memory()).await;
    for n in 1..=2 {
        let mut request = keyed(
            WatchRequest {
                count: 3,
                interval_ms: 10,
            },
            "watch-1",
        );
        request.metadata_mut().insert("x-n", n.into());
        let response = client.watch(request).await.expect("a stream");
        assert!(!replayed(response.metadata()));
        let mut stream = response.into_inner();
        let mut events = Vec::new();
        while let Some(event) = stream.message().await.expect("an event") {
            events.push(event);
        }
        assert_eq!(events.len(), 3);
        assert!(events.iter().all(|e| e.execution == n), "{events:?}");
    }
    assert_eq!(
        runs(&mut client, "Watch").await,
        2,
        "never claimed: both calls ran"
    );
}

#[tokio::test]
async fn a_compressed_and_an_uncompressed_message_are_the_same_request() {
    let (_, client) = conformance(memory()).await;
    let mut compressed = client.clone().compressed();
    // Long enough that tonic really compresses it.
    let message = order(&"compressible ".repeat(200), 3);
    let first = compressed
        .call::<_, OrderReply>("Order", keyed(message.clone(), "gzip-1"))
        .await
        .expect("OK");
    let mut plain = client;
    let replay = plain
        .call::<_, OrderReply>("Order", keyed(message.clone(), "gzip-1"))
        .await
        .expect("the replay, not a reuse");
    assert_eq!(replay.get_ref(), first.get_ref());
    assert!(replayed(replay.metadata()));
    let mut other = message;
    other.quantity = 4;
    let reused = compressed
        .call::<_, OrderReply>("Order", keyed(other, "gzip-1"))
        .await
        .expect_err("another message");
    assert_refusal(&reused, Code::FailedPrecondition, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(runs(&mut plain, "Order").await, 1);
}

#[tokio::test]
async fn two_callers_with_one_key_are_two_scopes() {
    let (_, mut client) = conformance(memory()).await;
    let as_caller = |who: &str| {
        let mut request = keyed(order("book", 1), "shared-key");
        let bearer = format!("Bearer acme:{who}").parse().expect("value");
        request.metadata_mut().insert("authorization", bearer);
        request
    };
    let alice = client
        .call::<_, OrderReply>("Order", as_caller("alice"))
        .await
        .expect("OK");
    let bob = client
        .call::<_, OrderReply>("Order", as_caller("bob"))
        .await
        .expect("OK");
    assert!(!replayed(bob.metadata()), "bob never gets alice's answer");
    assert_ne!(alice.get_ref().execution, bob.get_ref().execution);
    let again = client
        .call::<_, OrderReply>("Order", as_caller("alice"))
        .await
        .expect("OK");
    assert!(replayed(again.metadata()));
    assert_eq!(again.get_ref(), alice.get_ref());
    assert_eq!(runs(&mut client, "Order").await, 2);
    let mut malformed = keyed(order("book", 1), "k");
    malformed
        .metadata_mut()
        .insert("authorization", "Basic x".parse().expect("value"));
    let refused = client
        .call::<_, OrderReply>("Order", malformed)
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn an_answer_over_max_response_is_sent_whole_and_runs_again() {
    let config = idempotent_runtime::config::Config::builder()
        .strict(false)
        .max_response(1000)
        .build();
    let store = idempotent_runtime::store::memory::MemoryStore::builder().build();
    let handle = idempotent_runtime::Idempotency::builder(store)
        .config(config)
        .build();
    let (_, mut client) = conformance(handle).await;
    for _ in 0..2 {
        let reply = client
            .call::<_, BigReply>("Big", keyed(BigRequest { bytes: 5000 }, "big"))
            .await
            .expect("the whole answer");
        assert_eq!(reply.get_ref().data, vec![b'a'; 5000]);
        assert!(!replayed(reply.metadata()));
    }
    assert_eq!(
        runs(&mut client, "Big").await,
        2,
        "too large to keep: the key was released"
    );
    for _ in 0..2 {
        let reply = client
            .call::<_, BigReply>("Big", keyed(BigRequest { bytes: 500 }, "small"))
            .await
            .expect("OK");
        assert_eq!(reply.get_ref().data.len(), 500);
    }
    assert_eq!(
        runs(&mut client, "Big").await,
        3,
        "within max_response: recorded"
    );
}

#[tokio::test]
async fn a_listed_method_that_streams_is_passed_on_unrecorded() {
    // A setup mistake: `Watch` streams, and this layer lists it.
    let layer = IdempotencyLayer::new(memory()).method(
        &idempotent_examples::grpc::path("Watch"),
        EndpointConfig::REQUIRED,
    );
    let service = idempotent_examples::grpc::Conformance::new(
        idempotent_examples::conformance::RunLog::from_env(),
    );
    let addr = serve(layer, service).await;
    let mut client = Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    for n in 1..=2 {
        let request = keyed(
            WatchRequest {
                count: 3,
                interval_ms: 20,
            },
            "watch",
        );
        let response = client.watch(request).await.expect("a stream");
        let mut stream = response.into_inner();
        let mut events = Vec::new();
        while let Some(event) = stream.message().await.expect("an event") {
            events.push(event);
        }
        let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
        assert_eq!(sequences, [0, 1, 2], "every event, in order");
        assert!(events.iter().all(|e| e.execution == n));
    }
    assert_eq!(
        runs(&mut client, "Watch").await,
        2,
        "released, never replayed"
    );
}

#[tokio::test]
async fn a_call_past_its_deadline_still_runs_to_its_end_and_its_retry_is_a_replay() {
    let (_, mut client) = conformance(memory()).await;
    let mut request = keyed(SlowRequest { ms: 600 }, "deadline-1");
    request.set_timeout(Duration::from_millis(150));
    let late = client
        .call::<_, ExecutionReply>("Slow", request)
        .await
        .expect_err("past its deadline");
    assert!(
        matches!(late.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{late:?}"
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(runs(&mut client, "Slow").await, 1, "the handler finished");
    let retry = client
        .call::<_, ExecutionReply>("Slow", keyed(SlowRequest { ms: 600 }, "deadline-1"))
        .await
        .expect("the replay");
    assert_eq!(retry.get_ref().execution, 1);
    assert!(replayed(retry.metadata()));
}

#[tokio::test]
async fn a_listed_method_whose_client_streams_is_refused_and_never_runs() {
    let receipts = Receipts::default();
    let layer =
        IdempotencyLayer::new(memory()).method("/test.v1.Receipts/Issue", EndpointConfig::REQUIRED);
    let addr = serve(layer, receipts.clone()).await;
    let key = [("idempotency-key", "two-messages")];
    let answer = raw_frames(addr, "/test.v1.Receipts/Issue", &[b"one", b"two"], &key).await;
    assert_eq!(
        answer.headers["grpc-status"],
        (Code::InvalidArgument as i32).to_string()
    );
    let message = answer.headers["grpc-message"].to_str().expect("ASCII");
    assert!(message.starts_with("IDEMPOTENCY_BODY_INVALID"), "{message}");
    assert!(answer.body.is_empty(), "trailers-only");
    assert_eq!(
        receipts.runs.load(Ordering::SeqCst),
        0,
        "nothing ran, nothing was claimed"
    );
    // The same key with one message is a first call: the refusal claimed nothing.
    let one = raw_call(addr, "/test.v1.Receipts/Issue", b"one", &key).await;
    assert_eq!(one.trailers.expect("trailers")["grpc-status"], "0");
    assert_eq!(receipts.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_key_header_setting_names_the_metadata_entry() {
    let config = idempotent_runtime::config::Config::builder()
        .strict(false)
        .key_header("X-Request-Key")
        .build();
    let store = idempotent_runtime::store::memory::MemoryStore::builder().build();
    let handle = idempotent_runtime::Idempotency::builder(store)
        .config(config)
        .build();
    let (_, mut client) = conformance(handle).await;
    let with_key = || {
        let mut request = Request::new(order("book", 1));
        request
            .metadata_mut()
            .insert("x-request-key", "k-1".parse().expect("key"));
        request
    };
    let first = client
        .call::<_, OrderReply>("Order", with_key())
        .await
        .expect("OK");
    let replay = client
        .call::<_, OrderReply>("Order", with_key())
        .await
        .expect("OK");
    assert_eq!(replay.get_ref(), first.get_ref());
    assert!(replayed(replay.metadata()));
    let other_entry = client
        .call::<_, OrderReply>("Order", keyed(order("book", 1), "k-1"))
        .await
        .expect_err("idempotency-key is not this server's key entry");
    assert_refusal(
        &other_entry,
        Code::InvalidArgument,
        "IDEMPOTENCY_KEY_REQUIRED",
    );
    assert_eq!(runs(&mut client, "Order").await, 1);
}
