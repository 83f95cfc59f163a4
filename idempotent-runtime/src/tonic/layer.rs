//! [`IdempotencyLayer`]: the sequence for the unary methods of a tonic server.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// What tonic's bodies and services fail with.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

use bytes::Bytes;
use tower_layer::Layer;
use tower_service::Service;

use super::reply::{GrpcReply, Partial, read_answer};
use super::request::{MessageBody, framed};
use crate::Idempotency;
use crate::adapter::http::HttpHead;
use crate::adapter::{Ended, Prepared, Served, prepare};
use crate::config::EndpointConfig;

/// The gRPC statuses recorded by default: `OK` and the caller's own mistakes that would be
/// answered the same again ([the contract](crate::design) §1, gRPC).
pub(crate) const RECORDED_CODES: [::tonic::Code; 6] = [
    ::tonic::Code::Ok,
    ::tonic::Code::InvalidArgument,
    ::tonic::Code::NotFound,
    ::tonic::Code::AlreadyExists,
    ::tonic::Code::FailedPrecondition,
    ::tonic::Code::OutOfRange,
];

/// One method's settings: its [`EndpointConfig`] (key required or not, lease, retention,
/// caps, the metadata allowlist, …) and which gRPC statuses are recorded (every other one
/// releases the key, as `non_replayable` statuses do on HTTP).
#[derive(Debug, Clone)]
pub struct MethodConfig {
    endpoint: EndpointConfig,
    recorded: Arc<[::tonic::Code]>,
}

impl MethodConfig {
    /// `endpoint`, recording `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
    /// `FAILED_PRECONDITION` and `OUT_OF_RANGE`.
    pub fn new(endpoint: EndpointConfig) -> Self {
        Self {
            endpoint,
            recorded: Arc::new(RECORDED_CODES),
        }
    }

    /// Records exactly these gRPC statuses; every other one releases the key.
    pub fn recorded_codes(self, codes: impl IntoIterator<Item = ::tonic::Code>) -> Self {
        Self {
            recorded: codes.into_iter().collect(),
            ..self
        }
    }

    /// The endpoint settings.
    pub fn endpoint(&self) -> &EndpointConfig {
        &self.endpoint
    }

    fn records(&self, code: ::tonic::Code) -> bool {
        self.recorded.contains(&code)
    }
}

impl From<EndpointConfig> for MethodConfig {
    fn from(endpoint: EndpointConfig) -> Self {
        Self::new(endpoint)
    }
}

/// Which methods the layer applies to.
#[derive(Debug, Default)]
struct Methods {
    /// `/pkg.Service/Method` → its settings.
    methods: HashMap<String, Arc<MethodConfig>>,
    /// `pkg.Service` → the settings of its methods.
    services: HashMap<String, Arc<MethodConfig>>,
    /// Methods of a listed service left out (streaming ones).
    except: HashSet<String>,
    /// Methods seen streaming, said once each.
    said: Mutex<HashSet<String>>,
}

impl Clone for Methods {
    fn clone(&self) -> Self {
        Self {
            methods: self.methods.clone(),
            services: self.services.clone(),
            except: self.except.clone(),
            said: Mutex::default(),
        }
    }
}

impl Methods {
    fn lookup(&self, path: &str) -> Option<&Arc<MethodConfig>> {
        if let Some(method) = self.methods.get(path) {
            return Some(method);
        }
        if self.except.contains(path) {
            return None;
        }
        let service = path.strip_prefix('/')?.rsplit_once('/')?.0;
        self.services.get(service)
    }

    /// Says once per method that it streams, with the fix.
    fn streams(&self, path: &str) {
        let mut said = self.said.lock().unwrap_or_else(|p| p.into_inner());
        if said.insert(path.to_owned()) {
            tracing::error!(
                method = path,
                "a method the idempotency layer applies to streams (more than one request or \
                 answer message): a call sending two messages is refused INVALID_ARGUMENT, an \
                 answer of two is passed on unrecorded; leave it out with \
                 `IdempotencyLayer::except(\"{path}\")`, or list only unary methods"
            );
        }
    }
}

/// The idempotency sequence for a tonic server's unary methods, as a tower layer:
/// `Server::builder().layer(…)`. It applies to the methods it lists, or to every method of the
/// services it lists except the ones left out (a streaming method must be left out: the layer
/// cannot tell from the wire that a method streams until it sees a second message; it then
/// refuses a call that sends two (`INVALID_ARGUMENT`), passes an answer of two on unrecorded
/// and releases its key, and says so once in the log).
///
/// A call it applies to reads its key from the `idempotency-key` metadata entry (the
/// [key header](crate::config::ConfigBuilder::key_header) setting applies), its scope from the
/// [`Identity`](crate::scope::Identity) a tower layer outside this one put in the request extensions,
/// else the peer address; its fingerprint covers the method path (as the route), the
/// `content-type`, and the request message with its gRPC frame undone (decompressed when the
/// client sent it gzip-compressed, so a message sent compressed and uncompressed is the same
/// request). A recorded answer is replayed with its status, its metadata through the
/// allowlist, its message and its trailers, plus `idempotency-replayed: true` metadata.
/// Refusals are gRPC statuses whose `grpc-message` starts with the crate's stable code, with
/// `google.rpc.ErrorInfo` (and for a call in progress `google.rpc.RetryInfo`) in their details
/// (`google.rpc.Status`).
///
/// ```
/// use idempotent_runtime::tonic::{IdempotencyLayer, MethodConfig};
/// use idempotent_runtime::{Idempotency, config::EndpointConfig};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = IdempotencyLayer::new(Idempotency::memory())
///     // Every method of the service, the key required…
///     .service("shop.v1.Orders", EndpointConfig::REQUIRED)
///     // …but this one, which streams,
///     .except("/shop.v1.Orders/Watch")
///     // and this one, whose key is optional and which records `OK` only.
///     .method(
///         "/shop.v1.Orders/Note",
///         MethodConfig::new(EndpointConfig::OPTIONAL).recorded_codes([tonic::Code::Ok]),
///     );
/// let server = tonic::transport::Server::builder().layer(layer);
/// # drop(server);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    handle: Idempotency,
    methods: Arc<Methods>,
}

impl IdempotencyLayer {
    /// A layer over the handle `idempotency` that applies to no method yet.
    pub fn new(idempotency: Idempotency) -> Self {
        Self {
            handle: idempotency,
            methods: Arc::default(),
        }
    }

    fn edit(mut self, edit: impl FnOnce(&mut Methods)) -> Self {
        // A clone made before this edit keeps the methods it had.
        edit(Arc::make_mut(&mut self.methods));
        self
    }

    /// Applies to the unary method `path` (`/package.Service/Method`) with these settings
    /// (an [`EndpointConfig`] or a [`MethodConfig`]); over a setting of its service.
    ///
    /// # Panics
    ///
    /// When `path` is not `/package.Service/Method`: a setup mistake, said at startup.
    pub fn method(self, path: &str, config: impl Into<MethodConfig>) -> Self {
        assert!(
            is_method_path(path),
            "IdempotencyLayer::method({path:?}): a method path is `/package.Service/Method`"
        );
        let config = Arc::new(config.into());
        self.edit(|m| {
            m.except.remove(path);
            m.methods.insert(path.to_owned(), config);
        })
    }

    /// Applies to every method of the service `name` (`package.Service`, as its `NAME`)
    /// with these settings, except those [left out](Self::except).
    ///
    /// # Panics
    ///
    /// When `name` is empty or contains `/`.
    pub fn service(self, name: &str, config: impl Into<MethodConfig>) -> Self {
        assert!(
            !name.is_empty() && !name.contains('/'),
            "IdempotencyLayer::service({name:?}): a service name is `package.Service`"
        );
        let config = Arc::new(config.into());
        self.edit(|m| {
            m.services.insert(name.to_owned(), config);
        })
    }

    /// Leaves the method `path` (`/package.Service/Method`) of a listed service out: its calls
    /// pass untouched. Every streaming method of a listed service must be left out.
    ///
    /// # Panics
    ///
    /// When `path` is not `/package.Service/Method`.
    pub fn except(self, path: &str) -> Self {
        assert!(
            is_method_path(path),
            "IdempotencyLayer::except({path:?}): a method path is `/package.Service/Method`"
        );
        self.edit(|m| {
            m.methods.remove(path);
            m.except.insert(path.to_owned());
        })
    }
}

fn is_method_path(path: &str) -> bool {
    path.strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .is_some_and(|(service, method)| {
            !service.is_empty() && !method.is_empty() && !method.contains('/')
        })
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            handle: self.handle.clone(),
            methods: Arc::clone(&self.methods),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a tonic server's routes in.
#[derive(Clone, Debug)]
pub struct IdempotencyService<S> {
    inner: S,
    handle: Idempotency,
    methods: Arc<Methods>,
}

type Request = http::Request<::tonic::body::Body>;
type Response = http::Response<::tonic::body::Body>;

impl<S, B> Service<Request> for IdempotencyService<S>
where
    S: Service<Request, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh one waits for its turn.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let method = match self.methods.lookup(request.uri().path()) {
            Some(method) if is_grpc(&request) => Arc::clone(method),
            _ => {
                return Box::pin(async move {
                    let response = inner.call(request).await?;
                    Ok(response.map(::tonic::body::Body::new))
                });
            }
        };
        let (handle, methods) = (self.handle.clone(), Arc::clone(&self.methods));
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let path = parts.uri.path().to_owned();
            let effective = method.endpoint.resolve(handle.config());
            let gzip = parts
                .headers
                .get("grpc-encoding")
                .is_some_and(|v| v.as_bytes() == b"gzip");
            let streams = {
                let (methods, path) = (Arc::clone(&methods), path.clone());
                move || methods.streams(&path)
            };
            let body = MessageBody::new(body, gzip, effective.max_body, Box::new(streams));
            let peer = parts
                .extensions
                .get::<::tonic::transport::server::TcpConnectInfo>()
                .and_then(|info| info.remote_addr())
                .map(|addr| addr.ip());
            let head = HttpHead::new(&parts, Some(&path), Vec::new(), peer);
            let prepared = prepare::<_, _, GrpcReply>(&handle, &method.endpoint, &head, body);
            let claimed = match prepared.await {
                Prepared::Answer(answer) => return Ok(answer.into_http()),
                Prepared::Pass(body) => {
                    let request = http::Request::from_parts(parts, body.into_inner());
                    let response = inner.call(request).await?;
                    return Ok(response.map(::tonic::body::Body::new));
                }
                Prepared::Claimed(claimed) => claimed,
            };
            let request = http::Request::from_parts(parts, framed(claimed.body()));
            let cap = effective.max_response;
            let handler = async move {
                let response = inner.call(request).await?;
                let (reply, read) = read_answer(response, cap, |code| method.records(code)).await;
                if read == Some(Partial::Streams) {
                    methods.streams(&path);
                }
                Ok((reply, ()))
            };
            match claimed.run(Served::ByHandler, handler).await {
                Ended::Answered(reply, ()) | Ended::Panicked(reply) => Ok(reply.into_http()),
                Ended::Failed(error) => Err(error),
            }
        })
    }
}

/// A gRPC call: `POST` with a `content-type` of `application/grpc` (`+proto`, `+json`, …).
/// gRPC-Web and anything else pass untouched.
fn is_grpc(request: &Request) -> bool {
    let content_type = request.headers().get(http::header::CONTENT_TYPE);
    request.method() == http::Method::POST
        && content_type.is_some_and(|v| {
            let v = v.as_bytes();
            v == b"application/grpc"
                || v.starts_with(b"application/grpc+")
                || v.starts_with(b"application/grpc;")
        })
}
