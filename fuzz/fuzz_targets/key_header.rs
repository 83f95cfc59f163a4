//! The `Idempotency-Key` parser (DESIGN.md §2 "Key syntax") on arbitrary header values: it
//! never panics, and whatever it accepts is 1–255 visible ASCII characters that round-trip
//! through both the bare and the quoted form.
#![no_main]

use idempotent_runtime::key::{IdempotencyKey, KeyError};
use idempotent_runtime::test_helpers::key::{MAX_KEY_LEN, parse_header_values, parse_value};
use libfuzzer_sys::fuzz_target;

fn quote(key: &str) -> Vec<u8> {
    let mut q = vec![b'"'];
    for b in key.bytes() {
        if b == b'"' || b == b'\\' {
            q.push(b'\\');
        }
        q.push(b);
    }
    q.push(b'"');
    q
}

fuzz_target!(|values: Vec<Vec<u8>>| {
    for raw in &values {
        // What must be accepted: any 1–255 visible ASCII characters as a Structured-Field
        // string (a parser that refuses everything fails here), and the same as a bare token
        // when it is one (no quote, comma, semicolon or space to misread).
        let visible: String = raw
            .iter()
            .filter(|b| (0x21..=0x7e).contains(*b))
            .take(MAX_KEY_LEN)
            .map(|&b| b as char)
            .collect();
        if !visible.is_empty() {
            let key = IdempotencyKey::new(&visible)
                .unwrap_or_else(|e| panic!("{visible:?} is a valid key: {e:?}"));
            assert_eq!(
                parse_value(&quote(&visible)),
                Ok(key.clone()),
                "refused a quoted valid key"
            );
            let token: String = visible
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || "-_.:".contains(*c))
                .collect();
            if !token.is_empty() {
                assert_eq!(
                    parse_value(token.as_bytes()).map(|k| k.as_str().to_owned()),
                    Ok(token.clone()),
                    "refused a bare token"
                );
            }
        }
        let parsed = parse_value(raw);
        // Surrounding optional whitespace never changes the answer.
        let mut padded = b" \t".to_vec();
        padded.extend_from_slice(raw);
        padded.extend_from_slice(b"\t ");
        assert_eq!(parse_value(&padded), parsed, "OWS changed the answer");
        match parsed {
            Ok(key) => {
                let s = key.as_str();
                assert!(
                    (1..=MAX_KEY_LEN).contains(&s.len()),
                    "accepted {} bytes",
                    s.len()
                );
                assert!(
                    s.bytes().all(|b| (0x21..=0x7e).contains(&b)),
                    "accepted a non-visible byte"
                );
                assert_eq!(IdempotencyKey::new(s), Ok(key.clone()));
                // `"abc"` and `abc` are the same key.
                assert_eq!(
                    parse_value(&quote(s)),
                    Ok(key.clone()),
                    "quoted form differs"
                );
                if !s.starts_with('"') && !s.contains(',') {
                    assert_eq!(
                        parse_value(s.as_bytes()),
                        Ok(key.clone()),
                        "bare form differs"
                    );
                }
                // The key is never shown by Debug: only its length is. (A substring check would
                // flag keys such as `byte` that happen to occur in the fixed text.)
                assert_eq!(
                    format!("{key:?}"),
                    format!("IdempotencyKey(<{} bytes>)", s.len()),
                    "Debug shows more than the key's length"
                );
            }
            Err(KeyError::TooLong { len }) => assert!(len > MAX_KEY_LEN),
            Err(_) => {}
        }
    }
    let all = parse_header_values(values.iter().map(Vec::as_slice));
    match values.len() {
        0 => assert_eq!(all, Ok(None)),
        1 => assert_eq!(all, parse_value(&values[0]).map(Some)),
        _ => assert_eq!(
            all,
            Err(KeyError::Multiple),
            "a header twice must be refused"
        ),
    }
});
