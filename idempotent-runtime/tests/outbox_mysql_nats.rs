//! The whole path on MySQL / MariaDB (DESIGN.md §6): orders enqueued with their messages in
//! the orders' transactions through `MySqlOutbox`, relayed by `NatsPublisher` to NATS
//! JetStream across a killed relay, and consumed through a `MySqlInbox` that applies each
//! order's effect in the inbox's own transaction.
//!
//! Reads `MYSQL_URL` (skipping without it unless `IDEMPOTENT_REQUIRE_MYSQL=1`) and NATS at
//! `NATS_URL` (default `127.0.0.1:4222`; skipping when unreachable unless
//! `IDEMPOTENT_REQUIRE_BROKER=1`). The test works in a database and a stream of its own.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt as _;
use idempotent_runtime::inbox::{MySqlInbox, Processed};
use idempotent_runtime::outbox::{Enqueued, Message, MySqlOutbox, NatsPublisher, Relay};
use idempotent_runtime::store::FencingToken;
use sqlx::AssertSqlSafe;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use tokio::time::Instant;

/// Orders placed; every tenth (from the third) rolls back.
const N: i64 = 200;
/// Customers: each one's messages share an ordering key and a subject.
const CUSTOMERS: i64 = 8;
/// The longest any phase may take before the test fails: a liveness bound, not a timing claim.
const PATIENCE: Duration = Duration::from_secs(120);

/// A database of its own, dropped when the test ends (best effort).
struct Db {
    base: MySqlConnectOptions,
    pool: MySqlPool,
    name: String,
}

impl Db {
    async fn connect() -> Option<Self> {
        let url = support::mysql_url()?;
        let base: MySqlConnectOptions = url.parse().expect("MYSQL_URL");
        let admin = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await
            .expect("connect to MYSQL_URL");
        let name = format!("idem_outbox_nats_{:016x}", FencingToken::mint().0);
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
            .execute(&admin)
            .await
            .expect("create database");
        admin.close().await;
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect_with(base.clone().database(&name))
            .await
            .expect("connect");
        Some(Self { base, pool, name })
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("SELECT CAST(({sql}) AS SIGNED)")))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl Drop for Db {
    /// Drops the database from a thread and runtime of their own, on a connection of their own.
    fn drop(&mut self) {
        let (base, name) = (self.base.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                use sqlx::Connection as _;
                if let Ok(mut conn) = sqlx::MySqlConnection::connect_with(&base).await {
                    let drop = format!("DROP DATABASE IF EXISTS `{name}`");
                    let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&mut conn).await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}

async fn nats() -> Option<jetstream::Context> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let why = match tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&url)).await {
        Ok(Ok(client)) => return Some(jetstream::new(client)),
        Ok(Err(e)) => e.to_string(),
        Err(_) => "timed out".into(),
    };
    assert!(
        !support::broker_required(),
        "NATS at {url} is unreachable ({why}) but IDEMPOTENT_REQUIRE_BROKER=1"
    );
    eprintln!("skipped: NATS at {url} is unreachable ({why})");
    None
}

/// Deletes the test's stream (and its consumer with it) when the test ends, passed or failed.
struct StreamGuard {
    js: jetstream::Context,
    name: String,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let (js, name) = (self.js.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let _ = js.delete_stream(&name).await;
            });
        })
        .join();
    }
}

fn message(prefix: &str, order: i64) -> Message {
    let customer = order % CUSTOMERS;
    Message::new(
        format!("order-{order}-placed"),
        format!("{prefix}.orders.c{customer}"),
        format!(r#"{{"order":{order}}}"#),
    )
    .ordered_by(format!("customer-{customer}"))
    .header("content-type", "application/json")
}

/// Places `order` with its message in one transaction, committed or rolled back.
async fn place(pool: &MySqlPool, outbox: &MySqlOutbox, prefix: &str, order: i64, commit: bool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES (?)")
        .bind(order)
        .execute(&mut *tx)
        .await
        .unwrap();
    let enqueued = outbox.enqueue(&mut tx, message(prefix, order)).await;
    assert_eq!(enqueued.unwrap(), Enqueued::New, "order {order}");
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
}

/// Enqueues `order`'s message again in a later transaction of its own, as a retried request
/// would: the outbox answers that it has it, and the transaction commits.
async fn place_again(pool: &MySqlPool, outbox: &MySqlOutbox, prefix: &str, order: i64) {
    let mut tx = pool.begin().await.unwrap();
    let enqueued = outbox.enqueue(&mut tx, message(prefix, order)).await;
    assert_eq!(
        enqueued.unwrap(),
        Enqueued::AlreadyEnqueued,
        "order {order}"
    );
    tx.commit().await.unwrap();
}

fn rolled_back(order: i64) -> bool {
    order % 10 == 3
}

/// What the consumer saw.
#[derive(Default)]
struct Consumed {
    /// Deliveries applied (the inbox ran the handler).
    done: AtomicUsize,
    /// Deliveries the inbox answered `Duplicate`.
    duplicates: AtomicUsize,
    /// Orders applied whose ack the consumer held back once (a consumer that died after its
    /// commit and before its ack), so JetStream delivered them again.
    held_back: Mutex<HashSet<i64>>,
    /// Deliveries of an order whose ack was held back, after it was.
    returned: AtomicUsize,
    /// Deliveries nacked because the inbox was busy or failed.
    nacked: AtomicUsize,
}

/// Pulls from `consumer` until `stop`, processing each delivery once through `inbox`, keyed by
/// its `Nats-Msg-Id`: the effect is a counter row per order, written in the inbox's transaction.
async fn consume(
    consumer: jetstream::consumer::PullConsumer,
    inbox: MySqlInbox,
    seen: Arc<Consumed>,
    stop: Arc<AtomicBool>,
) {
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(8)
        .messages()
        .await
        .expect("pull from the test's consumer");
    while !stop.load(Ordering::SeqCst) {
        let msg = match tokio::time::timeout(Duration::from_millis(100), messages.next()).await {
            Ok(Some(msg)) => msg.expect("a delivery"),
            Ok(None) => break,
            Err(_idle) => continue,
        };
        let headers = msg.headers.as_ref().expect("the publisher's headers");
        let id = headers
            .get("Nats-Msg-Id")
            .expect("Nats-Msg-Id")
            .as_str()
            .to_owned();
        let order: i64 = id
            .strip_prefix("order-")
            .and_then(|s| s.strip_suffix("-placed"))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("an order's message id: {id}"));
        let returning = seen.held_back.lock().unwrap().contains(&order);
        let processed = inbox
            .process(&id, |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO effects (order_id, applied) VALUES (?, 1) \
                         ON DUPLICATE KEY UPDATE applied = applied + 1",
                    )
                    .bind(order)
                    .execute(&mut *conn)
                    .await
                })
            })
            .await;
        match processed {
            Ok(Processed::Done(_)) => {
                seen.done.fetch_add(1, Ordering::SeqCst);
                seen.returned
                    .fetch_add(usize::from(returning), Ordering::SeqCst);
                if order % 5 == 0 && seen.held_back.lock().unwrap().insert(order) {
                    msg.ack_with(AckKind::Nak(None)).await.expect("nak");
                } else {
                    msg.ack().await.expect("ack");
                }
            }
            Ok(Processed::Duplicate) => {
                seen.duplicates.fetch_add(1, Ordering::SeqCst);
                seen.returned
                    .fetch_add(usize::from(returning), Ordering::SeqCst);
                msg.ack().await.expect("ack");
            }
            Ok(Processed::Busy) | Err(_) => {
                seen.nacked.fetch_add(1, Ordering::SeqCst);
                let retry = AckKind::Nak(Some(Duration::from_millis(100)));
                msg.ack_with(retry).await.expect("nak");
            }
        }
    }
}

/// Waits until `done` says so, polling; fails the test past [`PATIENCE`].
async fn wait_for<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn relay(outbox: &MySqlOutbox, js: &jetstream::Context) -> Relay<NatsPublisher, MySqlOutbox> {
    // A short lease, so that the second relay takes over the killed one's claims soon.
    Relay::builder(outbox.clone(), NatsPublisher::new(js.clone()))
        .batch(16)
        .lease(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_orders_are_effected_once_each_through_nats_and_the_inbox_across_a_killed_relay()
{
    let Some(db) = Db::connect().await else {
        return;
    };
    let Some(js) = nats().await else { return };
    let prefix = format!("outbox_mysql_e2e_{:016x}", FencingToken::mint().0);
    let stream_name = prefix.to_uppercase();
    let stream = js
        .create_stream(jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("create the test's stream (is JetStream enabled on the server?)");
    let _stream = StreamGuard {
        js: js.clone(),
        name: stream_name,
    };
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("effects".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .expect("create the test's consumer");

    db.exec("CREATE TABLE orders (id BIGINT PRIMARY KEY) ENGINE = InnoDB")
        .await;
    db.exec(
        "CREATE TABLE effects (order_id BIGINT PRIMARY KEY, applied INT NOT NULL) ENGINE = InnoDB",
    )
    .await;
    let outbox = MySqlOutbox::new(db.pool.clone());
    outbox.migrate().await.expect("migrate the outbox");
    let inbox = MySqlInbox::new(db.pool.clone(), "order-effects");
    inbox.migrate().await.expect("migrate the inbox");

    let seen = Arc::new(Consumed::default());
    let stop = Arc::new(AtomicBool::new(false));
    let consumer_task = tokio::spawn(consume(
        consumer.clone(),
        inbox.clone(),
        seen.clone(),
        stop.clone(),
    ));

    // The first half, then the first relay, running while the next quarter is placed.
    for order in 1..=N / 2 {
        place(&db.pool, &outbox, &prefix, order, !rolled_back(order)).await;
    }
    let first = tokio::spawn(relay(&outbox, &js).run());
    for order in N / 2 + 1..=3 * N / 4 {
        place(&db.pool, &outbox, &prefix, order, !rolled_back(order)).await;
    }
    wait_for("the first relay to publish 40 messages", || {
        let stream = &stream;
        async move { stream.get_info().await.unwrap().state.messages >= 40 }
    })
    .await;
    first.abort();
    let _ = first.await;
    let pending_at_kill = outbox.stats().await.unwrap().pending;
    assert!(pending_at_kill > 0, "the relay was killed with work left");

    // The last quarter, and each committed order of the tenth, twentieth… placed again.
    for order in 3 * N / 4 + 1..=N {
        place(&db.pool, &outbox, &prefix, order, !rolled_back(order)).await;
    }
    for order in (7..=N).step_by(7).filter(|o| !rolled_back(*o)) {
        place_again(&db.pool, &outbox, &prefix, order).await;
    }
    let second = tokio::spawn(relay(&outbox, &js).run());

    let committed: BTreeSet<i64> = (1..=N).filter(|o| !rolled_back(*o)).collect();
    let expected = committed.len() as i64;
    wait_for("the outbox to drain", || {
        let outbox = &outbox;
        async move { outbox.stats().await.unwrap().pending == 0 }
    })
    .await;
    let held_back = || seen.held_back.lock().unwrap().len();
    wait_for("every committed order to be effected and acked", || {
        let (db, seen, consumer) = (&db, &seen, &consumer);
        async move {
            let info = consumer.get_info().await.unwrap();
            db.scalar("SELECT COUNT(*) FROM effects").await == expected
                && seen.returned.load(Ordering::SeqCst) >= held_back()
                && info.num_pending == 0
                && info.num_ack_pending == 0
        }
    })
    .await;
    second.abort();
    stop.store(true, Ordering::SeqCst);
    consumer_task.await.expect("the consumer");

    // The outbox: drained, nothing dead.
    let stats = outbox.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 0), "{stats:?}");

    // The stream: exactly the committed orders' messages, one copy each (the killed relay's
    // republishes are the stream's duplicates), each customer's in commit order.
    let count = stream.get_info().await.unwrap().state.messages;
    let mut published = BTreeSet::new();
    let mut by_customer: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for sequence in 1..=count {
        let m = stream.get_raw_message(sequence).await.expect("get message");
        let id = m.headers.get("Nats-Msg-Id").expect("Nats-Msg-Id").as_str();
        let order: i64 = id
            .strip_prefix("order-")
            .and_then(|s| s.strip_suffix("-placed"))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("an order's message id: {id}"));
        assert!(published.insert(order), "order {order} published twice");
        let customer = m.subject.as_str().rsplit('.').next().unwrap().to_owned();
        assert_eq!(customer, format!("c{}", order % CUSTOMERS));
        by_customer.entry(customer).or_default().push(order);
    }
    assert_eq!(
        published, committed,
        "the stream holds exactly the committed orders"
    );
    for (customer, orders) in &by_customer {
        assert!(
            orders.is_sorted(),
            "customer {customer}'s messages out of commit order: {orders:?}"
        );
    }

    // The effects: one per committed order, none for a rolled-back one, none applied twice.
    let effected: Vec<(i64, i64)> =
        sqlx::query_as("SELECT order_id, CAST(applied AS SIGNED) FROM effects ORDER BY order_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let twice: Vec<_> = effected.iter().filter(|(_, n)| *n != 1).collect();
    assert!(
        twice.is_empty(),
        "orders applied other than once: {twice:?}"
    );
    let effected: BTreeSet<i64> = effected.into_iter().map(|(order, _)| order).collect();
    assert_eq!(effected, committed, "effects = the committed orders");
    let held_back = held_back();
    assert!(held_back > 0);
    assert!(
        seen.duplicates.load(Ordering::SeqCst) >= held_back,
        "each delivery applied and not acked came back a duplicate"
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM orders").await,
        expected,
        "rolled-back orders left no row"
    );
    eprintln!(
        "{expected} committed of {N}; {pending_at_kill} pending when the first relay was killed; \
         {held_back} acks held back, {} inbox duplicates, {} nacks",
        seen.duplicates.load(Ordering::SeqCst),
        seen.nacked.load(Ordering::SeqCst),
    );
}
