//! The PostgreSQL outbox and its relay against a real database (DESIGN.md §6): what commits is
//! delivered, what rolls back never is; one message is never in flight twice at once; per
//! ordering key one at a time, in commit order; retries, dead letters and the operators' calls.
//!
//! Reads `DATABASE_URL`; without it each test says so and skips, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. Each test works in its own schema. The publisher
//! is an in-test recorder that checks, at every publish, that no other publish of the same
//! message or ordering key is running.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::inbox::{PostgresInbox, Processed};
use idempotent_runtime::outbox::{
    Delivery, Enqueued, Message, OutboxError, PostgresOutbox, PublishError, Publisher, Relay, State,
};
use idempotent_runtime::store::FencingToken;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgPool, PgPoolOptions};

/// A pool and a fresh schema, dropped by [`Db::drop_schema`].
struct Db {
    pool: PgPool,
    schema: String,
}

impl Db {
    async fn connect() -> Option<Self> {
        let url = support::database_url()?;
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .expect("connect to DATABASE_URL");
        let schema = format!("outbox_test_{:016x}", FencingToken::mint().0);
        let db = Self { pool, schema };
        db.exec(&format!("CREATE SCHEMA {}", db.schema)).await;
        db.exec(&format!(
            "CREATE TABLE {}.orders (id bigint PRIMARY KEY)",
            db.schema
        ))
        .await;
        Some(db)
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn outbox(&self) -> PostgresOutbox {
        let outbox = PostgresOutbox::builder(self.pool.clone())
            .schema(&self.schema)
            .build()
            .unwrap();
        outbox.migrate().await.expect("migrate");
        outbox
    }

    /// Commits an order and its message in one transaction.
    async fn commit_order(&self, outbox: &PostgresOutbox, id: i64, message: Message) -> Enqueued {
        let mut tx = self.pool.begin().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.orders (id) VALUES ($1) ON CONFLICT DO NOTHING",
            self.schema
        )))
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
        let enqueued = outbox.enqueue(&mut tx, message).await.unwrap();
        tx.commit().await.unwrap();
        enqueued
    }

    async fn drop_schema(self) {
        self.exec(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .await;
    }
}

#[path = "support/recorder.rs"]
mod recorder;

use recorder::{Recorder, random_below};

/// Runs `relay.deliver_batch()` until a batch claims nothing and `done` holds, at most 2,000
/// batches (a bound on work, not on time).
async fn drain<P: Publisher>(relay: &Relay<P>, done: impl Fn() -> bool) {
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

fn relay(outbox: &PostgresOutbox, publisher: Arc<Recorder>) -> Relay<Arc<Recorder>> {
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
    // The same id again is not a second message.
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("order-1", "orders", "again"))
            .await,
        Enqueued::AlreadyEnqueued
    );

    let recorder = Recorder::ok();
    let relay = relay(&outbox, recorder.clone());
    drain(&relay, || recorder.delivered_ids().len() == 1).await;
    assert_eq!(recorder.delivered_ids(), ["order-1"]);
    assert_eq!(recorder.starts(), 1);
    let record = outbox.inspect("order-1").await.unwrap().unwrap();
    assert_eq!(record.state, State::Delivered);
    assert_eq!((record.attempts, record.payload_len), (1, 3));
    assert!(outbox.inspect("order-2").await.unwrap().is_none());
    assert!(outbox.inspect("order-3").await.unwrap().is_none());
    // Delivered within the retention: enqueuing it again is still a no-op.
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("order-1", "orders", "later"))
            .await,
        Enqueued::AlreadyEnqueued
    );
    assert_eq!(relay.deliver_batch().await.unwrap().claimed, 0);
    db.drop_schema().await;
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
        Message::new("m-1", "orders.placed", payload.clone())
            .ordered_by("order-1")
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
    let relay = Relay::new(outbox.clone(), keep.clone());
    assert_eq!(relay.deliver_batch().await.unwrap().delivered, 1);
    let got = keep.0.lock().unwrap().pop().unwrap();
    assert_eq!(got.id(), "m-1");
    assert_eq!(got.destination(), "orders.placed");
    assert_eq!(got.ordering_key(), Some("order-1"));
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
    db.drop_schema().await;
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
    let relays: Vec<_> = (0..4)
        .map(|_| {
            Relay::builder(outbox.clone(), recorder.clone())
                .batch(16)
                .build()
        })
        .collect();
    let done = || recorder.delivered_ids().len() >= N as usize;
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            let recorder = recorder.clone();
            tokio::spawn(async move {
                drain(&relay, || recorder.delivered_ids().len() >= N as usize).await;
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert!(done());
    let ids = recorder.delivered_ids();
    let mut expected: Vec<_> = (0..N).map(|i| format!("m-{i}")).collect();
    expected.sort();
    // Without failures or lapsed leases: each exactly once, none overlapping.
    assert_eq!(ids, expected);
    assert_eq!(recorder.starts(), N as usize);
    assert_eq!(recorder.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(outbox.stats().await.unwrap().pending, 0);
    db.drop_schema().await;
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
    db.drop_schema().await;
}

/// One `deliver_batch` of a relay publishing to `recorder`, in a task of its own (a gated
/// recorder holds its publishes in flight).
fn spawn_batch(
    outbox: &PostgresOutbox,
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
/// (Without the key's lock, the second commits while the first is open, a relay publishes its
/// message, and when the first commits another relay claims the first's message, earlier in
/// `seq` and so the key's head, beside it.)
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
    assert!(
        recorder.starts() <= 1,
        "one message of the key in flight: {:?}",
        recorder.started_ids()
    );
    recorder.open();
    for batch in [r1, r2, r3] {
        batch.await.unwrap();
    }
    let last = relay(&outbox, recorder.clone());
    drain(&last, || recorder.delivered_ids().len() == 2).await;

    assert_eq!(
        recorder.overlaps.load(Ordering::SeqCst),
        0,
        "two messages of key K in flight at once: {:?}",
        recorder.started_ids()
    );
    assert_eq!(
        recorder.delivered_in_order(),
        ["first", "second"],
        "key K out of commit order"
    );
    assert!(
        t2_waited,
        "T2's enqueue of K returned while T1, which enqueued K first, was open"
    );
    assert_eq!(recorder.starts(), 2);
    db.drop_schema().await;
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
    db.drop_schema().await;
}

/// Nothing of a key is claimed while a message of that key is in flight, even one that is
/// earlier in `seq` (a row an earlier version of this crate wrote without the key's lock, in a
/// transaction that committed late: during a rolling upgrade, say).
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
    db.exec(&format!(
        "INSERT INTO {}.outbox_messages (seq, id, destination, ordering_key, payload) \
         OVERRIDING SYSTEM VALUE VALUES (0, 'early', 'orders', 'K', '\\x78')",
        db.schema
    ))
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
    db.drop_schema().await;
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
    assert!(outbox.discard("gone").await.unwrap());
    assert!(!outbox.discard("gone").await.unwrap());
    drain(&relay, || recorder.delivered_ids().len() == 2).await;
    assert_eq!(recorder.delivered_ids(), ["after", "poison"]);
    let poison = outbox.inspect("poison").await.unwrap().unwrap();
    assert_eq!((poison.state, poison.attempts), (State::Delivered, 1));
    assert_eq!(outbox.dead_letters(10).await.unwrap(), []);
    db.drop_schema().await;
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
    db.drop_schema().await;
}

/// A message whose relays stop mid-publish every time (it crashes them, say) is dead-lettered
/// at the claim after its last attempt, not published again, and its key moves on.
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
    db.drop_schema().await;
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
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_delivers_what_committed_while_none_ran_and_wakes_on_commit() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = PostgresOutbox::builder(db.pool.clone())
        .schema(&db.schema)
        .notify(true)
        .build()
        .unwrap();
    outbox.migrate().await.unwrap();
    // Committed while no relay runs.
    db.commit_order(&outbox, 1, Message::new("early", "orders", "x"))
        .await;
    let recorder = Recorder::ok();
    // Polling once an hour: only the commit's notification can wake it in this test.
    let relay = Relay::builder(outbox.clone(), recorder.clone())
        .poll_interval(Duration::from_secs(3600))
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
    eventually("the notified messages are delivered", || {
        recorder.delivered_ids().len() == 4
    })
    .await;
    stop.send(()).unwrap();
    running.await.unwrap();
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_only_delivered_messages_past_the_retention() {
    let Some(db) = Db::connect().await else {
        return;
    };
    let outbox = PostgresOutbox::builder(db.pool.clone())
        .schema(&db.schema)
        .retention(Duration::from_millis(1))
        .build()
        .unwrap();
    outbox.migrate().await.unwrap();
    db.commit_order(&outbox, 1, Message::new("sent", "orders", "x"))
        .await;
    db.commit_order(&outbox, 2, Message::new("dead", "orders", "x"))
        .await;
    let recorder = Recorder::new(
        0,
        Box::new(|d| (d.id() == "dead").then(|| PublishError::permanent("no"))),
    );
    let relay = relay(&outbox, recorder.clone());
    drain(&relay, || recorder.delivered_ids().len() == 1).await;
    db.commit_order(&outbox, 3, Message::new("pending", "orders", "x"))
        .await;
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
    // Swept: the id may be enqueued again, a new message.
    assert_eq!(
        db.commit_order(&outbox, 1, Message::new("sent", "orders", "x"))
            .await,
        Enqueued::New
    );
    db.drop_schema().await;
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
    db.exec(&format!(
        "CREATE TABLE {}.effects (message_id text NOT NULL)",
        db.schema
    ))
    .await;
    let inbox = PostgresInbox::builder(db.pool.clone(), "reserve-stock")
        .schema(&db.schema)
        .build()
        .unwrap();
    inbox.migrate().await.unwrap();

    /// Hands each message to the consumer twice, as a broker redelivering would.
    struct Twice {
        inbox: PostgresInbox,
        schema: String,
    }
    impl Publisher for Twice {
        async fn publish(&self, d: &Delivery) -> Result<(), PublishError> {
            for _ in 0..2 {
                let sql = format!(
                    "INSERT INTO {}.effects (message_id) VALUES ($1)",
                    self.schema
                );
                let id = d.id().to_owned();
                let outcome = self
                    .inbox
                    .process(d.id(), |conn| {
                        Box::pin(async move {
                            sqlx::query(AssertSqlSafe(sql))
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
    let relay = Relay::new(
        outbox.clone(),
        Twice {
            inbox,
            schema: db.schema.clone(),
        },
    );
    for _ in 0..3 {
        relay.deliver_batch().await.unwrap();
    }
    let effects: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(DISTINCT message_id) * 1000 + count(*) FROM {}.effects",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(effects, 20 * 1000 + 20, "20 distinct effects, none twice");
    db.drop_schema().await;
}

/// Behind PgBouncer in transaction pooling mode (`scripts/pgbouncer start`): enqueue in the
/// caller's transaction, relay by polling (no `LISTEN`), operators' calls, all with unnamed
/// statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_transaction_pooler_it_enqueues_and_relays_by_polling() {
    let Some(url) = support::pgbouncer_url() else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect to PGBOUNCER_URL");
    let schema = format!("outbox_pooled_{:016x}", FencingToken::mint().0);
    let outbox = PostgresOutbox::builder(pool.clone())
        .schema(&schema)
        .transaction_pooler(true)
        .build()
        .unwrap();
    outbox.migrate().await.expect("migrate behind the pooler");
    for i in 0..20 {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(
                &mut tx,
                Message::new(format!("p-{i}"), "orders", "x").ordered_by("k"),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let recorder = Recorder::ok();
    let relay = Relay::builder(outbox.clone(), recorder.clone())
        .poll_interval(Duration::from_millis(20))
        .build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    eventually("every message is delivered behind the pooler", || {
        recorder.delivered_ids().len() == 20
    })
    .await;
    stop.send(()).unwrap();
    running.await.unwrap();
    let order = recorder.delivered_in_order();
    assert_eq!(order, (0..20).map(|i| format!("p-{i}")).collect::<Vec<_>>());
    let record = outbox.inspect("p-7").await.unwrap().unwrap();
    assert_eq!(record.state, State::Delivered);
    assert_eq!(outbox.stats().await.unwrap().pending, 0);

    // The key's lock behind the pooler: a second transaction enqueuing the key waits for the
    // first's commit.
    let mut t1 = pool.begin().await.unwrap();
    let first = Message::new("p-first", "orders", "x").ordered_by("j");
    outbox.enqueue(&mut t1, first).await.unwrap();
    let t2 = tokio::spawn({
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move {
            let mut t2 = pool.begin().await.unwrap();
            let second = Message::new("p-second", "orders", "x").ordered_by("j");
            outbox.enqueue(&mut t2, second).await.unwrap();
            t2.commit().await.unwrap();
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !t2.is_finished(),
        "T2 got past its enqueue while T1 was open"
    );
    t1.commit().await.unwrap();
    t2.await.unwrap();
    // An operator's retry behind the pooler: the dead letter goes after the key's later message.
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = healed.clone();
    let failing = Recorder::new(
        0,
        Box::new(move |d| {
            (d.id() == "p-first" && !h.load(Ordering::SeqCst))
                .then(|| PublishError::permanent("410 Gone"))
        }),
    );
    let polling = Relay::builder(outbox.clone(), failing.clone())
        .poll_interval(Duration::from_millis(20))
        .build();
    drain(&polling, || failing.delivered_ids() == ["p-second"]).await;
    assert_eq!(
        outbox.inspect("p-first").await.unwrap().unwrap().state,
        State::Dead
    );
    let mut tx = pool.begin().await.unwrap();
    let third = Message::new("p-third", "orders", "x").ordered_by("j");
    outbox.enqueue(&mut tx, third).await.unwrap();
    tx.commit().await.unwrap();
    healed.store(true, Ordering::SeqCst);
    assert!(outbox.retry("p-first").await.unwrap());
    drain(&polling, || failing.delivered_ids().len() == 3).await;
    assert_eq!(
        failing.delivered_in_order(),
        ["p-second", "p-third", "p-first"]
    );
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .persistent(false)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}
