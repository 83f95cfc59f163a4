//! Enlisted mode on MySQL/MariaDB and SQLite, over the conformance servers' `POST /ledger`
//! (DESIGN.md §5 "Two modes", CONFORMANCE.md): a keyed request runs once and its ledger row
//! commits with its record; a replay runs nothing; concurrent duplicates (in one process and,
//! on MySQL, on another replica) are 409 while the first transaction is open; a process killed
//! mid-handler leaves neither the row nor the record, and the retry runs once.

use serde_json::json;

use crate::support::harness::{self, Resp, Server};

/// One database for a case, kept across server restarts: its `--store` options.
struct Database {
    options: Vec<String>,
    _guard: Box<dyn std::any::Any>,
}

fn mysql() -> Option<Database> {
    let url = crate::support::mysql_url()?;
    let db = crate::support::MysqlDatabase::new(&url, "ledger");
    Some(Database {
        options: ["--store", "mysql", "--database-url", &db.url()]
            .map(String::from)
            .to_vec(),
        _guard: Box::new(db),
    })
}

/// A SQLite file in a directory of its own, removed afterwards.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sqlite(name: &str) -> Database {
    let dir = std::env::temp_dir().join(format!(
        "idem-ledger-{}-{name}-{:016x}",
        std::process::id(),
        idempotent_runtime::store::FencingToken::mint().0
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("store.db");
    Database {
        options: vec![
            "--store".into(),
            "sqlite".into(),
            "--database-url".into(),
            file.display().to_string(),
        ],
        _guard: Box::new(TempDir(dir)),
    }
}

fn start(name: &'static str, db: &Database) -> Server {
    let options: Vec<&str> = db.options.iter().map(String::as_str).collect();
    Server::start(name, &options)
}

async fn rows(s: &Server) -> u64 {
    let answer = s.get("/ledger").await;
    assert_eq!(
        answer.status, 200,
        "{}: GET /ledger {:?}",
        s.name, answer.body
    );
    answer.json()["rows"].as_u64().expect("rows")
}

/// `copies` concurrent requests with one key, each holding its transaction `ms`.
async fn concurrent(s: &std::sync::Arc<Server>, key: &'static str, copies: usize) -> Vec<Resp> {
    let mut calls = Vec::new();
    for _ in 0..copies {
        let s = std::sync::Arc::clone(s);
        calls.push(tokio::spawn(async move {
            s.post("/ledger?ms=1500").key(key).send().await
        }));
    }
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    answers
}

async fn case(name: &'static str, store: &str, db: &Database, replicas: bool) {
    let what = format!("{name} on {store}");
    let a = std::sync::Arc::new(start(name, db));

    // Once, recorded with its row; the replay runs nothing; another body is 422.
    let first = a.post("/ledger?ms=0").key("k-once").send().await;
    assert_eq!(first.status, 201, "{what}: {:?}", first.body);
    assert!(!first.replayed(), "{what}");
    let again = a.post("/ledger?ms=0").key("k-once").send().await;
    assert_eq!(again.status, 201, "{what}");
    assert!(again.replayed(), "{what}: the retry ran again");
    assert_eq!(again.body, first.body, "{what}");
    a.post("/ledger?ms=0")
        .key("k-once")
        .json(&json!({"other": true}))
        .send()
        .await
        .assert_problem(422, "IDEMPOTENCY_KEY_REUSED");
    assert_eq!(a.runs("/ledger").await, 1, "{what}");
    assert_eq!(rows(&a).await, 1, "{what}");

    // 8 concurrent copies: one runs, seven are 409 while its transaction is open.
    let answers = concurrent(&a, "k-crowd", 8).await;
    let created = answers.iter().filter(|r| r.status == 201).count();
    let busy: Vec<_> = answers.iter().filter(|r| r.status == 409).collect();
    assert_eq!(
        created,
        1,
        "{what}: {:?}",
        answers.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(busy.len(), 7, "{what}");
    for r in busy {
        r.assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
    }
    assert_eq!(a.runs("/ledger").await, 2, "{what}");
    assert_eq!(rows(&a).await, 2, "{what}");

    // On MySQL, a second replica meets the first one's open transaction through the key's
    // named lock: 409 at once, not a wait on the row.
    if replicas {
        let b = start(name, db);
        let held = {
            let a = std::sync::Arc::clone(&a);
            tokio::spawn(async move { a.post("/ledger?ms=1500").key("k-two").send().await })
        };
        a.wait_runs("/ledger", 3).await;
        b.post("/ledger?ms=0")
            .key("k-two")
            .send()
            .await
            .assert_problem(409, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(held.await.unwrap().status, 201, "{what}");
        let replay = b.post("/ledger?ms=1500").key("k-two").send().await;
        assert!(
            replay.replayed(),
            "{what}: the other replica did not replay: {} {:?}",
            replay.status,
            replay.body
        );
        assert_eq!(b.runs("/ledger").await, 0, "{what}");
        assert_eq!(rows(&a).await, 3, "{what}");
    }
    let committed = rows(&a).await;

    // Killed mid-handler (SIGKILL): the row and the record roll back with the transaction.
    // Counted before the request is sent: counted after, it may already include it.
    let ran = a.runs("/ledger").await + 1;
    let killed = {
        let url = format!("http://{}/ledger?ms=10000", a.addr);
        let call = reqwest::Client::new()
            .post(url)
            .header("idempotency-key", "k-crash");
        tokio::spawn(async move { call.send().await })
    };
    a.wait_runs("/ledger", ran).await;
    drop(std::sync::Arc::into_inner(a).expect("no other holder"));
    assert!(
        killed.await.unwrap().is_err(),
        "{what}: the killed request was answered"
    );

    let a = start(name, db);
    assert_eq!(
        rows(&a).await,
        committed,
        "{what}: the killed request's row committed"
    );
    let retry = a.post("/ledger?ms=0").key("k-crash").send().await;
    assert_eq!(retry.status, 201, "{what}: {:?}", retry.body);
    assert!(
        !retry.replayed(),
        "{what}: a record of the killed request survived"
    );
    assert_eq!(a.runs("/ledger").await, 1, "{what}");
    assert_eq!(rows(&a).await, committed + 1, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enlisted_on_mysql_runs_once_commits_with_its_record_and_rolls_back_when_killed() {
    for name in harness::SERVERS {
        let Some(db) = mysql() else { return };
        case(name, "mysql", &db, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enlisted_on_sqlite_runs_once_commits_with_its_record_and_rolls_back_when_killed() {
    for name in harness::SERVERS {
        let db = sqlite(name);
        case(name, "sqlite", &db, false).await;
    }
}
