//! The relay's metrics (DESIGN.md §6: pending messages, the oldest one's age, delivered,
//! retried, dead-lettered, delivery lag by destination), read back from a recorder this test
//! installs, over a real PostgreSQL outbox.
//!
//! Reads `DATABASE_URL`; without it the test says so and skips, unless `IDEMPOTENT_REQUIRE_DB=1`,
//! when it fails. It works in a schema of its own. One test in this binary: the recorder is
//! process-wide.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::outbox::{
    Delivery, Message, PostgresOutbox, PublishError, Publisher, Relay,
};
use idempotent_runtime::store::FencingToken;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPoolOptions;

/// One metric's value: a counter's count, a gauge's last value (as `f64` bits), a histogram's
/// number of samples.
#[derive(Default)]
struct Value(AtomicU64);

impl metrics::CounterFn for Value {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::SeqCst);
    }
}

impl metrics::GaugeFn for Value {
    fn increment(&self, value: f64) {
        self.set(f64::from_bits(self.0.load(Ordering::SeqCst)) + value);
    }

    fn decrement(&self, value: f64) {
        self.increment(-value);
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::SeqCst);
    }
}

impl metrics::HistogramFn for Value {
    fn record(&self, _: f64) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Every metric registered, by `name{label=value,…}`.
#[derive(Default, Clone)]
struct Captured(Arc<Mutex<HashMap<String, Arc<Value>>>>);

impl Captured {
    fn value(&self, key: &Key) -> Arc<Value> {
        let mut name = key.name().to_owned();
        let labels: Vec<_> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        if !labels.is_empty() {
            name = format!("{name}{{{}}}", labels.join(","));
        }
        self.0.lock().unwrap().entry(name).or_default().clone()
    }

    /// A counter's count or a histogram's samples; `None` if never registered.
    fn count(&self, name: &str) -> Option<u64> {
        let values = self.0.lock().unwrap();
        values.get(name).map(|v| v.0.load(Ordering::SeqCst))
    }

    fn gauge(&self, name: &str) -> Option<f64> {
        self.count(name).map(f64::from_bits)
    }
}

impl Recorder for Captured {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.value(key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.value(key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.value(key))
    }
}

/// Delivers `orders-*` and `events-*`; `flaky` fails once and is retried; `gone` fails for good.
#[derive(Default)]
struct Broker {
    flaky_failed: AtomicU64,
}

impl Publisher for Broker {
    async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
        match d.id() {
            "gone" => Err(PublishError::permanent("404 Not Found")),
            "flaky" if self.flaky_failed.fetch_add(1, Ordering::SeqCst) == 0 => {
                Err(PublishError::retry("503 Service Unavailable"))
            }
            _ => Ok(()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_counts_deliveries_retries_dead_letters_and_sets_its_gauges() {
    let Some(url) = support::database_url() else {
        return;
    };
    let captured = Captured::default();
    metrics::set_global_recorder(captured.clone()).expect("the only recorder of this binary");

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect to DATABASE_URL");
    let schema = format!("outbox_metrics_{:016x}", FencingToken::mint().0);
    let exec = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::raw_sql(AssertSqlSafe(sql.clone()))
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    };
    exec(format!("CREATE SCHEMA {schema}")).await;
    let outbox = PostgresOutbox::builder(pool.clone())
        .schema(&schema)
        .build()
        .unwrap();
    outbox.migrate().await.expect("migrate");
    let mut tx = pool.begin().await.unwrap();
    for (id, destination) in [
        ("order-1", "orders"),
        ("order-2", "orders"),
        ("gone", "orders"),
        ("flaky", "events"),
    ] {
        outbox
            .enqueue(&mut tx, Message::new(id, destination, "{}"))
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();

    let relay = Relay::builder(outbox.clone(), Broker::default())
        .backoff(Duration::from_millis(5), Duration::from_millis(10))
        .poll_interval(Duration::from_millis(20))
        .listen(false)
        .build();
    let delivered = |destination: &str| {
        captured.count(&format!(
            "idempotent_outbox_delivered_total{{destination={destination}}}"
        ))
    };
    // Until everything is delivered or dead, bounded by checks, not by time: a relay that never
    // finishes fails the test.
    let done = async {
        for _ in 0..2_000 {
            if delivered("orders") == Some(2) && delivered("events") == Some(1) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the relay did not deliver every message");
    };
    relay.run_until(done).await;

    assert_eq!(
        captured.count("idempotent_outbox_retried_total{destination=events}"),
        Some(1)
    );
    assert_eq!(
        captured.count("idempotent_outbox_dead_total{destination=orders}"),
        Some(1)
    );
    assert_eq!(
        captured.count("idempotent_outbox_lag_seconds{destination=orders}"),
        Some(2),
        "one lag sample a delivery"
    );
    assert_eq!(
        captured.count("idempotent_outbox_lag_seconds{destination=events}"),
        Some(1)
    );
    // Set after the relay's first batch, which claimed all four: two delivered, `gone` dead,
    // `flaky` pending its retry. (A second refresh comes only ten seconds later; on a machine
    // that slow it may read `flaky` delivered, never more dead.)
    assert_eq!(captured.gauge("idempotent_outbox_dead"), Some(1.0));
    let pending = captured.gauge("idempotent_outbox_pending");
    assert!(
        matches!(pending, Some(p) if p == 1.0 || p == 0.0),
        "pending gauge {pending:?}"
    );
    assert!(
        captured
            .gauge("idempotent_outbox_oldest_pending_seconds")
            .is_some()
    );
    let stats = outbox.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 1));

    exec(format!("DROP SCHEMA {schema} CASCADE")).await;
}
