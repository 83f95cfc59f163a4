//! The record's life ([the contract](crate::design) §3) as plain functions over a [`Store`](crate::store::Store): what a standing record
//! means for a new request, the claim loop that reclaims abandoned and expired records (the same
//! loop for a detached claim and for one inside an enlisted transaction, through [`ClaimOps`]),
//! and what part of a response is kept.
//!
//! The conditional write in the store decides every race; these functions only interpret what
//! the store reports, so every backend behaves the same.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::{Config, Recording};
use crate::fingerprint::Fingerprint;
use crate::store::{
    Backend, Claim, ClaimRequest, FencingToken, RecordedResponse, Standing, StandingState, Store,
    StoreError,
};

/// What a standing record means for a request with fingerprint `fp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Take the record over (it expired, or its holder's lease lapsed with the same request).
    Reclaim {
        /// `true` when the previous holder may still have run: an abandoned reservation.
        abandoned: bool,
    },
    /// Replay the recorded response.
    Replay(Arc<RecordedResponse>),
    /// The first request is still running.
    InProgress {
        /// What is left of its lease.
        lease_left: Duration,
    },
    /// Same key, different request.
    KeyReused,
}

/// Decides from a standing record. A different fingerprint wins over every state except
/// expiry (an expired record is gone: the key runs again, whatever the request).
///
/// `same_request` compares the stored fingerprint with the current request, using the stored
/// fingerprint's own encoding version.
pub(crate) fn decide(
    standing: &Standing,
    same_request: impl FnOnce(&Fingerprint) -> bool,
) -> Decision {
    if standing.state == StandingState::Expired {
        return Decision::Reclaim { abandoned: false };
    }
    if !same_request(&standing.fingerprint) {
        return Decision::KeyReused;
    }
    match &standing.state {
        StandingState::Running { lease_left } => Decision::InProgress {
            lease_left: *lease_left,
        },
        StandingState::Abandoned => Decision::Reclaim { abandoned: true },
        StandingState::Completed(response) => Decision::Replay(Arc::clone(response)),
        StandingState::Expired => unreachable!("handled above"),
    }
}

/// The claim loop's verdict on a key ([`claim`]): run, replay, or refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub enum Verdict {
    /// The request holds the key with `req.token`; run the handler.
    Acquired {
        /// `true` when an abandoned reservation was taken over (its handler may have run).
        reclaimed: bool,
    },
    /// Replay this response.
    Replay(Arc<RecordedResponse>),
    /// 409: the first request is running.
    InProgress {
        /// What is left of its lease.
        lease_left: Duration,
    },
    /// 422 (or 409): same key, different request.
    KeyReused,
}

/// The two conditional writes the claim loop sends, with [`Store::claim`]'s and
/// [`Store::reclaim`]'s meaning: every store has them (through `&store`, and the one behind a
/// handle through `&Backend`), and so has an enlisted request's open transaction, so all claim
/// through the one loop in [`claim`].
///
/// A key that cannot be read because another transaction holds its row is reported as
/// [`StandingState::Running`] with the request's own fingerprint and lease: the loop answers
/// "in progress" and sends nothing more.
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub trait ClaimOps: Send {
    /// Installs `req.token` if nothing live stands under the key; otherwise reports what stands.
    fn claim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a;

    /// Takes over the expired record, or the abandoned one held by `stale`; otherwise reports
    /// what stands.
    fn reclaim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a;
}

/// The store behind a handle: the memory store's futures become the claim loop's, unboxed; any
/// other store's are boxed once, by the handle's `DynStore`.
impl ClaimOps for &Backend {
    fn claim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        Backend::claim(self, req)
    }

    fn reclaim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        crate::observe::timed("reclaim", self.kind(), Backend::reclaim(self, req, stale))
    }
}

/// Any store, called as itself (the tests' and benches' claims, without a handle).
impl<S: Store> ClaimOps for &S {
    fn claim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        #[cfg(feature = "metrics")]
        return Store::claim_timed(*self, req);
        #[cfg(not(feature = "metrics"))]
        Store::claim(*self, req)
    }

    fn reclaim<'a>(
        &'a mut self,
        req: &'a ClaimRequest<'_>,
        stale: FencingToken,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send + 'a {
        crate::observe::timed(
            "reclaim",
            Store::kind(*self),
            Store::reclaim(*self, req, stale),
        )
    }
}

/// How many takeovers a claim attempts before answering "in progress": each lost takeover
/// means another request acquired the key in between, so the next read shows it running.
const MAX_TAKEOVERS: usize = 3;

/// Claims `req` through `ops` (a `&store`, or an enlisted transaction): one conditional write,
/// plus a token-conditional takeover when the standing record is expired or abandoned by the
/// same request.
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub async fn claim(
    mut ops: impl ClaimOps,
    req: &ClaimRequest<'_>,
    same_request: impl Fn(&Fingerprint) -> bool,
) -> Result<Verdict, StoreError> {
    let mut outcome = ops.claim(req).await?;
    let mut reclaimed = false;
    for _ in 0..=MAX_TAKEOVERS {
        let standing = match outcome {
            Claim::Acquired => return Ok(Verdict::Acquired { reclaimed }),
            // Our own token: a retried statement whose first attempt was written after all.
            Claim::Standing(standing) if standing.token == req.token => {
                return Ok(Verdict::Acquired { reclaimed });
            }
            Claim::Standing(standing) => standing,
        };
        match decide(&standing, &same_request) {
            Decision::Reclaim { abandoned } => {
                reclaimed = abandoned;
                // Boxed: a takeover is rare, and the claim's future (moved whole from step to
                // step of every request) stays the size of the first claim's.
                outcome = Box::pin(ops.reclaim(req, standing.token)).await?;
            }
            Decision::Replay(response) => return Ok(Verdict::Replay(response)),
            Decision::InProgress { lease_left } => return Ok(Verdict::InProgress { lease_left }),
            Decision::KeyReused => return Ok(Verdict::KeyReused),
        }
    }
    // Every takeover lost to another request that acquired the key: it is running now.
    Ok(Verdict::InProgress {
        lease_left: req.lease,
    })
}

/// `Retry-After` for 409 in progress: the configured value capped by what is left of the lease,
/// in whole seconds rounded up, at least 1.
pub(crate) fn in_progress_retry_after(configured: Duration, lease_left: Duration) -> u64 {
    ceil_secs(configured.min(lease_left)).max(1)
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The header a replay of a record kept without its body carries, `Idempotency-Replay:
/// body-omitted` ([`Oversized::RecordWithoutBody`](crate::config::Oversized)). The runtime writes
/// it into the record's headers itself, so every store keeps it exactly as it keeps the others,
/// and never records a handler's own header of that name, so a replay says it only when the body
/// really was left out.
pub(crate) const REPLAY_HEADER: &str = "idempotency-replay";

/// [`REPLAY_HEADER`]'s value on a replay whose body was not kept.
pub(crate) const BODY_OMITTED: &str = "body-omitted";

/// The record of an answer whose body was too large to keep: its status and recorded headers,
/// an empty body and [`REPLAY_HEADER`]` = body-omitted`. A `content-encoding` goes too: it
/// describes a body the replay does not have.
pub(crate) fn without_body(status: u16, mut headers: Vec<(String, Bytes)>) -> RecordedResponse {
    headers.retain(|(name, _)| !name.eq_ignore_ascii_case("content-encoding"));
    headers.push((
        REPLAY_HEADER.to_owned(),
        Bytes::from_static(BODY_OMITTED.as_bytes()),
    ));
    RecordedResponse::new(status, headers, Bytes::new())
}

/// The headers a record keeps: the allowlisted ones, in order, never [`REPLAY_HEADER`] (the
/// runtime's own). `None` when the response cannot be recorded because of its headers (a `content-encoding` that is not allowlisted: the record
/// would replay bytes whose decoding the client cannot know). Only the tests name it; the runtime
/// asks [`recorded_headers_for`], with the endpoint's recording rules.
#[cfg(test)]
pub(crate) fn recorded_headers<'a>(
    config: &Config,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Option<Vec<(String, Bytes)>> {
    recorded_headers_for(config, &Recording::default(), headers)
}

/// [`recorded_headers`] under an endpoint's own allowlist, when it has one.
pub(crate) fn recorded_headers_for<'a>(
    config: &Config,
    recording: &Recording,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Option<Vec<(String, Bytes)>> {
    let mut kept = Vec::new();
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("content-encoding")
            && !recording.records_header(config, "content-encoding")
        {
            return None;
        }
        if recording.records_header(config, name) && !name.eq_ignore_ascii_case(REPLAY_HEADER) {
            kept.push((name.to_owned(), Bytes::copy_from_slice(value)));
        }
    }
    Some(kept)
}

/// Trailers a record keeps whatever the allowlist says: gRPC's status ([the
/// contract](crate::design) §3, "What a record holds"), without which a replayed gRPC answer
/// would have no outcome, and its rich details (`google.rpc.Status`), part of that status.
const ALWAYS_RECORDED_TRAILERS: [&str; 3] =
    ["grpc-status", "grpc-message", "grpc-status-details-bin"];

/// The trailers a record keeps, in order: `grpc-status`, `grpc-message` and
/// `grpc-status-details-bin` always, any other
/// through the same allowlist as the headers ([`recorded_headers_for`]: the endpoint's list,
/// else the configured one; the never-recorded names never), [`REPLAY_HEADER`] never.
pub(crate) fn recorded_trailers_for(
    config: &Config,
    recording: &Recording,
    trailers: &[(String, Bytes)],
) -> Vec<(String, Bytes)> {
    trailers
        .iter()
        .filter(|(name, _)| {
            ALWAYS_RECORDED_TRAILERS.contains(&name.as_str())
                || (recording.records_header(config, name) && name != REPLAY_HEADER)
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(n: u8) -> Fingerprint {
        Fingerprint {
            version: 1,
            digest: [n; 32],
        }
    }

    fn standing(state: StandingState) -> Standing {
        Standing {
            token: FencingToken(1),
            fingerprint: fp(1),
            state,
            expires_in: None,
        }
    }

    fn response() -> Arc<RecordedResponse> {
        Arc::new(RecordedResponse::new(
            201,
            vec![],
            Bytes::from_static(b"{}"),
        ))
    }

    #[test]
    fn completed_same_request_replays() {
        let d = decide(&standing(StandingState::Completed(response())), |f| {
            *f == fp(1)
        });
        assert_eq!(d, Decision::Replay(response()));
    }

    #[test]
    fn running_same_request_is_in_progress() {
        let lease_left = Duration::from_millis(1500);
        let d = decide(&standing(StandingState::Running { lease_left }), |f| {
            *f == fp(1)
        });
        assert_eq!(d, Decision::InProgress { lease_left });
    }

    #[test]
    fn fingerprint_mismatch_wins_over_every_live_state() {
        for state in [
            StandingState::Running {
                lease_left: Duration::from_secs(1),
            },
            StandingState::Abandoned,
            StandingState::Completed(response()),
        ] {
            assert_eq!(
                decide(&standing(state), |f| *f == fp(2)),
                Decision::KeyReused
            );
        }
    }

    #[test]
    fn expired_records_are_reclaimed_by_any_request() {
        assert_eq!(
            decide(&standing(StandingState::Expired), |f| *f == fp(2)),
            Decision::Reclaim { abandoned: false }
        );
    }

    #[test]
    fn abandoned_same_request_is_reclaimed() {
        assert_eq!(
            decide(&standing(StandingState::Abandoned), |f| *f == fp(1)),
            Decision::Reclaim { abandoned: true }
        );
    }

    #[test]
    fn retry_after_is_capped_by_the_lease_and_floored_at_one_second() {
        let s = Duration::from_secs;
        assert_eq!(in_progress_retry_after(s(1), s(60)), 1);
        assert_eq!(in_progress_retry_after(s(5), s(60)), 5);
        assert_eq!(
            in_progress_retry_after(s(5), Duration::from_millis(2100)),
            3
        );
        assert_eq!(in_progress_retry_after(s(5), Duration::from_millis(10)), 1);
        assert_eq!(in_progress_retry_after(s(5), Duration::ZERO), 1);
        assert_eq!(
            in_progress_retry_after(Duration::from_millis(1500), s(60)),
            2
        );
    }

    /// A store whose claim was written on a connection that then died, and reads back the
    /// request's own reservation when the statement is sent again.
    struct WrittenBeforeTheConnectionDied;

    impl crate::store::Store for WrittenBeforeTheConnectionDied {
        async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
            Ok(Claim::Standing(Standing {
                token: req.token,
                fingerprint: req.fingerprint,
                state: StandingState::Running {
                    lease_left: req.lease,
                },
                expires_in: None,
            }))
        }
        async fn reclaim(
            &self,
            _: &ClaimRequest<'_>,
            _: FencingToken,
        ) -> Result<Claim, StoreError> {
            unreachable!("our own reservation is not reclaimed")
        }
        async fn complete(
            &self,
            _: &crate::scope::ScopeHash,
            _: &str,
            _: FencingToken,
            _: &RecordedResponse,
            _: Duration,
        ) -> Result<bool, StoreError> {
            Ok(true)
        }
        async fn release(
            &self,
            _: &crate::scope::ScopeHash,
            _: &str,
            _: FencingToken,
        ) -> Result<bool, StoreError> {
            Ok(true)
        }
        async fn renew(
            &self,
            _: &crate::scope::ScopeHash,
            _: &str,
            _: FencingToken,
            _: Duration,
        ) -> Result<bool, StoreError> {
            Ok(true)
        }
        async fn sweep(&self, _: usize) -> Result<usize, StoreError> {
            Ok(0)
        }
        async fn inspect(
            &self,
            _: &crate::scope::ScopeHash,
            _: &str,
            _: bool,
        ) -> Result<Option<crate::store::RecordInfo>, StoreError> {
            Ok(None)
        }
        async fn forget(&self, _: &crate::scope::ScopeHash, _: &str) -> Result<bool, StoreError> {
            Ok(false)
        }
    }

    #[tokio::test]
    async fn a_standing_record_with_our_own_token_is_ours() {
        let req = ClaimRequest {
            scope: &[9; 32],
            key: "k",
            quota_bucket: 0,
            fingerprint: fp(1),
            token: FencingToken::mint(),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(60),
            route: "/test",
            response_room: 0,
        };
        let claimed = claim(&WrittenBeforeTheConnectionDied, &req, |f| *f == fp(1))
            .await
            .unwrap();
        assert_eq!(claimed, Verdict::Acquired { reclaimed: false });
    }

    #[test]
    fn headers_follow_the_allowlist_and_content_encoding_rule() {
        let config = Config::default();
        let kept = recorded_headers(
            &config,
            [
                ("content-type", b"application/json".as_slice()),
                ("set-cookie", b"a=b".as_slice()),
                ("location", b"/orders/1".as_slice()),
                ("x-other", b"1".as_slice()),
            ],
        )
        .unwrap();
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["content-type", "location"]);
        assert_eq!(
            recorded_headers(&config, [("content-encoding", b"gzip".as_slice())]),
            None
        );
        let allow = Config::builder()
            .recorded_headers(["content-type", "content-encoding"])
            .build();
        assert!(recorded_headers(&allow, [("content-encoding", b"gzip".as_slice())]).is_some());
    }

    #[test]
    fn trailers_go_through_the_header_allowlist_and_grpc_status_always() {
        let config = Config::builder()
            .recorded_headers(["content-type", "x-checksum"])
            .build();
        let t = |n: &str, v: &'static [u8]| (n.to_owned(), Bytes::from_static(v));
        let sent = [
            t("x-secret", b"s"),
            t("grpc-status", b"0"),
            t("x-checksum", b"c"),
            t("grpc-message", b""),
            t("idempotency-replay", b"x"),
            t("grpc-status-details-bin", b"CAU"),
        ];
        assert_eq!(
            recorded_trailers_for(&config, &Recording::default(), &sent),
            [
                sent[1].clone(),
                sent[2].clone(),
                sent[3].clone(),
                sent[5].clone()
            ]
        );
        let route = crate::config::EndpointConfig::OPTIONAL
            .recorded_headers(&["x-secret"])
            .resolve(&config)
            .recording;
        assert_eq!(
            recorded_trailers_for(&config, &route, &sent),
            [
                sent[0].clone(),
                sent[1].clone(),
                sent[3].clone(),
                sent[5].clone()
            ],
            "the endpoint's own list"
        );
    }
}
