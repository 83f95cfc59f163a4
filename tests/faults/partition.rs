//! A replica partitioned from its store mid-handler for longer than its lease, while another
//! replica still reaches the store (DESIGN.md §3: fencing, lease, "What once means").
//!
//! Both replicas run in network namespaces of the test's own, A in one and B in another (their
//! subnets distinct by construction, [`Netns::pair`]); each reaches the store through a TCP
//! forwarder in this test listening on its own store link (PostgreSQL, MySQL and Redis listen on
//! loopback only), and the clients reach each through its own client link. Only A's store link
//! is ever cut. A takes a slow request and its store link is cut; A's lease lapses, B reclaims
//! the key on the client's retry (a new fencing token) and runs it; the link heals; A's handler
//! ends and its completion reaches the store late and is refused by the token. Exactly one
//! answer is recorded (B's), every retry replays it, A's refused completion is logged and counted
//! `lease_lost`, and the handler ran twice, once on each replica: the window the contract names
//! (a reclaim after a lost lease); B's own counters show it ran the key once and replayed it
//! after. A key sent to A during the partition gets a 503 (it never runs unrecorded), and runs
//! once after the heal.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::netns::Netns;
use crate::support::harness::{Resp, Server, sample};

const SERVER: &str = "conformance_axum";
/// The slow request: long enough to outlast the cut, the lapse of A's lease, B's reclaim and
/// the heal, which the test checks happened before A's answer.
const SLOW: &str = "/slow?ms=25000";
const LEASE: &str = "2";
const WHO: &str = "acme:alice";

/// A TCP forwarder from `listen` to `upstream`, for as long as it lives.
struct Forwarder {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Forwarder {
    async fn start(listen: std::net::Ipv4Addr, upstream: (String, u16)) -> Self {
        let listener = tokio::net::TcpListener::bind((listen, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                conns.spawn(async move {
                    let Ok(mut server) =
                        tokio::net::TcpStream::connect((upstream.0.as_str(), upstream.1)).await
                    else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    let _ = client.shutdown().await;
                });
            }
        });
        Self { port, task }
    }
}

/// `url` with its host and port replaced (where replica A reaches the store).
fn via(url: &str, host: std::net::Ipv4Addr, port: u16) -> (String, (String, u16)) {
    let mut parsed = reqwest::Url::parse(url).expect("store URL");
    let upstream = (
        parsed.host_str().expect("host").to_owned(),
        parsed.port().expect("the store URL names its port"),
    );
    parsed.set_host(Some(&host.to_string())).unwrap();
    parsed.set_port(Some(port)).unwrap();
    (parsed.to_string(), upstream)
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 60 s"))
}

async fn state(b: &Server, key: &str) -> Option<String> {
    let r = b
        .get_call(&format!("/admin/records?key={key}"))
        .bearer(WHO)
        .send()
        .await;
    (r.status == 200).then(|| r.json()["state"].as_str().unwrap().to_owned())
}

async fn wait_state(b: &Server, key: &str, wanted: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if state(b, key).await.as_deref() == Some(wanted) {
            return;
        }
        assert!(Instant::now() < deadline, "{key} never became {wanted}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn slow(server: &Server, key: &str) -> Resp {
    server
        .post(SLOW)
        .key(key)
        .bearer(WHO)
        .json(&json!({"n": 1}))
        .send()
        .await
}

async fn metric(server: &Server, name: &str, route: &str) -> f64 {
    let answer = server.get("/metrics").await;
    let text = String::from_utf8_lossy(&answer.body);
    sample(&text, name, &[&format!("route=\"{route}\"")]).unwrap_or(0.0)
}

/// The whole story on one store. `store` is the `--store` value, `url` the store's URL (on
/// loopback), `extra` the options both replicas share (a schema, a prefix).
async fn partitioned_holder_is_fenced(store: &str, url: &str, extra: &[&str]) {
    let Some((ns, b_ns)) = Netns::pair() else {
        return;
    };
    // Each replica's way to the store: a forwarder on the host's end of its store link.
    let (a_url, upstream) = via(url, ns.store.host_ip, 0);
    let a_forwarder = Forwarder::start(ns.store.host_ip, upstream.clone()).await;
    let (a_url, _) = via(&a_url, ns.store.host_ip, a_forwarder.port);
    let b_forwarder = Forwarder::start(b_ns.store.host_ip, upstream).await;
    let (b_url, _) = via(url, b_ns.store.host_ip, b_forwarder.port);

    let options = |url: &str| -> Vec<String> {
        let mut o: Vec<String> = ["--store", store, "--database-url", url, "--lease", LEASE]
            .map(String::from)
            .to_vec();
        o.extend(extra.iter().map(|s| s.to_string()));
        o
    };
    let a_options = options(&a_url);
    let a_options: Vec<&str> = a_options.iter().map(String::as_str).collect();
    let b_options = options(&b_url);
    let b_options: Vec<&str> = b_options.iter().map(String::as_str).collect();
    let a = Server::start_via(
        &ns.exec(),
        SERVER,
        &format!("{}:0", ns.clients.inner_ip),
        &a_options,
        "warn",
    );
    let b = Server::start_via(
        &b_ns.exec(),
        SERVER,
        &format!("{}:0", b_ns.clients.inner_ip),
        &b_options,
        "warn",
    );
    assert_eq!(a.addr.ip(), ns.clients.inner_ip);
    assert_eq!(b.addr.ip(), b_ns.clients.inner_ip);

    let key = format!(
        "partition-{:016x}",
        idempotent_runtime::store::FencingToken::mint().0
    );
    let during = format!("{key}-during");
    let a_call = {
        let a_post = a.post(SLOW).key(&key).bearer(WHO).json(&json!({"n": 1}));
        tokio::spawn(async move { a_post.send().await })
    };
    a.wait_runs(SLOW.split('?').next().unwrap(), 1).await;
    wait_state(&b, &key, "running").await;

    ns.partition_store();
    // A request A takes during the partition: its claim cannot reach the store.
    let during_call = {
        let post = a
            .post("/orders")
            .key(&during)
            .bearer(WHO)
            .json(&json!({"sku": "s", "quantity": 1}));
        tokio::spawn(async move { post.send().await })
    };
    // A's renewals cannot reach the store: its lease lapses, and B sees the key abandoned.
    wait_state(&b, &key, "abandoned").await;
    // The client's retry reaches B, which reclaims the key with a new token and runs it.
    let b_call = {
        let b_post = b.post(SLOW).key(&key).bearer(WHO).json(&json!({"n": 1}));
        tokio::spawn(async move { b_post.send().await })
    };
    b.wait_runs("/slow", 1).await;
    wait_state(&b, &key, "running").await;
    let during_answer = within("a claim during the partition", during_call)
        .await
        .unwrap();
    assert!(
        !a_call.is_finished(),
        "A's slow handler answered before the heal: lengthen {SLOW}"
    );
    ns.heal_store();

    let a_answer = within("A's slow request", a_call).await.unwrap();
    let b_answer = within("B's slow request", b_call).await.unwrap();
    let a_log = a.log();

    // Both ran, each answering its own execution; neither is a replay.
    assert_eq!(a_answer.status, 201, "A: {:?}", a_answer.body);
    assert_eq!(b_answer.status, 201, "B: {:?}", b_answer.body);
    assert!(!a_answer.replayed() && !b_answer.replayed());
    assert_eq!(a.runs("/slow").await, 1);
    assert_eq!(b.runs("/slow").await, 1);
    // A's completion arrived after B's reclaim and was refused by the token.
    assert!(
        a_log.contains("the lease was lost to another request"),
        "A's late completion was not refused as a lost lease; A's log:\n{a_log}"
    );
    assert!(metric(&a, "idempotent_lease_lost_total", "/slow").await >= 1.0);
    assert!(metric(&a, "idempotent_not_recorded_total", "/slow").await >= 1.0);
    // Exactly one answer recorded, B's: every retry, on either replica, replays it.
    for server in [&a, &b] {
        let again = within("a retry", slow(server, &key)).await;
        assert_eq!(again.status, 201);
        assert!(again.replayed(), "{}: a retry ran again", server.name);
        assert_eq!(
            again.json(),
            b_answer.json(),
            "the recorded answer is not B's"
        );
    }
    assert_eq!(a.runs("/slow").await + b.runs("/slow").await, 2);
    assert_eq!(state(&b, &key).await.as_deref(), Some("completed"));
    // 0 double executions on B: its counters say it claimed the key once (by reclaiming it),
    // ran it once, recorded its answer (nothing lost or unrecorded), and replayed it after.
    assert_eq!(b.runs("/slow").await, 1);
    assert_eq!(metric(&b, "idempotent_executed_total", "/slow").await, 1.0);
    assert_eq!(metric(&b, "idempotent_reclaimed_total", "/slow").await, 1.0);
    assert_eq!(metric(&b, "idempotent_replayed_total", "/slow").await, 1.0);
    assert_eq!(
        metric(&b, "idempotent_lease_lost_total", "/slow").await,
        0.0
    );
    assert_eq!(
        metric(&b, "idempotent_not_recorded_total", "/slow").await,
        0.0
    );

    // The request A took during the partition was refused, never run unrecorded; after the
    // heal its retry runs once, and the one after replays.
    during_answer.assert_problem(503, "IDEMPOTENCY_STORE_UNAVAILABLE");
    let order = |server: &Server| {
        server
            .post("/orders")
            .key(&during)
            .bearer(WHO)
            .json(&json!({"sku": "s", "quantity": 1}))
            .send()
    };
    let first = within("the retry after the heal", order(&a)).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    let second = within("the retry after that", order(&b)).await;
    assert!(second.replayed());
    assert_eq!(second.json(), first.json());
    let ran: Value = a.executions().await;
    assert_eq!(ran["/orders"], 1, "{ran}");
    assert_eq!(b.runs("/orders").await, 0);
    drop((a, b, a_forwarder, b_forwarder, ns, b_ns));
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replica_partitioned_past_its_lease_is_fenced_when_it_heals() {
    let Some(schema) = crate::support::Schema::new("partition").await else {
        return;
    };
    partitioned_holder_is_fenced("postgres", &schema.url(), &[]).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_replica_partitioned_past_its_lease_is_fenced_when_it_heals() {
    let Some(url) = crate::support::redis_url() else {
        return;
    };
    let prefix = format!(
        "partition-{:016x}",
        idempotent_runtime::store::FencingToken::mint().0
    );
    partitioned_holder_is_fenced("redis", &url, &["--redis-prefix", &prefix]).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_replica_partitioned_past_its_lease_is_fenced_when_it_heals() {
    let Some(base) = crate::support::mysql_url() else {
        return;
    };
    let db = crate::support::MysqlDatabase::new(&base, "partition");
    partitioned_holder_is_fenced("mysql", &db.url(), &[]).await;
}
