//! The `conformance_grpc` example as a process: its `listening on` line, a replay through it,
//! and a clean stop on SIGTERM.

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
