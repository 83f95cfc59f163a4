//! The PostgreSQL store over TLS (`sslmode=require`), and the refusal that names the feature to
//! turn on when the crate is built without TLS.
//!
//! Reads `DATABASE_URL` (a server that offers TLS, as the local one with Debian's snakeoil
//! certificate does); when it is unset each test says so and passes, unless
//! `IDEMPOTENT_REQUIRE_DB=1`, when it fails. With `--all-features` sqlx speaks native-tls; the
//! rustls path is checked by `--no-default-features --features postgres,tls-rustls`, the refusal
//! by `--no-default-features --features postgres` (both in `.ci/run`).
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!     cargo test --all-features -p idempotent-runtime --test postgres_tls
//! ```

#[cfg(not(any(feature = "tls-rustls", feature = "tls-native-tls")))]
use idempotent_runtime::store::ConnectError;
use idempotent_runtime::store::postgres::PostgresStore;

mod support;
use support::database_url;

/// `DATABASE_URL` with its `sslmode` replaced by `mode`.
fn with_sslmode(url: &str, mode: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("sslmode="))
        .collect();
    let sslmode = format!("sslmode={mode}");
    params.push(&sslmode);
    format!("{base}?{}", params.join("&"))
}

#[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
mod with_tls {
    use std::time::Duration;

    use idempotent_runtime::fingerprint::Fingerprint;
    use idempotent_runtime::store::{
        Claim, ClaimRequest, FencingToken, RecordedResponse, StandingState, Store,
    };

    use super::*;

    fn claim<'a>(scope: &'a [u8; 32], key: &'a str) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            quota_bucket: 0,
            fingerprint: Fingerprint {
                version: 1,
                digest: [7; 32],
            },
            token: FencingToken::mint(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(3600),
            route: "/orders",
            response_room: 0,
        }
    }

    #[tokio::test]
    async fn sslmode_require_connects_encrypted_and_claims_completes_and_replays() {
        let Some(url) = database_url() else {
            return;
        };
        let schema = format!("idem_tls_{:016x}", FencingToken::mint().0);
        let store = PostgresStore::builder()
            .schema(&schema)
            .table("records")
            .max_connections(1)
            .connect(&with_sslmode(&url, "require"))
            .await
            .expect("connect with sslmode=require");

        let encrypted: bool =
            sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(store.pool())
                .await
                .expect("read pg_stat_ssl");
        assert!(encrypted, "sslmode=require connected without TLS");

        store.migrate().await.expect("migrate over TLS");
        let scope = FencingToken::mint().0.to_be_bytes().repeat(4);
        let scope: [u8; 32] = scope.try_into().expect("32 bytes");
        let first = claim(&scope, "order-1");
        assert_eq!(store.claim(&first).await.expect("claim"), Claim::Acquired);
        let response = RecordedResponse::new(
            201,
            vec![("content-type".into(), "application/json".into())],
            r#"{"id":1}"#.into(),
        );
        let completed = store
            .complete(&scope, "order-1", first.token, &response, first.retention)
            .await
            .expect("complete");
        assert!(completed, "the claim's own token was fenced");

        let Claim::Standing(standing) = store
            .claim(&claim(&scope, "order-1"))
            .await
            .expect("replay")
        else {
            panic!("a completed key was claimed again");
        };
        assert_eq!(standing.token, first.token);
        let StandingState::Completed(replayed) = standing.state else {
            panic!("not completed: {:?}", standing.state);
        };
        assert_eq!(*replayed, response);

        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(store.pool())
            .await
            .expect("drop the test schema");
    }

    /// `require` encrypts without checking the certificate; `verify-full` checks it, and the
    /// local server's self-signed snakeoil certificate (issued to the host's name, not to
    /// 127.0.0.1) is refused by rustls with the webpki roots (unknown issuer) and by native-tls.
    #[tokio::test]
    async fn sslmode_verify_full_refuses_a_self_signed_certificate() {
        let Some(url) = database_url() else {
            return;
        };
        let store = PostgresStore::builder()
            .max_connections(1)
            .connect(&with_sslmode(&url, "verify-full"))
            .await
            .expect("the pool connects lazily");
        let error = store
            .migrate()
            .await
            .expect_err("verify-full accepted a self-signed certificate");
        // native-tls reports `Tls`; sqlx passes rustls's refusal on as an I/O error
        // (`InvalidCertificate(UnknownIssuer)`).
        let refused = match &error {
            sqlx::Error::Tls(_) => true,
            sqlx::Error::Io(e) => format!("{e:?}").contains("InvalidCertificate"),
            _ => false,
        };
        assert!(refused, "not a certificate refusal: {error:?}");
    }
}

/// Without a TLS feature, a URL that requires TLS fails at `connect`, naming the features to turn
/// on, instead of at the first statement with sqlx's own feature names.
#[cfg(not(any(feature = "tls-rustls", feature = "tls-native-tls")))]
#[tokio::test]
async fn sslmode_require_without_a_tls_feature_fails_at_connect_naming_the_feature() {
    // No server is needed: the refusal comes before any connection is opened.
    let url = database_url().unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into());
    let error = PostgresStore::builder()
        .connect(&with_sslmode(&url, "require"))
        .await
        .expect_err("sslmode=require connected without a TLS feature");
    let message = error.to_string();
    assert!(
        matches!(error, ConnectError::Database(sqlx::Error::Tls(_))),
        "{error:?}"
    );
    assert!(message.contains("`tls-rustls`"), "{message}");
    assert!(message.contains("`tls-native-tls`"), "{message}");
}

#[test]
fn with_sslmode_replaces_only_the_sslmode() {
    assert_eq!(
        with_sslmode("postgres://u@h/db", "require"),
        "postgres://u@h/db?sslmode=require"
    );
    assert_eq!(
        with_sslmode(
            "postgres://u@h/db?sslmode=disable&application_name=x",
            "verify-full"
        ),
        "postgres://u@h/db?application_name=x&sslmode=verify-full"
    );
}
