//! The metrics exporter the examples install for `GET /metrics` (DESIGN.md §7): the `metrics`
//! facade's Prometheus recorder, with buckets for the store latency histogram.

use idempotent_runtime::Idempotency;
use idempotent_runtime::observe::STORE_LATENCY;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Buckets for store operations: 0.25 ms to 2.5 s.
const BUCKETS: [f64; 12] = [
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5,
];

/// Installs the process-wide recorder; call once, before serving.
pub fn install() -> PrometheusHandle {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(STORE_LATENCY.to_owned()), &BUCKETS)
        .expect("the buckets are not empty")
        .install_recorder()
        .expect("no other metrics recorder is installed")
}

/// The scrape: the gauges set from their current values, then every metric in the text format.
pub fn render(handle: &PrometheusHandle, idempotency: &Idempotency) -> String {
    idempotency.report_gauges();
    handle.render()
}

/// The text format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
