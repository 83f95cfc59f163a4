//! `Config` loaded from a service's own TOML configuration (feature `serde`, #18).

use std::time::Duration;

use idempotent_runtime::config::grammar::{parse_duration, parse_size};
use idempotent_runtime::config::{Config, EndpointConfig};
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
        key_header = "X-Idempotency-Key"
        credential_headers = ["Authorization", "X-Api-Key"]
        max_buffered_bytes = "64MiB"
        sweeper = false
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
    assert_eq!(c.key_header(), "x-idempotency-key");
    assert_eq!(c.credential_headers(), ["authorization", "x-api-key"]);
    assert_eq!(c.max_buffered_bytes(), 64 << 20);
    assert!(!c.sweeper());
}

/// Every key the file form has, read into the same settings the builder makes.
#[test]
fn a_file_with_every_key_is_the_builder_s_config() {
    let file = r#"
        lease = "1.5m"
        retention = "7d"
        in_progress_retry_after = "2s"
        store_retry_after = "500ms"
        max_body = "64KiB"
        max_response = "1.5MB"
        body_timeout = "10s"
        non_replayable = [401, 403, 404]
        recorded_headers = ["content-type", "x-request-id"]
        reuse_status = 409
        missing_key_status = 428
        failure_mode = "open"
        oversized = "record_without_body"
        anonymous = "refuse"
        trusted_proxies = ["10.0.0.0/8"]
        shutdown_grace = "1m"
        key_header = "x-idempotency-key"
        credential_headers = ["authorization", "cookie"]
        methods = ["POST", "DELETE"]
        strict = true
        max_buffered_bytes = "128MiB"
        sweeper = false
    "#;
    let from_file: Config = toml::from_str(file).expect("a valid file");
    let built = Config::builder()
        .lease(Duration::from_secs(90))
        .retention(Duration::from_secs(7 * 86_400))
        .in_progress_retry_after(Duration::from_secs(2))
        .store_retry_after(Duration::from_millis(500))
        .max_body(64 << 10)
        .max_response(1_500_000)
        .body_timeout(Duration::from_secs(10))
        .non_replayable([401, 403, 404])
        .recorded_headers(["content-type", "x-request-id"])
        .reuse_status(ReuseStatus::Conflict)
        .missing_key_status(MissingKeyStatus::PreconditionRequired)
        .failure_mode(FailureMode::Open)
        .oversized(Oversized::RecordWithoutBody)
        .anonymous(Anonymous::Refuse)
        .trusted_proxies(["10.0.0.0/8".parse().unwrap()])
        .shutdown_grace(Duration::from_secs(60))
        .key_header("x-idempotency-key")
        .credential_headers(["authorization", "cookie"])
        .methods(Methods::POST.with(Methods::DELETE))
        .strict(true)
        .max_buffered_bytes(128 << 20)
        .sweeper(false)
        .build();
    assert_eq!(format!("{from_file:?}"), format!("{built:?}"));
}

/// A route's settings from a section of the file: the attribute's keys, the same values as the
/// `const` the attribute would build.
#[test]
fn an_endpoint_section_reads_every_per_route_setting() {
    #[derive(serde::Deserialize)]
    struct Routes {
        payments: EndpointConfig,
        notes: EndpointConfig,
    }
    let file = r#"
        [payments]
        require_key = true
        lease = "30s"
        retention = "7d"
        max_body = "64KiB"
        max_response = "1MiB"
        oversized = "record_without_body"
        reuse_status = 409
        failure_mode = "closed"
        non_replayable = [401, 403, 404, 408, 412, 429]
        recorded_headers = ["Content-Type", "location", "x-payment-id"]
        methods = ["POST", "PUT"]

        [notes]
    "#;
    const PAYMENTS: EndpointConfig = EndpointConfig::new()
        .require_key(true)
        .lease(Duration::from_secs(30))
        .retention(Duration::from_secs(7 * 86_400))
        .max_body(64 << 10)
        .max_response(1 << 20)
        .oversized(Oversized::RecordWithoutBody)
        .reuse_status(ReuseStatus::Conflict)
        .failure_mode(FailureMode::Closed)
        .non_replayable(&[401, 403, 404, 408, 412, 429])
        .recorded_headers(&["content-type", "location", "x-payment-id"])
        .methods(Methods::POST.with(Methods::PUT));
    let routes: Routes = toml::from_str(file).expect("a valid file");
    assert_eq!(routes.payments, PAYMENTS);
    assert_eq!(routes.notes, EndpointConfig::OPTIONAL);
    let err = toml::from_str::<EndpointConfig>("leese = \"30s\"").unwrap_err();
    assert!(err.to_string().contains("leese"), "{err}");
}

/// A bad duration or size in a file is refused with the message the attribute's compile error
/// gives for the same literal (read from the ui test's expected output), since both read it
/// through the one grammar.
#[test]
fn a_bad_duration_or_size_gets_the_attribute_s_message() {
    let root = env!("CARGO_MANIFEST_DIR");
    for (case, setting) in [
        ("axum/fail/bad_duration", "lease"),
        ("axum/fail/bad_retention", "retention"),
        ("axum/fail/bad_size", "max_body"),
        ("axum/fail/bad_max_response", "max_response"),
        ("actix/fail/invalid_lease", "lease"),
        ("actix/fail/bad_max_body", "max_body"),
    ] {
        let source = std::fs::read_to_string(format!("{root}/tests/ui/{case}.rs")).unwrap();
        let at = source.find(&format!("{setting} = \"")).expect(case) + setting.len() + 4;
        let literal = &source[at..at + source[at..].find('"').unwrap()];
        let stderr = std::fs::read_to_string(format!("{root}/tests/ui/{case}.stderr")).unwrap();
        let compile_error = stderr
            .lines()
            .find_map(|l| l.strip_prefix("error[E0080]: evaluation panicked: "))
            .unwrap_or_else(|| panic!("{case}: no const-evaluation error in {stderr}"));
        let grammar = if setting.starts_with("max_") {
            parse_size(literal).map(drop)
        } else {
            parse_duration(literal).map(drop)
        };
        assert_eq!(grammar.unwrap_err().message(), compile_error, "{case}");
        let file = format!("{setting} = {literal:?}");
        let err = toml::from_str::<Config>(&file).unwrap_err().to_string();
        assert!(err.contains(compile_error), "{case}: {err}");
        let err = toml::from_str::<EndpointConfig>(&file)
            .unwrap_err()
            .to_string();
        assert!(err.contains(compile_error), "{case}: {err}");
    }
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
