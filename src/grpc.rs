//! The gRPC conformance service (../shared/CONFORMANCE.md, "The gRPC conformance server"):
//! `conformance.v1.Conformance` as `examples/proto/conformance.proto` declares it, its
//! messages written with prost's derive and its routing by hand (what `tonic-build` would
//! generate, without a `protoc` at build time), the identity layer, and a small client the
//! tests call it through.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use idempotent_runtime::config::EndpointConfig;
use idempotent_runtime::tonic::{IdempotencyLayer, MethodConfig};
use tonic::codec::CompressionEncoding;
use tonic::server::{Grpc, NamedService, ServerStreamingService, UnaryService};
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::conformance::{Executions, RunLog, identity};

/// The service's full name.
pub const SERVICE: &str = "conformance.v1.Conformance";

/// `/conformance.v1.Conformance/<method>`.
pub fn path(method: &str) -> String {
    format!("/{SERVICE}/{method}")
}

/// `OrderRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OrderRequest {
    #[prost(string, tag = "1")]
    pub sku: String,
    #[prost(int64, tag = "2")]
    pub quantity: i64,
}

/// `OrderReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OrderReply {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(string, tag = "2")]
    pub sku: String,
    #[prost(int64, tag = "3")]
    pub quantity: i64,
    #[prost(uint64, tag = "4")]
    pub execution: u64,
}

/// `NoteRequest`: any text.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NoteRequest {
    #[prost(string, tag = "1")]
    pub text: String,
}

/// `ExecutionReply`: which run of the method answered.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExecutionReply {
    #[prost(uint64, tag = "1")]
    pub execution: u64,
}

/// `SlowRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SlowRequest {
    #[prost(uint64, tag = "1")]
    pub ms: u64,
}

/// `StatusRequest`: the gRPC status code to answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatusRequest {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

/// `BigRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BigRequest {
    #[prost(uint64, tag = "1")]
    pub bytes: u64,
}

/// `BigReply`: `bytes` bytes of `a`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BigReply {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
}

/// `Empty`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// `ExecutionsReply`: real runs per method name.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExecutionsReply {
    #[prost(map = "string, uint64", tag = "1")]
    pub executions: HashMap<String, u64>,
}

/// `WatchRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    #[prost(uint32, tag = "1")]
    pub count: u32,
    #[prost(uint64, tag = "2")]
    pub interval_ms: u64,
}

/// `WatchEvent`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchEvent {
    #[prost(uint64, tag = "1")]
    pub sequence: u64,
    #[prost(uint64, tag = "2")]
    pub execution: u64,
}

/// The methods counted in `Executions`, by name.
pub const METHODS: [&str; 7] = ["Order", "Note", "Slow", "Status", "Big", "Panic", "Watch"];

/// The conformance service: one counter per method, the run log.
#[derive(Clone)]
pub struct Conformance {
    executions: Arc<Executions>,
    run_log: Arc<RunLog>,
}

impl Conformance {
    /// A service appending runs to `run_log`.
    pub fn new(run_log: RunLog) -> Self {
        Self {
            executions: Arc::default(),
            run_log: Arc::new(run_log),
        }
    }

    /// The layer the conformance server puts around it: every method of the service with
    /// the key required, `Note` with it optional, `Executions` and the streaming `Watch` left
    /// out. `x-execution` is recorded as metadata beside the defaults.
    pub fn idempotency_layer(idempotency: idempotent_runtime::Idempotency) -> IdempotencyLayer {
        const RECORDED: &[&str] = &["content-type", "location", "x-execution"];
        let required = EndpointConfig::REQUIRED.recorded_headers(RECORDED);
        let optional = EndpointConfig::OPTIONAL.recorded_headers(RECORDED);
        IdempotencyLayer::new(idempotency)
            .service(SERVICE, required)
            .method(&path("Note"), MethodConfig::new(optional))
            .except(&path("Executions"))
            .except(&path("Watch"))
    }

    fn next(&self, method: &'static str, key: Option<&str>) -> u64 {
        if let Some(key) = key {
            self.run_log.record(key);
        }
        self.executions.next(method)
    }

    async fn order(self, request: Request<OrderRequest>) -> Result<Response<OrderReply>, Status> {
        let n = self.next("Order", key(&request).as_deref());
        let order = request.into_inner();
        if order.quantity < 1 {
            let mut status = Status::invalid_argument("quantity must be positive");
            status.metadata_mut().insert("x-execution", n.into());
            return Err(status);
        }
        let reply = OrderReply {
            id: n,
            sku: order.sku,
            quantity: order.quantity,
            execution: n,
        };
        let mut response = Response::new(reply);
        let metadata = response.metadata_mut();
        metadata.insert("x-execution", n.into());
        if let Ok(location) = format!("/orders/{n}").parse() {
            metadata.insert("location", location);
        }
        if let Ok(cookie) = format!("seen={n}").parse() {
            metadata.insert("set-cookie", cookie);
        }
        Ok(response)
    }

    async fn note(self, request: Request<NoteRequest>) -> Result<Response<ExecutionReply>, Status> {
        let execution = self.next("Note", key(&request).as_deref());
        Ok(Response::new(ExecutionReply { execution }))
    }

    async fn slow(self, request: Request<SlowRequest>) -> Result<Response<ExecutionReply>, Status> {
        let ms = request.get_ref().ms;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let execution = self.next("Slow", key(&request).as_deref());
        Ok(Response::new(ExecutionReply { execution }))
    }

    async fn status(
        self,
        request: Request<StatusRequest>,
    ) -> Result<Response<ExecutionReply>, Status> {
        let execution = self.next("Status", key(&request).as_deref());
        match Code::from_i32(request.get_ref().code) {
            Code::Ok => Ok(Response::new(ExecutionReply { execution })),
            code => {
                let mut status = Status::new(code, format!("execution {execution}"));
                status
                    .metadata_mut()
                    .insert("x-execution", execution.into());
                Err(status)
            }
        }
    }

    async fn big(self, request: Request<BigRequest>) -> Result<Response<BigReply>, Status> {
        self.next("Big", key(&request).as_deref());
        let bytes = usize::try_from(request.get_ref().bytes).unwrap_or(usize::MAX);
        Ok(Response::new(BigReply {
            data: vec![b'a'; bytes.min(64 << 20)],
        }))
    }

    async fn panic(self, request: Request<Empty>) -> Result<Response<ExecutionReply>, Status> {
        let n = self.next("Panic", key(&request).as_deref());
        panic!("the Panic method panics (execution {n})");
    }

    async fn executions(self, _: Request<Empty>) -> Result<Response<ExecutionsReply>, Status> {
        let snapshot = self.executions.snapshot_of(&METHODS);
        Ok(Response::new(ExecutionsReply {
            executions: snapshot,
        }))
    }

    async fn watch(self, request: Request<WatchRequest>) -> Result<Response<EventStream>, Status> {
        let execution = self.next("Watch", None);
        let WatchRequest { count, interval_ms } = request.into_inner();
        let events = futures_util::stream::unfold(0u64, move |sequence| async move {
            if sequence >= u64::from(count) {
                return None;
            }
            if sequence > 0 {
                tokio::time::sleep(Duration::from_millis(interval_ms)).await;
            }
            let event = WatchEvent {
                sequence,
                execution,
            };
            Some((Ok(event), sequence + 1))
        });
        Ok(Response::new(Box::pin(events)))
    }
}

/// The key a call carries, for the run log.
fn key<T>(request: &Request<T>) -> Option<String> {
    let value = request.metadata().get("idempotency-key")?;
    value.to_str().ok().map(str::to_owned)
}

type EventStream = Pin<Box<dyn futures_util::Stream<Item = Result<WatchEvent, Status>> + Send>>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A unary method as tonic's `UnaryService`.
struct Unary<F>(F);

impl<M1, M2, F, Fut> UnaryService<M1> for Unary<F>
where
    F: FnMut(Request<M1>) -> Fut,
    Fut: Future<Output = Result<Response<M2>, Status>>,
{
    type Response = M2;
    type Future = Fut;

    fn call(&mut self, request: Request<M1>) -> Fut {
        (self.0)(request)
    }
}

/// A server-streaming method as tonic's `ServerStreamingService`.
struct Streaming<F>(F);

impl<M1, F, Fut> ServerStreamingService<M1> for Streaming<F>
where
    F: FnMut(Request<M1>) -> Fut,
    Fut: Future<Output = Result<Response<EventStream>, Status>>,
{
    type Response = WatchEvent;
    type ResponseStream = EventStream;
    type Future = Fut;

    fn call(&mut self, request: Request<M1>) -> Fut {
        (self.0)(request)
    }
}

fn grpc<Enc, Dec>() -> Grpc<ProstCodec<Enc, Dec>>
where
    Enc: prost::Message + Send + 'static,
    Dec: prost::Message + Default + Send + 'static,
{
    Grpc::new(ProstCodec::default()).accept_compressed(CompressionEncoding::Gzip)
}

impl NamedService for Conformance {
    const NAME: &'static str = SERVICE;
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Conformance {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let this = self.clone();
        macro_rules! unary {
            ($method:ident) => {
                grpc()
                    .unary(Unary(move |r| this.clone().$method(r)), request)
                    .await
            };
        }
        Box::pin(async move {
            let method = request.uri().path().strip_prefix(&format!("/{SERVICE}/"));
            let response = match method.unwrap_or_default() {
                "Order" => unary!(order),
                "Note" => unary!(note),
                "Slow" => unary!(slow),
                "Status" => unary!(status),
                "Big" => unary!(big),
                "Panic" => unary!(panic),
                "Executions" => unary!(executions),
                "Watch" => {
                    let watch = Streaming(move |r| this.clone().watch(r));
                    grpc().server_streaming(watch, request).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            };
            Ok(response)
        })
    }
}

/// The conformance identity rules on gRPC metadata, as a tower layer outside the idempotency
/// layer: `authorization: Bearer <tenant>:<subject>` (with `x-api-key` beside it) publishes an
/// [`Identity`](idempotent_runtime::scope::Identity); a malformed `authorization` is
/// `UNAUTHENTICATED` before any idempotency step; `x-api-key` alone is left to the runtime's
/// resolver.
#[derive(Clone, Copy, Debug, Default)]
pub struct AuthLayer;

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth(inner)
    }
}

/// The service of [`AuthLayer`].
#[derive(Clone, Debug)]
pub struct Auth<S>(S);

impl<S, B> tower_service::Service<http::Request<B>> for Auth<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let headers = request.headers();
        if let Some(authorization) = headers.get(http::header::AUTHORIZATION) {
            let api_key = headers.get("x-api-key").map(|v| v.as_bytes());
            match identity(Some(authorization.as_bytes()), api_key) {
                Ok(Some(identity)) => {
                    request.extensions_mut().insert(identity);
                }
                Ok(None) => {}
                Err(()) => {
                    let refused =
                        Status::unauthenticated("authorization is not Bearer <tenant>:<subject>");
                    return Box::pin(async move { Ok(refused.into_http()) });
                }
            }
        }
        Box::pin(self.0.call(request))
    }
}

/// A client of the conformance service over a tonic channel.
#[derive(Clone, Debug)]
pub struct Client {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
}

impl Client {
    /// A client of the server at `url` (`http://HOST:PORT`).
    pub async fn connect(url: String) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(url)?
            .connect()
            .await?;
        Ok(Self::new(channel))
    }

    /// A client over `channel`.
    pub fn new(channel: tonic::transport::Channel) -> Self {
        let grpc = tonic::client::Grpc::new(channel).accept_compressed(CompressionEncoding::Gzip);
        Self { grpc }
    }

    /// This client sending its messages gzip-compressed.
    pub fn compressed(self) -> Self {
        let grpc = self.grpc.send_compressed(CompressionEncoding::Gzip);
        Self { grpc }
    }

    /// Calls the unary `method` (`Order`, …).
    pub async fn call<M1, M2>(
        &mut self,
        method: &str,
        request: Request<M1>,
    ) -> Result<Response<M2>, Status>
    where
        M1: prost::Message + Send + Sync + 'static,
        M2: prost::Message + Default + Send + Sync + 'static,
    {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let path = path(method).parse().expect("a method path");
        self.grpc.unary(request, path, ProstCodec::default()).await
    }

    /// Calls the server-streaming `Watch`.
    pub async fn watch(
        &mut self,
        request: Request<WatchRequest>,
    ) -> Result<Response<tonic::Streaming<WatchEvent>>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let path = path("Watch").parse().expect("a method path");
        let codec = ProstCodec::default();
        self.grpc.server_streaming(request, path, codec).await
    }
}

/// `request` carrying the key `key`.
pub fn keyed<T>(message: T, key: &str) -> Request<T> {
    let mut request = Request::new(message);
    if let Ok(value) = key.parse() {
        request.metadata_mut().insert("idempotency-key", value);
    }
    request
}
