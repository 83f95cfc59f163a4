//! The operators' tool (examples/idempotent_admin.rs) against real stores: it finds a record by
//! the identity the application publishes and the key, shows it, and forgets it; other callers'
//! records stay out of its reach.

use std::process::{Command, Output};
use std::time::Duration;

use crate::support::{Schema, example_binary};
use idempotent_runtime::fingerprint::Fingerprint;
use idempotent_runtime::scope::{Identity, Scope};
use idempotent_runtime::store::postgres::PostgresStore;
use idempotent_runtime::store::sqlite::SqliteStore;
use idempotent_runtime::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, Store};
use serde_json::Value;

/// Records key `order-17` for acme/alice on `/orders`, completed with a 201.
async fn seed(store: &impl Store) {
    let scope = Scope::from_identity(&Identity::subject("acme", "alice"), None).unwrap();
    let req = ClaimRequest {
        scope: scope.hash(),
        key: "order-17",
        quota_bucket: 0,
        fingerprint: Fingerprint {
            version: 1,
            digest: [1; 32],
        },
        token: FencingToken::mint(),
        lease: Duration::from_secs(60),
        retention: Duration::from_secs(3600),
        route: "/orders",
        response_room: 0,
    };
    assert_eq!(store.claim(&req).await.unwrap(), Claim::Acquired);
    let response = RecordedResponse::new(
        201,
        vec![("content-type".into(), "application/json".into())],
        r#"{"id":17}"#.into(),
    );
    let recorded = store.complete(
        scope.hash(),
        "order-17",
        req.token,
        &response,
        req.retention,
    );
    assert!(recorded.await.unwrap());
}

fn admin(store_args: &[&str], args: &[&str]) -> Output {
    Command::new(example_binary("idempotent_admin"))
        .args(store_args)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run idempotent_admin")
}

/// The whole session of a support engineer, against one store.
fn support_session(store_args: Vec<String>) {
    let store_args: Vec<&str> = store_args.iter().map(String::as_str).collect();
    let store_args = &store_args[..];
    let alice = [
        "--tenant",
        "acme",
        "--subject",
        "alice",
        "--key",
        "order-17",
    ];
    let shown = admin(store_args, &[&alice[..], &["inspect"]].concat());
    assert_eq!(
        shown.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let doc: Value = serde_json::from_slice(&shown.stdout).expect("JSON on stdout");
    assert_eq!(doc["state"], "completed", "{doc}");
    assert_eq!(doc["status"], 201);
    assert_eq!(doc["route"], "/orders");
    assert_eq!(doc["body_bytes"], 9);
    assert!(
        doc["expires_at"].is_string() && doc.get("body").is_none(),
        "{doc}"
    );

    let with_body = admin(store_args, &[&alice[..], &["inspect", "--body"]].concat());
    let doc: Value = serde_json::from_slice(&with_body.stdout).unwrap();
    assert_eq!(doc["body"], r#"{"id":17}"#, "{doc}");

    for other in [
        &["--tenant", "globex", "--subject", "alice"][..],
        &["--tenant", "acme", "--subject", "bob"][..],
        &["--api-key", "alice"][..],
    ] {
        let args = [other, &["--key", "order-17", "inspect"]].concat();
        assert_eq!(
            admin(store_args, &args).status.code(),
            Some(1),
            "{other:?} saw it"
        );
        let args = [other, &["--key", "order-17", "forget"]].concat();
        assert_eq!(
            admin(store_args, &args).status.code(),
            Some(1),
            "{other:?} forgot it"
        );
    }
    let elsewhere = admin(
        store_args,
        &[&alice[..], &["--route", "/notes", "forget"]].concat(),
    );
    assert_eq!(
        elsewhere.status.code(),
        Some(1),
        "forgotten through another route"
    );

    let forgot = admin(store_args, &[&alice[..], &["forget"]].concat());
    assert_eq!(
        forgot.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&forgot.stderr)
    );
    assert_eq!(
        admin(store_args, &[&alice[..], &["inspect"]].concat())
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        admin(store_args, &[&alice[..], &["forget"]].concat())
            .status
            .code(),
        Some(1)
    );

    let usage = admin(store_args, &["--key", "order-17", "inspect"]);
    assert_eq!(usage.status.code(), Some(2), "no caller is a usage error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspects_and_forgets_a_postgres_record_by_identity_and_key() {
    let Some(schema) = Schema::new("admin").await else {
        return;
    };
    let store = PostgresStore::builder()
        .schema(schema.name())
        .connect(&schema.url())
        .await
        .unwrap();
    store.migrate().await.unwrap();
    seed(&store).await;
    let url = schema.url();
    let args = [
        "--store",
        "postgres",
        "--database-url",
        &url,
        "--schema",
        schema.name(),
    ]
    .map(str::to_owned)
    .to_vec();
    tokio::task::spawn_blocking(move || support_session(args))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspects_and_forgets_a_sqlite_record_by_identity_and_key() {
    let path = std::env::temp_dir().join(format!("idem-admin-{:016x}.db", FencingToken::mint().0));
    let store = SqliteStore::open(&path).await.unwrap();
    store.migrate().await.unwrap();
    seed(&store).await;
    let file = path.to_str().unwrap().to_owned();
    let args = ["--store", "sqlite", "--database-url", &file]
        .map(str::to_owned)
        .to_vec();
    tokio::task::spawn_blocking(move || support_session(args))
        .await
        .unwrap();
    drop(store);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{file}{suffix}"));
    }
}
