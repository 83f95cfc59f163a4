//! The run and settle steps in enlisted mode ([the contract](crate::design) §5): the handler writes through the
//! transaction that holds the reservation; the final status decides whether its response is
//! recorded in that transaction and committed, or everything is rolled back.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;

use super::body::{self, Chunks, Collected};
use super::{Ended, Reply, refuse};
use crate::budget::BufferPermit;
use crate::config::Oversized;
use crate::enlisted::{self, EnlistedTx, Held, Settle};
use crate::handle::Idempotency;
use crate::record;
use crate::store::RecordedResponse;

/// An enlisted handler's whole run: `handler` gets the transaction and hands it back with its
/// response, which then commits or rolls back. A panic rolls the transaction back before the
/// 500 is answered, so the key's try-lock never outlives the answer.
pub(crate) async fn enlisted_work<R, F, Fut>(
    handle: Idempotency,
    held: Held,
    permit: BufferPermit,
    route: String,
    handler: F,
) -> Ended<R, (), Infallible>
where
    R: Reply,
    F: FnOnce(EnlistedTx) -> Fut,
    Fut: Future<Output = (EnlistedTx, R)>,
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
            Ended::Panicked(refuse(&handle, &handle.panicked(&route)))
        }
    }
}

/// The final status decides: recordable → record in the transaction and commit, then answer
/// (503 if the commit failed); anything else → roll back and answer. A recordable status whose
/// response cannot be recorded rolls back and answers 500 `IDEMPOTENCY_NOT_RECORDED`, except a
/// body over the cap under [`Oversized::RecordWithoutBody`], which commits the record without
/// it and answers the whole response.
pub(crate) async fn settle_enlisted<R: Reply>(
    handle: &Idempotency,
    settle: Settle,
    tx: EnlistedTx,
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
