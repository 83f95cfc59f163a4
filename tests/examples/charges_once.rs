//! End to end through a real NATS server and Redis: copies of one charge message, racing to two
//! consumers of one queue group and repeated by the producer, charge once, and every copy is
//! answered with the first receipt (DESIGN.md §6, "Plain functions").
//!
//! Needs `REDIS_URL` (skips without it, unless `IDEMPOTENT_REQUIRE_REDIS=1`) and NATS at
//! `NATS_URL` (default `127.0.0.1:4222`; skips when unreachable, unless
//! `IDEMPOTENT_REQUIRE_BROKER=1`).

#[path = "../../examples/charges_once.rs"]
#[allow(dead_code)]
mod example;

use std::time::Duration;

use example::{Charge, Provider, Reply};
use idempotent_runtime::Idempotency;
use idempotent_runtime::store::FencingToken;
use idempotent_runtime::store::redis::RedisStore;

use crate::support::{self, required};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_charge_charge_once_across_two_consumers() {
    let Some(redis_url) = support::redis_url() else {
        return;
    };
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client =
        match tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&nats_url)).await {
            Ok(Ok(client)) => client,
            _ => {
                assert!(
                    !required("IDEMPOTENT_REQUIRE_BROKER"),
                    "NATS at {nats_url} is unreachable but IDEMPOTENT_REQUIRE_BROKER=1"
                );
                eprintln!("charges_once: skipped, NATS at {nats_url} is unreachable");
                return;
            }
        };
    let unique = format!("{:016x}", FencingToken::mint().0);
    let subject = format!("idempotent.charges.{unique}");
    // Two consumer processes: each its own handle on one Redis (a prefix of this test's own).
    // They share the provider, so the test sees every charge either one made.
    let provider = Provider::default();
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder()
            .prefix(format!("idem-charges-{unique}"))
            .connect(&redis_url)
            .await
            .expect("connect to REDIS_URL");
        let idempotency = Idempotency::builder(store).sweeper(false).build();
        consumers.push(tokio::spawn(example::serve(
            client.clone(),
            subject.clone(),
            idempotency,
            provider.clone(),
        )));
    }
    client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let request = |charge: &Charge| {
        let (client, subject) = (client.clone(), subject.clone());
        let body = serde_json::to_vec(charge).unwrap();
        async move {
            let reply = client.request(subject, body.into()).await.expect("a reply");
            serde_json::from_slice::<Reply>(&reply.payload).expect("a Reply")
        }
    };
    let charge = Charge {
        id: format!("charge-{unique}"),
        customer: "acme".into(),
        amount: 1200,
    };
    // Eight copies at once (the queue group spreads them over both consumers), then four more.
    let mut replies = futures_util::future::join_all((0..8).map(|_| request(&charge))).await;
    for _ in 0..4 {
        replies.push(request(&charge).await);
    }
    let first = replies[0].clone();
    let Reply::Charged(receipt) = &first else {
        panic!("not charged: {first:?}");
    };
    assert_eq!(receipt.amount, 1200);
    assert!(
        replies.iter().all(|r| r == &first),
        "every copy gets the first receipt: {replies:?}"
    );
    assert_eq!(provider.made(), vec![charge.clone()], "charged once");

    // The same id for another amount is refused, and charges nothing.
    let changed = Charge {
        amount: 999,
        ..charge.clone()
    };
    assert!(matches!(request(&changed).await, Reply::Rejected { .. }));
    // Another id is another charge.
    let other = Charge {
        id: format!("charge-{unique}-2"),
        ..charge.clone()
    };
    assert!(matches!(request(&other).await, Reply::Charged(_)));
    assert_eq!(provider.made().len(), 2);
    for consumer in consumers {
        consumer.abort();
    }
}
