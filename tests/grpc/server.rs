//! The gRPC examples as processes: `conformance_grpc` (its `listening on` line, a replay
//! through it, a clean stop on SIGTERM) and `orders_grpc` (through the client generated from
//! its proto by build.rs).

use idempotent_examples::grpc::{
    Client, ExecutionReply, NoteRequest, OrderReply, OrderRequest, keyed,
};
use tonic::Request;

use crate::{replayed, runs, support};

#[tokio::test]
async fn the_conformance_server_replays_and_stops_on_sigterm() {
    let (mut process, addr) = support::start_server(
        "conformance_grpc",
        "127.0.0.1:0",
        ["--lease", "5"],
        &[],
        false,
    );
    let mut client = Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let order = OrderRequest {
        sku: "book".into(),
        quantity: 1,
    };
    let first = client
        .call::<_, OrderReply>("Order", keyed(order.clone(), "k1"))
        .await
        .expect("OK");
    let replay = client
        .call::<_, OrderReply>("Order", keyed(order, "k1"))
        .await
        .expect("OK");
    assert_eq!(replay.get_ref(), first.get_ref());
    assert!(replayed(replay.metadata()));
    assert_eq!(
        replay.metadata().get("location").map(|v| v.as_bytes()),
        Some(&b"/orders/1"[..])
    );
    let note = client
        .call::<_, ExecutionReply>("Note", Request::new(NoteRequest { text: "x".into() }))
        .await
        .expect("a keyless note runs");
    assert_eq!(note.get_ref().execution, 1);
    assert_eq!(runs(&mut client, "Order").await, 1);

    let pid = process.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    for _ in 0..100 {
        if let Some(status) = process.exited() {
            assert!(status.success(), "stopped cleanly: {status:?}");
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the server did not stop on SIGTERM");
}

/// The code build.rs generated from examples/proto/orders.proto.
#[cfg(feature = "postgres")]
mod shop {
    include!(concat!(env!("OUT_DIR"), "/shop.v1.rs"));
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn the_orders_example_creates_an_order_once_per_key() {
    use shop::orders_client::OrdersClient;
    use shop::{CreateOrderRequest, WatchOrdersRequest};

    // On PostgreSQL in a schema of its own when there is one, else on the memory store.
    let schema = match std::env::var("DATABASE_URL") {
        Ok(_) => support::Schema::new("orders_grpc").await,
        Err(_) => None,
    };
    let url = schema.as_ref().map(support::Schema::url);
    let env: Vec<(&str, &str)> = url.iter().map(|u| ("DATABASE_URL", u.as_str())).collect();
    let (_process, addr) =
        support::start_server("orders_grpc", "127.0.0.1:0", [""; 0], &env, false);
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut client = OrdersClient::new(channel);
    let create = || {
        let mut request = Request::new(CreateOrderRequest {
            sku: "book".into(),
            quantity: 2,
        });
        request
            .metadata_mut()
            .insert("idempotency-key", "order-1".parse().expect("key"));
        request
    };
    let first = client.create_order(create()).await.expect("created");
    let replay = client.create_order(create()).await.expect("replayed");
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(first.get_ref().id, 1);
    assert!(!replayed(first.metadata()));
    assert!(replayed(replay.metadata()));
    assert_eq!(
        replay.metadata().get("location"),
        first.metadata().get("location")
    );
    let missing = client
        .create_order(Request::new(CreateOrderRequest {
            sku: "pen".into(),
            quantity: 1,
        }))
        .await
        .expect_err("the key is required");
    assert_eq!(missing.code(), tonic::Code::InvalidArgument);
    let mut watch = client
        .watch_orders(Request::new(WatchOrdersRequest {}))
        .await
        .expect("a stream")
        .into_inner();
    let mut ids = Vec::new();
    while let Some(order) = watch.message().await.expect("an order") {
        ids.push(order.id);
    }
    assert_eq!(ids, [1], "one order, created once");
}
