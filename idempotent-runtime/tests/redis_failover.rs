//! A Redis primary failing over to its replica (DESIGN.md §5, "Durability is Redis's"): under
//! load, with and without the store's `wait_for_replicas` option.
//!
//! Each case starts a primary and a replica of its own with `scripts/redis-replica` (daemonized
//! `redis-server`s on free ports, nothing on disk, bounded lifetime; never the shared Redis), the
//! replica replicating through a TCP forwarder in this test. Cutting the forwarder is what makes
//! "acknowledged but not yet replicated" deterministic: every byte the primary writes after the
//! cut stays on the primary's side (stopping the replica with SIGSTOP would not do: the bytes
//! would wait in its socket buffer and be applied when it resumes). Then the primary is killed
//! (SIGKILL), the replica promoted with `REPLICAOF NO ONE`, and a second store connected to it
//! claims every key the first store had acknowledged as completed: a claim that acquires is a
//! record lost, whose retry runs the handler again.
//!
//! Needs `redis-server` and `redis-cli`; without them the test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_REDIS=1`, when it fails.
//!
//! ```text
//! cargo test -p idempotent-runtime --features redis --test redis_failover -- --nocapture
//! ```

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::redis::RedisStore;
use idempotent_runtime::store::{
    Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store, StoreError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

mod support;
use support::redis_required as required;

const SCOPE: ScopeHash = [7; 32];
const WORKERS: usize = 16;
/// Keys completed before the cut: the healthy phase, also what the throughput figures count.
const HEALTHY_KEYS: usize = 3000;
/// Keys whose completion was sent after the cut, before the primary is killed.
const AFTER_CUT: usize = 40;
const WAIT_TIMEOUT: Duration = Duration::from_millis(200);

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/redis-replica")
}

fn tools() -> bool {
    let ok = |name: &str| {
        Command::new(name)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if ok("redis-server") && ok("redis-cli") {
        return true;
    }
    assert!(
        !required(),
        "IDEMPOTENT_REQUIRE_REDIS=1 but redis-server or redis-cli is not installed"
    );
    eprintln!("redis-server or redis-cli is not installed: skipping the failover test");
    false
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn run_script(args: &[&str]) -> String {
    let out = Command::new(script())
        .args(args)
        .env("REDIS_REPLICA_LIFETIME", "300")
        .output()
        .expect("run scripts/redis-replica");
    assert!(
        out.status.success(),
        "scripts/redis-replica {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A primary and its replica, stopped (and their directories removed) on drop, whatever the
/// test's outcome.
struct Pair {
    primary: u16,
    replica: u16,
}

impl Pair {
    fn start(upstream_for_replica: impl FnOnce(u16) -> u16) -> Self {
        let pair = Self {
            primary: free_port(),
            replica: free_port(),
        };
        run_script(&["primary", &pair.primary.to_string()]);
        let upstream = upstream_for_replica(pair.primary);
        run_script(&["replica", &pair.replica.to_string(), &upstream.to_string()]);
        wait_until("the replica did not sync with its primary", || {
            cli(pair.replica, &["INFO", "replication"]).contains("master_link_status:up")
        });
        pair
    }

    fn url(port: u16) -> String {
        format!("redis://127.0.0.1:{port}/0")
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for port in [self.primary, self.replica] {
            let _ = Command::new(script())
                .args(["stop", &port.to_string()])
                .output();
        }
    }
}

/// A TCP forwarder from the replica to its primary that can be cut: after [`cut`], no byte
/// read on either side is forwarded, and the connections are held open (a replica that has
/// fallen behind, not one that has gone away, so the primary still counts it for `WAIT`).
///
/// [`cut`]: Forwarder::cut
struct Forwarder {
    port: u16,
    cut: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let read = tokio::select! {
            biased;
            _ = cut.wait_for(|cut| *cut) => break,
            read = from.read(&mut buf) => read,
        };
        let Ok(n @ 1..) = read else { return };
        if *cut.borrow() {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    // Cut: hold both ends, forwarding nothing, until the test is over.
    std::future::pending::<()>().await;
    drop((from, to));
}

impl Forwarder {
    async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, watch) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                else {
                    continue;
                };
                // As Redis's own sockets: a replica's acknowledgement is a few bytes.
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                conns.spawn(pump(cr, sw, watch.clone()));
                conns.spawn(pump(sr, cw, watch.clone()));
            }
        });
        Self { port, cut, task }
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

fn request(key: &str) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: &SCOPE,
        key,
        quota_bucket: 0,
        fingerprint: Fingerprint {
            version: 1,
            digest: [1; 32],
        },
        token: FencingToken::mint(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
        route: "/failover",
        response_room: 0,
    }
}

#[derive(Default)]
struct Outcomes {
    /// Completions acknowledged (`Ok(true)`), with whether the claim was sent after the cut.
    acknowledged: Vec<(String, bool)>,
    /// Completions answered `NotReplicated` (standing on the primary, not known to be on a
    /// replica), with whether the claim was sent after the cut.
    not_replicated: Vec<(String, bool)>,
    /// Operations that failed otherwise (the primary killed mid-call).
    failed: usize,
}

struct Load {
    outcomes: std::sync::Mutex<Outcomes>,
    cut: AtomicBool,
    stop: AtomicBool,
    /// Completions answered (either way) for claims sent after the cut.
    after_cut: AtomicUsize,
    healthy: AtomicUsize,
}

async fn worker(store: Arc<RedisStore>, load: Arc<Load>, worker: usize) {
    let answer = RecordedResponse::new(201, Vec::new(), "{\"ok\":true}".into());
    let mut n = 0;
    while !load.stop.load(Ordering::SeqCst) {
        n += 1;
        let key = format!("k-{worker}-{n}");
        let after_cut = load.cut.load(Ordering::SeqCst);
        let req = request(&key);
        match store.claim(&req).await {
            Ok(Claim::Acquired) => {}
            _ => {
                load.outcomes.lock().unwrap().failed += 1;
                continue;
            }
        }
        let done = store
            .complete(&SCOPE, &key, req.token, &answer, req.retention)
            .await;
        let mut outcomes = load.outcomes.lock().unwrap();
        match done {
            Ok(true) => outcomes.acknowledged.push((key, after_cut)),
            Err(StoreError::NotReplicated { .. }) => outcomes.not_replicated.push((key, after_cut)),
            _ => outcomes.failed += 1,
        }
        drop(outcomes);
        if after_cut {
            load.after_cut.fetch_add(1, Ordering::SeqCst);
        } else {
            load.healthy.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// What one failover did to the records a store had acknowledged.
struct Failover {
    /// With the option: a completion after the promoted replica lost its scripts (no replica
    /// is left to acknowledge it), and whether it stands completed.
    reloaded: Option<(Result<bool, StoreError>, bool)>,
    /// First requests (claim + completion) a second before the cut, on a healthy pair.
    per_second: f64,
    acknowledged: usize,
    acknowledged_after_cut: usize,
    not_replicated: usize,
    /// Acknowledged completions the promoted replica did not have completed: each retry runs
    /// the handler again.
    lost: usize,
    lost_after_cut: usize,
    /// `NotReplicated` completions the promoted replica did not have completed.
    not_replicated_lost: usize,
    not_replicated_after_cut: usize,
    not_replicated_lost_after_cut: usize,
}

async fn failover(wait: Option<(u32, Duration)>) -> Failover {
    let forwarder: Arc<std::sync::Mutex<Option<Forwarder>>> = Arc::default();
    let pair = {
        let forwarder = Arc::clone(&forwarder);
        let rt = tokio::runtime::Handle::current();
        tokio::task::block_in_place(|| {
            Pair::start(|primary| {
                let f = rt.block_on(Forwarder::start(primary));
                let port = f.port;
                *forwarder.lock().unwrap() = Some(f);
                port
            })
        })
    };
    let prefix = format!("failover-{:016x}", FencingToken::mint().0);
    let mut builder = RedisStore::builder().prefix(&prefix);
    if let Some((replicas, timeout)) = wait {
        builder = builder.wait_for_replicas(replicas, timeout);
    }
    let store = Arc::new(
        builder
            .connect(&Pair::url(pair.primary))
            .await
            .expect("connect to the test primary"),
    );
    let load = Arc::new(Load {
        outcomes: Default::default(),
        cut: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        after_cut: AtomicUsize::new(0),
        healthy: AtomicUsize::new(0),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(worker(Arc::clone(&store), Arc::clone(&load), w)))
        .collect();

    let started = Instant::now();
    let bounded = |what: &'static str| {
        assert!(started.elapsed() < Duration::from_secs(60), "{what}");
    };
    while load.healthy.load(Ordering::SeqCst) < HEALTHY_KEYS {
        bounded("the healthy phase did not finish");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let per_second = load.healthy.load(Ordering::SeqCst) as f64 / started.elapsed().as_secs_f64();

    // The replica falls behind: nothing written from now on reaches it.
    forwarder.lock().unwrap().as_ref().unwrap().cut();
    load.cut.store(true, Ordering::SeqCst);
    while load.after_cut.load(Ordering::SeqCst) < AFTER_CUT {
        bounded("completions after the cut did not come");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The primary dies, the replica is promoted.
    tokio::task::block_in_place(|| run_script(&["kill", &pair.primary.to_string()]));
    load.stop.store(true, Ordering::SeqCst);
    for w in workers {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("a worker did not stop after its primary died")
            .unwrap();
    }
    drop(store);
    tokio::task::block_in_place(|| {
        assert!(cli(pair.replica, &["REPLICAOF", "NO", "ONE"]).contains("OK"));
        wait_until("the replica was not promoted", || {
            cli(pair.replica, &["INFO", "replication"]).contains("role:master")
        });
    });

    // The application reconnects to the new primary; every acknowledged key is retried.
    let promoted = RedisStore::builder()
        .prefix(&prefix)
        .connect(&Pair::url(pair.replica))
        .await
        .expect("connect to the promoted replica");
    let outcomes = std::mem::take(&mut *load.outcomes.lock().unwrap());
    let mut lost = 0;
    let mut lost_after_cut = 0;
    for (key, after_cut) in &outcomes.acknowledged {
        if !completed_on(&promoted, key).await {
            lost += 1;
            lost_after_cut += usize::from(*after_cut);
        }
    }
    let mut not_replicated_lost = 0;
    let mut not_replicated_lost_after_cut = 0;
    for (key, after_cut) in &outcomes.not_replicated {
        if !completed_on(&promoted, key).await {
            not_replicated_lost += 1;
            not_replicated_lost_after_cut += usize::from(*after_cut);
        }
    }
    let mut reloaded = None;
    if let Some((replicas, timeout)) = wait {
        // The promoted replica has no script cache, as after a real failover for a store that
        // stays connected (Sentinel): a waited completion must load its script again, not fail.
        let waited = RedisStore::builder()
            .prefix(&prefix)
            .wait_for_replicas(replicas, timeout)
            .connect(&Pair::url(pair.replica))
            .await
            .expect("connect to the promoted replica");
        let req = request("after-the-failover");
        assert!(matches!(waited.claim(&req).await, Ok(Claim::Acquired)));
        tokio::task::block_in_place(|| {
            assert!(cli(pair.replica, &["SCRIPT", "FLUSH"]).contains("OK"));
        });
        let answer = RecordedResponse::new(201, Vec::new(), "{}".into());
        let done = waited
            .complete(&SCOPE, req.key, req.token, &answer, req.retention)
            .await;
        reloaded = Some((done, completed_on(&promoted, req.key).await));
    }
    drop(forwarder);
    drop(pair);
    Failover {
        reloaded,
        per_second,
        acknowledged: outcomes.acknowledged.len(),
        acknowledged_after_cut: outcomes.acknowledged.iter().filter(|(_, c)| *c).count(),
        not_replicated: outcomes.not_replicated.len(),
        not_replicated_after_cut: outcomes.not_replicated.iter().filter(|(_, c)| *c).count(),
        not_replicated_lost_after_cut,
        lost,
        lost_after_cut,
        not_replicated_lost,
    }
}

/// Whether a retry of `key` on `store` is answered from a completed record. Otherwise the
/// record is lost: either nothing stands and the retry runs the handler at once, or the claim
/// reached the replica without its completion and the retry runs it once the lease lapses.
async fn completed_on(store: &RedisStore, key: &str) -> bool {
    match store.claim(&request(key)).await.expect("claim") {
        Claim::Acquired => false,
        Claim::Standing(s) => matches!(s.state, StandingState::Completed(_)),
    }
}

fn report(what: &str, f: &Failover) {
    eprintln!(
        "{what}: healthy {:.0} first requests/s ({WORKERS} concurrent); acknowledged {} \
         ({} after the cut); not replicated (reported) {}; after the failover: acknowledged \
         and lost {} ({} after the cut), retries that run again {}",
        f.per_second,
        f.acknowledged,
        f.acknowledged_after_cut,
        f.not_replicated,
        f.lost,
        f.lost_after_cut,
        f.lost + f.not_replicated_lost,
    );
}

/// Without `wait_for_replicas`: every completion acknowledged after the replica fell behind is
/// lost by the failover, and its retry runs again (the window the README names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_loses_completions_acknowledged_before_the_replica_had_them() {
    if !tools() {
        return;
    }
    let f = failover(None).await;
    report("without wait_for_replicas", &f);
    assert_eq!(f.not_replicated, 0, "nothing waits, nothing is reported");
    assert!(
        f.acknowledged_after_cut > 0,
        "the load acknowledged nothing after the cut: the test saw no window"
    );
    assert_eq!(
        f.lost_after_cut, f.acknowledged_after_cut,
        "every completion acknowledged after the cut was never replicated, so the promoted \
         replica must not have it"
    );
}

/// With `wait_for_replicas(1, 200 ms)`: no acknowledged completion is lost by the failover;
/// the ones the replica never received were answered `NotReplicated` (reported, counted) and
/// are the only keys whose retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_replicas_no_acknowledged_completion_is_lost_by_a_failover() {
    if !tools() {
        return;
    }
    let f = failover(Some((1, WAIT_TIMEOUT))).await;
    report("with wait_for_replicas(1, 200 ms)", &f);
    assert_eq!(
        f.lost, 0,
        "an acknowledged completion was lost by the failover"
    );
    assert_eq!(
        f.acknowledged_after_cut, 0,
        "acknowledged without the replica"
    );
    assert!(
        f.not_replicated > 0,
        "no completion after the cut was reported unreplicated"
    );
    let (done, completed) = f.reloaded.expect("the completion after the failover");
    assert!(
        matches!(
            done,
            Err(StoreError::NotReplicated {
                acknowledged: 0,
                wanted: 1
            })
        ),
        "a waited completion on the promoted replica without its scripts: {done:?}"
    );
    assert!(completed, "the reloaded completion did not stand");
    // Reported means "not known to be on a replica": a completion that reached the replica
    // just before the cut, whose acknowledgement did not come back, is reported and survives.
    assert!(f.not_replicated_lost <= f.not_replicated);
    assert!(
        f.not_replicated_after_cut >= AFTER_CUT,
        "every completion after the cut is reported unreplicated"
    );
    assert_eq!(
        f.not_replicated_lost_after_cut, f.not_replicated_after_cut,
        "a completion sent after the cut was on the replica"
    );
}

#[tokio::test]
async fn wait_for_replicas_is_refused_on_a_cluster_connection() {
    let refused = RedisStore::builder()
        .wait_for_replicas(1, WAIT_TIMEOUT)
        .connect_cluster(["redis://127.0.0.1:1"])
        .await
        .expect_err("a cluster store that would wait is refused");
    assert!(
        refused.to_string().contains("wait_for_replicas"),
        "{refused}"
    );
}
