//! Plain functions run once per key (`Once::new`, DESIGN.md §6), on every store that
//! runs here: the memory store, the cache in front of it, SQLite, PostgreSQL and Redis
//! (`DATABASE_URL`, `REDIS_URL`; skipped when unset unless CI's `IDEMPOTENT_REQUIRE_*` says
//! otherwise). Each store gets the same cases: 64 concurrent callers with one key, a changed
//! input, an error and a panic releasing the key, waiting for a running call.
//!
//! ```text
//! cargo test -p idempotent-runtime --all-features --test once
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent_runtime::Idempotency;
use idempotent_runtime::once::{Once, OnceError};
use idempotent_runtime::scope::{ClientId, Identity, Scope};
use idempotent_runtime::store::cache::CachedStore;
use idempotent_runtime::store::memory::MemoryStore;
use idempotent_runtime::store::{FencingToken, Store};
use serde::{Deserialize, Serialize};

mod support;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Charge {
    id: String,
    amount: u64,
}

fn job(name: &str) -> Scope {
    Scope::from_identity(&Identity::client(ClientId::OAuth(name.to_owned())), None).unwrap()
}

fn handle(store: impl Store) -> Idempotency {
    Idempotency::builder(store).sweeper(false).build()
}

/// Every case against one store. `unique` keeps keys apart from earlier runs on shared stores.
async fn cases(idempotency: &Idempotency, unique: &str) {
    let billing = job(&format!("billing-{unique}"));
    let runs = Arc::new(AtomicUsize::new(0));
    let charge = |amount: u64| {
        let runs = Arc::clone(&runs);
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok::<_, std::io::Error>(Charge {
                id: format!("ch_{amount}"),
                amount,
            })
        }
    };

    // 64 callers at once: one runs, the others get its output or "in progress".
    let calls = (0..64).map(|_| {
        Once::new(idempotency, &billing, "invoice-1")
            .name("charge")
            .run(&1200u64, charge(1200))
    });
    let results = futures_util::future::join_all(calls).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the function ran once");
    let mut outputs = 0;
    for result in &results {
        match result {
            Ok(charge) => {
                assert_eq!(
                    charge,
                    &Charge {
                        id: "ch_1200".into(),
                        amount: 1200
                    }
                );
                outputs += 1;
            }
            Err(OnceError::InProgress { retry_after }) => {
                assert!(*retry_after >= Duration::from_secs(1));
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert!(outputs >= 1);
    // Later calls return the recorded output without running.
    let again = Once::new(idempotency, &billing, "invoice-1")
        .name("charge")
        .run(&1200u64, charge(1200))
        .await
        .unwrap();
    assert_eq!(again.id, "ch_1200");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Another input, or another function, under the same key is refused.
    let changed = Once::new(idempotency, &billing, "invoice-1")
        .name("charge")
        .run(&999u64, charge(999))
        .await;
    assert!(
        matches!(changed, Err(OnceError::InputChanged)),
        "{changed:?}"
    );
    let renamed = Once::new(idempotency, &billing, "invoice-1")
        .name("refund")
        .run(&1200u64, charge(1200))
        .await;
    assert!(
        matches!(renamed, Err(OnceError::InputChanged)),
        "{renamed:?}"
    );
    // Another scope is another key space.
    let other = Once::new(idempotency, &job(&format!("payroll-{unique}")), "invoice-1")
        .name("charge")
        .run(&1200u64, charge(1200))
        .await;
    assert!(other.is_ok());
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // A map's order does not change the input.
    let a: HashMap<String, u64> = (0..32).map(|i| (format!("k{i}"), i)).collect();
    let b: HashMap<String, u64> = (0..32).rev().map(|i| (format!("k{i}"), i)).collect();
    let first = Once::new(idempotency, &billing, "map").run(&a, || async { Ok::<_, ()>(1u8) });
    assert_eq!(first.await.unwrap(), 1);
    let second = Once::new(idempotency, &billing, "map").run(&b, || async { Ok::<_, ()>(2u8) });
    assert_eq!(
        second.await.unwrap(),
        1,
        "the same input: the recorded output"
    );

    // An error releases the key: the next call runs.
    let failed = Once::new(idempotency, &billing, "flaky")
        .run("x", || async { Err::<u8, _>("provider down") })
        .await;
    assert!(matches!(failed, Err(OnceError::Failed("provider down"))));
    let retried =
        Once::new(idempotency, &billing, "flaky").run("x", || async { Ok::<_, &str>(7u8) });
    assert_eq!(retried.await.unwrap(), 7);

    // A panic releases the key too.
    let panicked = Once::new(idempotency, &billing, "panics")
        .run("x", || async {
            if true {
                panic!("on purpose");
            }
            Ok::<u8, ()>(0)
        })
        .await;
    assert!(matches!(panicked, Err(OnceError::Panicked)));
    let after = Once::new(idempotency, &billing, "panics").run("x", || async { Ok::<_, ()>(3u8) });
    assert_eq!(after.await.unwrap(), 3);

    // Waiting: all 64 callers get the output.
    let waited = Arc::new(AtomicUsize::new(0));
    let calls = (0..64).map(|_| {
        let waited = Arc::clone(&waited);
        Once::new(idempotency, &billing, "waits")
            .wait(Duration::from_secs(20))
            .run("x", move || async move {
                waited.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, ()>(42u32)
            })
    });
    let results = futures_util::future::join_all(calls).await;
    assert!(results.iter().all(|r| matches!(r, Ok(42))), "{results:?}");
    assert_eq!(waited.load(Ordering::SeqCst), 1);

    // A bad key is refused before anything runs.
    let bad = Once::new(idempotency, &billing, "two words").run("x", || async { Ok::<_, ()>(0u8) });
    assert!(matches!(bad.await, Err(OnceError::InvalidKey(_))));
    // A dropped call (the caller gave up) leaves the key to the next one after its lease.
    let short = Once::new(idempotency, &billing, "dropped")
        .lease(Duration::from_millis(300))
        .run("x", std::future::pending::<Result<u8, ()>>);
    assert!(
        tokio::time::timeout(Duration::from_millis(50), short)
            .await
            .is_err()
    );
    // A crash mid-function: nothing runs after it (no destructor, no renewal), as under
    // SIGKILL. The key stands until its lease lapses; then the next call runs it once.
    let crashed_runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&crashed_runs);
    let mut crashing = Box::pin(
        Once::new(idempotency, &billing, "crash")
            .lease(Duration::from_millis(600))
            .run("x", move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<Result<u8, ()>>().await
            }),
    );
    let started = tokio::time::timeout(Duration::from_millis(300), crashing.as_mut()).await;
    assert!(started.is_err(), "the function is running");
    std::mem::forget(crashing);
    let during = Once::new(idempotency, &billing, "crash").run("x", || async { Ok::<_, ()>(9u8) });
    assert!(
        matches!(during.await, Err(OnceError::InProgress { .. })),
        "held by its lease"
    );
    let counted = Arc::clone(&crashed_runs);
    let after = Once::new(idempotency, &billing, "crash")
        .wait(Duration::from_secs(10))
        .run("x", move || async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(9u8)
        });
    assert_eq!(after.await.unwrap(), 9, "run again once the lease lapsed");
    assert_eq!(
        crashed_runs.load(Ordering::SeqCst),
        2,
        "the crashed run and one more"
    );
    let replay = Once::new(idempotency, &billing, "crash").run("x", || async { Ok::<_, ()>(0u8) });
    assert_eq!(replay.await.unwrap(), 9);

    // Its key is released when it is dropped, or lapses with its lease: the next call runs.
    let value = Once::new(idempotency, &billing, "dropped")
        .wait(Duration::from_secs(10))
        .run("x", || async { Ok::<_, ()>(5u8) })
        .await
        .unwrap();
    assert_eq!(value, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_the_memory_store() {
    cases(&handle(MemoryStore::default()), "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn behind_the_cache() {
    cases(&handle(CachedStore::new(MemoryStore::default())), "cache").await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_sqlite() {
    use idempotent_runtime::store::sqlite::SqliteStore;
    let path = std::env::temp_dir().join(format!(
        "idempotent-once-{:016x}.db",
        FencingToken::mint().0
    ));
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    cases(&handle(store), "sqlite").await;
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_postgres() {
    use idempotent_runtime::store::postgres::PostgresStore;
    let Some(url) = support::database_url() else {
        return;
    };
    let schema = format!("idem_once_{:016x}", FencingToken::mint().0);
    let store = PostgresStore::builder()
        .schema(&schema)
        .connect(&url)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    cases(&handle(store), &schema).await;
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    sqlx::query(sqlx::AssertSqlSafe(drop))
        .execute(&admin)
        .await
        .unwrap();
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_redis() {
    use idempotent_runtime::store::redis::RedisStore;
    let Some(url) = support::redis_url() else {
        return;
    };
    let prefix = format!("idem-once-{:016x}", FencingToken::mint().0);
    let store = RedisStore::builder()
        .prefix(&prefix)
        .connect(&url)
        .await
        .expect("connect to REDIS_URL");
    cases(&handle(store), &prefix).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_mysql() {
    use idempotent_runtime::store::mysql::MySqlStore;
    let Some(url) = support::mysql_url() else {
        return;
    };
    // A database of its own: `migrate()` creates it, and the test drops it.
    let database = format!("idem_once_{:016x}", FencingToken::mint().0);
    let store = MySqlStore::builder()
        .database(&database)
        .connect(&url)
        .await
        .expect("connect to MYSQL_URL");
    store.migrate().await.expect("migrate");
    cases(&handle(store), &database).await;
    let admin = sqlx::MySqlPool::connect(&url).await.unwrap();
    let drop = format!("DROP DATABASE IF EXISTS `{database}`");
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
        .execute(&admin)
        .await
        .unwrap();
}

/// The child process of [`a_killed_process_holds_its_key_for_its_lease_then_the_next_call_runs_once`]:
/// claims `crash` on the SQLite file named by `ONCE_CRASH_DB`, says so on stdout, and runs until
/// it is killed. Does nothing as an ordinary test.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    use idempotent_runtime::store::sqlite::SqliteStore;
    let Ok(path) = std::env::var("ONCE_CRASH_DB") else {
        return;
    };
    let idempotency = handle(SqliteStore::open(&path).await.expect("open"));
    let _ = Once::new(&idempotency, &job("crash"), "k")
        .lease(Duration::from_secs(1))
        .run("x", || async {
            use std::io::Write as _;
            println!("ONCE-CHILD-RUNNING");
            std::io::stdout().flush().expect("stdout");
            std::future::pending::<Result<u8, ()>>().await
        })
        .await;
}

/// SIGKILL of the process running the function: the key stands while its lease lasts (renewed
/// until the kill), then the next call, in another process, runs the function once.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_holds_its_key_for_its_lease_then_the_next_call_runs_once() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    use idempotent_runtime::store::sqlite::SqliteStore;
    let path = std::env::temp_dir().join(format!(
        "idempotent-once-crash-{:016x}.db",
        FencingToken::mint().0
    ));
    let store = SqliteStore::open(&path).await.expect("open");
    store.migrate().await.expect("migrate");
    let idempotency = handle(store);

    let mut child = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("ONCE_CRASH_DB", &path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("piped");
    let running = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("ONCE-CHILD-RUNNING"))
    });
    let running = tokio::time::timeout(Duration::from_secs(60), running).await;
    assert!(
        matches!(running, Ok(Ok(true))),
        "the child never ran the function"
    );
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");

    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let scope = job("crash");
    let call = || Once::new(&idempotency, &scope, "k").lease(Duration::from_secs(1));
    let during = call().run("x", || async { Ok::<_, ()>(1u8) }).await;
    assert!(
        matches!(during, Err(OnceError::InProgress { .. })),
        "{during:?}"
    );
    let after = call()
        .wait(Duration::from_secs(15))
        .run("x", move || async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(2u8)
        })
        .await;
    assert_eq!(
        after.unwrap(),
        2,
        "run again after the killed holder's lease"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let replay = call().run("x", || async { Ok::<_, ()>(3u8) }).await;
    assert_eq!(replay.unwrap(), 2);
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.clone().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}
