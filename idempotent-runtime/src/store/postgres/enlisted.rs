//! The PostgreSQL side of enlisted mode ([the contract](crate::design) §5): the reservation is written in a
//! transaction the handler then writes through, and completed in it before the commit.
//!
//! A duplicate cannot see an uncommitted reservation, and must not wait on its row lock: every
//! enlisted claim first takes a transaction-scoped advisory try-lock on a 64-bit hash of the
//! table, scope and key. Whoever holds it has the key's transaction open; the others answer 409
//! at once, whatever their body. The lock goes with the transaction (commit, rollback, or the
//! connection's death), so a crash leaves neither the reservation nor the lock behind.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, Postgres};
use sqlx::{AssertSqlSafe, Row as _, Transaction};

use super::{On, PostgresStore, Session, corrupt, millis_i64, now, unavailable};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::store::{
    Claim, ClaimRequest, Enlist, FencingToken, Glanced, RecordedResponse, StoreError,
};

/// Default size of the pool kept apart for [`PostgresStore::enlisted_glance`].
pub(super) const RESERVED_CONNECTIONS: u32 = 2;

/// The read an enlisted request makes before it begins a transaction, and the connections it
/// makes it on: a pool of their own, so enlisted handlers holding every pooled connection in
/// their transactions never make a replay or a duplicate wait (or fail) for one.
pub(super) struct Glance {
    sql: Arc<str>,
    size: u32,
    /// Opened on first use, with the store pool's connect options (a pool spawns its upkeep
    /// tasks, and a store may be built outside a runtime).
    pool: OnceLock<PgPool>,
}

impl Glance {
    pub(super) fn new(table: &str, size: u32) -> Self {
        // One row whatever the table holds. Whether another transaction holds the key's lock
        // is read from `pg_locks` (a bigint advisory key is `classid` high, `objid` low,
        // `objsubid` 1), without taking the lock: glances of concurrent copies never see each
        // other as holders, so one of them always goes on to claim; the claim's own try-lock
        // still decides. It writes nothing, so a replay still writes no WAL.
        let sql = format!(
            "WITH clock AS (SELECT {now} AS now), \
                  lock AS (SELECT $3 # '{table}'::regclass::oid::bigint AS k) \
             SELECT NOT EXISTS (SELECT 1 FROM pg_locks l, lock \
                      WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
                        AND l.database = (SELECT oid FROM pg_database \
                                          WHERE datname = current_database()) \
                        AND l.classid = ((lock.k >> 32) & 4294967295)::oid \
                        AND l.objid = (lock.k & 4294967295)::oid), \
                    r.fingerprint, r.fp_version, r.status, r.headers, r.body, r.trailers \
             FROM clock LEFT JOIN {table} r \
               ON r.scope = $1 AND r.key = $2 AND r.state = 1 AND r.expires_at > clock.now",
            now = now(4)
        );
        Self {
            sql: sql.into(),
            size,
            pool: OnceLock::new(),
        }
    }
}

impl PostgresStore {
    /// The reserved pool (see [`PostgresStoreBuilder::reserved_connections`](super::PostgresStoreBuilder::reserved_connections)).
    fn glance_pool(&self) -> &PgPool {
        self.glance.pool.get_or_init(|| {
            let options = self.core.pool.options();
            PgPoolOptions::new()
                .max_connections(self.glance.size)
                .acquire_timeout(options.get_acquire_timeout())
                .test_before_acquire(false)
                .connect_lazy_with((*self.core.pool.connect_options()).clone())
        })
    }

    /// One read on the reserved connections, before any transaction: a completed record of
    /// `req`'s key, or whether another transaction holds the key. One round trip; it writes
    /// nothing.
    pub(crate) async fn enlisted_glance(
        &self,
        req: &ClaimRequest<'_>,
    ) -> Result<Glanced, StoreError> {
        self.count();
        let query = sqlx::query(AssertSqlSafe(Arc::clone(&self.glance.sql)))
            .bind(&req.scope[..])
            .bind(req.key)
            .bind(self.enlisted_lock_key(req.scope, req.key))
            .bind(self.offset());
        let row = on_pool!(self.core, self.glance_pool(), query, fetch_one)
            .await
            .map_err(unavailable)?;
        let free: bool = row.try_get(0).map_err(unavailable)?;
        let digest: Option<Vec<u8>> = row.try_get(1).map_err(unavailable)?;
        let Some(digest) = digest else {
            return Ok(if free { Glanced::Open } else { Glanced::Held });
        };
        let version: i16 = row.try_get(2).map_err(unavailable)?;
        let status: Option<i16> = row.try_get(3).map_err(unavailable)?;
        let headers: Option<Vec<u8>> = row.try_get(4).map_err(unavailable)?;
        let body: Option<Vec<u8>> = row.try_get(5).map_err(unavailable)?;
        let trailers: Option<Vec<u8>> = row.try_get(6).map_err(unavailable)?;
        let fingerprint = Fingerprint {
            version: version as u16,
            digest: digest
                .try_into()
                .map_err(|_| corrupt("fingerprint is not 32 bytes"))?,
        };
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| corrupt("completed without a status"))?;
        let headers = RecordedResponse::decode_headers(headers.as_deref().unwrap_or_default())
            .ok_or_else(|| corrupt("headers do not decode"))?;
        Ok(Glanced::Completed {
            fingerprint,
            response: Arc::new(
                RecordedResponse::new(status, headers, Bytes::from(body.unwrap_or_default()))
                    .with_trailers(super::decode_trailers(trailers.as_deref())?),
            ),
        })
    }

    /// Opens the transaction an enlisted request runs in, on one of the store's connections
    /// (so its `lock_timeout` and `statement_timeout` apply to the handler's statements too:
    /// behind a transaction pooler, as `SET LOCAL` at its start).
    pub(crate) async fn enlisted_begin(
        &self,
    ) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.count();
        match &self.core.session {
            Session::Direct { .. } => self.core.pool.begin().await,
            // Behind a transaction pooler the store's timeouts are the transaction's own.
            Session::Pooled { begin } => {
                self.core
                    .pool
                    .begin_with(AssertSqlSafe(Arc::clone(begin)))
                    .await
            }
        }
        .map_err(unavailable)
    }

    /// The advisory lock key of `(scope, key)` in this table.
    pub(crate) fn enlisted_lock_key(&self, scope: &ScopeHash, key: &str) -> i64 {
        let mut h = Sha256::new();
        h.update(b"idempotent-enlisted/v1\n");
        let mut enc = crate::digest::Encoder(&mut h);
        enc.bytes(self.table.qualified.as_bytes());
        enc.bytes(scope);
        enc.bytes(key.as_bytes());
        let digest: [u8; 32] = h.finalize().into();
        i64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
    }

    /// Takes the key's transaction-scoped try-lock in the open transaction on `conn`. `false`
    /// when another transaction holds it (the key is in progress; this transaction holds
    /// nothing). Whatever the claim then decides, anything but an acquired key leaves the
    /// transaction to be rolled back, and it holds the key's lock until it is.
    pub(crate) async fn enlisted_lock(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        self.count();
        // The table's OID joins the key: two schemas (or databases' search paths) with a table of
        // the same name must never share a lock, or one's request is another's false 409.
        let sql = format!(
            "SELECT pg_try_advisory_xact_lock($1 # '{}'::regclass::oid::bigint)",
            self.table.qualified
        );
        sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(self.enlisted_lock_key(req.scope, req.key))
            .persistent(self.core.named())
            .fetch_one(&mut *conn)
            .await
            .map_err(unavailable)
    }

    /// Ends a transaction that decided not to run (a replay, a refusal) before the answer goes
    /// out: it holds the key's try-lock until it ends.
    pub(crate) async fn enlisted_rollback(&self, tx: Transaction<'static, Postgres>, route: &str) {
        self.count();
        if let Err(error) = tx.rollback().await {
            // The connection is gone: the server ended the transaction with it.
            tracing::debug!(route, %error, "enlisted rollback before answering failed");
        }
    }

    /// One statement on the open transaction, to learn whether it is still alive before the
    /// commit: an aborted transaction answers it with an error [`is_aborted`](Self::is_aborted)
    /// recognises, where its COMMIT would silently roll back.
    pub(crate) async fn enlisted_probe(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        self.count();
        sqlx::query("SELECT 1")
            .persistent(self.core.named())
            .execute(&mut *conn)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    /// Whether a statement failed because its transaction was already aborted (SQLSTATE 25P02,
    /// `in_failed_sql_transaction`): an earlier statement failed and the handler went on.
    pub(crate) fn is_aborted(error: &StoreError) -> bool {
        let StoreError::Unavailable(source) = error else {
            return false;
        };
        source
            .downcast_ref::<sqlx::Error>()
            .and_then(|e| e.as_database_error())
            .and_then(|e| e.code())
            .is_some_and(|code| code == "25P02")
    }

    /// Completes the reservation held by `token` in the open transaction on `conn`. `Ok(false)`
    /// when the token no longer holds it (it cannot happen while the transaction holds the
    /// row, but the write stays conditional like every other).
    pub(crate) async fn enlisted_complete(
        &self,
        conn: &mut PgConnection,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.count();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.core.sql.complete)))
            .bind(&scope[..])
            .bind(key)
            .bind(token.as_i64())
            .bind(response.status as i16)
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(millis_i64(retention))
            .bind(self.offset())
            .bind(super::encoded_trailers(response))
            .persistent(self.core.named())
            .execute(&mut *conn)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }
}

/// The PostgreSQL store's part in enlisted requests. A row locked by a detached request past
/// `lock_timeout` aborts the transaction and reads as running: the claim loop answers "in
/// progress" without another statement.
impl Enlist<Postgres> for PostgresStore {
    fn glance<'a>(
        &'a self,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Glanced, StoreError>> {
        Box::pin(self.enlisted_glance(req))
    }

    fn begin(&self) -> BoxFuture<'_, Result<Transaction<'static, Postgres>, StoreError>> {
        Box::pin(self.enlisted_begin())
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.enlisted_lock(conn, req))
    }

    fn claim<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move { self.claim_on(&mut On::Transaction(conn), req).await })
    }

    fn reclaim<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            self.reclaim_on(&mut On::Transaction(conn), req, stale)
                .await
        })
    }

    fn complete<'a>(
        &'a self,
        conn: &'a mut PgConnection,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.enlisted_complete(conn, scope, key, token, response, retention))
    }

    fn probe<'a>(&'a self, conn: &'a mut PgConnection) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.enlisted_probe(conn))
    }

    fn rollback<'a>(
        &'a self,
        tx: Transaction<'static, Postgres>,
        route: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(self.enlisted_rollback(tx, route))
    }

    fn is_aborted(&self, error: &StoreError) -> bool {
        Self::is_aborted(error)
    }
}
