//! Both conformance servers on a Redis at `maxmemory` (DESIGN.md §5 Redis: a claim Redis
//! accepts is one whose answer it will take). Each run starts a `redis-server` of its own on a
//! free port, so the test may set its `maxmemory`; it needs `redis-server` and `redis-cli` on
//! the `PATH` and skips without them, unless `IDEMPOTENT_REQUIRE_REDIS=1`, when it fails.
//!
//! ```text
//! cargo test --all-features -p idempotent-examples --test stores redis_maxmemory::
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::harness::{SERVERS, Server};
use crate::support::{free_port, required};

/// A `redis-server` of the test's own; killed and its directory removed on drop.
struct Redis {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
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

impl Redis {
    fn start() -> Option<Self> {
        let installed = |name: &str| {
            Command::new(name)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !installed("redis-server") || !installed("redis-cli") {
            assert!(
                !required("IDEMPOTENT_REQUIRE_REDIS"),
                "IDEMPOTENT_REQUIRE_REDIS=1 but redis-server or redis-cli is not installed"
            );
            eprintln!("redis-server or redis-cli is not installed: skipping");
            return None;
        }
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "idempotent-maxmemory-{:016x}",
            idempotent_runtime::store::FencingToken::mint().0
        ));
        std::fs::create_dir_all(&dir).expect("server dir");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let redis = Self { child, port, dir };
        let start = Instant::now();
        while !cli(port, &["PING"]).is_some_and(|o| o.contains("PONG")) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(redis)
    }

    fn used_memory(&self) -> u64 {
        cli(self.port, &["INFO", "memory"])
            .and_then(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("used_memory:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .expect("used_memory")
    }

    fn limit_memory(&self, bytes: u64) {
        for (name, value) in [
            ("maxmemory-policy", "noeviction".to_owned()),
            ("maxmemory", bytes.to_string()),
        ] {
            let out = cli(self.port, &["CONFIG", "SET", name, &value]).expect("CONFIG SET");
            assert!(out.contains("OK"), "CONFIG SET {name}: {out}");
        }
    }
}

/// 30 keys to `/big?bytes=200000` on a Redis with room for a handful of such answers, then an
/// immediate retry of each: every key's handler ran at most once. A first request either ran
/// and was recorded (its retry is a replay of the same bytes) or was refused with 503
/// `IDEMPOTENCY_STORE_FULL` before its handler ran; never run, unrecorded and run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_maxmemory_no_handler_runs_twice() {
    const KEYS: usize = 30;
    const BYTES: usize = 200_000;
    for &name in SERVERS {
        let Some(redis) = Redis::start() else {
            return;
        };
        let url = format!("redis://127.0.0.1:{}/0", redis.port);
        let server = Server::start(
            name,
            &[
                "--store",
                "redis",
                "--database-url",
                &url,
                "--max-response",
                &BYTES.to_string(),
            ],
        );
        redis.limit_memory(redis.used_memory() + 2_000_000);
        let path = format!("/big?bytes={BYTES}");
        let mut ran: HashMap<String, usize> = HashMap::new();
        let (mut recorded, mut refused) = (0, 0);
        for k in 0..KEYS {
            let key = format!("big-{k}");
            let first = server.post(&path).key(&key).send().await;
            let retry = server.post(&path).key(&key).send().await;
            for resp in [&first, &retry] {
                match resp.status {
                    200 if !resp.replayed() => {
                        assert_eq!(resp.body.len(), BYTES, "{name} {key}");
                        *ran.entry(key.clone()).or_default() += 1;
                    }
                    200 => assert_eq!(resp.body.len(), BYTES, "{name} {key}: a replay"),
                    503 => resp.assert_problem(503, "IDEMPOTENCY_STORE_FULL"),
                    other => panic!("{name} {key}: {other} {:?}", resp.body),
                }
            }
            match (
                first.status,
                first.replayed(),
                retry.status,
                retry.replayed(),
            ) {
                (200, false, 200, true) => recorded += 1,
                (503, _, 503, _) => refused += 1,
                // Refused first, room freed meanwhile: the retry is the first run.
                (503, _, 200, false) => {}
                _ => panic!(
                    "{name} {key}: first {} (replayed {}), retry {} (replayed {}): the handler \
                     ran {} times",
                    first.status,
                    first.replayed(),
                    retry.status,
                    retry.replayed(),
                    ran.get(&key).copied().unwrap_or(0)
                ),
            }
        }
        let executed = server.runs("/big").await;
        eprintln!(
            "{name}: {executed} executed, {recorded} recorded and replayed, {refused} refused \
             twice, of {KEYS} keys"
        );
        assert_eq!(
            executed as usize,
            ran.len(),
            "{name}: handler runs ({executed}) against keys that ran ({})",
            ran.len()
        );
        assert!(
            ran.values().all(|&n| n == 1),
            "{name}: a handler ran twice: {ran:?}"
        );
        assert!(
            recorded > 0 && refused > 0,
            "{name}: the test did not reach maxmemory ({recorded} recorded, {refused} refused)"
        );
    }
}
