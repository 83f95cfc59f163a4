//! The one grammar for durations and sizes, shared by `#[idempotent(...)]` (whose expansion
//! evaluates these functions in a `const`, so a bad value is a compile error at its literal) and
//! the file form (feature `serde`), so both accept and refuse exactly the same strings.
//!
//! A value is a number immediately followed by its unit, with no spaces:
//!
//! - The number is decimal digits with an optional fraction (`30`, `1.5`; not `.5`, `1.`,
//!   `-1`, `1e3`). The value it spells must be whole in the smallest unit (a nanosecond for a
//!   duration, a byte for a size): `"1.5KiB"` is 1536 bytes, `"1.3B"` is refused.
//! - Units are case-sensitive and written exactly as listed. Durations: `ms`, `s`, `m`
//!   (minutes), `h`, `d`; a duration always has a unit. Sizes: `B`, `KiB`, `MiB`, `GiB` (powers
//!   of 1024) and `KB`, `MB`, `GB` (powers of 1000); a size without a unit is in bytes.
//! - Zero is refused: no setting that takes a duration or a size means anything at zero.
//!
//! ```
//! use std::time::Duration;
//! use idempotent_runtime::config::grammar::{parse_duration, parse_size};
//!
//! const LEASE: Duration = match parse_duration("1.5m") {
//!     Ok(d) => d,
//!     Err(e) => panic!("{}", e.message()),
//! };
//! assert_eq!(LEASE, Duration::from_secs(90));
//! assert_eq!(parse_size("64KiB"), Ok(65_536));
//! assert_eq!(parse_size("64KB"), Ok(64_000));
//! assert!(parse_size("64kib").is_err()); // case matters
//! assert!(parse_duration("30").is_err()); // a duration needs its unit
//! ```

use std::time::Duration;

/// Why a string is not a duration or a size. [`message`](Self::message) is the explanation, the
/// same wherever the value was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarError {
    size: bool,
    reason: Reason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reason {
    /// No digits where the number should be.
    NoNumber,
    /// A space or other whitespace anywhere.
    Space,
    /// A duration without its unit.
    NoUnit,
    /// A unit of another case (`kib`, `MS`).
    Case,
    /// No such unit.
    UnknownUnit,
    /// Not a whole nanosecond or byte.
    NotWhole,
    /// Zero.
    Zero,
    /// Larger than the type holds.
    TooLarge,
}

impl GrammarError {
    const fn duration(reason: Reason) -> Self {
        Self {
            size: false,
            reason,
        }
    }

    const fn size(reason: Reason) -> Self {
        Self { size: true, reason }
    }

    /// What is wrong and how to write it, the same text in a compile error and in a file's
    /// error.
    pub const fn message(&self) -> &'static str {
        match (self.size, self.reason) {
            (false, Reason::NoNumber | Reason::UnknownUnit) => {
                "not a duration: write a number and a unit (ms, s, m, h or d), e.g. \"30s\" or \
                 \"1.5m\""
            }
            (false, Reason::Space) => {
                "not a duration: write the number and its unit without spaces, e.g. \"30s\""
            }
            (false, Reason::NoUnit) => {
                "not a duration: a duration needs a unit (ms, s, m, h or d), e.g. \"30s\""
            }
            (false, Reason::Case) => {
                "not a duration: units are case-sensitive and lower case (ms, s, m, h, d)"
            }
            (false, Reason::NotWhole) => "not a duration: not a whole number of nanoseconds",
            (false, Reason::Zero) => "not a duration: must be longer than zero",
            (false, Reason::TooLarge) => "not a duration: too long",
            (true, Reason::NoNumber | Reason::UnknownUnit | Reason::NoUnit) => {
                "not a size: write a number of bytes and an optional unit (B, KiB, MiB, GiB, KB, \
                 MB, GB), e.g. \"64KiB\""
            }
            (true, Reason::Space) => {
                "not a size: write the number and its unit without spaces, e.g. \"64KiB\""
            }
            (true, Reason::Case) => {
                "not a size: units are case-sensitive: B, KiB, MiB, GiB (powers of 1024), KB, MB, \
                 GB (powers of 1000)"
            }
            (true, Reason::NotWhole) => "not a size: not a whole number of bytes",
            (true, Reason::Zero) => "not a size: must be at least one byte",
            (true, Reason::TooLarge) => "not a size: too large",
        }
    }
}

impl std::fmt::Display for GrammarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for GrammarError {}

/// A number split from its unit: `digits` and `fraction` as integers, with the fraction's
/// number of digits, and the unit's bytes.
struct Number<'a> {
    whole: u128,
    fraction: u128,
    fraction_digits: u32,
    unit: &'a [u8],
}

const fn has_space(text: &[u8]) -> bool {
    let mut i = 0;
    while i < text.len() {
        if text[i].is_ascii_whitespace() {
            return true;
        }
        i += 1;
    }
    false
}

/// Digits up to `at`, as an integer, or `None` when it overflows.
const fn digits(text: &[u8], mut at: usize, end: usize) -> Option<u128> {
    let mut n: u128 = 0;
    while at < end {
        n = match n.checked_mul(10) {
            Some(n) => match n.checked_add((text[at] - b'0') as u128) {
                Some(n) => n,
                None => return None,
            },
            None => return None,
        };
        at += 1;
    }
    Some(n)
}

const fn count_digits(text: &[u8], mut at: usize) -> usize {
    let start = at;
    while at < text.len() && text[at].is_ascii_digit() {
        at += 1;
    }
    at - start
}

const fn split(text: &[u8]) -> Result<Number<'_>, Reason> {
    if has_space(text) {
        return Err(Reason::Space);
    }
    let whole_len = count_digits(text, 0);
    if whole_len == 0 {
        return Err(Reason::NoNumber);
    }
    let Some(whole) = digits(text, 0, whole_len) else {
        return Err(Reason::TooLarge);
    };
    let (mut fraction, mut fraction_digits, mut end) = (0, 0, whole_len);
    if end < text.len() && text[end] == b'.' {
        let len = count_digits(text, end + 1);
        if len == 0 {
            return Err(Reason::NoNumber);
        }
        // Trailing zeros change nothing. Past 20 significant digits no fraction is whole in
        // any unit (the largest, a day, is 2^16 × 5^11 × 3^3 nanoseconds).
        let mut significant = len;
        while significant > 0 && text[end + significant] == b'0' {
            significant -= 1;
        }
        if significant > 20 {
            return Err(Reason::NotWhole);
        }
        fraction = match digits(text, end + 1, end + 1 + significant) {
            Some(f) => f,
            None => return Err(Reason::TooLarge),
        };
        fraction_digits = significant as u32;
        end += 1 + len;
    }
    let (_, unit) = text.split_at(end);
    Ok(Number {
        whole,
        fraction,
        fraction_digits,
        unit,
    })
}

const fn eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const fn eq_ignore_case(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if !a[i].eq_ignore_ascii_case(&b[i]) {
            return false;
        }
        i += 1;
    }
    true
}

/// `number × factor` when it is whole, from the split number.
const fn scale(n: &Number<'_>, factor: u128) -> Result<u128, Reason> {
    let Some(whole) = n.whole.checked_mul(factor) else {
        return Err(Reason::TooLarge);
    };
    if n.fraction_digits == 0 {
        return Ok(whole);
    }
    let Some(fraction) = n.fraction.checked_mul(factor) else {
        return Err(Reason::TooLarge);
    };
    let divisor = 10u128.pow(n.fraction_digits);
    if fraction % divisor != 0 {
        return Err(Reason::NotWhole);
    }
    match whole.checked_add(fraction / divisor) {
        Some(total) => Ok(total),
        None => Err(Reason::TooLarge),
    }
}

const DURATION_UNITS: [(&[u8], u128); 5] = [
    (b"ms", 1_000_000),
    (b"s", 1_000_000_000),
    (b"m", 60_000_000_000),
    (b"h", 3_600_000_000_000),
    (b"d", 86_400_000_000_000),
];

const SIZE_UNITS: [(&[u8], u128); 8] = [
    (b"", 1),
    (b"B", 1),
    (b"KiB", 1 << 10),
    (b"MiB", 1 << 20),
    (b"GiB", 1 << 30),
    (b"KB", 1_000),
    (b"MB", 1_000_000),
    (b"GB", 1_000_000_000),
];

/// The factor of `unit` in `units`: `Err(Case)` when only another case of it is listed.
const fn factor(units: &[(&[u8], u128)], unit: &[u8]) -> Result<u128, Reason> {
    let mut i = 0;
    while i < units.len() {
        if eq(units[i].0, unit) {
            return Ok(units[i].1);
        }
        i += 1;
    }
    let mut i = 0;
    while i < units.len() {
        if eq_ignore_case(units[i].0, unit) {
            return Err(Reason::Case);
        }
        i += 1;
    }
    Err(Reason::UnknownUnit)
}

/// A duration such as `"500ms"`, `"30s"`, `"1.5m"`, `"24h"`, `"7d"` (see the [module](self)).
pub const fn parse_duration(text: &str) -> Result<Duration, GrammarError> {
    let n = match split(text.as_bytes()) {
        Ok(n) => n,
        Err(reason) => return Err(GrammarError::duration(reason)),
    };
    if n.unit.is_empty() {
        return Err(GrammarError::duration(Reason::NoUnit));
    }
    let nanos = match factor(&DURATION_UNITS, n.unit) {
        Ok(f) => match scale(&n, f) {
            Ok(nanos) => nanos,
            Err(reason) => return Err(GrammarError::duration(reason)),
        },
        Err(reason) => return Err(GrammarError::duration(reason)),
    };
    if nanos == 0 {
        return Err(GrammarError::duration(Reason::Zero));
    }
    let secs = nanos / 1_000_000_000;
    if secs > u64::MAX as u128 {
        return Err(GrammarError::duration(Reason::TooLarge));
    }
    Ok(Duration::new(secs as u64, (nanos % 1_000_000_000) as u32))
}

/// A size in bytes such as `"512"`, `"512B"`, `"64KiB"`, `"1.5MiB"`, `"64KB"`, `"1GB"` (see
/// the [module](self)).
pub const fn parse_size(text: &str) -> Result<usize, GrammarError> {
    let n = match split(text.as_bytes()) {
        Ok(n) => n,
        Err(reason) => return Err(GrammarError::size(reason)),
    };
    let bytes = match factor(&SIZE_UNITS, n.unit) {
        Ok(f) => match scale(&n, f) {
            Ok(bytes) => bytes,
            Err(reason) => return Err(GrammarError::size(reason)),
        },
        Err(reason) => return Err(GrammarError::size(reason)),
    };
    if bytes == 0 {
        return Err(GrammarError::size(Reason::Zero));
    }
    if bytes > usize::MAX as u128 {
        return Err(GrammarError::size(Reason::TooLarge));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let ok = [
            ("500ms", Duration::from_millis(500)),
            ("1.5ms", Duration::from_micros(1500)),
            ("30s", Duration::from_secs(30)),
            ("1.5s", Duration::from_millis(1500)),
            ("1.5m", Duration::from_secs(90)),
            ("2m", Duration::from_secs(120)),
            ("24h", Duration::from_secs(86_400)),
            ("7d", Duration::from_secs(7 * 86_400)),
            ("0.000000001s", Duration::from_nanos(1)),
            (
                "0.5000000000000000000000000000s",
                Duration::from_millis(500),
            ),
        ];
        for (text, want) in ok {
            assert_eq!(parse_duration(text), Ok(want), "{text:?}");
        }
        let bad = [
            ("", Reason::NoNumber),
            ("s", Reason::NoNumber),
            ("-1s", Reason::NoNumber),
            (".5s", Reason::NoNumber),
            ("1.s", Reason::NoNumber),
            ("30", Reason::NoUnit),
            ("30 s", Reason::Space),
            (" 30s", Reason::Space),
            ("30s ", Reason::Space),
            ("30 seconds", Reason::Space),
            ("3fortnights", Reason::UnknownUnit),
            ("1e3s", Reason::UnknownUnit),
            ("30S", Reason::Case),
            ("30MS", Reason::Case),
            ("1min", Reason::UnknownUnit),
            ("0s", Reason::Zero),
            ("0.0ms", Reason::Zero),
            ("0.0000000001s", Reason::NotWhole),
            ("0.000000000000000000000000000001d", Reason::NotWhole),
            (
                "99999999999999999999999999999999999999999d",
                Reason::TooLarge,
            ),
            ("999999999999999999999d", Reason::TooLarge),
        ];
        for (text, reason) in bad {
            assert_eq!(
                parse_duration(text),
                Err(GrammarError::duration(reason)),
                "{text:?}"
            );
        }
    }

    #[test]
    fn sizes() {
        let ok = [
            ("512", 512),
            ("512B", 512),
            ("64KiB", 65_536),
            ("0.5KiB", 512),
            ("1.5MiB", 3 << 19),
            ("1MiB", 1 << 20),
            ("1GiB", 1 << 30),
            ("64KB", 64_000),
            ("2MB", 2_000_000),
            ("1.5GB", 1_500_000_000),
        ];
        for (text, want) in ok {
            assert_eq!(parse_size(text), Ok(want), "{text:?}");
        }
        let bad = [
            ("", Reason::NoNumber),
            ("MiB", Reason::NoNumber),
            ("1 MiB", Reason::Space),
            ("64kib", Reason::Case),
            ("64kb", Reason::Case),
            ("64kB", Reason::Case),
            ("1m", Reason::UnknownUnit),
            ("1k", Reason::UnknownUnit),
            ("1 parsec", Reason::Space),
            ("1.3B", Reason::NotWhole),
            ("0.3KiB", Reason::NotWhole),
            ("0", Reason::Zero),
            ("0KiB", Reason::Zero),
        ];
        for (text, reason) in bad {
            assert_eq!(
                parse_size(text),
                Err(GrammarError::size(reason)),
                "{text:?}"
            );
        }
        #[cfg(target_pointer_width = "64")]
        assert_eq!(
            parse_size("99999999999GiB"),
            Err(GrammarError::size(Reason::TooLarge))
        );
    }

    #[test]
    fn every_message_names_the_kind() {
        for reason in [
            Reason::NoNumber,
            Reason::Space,
            Reason::NoUnit,
            Reason::Case,
            Reason::UnknownUnit,
            Reason::NotWhole,
            Reason::Zero,
            Reason::TooLarge,
        ] {
            assert!(
                GrammarError::duration(reason)
                    .message()
                    .starts_with("not a duration")
            );
            assert!(
                GrammarError::size(reason)
                    .message()
                    .starts_with("not a size")
            );
        }
    }
}
