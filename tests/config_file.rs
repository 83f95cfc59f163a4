//! `Config` loaded from a service's own TOML configuration (feature `serde`, #18).

use std::time::Duration;

use idempotent_runtime::Config;
use idempotent_runtime::config::{FailureMode, Methods, MissingKeyStatus, Oversized, ReuseStatus};
use idempotent_runtime::scope::Anonymous;

#[derive(serde::Deserialize)]
struct ServiceConfig {
    #[allow(dead_code)]
    listen: String,
    idempotency: Config,
}

#[test]
fn loads_every_setting_from_a_toml_section_in_human_units() {
    let file = r#"
        listen = "0.0.0.0:8080"

        [idempotency]
        lease = "30s"
        retention = "7d"
        in_progress_retry_after = "2s"
        store_retry_after = 3
        max_body = "64KiB"
        max_response = "2MiB"
        body_timeout = "1500ms"
        non_replayable = [401, 403, 429]
        recorded_headers = ["Content-Type", "Location", "X-Request-Id"]
        reuse_status = 409
        missing_key_status = 428
        failure_mode = "open"
        oversized = "record_without_body"
        anonymous = "refuse"
        trusted_proxies = ["10.0.0.0/8", "fd00::/8"]
        shutdown_grace = "1m"
        methods = ["POST", "PUT"]
        strict = false
    "#;
    let service: ServiceConfig = toml::from_str(file).expect("a valid file");
    let c = service.idempotency;
    assert_eq!(c.lease(), Duration::from_secs(30));
    assert_eq!(c.retention(), Duration::from_secs(7 * 86_400));
    assert_eq!(c.in_progress_retry_after(), Duration::from_secs(2));
    assert_eq!(c.store_retry_after(), Duration::from_secs(3));
    assert_eq!((c.max_body(), c.max_response()), (64 * 1024, 2 << 20));
    assert_eq!(c.body_timeout(), Duration::from_millis(1500));
    assert!(!c.is_recordable_status(429) && c.is_recordable_status(408));
    assert!(c.records_header("x-request-id") && !c.records_header("etag"));
    assert_eq!(c.reuse_status(), ReuseStatus::Conflict);
    assert_eq!(
        c.missing_key_status(),
        MissingKeyStatus::PreconditionRequired
    );
    assert_eq!(c.failure_mode(), FailureMode::Open);
    assert_eq!(c.oversized(), Oversized::RecordWithoutBody);
    assert_eq!(c.anonymous(), Anonymous::Refuse);
    assert_eq!(c.trusted_proxies().len(), 2);
    assert_eq!(c.shutdown_grace(), Duration::from_secs(60));
    assert_eq!(c.methods(), Methods::POST.with(Methods::PUT));
    assert!(!c.strict());
}

#[test]
fn methods_name_only_unsafe_methods_and_strict_defaults_to_the_build() {
    let err = toml::from_str::<Config>(r#"methods = ["POST", "GET"]"#).unwrap_err();
    assert!(err.to_string().contains("safe methods"), "{err}");
    let c: Config = toml::from_str("").unwrap();
    assert_eq!(c.methods(), Methods::POST.with(Methods::PATCH));
    assert_eq!(c.strict(), cfg!(debug_assertions));
    let on: Config = toml::from_str("strict = true").unwrap();
    assert!(on.strict());
}

#[test]
fn an_empty_section_is_the_default_and_a_misspelt_setting_is_an_error() {
    let c: Config = toml::from_str("").unwrap();
    assert_eq!(format!("{c:?}"), format!("{:?}", Config::default()));
    let err = toml::from_str::<Config>("leese = \"30s\"").unwrap_err();
    assert!(err.to_string().contains("leese"), "{err}");
    let err = toml::from_str::<Config>("max_body = \"a lot\"").unwrap_err();
    assert!(err.to_string().contains("size"), "{err}");
}
