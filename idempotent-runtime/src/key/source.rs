//! Where an endpoint's key comes from: a request header, or a JSON Pointer into a JSON body
//! ([the contract](crate::design) §4, "Where the key comes from").

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use super::json::{self, JsonError, Value};
use super::pointer::{JsonPointer, PointerError, validate_bytes};
use super::{IdempotencyKey, KeyError, MAX_KEY_LEN};
use crate::problem::{Problem, ProblemCode};

/// Where an endpoint reads its idempotency key.
///
/// Written form (the file form, [`FromStr`] and [`Display`](fmt::Display)): a header name
/// (`webhook-id`, or `header:webhook-id`), or `body:` followed by a JSON Pointer (`body:/id`).
/// A header name cannot contain `:`, so the two never collide. The attribute spells the same
/// `key = header("webhook-id")` / `key = body("/id")` and lowers to
/// [`header_static`](Self::header_static) / [`body_static`](Self::body_static) in a `const`
/// item, so a malformed value is a compile error.
///
/// # How the pipeline calls it
///
/// With a header source the pipeline reads the key where it does today, first of all checks
/// (the header parser on the values of
/// [`KeySource::header_name`]). With a body source it cannot: the key is known only once the
/// body has been read within its bounds (`max_body`, `body_timeout`), so the order of checks
/// becomes body → key syntax → key presence → scope → claim. After the body step it calls
///
/// ```text
/// key_from_body(pointer: &JsonPointer, body: &[u8]) -> Result<Option<IdempotencyKey>, BodyKeyError>
/// ```
///
/// and answers `Ok(None)` as a missing key (400/428 `IDEMPOTENCY_KEY_REQUIRED` on `require_key`,
/// untouched otherwise) and `Err(e)` with its problem (400
/// `IDEMPOTENCY_KEY_INVALID`).
///
/// # Example
///
/// ```
/// use idempotent_runtime::key::KeySource;
///
/// const STRIPE: KeySource = KeySource::body_static("/id");
/// const STANDARD: KeySource = KeySource::header_static("webhook-id");
/// assert_eq!("body:/id".parse::<KeySource>().unwrap(), STRIPE);
/// assert_eq!("Webhook-Id".parse::<KeySource>().unwrap(), STANDARD);
/// assert_eq!(STRIPE.to_string(), "body:/id");
/// assert_eq!(KeySource::default().header_name(), Some("idempotency-key"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeySource(Source);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Source {
    /// Lowercase token.
    Header(Cow<'static, str>),
    Body(JsonPointer),
}

/// Why a written key source is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySourceError {
    /// An empty header name.
    EmptyHeaderName,
    /// A byte that is not an RFC 9110 token character, at this offset of the name.
    InvalidHeaderName {
        /// Byte offset in the header name.
        at: usize,
    },
    /// An uppercase letter in a name given to [`KeySource::header_static`] (HTTP/2 and HTTP/3
    /// carry names in lowercase; [`KeySource::header`] lowercases for you).
    UppercaseHeaderName {
        /// Byte offset in the header name.
        at: usize,
    },
    /// The pointer after `body:` is malformed.
    Pointer(PointerError),
}

impl fmt::Display for KeySourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmptyHeaderName => f.write_str("the key's header name is empty"),
            Self::InvalidHeaderName { at } => write!(
                f,
                "the key's header name has a character that is not allowed in a header name at byte {at}; for a key in the body write `body:/pointer`"
            ),
            Self::UppercaseHeaderName { at } => write!(
                f,
                "write the key's header name in lowercase (uppercase letter at byte {at})"
            ),
            Self::Pointer(e) => write!(f, "the key's JSON Pointer is malformed: {e}"),
        }
    }
}

impl std::error::Error for KeySourceError {}

const fn is_tchar(b: u8) -> bool {
    matches!(b,
        b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*' | b'+' | b'-' | b'.' | b'^' | b'_'
        | b'`' | b'|' | b'~' | b'0'..=b'9' | b'a'..=b'z' | b'A'..=b'Z')
}

const fn validate_header(
    bytes: &[u8],
    start: usize,
    lowercase: bool,
) -> Result<(), KeySourceError> {
    if bytes.len() == start {
        return Err(KeySourceError::EmptyHeaderName);
    }
    let mut i = start;
    while i < bytes.len() {
        if !is_tchar(bytes[i]) {
            return Err(KeySourceError::InvalidHeaderName { at: i - start });
        }
        if lowercase && bytes[i].is_ascii_uppercase() {
            return Err(KeySourceError::UppercaseHeaderName { at: i - start });
        }
        i += 1;
    }
    Ok(())
}

const fn starts_with(bytes: &[u8], prefix: &[u8]) -> bool {
    if bytes.len() < prefix.len() {
        return false;
    }
    let mut i = 0;
    while i < prefix.len() {
        if bytes[i] != prefix[i] {
            return false;
        }
        i += 1;
    }
    true
}

const BODY_PREFIX: &[u8] = b"body:";
const HEADER_PREFIX: &[u8] = b"header:";

impl KeySource {
    /// The default: the `Idempotency-Key` header.
    pub const IDEMPOTENCY_KEY: KeySource =
        KeySource(Source::Header(Cow::Borrowed(super::HEADER_NAME)));

    /// A header, from a lowercase literal (`webhook-id`, `x-github-delivery`); in a `const` item
    /// anything else fails to compile.
    pub const fn header_static(name: &'static str) -> Self {
        match validate_header(name.as_bytes(), 0, true) {
            Ok(()) => Self(Source::Header(Cow::Borrowed(name))),
            Err(KeySourceError::UppercaseHeaderName { .. }) => {
                panic!("write the key's header name in lowercase")
            }
            Err(_) => panic!("the key's header name must be a non-empty HTTP token"),
        }
    }

    /// A JSON Pointer into the body, from a literal; in a `const` item a malformed pointer fails
    /// to compile.
    pub const fn body_static(pointer: &'static str) -> Self {
        Self(Source::Body(JsonPointer::from_static(pointer)))
    }

    /// A header, from a name read at run time (trimmed, lowercased).
    pub fn header(name: &str) -> Result<Self, KeySourceError> {
        let name = name.trim().to_ascii_lowercase();
        validate_header(name.as_bytes(), 0, true)?;
        Ok(Self(Source::Header(Cow::Owned(name))))
    }

    /// A JSON Pointer into the body.
    pub fn body(pointer: JsonPointer) -> Self {
        Self(Source::Body(pointer))
    }

    /// Checks the written form (see the type's docs), in const context.
    ///
    /// ```
    /// use idempotent_runtime::key::{KeySource, KeySourceError, PointerError};
    ///
    /// const _: () = assert!(KeySource::validate("body:/data/id").is_ok());
    /// assert_eq!(
    ///     KeySource::validate("body:id"),
    ///     Err(KeySourceError::Pointer(PointerError::MissingLeadingSlash))
    /// );
    /// ```
    pub const fn validate(text: &str) -> Result<(), KeySourceError> {
        let bytes = text.as_bytes();
        if starts_with(bytes, BODY_PREFIX) {
            return match validate_bytes(bytes, BODY_PREFIX.len()) {
                Ok(()) => Ok(()),
                Err(e) => Err(KeySourceError::Pointer(e)),
            };
        }
        let start = if starts_with(bytes, HEADER_PREFIX) {
            HEADER_PREFIX.len()
        } else {
            0
        };
        validate_header(bytes, start, false)
    }

    /// The header's lowercase name, for a header source.
    pub fn header_name(&self) -> Option<&str> {
        match &self.0 {
            Source::Header(name) => Some(name),
            Source::Body(_) => None,
        }
    }

    /// The pointer, for a body source.
    pub fn body_pointer(&self) -> Option<&JsonPointer> {
        match &self.0 {
            Source::Body(pointer) => Some(pointer),
            Source::Header(_) => None,
        }
    }

    /// Whether the key is known only after the body has been read.
    pub fn reads_body(&self) -> bool {
        matches!(self.0, Source::Body(_))
    }
}

impl Default for KeySource {
    fn default() -> Self {
        Self::IDEMPOTENCY_KEY
    }
}

impl FromStr for KeySource {
    type Err = KeySourceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if let Some(pointer) = text.strip_prefix("body:") {
            return JsonPointer::parse(pointer)
                .map(Self::body)
                .map_err(KeySourceError::Pointer);
        }
        let name = text
            .strip_prefix("header:")
            .unwrap_or(text)
            .to_ascii_lowercase();
        validate_header(name.as_bytes(), 0, true)?;
        Ok(Self(Source::Header(Cow::Owned(name))))
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Header(name) => f.write_str(name),
            Source::Body(pointer) => write!(f, "body:{pointer}"),
        }
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeySource({self})")
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for KeySource {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// What a body-sourced key's pointer found instead of a string or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum JsonKind {
    /// `null`
    Null,
    /// `true` or `false`
    Boolean,
    /// `[…]`
    Array,
    /// `{…}`
    Object,
}

impl fmt::Display for JsonKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Null => "null",
            Self::Boolean => "a boolean",
            Self::Array => "an array",
            Self::Object => "an object",
        })
    }
}

/// Why a body-sourced key was refused. Every variant answers 400 `IDEMPOTENCY_KEY_INVALID`
/// ([`problem`](Self::problem)); none shows the key or the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum BodyKeyError {
    /// The body is not JSON (or not I-JSON: a repeated member name, an escaped lone
    /// surrogate), so it carries no key the server can trust.
    NotJson(JsonError),
    /// The pointer found something other than a string or a number.
    NotAScalar(JsonKind),
    /// The string or number found breaks the key syntax (1–255 visible ASCII).
    Syntax(KeyError),
}

impl BodyKeyError {
    /// The refusal: 400 `IDEMPOTENCY_KEY_INVALID` with this error as its `detail`.
    pub(crate) fn problem(&self) -> Problem {
        Problem::new(400, ProblemCode::KeyInvalid, self.to_string())
    }
}

impl fmt::Display for BodyKeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotJson(e) => {
                write!(f, "this endpoint reads its idempotency key from a JSON body, and {e}")
            }
            Self::NotAScalar(kind) => write!(
                f,
                "the idempotency key in the body is {kind}; it must be a string or a number"
            ),
            Self::Syntax(KeyError::Empty) => f.write_str("the idempotency key in the body is empty"),
            Self::Syntax(KeyError::TooLong { len }) => write!(
                f,
                "the idempotency key in the body is {len} characters long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::Syntax(_) => f.write_str(
                "the idempotency key in the body may contain only visible ASCII characters (0x21-0x7E)",
            ),
        }
    }
}

impl std::error::Error for BodyKeyError {}

/// Reads the key `pointer` selects in a JSON `body`.
///
/// A string is the key after JSON unescaping; a number is the key as its JSON text was written
/// (`1e2` and `100` are two keys: providers send ids as strings, and a number is never
/// reformatted behind the client's back). Either must then pass the header's syntax rules.
/// Nothing selected is `Ok(None)`, the missing answer; an object, array, boolean or `null`, or a
/// body that is not JSON, is the invalid answer.
///
/// ```ignore
/// use idempotent_runtime::key::{key_from_body, BodyKeyError, JsonKind, JsonPointer};
///
/// const ID: JsonPointer = JsonPointer::from_static("/id");
/// let key = key_from_body(&ID, br#"{"id": "evt_1NG8Du2eZvKYlo2CUI79vXWy"}"#).unwrap().unwrap();
/// assert_eq!(key.as_str(), "evt_1NG8Du2eZvKYlo2CUI79vXWy");
/// assert_eq!(key_from_body(&ID, br#"{"id": 42}"#).unwrap().unwrap().as_str(), "42");
/// assert_eq!(key_from_body(&ID, br#"{"type": "charge"}"#), Ok(None));
/// assert_eq!(key_from_body(&ID, br#"{"id": {}}"#), Err(BodyKeyError::NotAScalar(JsonKind::Object)));
/// ```
pub(crate) fn key_from_body(
    pointer: &JsonPointer,
    body: &[u8],
) -> Result<Option<IdempotencyKey>, BodyKeyError> {
    let doc = json::parse(body).map_err(BodyKeyError::NotJson)?;
    key_from_document(pointer, &doc)
}

/// [`key_from_body`] on a body already parsed (for the subset fingerprint, which reads the same
/// document).
pub(crate) fn key_from_document(
    pointer: &JsonPointer,
    doc: &Value<'_>,
) -> Result<Option<IdempotencyKey>, BodyKeyError> {
    let text: &str = match doc.select(pointer) {
        None => return Ok(None),
        Some(Value::String(s)) => s,
        Some(Value::Number(n, _)) => n,
        Some(Value::Null) => return Err(BodyKeyError::NotAScalar(JsonKind::Null)),
        Some(Value::Bool(_)) => return Err(BodyKeyError::NotAScalar(JsonKind::Boolean)),
        Some(Value::Array(_)) => return Err(BodyKeyError::NotAScalar(JsonKind::Array)),
        Some(Value::Object(_)) => return Err(BodyKeyError::NotAScalar(JsonKind::Object)),
    };
    IdempotencyKey::new(text)
        .map(Some)
        .map_err(BodyKeyError::Syntax)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::json::JsonErrorReason;
    use proptest::prelude::*;

    const ID: JsonPointer = JsonPointer::from_static("/id");

    fn key(pointer: &str, body: &str) -> Result<Option<String>, BodyKeyError> {
        key_from_body(&JsonPointer::parse(pointer).unwrap(), body.as_bytes())
            .map(|k| k.map(|k| k.as_str().to_owned()))
    }

    #[test]
    fn strings_are_unescaped_and_numbers_keep_their_text() {
        assert_eq!(
            key("/id", r#"{"id":"a\u0041\/b"}"#),
            Ok(Some("aA/b".into()))
        );
        assert_eq!(key("/id", r#"{"id":1e2}"#), Ok(Some("1e2".into())));
        assert_eq!(key("/id", r#"{"id":-0.50}"#), Ok(Some("-0.50".into())));
        assert_eq!(
            key("/data/0/id", r#"{"data":[{"id":"x"}]}"#),
            Ok(Some("x".into()))
        );
        assert_eq!(key("/a~1b", r#"{"a/b":"slash"}"#), Ok(Some("slash".into())));
        assert_eq!(key("", r#""whole""#), Ok(Some("whole".into())));
    }

    #[test]
    fn nothing_selected_is_the_missing_answer() {
        assert_eq!(key("/id", r#"{"ID":"x"}"#), Ok(None));
        assert_eq!(key("/id/x", r#"{"id":"x"}"#), Ok(None));
        assert_eq!(key("/0", r#"[]"#), Ok(None));
        assert_eq!(key("/-", r#"["x"]"#), Ok(None));
        assert_eq!(key("/id", r#"[]"#), Ok(None));
    }

    #[test]
    fn other_values_and_non_json_bodies_are_the_invalid_answer() {
        assert_eq!(
            key("/id", r#"{"id":null}"#),
            Err(BodyKeyError::NotAScalar(JsonKind::Null))
        );
        assert_eq!(
            key("/id", r#"{"id":true}"#),
            Err(BodyKeyError::NotAScalar(JsonKind::Boolean))
        );
        assert_eq!(
            key("/id", r#"{"id":[1]}"#),
            Err(BodyKeyError::NotAScalar(JsonKind::Array))
        );
        assert_eq!(
            key("/id", r#"{"id":{}}"#),
            Err(BodyKeyError::NotAScalar(JsonKind::Object))
        );
        let not_json = |body: &[u8]| match key_from_body(&ID, body) {
            Err(BodyKeyError::NotJson(e)) => e.reason(),
            other => panic!("{other:?}"),
        };
        assert_eq!(not_json(b"id=1"), JsonErrorReason::Syntax);
        assert_eq!(not_json(b""), JsonErrorReason::Syntax);
        assert_eq!(not_json(b"{\"id\":\"\xff\"}"), JsonErrorReason::NotUtf8);
        // Two readers could pick either `id`: never guess which one the sender meant.
        assert_eq!(
            not_json(br#"{"id":"a","id":"b"}"#),
            JsonErrorReason::DuplicateName
        );
        let problem = key("/id", r#"{"id":{}}"#).unwrap_err().problem();
        assert_eq!(
            (problem.status(), problem.code()),
            (400, ProblemCode::KeyInvalid)
        );
    }

    #[test]
    fn the_header_syntax_rules_apply_after_extraction() {
        assert_eq!(
            key("/id", r#"{"id":""}"#),
            Err(BodyKeyError::Syntax(KeyError::Empty))
        );
        assert_eq!(
            key("/id", r#"{"id":"a b"}"#),
            Err(BodyKeyError::Syntax(KeyError::InvalidCharacter))
        );
        assert_eq!(
            key("/id", r#"{"id":"é"}"#),
            Err(BodyKeyError::Syntax(KeyError::InvalidCharacter))
        );
        let long = format!(r#"{{"id":"{}"}}"#, "k".repeat(256));
        assert_eq!(
            key("/id", &long),
            Err(BodyKeyError::Syntax(KeyError::TooLong { len: 256 }))
        );
        let ok = format!(r#"{{"id":"{}"}}"#, "k".repeat(255));
        assert_eq!(key("/id", &ok).unwrap().unwrap().len(), 255);
        // Commas are fine here: there is no header line to fold.
        assert_eq!(key("/id", r#"{"id":"a,b"}"#), Ok(Some("a,b".into())));
    }

    #[test]
    fn errors_never_show_the_key_or_the_body() {
        let secret = format!(r#"{{"id":"{}"}}"#, "secretsecret".repeat(30));
        let e = key("/id", &secret).unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
        let e = key("/id", r#"{"id": secret-bare}"#).unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
    }

    #[test]
    fn written_forms_parse_validate_and_display_alike() {
        for (text, display) in [
            ("body:/id", "body:/id"),
            ("body:", "body:"),
            ("header:Webhook-Id", "webhook-id"),
            ("X-GitHub-Delivery", "x-github-delivery"),
            (" idempotency-key ", "idempotency-key"),
        ] {
            assert!(KeySource::validate(text.trim()).is_ok(), "{text}");
            assert_eq!(text.parse::<KeySource>().unwrap().to_string(), display);
        }
        for (text, err) in [
            (
                "body:id",
                KeySourceError::Pointer(PointerError::MissingLeadingSlash),
            ),
            (
                "body:/~",
                KeySourceError::Pointer(PointerError::BadEscape { at: 1 }),
            ),
            ("", KeySourceError::EmptyHeaderName),
            ("header:", KeySourceError::EmptyHeaderName),
            ("webhook id", KeySourceError::InvalidHeaderName { at: 7 }),
            ("json:/id", KeySourceError::InvalidHeaderName { at: 4 }),
        ] {
            assert_eq!(KeySource::validate(text), Err(err), "{text}");
            assert_eq!(text.parse::<KeySource>(), Err(err), "{text}");
        }
        assert!(KeySource::body_static("/id").reads_body());
        assert_eq!(KeySource::body_static("/id").body_pointer(), Some(&ID));
        assert!(!KeySource::default().reads_body());
    }

    #[cfg(feature = "serde")]
    #[test]
    fn the_file_form_deserializes_through_the_written_form() {
        let source: KeySource = serde_json::from_str(r#""body:/data/id""#).unwrap();
        assert_eq!(source, KeySource::body_static("/data/id"));
        let source: KeySource = serde_json::from_str(r#""X-GitHub-Delivery""#).unwrap();
        assert_eq!(source.header_name(), Some("x-github-delivery"));
        let err = serde_json::from_str::<KeySource>(r#""body:id""#).unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
    }

    #[test]
    #[should_panic(expected = "lowercase")]
    fn header_static_refuses_uppercase() {
        let _ = KeySource::header_static("Webhook-Id");
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_and_pointers_never_panic(
            body in proptest::collection::vec(any::<u8>(), 0..200),
            pointer in "(/[a-z0-9~01]{0,3}){0,3}",
        ) {
            if let Ok(pointer) = JsonPointer::parse(&pointer)
                && let Ok(Some(k)) = key_from_body(&pointer, &body)
            {
                let k = k.as_str().as_bytes();
                prop_assert!(!k.is_empty() && k.len() <= MAX_KEY_LEN);
                prop_assert!(k.iter().all(|b| (0x21..=0x7e).contains(b)));
            }
        }

        #[test]
        fn any_valid_key_round_trips_through_a_json_string(k in "[!-~]{1,255}") {
            let body = serde_json::json!({"event": {"id": k}}).to_string();
            let found = key_from_body(&JsonPointer::parse("/event/id").unwrap(), body.as_bytes());
            let found = found.unwrap().unwrap();
            prop_assert_eq!(found.as_str(), k.as_str());
        }

        #[test]
        fn const_validation_agrees_with_parsing(text in "(body:|header:)?[!-~ ]{0,12}") {
            // Parsing trims the whole text, validation does not.
            prop_assume!(text.trim() == text);
            prop_assert_eq!(KeySource::validate(&text).is_ok(), text.parse::<KeySource>().is_ok());
        }
    }
}
