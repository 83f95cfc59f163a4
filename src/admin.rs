//! What the conformance servers' admin routes and the operator tool (examples/idempotent_admin.rs)
//! share: a record as JSON (DESIGN.md §5 "Admin"). Who the caller of an admin route is, the
//! runtime resolves itself (`idempotent_runtime::axum::CallerScope`,
//! `idempotent_runtime::actix::CallerScope`), as for its idempotent requests.

use std::time::{SystemTime, UNIX_EPOCH};

use idempotent_runtime::scope::ScopeHash;
use idempotent_runtime::store::RecordInfo;
use serde_json::{Value, json};

/// A 64-hex-digit scope hash, as `--scope-hash` takes it.
pub fn parse_scope_hash(hex: &str) -> Option<ScopeHash> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `t` as RFC 3339 in UTC with milliseconds, e.g. `2026-12-01T06:32:25.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let ms = t
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let (days, rem) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

/// A record as the admin routes answer it: `state`, `status`, `route`, the times (RFC 3339,
/// `null` when unknown or not applicable) and sizes; `body` (as UTF-8, lossy) only when the
/// response was read.
pub fn record_json(info: &RecordInfo) -> Value {
    let time = |t: Option<SystemTime>| t.map(rfc3339);
    let mut doc = json!({
        "state": info.state.as_str(),
        "status": info.status,
        "route": info.route,
        "created_at": time(info.created_at),
        "completed_at": time(info.completed_at),
        "lease_until": time(info.lease_until),
        "expires_at": rfc3339(info.expires_at),
        "body_bytes": info.body_bytes,
        "header_bytes": info.header_bytes,
    });
    if let Some(response) = &info.response {
        doc["body"] = String::from_utf8_lossy(&response.body).into_owned().into();
        doc["headers"] = response
            .headers
            .iter()
            .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
            .collect();
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_are_rfc3339_in_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_761_145_123);
        assert_eq!(rfc3339(t), "2026-11-27T06:32:25.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn scope_hashes_parse_from_hex() {
        let hash = *idempotent_runtime::scope::Scope::from_identity(
            &idempotent_runtime::scope::Identity::subject("acme", "alice"),
            None,
        )
        .unwrap()
        .hash();
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(parse_scope_hash(&hex), Some(hash));
        assert_eq!(parse_scope_hash("abc"), None);
        assert_eq!(parse_scope_hash(&"zz".repeat(32)), None);
    }
}
