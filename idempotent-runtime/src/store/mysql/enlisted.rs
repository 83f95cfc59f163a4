//! The MySQL / MariaDB side of enlisted mode ([the contract](crate::design) §5): the reservation
//! is written in the transaction the handler then writes through, and completed in it before
//! the commit.
//!
//! A duplicate cannot see an uncommitted reservation, and must not wait on its row lock: every
//! enlisted claim first takes a named lock, `GET_LOCK(name, 0)` (a try: it never waits), whose
//! name is a hash of the database, table, scope and key. Whoever holds it has the key's
//! transaction open; the others answer 409 at once, whatever their body. A named lock belongs
//! to the session, not the transaction, so enlisted transactions run on a pool of their own
//! whose connections release every named lock they hold (`RELEASE_ALL_LOCKS()`) each time they
//! come back to it, after the commit or rollback; a connection that dies releases its locks
//! with it. A duplicate that arrives between the commit and that release still reads the
//! committed record first (the glance), so it is replayed, not refused.
//!
//! InnoDB ends a transaction that loses a deadlock (error 1213) on its own; anything the
//! handler sends after that would run outside it. A keyed request finds out at its completion
//! (the reservation is gone with the transaction: 503, nothing recorded); a request without a
//! key cannot, so a handler must not swallow a deadlock error (return it as a 5xx).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use sha2::{Digest, Sha256};
use sqlx::mysql::{MySql, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Executor as _, Row as _, Transaction};

use super::{
    ClaimRow, Completion, Inserted, LOCK_WAIT_TIMEOUT, MAX_RERUNS, MySqlStore, NOW, busy, corrupt,
    inserted, number, set_session, standing, unavailable,
};
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::store::{
    Claim, ClaimRequest, Enlist, FencingToken, Glanced, RecordedResponse, StoreError,
};

/// Enlisted mode's read before any transaction, and the pool its transactions run on.
pub(super) struct Transactions {
    glance: Arc<str>,
    /// Opened on first use, with the store pool's connect options (a pool spawns its upkeep
    /// tasks, and a store may be built outside a runtime).
    pool: OnceLock<MySqlPool>,
}

impl Transactions {
    pub(super) fn new(table: &str) -> Self {
        // lock name, offset, scope, key. One row whatever the table holds: whether a session
        // holds the key's named lock (without taking it, so concurrent glances never see each
        // other), and the key's completed, unexpired record if there is one. It writes nothing.
        let glance = format!(
            "SELECT CAST(IS_USED_LOCK(?) IS NULL AS SIGNED), r.fingerprint, \
                    CAST(r.fp_version AS SIGNED), CAST(r.status AS SIGNED), r.headers, r.body, \
                    r.trailers \
             FROM (SELECT {NOW} AS now) c LEFT JOIN {table} r \
               ON r.scope = ? AND r.`key` = ? AND r.state = 1 AND r.expires_at > c.now"
        );
        Self {
            glance: glance.into(),
            pool: OnceLock::new(),
        }
    }
}

impl MySqlStore {
    /// The pool enlisted transactions run on: the store pool's size and connect options, its
    /// session settings, and every named lock released when a connection comes back.
    fn transactions(&self) -> &MySqlPool {
        self.enlisted.pool.get_or_init(|| {
            let options = self.core.pool.options();
            MySqlPoolOptions::new()
                .max_connections(options.get_max_connections())
                .acquire_timeout(options.get_acquire_timeout())
                .test_before_acquire(false)
                .after_connect(set_session(Arc::clone(&self.core.session)))
                .after_release(|conn, _| {
                    Box::pin(async move {
                        conn.execute("DO RELEASE_ALL_LOCKS()").await?;
                        Ok(true)
                    })
                })
                .connect_lazy_with((*self.core.pool.connect_options()).clone())
        })
    }

    /// The named lock of `(scope, key)` in this table: 59 characters (MySQL allows 64), the
    /// database in the hash because lock names are server-wide.
    fn lock_name(&self, scope: &ScopeHash, key: &str) -> String {
        let options = self.core.pool.connect_options();
        let mut h = Sha256::new();
        h.update(b"idempotent-enlisted/v1\n");
        let mut enc = crate::digest::Encoder(&mut h);
        enc.bytes(options.get_database().unwrap_or_default().as_bytes());
        enc.bytes(self.core.table.as_bytes());
        enc.bytes(scope);
        enc.bytes(key.as_bytes());
        let digest: [u8; 32] = h.finalize().into();
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut name = String::with_capacity(59);
        name.push_str("idempotent:");
        for byte in &digest[..24] {
            name.push(char::from(HEX[usize::from(byte >> 4)]));
            name.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        name
    }

    /// One read before any transaction: a completed record of `req`'s key, or whether another
    /// session holds the key's lock. One round trip, on the store's own pool; it writes
    /// nothing.
    async fn enlisted_glance(&self, req: &ClaimRequest<'_>) -> Result<Glanced, StoreError> {
        self.core.count();
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.enlisted.glance)))
            .bind(self.lock_name(req.scope, req.key))
            .bind(self.core.offset())
            .bind(&req.scope[..])
            .bind(req.key.as_bytes())
            .fetch_one(&self.core.pool)
            .await
            .map_err(unavailable)?;
        let free: i64 = row.try_get(0).map_err(unavailable)?;
        let digest: Option<Vec<u8>> = row.try_get(1).map_err(unavailable)?;
        let Some(digest) = digest else {
            return Ok(if free == 1 {
                Glanced::Open
            } else {
                Glanced::Held
            });
        };
        let version: Option<i64> = row.try_get(2).map_err(unavailable)?;
        let status: Option<i64> = row.try_get(3).map_err(unavailable)?;
        let headers: Option<Vec<u8>> = row.try_get(4).map_err(unavailable)?;
        let body: Option<Vec<u8>> = row.try_get(5).map_err(unavailable)?;
        let trailers: Option<Vec<u8>> = row.try_get(6).map_err(unavailable)?;
        let fingerprint = Fingerprint {
            version: version
                .and_then(|v| u16::try_from(v).ok())
                .ok_or_else(|| corrupt("fingerprint version"))?,
            digest: digest
                .try_into()
                .map_err(|_| corrupt("fingerprint is not 32 bytes"))?,
        };
        let status = status
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(|| corrupt("completed without a status"))?;
        let headers = RecordedResponse::decode_headers(headers.as_deref().unwrap_or_default())
            .ok_or_else(|| corrupt("headers do not decode"))?;
        let trailers = RecordedResponse::decode_headers(trailers.as_deref().unwrap_or_default())
            .ok_or_else(|| corrupt("trailers do not decode"))?;
        Ok(Glanced::Completed {
            fingerprint,
            response: Arc::new(
                RecordedResponse::new(status, headers, Bytes::from(body.unwrap_or_default()))
                    .with_trailers(trailers),
            ),
        })
    }

    /// Takes the key's named lock without waiting: `false` when another session holds it.
    async fn enlisted_lock(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        self.core.count();
        let got: Option<i64> = sqlx::query_scalar("SELECT CAST(GET_LOCK(?, 0) AS SIGNED)")
            .bind(self.lock_name(req.scope, req.key))
            .fetch_one(&mut *conn)
            .await
            .map_err(unavailable)?;
        match got {
            Some(1) => Ok(true),
            Some(_) => Ok(false),
            None => Err(StoreError::unavailable("GET_LOCK failed")),
        }
    }

    /// The standing row under `(scope, key)`, read in the transaction on `conn`.
    async fn read_on(
        &self,
        conn: &mut MySqlConnection,
        scope: &ScopeHash,
        key: &str,
    ) -> Result<Option<crate::store::Standing>, StoreError> {
        self.core.count();
        let row = self
            .core
            .read_query(scope, key)
            .fetch_optional(&mut *conn)
            .await
            .map_err(unavailable)?;
        row.map(|row| standing(&row)).transpose()
    }

    /// [`Store::claim`](crate::store::Store::claim) inside the transaction on `conn`. A
    /// deadlock ended the transaction, so it is a failure here, not a reason to send again.
    async fn enlisted_claim(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        let row = ClaimRow::new(req);
        for _ in 0..MAX_RERUNS {
            self.core.count();
            let Err(e) = self.core.insert_query(&row).execute(&mut *conn).await else {
                return Ok(Claim::Acquired);
            };
            match inserted(&e) {
                Some(Inserted::Busy) => return Ok(Claim::Standing(busy(req))),
                Some(Inserted::Duplicate) => {
                    if let Some(standing) = self.read_on(conn, req.scope, req.key).await? {
                        return Ok(Claim::Standing(standing));
                    }
                    // Deleted between the insert and the read (released, swept): again.
                }
                _ => return Err(unavailable(e)),
            }
        }
        Ok(Claim::Standing(busy(req)))
    }

    /// [`Store::reclaim`](crate::store::Store::reclaim) inside the transaction on `conn`.
    async fn enlisted_reclaim(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        stale: FencingToken,
    ) -> Result<Claim, StoreError> {
        let row = ClaimRow::new(req);
        self.core.count();
        let done = self
            .core
            .takeover_query(&row, stale)
            .execute(&mut *conn)
            .await;
        match done {
            Ok(done) if done.rows_affected() == 1 => Ok(Claim::Acquired),
            Ok(_) => match self.read_on(conn, req.scope, req.key).await? {
                Some(standing) => Ok(Claim::Standing(standing)),
                // Released or swept in between: claim it afresh.
                None => Box::pin(self.enlisted_claim(conn, req)).await,
            },
            Err(e) if number(&e) == Some(LOCK_WAIT_TIMEOUT) => Ok(Claim::Standing(busy(req))),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Completes the reservation held by `token` in the transaction on `conn`.
    async fn enlisted_complete(
        &self,
        conn: &mut MySqlConnection,
        scope: &ScopeHash,
        key: &str,
        token: FencingToken,
        response: &RecordedResponse,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        self.core.count();
        let completion = Completion::new(scope, key, token, response, retention);
        let done = completion
            .query(&self.core)
            .execute(&mut *conn)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }
}

/// The MySQL / MariaDB store's part in enlisted requests.
impl Enlist<MySql> for MySqlStore {
    fn glance<'a>(
        &'a self,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Glanced, StoreError>> {
        Box::pin(self.bounded(self.enlisted_glance(req)))
    }

    fn begin(&self) -> BoxFuture<'_, Result<Transaction<'static, MySql>, StoreError>> {
        Box::pin(async move {
            self.core.count();
            self.bounded(async { self.transactions().begin().await.map_err(unavailable) })
                .await
        })
    }

    fn lock<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.bounded(self.enlisted_lock(conn, req)))
    }

    fn claim<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        req: &'a ClaimRequest<'_>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.bounded(self.enlisted_claim(conn, req)))
    }

    fn reclaim<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.bounded(self.enlisted_reclaim(conn, req, stale)))
    }

    fn complete<'a>(
        &'a self,
        conn: &'a mut MySqlConnection,
        scope: &'a ScopeHash,
        key: &'a str,
        token: FencingToken,
        response: &'a RecordedResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.bounded(self.enlisted_complete(conn, scope, key, token, response, retention)))
    }

    fn probe<'a>(&'a self, conn: &'a mut MySqlConnection) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.core.count();
            self.bounded(async { conn.execute("DO 1").await.map(drop).map_err(unavailable) })
                .await
        })
    }

    fn rollback<'a>(
        &'a self,
        tx: Transaction<'static, MySql>,
        route: &'a str,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.core.count();
            let rolled_back = tokio::time::timeout(self.operation_timeout, tx.rollback()).await;
            match rolled_back {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    // The connection is gone: the server ended the transaction (and its lock).
                    tracing::debug!(route, %error, "enlisted rollback before answering failed");
                }
                // Unheard: the transaction is dropped with its rollback in flight; sqlx lends
                // its connection again only after reading what is pending (see `bounded`).
                Err(_) => tracing::debug!(route, "enlisted rollback before answering unheard"),
            }
        })
    }

    /// MySQL has no aborted-transaction state: a failed statement leaves its transaction open,
    /// and a deadlock ends it outright (see the module's docs).
    fn is_aborted(&self, _error: &StoreError) -> bool {
        false
    }
}
