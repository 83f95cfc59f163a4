//! JSON Pointers (RFC 6901): where in a JSON body a key, or a value the fingerprint covers, is.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

/// A syntactically valid JSON Pointer (RFC 6901), e.g. `/id` or `/data/items/0/sku`.
///
/// The empty pointer is the whole document. Each `/`-separated reference token is unescaped on
/// use (`~1` is `/`, `~0` is `~`); against an array a token is an index (`0`, or digits without a
/// leading zero; `-` and anything else select nothing).
///
/// Valid pointers are known at compile time where they are written as literals:
///
/// ```
/// use idempotent_runtime::key::JsonPointer;
///
/// const EVENT_ID: JsonPointer = JsonPointer::from_static("/id");
/// assert_eq!(EVENT_ID.as_str(), "/id");
/// assert_eq!("/a~1b/~0c".parse::<JsonPointer>().unwrap().tokens().collect::<Vec<_>>(), ["a/b", "~c"]);
/// ```
///
/// and a malformed literal is a compile error, not a request-time surprise:
///
/// ```compile_fail
/// use idempotent_runtime::key::JsonPointer;
///
/// const EVENT_ID: JsonPointer = JsonPointer::from_static("id"); // no leading `/`
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JsonPointer(Cow<'static, str>);

/// Why a text is not a JSON Pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PointerError {
    /// A non-empty pointer starts with `/` (`id` is written `/id`).
    MissingLeadingSlash,
    /// A `~` not followed by `0` or `1`, at this byte offset of the pointer.
    BadEscape {
        /// Byte offset of the `~`.
        at: usize,
    },
}

impl fmt::Display for PointerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingLeadingSlash => f.write_str(
                "a JSON Pointer starts with `/` (write `/id`, or `` for the whole body)",
            ),
            Self::BadEscape { at } => write!(
                f,
                "a JSON Pointer writes `~` as `~0` and `/` inside a name as `~1`; the `~` at byte {at} is neither"
            ),
        }
    }
}

impl std::error::Error for PointerError {}

/// [`JsonPointer::validate`] on `bytes[start..]`, in const context.
pub(crate) const fn validate_bytes(bytes: &[u8], start: usize) -> Result<(), PointerError> {
    if bytes.len() == start {
        return Ok(());
    }
    if bytes[start] != b'/' {
        return Err(PointerError::MissingLeadingSlash);
    }
    let mut i = start;
    while i < bytes.len() {
        if bytes[i] == b'~' {
            if i + 1 >= bytes.len() || !(bytes[i + 1] == b'0' || bytes[i + 1] == b'1') {
                return Err(PointerError::BadEscape { at: i - start });
            }
            i += 1;
        }
        i += 1;
    }
    Ok(())
}

impl JsonPointer {
    /// The whole document (the empty pointer).
    pub const ROOT: JsonPointer = JsonPointer(Cow::Borrowed(""));

    /// Checks RFC 6901 syntax: empty, or `/` followed by tokens in which every `~` is `~0` or
    /// `~1`. Usable in const context, so a macro or a `const` item can refuse a malformed
    /// pointer at compile time.
    ///
    /// ```
    /// use idempotent_runtime::key::{JsonPointer, PointerError};
    ///
    /// const _: () = assert!(JsonPointer::validate("/data/0").is_ok());
    /// assert_eq!(JsonPointer::validate("/a~2"), Err(PointerError::BadEscape { at: 2 }));
    /// ```
    pub const fn validate(text: &str) -> Result<(), PointerError> {
        validate_bytes(text.as_bytes(), 0)
    }

    /// A pointer from a literal; in a `const` item a malformed one fails to compile (elsewhere
    /// it panics, with the reason). Use [`parse`](Self::parse) for text read at run time.
    pub const fn from_static(text: &'static str) -> Self {
        match Self::validate(text) {
            Ok(()) => Self(Cow::Borrowed(text)),
            Err(PointerError::MissingLeadingSlash) => panic!(
                "malformed JSON Pointer: a non-empty pointer starts with `/` (write \"/id\", not \"id\")"
            ),
            Err(PointerError::BadEscape { .. }) => panic!(
                "malformed JSON Pointer: `~` must be written `~0`, and a `/` inside a name `~1`"
            ),
        }
    }

    /// Parses a pointer read at run time (a configuration file, say).
    pub fn parse(text: &str) -> Result<Self, PointerError> {
        Self::validate(text)?;
        Ok(Self(Cow::Owned(text.to_owned())))
    }

    /// The pointer as written (escaped).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The unescaped reference tokens, in order (none for the whole document).
    pub fn tokens(&self) -> impl Iterator<Item = Cow<'_, str>> + '_ {
        let rest = self.0.strip_prefix('/');
        rest.into_iter()
            .flat_map(|rest| rest.split('/'))
            .map(unescape)
    }
}

fn unescape(token: &str) -> Cow<'_, str> {
    if !token.contains('~') {
        return Cow::Borrowed(token);
    }
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            // Validation guarantees `~0` or `~1`; reading them in one pass is what makes `~01`
            // the name `~1` rather than `/`.
            match chars.next() {
                Some('1') => out.push('/'),
                _ => out.push('~'),
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// An array index token: `0`, or digits without a leading zero that fit a `usize`.
pub(crate) fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if bytes.len() > 1 && bytes[0] == b'0' {
        return None;
    }
    token.parse().ok()
}

impl FromStr for JsonPointer {
    type Err = PointerError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonPointer({:?})", self.0)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for JsonPointer {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <Cow<'de, str>>::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc_6901_escapes_unescape_in_one_pass() {
        let p = JsonPointer::parse("/a~1b/m~0n/~01/").unwrap();
        assert_eq!(p.tokens().collect::<Vec<_>>(), ["a/b", "m~n", "~1", ""]);
        assert_eq!(JsonPointer::ROOT.tokens().count(), 0);
        assert_eq!(
            JsonPointer::parse("/")
                .unwrap()
                .tokens()
                .collect::<Vec<_>>(),
            [""]
        );
    }

    #[test]
    fn malformed_pointers_are_refused_with_the_reason() {
        assert_eq!(
            JsonPointer::validate("id"),
            Err(PointerError::MissingLeadingSlash)
        );
        assert_eq!(
            JsonPointer::validate("/a~"),
            Err(PointerError::BadEscape { at: 2 })
        );
        assert_eq!(
            JsonPointer::validate("/~x"),
            Err(PointerError::BadEscape { at: 1 })
        );
        assert!(JsonPointer::validate("").is_ok());
        assert!(JsonPointer::validate("/é/ü~0").is_ok());
    }

    #[test]
    #[should_panic(expected = "starts with `/`")]
    fn from_static_panics_outside_const_context() {
        let _ = JsonPointer::from_static("id");
    }

    #[test]
    fn array_indices_follow_rfc_6901() {
        assert_eq!(array_index("0"), Some(0));
        assert_eq!(array_index("17"), Some(17));
        assert_eq!(array_index("01"), None);
        assert_eq!(array_index("-"), None);
        assert_eq!(array_index("1e2"), None);
        assert_eq!(array_index(""), None);
        assert_eq!(array_index("99999999999999999999999999"), None);
    }

    proptest! {
        #[test]
        fn validation_never_panics_and_accepted_pointers_round_trip(text in "\\PC{0,40}") {
            if let Ok(p) = JsonPointer::parse(&text) {
                prop_assert_eq!(p.as_str(), text.as_str());
                // Re-escaping the tokens gives the pointer back.
                let rebuilt: String = p
                    .tokens()
                    .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
                    .collect();
                prop_assert_eq!(rebuilt, text);
            }
        }
    }
}
