//! The metrics exporter the examples install for `GET /metrics` (DESIGN.md §7): the `metrics`
//! facade's Prometheus recorder, with buckets for the store latency histogram.

use std::time::Duration;

use idempotent_runtime::Idempotency;
use idempotent_runtime::observe::STORE_LATENCY;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Buckets for store operations: 0.25 ms to 2.5 s.
const BUCKETS: [f64; 12] = [
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5,
];

/// How often the recorder's upkeep runs (the exporter's own default for the recorders it spawns
/// itself).
pub const UPKEEP: Duration = Duration::from_secs(5);

/// Installs the process-wide recorder and starts its upkeep; call once, before serving, inside
/// the Tokio runtime (actix-web's included).
///
/// The recorder keeps every histogram sample (each store operation's latency) raw, a value and
/// its time, until it is drained into the buckets, which only `render` and `run_upkeep` do; a
/// recorder installed with `install_recorder` leaves the upkeep to its caller. Without it, a
/// server nobody scrapes keeps every sample, 16.4 bytes per store operation, for ever: the
/// hostile soak's servers (which never scrape) grew that way, 0.25 MB a minute on PostgreSQL.
pub fn install() -> PrometheusHandle {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(STORE_LATENCY.to_owned()), &BUCKETS)
        .expect("the buckets are not empty")
        .install_recorder()
        .expect("no other metrics recorder is installed");
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    handle
}

/// The scrape: the gauges set from their current values, then every metric in the text format.
pub fn render(handle: &PrometheusHandle, idempotency: &Idempotency) -> String {
    idempotency.report_gauges();
    handle.render()
}

/// The text format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
