//! What both conformance servers share (../shared/CONFORMANCE.md): command-line options, the
//! store they select, the caller-identity rules and the per-route execution counters.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotent_runtime::Idempotency;
use idempotent_runtime::config::{Config, MissingKeyStatus, Oversized, ReuseStatus, grammar};
use idempotent_runtime::problem::{Problem, ProblemCode};
use idempotent_runtime::scope::{ClientId, Identity, RequestHead, Resolution};
use idempotent_runtime::store::memory::{MemoryLimits, MemoryStore};
use idempotent_runtime::webhook::StandardWebhooks;
use ipnet::IpNet;

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
    /// MySQL or MariaDB (several replicas may share it).
    Mysql,
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
    /// Peers whose forwarded headers are believed (`--trusted-proxy CIDR`, repeatable).
    pub trusted_proxies: Vec<IpNet>,
    /// The header that carries the key (`--key-header NAME`, default `Idempotency-Key`).
    pub key_header: String,
    /// Credential headers beside `authorization` (`--credential-header NAME`, repeatable).
    pub credential_headers: Vec<String>,
    /// `--local-cache`: completed records kept in this process in front of a shared store.
    pub local_cache: bool,
    /// `--transaction-pooler`: the PostgreSQL store reaches the database through a pooler in
    /// transaction mode (PgBouncer), `PostgresStoreBuilder::transaction_pooler(true)`.
    pub transaction_pooler: bool,
    /// What an answer over `--max-response` leaves behind (`--oversized run_again|record_without_body`).
    pub oversized: Oversized,
    /// `--strict` / `--no-strict`: refuse a detected setup mistake with 500
    /// `IDEMPOTENCY_MISCONFIGURED` (default: the build's, strict in debug builds).
    pub strict: bool,
    /// `--wait-in-progress SECS`: hold a duplicate of a running key up to SECS, then replay,
    /// instead of 409 (default: off).
    pub wait_in_progress: Duration,
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
            trusted_proxies: Vec::new(),
            key_header: "Idempotency-Key".into(),
            credential_headers: Vec::new(),
            local_cache: false,
            transaction_pooler: false,
            oversized: Oversized::RunAgain,
            strict: cfg!(debug_assertions),
            wait_in_progress: Duration::ZERO,
        }
    }
}

const USAGE: &str = "options: --addr HOST:PORT --store memory|postgres|sqlite|redis|mysql --database-url URL --redis-prefix PREFIX \
--lease SECS --retention SECS --max-body BYTES --max-response BYTES --body-timeout SECS \
--reuse-status 422|409 \
--missing-status 400|428 --trusted-proxy CIDR (repeatable) --key-header NAME \
--credential-header NAME (repeatable) --local-cache --transaction-pooler --oversized run_again|record_without_body --strict --no-strict \
--wait-in-progress SECS";

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
            if flag == "--local-cache" {
                o.local_cache = true;
                continue;
            }
            if flag == "--transaction-pooler" {
                o.transaction_pooler = true;
                continue;
            }
            if flag == "--strict" || flag == "--no-strict" {
                o.strict = flag == "--strict";
                continue;
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
                        "mysql" => StoreKind::Mysql,
                        _ => return Err(bad("unknown store")),
                    }
                }
                "--database-url" => o.database_url = Some(value),
                "--redis-prefix" => o.redis_prefix = value,
                "--lease" => o.lease = secs(&value).ok_or_else(|| bad("not seconds"))?,
                "--retention" => o.retention = secs(&value).ok_or_else(|| bad("not seconds"))?,
                "--max-body" => o.max_body = bytes(&value).ok_or_else(|| bad("not bytes"))?,
                "--max-response" => {
                    o.max_response = bytes(&value).ok_or_else(|| bad("not bytes"))?;
                }
                "--wait-in-progress" => {
                    o.wait_in_progress = match value.trim() {
                        "0" => Duration::ZERO,
                        v => secs(v).ok_or_else(|| bad("not seconds"))?,
                    };
                }
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
                "--trusted-proxy" => o
                    .trusted_proxies
                    .push(cidr(&value).ok_or_else(|| bad("not a CIDR or an address"))?),
                "--key-header" => {
                    o.key_header = header_name(&value).ok_or_else(|| bad("not a header name"))?
                }
                "--oversized" => {
                    o.oversized = match value.as_str() {
                        "run_again" => Oversized::RunAgain,
                        "record_without_body" => Oversized::RecordWithoutBody,
                        _ => return Err(bad("run_again or record_without_body")),
                    }
                }
                "--credential-header" => o
                    .credential_headers
                    .push(header_name(&value).ok_or_else(|| bad("not a header name"))?),
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
            .oversized(self.oversized)
            .missing_key_status(self.missing_status)
            .trusted_proxies(self.trusted_proxies.iter().copied())
            .key_header(&self.key_header)
            .credential_headers(
                std::iter::once("authorization")
                    .chain(self.credential_headers.iter().map(String::as_str)),
            )
            .strict(self.strict)
            .wait_in_progress(self.wait_in_progress)
            .build()
    }

    /// The identity resolver both servers set: `X-Api-Key: <id>` alone (without
    /// `Authorization`, which the servers' authentication middleware publishes) is the client
    /// `api-key:<id>`. An empty key is refused with 401 before anything is claimed.
    pub fn resolver(head: &RequestHead<'_>) -> Resolution {
        match head.header("x-api-key") {
            None => Resolution::Unknown,
            Some(b"") => Resolution::Refuse(Problem::new(
                401,
                ProblemCode::ScopeUnresolved,
                "the X-Api-Key header is empty",
            )),
            Some(id) => match identity(None, Some(id)) {
                Ok(Some(identity)) => Resolution::Identity(identity),
                _ => Resolution::Refuse(Problem::new(
                    401,
                    ProblemCode::ScopeUnresolved,
                    "the X-Api-Key header is not UTF-8",
                )),
            },
        }
    }

    /// The idempotency handle over the selected store (migrating SQL stores first).
    pub async fn idempotency(&self) -> Result<Idempotency, Box<dyn std::error::Error>> {
        match self.store {
            StoreKind::Memory => {
                // Room for the largest answer this server records is set aside per claim.
                let limits = MemoryLimits {
                    response_headroom: self.max_response,
                    ..MemoryLimits::default()
                };
                let store = MemoryStore::builder().limits(limits).build();
                Ok(Idempotency::builder(store)
                    .config(self.config())
                    .resolver(Self::resolver)
                    .build())
            }
            #[cfg(feature = "postgres")]
            StoreKind::Postgres => {
                // Several replicas may start at once: `migrate()` serialises them. A test isolates
                // itself through the URL (`?options=-c%20search_path%3D<schema>`).
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store postgres needs --database-url or DATABASE_URL")?;
                let store = idempotent_runtime::store::postgres::PostgresStore::builder()
                    .transaction_pooler(self.transaction_pooler)
                    .connect(url)
                    .await?;
                store.migrate().await?;
                let builder = if self.local_cache {
                    Idempotency::builder(idempotent_runtime::store::cache::CachedStore::new(store))
                } else {
                    Idempotency::builder(store)
                };
                Ok(builder
                    .config(self.config())
                    .resolver(Self::resolver)
                    .build())
            }
            #[cfg(feature = "sqlite")]
            StoreKind::Sqlite => {
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store sqlite needs --database-url PATH (a database file)")?;
                let store = idempotent_runtime::store::sqlite::SqliteStore::builder()
                    .connect_with(sqlite_options(url)?)
                    .await?;
                store.migrate().await?;
                Ok(Idempotency::builder(store)
                    .config(self.config())
                    .resolver(Self::resolver)
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
                let builder = if self.local_cache {
                    Idempotency::builder(idempotent_runtime::store::cache::CachedStore::new(store))
                } else {
                    Idempotency::builder(store)
                };
                Ok(builder
                    .config(self.config())
                    .resolver(Self::resolver)
                    .build())
            }
            #[cfg(feature = "mysql")]
            StoreKind::Mysql => {
                // `mysql://user@host:3306/DB`; several replicas may start at once: `migrate()`
                // serialises them. A test isolates itself through the URL's database.
                let url = self
                    .database_url
                    .as_deref()
                    .ok_or("--store mysql needs --database-url mysql://USER@HOST:PORT/DB")?;
                let store = idempotent_runtime::store::mysql::MySqlStore::connect(url).await?;
                store.migrate().await?;
                let builder = if self.local_cache {
                    Idempotency::builder(idempotent_runtime::store::cache::CachedStore::new(store))
                } else {
                    Idempotency::builder(store)
                };
                Ok(builder
                    .config(self.config())
                    .resolver(Self::resolver)
                    .build())
            }
            #[allow(unreachable_patterns)]
            StoreKind::Postgres | StoreKind::Sqlite | StoreKind::Redis | StoreKind::Mysql => {
                Err("this build has no support for the selected store (cargo features postgres, sqlite, redis, mysql)".into())
            }
        }
    }
}

/// `10.0.0.0/8`, `::1/128`, or a bare address (one host).
fn cidr(v: &str) -> Option<IpNet> {
    v.parse()
        .ok()
        .or_else(|| v.parse::<IpAddr>().ok().map(IpNet::from))
}

fn header_name(v: &str) -> Option<String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    (!v.is_empty() && v.bytes().all(token)).then(|| v.to_ascii_lowercase())
}

/// The SQLite database `url` names: a `sqlite:` URL, parsed by sqlx itself (so a query such as
/// `?mode=rwc` is an option, never part of the file name), or a plain file path. The file is
/// created if missing either way, so both forms of one path open one database.
#[cfg(feature = "sqlite")]
pub fn sqlite_options(url: &str) -> Result<sqlx::sqlite::SqliteConnectOptions, sqlx::Error> {
    use std::str::FromStr as _;
    let options = if url.starts_with("sqlite:") {
        sqlx::sqlite::SqliteConnectOptions::from_str(url)?
    } else {
        sqlx::sqlite::SqliteConnectOptions::new().filename(url)
    };
    Ok(options.create_if_missing(true))
}

/// The `ledger` table behind `POST /ledger` and `GET /ledger` (the PostgreSQL, MySQL and SQLite
/// stores): rows the enlisted handler inserts in the request's transaction, so a checker can
/// compare committed rows with executions.
pub mod ledger {
    use std::time::Duration;

    use serde_json::{Value, json};
    use sqlx::{AssertSqlSafe, Executor};

    use super::{Options, StoreKind};

    /// A small pool of its own for `GET /ledger` and the table's creation, on the store's
    /// database, so the store's pool keeps its default size and its connections only serve
    /// requests.
    #[derive(Clone, Debug)]
    pub enum Ledger {
        /// `--store postgres`.
        Postgres(sqlx::PgPool),
        /// `--store mysql`.
        #[cfg(feature = "mysql")]
        MySql(sqlx::MySqlPool),
        /// `--store sqlite`.
        #[cfg(feature = "sqlite")]
        Sqlite(sqlx::SqlitePool),
    }

    /// Opens the pool and creates the table; `None` for a store without SQL transactions.
    pub async fn open(options: &Options) -> Result<Option<Ledger>, Box<dyn std::error::Error>> {
        let Some(url) = options.database_url.as_deref() else {
            return Ok(None);
        };
        match options.store {
            StoreKind::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .connect(url)
                    .await?;
                // Replicas start together: serialise the creation, as `migrate()` does. Simple
                // queries only: the server may run behind a transaction pooler
                // (`--transaction-pooler`), where a named statement would outlive its
                // transaction.
                let mut tx = pool.begin().await?;
                sqlx::raw_sql(
                    "SELECT pg_advisory_xact_lock(hashtext('idempotent-conformance-ledger')); \
                     CREATE TABLE IF NOT EXISTS ledger (execution bigint NOT NULL)",
                )
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(Some(Ledger::Postgres(pool)))
            }
            #[cfg(feature = "mysql")]
            StoreKind::Mysql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(2)
                    .connect(url)
                    .await?;
                // InnoDB, so the rows commit and roll back with the request's transaction.
                pool.execute(
                    "CREATE TABLE IF NOT EXISTS ledger (execution bigint NOT NULL) ENGINE = InnoDB",
                )
                .await?;
                Ok(Some(Ledger::MySql(pool)))
            }
            #[cfg(feature = "sqlite")]
            StoreKind::Sqlite => {
                // Reads only (WAL: they never wait for the store's writer), after the creation.
                let pool = sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(2)
                    .connect_with(super::sqlite_options(url)?.busy_timeout(Duration::from_secs(5)))
                    .await?;
                pool.execute("CREATE TABLE IF NOT EXISTS ledger (execution bigint NOT NULL)")
                    .await?;
                Ok(Some(Ledger::Sqlite(pool)))
            }
            _ => Ok(None),
        }
    }

    /// The row of execution `n`, for the enlisted transaction's connection: a statement without
    /// parameters, sent as a simple query (never a named statement, so it works behind a
    /// transaction pooler too).
    fn row(n: u64) -> AssertSqlSafe<String> {
        AssertSqlSafe(format!("INSERT INTO ledger (execution) VALUES ({n})"))
    }

    /// Inserts the row of execution `n` through a PostgreSQL enlisted transaction.
    pub async fn insert(conn: &mut sqlx::PgConnection, n: u64) -> Result<(), sqlx::Error> {
        conn.execute(row(n)).await.map(drop)
    }

    /// Inserts the row of execution `n` through a MySQL enlisted transaction.
    #[cfg(feature = "mysql")]
    pub async fn insert_mysql(conn: &mut sqlx::MySqlConnection, n: u64) -> Result<(), sqlx::Error> {
        conn.execute(row(n)).await.map(drop)
    }

    /// Inserts the row of execution `n` through a SQLite enlisted transaction.
    #[cfg(feature = "sqlite")]
    pub async fn insert_sqlite(
        conn: &mut sqlx::SqliteConnection,
        n: u64,
    ) -> Result<(), sqlx::Error> {
        conn.execute(row(n)).await.map(drop)
    }

    /// The handler's answer once its row was `inserted`: after `ms` of sleep, 201
    /// `{"execution": n}`, or 500 at once if the insert failed.
    pub async fn answer(n: u64, inserted: Result<(), sqlx::Error>, ms: u64) -> (u16, Value) {
        if let Err(error) = inserted {
            return (500, json!({"error": error.to_string(), "execution": n}));
        }
        tokio::time::sleep(Duration::from_millis(ms)).await;
        (201, json!({"execution": n}))
    }

    /// Committed rows: `{"rows": n}`.
    pub async fn rows(ledger: &Ledger) -> Result<Value, sqlx::Error> {
        const COUNT: &str = "SELECT count(*) FROM ledger";
        let rows: i64 = match ledger {
            // Unnamed: behind a transaction pooler a named statement would outlive its use.
            Ledger::Postgres(pool) => {
                sqlx::query_scalar(COUNT)
                    .persistent(false)
                    .fetch_one(pool)
                    .await?
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => sqlx::query_scalar(COUNT).fetch_one(pool).await?,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlx::query_scalar(COUNT).fetch_one(pool).await?,
        };
        Ok(json!({ "rows": rows }))
    }
}

/// Seconds as CONFORMANCE.md writes them (`0.5`), or a duration in the runtime's grammar
/// (`"500ms"`), the one the attribute and the file form read.
fn secs(v: &str) -> Option<Duration> {
    match v.parse::<f64>() {
        Ok(s) => (s.is_finite() && s > 0.0).then(|| Duration::from_secs_f64(s)),
        Err(_) => grammar::parse_duration(v).ok(),
    }
}

/// Bytes as CONFORMANCE.md writes them, or a size in the runtime's grammar (`"64KiB"`).
fn bytes(v: &str) -> Option<usize> {
    v.parse().ok().or_else(|| grammar::parse_size(v).ok())
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

/// The Standard Webhooks secret of `POST /webhooks/standard`: `whsec_` and the base64 of
/// `conformance`.
pub const WEBHOOK_SECRET: &str = "whsec_Y29uZm9ybWFuY2U=";

/// The verifier of `POST /webhooks/standard`'s deliveries.
pub fn webhook_verifier() -> StandardWebhooks {
    StandardWebhooks::new(WEBHOOK_SECRET).expect("the conformance secret is well formed")
}

/// Who a verified delivery comes from: the provider, as the scope's identity, so that its
/// delivery ids never meet another caller's keys.
pub fn webhook_provider() -> Identity {
    Identity::client(ClientId::OAuth("standard-webhooks".to_owned()))
}

/// A webhook delivery checked before anything else runs (both servers' route middleware: only
/// the framework's request and response types differ): its body read under `limit`, its
/// signature verified against `header` (a lookup by lowercase name), and the provider's
/// identity to publish. `Err` is the status to answer: 413 past `limit`, 400 for a body broken
/// mid-read, 401 for a signature that does not verify.
pub async fn verify_delivery<'h, S, E>(
    chunks: S,
    limit: usize,
    header: impl FnMut(&str) -> Option<&'h [u8]>,
) -> Result<(bytes::Bytes, Identity), u16>
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>>,
{
    let body = read_delivery(chunks, limit).await?;
    if let Err(error) = webhook_verifier().verify(header, &body, SystemTime::now()) {
        tracing::debug!(%error, "webhook delivery refused");
        return Err(401);
    }
    Ok((body, webhook_provider()))
}

/// Reads at most `limit` bytes of a webhook delivery's body before its signature is checked:
/// `Err(413)` past it, `Err(400)` for a body broken mid-read.
async fn read_delivery<S, E>(chunks: S, limit: usize) -> Result<bytes::Bytes, u16>
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>>,
{
    use futures_util::StreamExt as _;
    let mut chunks = std::pin::pin!(chunks);
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|_| 400u16)?;
        if body.len() + chunk.len() > limit {
            return Err(413);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Per-route counters of real handler executions (`GET /executions`).
#[derive(Debug, Default)]
pub struct Executions(Mutex<BTreeMap<&'static str, u64>>);

/// Every route pattern the servers expose, for `GET /executions`: the POST routes, then
/// `/orders/{id}` (never counted).
pub const ROUTES: [&str; 12] = [
    "/orders",
    "/notes",
    "/shops/{shop}/orders",
    "/slow",
    "/status",
    "/big",
    "/panic",
    "/search",
    "/ledger",
    "/webhooks/standard",
    "/events",
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

    /// `{name: n}` for each of `names` (0 for those that never ran): the gRPC service's
    /// methods.
    pub fn snapshot_of(&self, names: &[&str]) -> std::collections::HashMap<String, u64> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = |name: &str| map.get(name).copied().unwrap_or(0);
        names.iter().map(|n| ((*n).to_owned(), count(n))).collect()
    }

    /// `{"<route>": n, …}` for every POST route (0 for those that never ran).
    pub fn snapshot(&self) -> serde_json::Value {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = serde_json::Map::new();
        for route in &ROUTES[..ROUTES.len() - 1] {
            out.insert((*route).into(), map.get(route).copied().unwrap_or(0).into());
        }
        serde_json::Value::Object(out)
    }
}

/// Installs a `tracing` subscriber that writes every event and span of the process to stderr,
/// at the level named by `IDEMPOTENT_LOG` (`trace`, `debug`, `info`, `warn`, `error`); none when
/// it is unset, so benchmarks pay nothing. The hostile suite runs the servers with
/// `IDEMPOTENT_LOG=trace` and reads their stderr: no line may carry a raw key (DESIGN §7).
pub fn init_logging() {
    let Ok(level) = std::env::var("IDEMPOTENT_LOG") else {
        return;
    };
    let level: tracing::Level = match level.parse() {
        Ok(level) => level,
        Err(_) => {
            eprintln!("IDEMPOTENT_LOG={level}: not a level (trace, debug, info, warn, error)");
            std::process::exit(2);
        }
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .init();
}

/// A server-side log of handler runs, for the soak and any checker that counts runs where they
/// happen: with `IDEMPOTENT_RUN_LOG=PATH`, each run appends one line `key<TAB>run id<TAB>unix
/// ms` to `PATH` before the handler answers. The file has no uniqueness of any kind, so a key
/// that ran twice shows twice, even across replicas and restarts (the run id is
/// `<server>:<pid>:<n>`). Each line is one `write` on a file opened for appending, so replicas
/// may share a file, and a line survives a SIGKILL right after it.
#[derive(Debug)]
pub struct RunLog {
    file: Option<Mutex<std::fs::File>>,
    server: String,
    runs: AtomicU64,
}

impl RunLog {
    /// The log named by `IDEMPOTENT_RUN_LOG`, or one that records nothing.
    pub fn from_env() -> Self {
        let file = std::env::var_os("IDEMPOTENT_RUN_LOG").map(|path| {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap_or_else(|e| panic!("IDEMPOTENT_RUN_LOG={path:?}: {e}"));
            Mutex::new(file)
        });
        let server = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "server".into());
        Self {
            file,
            server,
            runs: AtomicU64::new(0),
        }
    }

    /// Appends one run of `key` (no-op without a log file).
    pub fn record(&self, key: &str) {
        let Some(file) = &self.file else { return };
        let n = self.runs.fetch_add(1, Ordering::Relaxed) + 1;
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let line = format!("{key}\t{}:{}:{n}\t{ms}\n", self.server, std::process::id());
        let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
        file.write_all(line.as_bytes())
            .expect("append to IDEMPOTENT_RUN_LOG");
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
             --max-body 10 --max-response 20 --reuse-status 409 --local-cache --missing-status 428 \
             --wait-in-progress 2.5"
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
        assert!(o.local_cache);
        assert_eq!(o.wait_in_progress, Duration::from_millis(2500));
        assert!(!Options::parse([]).unwrap().local_cache);
        assert!(
            Options::parse(["--transaction-pooler".into()])
                .unwrap()
                .transaction_pooler
        );
        assert!(!Options::parse([]).unwrap().transaction_pooler);
        assert_eq!(Options::parse([]).unwrap().wait_in_progress, Duration::ZERO);
        assert_eq!(Options::parse([]).unwrap().oversized, Oversized::RunAgain);
        let bodiless = Options::parse(["--oversized".into(), "record_without_body".into()]);
        let bodiless = bodiless.unwrap().config();
        assert_eq!(bodiless.oversized(), Oversized::RecordWithoutBody);
        assert!(Options::parse(["--oversized".into(), "truncate".into()]).is_err());
        assert_eq!(Options::parse([]).unwrap().strict, cfg!(debug_assertions));
        let strict = |flags: &[&str]| {
            let o = Options::parse(flags.iter().map(|f| f.to_string())).unwrap();
            (o.strict, o.config().strict())
        };
        assert_eq!(strict(&["--strict"]), (true, true));
        assert_eq!(strict(&["--strict", "--no-strict"]), (false, false));
        let redis = Options::parse(
            "--store redis --database-url redis://127.0.0.1:6379/3 --redis-prefix t1"
                .split(' ')
                .map(String::from),
        )
        .unwrap();
        assert_eq!(redis.store, StoreKind::Redis);
        let mysql = Options::parse(
            "--store mysql --database-url mysql://root@127.0.0.1:3306/test"
                .split(' ')
                .map(String::from),
        )
        .unwrap();
        assert_eq!(mysql.store, StoreKind::Mysql);
        assert_eq!(
            mysql.database_url.as_deref(),
            Some("mysql://root@127.0.0.1:3306/test")
        );
        assert_eq!(redis.redis_prefix, "t1");
        assert!(Options::parse(["--store".into(), "mongodb".into()]).is_err());
        assert!(Options::parse(["--bogus".into(), "1".into()]).is_err());
        let o = Options::parse(
            "--trusted-proxy 10.0.0.0/8 --trusted-proxy 127.0.0.1 --key-header X-Idempotency-Key \
             --credential-header X-Session --credential-header cookie"
                .split(' ')
                .map(String::from),
        )
        .unwrap();
        assert_eq!(o.trusted_proxies.len(), 2);
        assert_eq!(o.key_header, "x-idempotency-key");
        assert_eq!(o.credential_headers, ["x-session", "cookie"]);
        let c = o.config();
        assert_eq!(
            c.credential_headers(),
            ["authorization", "x-session", "cookie"]
        );
        assert!(Options::parse(["--trusted-proxy".into(), "nope".into()]).is_err());
        assert!(Options::parse(["--key-header".into(), "bad header".into()]).is_err());
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_url_and_plain_path_name_one_file() {
        let url = sqlite_options("sqlite:///tmp/dir/x.db?mode=rwc").unwrap();
        let plain = sqlite_options("/tmp/dir/x.db").unwrap();
        assert_eq!(url.get_filename(), std::path::Path::new("/tmp/dir/x.db"));
        assert_eq!(url.get_filename(), plain.get_filename());
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
