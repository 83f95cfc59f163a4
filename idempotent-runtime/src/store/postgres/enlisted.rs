//! The PostgreSQL side of enlisted mode (DESIGN.md §5): the reservation is written in a
//! transaction the handler then writes through, and completed in it before the commit.
//!
//! A duplicate cannot see an uncommitted reservation, and must not wait on its row lock: every
//! enlisted claim first takes a transaction-scoped advisory try-lock on a 64-bit hash of the
//! table, scope and key. Whoever holds it has the key's transaction open; the others answer 409
//! at once, whatever their body. The lock goes with the transaction (commit, rollback, or the
//! connection's death), so a crash leaves neither the reservation nor the lock behind.

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnection, Postgres};
use sqlx::{AssertSqlSafe, Transaction};

use super::{Outcome, PostgresStore, decode, is_lock_timeout, millis_i64, unavailable};
use crate::fingerprint::Fingerprint;
use crate::record::{self, Claimed, Decision};
use crate::scope::ScopeHash;
use crate::store::{Claim, ClaimRequest, FencingToken, RecordedResponse, StoreError};

/// How many takeovers (expired or abandoned rows left by detached requests) a claim attempts
/// before answering "in progress", as in [`record::claim`].
const MAX_TAKEOVERS: usize = 3;

/// How often a claim whose snapshot missed a concurrent commit is re-run.
const MAX_RERUNS: usize = 8;

impl PostgresStore {
    /// Opens the transaction an enlisted request runs in, on one of the store's connections
    /// (so its `lock_timeout` and `statement_timeout` apply to the handler's statements too).
    pub(crate) async fn enlisted_begin(
        &self,
    ) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.count();
        self.pool.begin().await.map_err(unavailable)
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

    /// Claims `req` inside the open transaction on `conn`: the try-lock, then the same
    /// conditional insert (and token-conditional takeover) as a detached claim. `None` when the
    /// try-lock is held by another transaction (the key is in progress; this transaction holds
    /// nothing). Anything but [`Claimed::Acquired`] leaves the transaction to be rolled back,
    /// and it holds the key's lock until it is.
    pub(crate) async fn enlisted_claim(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest<'_>,
        same_request: impl Fn(&Fingerprint) -> bool,
    ) -> Result<Option<Claimed>, StoreError> {
        self.count();
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(self.enlisted_lock_key(req.scope, req.key))
            .fetch_one(&mut *conn)
            .await
            .map_err(unavailable)?;
        let running = Claimed::InProgress {
            lease_left: req.lease,
        };
        if !locked {
            // Another request's transaction holds this key: its reservation is not visible
            // yet, so the only honest answer is "in progress", whatever this request's body.
            return Ok(None);
        }
        let mut outcome = self.enlisted_statement(conn, req, None).await?;
        let mut reclaimed = false;
        for _ in 0..=MAX_TAKEOVERS {
            let standing = match outcome {
                Some(Claim::Acquired) => return Ok(Some(Claimed::Acquired { reclaimed })),
                Some(Claim::Standing(standing)) => standing,
                // A row locked by a detached request past `lock_timeout`: the transaction is
                // aborted, and the key is busy.
                None => return Ok(Some(running)),
            };
            match record::decide(&standing, &same_request) {
                Decision::Reclaim { abandoned } => {
                    reclaimed = abandoned;
                    outcome = self
                        .enlisted_statement(conn, req, Some(standing.token))
                        .await?;
                }
                Decision::Replay(response) => return Ok(Some(Claimed::Replay(response))),
                Decision::InProgress { lease_left } => {
                    return Ok(Some(Claimed::InProgress { lease_left }));
                }
                Decision::KeyReused => return Ok(Some(Claimed::KeyReused)),
            }
        }
        Ok(Some(running))
    }

    /// One claim (or, with `stale`, takeover) statement on `conn`, re-run while its snapshot
    /// misses a concurrent commit. `None` when it met a row lock past `lock_timeout`.
    async fn enlisted_statement(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest<'_>,
        mut stale: Option<FencingToken>,
    ) -> Result<Option<Claim>, StoreError> {
        for _ in 0..MAX_RERUNS {
            let sql = match stale {
                Some(_) => &self.sql.reclaim,
                None => &self.sql.claim,
            };
            let mut query = sqlx::query(AssertSqlSafe(Arc::clone(sql)))
                .bind(&req.scope[..])
                .bind(req.key)
                .bind(req.token.as_i64())
                .bind(&req.fingerprint.digest[..])
                .bind(req.fingerprint.version as i16)
                .bind(millis_i64(req.lease))
                .bind(millis_i64(req.retention))
                .bind(self.offset());
            if let Some(stale) = stale {
                query = query.bind(stale.as_i64());
            }
            self.count();
            let rows = match query.fetch_all(&mut *conn).await {
                Ok(rows) => rows,
                Err(e) if is_lock_timeout(&e) => return Ok(None),
                Err(e) => return Err(unavailable(e)),
            };
            match decode(rows)? {
                Outcome::Acquired => return Ok(Some(Claim::Acquired)),
                Outcome::Standing(standing) => return Ok(Some(Claim::Standing(standing))),
                // A takeover whose row vanished (released or swept): claim it afresh.
                Outcome::Nothing => stale = None,
            }
        }
        Ok(None)
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
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.complete)))
            .bind(&scope[..])
            .bind(key)
            .bind(token.as_i64())
            .bind(response.status as i16)
            .bind(response.encode_headers())
            .bind(&response.body[..])
            .bind(millis_i64(retention))
            .bind(self.offset())
            .execute(&mut *conn)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }
}
