//! What both conformance servers share (../shared/CONFORMANCE.md): command-line options, the
//! store they select, the caller-identity rules and the per-route execution counters.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use idempotent_runtime::Idempotency;
use idempotent_runtime::config::{Config, MissingKeyStatus, ReuseStatus};
use idempotent_runtime::scope::{ClientId, Identity};

/// Which store to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// The embedded in-memory store.
    Memory,
    /// PostgreSQL (several replicas may share it).
    Postgres,
    /// SQLite (one node).
    Sqlite,
    /// Redis or Valkey (several replicas may share it).
    Redis,
}

/// Command-line options of a conformance server.
#[derive(Debug, Clone)]
pub struct Options {
    pub addr: SocketAddr,
    pub store: StoreKind,
    pub database_url: Option<String>,
    /// Key prefix of the Redis store (`--redis-prefix`, default `idem`), so tests sharing one
    /// Redis keep apart.
    pub redis_prefix: String,
    pub lease: Duration,
    pub retention: Duration,
    pub max_body: usize,
    pub max_response: usize,
    /// How long a request body may take to arrive (`--body-timeout SECS`, default 30).
    pub body_timeout: Duration,
    pub reuse_status: ReuseStatus,
    pub missing_status: MissingKeyStatus,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            addr: ([127, 0, 0, 1], 3000).into(),
            store: StoreKind::Memory,
            database_url: std::env::var("DATABASE_URL").ok(),
            redis_prefix: "idem".into(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(86_400),
            max_body: 1 << 20,
            max_response: 1 << 20,
            body_timeout: Duration::from_secs(30),
            reuse_status: ReuseStatus::UnprocessableContent,
            missing_status: MissingKeyStatus::BadRequest,
        }
    }
}

const USAGE: &str = "options: --addr HOST:PORT --store memory|postgres|sqlite|redis --database-url URL --redis-prefix PREFIX \
--lease SECS --retention SECS --max-body BYTES --max-response BYTES --body-timeout SECS \
--reuse-status 422|409 \
--missing-status 400|428";

impl Options {
    /// Parses `std::env::args()`.
    pub fn from_env() -> Result<Self, String> {
        Self::parse(std::env::args().skip(1))
    }

    /// Parses options (without the program name).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let mut o = Self::default();
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.into());
            }
            let value = args
                .next()
                .ok_or_else(|| format!("{flag} needs a value; {USAGE}"))?;
            let bad = |what: &str| format!("{flag} {value}: {what}; {USAGE}");
            match flag.as_str() {
                "--addr" => o.addr = value.parse().map_err(|_| bad("not HOST:PORT"))?,
                "--store" => {
                    o.store = match value.as_str() {
                        "memory" => StoreKind::Memory,
                        "postgres" => StoreKind::Postgres,
                        "sqlite" => StoreKind::Sqlite,
                        "redis" => StoreKind::Redis,
                        _ => return Err(bad("unknown store")),
                    }
                }
                "--database-url" => o.database_url = Some(value),
                "--redis-prefix" => o.redis_prefix = value,
                "--lease" => o.lease = secs(&value).ok_or_else(|| bad("not seconds"))?,
                "--retention" => o.retention = secs(&value).ok_or_else(|| bad("not seconds"))?,
                "--max-body" => o.max_body = value.parse().map_err(|_| bad("not bytes"))?,
                "--max-response" => o.max_response = value.parse().map_err(|_| bad("not bytes"))?,
                "--body-timeout" => {
                    o.body_timeout = secs(&value).ok_or_else(|| bad("not seconds"))?;
                }
                "--reuse-status" => {
                    o.reuse_status = match value.as_str() {
                        "422" => ReuseStatus::UnprocessableContent,
                        "409" => ReuseStatus::Conflict,
                        _ => return Err(bad("422 or 409")),
                    }
                }
                "--missing-status" => {
                    o.missing_status = match value.as_str() {
                        "400" => MissingKeyStatus::BadRequest,
                        "428" => MissingKeyStatus::PreconditionRequired,
                        _ => return Err(bad("400 or 428")),
                    }
                }
                _ => return Err(format!("unknown option {flag}; {USAGE}")),
            }
        }
        Ok(o)
    }

    /// The runtime settings these options describe.
    pub fn config(&self) -> Config {
        Config::builder()
            .lease(self.lease)
            .retention(self.retention)
            .max_body(self.max_body)
            .max_response(self.max_response)
            .body_timeout(self.body_timeout)
            .reuse_status(self.reuse_status)
            .missing_key_status(self.missing_status)
            .build()
    }

    /// The idempotency handle over the selected store (migrating SQL stores first).
    pub async fn idempotency(&self) -> Result<Idempotency, Box<dyn std::error::Error>> {
        match self.store {
            StoreKind::Memory => Ok(Idempotency::builder(
                idempotent_runtime::store::memory::MemoryStore::default(),
            )
            .config(self.config())
            .build()),
            #[cfg(feature = "postgres")]
            StoreKind::Postgres => {
                // Several replicas may start at once: `migrate()` serialises them. A test isolates
                // itself through the URL (`?options=-c%20search_path%3D<schema>`).
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store postgres needs --database-url or DATABASE_URL")?;
                let store = idempotent_runtime::store::postgres::PostgresStore::connect(url).await?;
                store.migrate().await?;
                Ok(Idempotency::builder(store)
                    .config(self.config())
                    .build())
            }
            #[cfg(feature = "sqlite")]
            StoreKind::Sqlite => {
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store sqlite needs --database-url PATH (a database file)")?;
                let path = url
                    .strip_prefix("sqlite://")
                    .or_else(|| url.strip_prefix("sqlite:"))
                    .unwrap_or(url);
                let store = idempotent_runtime::store::sqlite::SqliteStore::open(path).await?;
                store.migrate().await?;
                Ok(Idempotency::builder(store)
                    .config(self.config())
                    .build())
            }
            #[cfg(feature = "redis")]
            StoreKind::Redis => {
                // `redis://host:port/N`; several comma-separated node URLs select Redis Cluster.
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store redis needs --database-url redis://HOST:PORT/N")?;
                let builder = idempotent_runtime::store::redis::RedisStore::builder()
                    .prefix(&self.redis_prefix);
                let store = if url.contains(',') {
                    builder.connect_cluster(url.split(',')).await?
                } else {
                    builder.connect(url).await?
                };
                Ok(Idempotency::builder(store)
                    .config(self.config())
                    .build())
            }
            #[allow(unreachable_patterns)]
            StoreKind::Postgres | StoreKind::Sqlite | StoreKind::Redis => {
                Err("this build has no support for the selected store (cargo features postgres, sqlite, redis)".into())
            }
        }
    }
}

fn secs(v: &str) -> Option<Duration> {
    let s: f64 = v.parse().ok()?;
    (s.is_finite() && s > 0.0).then(|| Duration::from_secs_f64(s))
}

/// Who the caller is, from its headers: `Authorization: Bearer <tenant>:<subject>`,
/// `X-Api-Key: <id>`, or neither (anonymous). `Err` when `Authorization` is present but not of
/// that form: the server answers 401 before any idempotency step.
// There is one way to fail (not of the documented form), and the caller answers 401 for it.
#[allow(clippy::result_unit_err)]
pub fn identity(
    authorization: Option<&[u8]>,
    api_key: Option<&[u8]>,
) -> Result<Option<Identity>, ()> {
    let mut identity = None;
    if let Some(auth) = authorization {
        let auth = std::str::from_utf8(auth).map_err(|_| ())?;
        let token = auth.strip_prefix("Bearer ").ok_or(())?;
        let (tenant, subject) = token.split_once(':').ok_or(())?;
        if tenant.is_empty() || subject.is_empty() {
            return Err(());
        }
        identity = Some(Identity::subject(tenant, subject));
    }
    if let Some(key) = api_key {
        let key = std::str::from_utf8(key).map_err(|_| ())?;
        let with_client = identity.take().unwrap_or_default();
        identity = Some(Identity {
            client: Some(ClientId::ApiKey(key.to_owned())),
            ..with_client
        });
    }
    Ok(identity)
}

/// Per-route counters of real handler executions (`GET /executions`).
#[derive(Debug, Default)]
pub struct Executions(Mutex<BTreeMap<&'static str, u64>>);

/// Every route pattern the servers expose, for `GET /executions`.
pub const ROUTES: [&str; 9] = [
    "/orders",
    "/notes",
    "/shops/{shop}/orders",
    "/slow",
    "/status",
    "/big",
    "/panic",
    "/search",
    "/orders/{id}",
];

impl Executions {
    /// Counts one execution of `route` and returns its number (1 for the first).
    pub fn next(&self, route: &'static str) -> u64 {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(route).or_insert(0);
        *n += 1;
        *n
    }

    /// `{"<route>": n, …}` for every POST route (0 for those that never ran).
    pub fn snapshot(&self) -> serde_json::Value {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = serde_json::Map::new();
        for route in &ROUTES[..8] {
            out.insert((*route).into(), map.get(route).copied().unwrap_or(0).into());
        }
        serde_json::Value::Object(out)
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let o = Options::parse(
            "--addr 127.0.0.1:0 --store sqlite --database-url x.db --lease 0.5 --retention 10 \
             --max-body 10 --max-response 20 --reuse-status 409 --missing-status 428"
                .split(' ')
                .map(String::from),
        )
        .unwrap();
        assert_eq!(o.addr.port(), 0);
        assert_eq!(o.store, StoreKind::Sqlite);
        assert_eq!(o.lease, Duration::from_millis(500));
        assert_eq!((o.max_body, o.max_response), (10, 20));
        assert_eq!(o.reuse_status, ReuseStatus::Conflict);
        assert_eq!(o.missing_status, MissingKeyStatus::PreconditionRequired);
        let redis = Options::parse(
            "--store redis --database-url redis://127.0.0.1:6379/3 --redis-prefix t1"
                .split(' ')
                .map(String::from),
        )
        .unwrap();
        assert_eq!(redis.store, StoreKind::Redis);
        assert_eq!(redis.redis_prefix, "t1");
        assert!(Options::parse(["--store".into(), "mongodb".into()]).is_err());
        assert!(Options::parse(["--bogus".into(), "1".into()]).is_err());
    }

    #[test]
    fn identity_follows_the_conformance_rules() {
        assert_eq!(
            identity(Some(b"Bearer acme:alice"), None).unwrap(),
            Some(Identity::subject("acme", "alice"))
        );
        assert!(identity(Some(b"Basic abc"), None).is_err());
        assert!(identity(Some(b"Bearer nocolon"), None).is_err());
        assert_eq!(
            identity(None, Some(b"k1")).unwrap(),
            Some(Identity::client(ClientId::ApiKey("k1".into())))
        );
        assert_eq!(identity(None, None).unwrap(), None);
    }
}
