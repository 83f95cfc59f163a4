//! Whether the PostgreSQL store can honour the TLS its connect options ask for.
//!
//! The store's pool connects lazily, so without this check a `sslmode=require` URL on a build
//! with no TLS feature would connect "fine" and fail at the first statement, with sqlx's message
//! naming sqlx's features rather than this crate's.

use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// Whether this build can speak TLS to PostgreSQL: one of the crate's TLS features is on.
pub(crate) const TLS_COMPILED: bool = cfg!(any(feature = "tls-rustls", feature = "tls-native-tls"));

/// `Err` naming the feature to turn on when `options` require TLS (`sslmode=require`,
/// `verify-ca`, `verify-full`) and `tls_compiled` is false; `prefer`, `allow` and `disable`
/// connect without it.
pub(crate) fn require_tls_support(
    options: &PgConnectOptions,
    tls_compiled: bool,
) -> Result<(), sqlx::Error> {
    let mode = match options.get_ssl_mode() {
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
        PgSslMode::Disable | PgSslMode::Allow | PgSslMode::Prefer => return Ok(()),
    };
    if tls_compiled {
        return Ok(());
    }
    Err(sqlx::Error::Tls(
        format!(
            "the PostgreSQL connect options ask for sslmode={mode}, but idempotent-runtime was \
             built without TLS: enable its `tls-rustls` feature (or `tls-native-tls`), e.g. \
             idempotent-runtime = {{ version = \"0.1\", features = [\"postgres\", \"tls-rustls\"] }}"
        )
        .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(url: &str) -> PgConnectOptions {
        url.parse().expect("a valid URL")
    }

    #[test]
    fn required_tls_without_a_tls_feature_names_the_features_to_turn_on() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://app@db/app?sslmode={mode}");
            let error = require_tls_support(&options(&url), false).expect_err(mode);
            let sqlx::Error::Tls(message) = &error else {
                panic!("{mode}: not a TLS error: {error:?}");
            };
            let message = message.to_string();
            assert!(message.contains(&format!("sslmode={mode}")), "{message}");
            assert!(message.contains("`tls-rustls`"), "{message}");
            assert!(message.contains("`tls-native-tls`"), "{message}");
        }
    }

    #[test]
    fn required_tls_with_a_tls_feature_passes() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://app@db/app?sslmode={mode}");
            require_tls_support(&options(&url), true).expect(mode);
        }
    }

    #[test]
    fn optional_tls_passes_without_a_tls_feature() {
        for mode in ["disable", "allow", "prefer"] {
            let url = format!("postgres://app@db/app?sslmode={mode}");
            require_tls_support(&options(&url), false).expect(mode);
        }
    }
}
