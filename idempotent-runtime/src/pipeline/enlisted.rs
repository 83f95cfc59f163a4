//! Enlisted mode's steps ([the contract](crate::design) §5): the claim inside a transaction
//! ([`Enlisted`], a [`ClaimMode`]), then the run and settle: the handler writes through the
//! transaction that holds the reservation; the final status decides whether its response is
//! recorded in that transaction and committed, or everything is rolled back. The transaction
//! itself, and how it commits or rolls back, is [`crate::enlisted`]'s.

use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;

use super::body::{self, Chunks, Collected};
use super::claim::{ClaimMode, ClaimPlan, answer};
use super::{Begin, BeginRequest, Ended, Reply, refuse};
use crate::budget::BufferPermit;
use crate::config::{Oversized, Recording};
use crate::enlisted::{
    self, EnlistedTx, Held, Reserved, Settle, claim_in, enlister, not_enlistable,
};
use crate::handle::Idempotency;
use crate::observe::{self, Event};
use crate::problem::{Problem, ProblemCode};
use crate::record::{self, Verdict};
use crate::store::{Backend, Glanced, Joinable, RecordedResponse, StoreError};

/// The enlisted claim mode for the framework pipelines, in database `DB`'s transactions.
pub(crate) struct Enlisted<DB>(Infallible, PhantomData<DB>);

impl<DB: Joinable> ClaimMode for Enlisted<DB> {
    type Held = Held<DB>;

    /// The body of a request without a key is read before its transaction begins too, so a
    /// slow client never holds a database connection.
    const BUFFERS_UNKEYED: bool = true;

    fn begin<'a>(
        handle: &'a Idempotency,
        req: &'a BeginRequest<'a>,
    ) -> impl Future<Output = Begin<Held<DB>>> + Send + 'a {
        begin(handle, req)
    }

    fn unkeyed<'a>(
        handle: &'a Idempotency,
        route: &'a str,
    ) -> impl Future<Output = Result<Held<DB>, Problem>> + Send + 'a {
        begin_unkeyed(handle, route)
    }
}

fn unavailable(handle: &Idempotency, route: &str, error: &StoreError) -> Problem {
    observe::count(Event::StoreError, route);
    tracing::warn!(route, %error, "enlisted transaction could not start or claim");
    Problem::new(
        503,
        ProblemCode::StoreUnavailable,
        "the idempotency store cannot be reached; retry later",
    )
    .with_retry_after(record::ceil_secs(handle.config().store_retry_after).max(1))
}

fn settle_for<DB: Joinable>(
    handle: &Idempotency,
    store: Backend,
    reserved: Option<Reserved>,
    retention: Duration,
    max_response: usize,
    route: &str,
) -> Settle<DB> {
    Settle {
        store,
        reserved,
        retention,
        max_response,
        recording: Recording::default(),
        store_retry_after: handle.config().store_retry_after,
        route: route.into(),
        back: None,
        _running: handle.enter_running(),
        _in_flight: None,
    }
}

/// A transaction without a reservation, for a keyless request on an endpoint whose key is
/// optional.
pub(crate) async fn begin_unkeyed<DB: Joinable>(
    handle: &Idempotency,
    route: &str,
) -> Result<Held<DB>, Problem> {
    let store = handle.store().clone();
    let Some(db) = enlister::<DB>(&store) else {
        return Err(not_enlistable::<DB>(route));
    };
    let tx = db
        .begin()
        .await
        .map_err(|e| unavailable(handle, route, &e))?;
    let config = handle.config();
    Ok(Held {
        tx: EnlistedTx::new(tx),
        settle: settle_for(handle, store, None, config.retention, 0, route),
    })
}

/// 409 for a key another enlisted request holds.
fn in_progress<DB: Joinable>(
    handle: &Idempotency,
    req: &BeginRequest<'_>,
    lease: Duration,
) -> Begin<Held<DB>> {
    let claimed = Verdict::InProgress { lease_left: lease };
    answer(handle, req, claimed, || {
        unreachable!("an in-progress key is not held")
    })
}

/// Answers what needs no transaction, then opens the transaction, takes the key's try-lock
/// and claims the key in it. A duplicate held by this process is 409 without the database; a
/// replay, a reused key and a duplicate held by another replica are answered by one read on
/// the store's reserved connections; only a request that may run waits for a pooled
/// connection to begin its transaction.
async fn begin<DB: Joinable>(handle: &Idempotency, req: &BeginRequest<'_>) -> Begin<Held<DB>> {
    let plan = match ClaimPlan::new(req, handle.contributor()) {
        Ok(plan) => plan,
        Err(problem) => return Begin::Refuse(problem),
    };
    let route = plan.route;
    let store = handle.store().clone();
    let Some(db) = enlister::<DB>(&store) else {
        return Begin::Refuse(not_enlistable::<DB>(route));
    };
    let (scope, key) = (req.input.scope.hash(), req.key.as_str());
    let in_flight = handle.enlisted_in_flight();
    if in_flight.contains(scope, key) {
        return in_progress(handle, req, plan.claim.lease);
    }
    match db.glance(&plan.claim).await {
        Ok(Glanced::Completed {
            fingerprint,
            response,
        }) => {
            let claimed = if plan.same_request(&fingerprint) {
                Verdict::Replay(response)
            } else {
                Verdict::KeyReused
            };
            return answer(handle, req, claimed, || {
                unreachable!("a decided key is not held")
            });
        }
        Ok(Glanced::Held) => return in_progress(handle, req, plan.claim.lease),
        Ok(Glanced::Open) => {}
        Err(error) => return Begin::Refuse(unavailable(handle, route, &error)),
    }
    // Entered only now, so concurrent replays of a completed key all read it (none is 409).
    let Some(guard) = in_flight.enter(scope, key) else {
        return in_progress(handle, req, plan.claim.lease);
    };
    let mut tx = match db.begin().await {
        Ok(tx) => tx,
        Err(error) => return Begin::Refuse(unavailable(handle, route, &error)),
    };
    let claimed = match claim_in(db, &mut tx, &plan.claim, |f| plan.same_request(f)).await {
        Ok(Some(claimed @ Verdict::Acquired { .. })) => claimed,
        // The try-lock failed: this transaction holds nothing, and dropping it rolls it back
        // as its connection returns to the pool, after the 409 is on its way.
        Ok(None) => Verdict::InProgress {
            lease_left: plan.claim.lease,
        },
        // It holds the key's lock: end it before answering, or the client's next request
        // could still meet the lock and get a 409 for a key that is free.
        Ok(Some(decided)) => {
            db.rollback(tx, route).await;
            return answer(handle, req, decided, || {
                unreachable!("only an acquired key is held")
            });
        }
        Err(error) => return Begin::Refuse(unavailable(handle, route, &error)),
    };
    answer(handle, req, claimed, || {
        let mut settle = Settle {
            recording: req.endpoint.recording.clone(),
            ..settle_for(
                handle,
                store,
                Some(Reserved {
                    scope: *req.input.scope.hash(),
                    key: req.key.clone(),
                    token: plan.claim.token,
                }),
                req.endpoint.retention,
                req.endpoint.max_response,
                route,
            )
        };
        settle._in_flight = Some(guard);
        Held {
            tx: EnlistedTx::new(tx),
            settle,
        }
    })
}

/// An enlisted handler's whole run: `handler` gets the transaction and hands it back with its
/// response, which then commits or rolls back. A panic rolls the transaction back before the
/// 500 is answered, so the key's try-lock never outlives the answer.
pub(crate) async fn enlisted_work<DB, R, F, Fut>(
    handle: Idempotency,
    held: Held<DB>,
    permit: BufferPermit,
    route: Arc<str>,
    handler: F,
) -> Ended<R, (), Infallible>
where
    DB: Joinable,
    R: Reply,
    F: FnOnce(EnlistedTx<DB>) -> Fut,
    Fut: Future<Output = (EnlistedTx<DB>, R)>,
{
    let Held { tx, mut settle } = held;
    let handler = handler(settle.hand_out(tx));
    // A statement of its own, so a panicked future (and the transaction in it) is dropped
    // before the rollback waits for the transaction to come back.
    let outcome = AssertUnwindSafe(handler).catch_unwind().await;
    match outcome {
        Ok((tx, response)) => {
            drop(permit);
            Ended::Answered(settle_enlisted(&handle, settle, tx, response).await, ())
        }
        Err(_) => {
            settle.panicked().await;
            Ended::Panicked(refuse(&handle, &super::refusals::panicked(&route)))
        }
    }
}

/// The final status decides: recordable → record in the transaction and commit, then answer
/// (503 if the commit failed); anything else → roll back and answer. A recordable status whose
/// response cannot be recorded rolls back and answers 500 `IDEMPOTENCY_NOT_RECORDED`, except a
/// body over the cap under [`Oversized::RecordWithoutBody`], which commits the record without
/// it and answers the whole response.
pub(crate) async fn settle_enlisted<DB: Joinable, R: Reply>(
    handle: &Idempotency,
    settle: Settle<DB>,
    tx: EnlistedTx<DB>,
    response: R,
) -> R {
    let config = handle.config();
    let status = response.status();
    let recording = settle.recording();
    if !recording.is_recordable_status(config, status) {
        settle.rollback(tx, "final status not recordable").await;
        return response;
    }
    if !settle.is_keyed() {
        return match settle.commit(tx, None).await {
            Ok(()) => response,
            Err(problem) => refuse(handle, &problem),
        };
    }
    let route = settle.route().to_owned();
    let cap = settle.max_response();
    let without_body = recording.oversized(config) == Oversized::RecordWithoutBody;
    let headers = record::recorded_headers_for(config, &recording, response.headers());
    let (head, body) = response.into_parts();
    let Some(headers) = headers else {
        settle.rollback(tx, "response not recordable").await;
        return refuse(handle, &enlisted::not_recordable(&route));
    };
    if body.exact_len().is_some_and(|n| n > cap as u64) {
        if !without_body {
            settle.rollback(tx, "response over max_response").await;
            return refuse(handle, &enlisted::not_recordable(&route));
        }
        let recorded = record::without_body(status, headers);
        return match settle.commit(tx, Some(&recorded)).await {
            Ok(()) => R::from_parts(head, body),
            Err(problem) => refuse(handle, &problem),
        };
    }
    let (collected, permit) = body::collect_response(handle.budget(), body, cap).await;
    let (bytes, drained, trailers) = match collected {
        Collected::Complete {
            bytes,
            drained,
            trailers,
        } => (bytes, drained, trailers),
        // Streamed past the cap: kept without its body, committed before the answer goes on.
        Collected::Partial {
            read,
            error: None,
            rest,
        } if without_body => {
            drop(permit);
            let recorded = record::without_body(status, headers);
            return match settle.commit(tx, Some(&recorded)).await {
                Ok(()) => R::resumed(head, read, None, rest),
                Err(problem) => refuse(handle, &problem),
            };
        }
        Collected::Partial { .. } => {
            settle.rollback(tx, "response over max_response").await;
            return refuse(handle, &enlisted::not_recordable(&route));
        }
    };
    let recorded = RecordedResponse::new(status, headers, bytes)
        .with_trailers(record::recorded_trailers_for(config, &recording, &trailers));
    match settle.commit(tx, Some(&recorded)).await {
        Ok(()) => R::recorded(head, recorded.body, drained).with_trailers(&trailers),
        Err(problem) => refuse(handle, &problem),
    }
}
