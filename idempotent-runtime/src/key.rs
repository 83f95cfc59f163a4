//! Parsing the `Idempotency-Key` request header ([the contract](crate::design) §2, "Key syntax").
//!
//! A value that starts with `"` is a Structured-Field string (RFC 9651) without parameters; any
//! other value is the bare form most clients send. After unquoting, a key is 1–255 visible ASCII
//! characters. Two header lines, or one bare line with a `,` (two lines folded into one), are
//! refused: the client sent two keys and we cannot know which one it meant.
//!
//! An endpoint may instead read its key from a JSON body ([`KeySource`]): a
//! webhook provider's event id, say. The same syntax rules apply to the value found.

use std::fmt;
use std::sync::Arc;

// Keys read from a JSON body (issue 31): where the key comes from, RFC 6901 pointers, and the
// strict JSON reader the subset fingerprint shares.
pub(crate) mod json;
mod pointer;
mod source;

pub use pointer::{JsonPointer, PointerError};
pub(crate) use source::{BodyKeyError, key_from_body};
pub use source::{KeySource, KeySourceError};

/// The longest key accepted, in bytes (after unquoting).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// The header's name, lowercase as HTTP/2 and HTTP/3 carry it.
pub(crate) const HEADER_NAME: &str = "idempotency-key";

/// A syntactically valid idempotency key, compared exactly (case-sensitive).
///
/// Its `Debug` and `Display` never show the key: keys are the client's and are never logged.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Arc<str>);

impl IdempotencyKey {
    /// The key as the client sent it, after unquoting.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Builds a key from an already unquoted value, checking the 1–255 visible-ASCII rule.
    pub fn new(value: &str) -> Result<Self, KeyError> {
        check_chars(value.as_bytes())?;
        Ok(Self(Arc::from(value)))
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(<{} bytes>)", self.0.len())
    }
}

/// Why a present `Idempotency-Key` was refused. Every variant answers 400
/// `IDEMPOTENCY_KEY_INVALID`; the variant only shapes the problem's `detail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was present but empty (or `""`).
    Empty,
    /// Longer than 255 bytes after unquoting.
    TooLong {
        /// The length in bytes; the key itself is never echoed.
        len: usize,
    },
    /// A byte outside visible ASCII (0x21–0x7E).
    InvalidCharacter,
    /// A quoted value that is not a valid Structured-Field string without parameters.
    MalformedQuoted,
    /// The header appeared more than once, or a bare value contains `,`.
    Multiple,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the Idempotency-Key header is empty"),
            Self::TooLong { len } => write!(
                f,
                "the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::InvalidCharacter => f.write_str(
                "the Idempotency-Key may contain only visible ASCII characters (0x21-0x7E)",
            ),
            Self::MalformedQuoted => f.write_str(
                "a quoted Idempotency-Key must be a Structured-Field string without parameters",
            ),
            Self::Multiple => f.write_str("the request carries more than one Idempotency-Key"),
        }
    }
}

impl std::error::Error for KeyError {}

/// Parses every value of the `Idempotency-Key` header, in the order received.
///
/// `Ok(None)` means no header at all. Any header present but invalid, or present twice, is an
/// error.
///
/// ```
/// # #[cfg(feature = "testing")] {
/// use idempotent_runtime::key::KeyError;
/// use idempotent_runtime::test_helpers::key::parse_header_values;
///
/// let key = parse_header_values([b"\"order-42\"".as_slice()]).unwrap().unwrap();
/// assert_eq!(key.as_str(), "order-42");
/// assert_eq!(parse_header_values([b"a, b".as_slice()]), Err(KeyError::Multiple));
/// assert_eq!(parse_header_values(std::iter::empty::<&[u8]>()), Ok(None));
/// # }
/// ```
pub(crate) fn parse_header_values<'a, I>(values: I) -> Result<Option<IdempotencyKey>, KeyError>
where
    I: IntoIterator<Item = &'a [u8]>,
{
    let mut values = values.into_iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse_value(first).map(Some)
}

/// Parses one header value.
pub(crate) fn parse_value(raw: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let value = trim_ows(raw);
    if value.first() == Some(&b'"') {
        return parse_quoted(value);
    }
    if value.is_empty() {
        return Err(KeyError::Empty);
    }
    if value.contains(&b',') {
        return Err(KeyError::Multiple);
    }
    check_chars(value)?;
    // check_chars proved the bytes are ASCII.
    let text = std::str::from_utf8(value).map_err(|_| KeyError::InvalidCharacter)?;
    Ok(IdempotencyKey(Arc::from(text)))
}

fn parse_quoted(value: &[u8]) -> Result<IdempotencyKey, KeyError> {
    let item: sfv::Item = sfv::Parser::new(value)
        .parse_item()
        .map_err(|_| KeyError::MalformedQuoted)?;
    if !item.params.is_empty() {
        return Err(KeyError::MalformedQuoted);
    }
    let text = item
        .bare_item
        .as_string()
        .ok_or(KeyError::MalformedQuoted)?
        .as_str();
    check_chars(text.as_bytes())?;
    Ok(IdempotencyKey(Arc::from(text)))
}

fn check_chars(value: &[u8]) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty);
    }
    if value.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: value.len() });
    }
    if !value.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(())
}

/// Optional whitespace around a field value (RFC 9110 §5.5); servers usually strip it already.
fn trim_ows(value: &[u8]) -> &[u8] {
    let start = value
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    &value[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn one(v: &str) -> Result<IdempotencyKey, KeyError> {
        parse_value(v.as_bytes())
    }

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(one("abc").unwrap(), one("\"abc\"").unwrap());
        assert_eq!(one("  abc\t").unwrap().as_str(), "abc");
    }

    #[test]
    fn keys_compare_case_sensitively() {
        assert_ne!(one("ABC").unwrap(), one("abc").unwrap());
    }

    #[test]
    fn quoted_escapes_are_unquoted() {
        assert_eq!(one(r#""a\"b\\c""#).unwrap().as_str(), r#"a"b\c"#);
    }

    #[test]
    fn quoted_with_bad_escape_or_parameters_is_malformed() {
        assert_eq!(one(r#""a\qb""#), Err(KeyError::MalformedQuoted));
        assert_eq!(one(r#""abc";p=1"#), Err(KeyError::MalformedQuoted));
        assert_eq!(one(r#""abc"#), Err(KeyError::MalformedQuoted));
        assert_eq!(one(r#""abc" x"#), Err(KeyError::MalformedQuoted));
        assert_eq!(one(r#""a", "b""#), Err(KeyError::MalformedQuoted));
    }

    #[test]
    fn quoted_space_is_refused_after_unquoting() {
        assert_eq!(one("\"a b\""), Err(KeyError::InvalidCharacter));
    }

    #[test]
    fn empty_values_are_refused() {
        assert_eq!(one(""), Err(KeyError::Empty));
        assert_eq!(one("   "), Err(KeyError::Empty));
        assert_eq!(one("\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn length_limit_is_255_after_unquoting() {
        let ok = "k".repeat(255);
        assert_eq!(one(&ok).unwrap().as_str(), ok);
        assert_eq!(one(&format!("\"{ok}\"")).unwrap().as_str(), ok);
        assert_eq!(one(&"k".repeat(256)), Err(KeyError::TooLong { len: 256 }));
        assert_eq!(
            one(&"k".repeat(10_000)),
            Err(KeyError::TooLong { len: 10_000 })
        );
    }

    #[test]
    fn control_and_non_ascii_bytes_are_refused() {
        assert_eq!(parse_value(b"a\x01b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_value(b"a\xffb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_value("é".as_bytes()), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_value(b"a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_value(b"a\x7f"), Err(KeyError::InvalidCharacter));
    }

    #[test]
    fn two_headers_or_a_folded_line_are_refused() {
        assert_eq!(
            parse_header_values([b"a".as_slice(), b"a".as_slice()]),
            Err(KeyError::Multiple)
        );
        assert_eq!(one("a,b"), Err(KeyError::Multiple));
    }

    #[test]
    fn debug_never_shows_the_key() {
        let key = one("secret-key").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }

    proptest! {
        #[test]
        fn any_visible_ascii_bare_key_round_trips(key in "[!#-+\\--~][!-+\\--~]{0,254}") {
            let parsed = one(&key).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn quoting_any_valid_key_yields_the_same_key(key in "[!-+\\--~]{1,255}") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let parsed = one(&quoted).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn junk_never_panics_and_accepted_keys_obey_the_rules(raw in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(key) = parse_value(&raw) {
                let k = key.as_str().as_bytes();
                prop_assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN);
                prop_assert!(k.iter().all(|b| (0x21..=0x7e).contains(b)));
            }
        }
    }
}
