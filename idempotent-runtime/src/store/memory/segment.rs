//! Where the memory store keeps completed answers: append-only segments, one queue of them per
//! retention, so that each queue is in expiry order (the Segcache design, Yang et al., NSDI '21).
//!
//! A completed record is one run of bytes in a segment: a fixed header (its hash, quota bucket,
//! times, fingerprint, status, the lengths of what follows, its charge and its scope), then its
//! key, route, encoded headers, body and encoded trailers. Nothing is allocated or freed per
//! record: segments are [`SEGMENT_BYTES`] long, allocated once and reused; an answer larger than a
//! segment gets a segment of its own, counted in [`Segments::own_allocations`]. Records of one
//! retention completed in one shard are appended in completion order, so each queue's records
//! are in expiry order and the sweep walks a queue from its front until it meets a record that is
//! not due. A record forgotten or taken over leaves its bytes where they are (a hole, counted by
//! the store) until the walk passes it, and a segment the walk has passed entirely is reused.

use std::collections::VecDeque;

use crate::clock::Millis;
use crate::fingerprint::Fingerprint;
use crate::scope::ScopeHash;
use crate::store::{RecordedResponse, encode_fields_into, header_bytes};

/// Bytes of a segment: about fifty 1 KiB answers.
pub(super) const SEGMENT_BYTES: usize = 64 << 10;

/// Bytes of a record's fixed header in its segment.
pub(super) const HEADER_BYTES: usize = 124;

/// Offsets inside the header.
const HASH: usize = 0;
const BUCKET: usize = 8;
const CREATED: usize = 16;
const COMPLETED: usize = 24;
const FP_VERSION: usize = 32;
const FP_DIGEST: usize = 34;
const STATUS: usize = 66;
/// Five `u32` lengths: key, route, headers, body, trailers.
const LENGTHS: usize = 68;
const WEIGHT: usize = 88;
const SCOPE: usize = 92;

/// Where a completed record starts: a segment's id and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) seg: u32,
    pub(super) off: u32,
}

/// What a completed record is made of, before it is written.
pub(super) struct Parts<'a> {
    pub(super) hash: u64,
    pub(super) bucket: u64,
    pub(super) created_at: Millis,
    pub(super) completed_at: Millis,
    pub(super) fingerprint: Fingerprint,
    pub(super) scope: &'a ScopeHash,
    pub(super) key: &'a str,
    pub(super) route: &'a str,
    pub(super) response: &'a RecordedResponse,
}

impl Parts<'_> {
    /// The record's five lengths and its total, or `None` when one does not fit the header's
    /// 32 bits (or the whole record does not fit an offset).
    pub(super) fn lengths(&self) -> Option<([u32; 5], usize)> {
        let lens = [
            self.key.len(),
            self.route.len(),
            header_bytes(&self.response.headers),
            self.response.body.len(),
            header_bytes(&self.response.trailers),
        ];
        let total = HEADER_BYTES + lens.iter().sum::<usize>();
        u32::try_from(total).ok()?;
        Some((lens.map(|l| l as u32), total))
    }

    fn write(&self, lens: [u32; 5], weight: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&self.bucket.to_le_bytes());
        out.extend_from_slice(&self.created_at.to_le_bytes());
        out.extend_from_slice(&self.completed_at.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.version.to_le_bytes());
        out.extend_from_slice(&self.fingerprint.digest);
        out.extend_from_slice(&self.response.status.to_le_bytes());
        for len in lens {
            out.extend_from_slice(&len.to_le_bytes());
        }
        out.extend_from_slice(&weight.to_le_bytes());
        out.extend_from_slice(self.scope);
        out.extend_from_slice(self.key.as_bytes());
        out.extend_from_slice(self.route.as_bytes());
        self.response.encode_headers_into(out);
        out.extend_from_slice(&self.response.body);
        encode_fields_into(&self.response.trailers, out);
    }
}

/// A completed record read in place.
#[derive(Clone, Copy)]
pub(super) struct Record<'a> {
    bytes: &'a [u8],
}

impl<'a> Record<'a> {
    fn at(buf: &'a [u8], off: usize) -> Self {
        let head = &buf[off..off + HEADER_BYTES];
        let lens: usize = (0..5).map(|i| u32_at(head, LENGTHS + 4 * i) as usize).sum();
        Self {
            bytes: &buf[off..off + HEADER_BYTES + lens],
        }
    }

    /// Bytes the record takes in its segment.
    pub(super) fn len(self) -> usize {
        self.bytes.len()
    }

    pub(super) fn hash(self) -> u64 {
        u64_at(self.bytes, HASH)
    }

    pub(super) fn bucket(self) -> u64 {
        u64_at(self.bytes, BUCKET)
    }

    pub(super) fn created_at(self) -> Millis {
        u64_at(self.bytes, CREATED)
    }

    pub(super) fn completed_at(self) -> Millis {
        u64_at(self.bytes, COMPLETED)
    }

    pub(super) fn fingerprint(self) -> Fingerprint {
        Fingerprint {
            version: u16::from_le_bytes([self.bytes[FP_VERSION], self.bytes[FP_VERSION + 1]]),
            digest: self.bytes[FP_DIGEST..FP_DIGEST + 32]
                .try_into()
                .expect("32 bytes"),
        }
    }

    pub(super) fn status(self) -> u16 {
        u16::from_le_bytes([self.bytes[STATUS], self.bytes[STATUS + 1]])
    }

    /// What the record is charged, in the store and in its scope's share.
    pub(super) fn weight(self) -> usize {
        u32_at(self.bytes, WEIGHT) as usize
    }

    pub(super) fn scope(self) -> &'a [u8] {
        &self.bytes[SCOPE..SCOPE + 32]
    }

    /// The `i`th variable part: 0 key, 1 route, 2 headers, 3 body, 4 trailers.
    fn part(self, i: usize) -> &'a [u8] {
        let start = HEADER_BYTES
            + (0..i)
                .map(|j| u32_at(self.bytes, LENGTHS + 4 * j) as usize)
                .sum::<usize>();
        &self.bytes[start..start + u32_at(self.bytes, LENGTHS + 4 * i) as usize]
    }

    pub(super) fn key(self) -> &'a [u8] {
        self.part(0)
    }

    pub(super) fn route(self) -> &'a str {
        // Written from a `&str`.
        std::str::from_utf8(self.part(1)).unwrap_or_default()
    }

    pub(super) fn headers(self) -> &'a [u8] {
        self.part(2)
    }

    pub(super) fn body(self) -> &'a [u8] {
        self.part(3)
    }

    pub(super) fn trailers(self) -> &'a [u8] {
        self.part(4)
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

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

struct Segment {
    buf: Vec<u8>,
    /// Given to one answer too large for a segment: never appended to, never reused.
    own: bool,
    /// Bytes from the start that the sweep has passed: every record there is gone.
    swept: usize,
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
}

/// What the sweep found at the front of a queue.
pub(super) enum Front<'a> {
    /// The oldest record not yet passed, at `loc`.
    Record(Loc, Record<'a>),
    /// Nothing left to walk.
    Empty,
}

impl Segments {
    /// Writes a record into the open segment of its retention's queue (a new one when it does
    /// not fit) and says where. `lens` and `total` are [`Parts::lengths`]' answer.
    pub(super) fn append(
        &mut self,
        retention: Millis,
        parts: &Parts<'_>,
        lens: [u32; 5],
        total: usize,
        weight: u32,
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
        let open = self.queues[q].segments.back().copied().filter(|&id| {
            let seg = self.by_id[id as usize].as_ref().expect("a queued segment");
            !seg.own && seg.buf.len() + total <= SEGMENT_BYTES
        });
        let id = match open {
            Some(id) => id,
            None => {
                let own = total > SEGMENT_BYTES;
                let buf = if own {
                    self.own_allocations += 1;
                    Vec::with_capacity(total)
                } else {
                    self.spare
                        .pop()
                        .unwrap_or_else(|| Vec::with_capacity(SEGMENT_BYTES))
                };
                let id = self.add(Segment { buf, own, swept: 0 });
                self.queues[q].segments.push_back(id);
                id
            }
        };
        let seg = self.by_id[id as usize].as_mut().expect("a queued segment");
        let (off, capacity) = (seg.buf.len(), seg.buf.capacity());
        parts.write(lens, weight, &mut seg.buf);
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
                (self.by_id.len() - 1) as u32
            }
        }
    }

    /// The record at `loc`.
    pub(super) fn get(&self, loc: Loc) -> Record<'_> {
        let seg = self.by_id[loc.seg as usize]
            .as_ref()
            .expect("a live segment");
        Record::at(&seg.buf, loc.off as usize)
    }

    /// Number of retention queues (the sweep walks each).
    pub(super) fn queues(&self) -> usize {
        self.queues.len()
    }

    /// The oldest record of queue `q` the sweep has not passed. Segments passed entirely are
    /// put aside for reuse on the way.
    pub(super) fn front(&mut self, q: usize) -> Front<'_> {
        loop {
            let Some(&id) = self.queues[q].segments.front() else {
                return Front::Empty;
            };
            let seg = self.by_id[id as usize].as_ref().expect("a queued segment");
            if seg.swept < seg.buf.len() {
                break;
            }
            self.queues[q].segments.pop_front();
            self.retire(id);
        }
        let id = *self.queues[q].segments.front().expect("checked above");
        let seg = self.by_id[id as usize].as_ref().expect("a queued segment");
        Front::Record(
            Loc {
                seg: id,
                off: seg.swept as u32,
            },
            Record::at(&seg.buf, seg.swept),
        )
    }

    /// The sweep passes the record at `loc`, the front of its queue.
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
        // Keep enough spares for a shard's churn between two sweeps, not a burst's worth.
        if !seg.own && self.spare.len() < 2 + self.in_use / 4 {
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
