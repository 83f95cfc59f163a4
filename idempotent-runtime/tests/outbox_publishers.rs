//! The outbox's built-in publishers against the real things (DESIGN.md §6): NATS JetStream,
//! RabbitMQ, and an HTTP server of the test's own for webhooks; then the relay through each,
//! from an outbox on PostgreSQL.
//!
//! NATS at `NATS_URL` (default `127.0.0.1:4222`) and RabbitMQ at `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): a test skips when its broker is unreachable, unless
//! `IDEMPOTENT_REQUIRE_BROKER=1`. The relay tests also read `DATABASE_URL` (skipping without it
//! unless `IDEMPOTENT_REQUIRE_DB=1`). Each test works in its own stream, queue and schema.

mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream;
use idempotent_runtime::outbox::{
    AmqpPublisher, Delivery, Enqueued, Message, NatsPublisher, PostgresOutbox, Publisher, Relay,
    State, WebhookPublisher,
};
use idempotent_runtime::store::FencingToken;
use idempotent_runtime::webhook::StandardWebhooks;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A name no other test (or run) uses.
fn unique() -> String {
    format!("{:016x}", FencingToken::mint().0)
}

fn delivery(message: Message) -> Delivery {
    Delivery::new(message, 1, SystemTime::now())
}

/// Skips (`None`) or fails, per `IDEMPOTENT_REQUIRE_BROKER`, when a broker is unreachable.
fn unreachable<T>(broker: &str, url: &str, why: String) -> Option<T> {
    assert!(
        !support::broker_required(),
        "{broker} at {url} is unreachable ({why}) but IDEMPOTENT_REQUIRE_BROKER=1"
    );
    eprintln!("skipped: {broker} at {url} is unreachable ({why})");
    None
}

// ---- NATS JetStream ---------------------------------------------------------------------------

async fn nats() -> Option<jetstream::Context> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    match tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&url)).await {
        Ok(Ok(client)) => Some(jetstream::new(client)),
        Ok(Err(e)) => unreachable("NATS", &url, e.to_string()),
        Err(_) => unreachable("NATS", &url, "timed out".into()),
    }
}

/// A stream of its own capturing `<prefix>.>`, with a duplicate window of a minute.
async fn stream(js: &jetstream::Context, prefix: &str) -> jetstream::stream::Stream {
    js.create_stream(jetstream::stream::Config {
        name: prefix.replace('.', "_").to_uppercase(),
        subjects: vec![format!("{prefix}.>")],
        duplicate_window: Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .expect("create the test's stream (is JetStream enabled on the server?)")
}

async fn stream_messages(
    stream: &jetstream::stream::Stream,
) -> Vec<jetstream::message::StreamMessage> {
    let count = stream.get_info().await.expect("stream info").state.messages;
    let mut messages = Vec::new();
    for sequence in 1..=count {
        messages.push(stream.get_raw_message(sequence).await.expect("get message"));
    }
    messages
}

fn nats_header<'m>(m: &'m jetstream::message::StreamMessage, name: &str) -> Option<&'m str> {
    m.headers.get(name).map(|v| v.as_str())
}

#[tokio::test]
async fn nats_publish_carries_the_id_and_the_stream_keeps_one_copy_of_a_republished_id() {
    let Some(js) = nats().await else { return };
    let prefix = format!("outbox_test_{}", unique());
    let stream = stream(&js, &prefix).await;
    let publisher = NatsPublisher::new(js.clone());
    let subject = format!("{prefix}.orders.placed");
    let first = delivery(
        Message::new("order-7-placed", &subject, r#"{"order":7}"#)
            .header("content-type", "application/json")
            .header("x-tenant", "acme"),
    );

    publisher.publish(&first).await.expect("first publish");
    // The relay's second try of the same message (it died before recording the first).
    publisher
        .publish(&first)
        .await
        .expect("a republished id is acknowledged as a duplicate, which is a success");

    let messages = stream_messages(&stream).await;
    assert_eq!(messages.len(), 1, "the server kept one copy of the id");
    let m = &messages[0];
    assert_eq!(m.subject.as_str(), subject);
    assert_eq!(nats_header(m, "Nats-Msg-Id"), Some("order-7-placed"));
    assert_eq!(nats_header(m, "content-type"), Some("application/json"));
    assert_eq!(nats_header(m, "x-tenant"), Some("acme"));
    assert_eq!(&m.payload[..], br#"{"order":7}"#);

    // Another id on the same subject is another message.
    let second = delivery(Message::new("order-8-placed", &subject, "{}"));
    publisher.publish(&second).await.expect("second id");
    assert_eq!(stream_messages(&stream).await.len(), 2);

    js.delete_stream(stream.cached_info().config.name.clone())
        .await
        .ok();
}

#[tokio::test]
async fn nats_subject_no_stream_captures_is_retried_not_dead_lettered() {
    let Some(js) = nats().await else { return };
    let publisher = NatsPublisher::new(js);
    let d = delivery(Message::new(
        "order-9-placed",
        format!("outbox_test_nostream_{}.orders", unique()),
        "{}",
    ));
    let e = publisher
        .publish(&d)
        .await
        .expect_err("no stream captures it");
    assert!(!e.is_permanent(), "{e}");
    assert_eq!(e.retry_after_hint(), None);
    assert!(e.to_string().contains("create a stream"), "{e}");
    assert!(e.to_string().contains("order-9-placed"), "{e}");
}

// ---- RabbitMQ ---------------------------------------------------------------------------------

async fn rabbitmq() -> Option<Connection> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connect = Connection::connect(&url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => Some(connection),
        Ok(Err(e)) => unreachable("RabbitMQ", &url, e.to_string()),
        Err(_) => unreachable("RabbitMQ", &url, "timed out".into()),
    }
}

/// An exclusive queue of the test's own (deleted with the connection), on the default
/// exchange under its own name.
async fn queue(connection: &Connection) -> (lapin::Channel, String) {
    let channel = connection.create_channel().await.expect("channel");
    let name = format!("outbox-test-{}", unique());
    channel
        .queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare the test's queue");
    (channel, name)
}

async fn drain(channel: &lapin::Channel, queue: &str) -> Vec<lapin::message::Delivery> {
    let mut got = Vec::new();
    while let Some(m) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        got.push(m.delivery);
    }
    got
}

fn message_id(d: &lapin::message::Delivery) -> Option<&str> {
    d.properties.message_id().as_ref().map(ShortString::as_str)
}

#[tokio::test]
async fn amqp_publish_is_confirmed_with_message_id_headers_and_persistence() {
    let Some(connection) = rabbitmq().await else {
        return;
    };
    let (consumer, queue) = queue(&connection).await;
    let publisher = AmqpPublisher::new(connection.create_channel().await.unwrap(), "")
        .await
        .expect("confirm.select");
    let d = delivery(
        Message::new("order-7-placed", &queue, r#"{"order":7}"#)
            .header("content-type", "application/json")
            .header("x-tenant", "acme"),
    );

    publisher.publish(&d).await.expect("confirmed");

    let got = drain(&consumer, &queue).await;
    assert_eq!(got.len(), 1);
    let m = &got[0];
    assert_eq!(message_id(m), Some("order-7-placed"));
    assert_eq!(*m.properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        m.properties
            .content_type()
            .as_ref()
            .map(ShortString::as_str),
        Some("application/json")
    );
    let headers = m.properties.headers().as_ref().expect("headers").inner();
    assert_eq!(
        headers.get("x-tenant"),
        Some(&AMQPValue::LongString("acme".into()))
    );
    assert_eq!(m.data, br#"{"order":7}"#);
    connection.close(200, "done".into()).await.ok();
}

#[tokio::test]
async fn amqp_unroutable_message_is_returned_and_retried() {
    let Some(connection) = rabbitmq().await else {
        return;
    };
    let (consumer, queue) = queue(&connection).await;
    let publisher = AmqpPublisher::new(connection.create_channel().await.unwrap(), "")
        .await
        .expect("confirm.select");
    let nowhere = format!("outbox-test-nowhere-{}", unique());

    let e = publisher
        .publish(&delivery(Message::new("order-9-placed", &nowhere, "{}")))
        .await
        .expect_err("no queue is bound for the routing key");
    assert!(!e.is_permanent(), "{e}");
    assert!(e.to_string().contains("unroutable"), "{e}");
    assert!(e.to_string().contains("order-9-placed"), "{e}");

    // The return is not taken for the next message's: that one is delivered.
    publisher
        .publish(&delivery(Message::new("order-10-placed", &queue, "{}")))
        .await
        .expect("routable");
    let got = drain(&consumer, &queue).await;
    let ids: Vec<_> = got.iter().map(message_id).collect();
    assert_eq!(ids, [Some("order-10-placed")]);
    connection.close(200, "done".into()).await.ok();
}

// ---- Webhooks ---------------------------------------------------------------------------------

/// One request as the test's server read it.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What the server answers a request: a raw HTTP/1.1 status line and headers, or `None` to
/// hold the connection without answering.
type Answer = Arc<dyn Fn(&Received) -> Option<String> + Send + Sync>;

/// An HTTP/1.1 server on 127.0.0.1:0 recording what it receives.
struct Server {
    url: String,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Server {
    async fn start(answer: impl Fn(&Received) -> Option<String> + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(Mutex::new(Vec::new()));
        let answer: Answer = Arc::new(answer);
        let log = received.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve(socket, answer.clone(), log.clone()));
            }
        });
        Self { url, received }
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

async fn serve(mut socket: TcpStream, answer: Answer, log: Arc<Mutex<Vec<Received>>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .unwrap_or("")
        .to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let request = Received {
        path,
        headers,
        body,
    };
    log.lock().unwrap().push(request.clone());
    match answer(&request) {
        Some(head) => {
            let response = format!("{head}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            socket.write_all(response.as_bytes()).await.ok();
            socket.shutdown().await.ok();
        }
        // Holds the connection open: a receiver that never answers.
        None => tokio::time::sleep(Duration::from_secs(300)).await,
    }
}

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

fn signer() -> StandardWebhooks {
    StandardWebhooks::new(SECRET).unwrap()
}

#[tokio::test]
async fn webhook_post_is_signed_and_carries_the_id_as_idempotency_key_and_webhook_id() {
    let server = Server::start(|_| Some("HTTP/1.1 204 No Content".into())).await;
    let publisher = WebhookPublisher::new(signer());
    let d = delivery(
        Message::new(
            "order-7-paid",
            format!("{}/hooks/orders", server.url),
            r#"{"order":7}"#,
        )
        .header("content-type", "application/json")
        .header("x-tenant", "acme")
        .header("webhook-id", "forged"),
    );

    publisher.publish(&d).await.expect("204 is delivered");

    let received = server.received();
    assert_eq!(received.len(), 1);
    let r = &received[0];
    assert_eq!(r.path, "/hooks/orders");
    assert_eq!(r.body, br#"{"order":7}"#);
    assert_eq!(r.header("idempotency-key"), Some("order-7-paid"));
    assert_eq!(r.header("webhook-id"), Some("order-7-paid"));
    assert_eq!(
        r.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("webhook-id"))
            .count(),
        1,
        "the message's own webhook-id is replaced"
    );
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-tenant"), Some("acme"));
    let lookup = |name: &str| r.header(name).map(str::as_bytes);
    signer()
        .verify(lookup, &r.body, SystemTime::now())
        .expect("the signature verifies with the endpoint's secret");
    let other = StandardWebhooks::new("whsec_b3RoZXIgc2VjcmV0IGtleQ==").unwrap();
    assert!(other.verify(lookup, &r.body, SystemTime::now()).is_err());
}

#[tokio::test]
async fn webhook_503_with_retry_after_is_retried_after_it() {
    let server =
        Server::start(|_| Some("HTTP/1.1 503 Service Unavailable\r\nretry-after: 7".into())).await;
    let publisher = WebhookPublisher::new(signer());
    let d = delivery(Message::new(
        "order-7-paid",
        format!("{}/hooks", server.url),
        "{}",
    ));

    let e = publisher.publish(&d).await.expect_err("503");
    assert!(!e.is_permanent(), "{e}");
    assert_eq!(e.retry_after_hint(), Some(Duration::from_secs(7)));
    assert!(e.to_string().contains("503"), "{e}");
}

#[tokio::test]
async fn webhook_404_is_permanent() {
    let server = Server::start(|_| Some("HTTP/1.1 404 Not Found".into())).await;
    let publisher = WebhookPublisher::new(signer());
    let d = delivery(Message::new(
        "order-7-paid",
        format!("{}/gone", server.url),
        "{}",
    ));

    let e = publisher.publish(&d).await.expect_err("404");
    assert!(e.is_permanent(), "{e}");
    assert!(e.to_string().contains("404"), "{e}");
    assert_eq!(server.received().len(), 1);
}

#[tokio::test]
async fn webhook_redirect_is_permanent_and_not_followed() {
    let server = Server::start(|r| {
        Some(if r.path == "/old" {
            "HTTP/1.1 302 Found\r\nlocation: /new".into()
        } else {
            "HTTP/1.1 204 No Content".into()
        })
    })
    .await;
    let publisher = WebhookPublisher::new(signer());
    let d = delivery(Message::new(
        "order-7-paid",
        format!("{}/old", server.url),
        "{}",
    ));

    let e = publisher.publish(&d).await.expect_err("302");
    assert!(e.is_permanent(), "{e}");
    assert!(e.to_string().contains("302"), "{e}");
    let paths: Vec<String> = server.received().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/old"], "the redirect was not followed");
}

#[tokio::test]
async fn webhook_receiver_that_does_not_answer_is_retried_after_the_timeout() {
    let server = Server::start(|_| None).await;
    let publisher = WebhookPublisher::builder(signer())
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let d = delivery(Message::new(
        "order-7-paid",
        format!("{}/slow", server.url),
        "{}",
    ));

    let e = publisher.publish(&d).await.expect_err("no answer");
    assert!(!e.is_permanent(), "{e}");
    assert_eq!(e.retry_after_hint(), None);
    assert!(e.to_string().contains("no answer within"), "{e}");
}

#[tokio::test]
async fn webhook_refused_connection_is_retried() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    drop(listener);
    let publisher = WebhookPublisher::new(signer());

    let e = publisher
        .publish(&delivery(Message::new("order-7-paid", url, "{}")))
        .await
        .expect_err("nothing listens");
    assert!(!e.is_permanent(), "{e}");
}

#[tokio::test]
async fn webhook_https_without_a_tls_feature_is_retried_and_says_why() {
    let publisher = WebhookPublisher::new(signer());
    let e = publisher
        .publish(&delivery(Message::new(
            "order-7-paid",
            "https://127.0.0.1:9/hooks",
            "{}",
        )))
        .await
        .expect_err("no TLS in this build");
    assert!(!e.is_permanent(), "{e}");
    assert!(e.to_string().contains("scheme is not http"), "{e}");
}

#[tokio::test]
async fn webhook_destination_that_is_not_a_url_is_permanent() {
    let publisher = WebhookPublisher::new(signer());
    let e = publisher
        .publish(&delivery(Message::new(
            "order-7-paid",
            "orders.placed",
            "{}",
        )))
        .await
        .expect_err("not a URL");
    assert!(e.is_permanent(), "{e}");
}

// ---- The relay through each publisher, from PostgreSQL ----------------------------------------

/// An outbox in a schema of its own, migrated.
async fn outbox() -> Option<(PgPool, PostgresOutbox, String)> {
    let url = support::database_url()?;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("connect to DATABASE_URL");
    let schema = format!("outbox_pub_test_{}", unique());
    let outbox = PostgresOutbox::builder(pool.clone())
        .schema(&schema)
        .build()
        .unwrap();
    outbox.migrate().await.expect("migrate the outbox");
    Some((pool, outbox, schema))
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(pool)
        .await
        .ok();
}

/// Enqueues `n` messages to `destination`, each in a committed transaction of its own, and one
/// more in a transaction rolled back. Returns the committed ids and the rolled-back one.
async fn enqueue(
    pool: &PgPool,
    outbox: &PostgresOutbox,
    n: usize,
    destination: impl Fn(usize) -> String,
) -> (BTreeSet<String>, String) {
    let run = unique();
    let mut committed = BTreeSet::new();
    for i in 0..n {
        let id = format!("order-{run}-{i}");
        let mut tx = pool.begin().await.unwrap();
        let message = Message::new(&id, destination(i), format!(r#"{{"order":{i}}}"#))
            .header("content-type", "application/json");
        let enqueued = outbox.enqueue(&mut tx, message).await.unwrap();
        assert_eq!(enqueued, Enqueued::New);
        tx.commit().await.unwrap();
        committed.insert(id);
    }
    let rolled_back = format!("order-{run}-rolled-back");
    let mut tx = pool.begin().await.unwrap();
    let enqueued = outbox
        .enqueue(&mut tx, Message::new(&rolled_back, destination(n), "{}"))
        .await
        .unwrap();
    assert_eq!(enqueued, Enqueued::New);
    tx.rollback().await.unwrap();
    (committed, rolled_back)
}

/// Runs `deliver_batch` until a batch claims nothing; every message must be delivered.
async fn relay_all<P: Publisher>(outbox: &PostgresOutbox, publisher: P, n: usize) {
    let relay = Relay::builder(outbox.clone(), publisher)
        .batch(4)
        .listen(false)
        .build();
    let mut delivered = 0;
    for _ in 0..2 * n + 2 {
        let report = relay.deliver_batch().await.expect("deliver a batch");
        assert_eq!(report.delivered, report.claimed, "{report:?}");
        if report.claimed == 0 {
            break;
        }
        delivered += report.delivered;
    }
    assert_eq!(delivered, n);
}

async fn assert_outbox_says_delivered(
    outbox: &PostgresOutbox,
    committed: &BTreeSet<String>,
    rolled_back: &str,
) {
    for id in committed {
        let record = outbox
            .inspect(id)
            .await
            .unwrap()
            .expect("committed message");
        assert_eq!(record.state, State::Delivered, "{id}");
    }
    assert_eq!(outbox.inspect(rolled_back).await.unwrap(), None);
}

const N: usize = 9;

#[tokio::test]
async fn relay_to_nats_delivers_exactly_the_committed_messages_each_with_its_id() {
    let Some(js) = nats().await else { return };
    let Some((pool, outbox, schema)) = self::outbox().await else {
        return;
    };
    let prefix = format!("outbox_test_{}", unique());
    let stream = stream(&js, &prefix).await;
    let (committed, rolled_back) =
        enqueue(&pool, &outbox, N, |i| format!("{prefix}.orders.{i}")).await;

    relay_all(&outbox, NatsPublisher::new(js.clone()), N).await;

    let got: BTreeSet<String> = stream_messages(&stream)
        .await
        .iter()
        .map(|m| {
            nats_header(m, "Nats-Msg-Id")
                .expect("Nats-Msg-Id")
                .to_owned()
        })
        .collect();
    assert_eq!(stream.get_info().await.unwrap().state.messages, N as u64);
    assert_eq!(got, committed);
    assert_outbox_says_delivered(&outbox, &committed, &rolled_back).await;
    js.delete_stream(stream.cached_info().config.name.clone())
        .await
        .ok();
    drop_schema(&pool, &schema).await;
}

#[tokio::test]
async fn relay_to_rabbitmq_delivers_exactly_the_committed_messages_each_with_its_id() {
    let Some(connection) = rabbitmq().await else {
        return;
    };
    let Some((pool, outbox, schema)) = self::outbox().await else {
        return;
    };
    let (consumer, queue) = queue(&connection).await;
    let (committed, rolled_back) = enqueue(&pool, &outbox, N, |_| queue.clone()).await;
    let channels = [
        connection.create_channel().await.unwrap(),
        connection.create_channel().await.unwrap(),
    ];
    let publisher = AmqpPublisher::with_channels(channels, "").await.unwrap();

    relay_all(&outbox, publisher, N).await;

    let got = drain(&consumer, &queue).await;
    assert_eq!(got.len(), N);
    let ids: BTreeSet<String> = got
        .iter()
        .map(|m| message_id(m).expect("message_id").to_owned())
        .collect();
    assert_eq!(ids, committed);
    assert_outbox_says_delivered(&outbox, &committed, &rolled_back).await;
    connection.close(200, "done".into()).await.ok();
    drop_schema(&pool, &schema).await;
}

#[tokio::test]
async fn relay_to_webhooks_delivers_exactly_the_committed_messages_each_with_its_id() {
    let Some((pool, outbox, schema)) = self::outbox().await else {
        return;
    };
    let server = Server::start(|_| Some("HTTP/1.1 200 OK".into())).await;
    let url = server.url.clone();
    let (committed, rolled_back) = enqueue(&pool, &outbox, N, |i| format!("{url}/hooks/{i}")).await;

    relay_all(&outbox, WebhookPublisher::new(signer()), N).await;

    let received = server.received();
    assert_eq!(received.len(), N);
    let mut ids = BTreeSet::new();
    for r in &received {
        let lookup = |name: &str| r.header(name).map(str::as_bytes);
        signer()
            .verify(lookup, &r.body, SystemTime::now())
            .expect("signed");
        assert_eq!(r.header("idempotency-key"), r.header("webhook-id"));
        ids.insert(r.header("webhook-id").unwrap().to_owned());
    }
    assert_eq!(ids, committed);
    assert_outbox_says_delivered(&outbox, &committed, &rolled_back).await;
    drop_schema(&pool, &schema).await;
}
