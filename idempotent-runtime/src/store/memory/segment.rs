//! Where the memory store keeps completed answers: append-only segments, one queue of them per
//! retention, so that each queue is in expiry order (the Segcache design, Yang et al., NSDI '21).
//!
//! A completed record is one run of bytes in a segment: a fixed header (its token, fingerprint
//! digest, owner, completion time, status and the 32 bits of its hash its index slot keeps), six
//! variable-length integers (its fingerprint's version, how long before its completion it was
//! claimed, and the lengths of what follows), then its key, encoded headers, body and encoded
//! trailers. What many records share is not in the record: its scope, quota bucket and route are
//! its shard's owner entry, named by a 4-byte id; its expiry is its completion time and its
//! segment's retention; its completion time is a 32-bit offset from its segment's first. Nothing is allocated or freed per record: segments are
//! [`SEGMENT_BYTES`] long, allocated once and reused; an answer larger than a segment gets a
//! segment of its own, counted in [`Segments::own_allocations`]. Records of one retention
//! completed in one shard are appended in completion order, so each queue's records are in expiry
//! order and the sweep walks a queue from its front until it meets a record that is not due. A
//! record forgotten or taken over is marked a hole and leaves its bytes where they are (counted
//! by the store) until the walk passes it, and a segment the walk has passed entirely is reused.

use std::collections::VecDeque;

use crate::clock::Millis;
use crate::fingerprint::Fingerprint;
use crate::store::{FencingToken, RecordedResponse, encode_fields_into, header_bytes};

/// Bytes of a segment: about fifty 1 KiB answers.
pub(super) const SEGMENT_BYTES: usize = 64 << 10;

/// Segments one shard may hold at once: a record's place in its index slot is a 15-bit segment
/// id and a 16-bit offset (2 GiB of answers a shard).
pub(super) const MAX_SEGMENTS: usize = 1 << 15;

/// Bytes of a record's fixed header in its segment.
pub(super) const FIXED_HEADER: usize = 54;

/// Most bytes of a record's header: the fixed part, then as variable-length integers its
/// fingerprint's version (16 bits), how long it ran (64 bits) and four 32-bit lengths.
pub(super) const MAX_HEADER_BYTES: usize = FIXED_HEADER + 3 + 10 + 4 * 5;

/// Offsets inside the fixed header.
const TOKEN: usize = 0;
const FP_DIGEST: usize = 8;
const OWNER: usize = 40;
const COMPLETED: usize = 44;
const STATUS: usize = 48;
const CHECK: usize = 50;

/// The owner id of a hole: a record forgotten or taken over, whose owner entry may be gone.
const HOLE: u32 = u32::MAX;

/// Where a completed record starts: a segment's id and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) seg: u32,
    pub(super) off: u32,
}

/// What a completed record is made of, before it is written.
pub(super) struct Parts<'a> {
    pub(super) token: FencingToken,
    pub(super) check: u32,
    pub(super) created_at: Millis,
    pub(super) completed_at: Millis,
    pub(super) fingerprint: Fingerprint,
    pub(super) key: &'a str,
    pub(super) response: &'a RecordedResponse,
}

impl Parts<'_> {
    /// The record's four lengths (key, headers, body, trailers) and its total bytes, or `None`
    /// when a length does not fit 32 bits (or the whole record does not fit an offset).
    pub(super) fn lengths(&self) -> Option<([u32; 4], usize)> {
        let lens = [
            self.key.len(),
            header_bytes(&self.response.headers),
            self.response.body.len(),
            header_bytes(&self.response.trailers),
        ];
        let mut header =
            FIXED_HEADER + varint_len(self.fingerprint.version.into()) + varint_len(self.ran());
        for len in lens {
            header += varint_len(u32::try_from(len).ok()?.into());
        }
        let total = header + lens.iter().sum::<usize>();
        u32::try_from(total).ok()?;
        Some((lens.map(|l| l as u32), total))
    }

    /// How long before its completion the record was claimed.
    fn ran(&self) -> u64 {
        self.completed_at.saturating_sub(self.created_at)
    }

    /// Writes the record, naming `owner`, its completion time as `completed` (an offset from
    /// its segment's).
    fn write(&self, owner: u32, lens: [u32; 4], completed: i32, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.token.0.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.digest);
        out.extend_from_slice(&owner.to_le_bytes());
        out.extend_from_slice(&completed.to_le_bytes());
        out.extend_from_slice(&self.response.status.to_le_bytes());
        out.extend_from_slice(&self.check.to_le_bytes());
        put_varint(self.fingerprint.version.into(), out);
        put_varint(self.ran(), out);
        for len in lens {
            put_varint(len.into(), out);
        }
        out.extend_from_slice(self.key.as_bytes());
        self.response.encode_headers_into(out);
        out.extend_from_slice(&self.response.body);
        encode_fields_into(&self.response.trailers, out);
    }
}

/// Bytes of `v` as a variable-length integer (LEB128: seven bits a byte).
pub(super) fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The variable-length integer at `*at`, which moves past it.
fn varint_at(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            break;
        }
    }
    v
}

/// A completed record read in place.
#[derive(Clone, Copy)]
pub(super) struct Record<'a> {
    bytes: &'a [u8],
    /// The segment's time its completion time is an offset from, and the segment's retention.
    base: Millis,
    retention: Millis,
    version: u16,
    ran: u64,
    /// Where the key starts, and the four lengths.
    parts: usize,
    lens: [u32; 4],
}

impl<'a> Record<'a> {
    fn at(seg: &'a Segment, off: usize) -> Self {
        let buf = &seg.buf[off..];
        let mut at = FIXED_HEADER;
        let version = varint_at(buf, &mut at) as u16;
        let ran = varint_at(buf, &mut at);
        let lens = [0; 4].map(|_| varint_at(buf, &mut at) as u32);
        let len = at + lens.iter().map(|&l| l as usize).sum::<usize>();
        Self {
            bytes: &buf[..len],
            base: seg.base,
            retention: seg.retention,
            version,
            ran,
            parts: at,
            lens,
        }
    }

    /// Bytes the record takes in its segment.
    pub(super) fn len(self) -> usize {
        self.bytes.len()
    }

    pub(super) fn token(self) -> FencingToken {
        FencingToken(u64::from_le_bytes(
            self.bytes[TOKEN..TOKEN + 8].try_into().expect("8 bytes"),
        ))
    }

    /// The 32 bits of its hash its index slot keeps.
    pub(super) fn check(self) -> u32 {
        u32::from_le_bytes(self.bytes[CHECK..CHECK + 4].try_into().expect("4 bytes"))
    }

    /// Its owner entry's id, `None` for a hole.
    pub(super) fn owner(self) -> Option<u32> {
        let id = u32::from_le_bytes(self.bytes[OWNER..OWNER + 4].try_into().expect("4 bytes"));
        (id != HOLE).then_some(id)
    }

    pub(super) fn completed_at(self) -> Millis {
        let offset = i32::from_le_bytes(
            self.bytes[COMPLETED..COMPLETED + 4]
                .try_into()
                .expect("4 bytes"),
        );
        self.base.wrapping_add_signed(offset.into())
    }

    pub(super) fn created_at(self) -> Millis {
        self.completed_at() - self.ran
    }

    pub(super) fn expires_at(self) -> Millis {
        self.completed_at().saturating_add(self.retention)
    }

    pub(super) fn fingerprint(self) -> Fingerprint {
        Fingerprint {
            version: self.version,
            digest: self.bytes[FP_DIGEST..FP_DIGEST + 32]
                .try_into()
                .expect("32 bytes"),
        }
    }

    pub(super) fn status(self) -> u16 {
        u16::from_le_bytes([self.bytes[STATUS], self.bytes[STATUS + 1]])
    }

    /// The `i`th variable part: 0 key, 1 headers, 2 body, 3 trailers.
    fn part(self, i: usize) -> &'a [u8] {
        let start = self.parts + self.lens[..i].iter().map(|&l| l as usize).sum::<usize>();
        &self.bytes[start..start + self.lens[i] as usize]
    }

    pub(super) fn key(self) -> &'a [u8] {
        self.part(0)
    }

    pub(super) fn headers(self) -> &'a [u8] {
        self.part(1)
    }

    pub(super) fn body(self) -> &'a [u8] {
        self.part(2)
    }

    pub(super) fn trailers(self) -> &'a [u8] {
        self.part(3)
    }

    /// The recorded answer, for a replay. Its headers, body and trailers are copied out of the
    /// segment (which is reused once the record expires) in one copy, the record's tail, and
    /// each value and the body is a view of that copy: nothing is copied twice.
    pub(super) fn response(self) -> RecordedResponse {
        let (headers, body) = (self.headers().len(), self.body().len());
        let tail = headers + body + self.trailers().len();
        let answer = bytes::Bytes::copy_from_slice(&self.bytes[self.bytes.len() - tail..]);
        let fields = |raw: bytes::Bytes| {
            RecordedResponse::decode_headers_in(&raw).expect("fields the store encoded itself")
        };
        RecordedResponse::new(
            self.status(),
            fields(answer.slice(..headers)),
            answer.slice(headers..headers + body),
        )
        .with_trailers(fields(answer.slice(headers + body..)))
    }

    /// Whether `response` is the answer recorded here.
    pub(super) fn holds(self, response: &RecordedResponse) -> bool {
        let fields = |raw: &[u8]| RecordedResponse::decode_headers(raw);
        self.status() == response.status
            && self.body() == &response.body[..]
            && header_bytes(&response.headers) == self.headers().len()
            && header_bytes(&response.trailers) == self.trailers().len()
            && fields(self.headers()).as_ref() == Some(&response.headers)
            && fields(self.trailers()).as_ref() == Some(&response.trailers)
    }
}

struct Segment {
    buf: Vec<u8>,
    /// Given to one answer too large for a segment: never appended to, never reused.
    own: bool,
    /// Bytes from the start that the sweep has passed: every record there is gone.
    swept: usize,
    /// Its first record's completion time: each record's is a 32-bit offset from it.
    base: Millis,
    /// Its queue's retention.
    retention: Millis,
}

/// The segments of one retention, oldest first; the last is the one appended to.
struct Queue {
    retention: Millis,
    segments: VecDeque<u32>,
}

/// A shard's segments.
#[derive(Default)]
pub(super) struct Segments {
    by_id: Vec<Option<Segment>>,
    free_ids: Vec<u32>,
    /// Segments passed entirely by the sweep, kept for reuse.
    spare: Vec<Vec<u8>>,
    queues: Vec<Queue>,
    /// Segments in use.
    in_use: usize,
    /// Answers too large for a segment that were given one of their own (reported by the
    /// store's `Debug`).
    pub(super) own_allocations: usize,
    /// Segments of the usual size allocated because no spare was kept.
    #[cfg(test)]
    pub(super) fresh: usize,
}

impl Segments {
    /// Writes a record naming `owner` into the open segment of its retention's queue (a new one
    /// when it does not fit, or when its completion time is too far from the segment's first)
    /// and says where. `lens` and `total` are [`Parts::lengths`]' answer. The shard holds fewer than
    /// [`MAX_SEGMENTS`] segments (the store refuses claims before that).
    pub(super) fn append(
        &mut self,
        retention: Millis,
        parts: &Parts<'_>,
        owner: u32,
        lens: [u32; 4],
        total: usize,
    ) -> Loc {
        let q = match self.queues.iter().position(|q| q.retention == retention) {
            Some(q) => q,
            None => {
                self.queues.push(Queue {
                    retention,
                    segments: VecDeque::new(),
                });
                self.queues.len() - 1
            }
        };
        let offset = |seg: &Segment| {
            i32::try_from(i128::from(parts.completed_at) - i128::from(seg.base)).ok()
        };
        let open = self.queues[q].segments.back().copied().filter(|&id| {
            let seg = self.by_id[id as usize].as_ref().expect("a queued segment");
            !seg.own && seg.buf.len() + total <= SEGMENT_BYTES && offset(seg).is_some()
        });
        let id = match open {
            Some(id) => id,
            None => {
                let own = total > SEGMENT_BYTES;
                let buf = if own {
                    self.own_allocations += 1;
                    Vec::with_capacity(total)
                } else {
                    self.spare.pop().unwrap_or_else(|| {
                        #[cfg(test)]
                        {
                            self.fresh += 1;
                        }
                        Vec::with_capacity(SEGMENT_BYTES)
                    })
                };
                let id = self.add(Segment {
                    buf,
                    own,
                    swept: 0,
                    base: parts.completed_at,
                    retention,
                });
                self.queues[q].segments.push_back(id);
                id
            }
        };
        let seg = self.by_id[id as usize].as_mut().expect("a queued segment");
        let (off, capacity) = (seg.buf.len(), seg.buf.capacity());
        let completed = offset(seg).expect("checked above");
        parts.write(owner, lens, completed, &mut seg.buf);
        debug_assert_eq!(seg.buf.len(), off + total);
        debug_assert_eq!(seg.buf.capacity(), capacity, "a segment grew");
        Loc {
            seg: id,
            off: off as u32,
        }
    }

    fn add(&mut self, seg: Segment) -> u32 {
        self.in_use += 1;
        match self.free_ids.pop() {
            Some(id) => {
                self.by_id[id as usize] = Some(seg);
                id
            }
            None => {
                self.by_id.push(Some(seg));
                debug_assert!(
                    self.by_id.len() <= MAX_SEGMENTS,
                    "a segment id past 15 bits"
                );
                (self.by_id.len() - 1) as u32
            }
        }
    }

    /// The record at `loc`.
    pub(super) fn get(&self, loc: Loc) -> Record<'_> {
        let seg = self.by_id[loc.seg as usize]
            .as_ref()
            .expect("a live segment");
        Record::at(seg, loc.off as usize)
    }

    /// Marks the record at `loc` a hole: its owner entry may be released and reused, and the
    /// sweep passes it without looking it up.
    pub(super) fn make_hole(&mut self, loc: Loc) {
        let seg = self.by_id[loc.seg as usize]
            .as_mut()
            .expect("a live segment");
        let at = loc.off as usize + OWNER;
        seg.buf[at..at + 4].copy_from_slice(&HOLE.to_le_bytes());
    }

    /// Segments in use.
    pub(super) fn in_use(&self) -> usize {
        self.in_use
    }

    /// Number of retention queues (the sweep walks each).
    pub(super) fn queues(&self) -> usize {
        self.queues.len()
    }

    /// Where the oldest record of queue `q` the sweep has not passed starts, `None` when nothing
    /// is left to walk. Segments passed entirely are put aside for reuse on the way.
    pub(super) fn front(&mut self, q: usize) -> Option<Loc> {
        loop {
            let &id = self.queues[q].segments.front()?;
            let seg = self.by_id[id as usize].as_ref().expect("a queued segment");
            if seg.swept < seg.buf.len() {
                return Some(Loc {
                    seg: id,
                    off: seg.swept as u32,
                });
            }
            self.queues[q].segments.pop_front();
            self.retire(id);
        }
    }

    /// Where the record after the one at `loc` (of `len` bytes) starts, `None` when that one
    /// ends its segment: the sweep reads a segment's records ahead of passing them.
    pub(super) fn after(&self, loc: Loc, len: usize) -> Option<Loc> {
        let seg = self.by_id[loc.seg as usize]
            .as_ref()
            .expect("a live segment");
        let off = loc.off as usize + len;
        (off < seg.buf.len()).then_some(Loc {
            seg: loc.seg,
            off: off as u32,
        })
    }

    /// The sweep passes the records in the `len` bytes from `loc`, the front of its queue.
    pub(super) fn pass(&mut self, loc: Loc, len: usize) {
        let seg = self.by_id[loc.seg as usize]
            .as_mut()
            .expect("a live segment");
        debug_assert_eq!(seg.swept, loc.off as usize);
        seg.swept += len;
    }

    /// Drops queues left empty, so a retention no longer in use costs nothing.
    pub(super) fn drop_empty_queues(&mut self) {
        self.queues.retain(|q| !q.segments.is_empty());
    }

    fn retire(&mut self, id: u32) {
        let seg = self.by_id[id as usize].take().expect("a live segment");
        self.free_ids.push(id);
        self.in_use -= 1;
        // Keep enough spares for a shard's churn between two sweeps: the sweeper runs once a
        // retention, so a steady shard's sweep retires about as many segments as stay in use,
        // and the shard fills as many again before the next one (a quarter of the segments in
        // use, the limit before, sent the rest back to `malloc` to be allocated again). Spares
        // never outnumber the segments in use (plus two), so a burst's peak is not kept whole
        // once it drains.
        if !seg.own && self.spare.len() < 2 + self.in_use {
            let mut buf = seg.buf;
            buf.clear();
            self.spare.push(buf);
        }
    }

    /// Segments in use and spare.
    #[cfg(test)]
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.in_use, self.spare.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_length_integer_reads_back_as_written_in_its_counted_bytes() {
        for v in [
            0,
            1,
            127,
            128,
            200,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(v, &mut out);
            assert_eq!(out.len(), varint_len(v), "{v}");
            let mut at = 0;
            assert_eq!(varint_at(&out, &mut at), v);
            assert_eq!(at, out.len());
        }
    }
}
