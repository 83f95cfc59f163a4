//! The Redis store against a real Redis, standalone and on a three-node Redis Cluster that the
//! test starts itself (DESIGN.md §3, §5).
//!
//! Reads `REDIS_URL` (e.g. `redis://127.0.0.1:6379/0`); when it is unset each test says so and
//! passes, unless `IDEMPOTENT_REQUIRE_REDIS=1`, when it fails. The cluster test needs
//! `redis-server` and `redis-cli` on the `PATH` (same rule). Every test works under a key prefix
//! of its own, so tests run in parallel and across runs.
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379/0 \
//!     cargo test --all-features -p idempotent-runtime --test store_redis
//! ```

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::contract::model::{Op, check_model};
use idempotent_runtime::store::redis::RedisStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store, contract,
};
use idempotent_runtime::test_helpers::record::{self, Verdict};
use idempotent_runtime::test_helpers::store::REDIS_RECORD_HEADER_LEN as RECORD_HEADER_LEN;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

mod support;
use support::{redis_required as required, redis_url};

fn prefix(what: &str) -> String {
    format!("idem-test-{what}-{:016x}", FencingToken::mint().0)
}

/// Deletes every key under `prefix` on `url` (best effort), so runs leave nothing behind.
async fn delete_prefix(url: &str, prefix: &str) {
    let Ok(client) = redis::Client::open(url) else {
        return;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let mut cursor = 0u64;
    loop {
        let Ok((next, keys)): Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
        else {
            return;
        };
        if !keys.is_empty() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint {
        version: 1,
        digest: [n; 32],
    }
}

fn req<'a>(scope: &'a ScopeHash, key: &'a str, lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        quota_bucket: 0,
        fingerprint: fp(1),
        token: FencingToken::mint(),
        lease,
        retention: Duration::from_secs(3600),
        route: "/test",
        response_room: 0,
    }
}

fn response(body: &str) -> RecordedResponse {
    RecordedResponse::new(
        201,
        vec![("content-type".into(), "application/json".into())],
        body.to_owned().into(),
    )
}

fn cases() -> u32 {
    std::env::var("IDEMPOTENT_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), 1u8..5)
            .prop_map(|(key, fp, lease_s)| Op::Claim { key, fp, lease_s }),
        1 => (any::<u8>(), any::<u8>(), 1u8..5, 2u8..9)
            .prop_map(|(key, fp, lease_s, copies)| Op::ClaimConcurrently { key, fp, lease_s, copies }),
        2 => (any::<u8>(), any::<bool>(), 1u8..5)
            .prop_map(|(key, stale, retention_s)| Op::Complete { key, stale, retention_s }),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(key, stale)| Op::Release { key, stale }),
        1 => (any::<u8>(), any::<bool>(), 1u8..5)
            .prop_map(|(key, stale, lease_s)| Op::Renew { key, stale, lease_s }),
        2 => (0u8..4).prop_map(|secs| Op::Advance { secs }),
        1 => Just(Op::Sweep),
    ]
}

/// Random operation sequences against `store` and the reference model, each in a scope of its
/// own (`check_model` makes one).
fn run_model(rt: &tokio::runtime::Runtime, store: Arc<RedisStore>) {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..50), |ops| {
        rt.block_on(async {
            let clock = Arc::clone(&store);
            check_model(
                Arc::clone(&store),
                move |d| clock.advance_clock_for_tests(d),
                &ops,
            )
            .await;
        });
        Ok(())
    });
    if let Err(e) = result {
        panic!("the Redis store disagrees with the reference model: {e}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn passes_the_store_contract_and_agrees_with_the_model() {
    let Some(url) = redis_url() else { return };
    let prefix = prefix("contract");
    let rt = runtime();
    let store = rt.block_on(async {
        Arc::new(
            RedisStore::builder()
                .prefix(&prefix)
                .connect(&url)
                .await
                .expect("connect to REDIS_URL"),
        )
    });
    rt.block_on(async {
        let clock = Arc::clone(&store);
        contract::run_self_expiring(Arc::clone(&store), move |d| {
            clock.advance_clock_for_tests(d)
        })
        .await;
    });
    run_model(&rt, Arc::clone(&store));
    rt.block_on(delete_prefix(&url, &prefix));
}

#[tokio::test]
async fn a_first_request_is_one_round_trip_and_a_replay_one() {
    let Some(url) = redis_url() else { return };
    let prefix = prefix("trips");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let same = |f: &Fingerprint| *f == fp(1);
    let first = req(&scope, "order-1", Duration::from_secs(30));
    let before = store.round_trips();
    assert_eq!(
        record::claim(&store, &first, same).await.unwrap(),
        Verdict::Acquired { reclaimed: false }
    );
    assert_eq!(
        store.round_trips() - before,
        1,
        "a first claim is one script"
    );
    assert!(
        store
            .complete(
                &scope,
                "order-1",
                first.token,
                &response("{}"),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
    );
    let before = store.round_trips();
    assert_eq!(
        record::claim(
            &store,
            &req(&scope, "order-1", Duration::from_secs(30)),
            same
        )
        .await
        .unwrap(),
        Verdict::Replay(Arc::new(response("{}")))
    );
    assert_eq!(store.round_trips() - before, 1, "a replay is one script");
    delete_prefix(&url, &prefix).await;
}

#[tokio::test]
async fn records_round_trip_byte_for_byte_in_their_compact_layout_with_a_ttl() {
    let Some(url) = redis_url() else { return };
    let prefix = prefix("layout");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let r = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let redis_key = store.redis_key(&scope, "k");
    assert!(
        redis_key.starts_with(&format!("{prefix}:{{")),
        "{redis_key}"
    );
    let len: usize = redis::cmd("STRLEN")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(len, RECORD_HEADER_LEN, "a reservation is its header alone");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        ttl > 3_600_000 && ttl <= 3_630_000,
        "a reservation lives lease + retention: {ttl} ms"
    );

    let recorded = RecordedResponse::new(
        409,
        vec![
            ("content-type".into(), "application/octet-stream".into()),
            ("etag".into(), "".into()),
        ],
        (0..=255u8).collect::<Vec<_>>().into(),
    );
    assert!(
        store
            .complete(&scope, "k", r.token, &recorded, Duration::from_secs(60))
            .await
            .unwrap()
    );
    let len: usize = redis::cmd("STRLEN")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        len,
        RECORD_HEADER_LEN + recorded.encode_headers().len() + 256,
        "a completed record is its header, its encoded headers and its body"
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        ttl > 55_000 && ttl <= 60_000,
        "a completed record lives its retention: {ttl} ms"
    );
    match store
        .claim(&req(&scope, "k", Duration::from_secs(30)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => {
            assert_eq!(st.token, r.token);
            assert_eq!(st.state, StandingState::Completed(Arc::new(recorded)))
        }
        Claim::Acquired => panic!("completed key acquired"),
    }
    delete_prefix(&url, &prefix).await;
}

/// DESIGN.md §3: a handler runs once while the store is reachable. A connection Redis closed
/// (a restart, a failover, `CLIENT KILL`, an idle timeout) must not fail a completion, renewal
/// or release: each is sent again on a fresh connection, which is safe because each is
/// conditional on the token and answers the same when its first send had landed.
#[tokio::test]
async fn token_conditional_writes_survive_connections_redis_closed() {
    let Some(url) = redis_url() else { return };
    // A database number of its own, to find this test's connections in CLIENT LIST.
    let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
    let url = format!("{base}/13");
    let prefix = prefix("killed");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let mut admin = redis::Client::open(format!("{base}/0"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let (done, renewed, released) = (
        req(&scope, "done", Duration::from_secs(30)),
        req(&scope, "renewed", Duration::from_secs(30)),
        req(&scope, "released", Duration::from_secs(30)),
    );
    for r in [&done, &renewed, &released] {
        assert_eq!(store.claim(r).await.unwrap(), Claim::Acquired);
    }
    let mut kill = async || {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut admin)
            .await
            .unwrap();
        let ids: Vec<String> = list
            .lines()
            .filter(|l| l.split(' ').any(|f| f == "db=13"))
            .filter_map(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
            .map(str::to_owned)
            .collect();
        assert!(!ids.is_empty(), "the store holds no connection to kill");
        for id in ids {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async(&mut admin)
                .await
                .unwrap();
        }
    };

    kill().await;
    let completed = store
        .complete(
            &scope,
            "done",
            done.token,
            &response("{}"),
            Duration::from_secs(60),
        )
        .await;
    assert!(
        matches!(completed, Ok(true)),
        "completion on a closed connection: {completed:?}"
    );
    kill().await;
    let renew = store
        .renew(&scope, "renewed", renewed.token, Duration::from_secs(30))
        .await;
    assert!(
        matches!(renew, Ok(true)),
        "renewal on a closed connection: {renew:?}"
    );
    kill().await;
    let release = store.release(&scope, "released", released.token).await;
    assert!(
        matches!(release, Ok(true)),
        "release on a closed connection: {release:?}"
    );
    kill().await;
    let again = req(&scope, "fresh", Duration::from_secs(30));
    assert_eq!(
        store.claim(&again).await.unwrap(),
        Claim::Acquired,
        "a claim on a closed connection"
    );
    match store
        .claim(&req(&scope, "done", Duration::from_secs(30)))
        .await
        .unwrap()
    {
        Claim::Standing(st) => assert!(
            matches!(st.state, StandingState::Completed(_)),
            "{:?}",
            st.state
        ),
        Claim::Acquired => panic!("the completed key ran again"),
    }
    delete_prefix(&url, &prefix).await;
}

#[tokio::test]
async fn resent_operations_answer_as_their_first_send_did() {
    // What a resend after a lost reply meets: the first send's own effect.
    let Some(url) = redis_url() else { return };
    let prefix = prefix("resend");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let r = req(&scope, "k", Duration::from_secs(30));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired);
    assert_eq!(
        store.claim(&r).await.unwrap(),
        Claim::Acquired,
        "a claim that finds its own token acquired"
    );
    assert_eq!(
        store.reclaim(&r, FencingToken(1)).await.unwrap(),
        Claim::Acquired,
        "so does a reclaim"
    );
    delete_prefix(&url, &prefix).await;
}

#[tokio::test]
async fn a_bad_prefix_is_refused() {
    let Some(url) = redis_url() else { return };
    let err = RedisStore::builder()
        .prefix("a{b}")
        .connect(&url)
        .await
        .expect_err("a prefix with braces was accepted");
    assert!(err.to_string().contains("prefix"), "{err}");
}

/// Three `redis-server` cluster nodes on free local ports, in a temporary directory; shut down
/// and removed on drop.
struct Cluster {
    nodes: Vec<Child>,
    ports: Vec<u16>,
    dir: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port_pair() -> u16 {
    // The cluster bus listens on port + 10000.
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn tool(name: &str) -> bool {
    Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Cluster {
    fn start() -> Option<Self> {
        if !tool("redis-server") || !tool("redis-cli") {
            assert!(
                !required(),
                "IDEMPOTENT_REQUIRE_REDIS=1 but redis-server or redis-cli is not installed"
            );
            eprintln!("redis-server or redis-cli is not installed: skipping the cluster test");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "idempotent-cluster-{:016x}",
            FencingToken::mint().0
        ));
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let mut cluster = Self {
            nodes: Vec::new(),
            ports: Vec::new(),
            dir,
        };
        for _ in 0..3 {
            let port = free_port_pair();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&cluster.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            cluster.nodes.push(child);
            cluster.ports.push(port);
        }
        for &port in &cluster.ports {
            wait_for(|| cli(port, &["PING"]).is_some_and(|o| o.contains("PONG")));
        }
        let addrs: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli --cluster create");
        assert!(status.success(), "redis-cli --cluster create failed");
        for &port in &cluster.ports {
            wait_for(|| {
                cli(port, &["CLUSTER", "INFO"]).is_some_and(|o| o.contains("cluster_state:ok"))
            });
        }
        Some(cluster)
    }

    fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }
}

fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn wait_for(mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the test cluster did not come up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn passes_the_store_contract_and_agrees_with_the_model_on_a_three_node_cluster() {
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let rt = runtime();
    let store = rt.block_on(async {
        Arc::new(
            RedisStore::builder()
                .prefix(prefix("cluster"))
                .connect_cluster(cluster.urls())
                .await
                .expect("connect to the test cluster"),
        )
    });
    rt.block_on(async {
        let clock = Arc::clone(&store);
        contract::run_self_expiring(Arc::clone(&store), move |d| {
            clock.advance_clock_for_tests(d)
        })
        .await;
        // Scopes spread over the nodes: every node holds records.
        let mut per_node = Vec::new();
        for &port in &cluster.ports {
            let keys = cli(port, &["DBSIZE"])
                .and_then(|o| o.trim().parse::<u64>().ok())
                .unwrap_or(0);
            per_node.push(keys);
        }
        assert!(
            per_node.iter().all(|&n| n > 0),
            "records did not spread over the cluster: {per_node:?}"
        );
    });
    run_model(&rt, Arc::clone(&store));
    drop(store);
    drop(rt);
    drop(cluster);
}

/// One standalone `redis-server` of the test's own on a free local port (so the test may set
/// its `maxmemory`), in a temporary directory; shut down and removed on drop.
struct Standalone {
    node: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let _ = self.node.kill();
        let _ = self.node.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Standalone {
    fn start() -> Option<Self> {
        if !tool("redis-server") || !tool("redis-cli") {
            assert!(
                !required(),
                "IDEMPOTENT_REQUIRE_REDIS=1 but redis-server or redis-cli is not installed"
            );
            eprintln!("redis-server or redis-cli is not installed: skipping");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "idempotent-standalone-{:016x}",
            FencingToken::mint().0
        ));
        std::fs::create_dir_all(&dir).expect("server dir");
        let port = free_port_pair();
        let node = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let server = Self { node, port, dir };
        wait_for(|| cli(port, &["PING"]).is_some_and(|o| o.contains("PONG")));
        Some(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// `used_memory` from `INFO memory`: what `maxmemory` is compared with.
    fn used_memory(&self) -> u64 {
        let info = cli(self.port, &["INFO", "memory"]).expect("INFO memory");
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("used_memory in INFO memory")
    }

    /// Refuses writes once `used_memory` passes `bytes` (`noeviction`).
    fn limit_memory(&self, bytes: u64) {
        for args in [
            ["CONFIG", "SET", "maxmemory-policy", "noeviction"],
            ["CONFIG", "SET", "maxmemory", &bytes.to_string()],
        ] {
            let out = cli(self.port, &args).expect("CONFIG SET");
            assert!(out.contains("OK"), "{args:?}: {out}");
        }
    }
}

/// DESIGN.md §5: a claim Redis accepts is one whose answer it will take. With `maxmemory` and
/// `noeviction` near the limit, 30 keys of an endpoint whose answers are up to 200 KB: every
/// claim that acquired completes with its 200 KB answer (none refused with OOM, which would
/// release the key and let the retry run the handler again), and the claims Redis had no room
/// for were refused at the claim, before any handler would run.
#[tokio::test]
async fn at_maxmemory_a_claimed_answer_is_never_refused_and_refusals_come_at_the_claim() {
    let Some(server) = Standalone::start() else {
        return;
    };
    const KEYS: usize = 30;
    const ANSWER: usize = 200_000;
    let store = RedisStore::builder()
        .prefix(prefix("maxmemory"))
        .connect(&server.url())
        .await
        .unwrap();
    // Room for a handful of answers, not thirty.
    server.limit_memory(server.used_memory() + 2_000_000);
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let keys: Vec<String> = (0..KEYS).map(|k| format!("big-{k}")).collect();
    let mut acquired = Vec::new();
    let mut refused = 0;
    for key in &keys {
        let mut r = req(&scope, key, Duration::from_secs(30));
        r.response_room = ANSWER;
        match store.claim(&r).await {
            Ok(Claim::Acquired) => acquired.push(r),
            Err(idempotent_runtime::store::StoreError::Full) => refused += 1,
            other => panic!("claim of {key}: {other:?}"),
        }
    }
    let answer = RecordedResponse::new(
        200,
        vec![("content-type".into(), "application/octet-stream".into())],
        vec![b'a'; ANSWER].into(),
    );
    for (completed, r) in acquired.iter().enumerate() {
        let done = store
            .complete(&scope, r.key, r.token, &answer, Duration::from_secs(600))
            .await;
        assert!(
            matches!(done, Ok(true)),
            "the completion of claimed {} was refused after {completed} of {} claimed \
             completed ({refused} claims refused): {done:?}",
            r.key,
            acquired.len()
        );
    }
    eprintln!(
        "{} of {KEYS} claims acquired and completed, {refused} refused at the claim",
        acquired.len()
    );
    assert_eq!(acquired.len() + refused, KEYS);
    assert!(
        !acquired.is_empty() && refused > 0,
        "the limit admitted {} of {KEYS} claims: the test did not reach maxmemory",
        acquired.len()
    );
    // Every recorded answer replays whole; every refused key is free (nothing stands).
    for key in &keys {
        let got = store
            .claim(&req(&scope, key, Duration::from_secs(30)))
            .await;
        let was_claimed = acquired.iter().any(|r| r.key == key.as_str());
        match got {
            Ok(Claim::Standing(st)) if was_claimed => assert_eq!(
                st.state,
                StandingState::Completed(Arc::new(answer.clone())),
                "{key}"
            ),
            // At the limit a fresh claim of a refused key is refused again, or (once memory
            // was freed) acquires: never a record left standing by the refusal.
            Err(idempotent_runtime::store::StoreError::Full) | Ok(Claim::Acquired)
                if !was_claimed => {}
            other => panic!("{key} (claimed: {was_claimed}) after the run: {other:?}"),
        }
    }
}

/// Marks the claims [`HoldingProxy`] holds: the route, an argument of the claim script only.
const HELD_ROUTE: &str = "/held-claim";

/// A chunk held back, with the upstream connection to Redis it was sent on.
type Held = (tokio::net::TcpStream, Vec<u8>);

/// A TCP proxy in front of a Redis that, while holding, keeps back every chunk a client sends
/// that carries [`HELD_ROUTE`] and closes that client's connection, as a network or a busy
/// server leaves a command queued on a connection the client has given up on. [`deliver`]
/// later sends the held chunks to Redis on their own (still open) upstream connections.
///
/// [`deliver`]: HoldingProxy::deliver
struct HoldingProxy {
    port: u16,
    held: Arc<tokio::sync::Mutex<Vec<Held>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HoldingProxy {
    /// A proxy to the Redis on `upstream` that holds the first `hold_at_most` marked chunks
    /// and forwards the ones after them like any other.
    async fn start(upstream: u16, hold_at_most: usize) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held: Arc<tokio::sync::Mutex<Vec<_>>> = Arc::default();
        let keep = Arc::clone(&held);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let held = Arc::clone(&keep);
                tokio::spawn(async move {
                    let Ok(mut server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut up, mut down) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
                    loop {
                        tokio::select! {
                            n = client.read(&mut up) => {
                                let Ok(n @ 1..) = n else { return };
                                let chunk = &up[..n];
                                let marked = chunk.windows(HELD_ROUTE.len()).any(|w| w == HELD_ROUTE.as_bytes());
                                let mut held = held.lock().await;
                                if marked && held.len() < hold_at_most {
                                    // The client's connection closes here; Redis's stays open.
                                    held.push((server, chunk.to_vec()));
                                    return;
                                }
                                drop(held);
                                if server.write_all(chunk).await.is_err() { return }
                            }
                            n = server.read(&mut down) => {
                                let Ok(n @ 1..) = n else { return };
                                if client.write_all(&down[..n]).await.is_err() { return }
                            }
                        }
                    }
                });
            }
        });
        Self { port, held, task }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Sends every held chunk to Redis on its own connection and waits for Redis's reply to
    /// each; returns how many there were.
    async fn deliver(&self) -> usize {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut held = self.held.lock().await;
        for (server, chunk) in held.iter_mut() {
            server.write_all(chunk).await.unwrap();
            let mut reply = [0u8; 256];
            let n = tokio::time::timeout(Duration::from_secs(10), server.read(&mut reply))
                .await
                .expect("Redis answers a delivered claim")
                .unwrap();
            assert!(n > 0, "Redis closed a held connection");
        }
        held.len()
    }
}

/// DESIGN.md §3 "Renewal outlives outages": a claim whose outcome is unknown is released before
/// its 503, and the release must hold even when the claim reaches Redis after it. The claim's
/// connection fails while the claim is still on its way (held by a proxy, as a network or a
/// busy server holds it), the connection manager reconnects and the release runs first on the
/// new connection; then the held claim lands. The key must not stand for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_reaches_redis_after_its_release_does_not_stand() {
    let Some(server) = Standalone::start() else {
        return;
    };
    let proxy = HoldingProxy::start(server.port, usize::MAX).await;
    let prefix = prefix("late-claim");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&proxy.url())
        .await
        .unwrap();
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let mut first = req(&scope, "late", Duration::from_secs(30));
    first.route = HELD_ROUTE;
    let claimed = store.claim(&first).await;
    assert!(
        matches!(
            claimed,
            Err(idempotent_runtime::store::StoreError::Unavailable(_))
        ),
        "a claim whose connections all failed: {claimed:?}"
    );
    // What the pipeline does before answering 503 (pipeline::claim::claim_failed).
    let released = store.release(&scope, "late", first.token).await;
    assert!(
        matches!(released, Ok(false)),
        "the release found the claim: {released:?}"
    );
    let held = proxy.deliver().await;
    assert!(held >= 1, "the proxy held no claim");

    // The client's retry, with a fresh token, on a connection of its own.
    let direct = RedisStore::builder()
        .prefix(&prefix)
        .connect(&server.url())
        .await
        .unwrap();
    let retry = req(&scope, "late", Duration::from_secs(30));
    match direct.claim(&retry).await.unwrap() {
        Claim::Acquired => {}
        Claim::Standing(st) => panic!(
            "after its release, the claim that arrived late ({held} copies) stands: {:?} \
             (token {}, the released claim's {})",
            st.state, st.token.0, first.token.0
        ),
    }
    assert!(
        direct
            .complete(
                &scope,
                "late",
                retry.token,
                &response("{}"),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        "the retry holds the key"
    );
}

/// The same when the resent claim is refused for room: its first copy, still on its way, must
/// not stand either (the pipeline releases only after an unknown outcome, not after 503
/// `IDEMPOTENCY_STORE_FULL`, so the store leaves the tombstone itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_refused_for_room_on_its_resend_leaves_no_late_copy_standing() {
    let Some(server) = Standalone::start() else {
        return;
    };
    let proxy = HoldingProxy::start(server.port, 1).await;
    let prefix = prefix("late-full");
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&proxy.url())
        .await
        .unwrap();
    server.limit_memory(server.used_memory() / 2);
    let scope = idempotent_runtime::test_helpers::store::fresh_scope();
    let mut first = req(&scope, "late", Duration::from_secs(30));
    first.route = HELD_ROUTE;
    let claimed = store.claim(&first).await;
    assert!(
        matches!(claimed, Err(idempotent_runtime::store::StoreError::Full)),
        "a resent claim over maxmemory: {claimed:?}"
    );
    server.limit_memory(0);
    assert_eq!(proxy.deliver().await, 1, "the proxy held the first send");
    let retry = req(&scope, "late", Duration::from_secs(30));
    match store.claim(&retry).await.unwrap() {
        Claim::Acquired => {}
        Claim::Standing(st) => panic!(
            "the first send of a claim refused for room stands: {:?} (its token: {})",
            st.state,
            st.token == first.token
        ),
    }
}
