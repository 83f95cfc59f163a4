//! One POST, one event, one effect, through crashes (DESIGN.md §6, issue #32): the
//! `outbox_orders` example's three roles run as separate processes against PostgreSQL and a
//! broker, once with NATS JetStream and once with RabbitMQ (feature `rabbitmq`), through one
//! test body. Orders are posted with duplicates while the relay and the consumer are SIGKILLed
//! and restarted, every backend of the example's database connections is terminated, and
//! every broker connection is cut (the relay and the consumer reach the broker through proxies
//! of the test's). Before each consumer SIGKILL, the consumer's proxy holds back what it sends
//! while it applies a round of orders, so that it dies with those deliveries applied and not
//! acked: the broker delivers them again, and the inbox answers `Duplicate`.
//!
//! Afterwards: exactly N orders, each of the N messages delivered to the consumer at least once
//! (counted from the consumer's `received` lines, redeliveries included), exactly N
//! reservations, at least as many inbox duplicates as deliveries applied and unacked at the
//! kills, nothing pending or dead, and each customer's events in commit order: on NATS in the
//! stream, which holds exactly N messages (JetStream deduplicated what the relay published again
//! by `Nats-Msg-Id`); on RabbitMQ in the order the consumer applied them, the queue left empty.
//!
//! Needs `DATABASE_URL` (skips without it, unless `IDEMPOTENT_REQUIRE_DB=1`), NATS with
//! JetStream at `NATS_URL` (default `127.0.0.1:4222`) and RabbitMQ at `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`); a broker test skips when its broker is
//! unreachable, unless `IDEMPOTENT_REQUIRE_BROKER=1`.

#[path = "../../examples/outbox_orders.rs"]
#[allow(dead_code)]
mod example;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use example::{Names, OrderPlaced};
use idempotent_runtime::store::FencingToken;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::support::{self, required};

/// A TCP proxy in front of the broker whose connections the test can cut, and whose open
/// connections it can freeze in the client-to-broker direction (what the client sends then is
/// held, and dropped with the connection when it is cut).
struct Proxy {
    addr: String,
    connections: Arc<Mutex<Vec<Link>>>,
    accept: JoinHandle<()>,
}

/// One proxied connection.
struct Link {
    task: JoinHandle<()>,
    frozen: tokio::sync::watch::Sender<bool>,
}

/// Copies `from` to `to`; with `frozen`, holds what it read while the flag is up.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: Option<tokio::sync::watch::Receiver<bool>>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(frozen) = frozen.as_mut()
            && frozen.wait_for(|f| !f).await.is_err()
        {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connections: Arc<Mutex<Vec<Link>>> = Arc::default();
        let conns = connections.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let upstream = upstream.clone();
                let (frozen, thawed) = tokio::sync::watch::channel(false);
                let task = tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        // Either direction ending closes both.
                        tokio::select! {
                            () = pipe(client_read, server_write, Some(thawed)) => {}
                            () = pipe(server_read, client_write, None) => {}
                        }
                    }
                });
                conns.lock().unwrap().push(Link { task, frozen });
            }
        });
        Self {
            addr,
            connections,
            accept,
        }
    }

    /// Drops every connection (the clients reconnect through the proxy), with what a freeze
    /// held; returns how many were still open.
    fn cut(&self) -> usize {
        let cut: Vec<_> = self.connections.lock().unwrap().drain(..).collect();
        let open = cut.iter().filter(|l| !l.task.is_finished()).count();
        for link in &cut {
            link.task.abort();
        }
        open
    }

    /// How many connections are open.
    fn open(&self) -> usize {
        let links = self.connections.lock().unwrap();
        links.iter().filter(|l| !l.task.is_finished()).count()
    }

    /// Freezes the open connections (not those opened later).
    fn freeze(&self) {
        for link in self.connections.lock().unwrap().iter() {
            if !link.task.is_finished() {
                link.frozen.send_replace(true);
            }
        }
    }

    /// Whether some connection was frozen and every frozen one is still open: then nothing
    /// the client sent since reached the broker.
    fn frozen_and_open(&self) -> bool {
        let links = self.connections.lock().unwrap();
        let mut frozen = links.iter().filter(|l| *l.frozen.borrow()).peekable();
        frozen.peek().is_some() && frozen.all(|l| !l.task.is_finished())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

/// One role of the example, as a process of its own.
struct Role {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Role {
    /// Starts `role` and waits for the line starting with `ready`; returns it too.
    fn start(
        role: &str,
        database_url: &str,
        broker: &[(&'static str, String)],
        name: &str,
        ready: &str,
    ) -> (Self, String) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut child = Command::new(cargo)
            .args([
                "run",
                "--quiet",
                "--all-features",
                "-p",
                "idempotent-examples",
                "--example",
                "outbox_orders",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("DATABASE_URL", database_url)
            .envs(broker.iter().map(|(k, v)| (k, v)))
            .env("OUTBOX_NAME", name)
            .env("OUTBOX_ROLE", role)
            .env("ORDERS_ADDR", "127.0.0.1:0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start outbox_orders");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let role_ = Self {
            child,
            lines,
            reader: Some(reader),
        };
        // A liveness bound (the first start may build the example), not a speed assertion.
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match role_.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(ready) => return (role_, line),
                Ok(_) => {}
                Err(e) => panic!("outbox_orders {role} never printed {ready:?}: {e}"),
            }
        }
    }

    /// SIGKILL: no destructor, no graceful shutdown, whatever was in flight. Returns the lines
    /// it printed after its ready line.
    fn kill(mut self) -> Vec<String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.lines.try_iter().collect()
    }
}

/// What the consumers' lines say: `received <id>[ redelivered]`, `done <id>`, `duplicate <id>`.
#[derive(Debug, Default)]
struct Receipts {
    received: usize,
    redelivered: usize,
    duplicates: usize,
    ids: BTreeSet<String>,
}

impl Receipts {
    fn add(&mut self, lines: Vec<String>) {
        for line in lines {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("received"), Some(id), flag) => {
                    self.received += 1;
                    self.redelivered += usize::from(flag == Some("redelivered"));
                    self.ids.insert(id.to_owned());
                }
                (Some("duplicate"), Some(_), None) => self.duplicates += 1,
                _ => {}
            }
        }
    }
}

/// Each customer's order ids, in some order.
type PerCustomer = BTreeMap<String, Vec<i64>>;

/// The broker a run goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Nats,
    #[cfg(feature = "rabbitmq")]
    Amqp,
}

/// A connection of the test's own to the broker (not through the proxy).
enum Client {
    Nats(jetstream::Context),
    #[cfg(feature = "rabbitmq")]
    Amqp {
        url: String,
        channel: lapin::Channel,
    },
}

/// Splits `host:port` out of a URL like `scheme://user:password@host:port/rest` (or a bare
/// `host:port`): `(before, host:port, after)`.
fn authority(url: &str, default_port: u16) -> (String, String, String) {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let end = rest.find('/').unwrap_or(rest.len());
    let (auth, path) = rest.split_at(end);
    let (user, host) = match auth.rfind('@') {
        Some(i) => (&auth[..=i], &auth[i + 1..]),
        None => ("", auth),
    };
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:{default_port}")
    };
    (format!("{scheme}{user}"), host, path.to_owned())
}

impl Client {
    /// Connects and creates the broker's side of run `names`; `None` when the broker is
    /// unreachable and not required.
    async fn setup(broker: Broker, names: &Names) -> Option<Self> {
        let unreachable = |what: &str, url: &str| {
            assert!(
                !required("IDEMPOTENT_REQUIRE_BROKER"),
                "{what} at {url} is unreachable but IDEMPOTENT_REQUIRE_BROKER=1"
            );
            eprintln!("outbox_orders: skipped, {what} at {url} is unreachable");
        };
        match broker {
            Broker::Nats => {
                let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
                let connect = async_nats::connect(&url);
                let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(5), connect).await
                else {
                    unreachable("NATS", &url);
                    return None;
                };
                let js = jetstream::new(client);
                example::setup_broker(&js, names, Duration::from_secs(2))
                    .await
                    .expect("create the stream and consumer (is JetStream enabled?)");
                Some(Self::Nats(js))
            }
            #[cfg(feature = "rabbitmq")]
            Broker::Amqp => {
                let url = std::env::var("AMQP_URL")
                    .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
                let connect =
                    lapin::Connection::connect(&url, lapin::ConnectionProperties::default());
                let Ok(Ok(connection)) =
                    tokio::time::timeout(Duration::from_secs(5), connect).await
                else {
                    unreachable("RabbitMQ", &url);
                    return None;
                };
                let channel = connection.create_channel().await.unwrap();
                example::amqp::setup_broker(&channel, names)
                    .await
                    .expect("declare the exchange and the queue");
                Some(Self::Amqp { url, channel })
            }
        }
    }

    /// The broker's `host:port`, and the example's environment to reach it through `proxy`.
    fn through(&self, proxy: &str) -> Vec<(&'static str, String)> {
        match self {
            Self::Nats(_) => vec![
                ("OUTBOX_BROKER", "nats".into()),
                ("NATS_URL", proxy.to_owned()),
            ],
            #[cfg(feature = "rabbitmq")]
            Self::Amqp { url, .. } => {
                let (before, _, after) = authority(url, 5672);
                vec![
                    ("OUTBOX_BROKER", "amqp".into()),
                    ("AMQP_URL", format!("{before}{proxy}{after}")),
                ]
            }
        }
    }

    fn upstream(&self) -> String {
        match self {
            Self::Nats(_) => {
                let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
                authority(&url, 4222).1
            }
            #[cfg(feature = "rabbitmq")]
            Self::Amqp { url, .. } => authority(url, 5672).1,
        }
    }

    /// What the broker holds at the end: how many messages, how many it must hold (N in the
    /// stream on NATS, none left in the queue on RabbitMQ), what they are in a few words, and
    /// on NATS each customer's events in the stream's order.
    async fn held(&self, names: &Names, n: i64) -> (u64, u64, &'static str, Option<PerCustomer>) {
        match self {
            Self::Nats(js) => {
                let mut stream = js.get_stream(&names.stream).await.unwrap();
                let info = stream.info().await.unwrap().clone();
                let mut seen = PerCustomer::new();
                for seq in info.state.first_sequence..=info.state.last_sequence {
                    let m = stream.get_raw_message(seq).await.unwrap();
                    let e: OrderPlaced = serde_json::from_slice(&m.payload).unwrap();
                    seen.entry(e.customer).or_default().push(e.order_id);
                }
                let messages = info.state.messages;
                (messages, n as u64, "messages in the stream", Some(seen))
            }
            #[cfg(feature = "rabbitmq")]
            Self::Amqp { channel, .. } => {
                let queue = channel
                    .queue_declare(
                        names.queue.as_str().into(),
                        lapin::options::QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        Default::default(),
                    )
                    .await
                    .unwrap();
                let left = u64::from(queue.message_count());
                (left, 0, "messages left in the queue", None)
            }
        }
    }

    async fn clean_up(&self, names: &Names) {
        match self {
            Self::Nats(js) => {
                let _ = js.delete_stream(&names.stream).await;
            }
            #[cfg(feature = "rabbitmq")]
            Self::Amqp { channel, .. } => {
                let _ = channel
                    .queue_delete(names.queue.as_str().into(), Default::default())
                    .await;
                let _ = channel
                    .exchange_delete(names.exchange.as_str().into(), Default::default())
                    .await;
            }
        }
    }
}

async fn scalar(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.clone()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[derive(Debug, Default)]
struct Tally {
    posts: usize,
    created: usize,
    replayed: usize,
    in_progress: usize,
    failed: usize,
}

/// POSTs order `key` until it is answered 201 (first or replayed), as a client retrying would.
async fn post_until_created(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &serde_json::Value,
    tally: &Mutex<Tally>,
) -> i64 {
    for _ in 0..400 {
        let sent = http
            .post(format!("{url}/orders"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await;
        tally.lock().unwrap().posts += 1;
        match sent {
            Ok(r) if r.status() == 201 => {
                let replayed = r.headers().contains_key("idempotency-replayed");
                let placed: OrderPlaced =
                    serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
                let mut t = tally.lock().unwrap();
                if replayed {
                    t.replayed += 1;
                } else {
                    t.created += 1;
                }
                return placed.order_id;
            }
            Ok(r) if r.status() == 409 => tally.lock().unwrap().in_progress += 1,
            _ => tally.lock().unwrap().failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("order {key} was never created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_order_publishes_one_event_and_reserves_once_through_crashes_on_nats() {
    end_to_end(Broker::Nats).await;
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_order_publishes_one_event_and_reserves_once_through_crashes_on_rabbitmq() {
    end_to_end(Broker::Amqp).await;
}

async fn end_to_end(broker: Broker) {
    let Some(database_url) = support::database_url() else {
        return;
    };
    let name = format!("e2e{:08x}", FencingToken::mint().0 as u32);
    let names = Names::new(&name);
    let Some(client) = Client::setup(broker, &names).await else {
        return;
    };
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url)
        .await
        .expect("connect to DATABASE_URL");
    example::setup_database(&pool, &names).await.unwrap();

    // The example's connections carry an application name, so the test can terminate them.
    let app = format!("outbox_{name}");
    let sep = if database_url.contains('?') { '&' } else { '?' };
    let example_url = format!("{database_url}{sep}application_name={app}");
    // The relay (and the server) and the consumer each reach the broker through a proxy of
    // their own, so that the consumer's acks can be held back while the relay publishes.
    let proxy = Proxy::start(client.upstream()).await;
    let consumer_proxy = Proxy::start(client.upstream()).await;
    let (url_db, url_name) = (example_url.clone(), name.clone());
    let (env, consumer_env) = (
        client.through(&proxy.addr),
        client.through(&consumer_proxy.addr),
    );
    let start = move |role: &'static str, ready: &'static str| {
        let (db, name) = (url_db.clone(), url_name.clone());
        let env = if role == "consume" {
            consumer_env.clone()
        } else {
            env.clone()
        };
        tokio::task::spawn_blocking(move || Role::start(role, &db, &env, &name, ready))
    };
    let (serve, line) = start("serve", "listening on ").await.unwrap();
    let url = line["listening on ".len()..].trim().to_owned();
    let (mut relay, _) = start("relay", "relaying").await.unwrap();
    let (mut consume, _) = start("consume", "consuming").await.unwrap();
    let mut receipts = Receipts::default();

    const CUSTOMERS: usize = 6;
    const ROUNDS: usize = 8;
    let http = reqwest::Client::new();
    let tally = Mutex::new(Tally::default());
    let mut faults = BTreeMap::<&str, usize>::new();
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut unacked_at_kills = 0;
    for round in 0..ROUNDS {
        // Before the consumer is SIGKILLed, it processes this round's orders with its acks
        // held back, so that the broker redelivers what it already applied.
        let kill_consumer = [2, 5, 7].contains(&round);
        if kill_consumer {
            // The consumer's connection, once it is open again after a cut (a liveness bound).
            let reconnecting = consumer_proxy.open() == 0;
            let deadline = Instant::now() + Duration::from_secs(30);
            while consumer_proxy.open() == 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if reconnecting {
                // Past its handshake, which a freeze would stall.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            consumer_proxy.freeze();
        }
        // Each customer's order of this round, posted three times, two of them at once.
        let posts = (0..CUSTOMERS).map(|c| {
            let (http, url, tally) = (&http, &url, &tally);
            async move {
                let key = format!("c{c}-r{round}");
                let body = serde_json::json!({"customer": format!("c{c}"), "sku": "A1", "quantity": round + 1});
                let (a, b) = tokio::join!(
                    post_until_created(http, url, &key, &body, tally),
                    post_until_created(http, url, &key, &body, tally)
                );
                let again = post_until_created(http, url, &key, &body, tally).await;
                assert!(a == b && b == again, "one order per key: {a} {b} {again}");
                (format!("c{c}"), a)
            }
        });
        let posted = futures_util::future::join_all(posts).await;
        for (customer, order) in &posted {
            expected.entry(customer.clone()).or_default().push(*order);
        }
        if [1, 4, 6].contains(&round) {
            relay.kill();
            *faults.entry("relay SIGKILLs").or_default() += 1;
            relay = start("relay", "relaying").await.unwrap().0;
        }
        if kill_consumer {
            // Until the consumer applied this round's orders (a liveness bound: a killed
            // relay's claims lapse after their 30 s lease), or gave up waiting.
            let ids: Vec<i64> = posted.iter().map(|(_, order)| *order).collect();
            let deadline = Instant::now() + Duration::from_secs(60);
            let applied = loop {
                let applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT count(*) FROM {}.reservations WHERE order_id = ANY($1)",
                    names.schema
                )))
                .bind(&ids)
                .fetch_one(&pool)
                .await
                .unwrap();
                if applied as usize >= ids.len() || Instant::now() >= deadline {
                    break applied as usize;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            // Counted only when every ack the consumer sent since the freeze was held back.
            if consumer_proxy.frozen_and_open() {
                unacked_at_kills += applied;
            }
            receipts.add(consume.kill());
            // What the freeze held (the acks among it) goes with the dead connection.
            consumer_proxy.cut();
            *faults.entry("consumer SIGKILLs").or_default() += 1;
            consume = start("consume", "consuming").await.unwrap().0;
        }
        if [3, 6].contains(&round) {
            let n = scalar(
                &pool,
                format!(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = '{app}'"
                ),
            )
            .await;
            *faults.entry("backends terminated").or_default() += n as usize;
        }
        if [4, 7].contains(&round) {
            *faults.entry("broker connections cut").or_default() +=
                proxy.cut() + consumer_proxy.cut();
        }
    }
    let n = (CUSTOMERS * ROUNDS) as i64;
    let s = &names.schema;

    // Every order's reservation arrives (a liveness bound, not a speed assertion).
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let reserved = scalar(
            &pool,
            format!("SELECT count(DISTINCT order_id) FROM {s}.reservations"),
        )
        .await;
        if reserved >= n {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {reserved} of {n} orders reserved"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let anything still in flight land before counting.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let orders = scalar(&pool, format!("SELECT count(*) FROM {s}.orders")).await;
    let reservations = scalar(&pool, format!("SELECT count(*) FROM {s}.reservations")).await;
    let distinct = scalar(
        &pool,
        format!("SELECT count(DISTINCT message_id) FROM {s}.reservations"),
    )
    .await;
    let outbox = example::outbox(&pool, &names).unwrap();
    let stats = outbox.stats().await.unwrap();
    let attempts = scalar(
        &pool,
        format!("SELECT sum(attempts) FROM {}", outbox.qualified_table()),
    )
    .await;

    // What the broker holds, and each customer's events in the order the consumer applied
    // them in. On RabbitMQ the last round's redeliveries (what the killed consumer applied but
    // had not acked) may still be on their way to the consumer that reconnected after the last
    // cut: waited for, with a liveness bound (the queue must empty, not merely shrink).
    let waited = Instant::now();
    let deadline = waited + Duration::from_secs(60);
    let (held, must_hold, held_words, stream_order) = loop {
        let held = client.held(&names, n).await;
        if held.0 == held.1 || Instant::now() >= deadline {
            break held;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let waited = waited.elapsed();
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT customer, order_id FROM {s}.reservations ORDER BY seq"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut applied = PerCustomer::new();
    for (customer, order) in rows {
        applied.entry(customer).or_default().push(order);
    }

    drop((serve, relay));
    receipts.add(consume.kill());
    client.clean_up(&names).await;
    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE")))
        .execute(&pool)
        .await;
    eprintln!(
        "outbox_orders e2e ({broker:?}): {n} orders, {held} {held_words} (after {waited:.1?}), {} messages delivered to the \
         consumer ({} distinct, {} marked redelivered, {} inbox duplicates; {unacked_at_kills} \
         applied and unacked when the consumer was SIGKILLed), {reservations} reservations \
         (applied in each customer's commit order: {}), {attempts} publish attempts; faults \
         {faults:?}; clients {:?}",
        receipts.received,
        receipts.ids.len(),
        receipts.redelivered,
        receipts.duplicates,
        applied == expected,
        tally.lock().unwrap()
    );

    assert_eq!(orders, n, "exactly N orders");
    assert_eq!(
        receipts.ids.len(),
        n as usize,
        "each of the N messages delivered at least once (and no other)"
    );
    assert_eq!((reservations, distinct), (n, n), "exactly N effects");
    assert!(
        unacked_at_kills > 0 && receipts.duplicates >= unacked_at_kills,
        "what the consumer applied but had not acked when it was killed came back, a duplicate"
    );
    assert_eq!((stats.pending, stats.dead), (0, 0), "nothing left behind");
    assert_eq!(held, must_hold, "{held_words}");
    match stream_order {
        // NATS: the stream holds each customer's events in commit order. The consumer naks
        // what fails and JetStream redelivers after the ack wait, so the applied order is only
        // reported.
        Some(stream_order) => assert_eq!(
            stream_order, expected,
            "each customer's events in commit order in the stream"
        ),
        // RabbitMQ: one queue, one active consumer, retries in place: applied in commit order.
        None => assert_eq!(
            applied, expected,
            "each customer's events applied in commit order"
        ),
    }
    assert!(
        faults.values().all(|&v| v > 0),
        "every fault happened: {faults:?}"
    );
}
