//! End to end through a real NATS JetStream broker and PostgreSQL: repeated deliveries of the
//! same message (producer retries, a crash before the ack, a nak, two competing consumer
//! processes) apply their effects once (DESIGN.md §6).
//!
//! Needs `DATABASE_URL` (skips without it, unless `IDEMPOTENT_REQUIRE_DB=1`) and NATS with
//! JetStream at `NATS_URL` (default `127.0.0.1:4222`; skips when unreachable, unless
//! `IDEMPOTENT_REQUIRE_BROKER=1`).

#[path = "../../examples/consumer_nats.rs"]
#[allow(dead_code)]
mod example;

use std::time::Duration;

use async_nats::jetstream;
use example::{Names, ReserveStock, StockConsumer};
use idempotent_runtime::inbox::PostgresInbox;
use idempotent_runtime::store::FencingToken;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPoolOptions;

use crate::support::{self, required};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_messages_reserve_stock_once() {
    let Some(database_url) = support::database_url() else {
        return;
    };
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client =
        match tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&nats_url)).await {
            Ok(Ok(client)) => client,
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".into(),
                };
                assert!(
                    !required("IDEMPOTENT_REQUIRE_BROKER"),
                    "NATS at {nats_url} is unreachable ({why}) but IDEMPOTENT_REQUIRE_BROKER=1"
                );
                eprintln!("consumer_nats: skipped, NATS at {nats_url} is unreachable ({why})");
                return;
            }
        };
    let js = jetstream::new(client);
    let names = Names::new(&format!("{:016x}", FencingToken::mint().0));
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url)
        .await
        .expect("connect to DATABASE_URL");
    let inbox = example::setup_database(&pool, &names, 100).await.unwrap();
    // JetStream redelivers an unacked message after ack_wait: 2 s keeps a slow machine from
    // redelivering messages that are merely queued, and the test short.
    let consumer = example::setup_broker(&js, &names, Duration::from_secs(2))
        .await
        .expect("create the stream and consumer (is JetStream enabled on the server?)");

    let order = |id: &str, qty| ReserveStock {
        order_id: id.into(),
        sku: "apple".into(),
        qty,
    };
    // order-1 published three times (producer retries), order-4 five times, so that the two
    // consumers below are likely to hold copies of it at the same moment.
    let publishes = [
        ("order-1", order("o-1", 2)),
        ("order-2", order("o-2", 3)),
        ("order-1", order("o-1", 2)),
        ("order-3", order("o-3", 1)),
        ("order-1", order("o-1", 2)),
        ("order-4", order("o-4", 4)),
        ("order-4", order("o-4", 4)),
        ("order-4", order("o-4", 4)),
        ("order-4", order("o-4", 4)),
        ("order-4", order("o-4", 4)),
    ];
    for (id, body) in &publishes {
        example::publish(&js, &names, id, body).await.unwrap();
    }

    // Two replicas of the consumer (each with its own pool) pull from the same durable
    // consumer. order-2 is processed but not acked once (a crash before the ack), order-3 is
    // nak'd once; every published message must end acked.
    let pool_b = PgPoolOptions::new()
        .max_connections(8)
        .connect(&database_url)
        .await
        .expect("connect to DATABASE_URL");
    let inbox_b = PostgresInbox::builder(pool_b, names.durable.clone())
        .schema(names.schema.clone())
        .build()
        .unwrap();
    let a = StockConsumer::new(inbox.clone(), names.schema.clone())
        .crash_before_ack("order-2")
        .nak_first("order-3");
    let b = a.replica(inbox_b);
    let expected_acks = publishes.len();
    // A liveness bound, not a speed assertion: ack_wait is 2 s, so this is ample.
    let deadline = Duration::from_secs(60);
    let (run_a, run_b) = tokio::join!(
        a.run(&consumer, expected_acks, deadline),
        b.run(&consumer, expected_acks, deadline)
    );
    run_a.unwrap();
    run_b.unwrap();

    let report = a.report();
    let acked = a.acked();
    let (units, reservations) = example::reserved(&pool, &names.schema).await.unwrap();
    let attempts = example::attempts(&pool, &names.schema).await.unwrap();
    let markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        inbox.qualified_table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let _ = js.delete_stream(&names.stream).await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA {} CASCADE",
        names.schema
    )))
    .execute(&pool)
    .await;

    assert_eq!(
        acked, expected_acks,
        "not every published message was acked: {report:?}"
    );
    assert_eq!(
        (units, reservations),
        (2 + 3 + 1 + 4, 4),
        "a repeated message changed the stock twice (or one never did): {report:?}"
    );
    assert_eq!(markers, 4, "one marker per distinct message");
    // Counted where the handler runs, not by rows a unique key protects.
    let once: std::collections::BTreeMap<String, usize> =
        ["order-1", "order-2", "order-3", "order-4"]
            .into_iter()
            .map(|id| (id.to_owned(), 1))
            .collect();
    assert_eq!(
        report.handler_entries, once,
        "each message entered the handler once, over both replicas: {report:?}"
    );
    let committed: std::collections::BTreeMap<String, usize> = attempts
        .into_iter()
        .map(|(id, n)| (id, n as usize))
        .collect();
    assert_eq!(
        committed, once,
        "each message committed one handler run (the attempts table has no key)"
    );
    assert_eq!(report.done, 4, "{report:?}");
    // 10 publishes of 4 distinct messages, plus the redelivery of the unacked order-2: at least
    // 7 copies are duplicates, acked without running (more if the broker redelivered others).
    assert!(report.duplicate >= 7, "{report:?}");
    assert_eq!(
        report.crashed_before_ack, 1,
        "the crash was not simulated: {report:?}"
    );
    assert_eq!(
        report.nakked_first, 1,
        "the nak was not simulated: {report:?}"
    );
    assert!(
        report.redeliveries >= 2,
        "the broker did not redeliver the unacked and the nak'd message: {report:?}"
    );
    assert_eq!(report.failed, 0, "{report:?}");
}
