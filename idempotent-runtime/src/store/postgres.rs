//! The PostgreSQL store, through sqlx ([the contract](crate::design) §5): several replicas share one table.
//!
//! Every operation is one statement, so one round trip: a claim is `INSERT … ON CONFLICT DO
//! NOTHING` with the standing row read back in the same statement, and a replay writes nothing
//! (no row lock, no WAL). Leases and expiry are judged by the database's clock, so replicas
//! never disagree about them. (Two costs sit beside that round trip, off the request's path or
//! paid once: sqlx prepares each statement once per connection, and its pool checks a connection
//! with a `Sync` message as it returns to the pool, after the answer has been read.)
//!
//! The schema ships with the crate and is applied by
//! [`PostgresStore::migrate`], which keeps its own version table (never sqlx's
//! `_sqlx_migrations`), so it coexists with the application's own migrations.
//!
//! ```no_run
//! # async fn example() -> Result<(), sqlx::Error> {
//! use idempotent_runtime::Idempotency;
//! use idempotent_runtime::store::postgres::PostgresStore;
//!
//! let store = PostgresStore::builder()
//!     .schema("app")
//!     .table("idempotency_records")
//!     .connect("postgres://app@db/app")
//!     .await?;
//! store.migrate().await?;
//! let idempotency = Idempotency::builder(store).build();
//! # Ok(()) }
//! ```
//!
//! # How it behaves
//!
//! - `migrate()` applies versioned DDL shipped in the crate under a transaction-scoped advisory lock
//!   and keeps its own `<table>_migrations` table (each version with the checksum of the SQL it
//!   ran; a version applied with other SQL is refused, naming it), so it never clashes with your
//!   sqlx migrations.
//! - The claim is one statement: `INSERT … ON CONFLICT DO NOTHING` with the standing row read back
//!   in the same statement. A first request costs two statements (claim, complete); a replay one,
//!   and it writes nothing (no row lock, no WAL) — tests count the statements and check the row's
//!   `xmin`. Fencing tokens make completing, releasing and renewing conditional, so a request whose
//!   lease lapsed can never overwrite its successor.
//! - **Group commit.** Under load, claims (replays included) and completions that arrive while a
//!   statement is out share the next one: one statement, one transaction, one WAL flush for up to
//!   `batch_rows` requests (32), with at most `batches_in_flight` statements out (1, and up to three
//!   more while none has come back for 20 ms, so one waiting on a lock never holds the queue). An
//!   idle service adds no wait: a request that finds fewer out goes at once. A round inserts its
//!   claims, then completes its completions, each in `(scope, key)` order, so two rounds (of two
//!   replicas) never wait on each other in a cycle; a key sent twice in a round acquires once; a
//!   round refused as a whole (a lock timeout on one row) is resent row by row. Rows are found by
//!   primary key, never by joining the table with the batch, because a join planned while the table
//!   was young (a hash join over a sequential scan) would stay in the connection's plan cache as the
//!   table grows (a test counts rows read by sequential scans: 0). Fencing, the snapshot re-read,
//!   `lock_timeout` and the unknown-outcome release are the same for a batched row; `batch_rows(1)`
//!   turns it off.
//! - **Heap-only completions.** The completion changes no indexed column (the sweeper's index holds
//!   `sweep_after`, the earliest a record can expire, set once when it is claimed), and the table
//!   leaves 30 % of each page free (`fillfactor = 70`), so a completion usually writes no index
//!   entry. Migration 3 moves a table of the previous shape there without rewriting its rows.
//! - Times come from the database's clock, so replicas never disagree about a lease.
//! - `lock_timeout` on the store's connections: a claim that meets another transaction's
//!   uncommitted row answers 409 instead of waiting.
//! - **Behind a connection pooler in transaction mode** (PgBouncer `pool_mode = transaction`),
//!   build it with [`PostgresStoreBuilder::transaction_pooler`]: each operation is then a
//!   transaction of its own that sets the timeouts with `SET LOCAL`, with unnamed statements
//!   only, since the pooler may give each transaction another server connection. Without it,
//!   [`migrate`](PostgresStore::migrate) refuses to run behind a pooler that dropped or refused
//!   the store's `lock_timeout`, naming the setting. Its locks are transaction-scoped and it
//!   never `LISTEN`s.
//! - Each replica runs the sweeper: 500 rows a statement with `FOR UPDATE SKIP LOCKED`, every
//!   `min(retention, 1 h)`, again at once when a batch was full, the expiry re-checked in the delete.
//!   (`Idempotency::builder(store).sweeper(false)` turns it off where another process sweeps.)
//! - Tested with two server processes sharing one database: 1,000 keys each sent 16 times
//!   concurrently across both ran exactly 1,000 handlers; a replica SIGKILLed mid-handler leaves its
//!   key at 409 until the lease lapses, after which it runs once.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};

use super::{
    Claim, ClaimRequest, FencingToken, InspectedRow, RecordInfo, RecordedResponse, Standing,
    StandingState, Store, StoreError,
};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::sql::{self, ConnectError, InvalidName, Migrations, Pg, STORE_NAMES, Step, TableName};

/// `$query.$fetch(…)` on `$pool` as the store's [`Session`] asks: straight on the pool, or, behind
/// a transaction pooler, unnamed and in a transaction of its own that sets the store's timeouts
/// (outside a transaction such a pooler may send the parse and the execution of one unnamed
/// statement to two server connections). A failed statement's transaction is rolled back before
/// its connection goes back to the pool, so the pooler's server connection is never left
/// pinned in an aborted transaction.
macro_rules! on_pool {
    ($core:expr, $pool:expr, $query:expr, $fetch:ident) => {
        async {
            match &$core.session {
                Session::Direct { .. } => $query.$fetch($pool).await,
                Session::Pooled { begin } => {
                    let mut tx = $pool.begin_with(AssertSqlSafe(Arc::clone(begin))).await?;
                    match $query.persistent(false).$fetch(&mut *tx).await {
                        Ok(out) => tx.commit().await.map(|()| out),
                        Err(e) => {
                            let _ = tx.rollback().await;
                            Err(e)
                        }
                    }
                }
            }
        }
    };
}
mod batch;
mod enlisted;

/// The versioned DDL shipped with the crate, in order. `{table}` is replaced by the quoted,
/// qualified table name, `{name}` by the bare one and `{schema}` by the quoted schema and a dot
/// (or nothing, for the connection's default schema). Never edit a shipped migration: add one.
const MIGRATIONS: &[Step] = &[
    Step {
        version: 1,
        description: "create records",
        template: include_str!("../../migrations/postgres/0001_create_records.sql"),
    },
    Step {
        version: 2,
        description: "record route and creation time",
        template: include_str!("../../migrations/postgres/0002_record_route_and_creation.sql"),
    },
    Step {
        version: 3,
        description: "heap-only completions",
        template: include_str!("../../migrations/postgres/0003_heap_only_completions.sql"),
    },
    Step {
        version: 4,
        description: "record trailers",
        template: include_str!("../../migrations/postgres/0004_record_trailers.sql"),
    },
];

/// SQLSTATE `lock_not_available`: `lock_timeout` elapsed.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// How often a statement whose snapshot missed a concurrent commit is re-run before giving up.
const MAX_RERUNS: usize = 8;

/// The default table name.
pub(crate) const DEFAULT_TABLE: &str = "idempotency_records";

/// Group commit's defaults: up to 32 requests a statement, one statement out at once (more only
/// while it is stalled). Measured in `scripts/bench`'s pinned setup, one statement out made the
/// largest batches and cost the database the least: a commit's WAL flush dominates.
/// A completion batch binds 8 parameters a row; PostgreSQL takes at most 65,535.
const MAX_BATCH_ROWS: usize = 128;

const DEFAULT_BATCH: batch::Limits = batch::Limits {
    rows: 32,
    in_flight: 1,
};

/// Builds a [`PostgresStore`]: table and schema names, and the settings of the pool it opens.
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresStoreBuilder {
    schema: Option<String>,
    table: String,
    lock_timeout: Duration,
    statement_timeout: Duration,
    acquire_timeout: Duration,
    max_connections: u32,
    application_name: Option<String>,
    reserved_connections: u32,
    batch: batch::Limits,
    transaction_pooler: bool,
    operation_timeout: Option<Duration>,
}

impl PostgresStoreBuilder {
    /// The table name (default `idempotency_records`): ASCII letters, digits and `_`, not
    /// starting with a digit, at most 48 characters (its index and version table are named
    /// after it). Another name fails [`build`](Self::build) with [`InvalidName`], and
    /// [`connect`](Self::connect) with [`ConnectError::InvalidName`], before anything connects.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The schema holding the table (default: the first schema of the connection's
    /// `search_path`). Same naming rules as [`table`](Self::table); `migrate()` creates it.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// `lock_timeout` of the store's connections (default 1 s): a claim that meets another
    /// transaction's uncommitted row for the same key waits at most this long, then reports
    /// the key as in progress (409) instead of waiting for that transaction.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// `statement_timeout` of the store's connections (default 10 s).
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// How long an operation waits for a pooled connection before failing with
    /// [`StoreError::Unavailable`] (503) (default 2 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long a store operation (claim, completion, release, renewal, inspect, forget,
    /// sweep) waits for PostgreSQL's answer before it fails with [`StoreError::Unavailable`]
    /// (default: [`statement_timeout`](Self::statement_timeout) + 1 s, when the server would
    /// have cancelled the statement itself). Across a network partition nothing comes back,
    /// not even an error (TCP keeps resending for about 15 minutes): without this bound a claim
    /// would hang there instead of answering 503, and a renewal could not see its lease lapse.
    /// The outcome of an operation cut off is unknown, as after a dropped connection.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }

    fn effective_operation_timeout(&self) -> Duration {
        self.operation_timeout
            .unwrap_or(self.statement_timeout + Duration::from_secs(1))
    }

    /// Size of the pool the store opens (default 10).
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// Connections kept apart from the pool for the one read that answers an enlisted replay
    /// or a duplicate held by another replica (default 2): enlisted handlers hold pooled
    /// connections for their whole transaction, and these answers must not wait behind them
    /// ([the contract](crate::design) §5). They come on top of
    /// [`max_connections`](Self::max_connections), opened on first use with the same settings.
    pub fn reserved_connections(mut self, n: u32) -> Self {
        self.reserved_connections = n.max(1);
        self
    }

    /// Group commit: at most `rows` requests' claims and completions in one statement
    /// (default 32, at most 128; 1 sends each request alone). Requests that arrive while
    /// [`batches_in_flight`](Self::batches_in_flight) statements are out wait for the next one
    /// and go out together, claims and completions alike, as one transaction; when fewer are out
    /// a request goes at once, so an idle pool adds no wait ([the contract](crate::design) §5).
    pub fn batch_rows(mut self, rows: usize) -> Self {
        self.batch.rows = rows.clamp(1, MAX_BATCH_ROWS);
        self
    }

    /// Statements out at once before requests start waiting to go out together (default 1). Fewer batches carry more rows each: less work for the
    /// database per request, a little more latency under load. Each takes a pooled connection
    /// while it is out. When none has come back for 20 ms (one waits on a lock, say), up to
    /// three more may start beside them, so a stalled statement never holds the whole queue.
    pub fn batches_in_flight(mut self, statements: usize) -> Self {
        self.batch.in_flight = statements.max(1);
        self
    }

    /// Whether the store reaches PostgreSQL through a connection pooler in transaction pooling
    /// mode (PgBouncer `pool_mode = transaction`, RDS Proxy, Supavisor) (default `false`).
    /// Such a pooler lends each transaction a different server connection, so the store then
    /// keeps nothing on a connection beyond one transaction: every operation runs in a
    /// transaction of its own that begins with `SET LOCAL lock_timeout` and
    /// `SET LOCAL statement_timeout` (instead of session settings sent when connecting, which
    /// a pooler drops or refuses), and every statement is unnamed (`persistent(false)`), never a
    /// named prepared statement another client could meet on the same server connection. The
    /// migration runner uses only transaction-scoped advisory locks, as enlisted mode does, and
    /// nothing here uses `LISTEN`.
    ///
    /// The cost: an operation takes four round trips instead of one (begin, parse, execute,
    /// commit), so leave it off without such a pooler. With it off, [`PostgresStore::migrate`]
    /// refuses to run when the connection lost the store's `lock_timeout` (a pooler that ignores
    /// the `options` startup parameter), naming this setting. Statements a handler runs in an
    /// [enlisted](crate::enlisted) transaction, or an inbox handler in its own, are the
    /// application's: behind such a pooler they must be unnamed too (`.persistent(false)` on
    /// each sqlx query).
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), sqlx::Error> {
    /// use idempotent_runtime::store::postgres::PostgresStore;
    ///
    /// // PgBouncer in transaction pooling mode on port 6432.
    /// let store = PostgresStore::builder()
    ///     .transaction_pooler(true)
    ///     .connect("postgres://app@pgbouncer:6432/app")
    ///     .await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn transaction_pooler(mut self, behind: bool) -> Self {
        self.transaction_pooler = behind;
        self
    }

    /// `application_name` of the store's connections (default `idempotent`), as shown in
    /// `pg_stat_activity`.
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// Opens a pool to `url` with these settings and builds the store over it. Does not
    /// migrate: call [`PostgresStore::migrate`] (once per deployment is enough; it is safe from
    /// several replicas at once).
    pub async fn connect(self, url: &str) -> Result<PostgresStore, ConnectError> {
        let options: PgConnectOptions = url.parse()?;
        self.connect_with(options).await
    }

    /// As [`connect`](Self::connect), from parsed connect options (whose own `options` and
    /// `application_name` are kept unless this builder sets them).
    pub async fn connect_with(
        self,
        options: PgConnectOptions,
    ) -> Result<PostgresStore, ConnectError> {
        // The pool connects lazily: without this, a missing TLS feature surfaces at the first
        // statement, naming sqlx's features instead of this crate's.
        super::postgres_tls::require_tls_support(&options, super::postgres_tls::TLS_COMPILED)?;
        let table = TableName::new(STORE_NAMES, self.schema.as_deref(), &self.table)?;
        // Behind a transaction pooler these session settings would not reach the server (or be
        // refused): each transaction sets them with SET LOCAL instead (`Core::begin`).
        let mut options = if self.transaction_pooler {
            options
        } else {
            options.options([
                ("lock_timeout", self.lock_timeout_setting()),
                ("statement_timeout", self.statement_timeout_setting()),
            ])
        };
        match (&self.application_name, options.get_application_name()) {
            (Some(name), _) => options = options.application_name(name),
            (None, None) => options = options.application_name("idempotent"),
            (None, Some(_)) => {}
        }
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            // A ping before every checkout would double the round trips of a replay; a dead
            // connection fails its statement instead (503) and is not reused.
            .test_before_acquire(false)
            .connect_lazy_with(options);
        let session = self.session(true);
        Ok(PostgresStore::with_table(
            pool,
            table,
            self.reserved_connections,
            self.batch,
            session,
            self.effective_operation_timeout(),
        ))
    }

    /// Builds the store over an existing pool. The pool's connections should set
    /// `lock_timeout` (see [`lock_timeout`](Self::lock_timeout)): without it, a claim that meets
    /// another transaction's uncommitted row waits for that transaction. With
    /// [`transaction_pooler`](Self::transaction_pooler) the store sets this builder's
    /// `lock_timeout` and `statement_timeout` in each of its transactions instead. The pool settings of
    /// this builder do not apply. Fails only on a bad table or schema name (which converts
    /// into `sqlx::Error` with `?`).
    pub fn build(self, pool: PgPool) -> Result<PostgresStore, InvalidName> {
        let table = TableName::new(STORE_NAMES, self.schema.as_deref(), &self.table)?;
        let session = self.session(false);
        Ok(PostgresStore::with_table(
            pool,
            table,
            self.reserved_connections,
            self.batch,
            session,
            self.effective_operation_timeout(),
        ))
    }

    fn lock_timeout_setting(&self) -> String {
        format!("{}ms", self.lock_timeout.as_millis().max(1))
    }

    fn statement_timeout_setting(&self) -> String {
        format!("{}ms", self.statement_timeout.as_millis().max(1))
    }

    /// How the store's connections carry their settings; `opened` when the store opened the
    /// pool itself (so it knows what its connections were sent).
    fn session(&self, opened: bool) -> Session {
        if self.transaction_pooler {
            Session::Pooled {
                begin: format!(
                    "BEGIN; SET LOCAL lock_timeout = '{}'; SET LOCAL statement_timeout = '{}'",
                    self.lock_timeout_setting(),
                    self.statement_timeout_setting()
                )
                .into(),
            }
        } else {
            Session::Direct {
                lock_timeout_ms: opened.then(|| self.lock_timeout.as_millis().max(1)),
            }
        }
    }
}

/// How the store's connections carry its settings and statements.
#[derive(Debug, Clone)]
enum Session {
    /// Each connection is the store's for its life: `lock_timeout` and `statement_timeout` are
    /// session settings sent when connecting, and statements are prepared once per connection.
    Direct {
        /// The `lock_timeout` (ms) the store sent when connecting (`None`: a pool the
        /// application built), checked by `migrate()`.
        lock_timeout_ms: Option<u128>,
    },
    /// Behind a transaction pooler ([`PostgresStoreBuilder::transaction_pooler`]): every
    /// operation is a transaction of its own opened by `begin` (`BEGIN` and the settings as
    /// `SET LOCAL`), and every statement is unnamed.
    Pooled { begin: Arc<str> },
}

/// The statements, rendered once for the configured table.
struct Statements {
    claim: Arc<str>,
    claim_many: Arc<str>,
    reclaim: Arc<str>,
    complete: Arc<str>,
    /// [`complete_many`] for each of [`complete_many_sizes`]: (rows, statement).
    complete_many: Vec<(usize, Arc<str>)>,
    /// [`round`] for each of [`complete_many_sizes`]: (completion rows, statement).
    rounds: Vec<(usize, Arc<str>)>,
    release: Arc<str>,
    renew: Arc<str>,
    sweep: Arc<str>,
    inspect: Arc<str>,
    forget: Arc<str>,
}

/// The statement's clock (`statement_timestamp()`, not the transaction's start: inside an
/// enlisted transaction the two differ) moved by the test clock offset, bound as the parameter
/// `$n` (milliseconds).
fn now(n: usize) -> String {
    format!("(statement_timestamp() + ${n}::bigint * interval '1 millisecond')")
}

/// The columns a standing row is reported with, from row `r` and the clock `clock.now`.
const STANDING_COLUMNS: &str = "r.token, r.fingerprint, r.fp_version, \
     CASE WHEN r.expires_at <= clock.now THEN 3 \
          WHEN r.state = 1 THEN 2 \
          WHEN r.lease_until > clock.now THEN 0 \
          ELSE 1 END::smallint, \
     GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (r.lease_until - clock.now)) * 1000))::bigint, \
     r.status, r.headers, r.body, \
     GREATEST(0, FLOOR(EXTRACT(EPOCH FROM (r.expires_at - clock.now)) * 1000))::bigint, \
     r.trailers";

const ACQUIRED_COLUMNS: &str = "true, token, NULL::bytea, NULL::smallint, NULL::smallint, \
     NULL::bigint, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint, NULL::bytea";

/// The padded sizes of completion batches: 2, 3, 4, 6, 8, 12, 16, 24, … up to the first at
/// least `max_rows`. A connection prepares a handful of statements, not one a size, and a batch
/// carries at most a third more (empty) rows than it has.
fn complete_many_sizes(max_rows: usize) -> Vec<usize> {
    let mut sizes = Vec::new();
    for size in (1..).flat_map(|shift| [1usize << shift, 3usize << (shift - 1)]) {
        sizes.push(size);
        if size >= max_rows {
            return sizes;
        }
    }
    unreachable!("the sizes grow past any usize a batch is limited to")
}

/// The statement that completes up to `rows` records: one `UPDATE` by primary key a row, each
/// its own data-modifying CTE, answering the ordinals (from 1) of the rows it completed. Row
/// `k` binds `$8k+1…$8k+8` (scope, key, token, status, headers, body, retention in ms,
/// trailers or NULL), the clock offset comes last; a row bound with a NULL scope matches nothing (padding).
///
/// Not one `UPDATE … FROM unnest(…)`: PostgreSQL plans that join once per connection and keeps
/// the plan, and a plan made while the table is young (a hash join over a sequential scan of
/// the table) is kept as it grows, until the next `ANALYZE` replaces it: every completion would
/// read the whole table. A lookup by primary key a row plans as the single-row statement does:
/// an index scan, unless the table was analyzed while it held a handful of rows (then both scan
/// it until the next `ANALYZE`). The CTEs run in order, so rows (sorted by `(scope, key)`) are
/// locked in order.
fn complete_many(t: &str, rows: usize) -> String {
    let ctes = completion_ctes(t, rows, 0, &now(8 * rows + 1));
    let union: Vec<String> = (0..rows).map(|k| format!("SELECT n FROM c{k}")).collect();
    format!("WITH {} {}", ctes.join(", "), union.join(" UNION ALL "))
}

/// The CTEs `c0…` of [`complete_many`], row `k` binding `$base+8k+1…$base+8k+8`, each
/// returning its ordinal (from 1) as `n`.
fn completion_ctes(t: &str, rows: usize, base: usize, now: &str) -> Vec<String> {
    (0..rows)
        .map(|k| {
            let p = |i: usize| base + 8 * k + i;
            let (scope, key, token, status, headers, body, retention, trailers) =
                (p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8));
            let expiry = format!("{now} + ${retention}::bigint * interval '1 millisecond'");
            format!(
                "c{k} AS (UPDATE {t} r SET state = 1, status = ${status}::smallint, \
                     headers = ${headers}::bytea, body = ${body}::bytea, lease_until = {now}, \
                     expires_at = {expiry}, sweep_after = LEAST(r.sweep_after, {expiry}), \
                     trailers = ${trailers}::bytea \
                 WHERE r.scope = ${scope}::bytea AND r.key = ${key}::text \
                   AND r.token = ${token}::bigint \
                   AND (r.state = 0 OR (r.status = ${status} AND r.headers = ${headers} \
                                        AND r.body = ${body} \
                                        AND r.trailers IS NOT DISTINCT FROM ${trailers})) \
                 RETURNING {ordinal}::bigint AS n)",
                ordinal = k + 1
            )
        })
        .collect()
}

/// The CTEs and the final `SELECT` of the batched claim: arrays `$1…$8` (scope, key, token,
/// fingerprint, its version, lease and retention in ms, route), the clock offset `$clock`. The
/// `SELECT` answers each request's row: [`decode_batched`]'s columns, then its ordinal `i.n`.
///
/// Rows are inserted in `(scope, key)` order, so two batches never wait on each other in a
/// cycle. A key carried twice is inserted once and both rows match its `RETURNING` row by key,
/// so a request has acquired only when the returned token is its own; the other reads back
/// nothing (its row is this statement's own insert, invisible to its read-back) and is re-run,
/// like a row committed after the snapshot. Only a row that inserted nothing is read back, a
/// lookup by primary key a row (`LATERAL … LIMIT` is never turned into a join: see
/// [`complete_many`] for why that matters).
fn claim_many_parts(t: &str, clock: usize) -> (String, String) {
    let ctes = format!(
        "clock AS (SELECT {n} AS now), \
         i AS (SELECT * FROM unnest($1::bytea[], $2::text[], $3::bigint[], $4::bytea[], \
                                    $5::smallint[], $6::bigint[], $7::bigint[], $8::text[]) \
               WITH ORDINALITY AS i(scope, key, token, fingerprint, fp_version, lease_ms, \
                                    retention_ms, route, n)), \
         ins AS (INSERT INTO {t} (scope, key, token, fingerprint, fp_version, state, \
                                  lease_until, expires_at, sweep_after, route, created_at) \
                 SELECT i.scope, i.key, i.token, i.fingerprint, i.fp_version, 0, \
                        clock.now + i.lease_ms * interval '1 millisecond', \
                        clock.now + (i.lease_ms + i.retention_ms) * interval '1 millisecond', \
                        clock.now + i.retention_ms * interval '1 millisecond', \
                        i.route, clock.now \
                 FROM i, clock ORDER BY i.scope, i.key \
                 ON CONFLICT DO NOTHING \
                 RETURNING scope, key, token)",
        n = now(clock)
    );
    let select = format!(
        "SELECT COALESCE(ins.token = i.token, false), {STANDING_COLUMNS}, i.n \
         FROM i CROSS JOIN clock \
         LEFT JOIN ins ON ins.scope = i.scope AND ins.key = i.key \
         LEFT JOIN LATERAL (SELECT * FROM {t} r \
                            WHERE ins.token IS NULL \
                              AND r.scope = i.scope AND r.key = i.key LIMIT 1) r ON true"
    );
    (ctes, select)
}

/// One round of group commit carrying both kinds: the batched claim over arrays `$1…$8` and
/// `completions` completion rows from `$9` (8 a row), the clock offset last. Claims answer
/// their ordinal (from 1) in the last column; completion `k` answers `-(k+1)` there and NULL in
/// the others.
///
/// One statement is one commit (one WAL flush) for both. The claims' insert runs first (the
/// first branch of the `UNION ALL` reads it), then the completions in order. That order keeps
/// rounds from deadlocking: a claim waits only on rows others are writing (an uncommitted insert
/// of the same key, or a completion's update of a key it conflicts with), while a completion
/// waits only on another writer of its row; so a round waiting in its claims holds nothing but
/// its own new rows, which no completion touches, and rounds waiting in their completions lock
/// rows in `(scope, key)` order.
fn round(t: &str, completions: usize) -> String {
    let clock = 8 + 8 * completions + 1;
    let (claim_ctes, claims) = claim_many_parts(t, clock);
    let ctes = completion_ctes(t, completions, 8, &now(clock));
    let done: Vec<String> = (0..completions)
        .map(|k| {
            format!(
                "SELECT NULL::boolean, NULL::bigint, NULL::bytea, NULL::smallint, \
                        NULL::smallint, NULL::bigint, NULL::smallint, NULL::bytea, NULL::bytea, \
                        NULL::bigint, NULL::bytea, -n FROM c{k}"
            )
        })
        .collect();
    format!(
        "WITH {claim_ctes}, {} {claims} UNION ALL {}",
        ctes.join(", "),
        done.join(" UNION ALL ")
    )
}

impl Statements {
    fn new(t: &str, max_rows: usize) -> Self {
        // Parameters shared by claim and reclaim: $1 scope, $2 key, $3 token, $4 fingerprint,
        // $5 fingerprint version, $6 lease (ms), $7 retention (ms), $8 clock offset (ms); the
        // route is $9 in a claim and $10 in a reclaim.
        let clock = format!("clock AS (SELECT {} AS now)", now(8));
        let lease_until = "clock.now + $6::bigint * interval '1 millisecond'";
        let expires_at = "clock.now + ($6::bigint + $7::bigint) * interval '1 millisecond'";
        // The earliest the record can expire (a completion is later than its claim): what the
        // sweeper's index holds, so that a completion changes no indexed column.
        let sweep_after = "clock.now + $7::bigint * interval '1 millisecond'";
        // The read-back sees the statement's snapshot: a conflicting row committed after it
        // reads back as nothing, and the caller re-runs the statement. Data-modifying CTEs are
        // invisible to the rest of the statement, so a successful insert reads back nothing.
        let claim = format!(
            "WITH {clock}, \
             ins AS (INSERT INTO {t} (scope, key, token, fingerprint, fp_version, state, \
                                      lease_until, expires_at, sweep_after, route, created_at) \
                     SELECT $1, $2, $3, $4, $5, 0, {lease_until}, {expires_at}, {sweep_after}, \
                            $9, clock.now \
                     FROM clock \
                     ON CONFLICT DO NOTHING \
                     RETURNING token) \
             SELECT {ACQUIRED_COLUMNS} FROM ins \
             UNION ALL \
             SELECT false, {STANDING_COLUMNS} FROM {t} r, clock WHERE r.scope = $1 AND r.key = $2"
        );
        // The same claim for many requests, over arrays ($9 the clock offset): see
        // [`claim_many_parts`].
        let claim_many = {
            let (ctes, select) = claim_many_parts(t, 9);
            format!("WITH {ctes} {select} ORDER BY i.n")
        };
        // $9: the stale token. Takes over an expired record (whoever holds it) or an abandoned
        // one still held by `stale`, the same rule as the in-memory store.
        let reclaim = format!(
            "WITH {clock}, \
             upd AS (UPDATE {t} r SET token = $3, fingerprint = $4, fp_version = $5, state = 0, \
                         lease_until = {lease_until}, expires_at = {expires_at}, \
                         status = NULL, headers = NULL, body = NULL, trailers = NULL, \
                         sweep_after = {sweep_after}, route = $10, created_at = clock.now \
                     FROM clock \
                     WHERE r.scope = $1 AND r.key = $2 \
                       AND (r.expires_at <= clock.now \
                            OR (r.token = $9 AND r.state = 0 AND r.lease_until <= clock.now)) \
                     RETURNING r.token) \
             SELECT {ACQUIRED_COLUMNS} FROM upd \
             UNION ALL \
             SELECT false, {STANDING_COLUMNS} FROM {t} r, clock \
             WHERE r.scope = $1 AND r.key = $2 AND NOT EXISTS (SELECT 1 FROM upd)"
        );
        // No indexed column changes (the sweeper's index holds `sweep_after`): where the page
        // has room, the completion is a heap-only update and writes no index entry. Only a
        // completion kept for less than the claim's retention moves `sweep_after` earlier (an
        // unchanged value does not stand in the way of a heap-only update). $9: the trailers,
        // NULL for none.
        let complete = format!(
            "UPDATE {t} SET state = 1, status = $4, headers = $5, body = $6, \
                 lease_until = {n}, expires_at = {n} + $7::bigint * interval '1 millisecond', \
                 sweep_after = LEAST(sweep_after, {n} + $7::bigint * interval '1 millisecond'), \
                 trailers = $9::bytea \
             WHERE scope = $1 AND key = $2 AND token = $3 \
               AND (state = 0 OR (status = $4 AND headers = $5 AND body = $6 \
                                  AND trailers IS NOT DISTINCT FROM $9::bytea))",
            n = now(8)
        );
        let release =
            format!("DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND state = 0");
        // A reservation expires `retention` after its lease: keep that distance when renewing.
        let renew = format!(
            "UPDATE {t} SET lease_until = {n} + $4::bigint * interval '1 millisecond', \
                 expires_at = {n} + $4::bigint * interval '1 millisecond' \
                              + (expires_at - lease_until) \
             WHERE scope = $1 AND key = $2 AND token = $3 AND state = 0",
            n = now(5)
        );
        // `ctid = ANY(ARRAY(…))` plans as a TID scan; the outer predicate re-checks expiry so a
        // row reclaimed between the select and the delete is never freed.
        let sweep = format!(
            "DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
                 SELECT ctid FROM {t} WHERE sweep_after <= {n} AND expires_at <= {n} \
                 LIMIT $1 FOR UPDATE SKIP LOCKED)) \
             AND expires_at <= {n}",
            n = now(2)
        );
        // Times as epoch milliseconds. The body's and headers' sizes come from their stored
        // length (no detoasting); the values themselves only when $3 asks for them.
        let epoch = |c: &str| format!("FLOOR(EXTRACT(EPOCH FROM {c}) * 1000)::bigint");
        let inspect = format!(
            "SELECT state, status, route, {created}, {lease}, {expires}, {now}, \
                    COALESCE(octet_length(body), 0)::bigint, \
                    COALESCE(octet_length(headers), 0)::bigint, \
                    CASE WHEN $3 THEN headers END, CASE WHEN $3 THEN body END, \
                    CASE WHEN $3 THEN trailers END \
             FROM {t} WHERE scope = $1 AND key = $2",
            created = epoch("created_at"),
            lease = epoch("lease_until"),
            expires = epoch("expires_at"),
            now = epoch(&now(4)),
        );
        let forget = format!("DELETE FROM {t} WHERE scope = $1 AND key = $2");
        Self {
            inspect: inspect.into(),
            forget: forget.into(),
            claim: claim.into(),
            claim_many: claim_many.into(),
            reclaim: reclaim.into(),
            complete: complete.into(),
            complete_many: complete_many_sizes(max_rows)
                .into_iter()
                .map(|rows| (rows, complete_many(t, rows).into()))
                .collect(),
            rounds: complete_many_sizes(max_rows)
                .into_iter()
                .map(|rows| (rows, round(t, rows).into()))
                .collect(),
            release: release.into(),
            renew: renew.into(),
            sweep: sweep.into(),
        }
    }
}

/// The PostgreSQL store. Cheap to share behind an `Arc`; build it with
/// [`PostgresStore::connect`], [`PostgresStore::new`] or [`PostgresStore::builder`].
pub struct PostgresStore {
    core: Arc<Core>,
    table: TableName,
    /// Detached claims and completions, sent together under load (group commit).
    rounds: Arc<batch::Batcher<Rounds>>,
    /// The enlisted mode's read before any transaction, on connections of its own.
    glance: enlisted::Glance,
    /// How long a detached operation waits for PostgreSQL.
    operation_timeout: Duration,
}

/// What every statement needs, shared with the tasks that send batches.
struct Core {
    pool: PgPool,
    session: Session,
    sql: Statements,
    clock_offset_ms: AtomicI64,
    statements: AtomicU64,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.qualified)
            .finish_non_exhaustive()
    }
}

fn millis_i64(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn unavailable(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

/// Whether the connection a statement went out on was already gone: the server terminated its
/// backend (SQLSTATE class 57P: `pg_terminate_backend`, a restart) or the socket failed.
fn connection_dropped(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| code.starts_with("57P") || code.starts_with("08")),
        _ => false,
    }
}

/// `e` with the fix named when it is what a transaction pooler does to a store built without
/// [`PostgresStoreBuilder::transaction_pooler`]: PgBouncer refusing the `options` startup
/// parameter, or a named prepared statement meeting another client's on a shared server
/// connection (SQLSTATE 42P05, `prepared statement "sqlx_s_1" already exists`; 26000 when it
/// is missing).
fn behind_a_pooler(e: sqlx::Error) -> sqlx::Error {
    let pooled = match &e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("42P05" | "26000"))
                || db.message().contains("unsupported startup parameter")
        }
        _ => false,
    };
    if !pooled {
        return e;
    }
    sqlx::Error::Configuration(
        format!(
            "{e}: a connection pooler in transaction mode (PgBouncer, say) stands between the \
             PostgreSQL store and PostgreSQL; build the store with \
             PostgresStoreBuilder::transaction_pooler(true)"
        )
        .into(),
    )
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(LOCK_NOT_AVAILABLE))
}

/// What a claim or reclaim statement returned.
enum Decoded {
    Acquired,
    Standing(Standing),
    /// No row: the record vanished, or was committed after the statement's snapshot.
    Nothing,
}

fn corrupt(what: &str) -> StoreError {
    StoreError::unavailable(format!("corrupt idempotency record: {what}"))
}

/// The `trailers` column: NULL (a record without trailers, or a row written before they were
/// kept) is none.
fn decode_trailers(raw: Option<&[u8]>) -> Result<Vec<(String, Bytes)>, StoreError> {
    RecordedResponse::decode_headers(raw.unwrap_or_default())
        .ok_or_else(|| corrupt("trailers do not decode"))
}

/// What the `trailers` column holds for `response`: NULL when it has none.
fn encoded_trailers(response: &RecordedResponse) -> Option<Vec<u8>> {
    (!response.trailers.is_empty()).then(|| response.encode_trailers())
}

fn decode(rows: Vec<PgRow>) -> Result<Decoded, StoreError> {
    // A row deleted after the snapshot can read back beside a successful insert: the insert
    // wins.
    let mut acquired = false;
    for row in &rows {
        acquired |= row.try_get::<bool, _>(0).map_err(unavailable)?;
    }
    let Some(row) = rows.into_iter().next() else {
        return Ok(Decoded::Nothing);
    };
    if acquired {
        return Ok(Decoded::Acquired);
    }
    standing(&row).map(Decoded::Standing)
}

/// One row of the batched claim: whether this request acquired, else the row read back (none:
/// re-run it).
fn decode_batched(row: &PgRow) -> Result<Decoded, StoreError> {
    if row.try_get::<bool, _>(0).map_err(unavailable)? {
        return Ok(Decoded::Acquired);
    }
    if row
        .try_get::<Option<i64>, _>(1)
        .map_err(unavailable)?
        .is_none()
    {
        return Ok(Decoded::Nothing);
    }
    standing(row).map(Decoded::Standing)
}

/// The standing record in columns 1.. of a claim's row ([`STANDING_COLUMNS`]).
fn standing(row: &PgRow) -> Result<Standing, StoreError> {
    let token: i64 = row.try_get(1).map_err(unavailable)?;
    let digest: Vec<u8> = row.try_get(2).map_err(unavailable)?;
    let version: i16 = row.try_get(3).map_err(unavailable)?;
    let phase: i16 = row.try_get(4).map_err(unavailable)?;
    let fingerprint = Fingerprint {
        version: version as u16,
        digest: digest
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?,
    };
    let state = match phase {
        0 => {
            let left: i64 = row.try_get(5).map_err(unavailable)?;
            StandingState::Running {
                lease_left: Duration::from_millis(left.max(0) as u64),
            }
        }
        1 => StandingState::Abandoned,
        2 => {
            let status: Option<i16> = row.try_get(6).map_err(unavailable)?;
            let headers: Option<Vec<u8>> = row.try_get(7).map_err(unavailable)?;
            let body: Option<Vec<u8>> = row.try_get(8).map_err(unavailable)?;
            let trailers: Option<Vec<u8>> = row.try_get(10).map_err(unavailable)?;
            let status = status
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| corrupt("completed without a status"))?;
            let headers = RecordedResponse::decode_headers(headers.as_deref().unwrap_or_default())
                .ok_or_else(|| corrupt("headers do not decode"))?;
            StandingState::Completed(Arc::new(
                RecordedResponse::new(status, headers, Bytes::from(body.unwrap_or_default()))
                    .with_trailers(decode_trailers(trailers.as_deref())?),
            ))
        }
        _ => StandingState::Expired,
    };
    let expires_in = match state {
        StandingState::Completed(_) => {
            let left: i64 = row.try_get(9).map_err(unavailable)?;
            Some(Duration::from_millis(left.max(0) as u64))
        }
        _ => None,
    };
    Ok(Standing {
        token: FencingToken::from_i64(token),
        fingerprint,
        state,
        expires_in,
    })
}

/// A claim's parameters, owned, as a batch carries them.
struct ClaimRow {
    scope: ScopeHash,
    key: String,
    token: i64,
    fingerprint: Fingerprint,
    lease: Duration,
    retention: Duration,
    route: String,
}

impl ClaimRow {
    fn new(req: &ClaimRequest<'_>) -> Self {
        Self {
            scope: *req.scope,
            key: req.key.to_owned(),
            token: req.token.as_i64(),
            fingerprint: req.fingerprint,
            lease: req.lease,
            retention: req.retention,
            route: req.route.to_owned(),
        }
    }
}

/// A statement with some of its parameters bound.
type Bound<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Binds the batched claim's arrays `$1…$8` ([`claim_many_parts`]).
fn bind_claims<'q>(query: Bound<'q>, rows: &[&'q ClaimRow]) -> Bound<'q> {
    query
        .bind(rows.iter().map(|r| &r.scope[..]).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.key.as_str()).collect::<Vec<_>>())
        .bind(rows.iter().map(|r| r.token).collect::<Vec<_>>())
        .bind(
            rows.iter()
                .map(|r| &r.fingerprint.digest[..])
                .collect::<Vec<_>>(),
        )
        .bind(
            rows.iter()
                .map(|r| r.fingerprint.version as i16)
                .collect::<Vec<_>>(),
        )
        .bind(rows.iter().map(|r| millis_i64(r.lease)).collect::<Vec<_>>())
        .bind(
            rows.iter()
                .map(|r| millis_i64(r.retention))
                .collect::<Vec<_>>(),
        )
        .bind(rows.iter().map(|r| r.route.as_str()).collect::<Vec<_>>())
}

/// Binds [`completion_ctes`]' rows, then NULL rows (which match nothing) up to `size`.
fn bind_completions<'q>(mut query: Bound<'q>, rows: &[&'q CompleteRow], size: usize) -> Bound<'q> {
    for row in rows {
        query = query
            .bind(Some(&row.scope[..]))
            .bind(row.key.as_str())
            .bind(row.token)
            .bind(row.status)
            .bind(&row.headers[..])
            .bind(&row.body[..])
            .bind(millis_i64(row.retention))
            .bind(row.trailers.as_deref());
    }
    for _ in rows.len()..size {
        query = query
            .bind(None::<&[u8]>)
            .bind(None::<&str>)
            .bind(None::<i64>)
            .bind(None::<i16>)
            .bind(None::<&[u8]>)
            .bind(None::<&[u8]>)
            .bind(None::<i64>)
            .bind(None::<&[u8]>);
    }
    query
}

/// The statement of `statements` padded for `rows` completion rows, and its size.
fn padded(statements: &[(usize, Arc<str>)], rows: usize) -> (usize, &Arc<str>) {
    let (size, statement) = statements
        .iter()
        .find(|(size, _)| *size >= rows)
        .expect("the batch's limit bounds its rows");
    (*size, statement)
}

/// Which of `rows` completed, from the ordinals (from 1) the statement answered.
fn completed(rows: &[&CompleteRow], done: impl IntoIterator<Item = i64>) -> Vec<bool> {
    let mut completed = vec![false; rows.len()];
    for n in done {
        if let Some(slot) = usize::try_from(n - 1)
            .ok()
            .and_then(|i| completed.get_mut(i))
        {
            *slot = true;
        }
    }
    // The same completion carried twice updates its row once and is answered once: the other
    // copy completed too.
    for i in 0..rows.len() {
        if !completed[i] {
            let same = |j: &usize| {
                let (a, b) = (&rows[i], &rows[*j]);
                completed[*j] && a.token == b.token && a.key == b.key && a.scope == b.scope
            };
            completed[i] = (0..rows.len()).any(|j| same(&j));
        }
    }
    completed
}

/// A claim or a completion, as a round carries them.
enum Op {
    Claim(ClaimRow),
    Complete(CompleteRow),
}

/// An [`Op`]'s answer.
enum Done {
    Claimed(Decoded),
    Completed(bool),
}

/// Group commit of claims and completions together: a round that carries both is one statement
/// ([`round`]), one commit.
struct Rounds;

impl batch::Job for Rounds {
    type Row = Op;
    type Out = Done;

    /// Claims first, then completions, each by `(scope, key)`: the order [`round`] needs.
    fn order(a: &Op, b: &Op) -> std::cmp::Ordering {
        match (a, b) {
            (Op::Claim(a), Op::Claim(b)) => (&a.scope, &a.key).cmp(&(&b.scope, &b.key)),
            (Op::Complete(a), Op::Complete(b)) => (&a.scope, &a.key).cmp(&(&b.scope, &b.key)),
            (Op::Claim(_), Op::Complete(_)) => std::cmp::Ordering::Less,
            (Op::Complete(_), Op::Claim(_)) => std::cmp::Ordering::Greater,
        }
    }

    async fn many(core: &Core, rows: &[Op]) -> Result<Vec<Result<Done, StoreError>>, sqlx::Error> {
        // Sorted claims first, so the answers below (claims, then completions) are in order.
        let (mut claims, mut completions) = (Vec::new(), Vec::new());
        for op in rows {
            match op {
                Op::Claim(row) => claims.push(row),
                Op::Complete(row) => completions.push(row),
            }
        }
        let sql = &core.sql;
        let (size, statement) = match (claims.is_empty(), completions.is_empty()) {
            (false, true) => (0, &sql.claim_many),
            (true, _) => padded(&sql.complete_many, completions.len()),
            (false, false) => padded(&sql.rounds, completions.len()),
        };
        let mut query = sqlx::query(AssertSqlSafe(Arc::clone(statement)));
        if !claims.is_empty() {
            query = bind_claims(query, &claims);
        }
        if !completions.is_empty() {
            query = bind_completions(query, &completions, size);
        }
        let answered = on_pool!(core, &core.pool, query.bind(core.offset()), fetch_all).await?;

        let mut outcomes: Vec<Option<Result<Decoded, StoreError>>> = Vec::new();
        outcomes.resize_with(claims.len(), || None);
        let mut done = Vec::new();
        for row in &answered {
            // A claim answers its ordinal in its last column (a round's completions, minus
            // theirs); a batch of completions alone answers only its ordinals.
            let n: i64 = row.try_get(row.len() - 1)?;
            if claims.is_empty() || n < 0 {
                done.push(n.abs());
            } else if let Some(slot) = usize::try_from(n - 1)
                .ok()
                .and_then(|i| outcomes.get_mut(i))
            {
                *slot = Some(decode_batched(row));
            }
        }
        let claimed = outcomes.into_iter().map(|outcome| {
            outcome
                .unwrap_or_else(|| Err(StoreError::unavailable("a batched claim got no answer")))
                .map(Done::Claimed)
        });
        let completed = completed(&completions, done)
            .into_iter()
            .map(|done| Ok(Done::Completed(done)));
        Ok(claimed.chain(completed).collect())
    }

    async fn one(core: &Core, row: &Op) -> Result<Done, StoreError> {
        match row {
            Op::Claim(row) => core
                .claim_statement(&mut On::Pool, row, None)
                .await
                .map(Done::Claimed),
            Op::Complete(row) => complete_one(core, row).await.map(Done::Completed),
        }
    }

    /// A claim nobody heard is released if it may hold the key; a completion nobody heard
    /// stands as it is (the record is complete, and a retry replays it).
    fn unheard(
        core: Arc<Core>,
        row: Op,
        out: Result<Done, StoreError>,
    ) -> Option<impl Future<Output = ()> + Send + 'static> {
        let Op::Claim(row) = row else {
            return None;
        };
        let out = out.map(|done| match done {
            Done::Claimed(outcome) => outcome,
            Done::Completed(_) => unreachable!("a claim is answered as a claim"),
        });
        unheard_claim(core, row, out)
    }
}

/// Releases, under its own token, a claim or reclaim whose outcome nobody is left to hear, when
/// it may hold the key: it acquired, read back its own token (a resent statement whose first
/// attempt was written), or failed (it may have been written before the failure). `None` when
/// it certainly holds nothing.
fn unheard_claim(
    core: Arc<Core>,
    row: ClaimRow,
    out: Result<Decoded, StoreError>,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let holds = match &out {
        Ok(Decoded::Acquired) | Err(_) => true,
        Ok(Decoded::Standing(standing)) => standing.token.as_i64() == row.token,
        Ok(Decoded::Nothing) => false,
    };
    if !holds {
        return None;
    }
    Some(async move {
        let token = FencingToken::from_i64(row.token);
        if let Err(error) = core.release(&row.scope, &row.key, token).await {
            tracing::warn!(
                %error,
                "could not release a claim whose request was gone; its key stands until its lease lapses"
            );
        }
    })
}

/// A completion's parameters, owned, as a batch carries them.
struct CompleteRow {
    scope: ScopeHash,
    key: String,
    token: i64,
    status: i16,
    headers: Vec<u8>,
    body: Bytes,
    retention: Duration,
    /// NULL for none.
    trailers: Option<Vec<u8>>,
}

/// One completion alone: [`Store::complete`]'s statement.
async fn complete_one(core: &Core, row: &CompleteRow) -> Result<bool, StoreError> {
    let rows = core
        .conditional_write(|| {
            sqlx::query(AssertSqlSafe(Arc::clone(&core.sql.complete)))
                .bind(&row.scope[..])
                .bind(row.key.as_str())
                .bind(row.token)
                .bind(row.status)
                .bind(&row.headers[..])
                .bind(&row.body[..])
                .bind(millis_i64(row.retention))
                .bind(core.offset())
                .bind(row.trailers.as_deref())
        })
        .await?;
    Ok(rows == 1)
}

impl PostgresStore {
    /// A builder: table name `idempotency_records`, `lock_timeout` 1 s, a pool of 10.
    pub fn builder() -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            lock_timeout: Duration::from_secs(1),
            statement_timeout: Duration::from_secs(10),
            acquire_timeout: Duration::from_secs(2),
            max_connections: 10,
            application_name: None,
            reserved_connections: enlisted::RESERVED_CONNECTIONS,
            batch: DEFAULT_BATCH,
            transaction_pooler: false,
            operation_timeout: None,
        }
    }

    /// Opens a pool to `url` with the default settings (see [`builder`](Self::builder)).
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), sqlx::Error> {
    /// use idempotent_runtime::store::postgres::PostgresStore;
    ///
    /// let store = PostgresStore::connect("postgres://app@db/app").await?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::builder().connect(url).await
    }

    /// The store over an existing pool, with the default table `idempotency_records` in the
    /// connection's default schema. See [`PostgresStoreBuilder::build`] about `lock_timeout`.
    pub fn new(pool: PgPool) -> Self {
        let table = TableName::new(STORE_NAMES, None, DEFAULT_TABLE)
            .expect("the default table name is valid");
        Self::with_table(
            pool,
            table,
            enlisted::RESERVED_CONNECTIONS,
            DEFAULT_BATCH,
            Session::Direct {
                lock_timeout_ms: None,
            },
            Self::builder().effective_operation_timeout(),
        )
    }

    fn with_table(
        pool: PgPool,
        table: TableName,
        reserved: u32,
        batch: batch::Limits,
        session: Session,
        operation_timeout: Duration,
    ) -> Self {
        let core = Arc::new(Core {
            sql: Statements::new(&table.qualified, batch.rows),
            pool,
            session,
            clock_offset_ms: AtomicI64::new(0),
            statements: AtomicU64::new(0),
        });
        Self {
            rounds: batch::Batcher::new(Arc::clone(&core), batch),
            glance: enlisted::Glance::new(&table.qualified, reserved),
            core,
            table,
            operation_timeout,
        }
    }

    /// `operation` bounded by the store's [`operation_timeout`]: past it, unavailable.
    ///
    /// [`operation_timeout`]: PostgresStoreBuilder::operation_timeout
    fn bounded<T>(
        &self,
        operation: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        crate::sql::bounded("PostgreSQL", self.operation_timeout, operation)
    }

    /// The pool the store runs on.
    pub fn pool(&self) -> &PgPool {
        &self.core.pool
    }

    /// The quoted, schema-qualified table name, e.g. `"app"."idempotency_records"`.
    pub fn table(&self) -> &str {
        &self.table.qualified
    }

    /// Creates or upgrades the table to this crate's schema. Safe to call from several replicas
    /// at once (they serialise on a transaction-scoped advisory lock derived from the table's
    /// name) and idempotent. Applied versions are kept in `<table>_migrations` beside the table,
    /// with the checksum of the SQL each ran, never in sqlx's `_sqlx_migrations`, so the
    /// application's own migrations are unaffected.
    ///
    /// A version recorded with another checksum than this release's SQL is refused with
    /// [`MigrateError::VersionMismatch`](sqlx::migrate::MigrateError::VersionMismatch) before
    /// anything runs. To apply the schema with a migration tool of your own instead, see
    /// [`migrations`](Self::migrations).
    ///
    /// Without [`transaction_pooler`](PostgresStoreBuilder::transaction_pooler), it first checks
    /// that the store's connections carry the `lock_timeout` it sent when connecting, and refuses
    /// with [`sqlx::Error::Configuration`] naming that setting when they do not (a connection
    /// pooler that drops the `options` startup parameter), as it does when the pooler refuses
    /// the parameter or meets another client's prepared statement.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let Session::Direct { lock_timeout_ms } = &self.core.session else {
            return sql::migrate::<Pg>(&self.core.pool, &self.table, MIGRATIONS).await;
        };
        if let Some(expected) = lock_timeout_ms {
            // A simple query: no prepared statement, so it answers behind any pooler.
            let row = sqlx::raw_sql(AssertSqlSafe(format!(
                "SELECT current_setting('lock_timeout'), \
                        current_setting('lock_timeout')::interval \
                            = '{expected} milliseconds'::interval"
            )))
            .fetch_one(&self.core.pool)
            .await
            .map_err(behind_a_pooler)?;
            let (got, carried): (String, bool) = (row.try_get(0)?, row.try_get(1)?);
            if !carried {
                return Err(sqlx::Error::Configuration(
                    format!(
                        "the PostgreSQL store's connections do not carry the lock_timeout it \
                         sent when connecting ({expected}ms; they have {got}): a connection \
                         pooler in transaction mode (PgBouncer with ignore_startup_parameters = \
                         options, say) stands between the store and PostgreSQL and drops session \
                         settings; build the store with \
                         PostgresStoreBuilder::transaction_pooler(true) (transaction or session \
                         pooling mode; statement pooling mode cannot work: the store needs \
                         transactions)"
                    )
                    .into(),
                ));
            }
        }
        sql::migrate::<Pg>(&self.core.pool, &self.table, MIGRATIONS)
            .await
            .map_err(behind_a_pooler)
    }

    /// The DDL [`migrate`](Self::migrate) applies, rendered for `table` in `schema` (`None`: the
    /// connection's default schema), for users who ship schema changes with their own migration
    /// tool: each step's SQL, in order, or a sqlx `Migrator` of them. Use either this or
    /// `migrate()` for a table, never both (see [`Migrations`]). The schema must exist before
    /// the first step runs; [`Migrations::migrator`] creates it.
    ///
    /// ```
    /// use idempotent_runtime::store::postgres::PostgresStore;
    ///
    /// let migrations = PostgresStore::migrations(Some("app"), "idempotency_records")?;
    /// for step in &migrations {
    ///     // e.g. a Flyway file: V{version}__{description}.sql
    ///     println!("-- V{}: {}\n{}", step.version, step.description, step.sql);
    /// }
    /// assert!(PostgresStore::migrations(None, "no spaces").is_err());
    /// # Ok::<(), idempotent_runtime::store::InvalidName>(())
    /// ```
    pub fn migrations(schema: Option<&str>, table: &str) -> Result<Migrations, InvalidName> {
        Ok(TableName::new(STORE_NAMES, schema, table)?.migrations(MIGRATIONS))
    }

    /// Moves the store's clock forward by `by` (an offset added to the database's `now()` in
    /// every statement), so the contract suite can test leases and retention without sleeping.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn advance_clock_for_tests(&self, by: Duration) {
        self.core
            .clock_offset_ms
            .fetch_add(millis_i64(by), Ordering::SeqCst);
    }

    /// Statements sent to the database so far (each one round trip; a batch is one).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn statements_executed(&self) -> u64 {
        self.core.statements.load(Ordering::Relaxed)
    }

    fn offset(&self) -> i64 {
        self.core.offset()
    }

    fn count(&self) {
        self.core.count();
    }

    /// [`Store::claim`] on `on`, re-run while its snapshot misses a concurrent commit.
    async fn claim_on(&self, on: &mut On<'_>, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        for _ in 0..MAX_RERUNS {
            let row = ClaimRow::new(req);
            let outcome = match on {
                On::Pool => match self.rounds.submit(Op::Claim(row)).await? {
                    Done::Claimed(outcome) => outcome,
                    Done::Completed(_) => unreachable!("a claim is answered as a claim"),
                },
                // Boxed: the statement's future (sqlx's, kilobytes) would otherwise sit in every
                // pooled claim's future too, which is moved and boxed whole on every request.
                On::Transaction(_) => Box::pin(self.core.claim_statement(on, &row, None)).await?,
            };
            match outcome {
                Decoded::Acquired => return Ok(Claim::Acquired),
                Decoded::Standing(standing) => return Ok(Claim::Standing(standing)),
                Decoded::Nothing => continue,
            }
        }
        Ok(still_running(req))
    }

    /// A reclaim on the pool, sent from a task of its own like every batched row (see
    /// [`batch`]): if the request stops waiting, the takeover it may commit is released there.
    /// (An enlisted reclaim needs none of this: a dropped transaction rolls back.)
    async fn reclaim_alone(
        &self,
        row: ClaimRow,
        stale: FencingToken,
    ) -> Result<Decoded, StoreError> {
        let (answer, answer_rx) = tokio::sync::oneshot::channel();
        let core = Arc::clone(&self.core);
        tokio::spawn(async move {
            let out = core.claim_statement(&mut On::Pool, &row, Some(stale)).await;
            if let Err(out) = answer.send(out)
                && let Some(undo) = unheard_claim(core, row, out)
            {
                undo.await;
            }
        });
        answer_rx.await.unwrap_or_else(|_| {
            Err(StoreError::unavailable(
                "the task sending the reclaim ended",
            ))
        })
    }

    /// [`Store::reclaim`] on `on`, re-run while its snapshot misses a concurrent commit.
    async fn reclaim_on(
        &self,
        on: &mut On<'_>,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        for _ in 0..MAX_RERUNS {
            let row = ClaimRow::new(req);
            let outcome = match on {
                On::Pool => self.reclaim_alone(row, stale).await?,
                On::Transaction(_) => self.core.claim_statement(on, &row, Some(stale)).await?,
            };
            match outcome {
                Decoded::Acquired => return Ok(Claim::Acquired),
                // The row vanished (released or swept): claim it afresh.
                Decoded::Nothing => return self.claim_on(on, req).await,
                Decoded::Standing(standing) => {
                    let takeable = standing.state == StandingState::Expired
                        || (standing.token == stale && standing.state == StandingState::Abandoned);
                    if !takeable {
                        return Ok(Claim::Standing(standing));
                    }
                    // The update skipped a row the snapshot still shows as takeable: another
                    // transaction changed it after the snapshot. Look again.
                }
            }
        }
        Ok(still_running(req))
    }
}

impl Core {
    /// Whether statements are prepared once per connection and kept (named), as they are
    /// without a transaction pooler.
    fn named(&self) -> bool {
        matches!(self.session, Session::Direct { .. })
    }

    fn offset(&self) -> i64 {
        self.clock_offset_ms.load(Ordering::SeqCst)
    }

    fn count(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
    }

    /// Sends a token-conditional write (complete, release, renew) and returns the rows it
    /// changed, sending it again when the connection it went out on was already dead. A database
    /// restart, a failover or `pg_terminate_backend` leaves such connections in the pool (it
    /// does not ping before lending one, to keep a replay at one round trip); failing the write
    /// would leave a completed request's reservation standing until its lease lapses, and the
    /// next retry would run the handler again. The write is conditional on the token, so sending
    /// it twice can neither apply twice nor touch a new holder's record.
    async fn conditional_write<'q>(
        &self,
        query: impl Fn() -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<u64, StoreError> {
        // Each dead connection fails once and is dropped: one attempt per pooled connection,
        // plus one on a fresh connection, is enough.
        let mut attempts_left = self.pool.options().get_max_connections();
        loop {
            self.count();
            match on_pool!(self, &self.pool, query(), execute).await {
                Ok(done) => return Ok(done.rows_affected()),
                Err(e) if attempts_left > 0 && connection_dropped(&e) => attempts_left -= 1,
                Err(e) => return Err(unavailable(e)),
            }
        }
    }

    /// [`Store::release`]: deletes the reservation `token` holds.
    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let rows = self
            .conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
                    .bind(&scope[..])
                    .bind(key)
                    .bind(token.as_i64())
            })
            .await?;
        Ok(rows == 1)
    }

    /// One claim or reclaim statement on `on`. A lock timeout means another transaction holds
    /// an uncommitted row for the key: reported as [`busy`].
    async fn claim_statement(
        &self,
        on: &mut On<'_>,
        row: &ClaimRow,
        stale: Option<FencingToken>,
    ) -> Result<Decoded, StoreError> {
        let sql = match stale {
            Some(_) => &self.sql.reclaim,
            None => &self.sql.claim,
        };
        let query = || {
            let query = sqlx::query(AssertSqlSafe(Arc::clone(sql)))
                .bind(&row.scope[..])
                .bind(row.key.as_str())
                .bind(row.token)
                .bind(&row.fingerprint.digest[..])
                .bind(row.fingerprint.version as i16)
                .bind(millis_i64(row.lease))
                .bind(millis_i64(row.retention))
                .bind(self.offset());
            match stale {
                Some(stale) => query.bind(stale.as_i64()),
                None => query,
            }
            .bind(row.route.as_str())
        };
        // On the pool it is sent again, like the conditional writes, when its pooled connection
        // was already dead: the database is there, only that connection is not. If the first
        // attempt was written after all, the retry reads back the request's own token, which the
        // engine takes as acquired. A transaction's connection is never retried: its death took
        // the transaction with it.
        let mut attempts_left = match on {
            On::Pool => self.pool.options().get_max_connections(),
            On::Transaction(_) => 0,
        };
        loop {
            self.count();
            let rows = match on {
                On::Pool => on_pool!(self, &self.pool, query(), fetch_all).await,
                On::Transaction(conn) => {
                    query()
                        .persistent(self.named())
                        .fetch_all(&mut **conn)
                        .await
                }
            };
            match rows {
                Ok(rows) => return decode(rows),
                Err(e) if is_lock_timeout(&e) => {
                    return Ok(Decoded::Standing(busy(row.fingerprint, row.lease)));
                }
                Err(e) if attempts_left > 0 && connection_dropped(&e) => attempts_left -= 1,
                Err(e) => return Err(unavailable(e)),
            }
        }
    }
}

/// Where a claim statement goes: the pool (a detached claim) or the connection of an enlisted
/// request's open transaction.
enum On<'c> {
    Pool,
    Transaction(&'c mut PgConnection),
}

/// A key whose state cannot be read: another transaction holds it. Reported as running, with
/// the request's own fingerprint (the key is in progress whatever that request's body) and the
/// request's lease as what is left, since the holder's is unknown; the claim loop answers "in
/// progress" and sends nothing more (an enlisted transaction that met the lock is aborted).
fn busy(fingerprint: Fingerprint, lease: Duration) -> Standing {
    Standing {
        token: FencingToken(0),
        fingerprint,
        state: StandingState::Running { lease_left: lease },
        expires_in: None,
    }
}

fn still_running(req: &ClaimRequest<'_>) -> Claim {
    // Every re-run met a record committed after its snapshot: the key is being fought over
    // right now, which is what "in progress" means.
    Claim::Standing(busy(req.fingerprint, req.lease))
}

impl Store for PostgresStore {
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.bounded(self.claim_on(&mut On::Pool, req)).await
    }

    async fn reclaim(
        &self,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.bounded(self.reclaim_on(&mut On::Pool, req, stale))
            .await
    }

    async fn complete(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let row = CompleteRow {
            scope: *scope,
            key: key.to_owned(),
            token: token.as_i64(),
            status: response.status as i16,
            headers: response.encode_headers(),
            body: response.body.clone(),
            retention,
            trailers: encoded_trailers(response),
        };
        match self.bounded(self.rounds.submit(Op::Complete(row))).await? {
            Done::Completed(done) => Ok(done),
            Done::Claimed(_) => unreachable!("a completion is answered as a completion"),
        }
    }

    async fn release(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.bounded(self.core.release(scope, key, token)).await
    }

    async fn renew(
        &self,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let rows = self
            .bounded(self.core.conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.renew)))
                    .bind(&scope[..])
                    .bind(key)
                    .bind(token.as_i64())
                    .bind(millis_i64(lease))
                    .bind(self.offset())
            }))
            .await?;
        Ok(rows == 1)
    }

    async fn sweep(&self, batch: usize) -> Result<usize, StoreError> {
        self.count();
        let query = sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.sweep)))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind(self.offset());
        let done = self
            .bounded(async {
                on_pool!(self.core, &self.core.pool, query, execute)
                    .await
                    .map_err(unavailable)
            })
            .await?;
        Ok(done.rows_affected() as usize)
    }

    async fn inspect(
        &self,
        scope: &ScopeHash,
        key: &str,
        with_response: bool,
    ) -> Result<Option<RecordInfo>, StoreError> {
        self.count();
        let query = sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.inspect)))
            .bind(&scope[..])
            .bind(key)
            .bind(with_response)
            .bind(self.offset());
        let row = self
            .bounded(async {
                on_pool!(self.core, &self.core.pool, query, fetch_optional)
                    .await
                    .map_err(unavailable)
            })
            .await?;
        row.map(|row| record_info(&row)).transpose()
    }

    async fn forget(&self, scope: &ScopeHash, key: &str) -> Result<bool, StoreError> {
        let rows = self
            .bounded(self.core.conditional_write(|| {
                sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.forget)))
                    .bind(&scope[..])
                    .bind(key)
            }))
            .await?;
        Ok(rows == 1)
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// Joins PostgreSQL transactions ([enlisted mode](crate::enlisted)).
    fn enlisting(&self) -> Option<crate::store::Enlisting<'_>> {
        Some(crate::store::Enlisting::postgres(self))
    }
}

/// A row of the inspect statement as what an operator sees.
fn record_info(row: &PgRow) -> Result<RecordInfo, StoreError> {
    let state: i16 = row.try_get(0).map_err(unavailable)?;
    let status: Option<i16> = row.try_get(1).map_err(unavailable)?;
    InspectedRow {
        completed: state == 1,
        status: status.map(i64::from),
        route: row.try_get(2).map_err(unavailable)?,
        created: row.try_get(3).map_err(unavailable)?,
        lease: row.try_get(4).map_err(unavailable)?,
        expires: row.try_get(5).map_err(unavailable)?,
        now: row.try_get(6).map_err(unavailable)?,
        body_bytes: row.try_get(7).map_err(unavailable)?,
        header_bytes: row.try_get(8).map_err(unavailable)?,
        headers: row.try_get(9).map_err(unavailable)?,
        body: row.try_get(10).map_err(unavailable)?,
        trailers: row.try_get(11).map_err(unavailable)?,
    }
    .into_info()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_batches_are_padded_to_a_few_sizes() {
        assert_eq!(complete_many_sizes(1), [2]);
        assert_eq!(complete_many_sizes(32), [2, 3, 4, 6, 8, 12, 16, 24, 32]);
        assert_eq!(complete_many_sizes(33).last(), Some(&48));
        assert_eq!(complete_many_sizes(MAX_BATCH_ROWS).last(), Some(&128));
        let sql = complete_many("t", 3);
        assert_eq!(sql.matches("UPDATE t r").count(), 3);
        // Row 3's body is $22 and its trailers $24; the clock offset comes after the last row.
        assert!(sql.contains("body = $22::bytea") && sql.contains("trailers = $24::bytea"));
        assert!(sql.contains("$25::bigint * interval") && !sql.contains("$26"));
    }
}
