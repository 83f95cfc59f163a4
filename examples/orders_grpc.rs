//! An orders service on tonic whose `CreateOrder` runs once per `idempotency-key`
//! (`idempotent_runtime::tonic::IdempotencyLayer`), its protobuf (`examples/proto/orders.proto`)
//! compiled by the package's build script with tonic-prost-build and a vendored protoc.
//!
//! ```text
//! cargo run --example orders_grpc                          # memory store
//! DATABASE_URL=postgres://… cargo run --example orders_grpc # PostgreSQL, several replicas
//! ```
//!
//! The caller's identity comes from `authorization: Bearer <tenant>:<subject>` through a tower
//! layer added before the idempotency layer; a caller without one is scoped by its address.
//! `WatchOrders` streams, so the layer leaves it out. It prints `listening on http://HOST:PORT`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use idempotent_examples::grpc::AuthLayer;
use idempotent_runtime::tonic::IdempotencyLayer;
use idempotent_runtime::{Idempotency, config::EndpointConfig};
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

pub mod shop {
    tonic::include_proto!("shop.v1");
}

use shop::orders_server::{Orders, OrdersServer};
use shop::{CreateOrderRequest, Order, WatchOrdersRequest};

#[derive(Default)]
struct Shop {
    orders: Mutex<BTreeMap<u64, Order>>,
}

type OrderStream = Pin<Box<dyn futures_util::Stream<Item = Result<Order, Status>> + Send>>;

#[tonic::async_trait]
impl Orders for Arc<Shop> {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let CreateOrderRequest { sku, quantity } = request.into_inner();
        if quantity < 1 {
            // Recorded: the same request is answered the same way again.
            return Err(Status::invalid_argument("quantity must be positive"));
        }
        let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        let id = orders.len() as u64 + 1;
        let order = Order { id, sku, quantity };
        orders.insert(id, order.clone());
        let mut response = Response::new(order);
        if let Ok(location) = format!("/orders/{id}").parse() {
            // `location` is on the default allowlist: a replay carries it too.
            response.metadata_mut().insert("location", location);
        }
        Ok(response)
    }

    type WatchOrdersStream = OrderStream;

    async fn watch_orders(
        &self,
        _: Request<WatchOrdersRequest>,
    ) -> Result<Response<OrderStream>, Status> {
        let orders: Vec<_> = self
            .orders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .map(Ok)
            .collect();
        Ok(Response::new(Box::pin(futures_util::stream::iter(orders))))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let idempotency = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let store = idempotent_runtime::store::postgres::PostgresStore::connect(&url).await?;
            store.migrate().await?;
            Idempotency::new(store)
        }
        Err(_) => Idempotency::memory(),
    };
    let layer = IdempotencyLayer::new(idempotency.clone())
        .service("shop.v1.Orders", EndpointConfig::REQUIRED)
        .except("/shop.v1.Orders/WatchOrders");
    let addr = std::env::args()
        .skip_while(|a| a != "--addr")
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:50051".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{}", listener.local_addr()?)?;
    stdout.flush()?;
    drop(stdout);
    Server::builder()
        // Outside the idempotency layer: the identity it publishes scopes the keys.
        .layer(AuthLayer)
        .layer(layer)
        .add_service(OrdersServer::new(Arc::new(Shop::default())))
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            idempotent_examples::conformance::shutdown_signal(),
        )
        .await?;
    idempotency.shutdown().await;
    Ok(())
}
