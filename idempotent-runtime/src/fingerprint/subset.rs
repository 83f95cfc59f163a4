//! Fingerprint version 2: the fingerprint over what matters of a JSON body
//! ([the contract](crate::design) §4, "What the fingerprint covers").
//!
//! An endpoint that names a list of JSON Pointers (`fingerprint = ["/amount", "/currency"]`)
//! has its body segment (9) computed from the values they select, so a client timestamp or a
//! nonce elsewhere in the body does not turn an honest retry into a 422. Everything else is
//! version 1's encoding under the tag `idempotent-fingerprint/v2\n`: segments 1–8 unchanged,
//! segment 9 the SHA-256 of the *selection*, contributors replacing and appending as before.

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};

use super::{Contribution, Fingerprint, FingerprintContributor, FingerprintInput, Segment};
use crate::digest::Encoder;
use crate::key::JsonPointer;
use crate::key::json::{self, JsonError, Value};
use crate::problem::{Problem, ProblemCode};

/// The encoding version of fingerprints over a [`BodySubset`].
pub(crate) const SUBSET_VERSION: u16 = 2;

const TAG_V2: &[u8] = b"idempotent-fingerprint/v2\n";

/// The JSON Pointers a fingerprint covers of the body, instead of the whole body.
///
/// # Its canonical form
///
/// The pointers are sorted by their (escaped) text and repeats dropped, so the order they are
/// configured in does not matter. The selection is then framed with the crate's frames (the
/// table in [the module docs](crate::fingerprint)):
///
/// ```text
/// list(n)                        n distinct pointers
///   for each pointer, sorted:
///   list(2)
///     bytes(pointer text)        e.g. "/amount"
///     bytes(JCS of the value)    RFC 8785 canonical JSON of what it selects
///     | absent                   0x00 when it selects nothing
/// ```
///
/// Why a framing of each pointer and its RFC 8785 bytes, rather than one RFC 8785 document of
/// `{pointer: value}`: JSON has no value for "nothing here" (`null` is a value a client may
/// send), so a document could not tell `{"coupon": null}` from a body without `coupon`; and
/// naming the pointer beside its value keeps `/a` selecting `{"b":1}` apart from `/a/b`
/// selecting `1`. Within a value, RFC 8785 gives what is insensitive to what a client's JSON
/// library varies: member order, whitespace, string escapes (`"\u0041"` is `"A"`), number
/// forms (`1.0`, `1`, `1e0` are one number; like every JSON reader that uses doubles, RFC 8785
/// cannot tell integers apart beyond 2^53).
///
/// The body is read by the crate's own strict reader, never `serde_json`, so no cargo feature
/// of `serde_json` that another crate turns on (`arbitrary_precision`, `preserve_order`) can
/// change a fingerprint. A body that is not JSON (or not I-JSON: a repeated member name, an
/// escaped lone surrogate, a number beyond the double range) is refused, 400
/// `IDEMPOTENCY_BODY_INVALID`.
///
/// # How the pipeline calls it
///
/// After the body bounds (and the body-sourced key, which reads the same document), an
/// endpoint with a subset computes
///
/// ```text
/// compute_subset(input: &FingerprintInput, subset: &BodySubset, contributor) -> Result<Fingerprint, SubsetError>
/// ```
///
/// instead of the whole body, and answers `Err` with its problem before claiming.
/// A stored record is compared through
/// `compute_version_subset(stored.version, input, endpoint's subset, contributor)`: a
/// version 1 record (written before the endpoint had a subset, or by an older release) is
/// recomputed over the whole body as version 1 does, so that upgrade never turns retries into
/// 422s; a version 2 record is recomputed with the endpoint's current pointers. Changing the
/// pointers changes version 2 fingerprints (retries in flight see 422): deploy it like a schema
/// change, as a contributor change.
///
/// # Example
///
/// ```
/// use idempotent_runtime::fingerprint::BodySubset;
/// use idempotent_runtime::key::JsonPointer;
///
/// const PAYMENT_FIELDS: &[JsonPointer] = &[
///     JsonPointer::from_static("/amount"),
///     JsonPointer::from_static("/currency"),
/// ];
/// const PAYMENT: BodySubset = BodySubset::from_static(PAYMENT_FIELDS);
/// // `{"amount": 100, "currency": "EUR", "sent_at": "12:00:00"}` and
/// // `{"sent_at":"12:00:05","currency":"EUR","amount":1e2}` are then the same request.
/// let endpoint = idempotent_runtime::config::EndpointConfig::REQUIRED.fingerprint(PAYMENT);
/// # let _ = endpoint;
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BodySubset(Cow<'static, [JsonPointer]>);

impl BodySubset {
    /// A subset from pointers known at compile time.
    pub const fn from_static(pointers: &'static [JsonPointer]) -> Self {
        Self(Cow::Borrowed(pointers))
    }

    /// A subset from pointers read at run time. Order and repeats do not matter.
    pub fn new(pointers: impl IntoIterator<Item = JsonPointer>) -> Self {
        Self(Cow::Owned(pointers.into_iter().collect()))
    }

    /// The pointers, as configured.
    pub fn pointers(&self) -> &[JsonPointer] {
        &self.0
    }

    /// The framed canonical selection of `body` (see the module docs); its SHA-256 is
    /// segment 9 of a version 2 fingerprint.
    pub(crate) fn canonical(&self, body: &[u8]) -> Result<Vec<u8>, SubsetError> {
        let doc = json::parse(body).map_err(SubsetError)?;
        self.canonical_document(&doc)
    }

    /// [`canonical`](Self::canonical) of a body already parsed (by the body-sourced key).
    pub(crate) fn canonical_document(&self, doc: &Value<'_>) -> Result<Vec<u8>, SubsetError> {
        let mut pointers: Vec<&JsonPointer> = self.0.iter().collect();
        pointers.sort();
        pointers.dedup();
        let mut out = Vec::new();
        frame_list(&mut out, pointers.len());
        let mut value = Vec::new();
        for pointer in pointers {
            frame_list(&mut out, 2);
            frame_bytes(&mut out, pointer.as_str().as_bytes());
            match doc.select(pointer) {
                None => out.push(0x00),
                Some(selected) => {
                    value.clear();
                    json::write_canonical(selected, &mut value).map_err(SubsetError)?;
                    frame_bytes(&mut out, &value);
                }
            }
        }
        Ok(out)
    }
}

impl FromIterator<JsonPointer> for BodySubset {
    fn from_iter<I: IntoIterator<Item = JsonPointer>>(pointers: I) -> Self {
        Self::new(pointers)
    }
}

/// The file form: a list of pointers, `fingerprint = ["/amount", "/currency"]`.
#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for BodySubset {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<JsonPointer>::deserialize(deserializer).map(Self::new)
    }
}

impl fmt::Debug for BodySubset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BodySubset").field(&self.0.as_ref()).finish()
    }
}

fn frame_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(0x01);
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn frame_list(out: &mut Vec<u8>, count: usize) {
    out.push(0x02);
    out.extend_from_slice(&(count as u64).to_be_bytes());
}

/// A body that a subset fingerprint cannot cover: not JSON, or not I-JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SubsetError(JsonError);

impl SubsetError {
    /// Where and why the body could not be read.
    #[cfg(test)]
    pub(crate) fn json_error(&self) -> JsonError {
        self.0
    }

    /// The refusal: 400 `IDEMPOTENCY_BODY_INVALID`, nothing claimed.
    pub(crate) fn problem(&self) -> Problem {
        Problem::new(400, ProblemCode::BodyInvalid, self.to_string())
    }
}

impl fmt::Display for SubsetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "this endpoint compares retries by fields of a JSON body, and {}",
            self.0
        )
    }
}

impl std::error::Error for SubsetError {}

/// Computes a version 2 fingerprint: segment 9 covers what `subset` selects of the body.
pub(crate) fn compute_subset(
    input: &FingerprintInput<'_>,
    subset: &BodySubset,
    contributor: Option<&dyn FingerprintContributor>,
) -> Result<Fingerprint, SubsetError> {
    let selection = subset.canonical(input.body)?;
    Ok(encode_v2(input, &selection, contributor))
}

/// [`compute_subset`] of a body already parsed.
#[allow(dead_code)] // the pipeline's, once body-sourced keys are wired (issue 31)
pub(crate) fn compute_subset_document(
    input: &FingerprintInput<'_>,
    subset: &BodySubset,
    doc: &Value<'_>,
    contributor: Option<&dyn FingerprintContributor>,
) -> Result<Fingerprint, SubsetError> {
    let selection = subset.canonical_document(doc)?;
    Ok(encode_v2(input, &selection, contributor))
}

/// Recomputes a stored fingerprint's version for this request, on an endpoint whose current
/// setting is `subset`: version 1 over the whole body whatever the setting, version 2 over
/// `subset`. `None` when the request cannot have that fingerprint: an unknown version, or
/// version 2 on an endpoint that no longer has a subset (both are a different request).
pub(crate) fn compute_version_subset(
    version: u16,
    input: &FingerprintInput<'_>,
    subset: Option<&BodySubset>,
    contributor: Option<&dyn FingerprintContributor>,
) -> Option<Result<Fingerprint, SubsetError>> {
    match (version, subset) {
        (SUBSET_VERSION, Some(subset)) => Some(compute_subset(input, subset, contributor)),
        (SUBSET_VERSION, None) => None,
        (version, _) => super::compute_version(version, input, contributor).map(Ok),
    }
}

/// Version 2's own encoder. It repeats version 1's segments 1–8 rather than sharing a helper
/// with it on purpose: each version's bytes are frozen once records carry them, and a change
/// meant for one version must not reach the other unseen (the golden vectors of both pin this).
fn encode_v2(
    input: &FingerprintInput<'_>,
    selection: &[u8],
    contributor: Option<&dyn FingerprintContributor>,
) -> Fingerprint {
    let contribution = contributor.map(|c| {
        let mut contribution = Contribution::default();
        c.contribute(input, &mut contribution);
        contribution
    });
    let replaced = |segment| contribution.as_ref().and_then(|c| c.replacement(segment));

    let mut h = Sha256::new();
    h.update(TAG_V2);
    let mut enc = Encoder(&mut h);

    match replaced(Segment::Method) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.bytes(input.method.as_bytes()),
    }
    match replaced(Segment::Route) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.opt_bytes(input.route.map(str::as_bytes)),
    }
    match replaced(Segment::PathParams) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => {
            enc.list(input.path_params.len());
            for value in input.path_params {
                enc.bytes(value.as_bytes());
            }
        }
    }
    match replaced(Segment::Query) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => super::encode_query(&mut enc, input.query),
    }
    input.scope.encode_segments(&mut enc);
    match replaced(Segment::ContentType) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.opt_bytes(input.content_type),
    }
    match replaced(Segment::Body) {
        Some(v) => enc.opt_bytes(v.as_deref()),
        None => enc.bytes(&Sha256::digest(selection)),
    }
    if let Some(contribution) = &contribution {
        for extra in &contribution.appended {
            enc.opt_bytes(extra.as_deref());
        }
    }
    Fingerprint {
        version: SUBSET_VERSION,
        digest: h.finalize().into(),
    }
}

#[cfg(test)]
mod tests;
