//! The MySQL / MariaDB outbox and its relay against a real database (DESIGN.md §6), the
//! PostgreSQL outbox's behaviours on InnoDB: what commits is delivered, what rolls back never
//! is; one message is never in flight twice at once; per ordering key one at a time, in commit
//! order; retries, dead letters and the operators' calls.
//!
//! Reads `MYSQL_URL`; without it each test says so and skips, unless
//! `IDEMPOTENT_REQUIRE_MYSQL=1`, when it fails. Each test works in a database of its own. The
//! publisher is an in-test recorder that checks, at every publish, that no other publish of the
//! same message or ordering key is running.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::inbox::{MySqlInbox, Processed};
use idempotent_runtime::outbox::{
    Delivery, Enqueued, Message, MySqlOutbox, OutboxError, PublishError, Publisher, Relay, State,
};
use idempotent_runtime::store::FencingToken;
use sqlx::AssertSqlSafe;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};

/// A database of its own with an `orders` table, dropped when the test ends (best effort).
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
        let name = format!("idem_outbox_{:016x}", FencingToken::mint().0);
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
        let db = Self { base, pool, name };
        db.exec("CREATE TABLE orders (id BIGINT PRIMARY KEY) ENGINE = InnoDB")
            .await;
        Some(db)
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

    async fn outbox(&self) -> MySqlOutbox {
        let outbox = MySqlOutbox::new(self.pool.clone());
        outbox.migrate().await.expect("migrate");
        outbox
    }

    /// Commits an order and its message in one transaction.
    async fn commit_order(&self, outbox: &MySqlOutbox, id: i64, message: Message) -> Enqueued {
        let mut tx = self.pool.begin().await.unwrap();
        sqlx::query("INSERT INTO orders (id) VALUES (?) ON DUPLICATE KEY UPDATE id = id")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        let enqueued = outbox.enqueue(&mut tx, message).await.unwrap();
        tx.commit().await.unwrap();
        enqueued
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

#[path = "support/recorder.rs"]
mod recorder;

use recorder::{Recorder, random_below};

/// Runs `relay.deliver_batch()` until a batch claims nothing and `done` holds, at most 2,000
/// batches (a bound on work, not on time).
async fn drain<P: Publisher>(relay: &Relay<P, MySqlOutbox>, done: impl Fn() -> bool) {
    for _ in 0..2_000 {
        let r = relay.deliver_batch().await.expect("deliver_batch");
        if r.claimed == 0 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    panic!("the relay did not finish");
}

/// Waits for `done`, checking every 20 ms, up to 2,000 checks (a bound on polling).
async fn eventually(what: &str, done: impl Fn() -> bool) {
    for _ in 0..2_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never: {what}");
}

type MyRelay<P> = Relay<P, MySqlOutbox>;

fn relay(outbox: &MySqlOutbox, publisher: Arc<Recorder>) -> MyRelay<Arc<Recorder>> {
    Relay::builder(outbox.clone(), publisher)
        .backoff(Duration::from_millis(10), Duration::from_millis(40))
        .poll_interval(Duration::from_millis(20))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_commits_is_delivered_and_what_rolls_back_never_is() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("order-1", "orders", "one"))
            .await,
        Enqueued::New
    );
    // Rolled back: the order and its message both vanish.
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(&mut tx, Message::new("order-2", "orders", "two"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // Dropped without a commit (a handler that failed or panicked): rolled back too.
    {
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .enqueue(&mut tx, Message::new("order-3", "orders", "three"))
            .await
            .unwrap();
    }
    // The same id again is not a second message, keyed or not, and writes nothing.
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("order-1", "orders", "again"))
            .await,
        Enqueued::AlreadyEnqueued
    );
    let keyed = || Message::new("order-5", "orders", "five").ordered_by("K");
    assert_eq!(db.commit_order(&outbox, 5, keyed()).await, Enqueued::New);
    assert_eq!(
        db.commit_order(&outbox, 5, keyed()).await,
        Enqueued::AlreadyEnqueued
    );
    let written = "SELECT (SELECT COUNT(*) FROM outbox_messages) * 100 \
                   + (SELECT COUNT(*) FROM outbox_messages_keys)";
    assert_eq!(
        db.scalar(written).await,
        2 * 100 + 1,
        "order-1, order-5, key K"
    );
    // A duplicate committed after the transaction began: found by the insert itself.
    let mut t1 = db.pool.begin().await.unwrap();
    let mut t2 = db.pool.begin().await.unwrap();
    let first = Message::new("order-4", "orders", "four");
    assert_eq!(outbox.enqueue(&mut t1, first).await.unwrap(), Enqueued::New);
    t1.commit().await.unwrap();
    let again = Message::new("order-4", "orders", "four");
    assert_eq!(
        outbox.enqueue(&mut t2, again).await.unwrap(),
        Enqueued::AlreadyEnqueued
    );
    t2.commit().await.unwrap();

    let recorder = Recorder::ok();
    let relay = relay(&outbox, recorder.clone());
    drain(&relay, || recorder.delivered_ids().len() == 3).await;
    assert_eq!(recorder.delivered_ids(), ["order-1", "order-4", "order-5"]);
    assert_eq!(recorder.starts(), 3);
    let record = outbox.inspect("order-1").await.unwrap().unwrap();
    assert_eq!(record.state, State::Delivered);
    assert_eq!((record.attempts, record.payload_len), (1, 3));
    assert!(record.delivered_at.is_some() && !record.leased);
    assert_eq!(
        outbox.payload("order-1").await.unwrap().as_deref(),
        Some(&b"one"[..])
    );
    assert!(outbox.inspect("order-2").await.unwrap().is_none());
    assert!(outbox.inspect("order-3").await.unwrap().is_none());
    // Delivered within the retention: enqueuing it again is still a no-op.
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("order-1", "orders", "later"))
            .await,
        Enqueued::AlreadyEnqueued
    );
    assert_eq!(relay.deliver_batch().await.unwrap().claimed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_ordering_key_and_payload_arrive_as_enqueued() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    let payload = vec![0u8, 1, 2, 255, 254];
    db.commit_order(
        &outbox,
        1,
        Message::new("m-1", "orders.placed/é", payload.clone())
            .ordered_by("order-1 ü")
            .header("content-type", "application/octet-stream")
            .header("x-trace", "abc 123"),
    )
    .await;
    struct Keep(Mutex<Vec<Delivery>>);
    impl Publisher for Keep {
        async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
            self.0.lock().unwrap().push(d.clone());
            Ok(())
        }
    }
    let keep = Arc::new(Keep(Mutex::default()));
    // `Relay::new` infers the outbox's database from its argument.
    let relay = Relay::new(outbox.clone(), keep.clone());
    assert_eq!(relay.deliver_batch().await.unwrap().delivered, 1);
    let got = keep.0.lock().unwrap().pop().unwrap();
    assert_eq!(got.id(), "m-1");
    assert_eq!(got.destination(), "orders.placed/é");
    assert_eq!(got.ordering_key(), Some("order-1 ü"));
    assert_eq!(got.payload().as_ref(), payload.as_slice());
    assert_eq!(got.attempt(), 1);
    assert_eq!(
        got.headers(),
        [
            (
                "content-type".to_owned(),
                "application/octet-stream".to_owned()
            ),
            ("x-trace".to_owned(), "abc 123".to_owned())
        ]
    );
    // Refused before any statement: the transaction is still usable.
    let mut tx = db.pool.begin().await.unwrap();
    let refused = outbox
        .enqueue(&mut tx, Message::new("bad id", "d", ""))
        .await;
    assert!(
        matches!(refused, Err(OutboxError::Invalid(_))),
        "{refused:?}"
    );
    outbox
        .enqueue(&mut tx, Message::new("m-2", "d", ""))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(outbox.inspect("m-2").await.unwrap().is_some());
    // Ids are compared as bytes: another case is another message.
    assert_eq!(
        db.commit_order(&outbox, 2, Message::new("M-2", "d", ""))
            .await,
        Enqueued::New
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_checked_and_a_second_outbox_lives_beside_the_first() {
    let Some(db) = Db::connect().await else {
        return;
    };
    for bad in ["Outbox", "1outbox", "out-box", &"x".repeat(49)] {
        assert!(
            MySqlOutbox::builder(db.pool.clone())
                .table(bad)
                .build()
                .is_err(),
            "{bad} accepted"
        );
    }
    assert!(MySqlOutbox::migrations(Some("bad-db"), "outbox").is_err());
    let elsewhere = format!("{}_other", db.name);
    let other = MySqlOutbox::builder(db.pool.clone())
        .database(&elsewhere)
        .table("events_out")
        .build()
        .unwrap();
    assert_eq!(
        other.qualified_table(),
        format!("`{elsewhere}`.`events_out`")
    );
    other.migrate().await.unwrap();
    other.migrate().await.unwrap();
    let outbox = db.outbox().await;
    db.commit_order(&other, 1, Message::new("x", "d", "").ordered_by("k"))
        .await;
    assert!(outbox.inspect("x").await.unwrap().is_none());
    assert_eq!(other.stats().await.unwrap().pending, 1);
    db.exec(&format!("DROP DATABASE `{elsewhere}`")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_relays_never_publish_one_message_twice_at_once() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    const N: i64 = 200;
    for i in 0..N {
        db.commit_order(&outbox, i, Message::new(format!("m-{i}"), "orders", "x"))
            .await;
    }
    let recorder = Recorder::new(5, Box::new(|_| None));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let relay = Relay::builder(outbox.clone(), recorder.clone())
                .batch(16)
                .build();
            let recorder = recorder.clone();
            tokio::spawn(async move {
                drain(&relay, || recorder.delivered_ids().len() >= N as usize).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let ids = recorder.delivered_ids();
    let mut expected: Vec<_> = (0..N).map(|i| format!("m-{i}")).collect();
    expected.sort();
    // Without failures or lapsed leases: each exactly once, none overlapping.
    assert_eq!(ids, expected);
    assert_eq!(recorder.starts(), N as usize);
    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(outbox.stats().await.unwrap().pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_ordering_key_one_in_flight_in_commit_order_through_failures() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    const KEYS: usize = 6;
    const PER_KEY: usize = 15;
    // Interleaved across keys, in commit order per key; a few without a key.
    for n in 0..PER_KEY {
        for k in 0..KEYS {
            let id = format!("k{k}-{n:02}");
            db.commit_order(
                &outbox,
                (n * KEYS + k) as i64,
                Message::new(id, "orders", "x").ordered_by(format!("key-{k}")),
            )
            .await;
        }
        db.commit_order(
            &outbox,
            10_000 + n as i64,
            Message::new(format!("free-{n:02}"), "orders", "x"),
        )
        .await;
    }
    // Roughly one publish in three fails on its first try, at random.
    let recorder = Recorder::new(
        4,
        Box::new(|d| {
            (d.attempt() == 1 && random_below(3) == 0).then(|| PublishError::retry("flaky"))
        }),
    );
    let total = KEYS * PER_KEY + PER_KEY;
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let relay = Relay::builder(outbox.clone(), recorder.clone())
                .batch(8)
                .backoff(Duration::from_millis(5), Duration::from_millis(20))
                .build();
            let recorder = recorder.clone();
            tokio::spawn(async move {
                drain(&relay, || recorder.delivered_ids().len() >= total).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
    let delivered = recorder.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), total, "each delivered once");
    for k in 0..KEYS {
        let key = format!("key-{k}");
        let order: Vec<_> = delivered
            .iter()
            .filter(|(_, dk)| dk.as_deref() == Some(key.as_str()))
            .map(|(id, _)| id.clone())
            .collect();
        let expected: Vec<_> = (0..PER_KEY).map(|n| format!("k{k}-{n:02}")).collect();
        assert_eq!(order, expected, "{key} out of commit order");
    }
}

/// Many transactions enqueue a few keys at once while two relays run. Each transaction, after
/// its enqueue, draws the next number of its key from a counter row it holds until its commit,
/// so the numbers are the key's commit order; each key's messages must be delivered in that
/// order, one at a time. (Without the key's lock, a transaction that enqueued first, and so has
/// the earlier `seq`, can commit second.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_key_order_is_commit_order_under_concurrent_enqueuers_and_two_relays() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.exec(
        "CREATE TABLE counters (k VARCHAR(16) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB; \
         INSERT INTO counters VALUES ('key-0', 0), ('key-1', 0), ('key-2', 0); \
         CREATE TABLE commits (id VARCHAR(32) PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
    )
    .await;
    const KEYS: usize = 3;
    const WRITERS: usize = 8;
    const EACH: usize = 6;
    let total = KEYS * WRITERS * EACH;
    let recorder = Recorder::new(3, Box::new(|_| None));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = Relay::builder(outbox.clone(), recorder.clone())
                .batch(4)
                .poll_interval(Duration::from_millis(10))
                .build();
            let mut stopped = stopped.clone();
            tokio::spawn(relay.run_until(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    let writers: Vec<_> = (0..KEYS * WRITERS)
        .map(|w| {
            let (pool, outbox) = (db.pool.clone(), outbox.clone());
            tokio::spawn(async move {
                let key = format!("key-{}", w % KEYS);
                for i in 0..EACH {
                    let id = format!("w{w}-{i}");
                    let mut tx = pool.begin().await.unwrap();
                    let message = Message::new(&id, "orders", "x").ordered_by(&key);
                    outbox.enqueue(&mut tx, message).await.unwrap();
                    // Widens the window between the enqueue and the commit order's draw.
                    tokio::time::sleep(Duration::from_millis(random_below(3))).await;
                    sqlx::query("UPDATE counters SET n = n + 1 WHERE k = ?")
                        .bind(&key)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    sqlx::query(
                        "INSERT INTO commits (id, n) SELECT ?, n FROM counters WHERE k = ?",
                    )
                    .bind(&id)
                    .bind(&key)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    eventually("every message is delivered", || {
        recorder.delivered_ids().len() >= total
    })
    .await;
    stop.send(true).unwrap();
    for r in relays {
        r.await.unwrap();
    }
    let numbers: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i32)>("SELECT id, n FROM commits")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(id, n)| (id, i64::from(n)))
            .collect();
    assert_eq!(numbers.len(), total);
    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
    let delivered = recorder.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), total, "each delivered once");
    for k in 0..KEYS {
        let key = format!("key-{k}");
        let order: Vec<i64> = delivered
            .iter()
            .filter(|(_, dk)| dk.as_deref() == Some(key.as_str()))
            .map(|(id, _)| numbers[id])
            .collect();
        let expected: Vec<i64> = (1..=(WRITERS * EACH) as i64).collect();
        assert_eq!(order, expected, "{key} delivered out of commit order");
    }
}

/// One `deliver_batch` of a relay publishing to `recorder`, in a task of its own (a gated
/// recorder holds its publishes in flight).
fn spawn_batch(
    outbox: &MySqlOutbox,
    recorder: &Arc<Recorder>,
) -> tokio::task::JoinHandle<idempotent_runtime::outbox::Relayed> {
    let relay = relay(outbox, recorder.clone());
    tokio::spawn(async move { relay.deliver_batch().await.expect("deliver_batch") })
}

/// Waits until `batch` has claimed: it finished (it claimed nothing, or a publish it claimed is
/// not held), or a publish started after `starts` others.
async fn claimed(batch: &tokio::task::JoinHandle<impl Sized>, recorder: &Recorder, starts: usize) {
    eventually("the relay's claim", || {
        batch.is_finished() || recorder.starts() > starts
    })
    .await;
}

/// Two transactions enqueue one ordering key at once. The second waits in its `enqueue` until
/// the first commits, so the first's message goes out first, and never beside the second's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_transactions_on_one_key_are_delivered_in_commit_order_one_at_a_time() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    // T1 enqueues K and stays open.
    let mut t1 = db.pool.begin().await.unwrap();
    let first = Message::new("first", "orders", "1").ordered_by("K");
    assert_eq!(outbox.enqueue(&mut t1, first).await.unwrap(), Enqueued::New);
    // T2 enqueues K and commits, in a task of its own.
    let t2 = tokio::spawn({
        let (pool, outbox) = (db.pool.clone(), outbox.clone());
        async move {
            let mut t2 = pool.begin().await.unwrap();
            let second = Message::new("second", "orders", "2").ordered_by("K");
            outbox.enqueue(&mut t2, second).await.unwrap();
            t2.commit().await.unwrap();
        }
    });
    // Only "not yet", never how long: T2 has not got past its enqueue while T1 is open.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t2_waited = !t2.is_finished();
    // Another key is not held up by K's lock.
    db.commit_order(
        &outbox,
        7,
        Message::new("other", "orders", "o").ordered_by("J"),
    )
    .await;

    // A relay while T1 is open: whatever it claims stays in flight until the gate opens.
    let recorder = Recorder::gated();
    let r1 = spawn_batch(&outbox, &recorder);
    claimed(&r1, &recorder, 0).await;
    t1.commit().await.unwrap();
    t2.await.unwrap();
    // Another relay once both committed, and a third while the second's claim is in flight.
    let before = recorder.starts();
    let r2 = spawn_batch(&outbox, &recorder);
    claimed(&r2, &recorder, before).await;
    let before = recorder.starts();
    let r3 = spawn_batch(&outbox, &recorder);
    claimed(&r3, &recorder, before).await;
    let of_k: Vec<_> = recorder
        .started_ids()
        .into_iter()
        .filter(|id| id != "other")
        .collect();
    assert!(
        of_k.len() <= 1,
        "one message of the key in flight: {of_k:?}"
    );
    recorder.open();
    for batch in [r1, r2, r3] {
        batch.await.unwrap();
    }
    let last = relay(&outbox, recorder.clone());
    drain(&last, || recorder.delivered_ids().len() == 3).await;

    assert_eq!(
        recorder.overlaps.load(Ordering::SeqCst),
        0,
        "two messages of key K in flight at once: {:?}",
        recorder.started_ids()
    );
    let order: Vec<_> = recorder
        .delivered_in_order()
        .into_iter()
        .filter(|id| id != "other")
        .collect();
    assert_eq!(order, ["first", "second"], "key K out of commit order");
    assert!(
        t2_waited,
        "T2's enqueue of K returned while T1, which enqueued K first, was open"
    );
    assert_eq!(recorder.starts(), 3);
}

/// An operator's retry puts a dead letter at the back of its key: after the key's message in
/// flight and the one pending behind it, never beside either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retried_dead_letter_goes_after_its_keys_later_messages_never_beside_them() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    for (i, id) in ["poison", "after", "more"].into_iter().enumerate() {
        let message = Message::new(id, "orders", "x").ordered_by("K");
        db.commit_order(&outbox, i as i64, message).await;
    }
    // The key's head dies at its first try; the key moves on.
    let failing = Recorder::new(
        0,
        Box::new(|d| (d.id() == "poison").then(|| PublishError::permanent("410 Gone"))),
    );
    let dead = relay(&outbox, failing).deliver_batch().await.unwrap();
    assert_eq!((dead.claimed, dead.dead), (1, 1), "{dead:?}");

    // "after" in flight (held), "more" pending behind it; the operator retries "poison" now.
    let recorder = Recorder::gated();
    let r1 = spawn_batch(&outbox, &recorder);
    eventually("the key's next message is in flight", || {
        recorder.started_ids() == ["after"]
    })
    .await;
    assert!(outbox.retry("poison").await.unwrap());
    let r2 = spawn_batch(&outbox, &recorder);
    claimed(&r2, &recorder, 1).await;
    assert_eq!(
        recorder.started_ids(),
        ["after"],
        "claimed beside the key's message in flight"
    );
    recorder.open();
    for batch in [r1, r2] {
        batch.await.unwrap();
    }
    let last = relay(&outbox, recorder.clone());
    drain(&last, || recorder.delivered_ids().len() == 3).await;

    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(
        recorder.delivered_in_order(),
        ["after", "more", "poison"],
        "the retried message did not go to the back of its key"
    );
    let poison = outbox.inspect("poison").await.unwrap().unwrap();
    assert_eq!((poison.state, poison.attempts), (State::Delivered, 1));
}

/// Nothing of a key is claimed while a message of that key is in flight, even one that is
/// earlier in `seq` (a row written without the key's lock, in a transaction that committed
/// late).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_in_flight_holds_its_key_whatever_the_order_of_the_rows() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(
        &outbox,
        1,
        Message::new("late", "orders", "x").ordered_by("K"),
    )
    .await;
    let recorder = Recorder::gated();
    let r1 = spawn_batch(&outbox, &recorder);
    eventually("the key's message is in flight", || {
        recorder.started_ids() == ["late"]
    })
    .await;
    // Written as an unlocked enqueue whose transaction committed late would have left it.
    db.exec(
        "INSERT INTO outbox_messages (seq, id, destination, ordering_key, headers, payload, \
           available_at, enqueued_at) VALUES (-1, 'early', 'orders', 'K', '[]', 'x', 0, 0)",
    )
    .await;
    let r2 = spawn_batch(&outbox, &recorder);
    claimed(&r2, &recorder, 1).await;
    assert_eq!(
        recorder.started_ids(),
        ["late"],
        "claimed beside the key's message in flight"
    );
    recorder.open();
    for batch in [r1, r2] {
        batch.await.unwrap();
    }
    let last = relay(&outbox, recorder.clone());
    drain(&last, || recorder.delivered_ids().len() == 2).await;
    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_failing_is_dead_lettered_and_an_operator_retries_it() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(
        &outbox,
        1,
        Message::new("poison", "orders", "x").ordered_by("k"),
    )
    .await;
    db.commit_order(
        &outbox,
        2,
        Message::new("after", "orders", "x").ordered_by("k"),
    )
    .await;
    db.commit_order(&outbox, 3, Message::new("gone", "orders", "x"))
        .await;
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = healed.clone();
    let recorder = Recorder::new(
        0,
        Box::new(move |d| match d.id() {
            "poison" if !h.load(Ordering::SeqCst) => Some(PublishError::retry("broker says no")),
            "gone" => Some(PublishError::permanent("404 Not Found")),
            _ => None,
        }),
    );
    let relay = Relay::builder(outbox.clone(), recorder.clone())
        .max_attempts(3)
        .backoff(Duration::from_millis(5), Duration::from_millis(10))
        .build();
    drain(&relay, || recorder.delivered_ids() == ["after"]).await;

    // Three tries, then dead with its last error; the key moved on; the permanent one died at once.
    let poison = outbox.inspect("poison").await.unwrap().unwrap();
    assert_eq!((poison.state, poison.attempts), (State::Dead, 3));
    assert_eq!(poison.last_error.as_deref(), Some("broker says no"));
    let gone = outbox.inspect("gone").await.unwrap().unwrap();
    assert_eq!((gone.state, gone.attempts), (State::Dead, 1));
    let started = recorder.started.lock().unwrap().clone();
    let poison_tries: Vec<_> = started
        .iter()
        .filter(|(id, _)| id == "poison")
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(poison_tries, [1, 2, 3]);
    let dead: Vec<_> = outbox
        .dead_letters(10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(dead, ["poison", "gone"]);
    let stats = outbox.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead), (0, 2));

    // The operator retries one and discards the other.
    healed.store(true, Ordering::SeqCst);
    assert!(outbox.retry("poison").await.unwrap());
    assert!(!outbox.retry("poison").await.unwrap(), "not dead any more");
    assert_eq!(outbox.stats().await.unwrap().pending, 1);
    assert!(outbox.discard("gone").await.unwrap());
    assert!(!outbox.discard("gone").await.unwrap());
    drain(&relay, || recorder.delivered_ids().len() == 2).await;
    assert_eq!(recorder.delivered_ids(), ["after", "poison"]);
    let poison = outbox.inspect("poison").await.unwrap().unwrap();
    assert_eq!((poison.state, poison.attempts), (State::Delivered, 1));
    assert_eq!(outbox.dead_letters(10).await.unwrap(), []);
    // Discarded: the id may be enqueued again.
    assert_eq!(
        db.commit_order(&outbox, 3, Message::new("gone", "orders", "x"))
            .await,
        Enqueued::New
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_mid_publish_leaves_the_message_to_the_next_after_its_lease() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(&outbox, 1, Message::new("m", "orders", "x").ordered_by("k"))
        .await;
    db.commit_order(&outbox, 2, Message::new("n", "orders", "x").ordered_by("k"))
        .await;

    // The first relay hangs in its publish and is killed there: no outcome is recorded.
    struct Hang(AtomicUsize);
    impl Publisher for Hang {
        async fn publish(&self, _: &Delivery) -> Result<(), PublishError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        }
    }
    let hang = Arc::new(Hang(AtomicUsize::new(0)));
    let dying = Relay::builder(outbox.clone(), hang.clone())
        .lease(Duration::from_secs(1))
        .build();
    let task = tokio::spawn(async move { dying.deliver_batch().await });
    eventually("the first relay publishes", || {
        hang.0.load(Ordering::SeqCst) == 1
    })
    .await;
    task.abort();
    let _ = task.await;
    assert!(outbox.inspect("m").await.unwrap().unwrap().leased);

    // Another relay finds nothing while the lease holds (nor the key's next message), then
    // the same message as attempt 2, then the next one.
    let recorder = Recorder::ok();
    let next = relay(&outbox, recorder.clone());
    assert_eq!(next.deliver_batch().await.unwrap().claimed, 0);
    drain(&next, || recorder.delivered_ids().len() == 2).await;
    let started = recorder.started.lock().unwrap().clone();
    assert_eq!(started, [("m".to_owned(), 2), ("n".to_owned(), 1)]);
    assert_eq!(hang.0.load(Ordering::SeqCst), 1);
}

/// A message whose relays stop mid-publish every time is dead-lettered at the claim after its
/// last attempt, not published again, and its key moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_relay_dies_every_time_is_dead_lettered_after_max_attempts() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(
        &outbox,
        1,
        Message::new("crasher", "orders", "x").ordered_by("k"),
    )
    .await;
    db.commit_order(
        &outbox,
        2,
        Message::new("next", "orders", "x").ordered_by("k"),
    )
    .await;
    struct Hang(AtomicUsize);
    impl Publisher for Hang {
        async fn publish(&self, _: &Delivery) -> Result<(), PublishError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        }
    }
    let hang = Arc::new(Hang(AtomicUsize::new(0)));
    for attempt in 1..=2 {
        let dying = Relay::builder(outbox.clone(), hang.clone())
            .lease(Duration::from_secs(1))
            .max_attempts(2)
            .build();
        // Claims as soon as the last lease lapses, then hangs in the publish and is killed.
        let task = tokio::spawn(async move {
            loop {
                if dying.deliver_batch().await.unwrap().claimed > 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        eventually("the relay publishes", || {
            hang.0.load(Ordering::SeqCst) == attempt
        })
        .await;
        task.abort();
        let _ = task.await;
    }
    let recorder = Recorder::ok();
    let relay = Relay::builder(outbox.clone(), recorder.clone())
        .max_attempts(2)
        .poll_interval(Duration::from_millis(20))
        .build();
    drain(&relay, || recorder.delivered_ids() == ["next"]).await;
    let crasher = outbox.inspect("crasher").await.unwrap().unwrap();
    assert_eq!((crasher.state, crasher.attempts), (State::Dead, 2));
    assert!(
        crasher
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("without a recorded outcome")),
        "{crasher:?}"
    );
    assert_eq!(
        hang.0.load(Ordering::SeqCst),
        2,
        "never published a third time"
    );
    assert_eq!(
        recorder.started.lock().unwrap().clone(),
        [("next".to_owned(), 1)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_running_into_the_lease_end_is_abandoned_and_retried() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(&outbox, 1, Message::new("slow", "orders", "x"))
        .await;
    struct SlowOnce(AtomicUsize);
    impl Publisher for SlowOnce {
        async fn publish(&self, _: &Delivery) -> Result<(), PublishError> {
            if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }
    let publisher = Arc::new(SlowOnce(AtomicUsize::new(0)));
    let relay = Relay::builder(outbox.clone(), publisher.clone())
        .lease(Duration::from_secs(1))
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .build();
    let first = relay.deliver_batch().await.unwrap();
    assert_eq!((first.claimed, first.retrying), (1, 1), "{first:?}");
    let record = outbox.inspect("slow").await.unwrap().unwrap();
    assert_eq!(record.state, State::Pending);
    assert!(!record.leased, "the abandoned claim gave its lease back");
    assert!(record.last_error.unwrap().contains("abandoned"));
    drain(&relay, || publisher.0.load(Ordering::SeqCst) == 2).await;
    assert_eq!(
        outbox.inspect("slow").await.unwrap().unwrap().state,
        State::Delivered
    );
}

/// MySQL has no `NOTIFY`: a running relay finds what committed before it started and after,
/// by polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_delivers_by_polling_what_committed_before_and_after_it_started() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.commit_order(&outbox, 1, Message::new("early", "orders", "x"))
        .await;
    let recorder = Recorder::ok();
    let relay = Relay::builder(outbox.clone(), recorder.clone())
        .poll_interval(Duration::from_millis(20))
        .build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    eventually("the early message is delivered", || {
        recorder.delivered_ids() == ["early"]
    })
    .await;
    for i in 2..5 {
        db.commit_order(&outbox, i, Message::new(format!("late-{i}"), "orders", "x"))
            .await;
    }
    eventually("the later messages are delivered", || {
        recorder.delivered_ids().len() == 4
    })
    .await;
    stop.send(()).unwrap();
    running.await.unwrap();
    let stats = outbox.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.dead, stats.oldest_pending),
        (0, 0, Duration::ZERO)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_only_delivered_messages_past_the_retention_and_idle_keys() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = MySqlOutbox::builder(db.pool.clone())
        .retention(Duration::from_millis(1))
        .build()
        .unwrap();
    outbox.migrate().await.unwrap();
    db.commit_order(
        &outbox,
        1,
        Message::new("sent", "orders", "x").ordered_by("a"),
    )
    .await;
    db.commit_order(
        &outbox,
        2,
        Message::new("dead", "orders", "x").ordered_by("b"),
    )
    .await;
    let recorder = Recorder::new(
        0,
        Box::new(|d| (d.id() == "dead").then(|| PublishError::permanent("no"))),
    );
    let relay = relay(&outbox, recorder.clone());
    drain(&relay, || recorder.delivered_ids().len() == 1).await;
    db.commit_order(
        &outbox,
        3,
        Message::new("pending", "orders", "x").ordered_by("c"),
    )
    .await;
    // A transaction holding key "d"'s lock, its message not committed yet.
    let mut open = db.pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut open,
            Message::new("open", "orders", "x").ordered_by("d"),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(outbox.sweep(100).await.unwrap(), 1);
    assert!(outbox.inspect("sent").await.unwrap().is_none());
    assert_eq!(
        outbox.inspect("dead").await.unwrap().unwrap().state,
        State::Dead
    );
    assert_eq!(
        outbox.inspect("pending").await.unwrap().unwrap().state,
        State::Pending
    );
    // The lock row of "a" (no message left) is gone; those of "b", "c" (messages) and "d"
    // (held) stay.
    open.commit().await.unwrap();
    let keys: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT ordering_key FROM outbox_messages_keys ORDER BY ordering_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(keys, [b"b".to_vec(), b"c".to_vec(), b"d".to_vec()]);
    // Swept: the id may be enqueued again, a new message, and its key works as before.
    assert_eq!(
        db.commit_order(
            &outbox,
            1,
            Message::new("sent", "orders", "x").ordered_by("a")
        )
        .await,
        Enqueued::New
    );
    let sweeper = outbox.spawn_sweeper();
    sweeper.abort();
}

/// The whole loop in one database: a POST's transaction enqueues, the relay publishes to a
/// broker that redelivers every message, and the consumer's inbox keyed by the message id
/// makes one effect per committed change.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_inbox_keyed_by_the_message_id_closes_the_loop() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = db.outbox().await;
    db.exec("CREATE TABLE effects (message_id VARCHAR(64) NOT NULL) ENGINE = InnoDB")
        .await;
    let inbox = MySqlInbox::new(db.pool.clone(), "reserve-stock");
    inbox.migrate().await.unwrap();

    /// Hands each message to the consumer twice, as a broker redelivering would.
    struct Twice(MySqlInbox);
    impl Publisher for Twice {
        async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
            for _ in 0..2 {
                let id = d.id().to_owned();
                let outcome = self
                    .0
                    .process(d.id(), |conn| {
                        Box::pin(async move {
                            sqlx::query("INSERT INTO effects (message_id) VALUES (?)")
                                .bind(id)
                                .execute(&mut *conn)
                                .await
                                .map(|_| ())
                        })
                    })
                    .await
                    .map_err(PublishError::retry)?;
                assert!(matches!(
                    outcome,
                    Processed::Done(()) | Processed::Duplicate
                ));
            }
            Ok(())
        }
    }
    for i in 0..20 {
        db.commit_order(&outbox, i, Message::new(format!("o-{i}"), "orders", "x"))
            .await;
        // The client's retry of the same POST enqueues the same id: nothing new.
        db.commit_order(&outbox, i, Message::new(format!("o-{i}"), "orders", "x"))
            .await;
    }
    let relay = Relay::new(outbox.clone(), Twice(inbox));
    for _ in 0..3 {
        relay.deliver_batch().await.unwrap();
    }
    let effects = db
        .scalar("SELECT COUNT(DISTINCT message_id) * 1000 + COUNT(*) FROM effects")
        .await;
    assert_eq!(effects, 20 * 1000 + 20, "20 distinct effects, none twice");
}
