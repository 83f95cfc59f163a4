//! gRPC beside the HTTP benchmarks (#30): unary first requests and replays through
//! `idempotent_runtime::tonic::IdempotencyLayer` against the bare tonic service, on the memory
//! store and on PostgreSQL, as ratios from one run (`ghz` is not available: this is its small
//! load client).
//!
//! ```text
//! cargo run --release -p idempotent-benchmarks --bin grpc_bench -- \
//!     [--duration SECS] [--concurrency N] [--connections N] [--database-url URL]
//! ```
//!
//! Each variant is a tonic server on loopback in this process (a runtime of two workers);
//! the client (its own runtime of one worker, `--connections` HTTP/2 connections, `--concurrency`
//! calls in flight) sends the 1 KiB order of the HTTP benchmarks as the message, which the
//! service echoes. First requests carry a fresh key each; replays one key, answered once
//! first. Without `--database-url` (or `DATABASE_URL`) the PostgreSQL rows are skipped.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use idempotent_benchmarks::{order_body, postgres_store, unbounded_memory_store};
use idempotent_runtime::tonic::IdempotencyLayer;
use idempotent_runtime::{Idempotency, config::EndpointConfig};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

const SERVICE: &str = "bench.v1.Orders";
const PATH: &str = "/bench.v1.Orders/Create";

/// The order, as the HTTP benchmarks' body, carried in a message.
#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(bytes = "bytes", tag = "1")]
    body: bytes::Bytes,
}

#[derive(Clone, Copy)]
struct Orders;

impl NamedService for Orders {
    const NAME: &'static str = SERVICE;
}

struct Create;

impl UnaryService<Order> for Create {
    type Response = Order;
    type Future = std::future::Ready<Result<Response<Order>, Status>>;

    fn call(&mut self, request: Request<Order>) -> Self::Future {
        std::future::ready(Ok(Response::new(request.into_inner())))
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<tonic::body::Body>> for Orders {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            if request.uri().path() != PATH {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = Grpc::new(ProstCodec::<Order, Order>::default());
            Ok(grpc.unary(Create, request).await)
        })
    }
}

struct Options {
    duration: Duration,
    concurrency: usize,
    connections: usize,
    database_url: Option<String>,
}

fn options() -> Options {
    let mut options = Options {
        duration: Duration::from_secs(5),
        concurrency: 32,
        connections: 4,
        database_url: std::env::var("DATABASE_URL").ok(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--duration" => {
                options.duration = Duration::from_secs_f64(value.parse().expect("seconds"));
            }
            "--concurrency" => options.concurrency = value.parse().expect("a number"),
            "--connections" => options.connections = value.parse().expect("a number"),
            "--database-url" => options.database_url = Some(value),
            _ => panic!("unknown option {flag}"),
        }
    }
    options
}

/// A server for the variant on a free loopback port, on `runtime`.
fn serve(runtime: &tokio::runtime::Runtime, store: Option<Idempotency>) -> SocketAddr {
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        // Without TCP_NODELAY a small answer waits for the client's delayed ACK (~40 ms).
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut builder = tonic::transport::Server::builder();
        match store {
            None => {
                let server = builder.add_service(Orders).serve_with_incoming(incoming);
                tokio::spawn(server);
            }
            Some(store) => {
                let layer = IdempotencyLayer::new(store).method(PATH, EndpointConfig::REQUIRED);
                let server = builder
                    .layer(layer)
                    .add_service(Orders)
                    .serve_with_incoming(incoming);
                tokio::spawn(server);
            }
        }
        addr
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Keys {
    None,
    Fresh,
    One,
}

/// Calls a second through `options.concurrency` tasks over `options.connections` channels.
async fn load(addr: SocketAddr, keys: Keys, options: &Options) -> f64 {
    let mut channels = Vec::new();
    for _ in 0..options.connections {
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("url");
        channels.push(endpoint.connect().await.expect("connect"));
    }
    let message = Order {
        body: bytes::Bytes::from(order_body()),
    };
    let call = move |channel: tonic::transport::Channel, key: Option<String>| {
        let message = message.clone();
        async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let mut request = Request::new(message);
            if let Some(key) = key {
                let value = key.parse().expect("a key");
                request.metadata_mut().insert("idempotency-key", value);
            }
            let codec = ProstCodec::<Order, Order>::default();
            grpc.unary(request, PATH.parse().expect("path"), codec)
                .await
        }
    };
    // Keys of this run only: a database kept from an earlier run must not turn first requests
    // into replays.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let replayed = format!("replayed-{run:x}");
    if keys == Keys::One {
        call(channels[0].clone(), Some(replayed.clone()))
            .await
            .expect("the first answer, recorded");
    }
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + options.duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..options.concurrency)
        .map(|task| {
            let channel = channels[task % channels.len()].clone();
            let (done, failed, call) = (Arc::clone(&done), Arc::clone(&failed), call.clone());
            let replayed = replayed.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    n += 1;
                    let key = match keys {
                        Keys::None => None,
                        Keys::Fresh => Some(format!("k-{run:x}-{task}-{n}")),
                        Keys::One => Some(replayed.clone()),
                    };
                    match call(channel.clone(), key).await {
                        Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a load task");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let failed = failed.load(Ordering::Relaxed);
    assert_eq!(failed, 0, "{failed} calls failed");
    done.load(Ordering::Relaxed) as f64 / elapsed
}

fn main() {
    let options = options();
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the servers' runtime");
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("the client's runtime");
    let bare = serve(&servers, None);
    let memory = serve(
        &servers,
        Some(servers.block_on(async { unbounded_memory_store() })),
    );
    let postgres = options.database_url.as_deref().map(|url| {
        let store = servers.block_on(postgres_store(url, 10, false));
        serve(&servers, Some(store))
    });
    let mut rows = vec![("bare tonic", bare, Keys::None)];
    rows.push(("memory, first requests", memory, Keys::Fresh));
    rows.push(("memory, replays", memory, Keys::One));
    if let Some(postgres) = postgres {
        rows.push(("PostgreSQL, first requests", postgres, Keys::Fresh));
        rows.push(("PostgreSQL, replays", postgres, Keys::One));
    }
    println!(
        "| gRPC unary, tonic 0.14 ({} s, {} calls in flight, {} connections) | calls/s | / bare |",
        options.duration.as_secs_f64(),
        options.concurrency,
        options.connections
    );
    println!("|---|---:|---:|");
    let mut base = None;
    for (name, addr, keys) in rows {
        let rate = client.block_on(load(addr, keys, &options));
        let base = *base.get_or_insert(rate);
        println!("| {name} | {rate:.0} | {:.2} |", rate / base);
    }
}
