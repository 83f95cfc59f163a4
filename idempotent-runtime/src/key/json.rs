//! The crate's own strict JSON reader and its RFC 8785 (JCS) writer, for the body-sourced key and
//! the subset fingerprint.
//!
//! Deliberately not `serde_json`: cargo unifies features across a build, and a service (or any
//! crate in it) turning on `serde_json/arbitrary_precision` or `preserve_order` would change what
//! `serde_json::Value` holds (numbers as written, member order), and with it a fingerprint that
//! two replicas and two releases must agree on byte for byte. This reader keeps each number's
//! text as written and each object's members in document order, and the writer derives
//! everything canonical itself.
//!
//! What it accepts is RFC 8259 JSON that is also I-JSON (RFC 7493), as RFC 8785 requires: UTF-8,
//! no repeated member name in an object, no escaped lone surrogate; nesting is bounded
//! ([`MAX_JSON_DEPTH`](crate::key::MAX_JSON_DEPTH)) so a hostile body cannot exhaust the stack.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use super::pointer::{JsonPointer, array_index};

/// The deepest nesting of arrays and objects read (as `serde_json`'s default recursion limit).
pub(crate) const MAX_JSON_DEPTH: usize = 128;

/// Objects up to this many members are checked for a repeated name without a hash set.
const SCAN_LIMIT: usize = 16;

/// A parsed JSON value, borrowing from the body where it can.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value<'a> {
    Null,
    Bool(bool),
    /// The number's text as written, checked against the RFC 8259 grammar, and its offset in
    /// the body.
    Number(&'a str, usize),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// Members in document order; names are unique.
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// Why a body is not JSON the crate can read (or, for a number, canonicalize). Never shows the
/// body's content, only where it went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct JsonError {
    offset: usize,
    reason: JsonErrorReason,
}

/// The kind of [`JsonError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum JsonErrorReason {
    /// The body is not UTF-8.
    NotUtf8,
    /// Not RFC 8259 JSON at this offset (includes an empty body and trailing content).
    Syntax,
    /// An object names the same member twice (I-JSON forbids it; two readers would disagree).
    DuplicateName,
    /// A `\uD800`–`\uDFFF` escape that is not half of a surrogate pair.
    LoneSurrogate,
    /// Arrays and objects nested deeper than [`MAX_JSON_DEPTH`](crate::key::MAX_JSON_DEPTH).
    TooDeep,
    /// A number beyond the IEEE 754 double range, which RFC 8785 cannot write (e.g. `1e400`).
    NumberOutOfRange,
}

impl JsonError {
    fn new(offset: usize, reason: JsonErrorReason) -> Self {
        Self { offset, reason }
    }

    /// The byte offset in the body where reading stopped.
    #[cfg(test)]
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// What was wrong.
    #[cfg(test)]
    pub(crate) fn reason(&self) -> JsonErrorReason {
        self.reason
    }
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.reason {
            JsonErrorReason::NotUtf8 => "is not UTF-8",
            JsonErrorReason::Syntax => "is not valid JSON",
            JsonErrorReason::DuplicateName => "repeats a member name in one object",
            JsonErrorReason::LoneSurrogate => "escapes half of a UTF-16 surrogate pair",
            JsonErrorReason::TooDeep => "nests arrays and objects more than 128 deep",
            JsonErrorReason::NumberOutOfRange => "has a number beyond the IEEE 754 double range",
        };
        write!(f, "the request body {what} (at byte {})", self.offset)
    }
}

impl std::error::Error for JsonError {}

/// Parses a whole body: one value, optional whitespace around it, nothing else.
pub(crate) fn parse(body: &[u8]) -> Result<Value<'_>, JsonError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| JsonError::new(e.valid_up_to(), JsonErrorReason::NotUtf8))?;
    let mut p = Parser { text, pos: 0 };
    p.ws();
    let value = p.value(0)?;
    p.ws();
    if p.pos != text.len() {
        return Err(p.err(JsonErrorReason::Syntax));
    }
    Ok(value)
}

impl<'a> Value<'a> {
    /// The value `pointer` selects, or `None` when it selects nothing.
    pub(crate) fn select(&self, pointer: &JsonPointer) -> Option<&Value<'a>> {
        let mut at = self;
        for token in pointer.tokens() {
            at = match at {
                Value::Object(members) => members
                    .iter()
                    .find(|(name, _)| name.as_ref() == token.as_ref())
                    .map(|(_, v)| v)?,
                Value::Array(items) => items.get(array_index(&token)?)?,
                _ => return None,
            };
        }
        Some(at)
    }
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, reason: JsonErrorReason) -> JsonError {
        JsonError::new(self.pos, reason)
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> Result<Value<'a>, JsonError> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.err(JsonErrorReason::Syntax))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => Ok(Value::String(self.string()?)),
            Some(b't') => self.literal("true", Value::Bool(true)),
            Some(b'f') => self.literal("false", Value::Bool(false)),
            Some(b'n') => self.literal("null", Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.err(JsonErrorReason::Syntax)),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_JSON_DEPTH {
            return Err(self.err(JsonErrorReason::TooDeep));
        }
        self.pos += 1;
        self.ws();
        let mut items = Vec::new();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.err(JsonErrorReason::Syntax)),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value<'a>, JsonError> {
        if depth > MAX_JSON_DEPTH {
            return Err(self.err(JsonErrorReason::TooDeep));
        }
        self.pos += 1;
        self.ws();
        let mut members: Vec<(Cow<'a, str>, Value<'a>)> = Vec::new();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        // Small objects (nearly all) are checked for a repeated name by a scan; a set is built
        // only for large ones, so that a hostile object cannot make the check quadratic.
        let mut names: Option<HashSet<Cow<'a, str>>> = None;
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(self.err(JsonErrorReason::Syntax));
            }
            let name_at = self.pos;
            let name = self.string()?;
            let repeated = match &mut names {
                Some(set) => !set.insert(name.clone()),
                None => {
                    let repeated = members.iter().any(|(n, _)| *n == name);
                    if members.len() >= SCAN_LIMIT {
                        let mut set: HashSet<Cow<'a, str>> =
                            members.iter().map(|(n, _)| n.clone()).collect();
                        set.insert(name.clone());
                        names = Some(set);
                    }
                    repeated
                }
            };
            if repeated {
                return Err(JsonError::new(name_at, JsonErrorReason::DuplicateName));
            }
            self.ws();
            if self.peek() != Some(b':') {
                return Err(self.err(JsonErrorReason::Syntax));
            }
            self.pos += 1;
            self.ws();
            let value = self.value(depth)?;
            members.push((name, value));
            self.ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Object(members));
                }
                _ => return Err(self.err(JsonErrorReason::Syntax)),
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Result<Value<'a>, JsonError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.err(JsonErrorReason::Syntax)),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.err(JsonErrorReason::Syntax));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.err(JsonErrorReason::Syntax));
            }
        }
        Ok(Value::Number(&self.text[start..self.pos], start))
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let hex = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| self.err(JsonErrorReason::Syntax))?;
        self.pos += 4;
        u32::from_str_radix(hex, 16).map_err(|_| self.err(JsonErrorReason::Syntax))
    }

    fn string(&mut self) -> Result<Cow<'a, str>, JsonError> {
        self.pos += 1; // the opening quote
        let start = self.pos;
        // Borrow while there is no escape.
        loop {
            match self.peek() {
                None => return Err(self.err(JsonErrorReason::Syntax)),
                Some(b'"') => {
                    let s = &self.text[start..self.pos];
                    self.pos += 1;
                    return Ok(Cow::Borrowed(s));
                }
                Some(b'\\') => break,
                Some(0x00..=0x1f) => return Err(self.err(JsonErrorReason::Syntax)),
                Some(_) => self.pos += 1,
            }
        }
        let mut out = String::from(&self.text[start..self.pos]);
        loop {
            match self.peek() {
                None | Some(0x00..=0x1f) => return Err(self.err(JsonErrorReason::Syntax)),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    let at = self.pos;
                    self.pos += 1;
                    let escaped = self
                        .peek()
                        .ok_or_else(|| self.err(JsonErrorReason::Syntax))?;
                    self.pos += 1;
                    match escaped {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let unit = self.hex4()?;
                            let c = match unit {
                                0xd800..=0xdbff => {
                                    if !self.text[self.pos..].starts_with("\\u") {
                                        return Err(JsonError::new(
                                            at,
                                            JsonErrorReason::LoneSurrogate,
                                        ));
                                    }
                                    self.pos += 2;
                                    let low = self.hex4()?;
                                    if !(0xdc00..=0xdfff).contains(&low) {
                                        return Err(JsonError::new(
                                            at,
                                            JsonErrorReason::LoneSurrogate,
                                        ));
                                    }
                                    0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00)
                                }
                                0xdc00..=0xdfff => {
                                    return Err(JsonError::new(at, JsonErrorReason::LoneSurrogate));
                                }
                                _ => unit,
                            };
                            out.push(
                                char::from_u32(c)
                                    .ok_or_else(|| JsonError::new(at, JsonErrorReason::Syntax))?,
                            );
                        }
                        _ => return Err(JsonError::new(at, JsonErrorReason::Syntax)),
                    }
                }
                Some(_) => {
                    // A whole UTF-8 character: the text is a `str`, so `pos` is on a boundary.
                    let c = self.text[self.pos..]
                        .chars()
                        .next()
                        .ok_or_else(|| self.err(JsonErrorReason::Syntax))?;
                    out.push(c);
                    self.pos += c.len_utf8();
                }
            }
        }
    }
}

/// Writes `value` in the RFC 8785 canonical form: no whitespace, object members sorted by their
/// names' UTF-16 code units, strings with the minimal escapes, numbers as ECMAScript writes the
/// IEEE 754 double they denote.
pub(crate) fn write_canonical(value: &Value<'_>, out: &mut Vec<u8>) -> Result<(), JsonError> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(text, at) => {
            write_number(text, out).map_err(|e| JsonError::new(*at, e.reason))?
        }
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<&(Cow<'_, str>, Value<'_>)> = members.iter().collect();
            sorted.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push(b'{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(name, out);
                out.push(b':');
                write_canonical(item, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// ECMAScript's `Number.prototype.toString` (ECMA-262 §6.1.6.1.20) of the double `text` denotes.
///
/// ECMAScript wants the fewest digits that read back as the double and, among those, the ones
/// closest to its exact value, the even one on a tie. Rust's `{:e}` gives the fewest digits but
/// breaks such a tie upwards (`1424953923781206.25` is written `…206.3`, ECMAScript writes
/// `…206.2`); its exact mode (`{:.N e}`) rounds the exact value half-to-even. So: the shortest
/// length from the first, the digits from the second when they still read back as the double
/// (near a power of two they may not, and then the shortest digits are the only ones).
fn write_number(text: &str, out: &mut Vec<u8>) -> Result<(), JsonError> {
    // An integer of at most 15 digits is a double exactly, and ECMAScript writes it as it is
    // (the grammar has no leading zeros), except `-0`.
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.len() <= 15 && digits.bytes().all(|b| b.is_ascii_digit()) {
        out.extend_from_slice(if digits == "0" { b"0" } else { text.as_bytes() });
        return Ok(());
    }
    // The grammar was checked when reading, and Rust's float parsing is correctly rounded.
    let x: f64 = text
        .parse()
        .map_err(|_| JsonError::new(0, JsonErrorReason::Syntax))?;
    if !x.is_finite() {
        return Err(JsonError::new(0, JsonErrorReason::NumberOutOfRange));
    }
    if x == 0.0 {
        out.push(b'0'); // -0 too
        return Ok(());
    }
    if x < 0.0 {
        out.push(b'-');
    }
    let shortest = format!("{:e}", x.abs());
    let len = shortest
        .split_once('e')
        .map_or(1, |(m, _)| m.len() - usize::from(m.contains('.')));
    let nearest = format!("{:.*e}", len - 1, x.abs());
    let sci = if nearest.parse::<f64>() == Ok(x.abs()) {
        nearest
    } else {
        shortest
    };
    let (mantissa, exp) = sci
        .split_once('e')
        .ok_or_else(|| JsonError::new(0, JsonErrorReason::Syntax))?;
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let exp: i32 = exp
        .parse()
        .map_err(|_| JsonError::new(0, JsonErrorReason::Syntax))?;
    let k = digits.len() as i32;
    let n = exp + 1; // x = 0.digits × 10^n
    let s = if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let sign = if n - 1 < 0 { '-' } else { '+' };
        let e = (n - 1).abs();
        if k == 1 {
            format!("{digits}e{sign}{e}")
        } else {
            format!("{}.{}e{sign}{e}", &digits[..1], &digits[1..])
        }
    };
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(body: &str) -> Result<String, JsonError> {
        let v = parse(body.as_bytes())?;
        let mut out = Vec::new();
        write_canonical(&v, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn rfc_8785_section_3_2_2_example() {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        assert_eq!(
            canonical(input).unwrap(),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    #[test]
    fn rfc_8785_section_3_2_3_sorts_by_utf16_code_units() {
        // U+1F600 is a surrogate pair (0xD83D …): it sorts before U+FB33 in UTF-16 although its
        // code point is larger.
        let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
        assert_eq!(
            canonical(input).unwrap(),
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
    }

    /// RFC 8785 Appendix B, each expectation also printed by node's `JSON.stringify` of the
    /// double with these IEEE 754 bits.
    #[test]
    fn rfc_8785_appendix_b_numbers() {
        let cases: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for &(bits, expected) in cases {
            // `{:e}` of the double is a JSON number that denotes exactly that double.
            let text = format!("{:e}", f64::from_bits(bits));
            let mut out = Vec::new();
            write_number(&text, &mut out).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{bits:016x}");
        }
    }

    #[test]
    fn number_forms_of_one_double_are_one_canonical_number() {
        for (a, b) in [
            ("1", "1.0"),
            ("100", "1e2"),
            ("100", "1E+2"),
            ("0.5", "5e-1"),
            ("0", "-0"),
        ] {
            assert_eq!(canonical(a).unwrap(), canonical(b).unwrap(), "{a} vs {b}");
        }
        // Beyond 2^53 integers are doubles too, as RFC 8785 says (I-JSON's interoperable range).
        assert_eq!(
            canonical("12345678901234567890").unwrap(),
            "12345678901234567000"
        );
        assert_eq!(
            canonical("1e400").unwrap_err().reason(),
            JsonErrorReason::NumberOutOfRange
        );
        assert_eq!(canonical("1e-400").unwrap(), "0");
    }

    #[test]
    fn what_is_not_i_json_is_refused_with_where() {
        let reason = |s: &str| canonical(s).unwrap_err().reason();
        assert_eq!(reason(r#"{"a":1,"a":2}"#), JsonErrorReason::DuplicateName);
        assert_eq!(
            reason(r#"{"a":1,"\u0061":2}"#),
            JsonErrorReason::DuplicateName
        );
        assert_eq!(reason(r#""\ud800""#), JsonErrorReason::LoneSurrogate);
        assert_eq!(reason(r#""\udc00\ud800""#), JsonErrorReason::LoneSurrogate);
        assert_eq!(reason(r#""\ud800\u0041""#), JsonErrorReason::LoneSurrogate);
        for bad in [
            "",
            " ",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "01",
            "1.",
            ".5",
            "+1",
            "1e",
            "-",
            "tru",
            "nul",
            "\"a",
            "\"\t\"",
            "'a'",
            "[1] 2",
            "\u{feff}1",
            "NaN",
            "{a:1}",
            "\"\\x\"",
        ] {
            assert_eq!(reason(bad), JsonErrorReason::Syntax, "{bad:?}");
        }
        assert_eq!(
            parse(b"\"\xff\"").unwrap_err().reason(),
            JsonErrorReason::NotUtf8
        );
        let deep = format!(
            "{}{}",
            "[".repeat(MAX_JSON_DEPTH + 1),
            "]".repeat(MAX_JSON_DEPTH + 1)
        );
        assert_eq!(reason(&deep), JsonErrorReason::TooDeep);
        let ok = format!(
            "{}{}",
            "[".repeat(MAX_JSON_DEPTH),
            "]".repeat(MAX_JSON_DEPTH)
        );
        assert!(canonical(&ok).is_ok());
        assert_eq!(canonical(r#"{"a":1,"a ":2}"#).unwrap(), r#"{"a":1,"a ":2}"#);
    }

    #[test]
    fn repeated_names_are_found_in_small_and_large_objects() {
        for size in [1, SCAN_LIMIT - 1, SCAN_LIMIT, SCAN_LIMIT + 1, 200] {
            let members: Vec<String> = (0..size).map(|i| format!("\"k{i}\":{i}")).collect();
            let ok = format!("{{{}}}", members.join(","));
            assert!(canonical(&ok).is_ok(), "{size}");
            for again in [0, size - 1] {
                let dup = format!("{{{},\"k{again}\":0}}", members.join(","));
                assert_eq!(
                    canonical(&dup).unwrap_err().reason(),
                    JsonErrorReason::DuplicateName,
                    "{size} {again}"
                );
            }
        }
    }

    #[test]
    fn strings_keep_what_needs_no_escape() {
        assert_eq!(
            canonical(r#""\u007f\u2028 \/ \u001f""#).unwrap(),
            "\"\u{7f}\u{2028} / \\u001f\""
        );
    }

    #[test]
    fn pointers_select_members_and_elements() {
        let doc = parse(br#"{"a":{"b/c":[10,{"~":true}]},"":1}"#).unwrap();
        let at = |p: &str| doc.select(&JsonPointer::parse(p).unwrap()).cloned();
        assert_eq!(at("/a/b~1c/0"), Some(Value::Number("10", 13)));
        assert_eq!(at("/a/b~1c/1/~0"), Some(Value::Bool(true)));
        assert_eq!(at("/"), Some(Value::Number("1", 32)));
        assert_eq!(at(""), Some(doc.clone()));
        assert_eq!(at("/a/b~1c/2"), None);
        assert_eq!(at("/a/b~1c/-"), None);
        assert_eq!(at("/a/b~1c/00"), None);
        assert_eq!(at("/a/b~1c/0/x"), None);
        assert_eq!(at("/missing"), None);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(v) = parse(&body) {
                let mut out = Vec::new();
                let _ = write_canonical(&v, &mut out);
            }
        }

        #[test]
        fn json_like_text_never_panics(body in "[\\[\\]{}\",:0-9eE.+\\-\\\\u tfrnal]{0,80}") {
            if let Ok(v) = parse(body.as_bytes()) {
                let mut out = Vec::new();
                let _ = write_canonical(&v, &mut out);
            }
        }

        #[test]
        fn plain_integers_take_the_short_way_to_the_same_answer(i in any::<i64>()) {
            let text = (i % 1_000_000_000_000_000).to_string();
            let mut short = Vec::new();
            write_number(&text, &mut short).unwrap();
            let mut long = Vec::new();
            write_number(&format!("{text}.0"), &mut long).unwrap();
            prop_assert_eq!(short, long);
        }

        #[test]
        fn canonical_form_is_a_fixed_point(x in any::<f64>().prop_filter("finite", |x| x.is_finite())) {
            // The canonical number parses back to the same double and canonicalises to itself.
            let text = format!("{x:e}");
            let mut once = Vec::new();
            write_number(&text, &mut once).unwrap();
            let once = String::from_utf8(once).unwrap();
            let back: f64 = once.parse().unwrap();
            prop_assert!(back == x || (back == 0.0 && x == 0.0));
            let mut twice = Vec::new();
            write_number(&once, &mut twice).unwrap();
            prop_assert_eq!(once, String::from_utf8(twice).unwrap());
        }
    }
}
