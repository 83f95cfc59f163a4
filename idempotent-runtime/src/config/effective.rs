//! [`Effective`]: what a request sees of its endpoint's settings, and [`Recording`], which
//! responses it records. Its own file so that it is
//! public only through `test_helpers` (the core bench builds requests with it).

use std::time::Duration;

use super::{
    Config, FailureMode, HeaderNames, Methods, NEVER_RECORDED, Oversized, ReuseStatus, Statuses,
};
use crate::fingerprint::BodySubset;

/// Endpoint settings merged with the runtime's [`Config`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct Effective {
    /// Refuse requests without a key.
    pub require_key: bool,
    /// Lease.
    pub lease: Duration,
    /// Retention.
    pub retention: Duration,
    /// Request body cap.
    pub max_body: usize,
    /// Recorded response cap.
    pub max_response: usize,
    /// Status for a reused key.
    pub reuse_status: ReuseStatus,
    /// Fail closed or open.
    pub failure_mode: FailureMode,
    /// The methods it applies to.
    pub methods: Methods,
    /// What of the body the fingerprint covers: `None` the whole body (version 1).
    pub fingerprint: Option<BodySubset>,
    /// How long a duplicate waits for a running request's answer (zero: 409 at once).
    pub wait_in_progress: Duration,
    /// Which responses are recorded.
    pub recording: Recording,
}

/// Which responses an endpoint records: its overrides of [`Config`]'s lists, `None` meaning
/// the configured one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(
    not(feature = "testing"),
    allow(
        unreachable_pub,
        reason = "public through test_helpers under the testing feature"
    )
)]
pub struct Recording {
    pub(super) non_replayable: Option<Statuses>,
    pub(super) recorded_headers: Option<HeaderNames>,
    pub(super) oversized: Option<Oversized>,
}

impl Recording {
    /// Whether a response with this final status may be recorded and replayed.
    pub(crate) fn is_recordable_status(&self, config: &Config, status: u16) -> bool {
        match &self.non_replayable {
            Some(list) => (200..500).contains(&status) && !list.as_slice().contains(&status),
            None => config.is_recordable_status(status),
        }
    }

    /// What an answer over `max_response` leaves behind on this endpoint.
    pub(crate) fn oversized(&self, config: &Config) -> Oversized {
        self.oversized.unwrap_or(config.oversized)
    }

    /// Whether a response header (lowercase name) is kept in the record.
    pub(crate) fn records_header(&self, config: &Config, lowercase_name: &str) -> bool {
        match &self.recorded_headers {
            Some(list) => {
                !NEVER_RECORDED.contains(&lowercase_name) && list.contains(lowercase_name)
            }
            None => config.records_header(lowercase_name),
        }
    }
}
