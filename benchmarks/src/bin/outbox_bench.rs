//! The outbox (#32): how fast relays empty it into NATS JetStream and RabbitMQ (one relay and
//! two), the lag of a message under a steady load of enlisted first requests, and what
//! enqueueing a message adds to an enlisted first request. One run; ratios and rates.
//!
//! ```text
//! cargo run --release -p idempotent-benchmarks --bin outbox_bench -- \
//!     [--messages N] [--seconds S] [--database-url URL] [--nats URL] [--amqp URL]
//! ```
//!
//! Defaults: 20,000 messages of 1 KiB, 10 s of requests, `DATABASE_URL` (required),
//! `127.0.0.1:4222`, `amqp://guest:guest@127.0.0.1:5672/%2f`. Everything runs in this process
//! on a Tokio runtime of two workers against the local services; each run uses its own schema,
//! stream and queue and removes them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use idempotent_benchmarks::{Order, order_body};
use idempotent_runtime::enlisted::EnlistedTx;
use idempotent_runtime::outbox::{
    AmqpPublisher, Message, NatsPublisher, PostgresOutbox, Publisher, Relay,
};
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::{Idempotency, IdempotencyContext};
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tower::ServiceExt as _;

struct Args {
    messages: usize,
    seconds: u64,
    database_url: String,
    nats: String,
    amqp: String,
}

fn args() -> Args {
    let mut a = Args {
        messages: 20_000,
        seconds: 10,
        database_url: std::env::var("DATABASE_URL").unwrap_or_default(),
        nats: "127.0.0.1:4222".into(),
        amqp: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--messages" => a.messages = value.parse().expect("--messages N"),
            "--seconds" => a.seconds = value.parse().expect("--seconds S"),
            "--database-url" => a.database_url = value,
            "--nats" => a.nats = value,
            "--amqp" => a.amqp = value,
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        !a.database_url.is_empty(),
        "set DATABASE_URL or --database-url"
    );
    a
}

fn unique() -> String {
    format!(
        "{:08x}",
        idempotent_runtime::store::FencingToken::mint().0 as u32
    )
}

/// A fresh schema holding an outbox (and the requests' tables).
async fn fresh_schema(pool: &PgPool) -> (String, PostgresOutbox) {
    let schema = format!("outbox_bench_{}", unique());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.orders (id bigserial PRIMARY KEY, body jsonb NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("create schema");
    let outbox = PostgresOutbox::builder(pool.clone())
        .schema(&schema)
        .build()
        .expect("outbox");
    outbox.migrate().await.expect("migrate");
    (schema, outbox)
}

/// The outbox of `schema`, notifying relays at commit.
async fn notifying(pool: &PgPool, schema: &str) -> PostgresOutbox {
    PostgresOutbox::builder(pool.clone())
        .schema(schema)
        .notify(true)
        .build()
        .expect("outbox")
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(pool)
        .await;
}

/// Commits `n` messages of 1 KiB to `destination`, 100 a transaction.
async fn fill(pool: &PgPool, outbox: &PostgresOutbox, n: usize, destination: &str) {
    let body = order_body();
    for chunk in 0..n.div_ceil(100) {
        let mut tx = pool.begin().await.expect("begin");
        for i in chunk * 100..((chunk + 1) * 100).min(n) {
            outbox
                .enqueue(
                    &mut tx,
                    Message::new(format!("m-{i}"), destination, body.clone()),
                )
                .await
                .expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
}

/// Runs `relays` relays until the outbox is empty; messages per second.
async fn drain<P: Publisher + Clone>(
    outbox: &PostgresOutbox,
    publisher: P,
    relays: usize,
    n: usize,
) -> f64 {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let tasks: Vec<_> = (0..relays)
        .map(|_| {
            let mut stopped = stopped.clone();
            let relay = Relay::builder(outbox.clone(), publisher.clone())
                .poll_interval(Duration::from_millis(5))
                .build();
            tokio::spawn(relay.run_until(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }))
        })
        .collect();
    loop {
        if outbox.stats().await.expect("stats").pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let _ = stop.send(true);
    for t in tasks {
        t.await.expect("relay");
    }
    n as f64 / elapsed.as_secs_f64()
}

#[derive(Clone)]
struct App {
    idempotency: Idempotency,
    outbox: Option<PostgresOutbox>,
    schema: Arc<str>,
}

impl FromRef<App> for Idempotency {
    fn from_ref(app: &App) -> Self {
        app.idempotency.clone()
    }
}

/// The benchmarks' 1 KiB order, written in the request's transaction, with its `OrderPlaced`
/// in the outbox when the app has one.
#[idempotent_runtime::axum::idempotent(require_key, enlisted)]
async fn create_order(
    State(app): State<App>,
    context: IdempotencyContext,
    tx: &mut EnlistedTx,
    Json(order): Json<Order>,
) -> (StatusCode, Json<Order>) {
    let body = serde_json::to_vec(&order).expect("serializes");
    let (id,): (i64,) = sqlx::query_as(AssertSqlSafe(format!(
        "INSERT INTO {}.orders (body) VALUES ($1::jsonb) RETURNING id",
        app.schema
    )))
    .bind(String::from_utf8(body.clone()).expect("utf-8"))
    .fetch_one(tx.conn())
    .await
    .expect("insert");
    if let Some(outbox) = &app.outbox {
        let placed = Message::for_request(&context, "order-placed", "orders.placed", body)
            .ordered_by(id.to_string());
        outbox.enqueue(tx.conn(), placed).await.expect("enqueue");
    }
    (StatusCode::CREATED, Json(order))
}

/// CPU time (user + system) of every PostgreSQL process of this machine, and of this process,
/// in clock ticks: each process's own, plus the postmaster's reaped children's (so a backend
/// that exits during a run still counts).
fn cpu_ticks() -> (u64, u64) {
    let stat = |pid: &str| -> Option<Vec<String>> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, rest) = text.rsplit_once(')')?;
        Some(rest.split_whitespace().map(str::to_owned).collect())
    };
    let ticks =
        |f: &[String], at: usize| f.get(at).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let mut postgres = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if pid.bytes().all(|b| b.is_ascii_digit())
            && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "postgres")
        {
            postgres.push(pid);
        }
    }
    let mut pg = 0;
    for pid in &postgres {
        let Some(f) = stat(pid) else { continue };
        // f[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
        pg += ticks(&f, 11) + ticks(&f, 12);
        if !postgres.contains(&f[1]) {
            pg += ticks(&f, 13) + ticks(&f, 14);
        }
    }
    let own = stat("self").map_or(0, |f| ticks(&f, 11) + ticks(&f, 12));
    (pg, own)
}

/// CPU per request in microseconds (PostgreSQL's, this process's) between two readings.
fn per_request(before: (u64, u64), after: (u64, u64), requests: f64) -> (f64, f64) {
    let hz = 100.0; // USER_HZ on Linux
    let us = |t: u64| t as f64 * 1e6 / hz / requests.max(1.0);
    (us(after.0 - before.0), us(after.1 - before.1))
}

/// First requests (a fresh key each) from 16 concurrent callers for `seconds`; requests/s,
/// and CPU per request (PostgreSQL's, this process's) in µs.
async fn measured(app: App, seconds: u64) -> (f64, f64, f64) {
    let before = cpu_ticks();
    let rate = first_requests(app, seconds).await;
    let (pg, own) = per_request(before, cpu_ticks(), rate * seconds as f64);
    (rate, pg, own)
}

/// First requests (a fresh key each) from 16 concurrent callers for `seconds`; requests/s.
async fn first_requests(app: App, seconds: u64) -> f64 {
    let router = axum::Router::new()
        .route("/orders", post(create_order))
        .with_state(app);
    let body: &'static [u8] = Box::leak(order_body().into_boxed_slice());
    let count = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(seconds);
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let (router, count) = (router.clone(), count.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < until {
                    i += 1;
                    let key = format!("w{w}-{i}-{}", unique());
                    let request = idempotent_benchmarks::request(body, Some(&key));
                    let response = router.clone().oneshot(request).await.expect("call");
                    assert_eq!(response.status(), StatusCode::CREATED);
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.expect("worker");
    }
    count.load(Ordering::Relaxed) as f64 / seconds as f64
}

async fn lag_percentiles(pool: &PgPool, outbox: &PostgresOutbox) -> (f64, f64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - enqueued_at)) * 1000)::float8, \
                (percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - enqueued_at)) * 1000)::float8, \
                count(*) \
         FROM {} WHERE state = 'delivered'",
        outbox.qualified_table()
    )))
    .fetch_one(pool)
    .await
    .expect("lag")
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .connect(&args.database_url)
        .await
        .expect("connect to PostgreSQL");
    let js = async_nats::jetstream::new(
        async_nats::connect(&args.nats)
            .await
            .expect("connect to NATS"),
    );
    let amqp = lapin::Connection::connect(&args.amqp, lapin::ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");

    println!(
        "# outbox relay throughput: {} messages of 1 KiB, batch 64",
        args.messages
    );
    println!("| target | relays | messages/s |");
    println!("|---|---|---|");
    for relays in [1, 2] {
        // NATS JetStream: a file-backed stream deduplicating by Nats-Msg-Id.
        let subject = format!("bench.outbox.{}", unique());
        let stream = format!("BENCH_OUTBOX_{}", unique());
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .expect("create stream");
        let (schema, outbox) = fresh_schema(&pool).await;
        fill(&pool, &outbox, args.messages, &subject).await;
        let rate = drain(
            &outbox,
            Arc::new(NatsPublisher::new(js.clone())),
            relays,
            args.messages,
        )
        .await;
        println!("| NATS JetStream | {relays} | {rate:.0} |");
        let _ = js.delete_stream(&stream).await;
        drop_schema(&pool, &schema).await;

        // RabbitMQ: a durable queue through the default exchange, publisher confirms.
        let channel = amqp.create_channel().await.expect("channel");
        let queue = format!("bench.outbox.{}", unique());
        channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .expect("declare queue");
        let (schema, outbox) = fresh_schema(&pool).await;
        fill(&pool, &outbox, args.messages, &queue).await;
        // One confirm in flight per channel: a channel per message of a relay's batch.
        let mut channels = Vec::new();
        for _ in 0..64 {
            channels.push(amqp.create_channel().await.expect("channel"));
        }
        let publisher = Arc::new(
            AmqpPublisher::with_channels(channels, "")
                .await
                .expect("publisher"),
        );
        let rate = drain(&outbox, publisher, relays, args.messages).await;
        println!("| RabbitMQ | {relays} | {rate:.0} |");
        let _ = channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await;
        drop_schema(&pool, &schema).await;
    }

    println!();
    println!(
        "# enlisted first requests (1 KiB order written, 16 concurrent, {} s each)",
        args.seconds
    );
    let store = PostgresStore::builder()
        .max_connections(24)
        .connect(&args.database_url)
        .await
        .expect("store");
    store.migrate().await.expect("migrate store");
    let idempotency = Idempotency::new(store);
    let (schema_a, _) = fresh_schema(&pool).await;
    let (without, without_pg, without_own) = measured(
        App {
            idempotency: idempotency.clone(),
            outbox: None,
            schema: schema_a.clone().into(),
        },
        args.seconds,
    )
    .await;
    // The message alone (the default outbox: relays poll), no relay running.
    let (schema_q, quiet) = fresh_schema(&pool).await;
    let (with_quiet, quiet_pg, quiet_own) = measured(
        App {
            idempotency: idempotency.clone(),
            outbox: Some(quiet),
            schema: schema_q.clone().into(),
        },
        args.seconds,
    )
    .await;
    // With the commit's NOTIFY, no relay running.
    let (schema_n, _) = fresh_schema(&pool).await;
    let notified = notifying(&pool, &schema_n).await;
    let (with_notify, notify_pg, notify_own) = measured(
        App {
            idempotency: idempotency.clone(),
            outbox: Some(notified),
            schema: schema_n.clone().into(),
        },
        args.seconds,
    )
    .await;
    println!(
        "| variant | requests/s | / order only | PostgreSQL CPU µs/req | this process CPU µs/req |"
    );
    println!("|---|---:|---:|---:|---:|");
    println!("| enlisted, order only | {without:.0} | 1.00 | {without_pg:.0} | {without_own:.0} |");
    println!(
        "| + outbox message (default: relays poll), no relay | {with_quiet:.0} | {:.2} | {quiet_pg:.0} | {quiet_own:.0} |",
        with_quiet / without
    );
    println!(
        "| + outbox message with NOTIFY, no relay | {with_notify:.0} | {:.2} | {notify_pg:.0} | {notify_own:.0} |",
        with_notify / without
    );
    // A relay publishing to NATS while the requests run: the lag under load, polling and
    // listening.
    let subject = "orders.placed";
    let stream = format!("BENCH_OUTBOX_LAG_{}", unique());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.into()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    for notify in [false, true] {
        let (schema_r, polled) = fresh_schema(&pool).await;
        let outbox = if notify {
            notifying(&pool, &schema_r).await
        } else {
            polled
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(
            Relay::new(outbox.clone(), NatsPublisher::new(js.clone())).run_until(async move {
                let _ = stopped.await;
            }),
        );
        let (with, with_pg, with_own) = measured(
            App {
                idempotency: idempotency.clone(),
                outbox: Some(outbox.clone()),
                schema: schema_r.clone().into(),
            },
            args.seconds,
        )
        .await;
        while outbox.stats().await.expect("stats").pending > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = stop.send(());
        relay.await.expect("relay");
        let (p50, p99, delivered) = lag_percentiles(&pool, &outbox).await;
        let how = if notify {
            "with NOTIFY, the relay listening"
        } else {
            "the relay polling every 100 ms"
        };
        println!(
            "| + outbox message, {how}, publishing to NATS | {with:.0} | {:.2} | {with_pg:.0} | {with_own:.0} |",
            with / without
        );
        println!(
            "|   lag enqueued → delivered ({delivered} messages): p50 {p50:.1} ms, p99 {p99:.1} ms | | | | |"
        );
        drop_schema(&pool, &schema_r).await;
    }
    drop_schema(&pool, &schema_q).await;
    drop_schema(&pool, &schema_n).await;
    let _ = js.delete_stream(&stream).await;
    drop_schema(&pool, &schema_a).await;
}
