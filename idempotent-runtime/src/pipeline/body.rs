//! Reading bodies under the buffer budget: the request's before the claim (bounded by
//! `max_body` and `body_timeout`), the response's to record it (bounded by `max_response`).

use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use crate::budget::{BufferBudget, BufferPermit};

/// Fields a body sends after its data (HTTP trailers, gRPC's status): lowercase names and
/// values, in the order sent.
pub(crate) type Trailers = Vec<(String, Bytes)>;

/// A body as the pipeline reads it: data chunks, then the end or an error. Each framework
/// implements it for its request and response bodies (empty chunks skipped; trailers skipped by
/// [`poll_chunk`](Self::poll_chunk), kept by [`poll_chunk_keeping`](Self::poll_chunk_keeping)).
pub trait Chunks: Unpin {
    /// What a broken body reports.
    type Error;

    /// The exact length, when the body knows it before it is read (the default: it does not).
    fn exact_len(&self) -> Option<u64> {
        None
    }

    /// The next data chunk; `None` at the end.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>>;

    /// [`poll_chunk`](Self::poll_chunk), appending the trailers the body sends to `trailers`
    /// instead of skipping them: how a response body is read to be recorded. The default keeps
    /// none, for a framework whose bodies have no trailers (actix-web's responses).
    fn poll_chunk_keeping(
        &mut self,
        cx: &mut Context<'_>,
        trailers: &mut Trailers,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let _ = trailers;
        self.poll_chunk(cx)
    }
}

async fn next_chunk<B: Chunks>(body: &mut B) -> Option<Result<Bytes, B::Error>> {
    poll_fn(|cx| body.poll_chunk(cx)).await
}

/// Chunks joined without a copy in the common case of one chunk.
#[derive(Default)]
struct Joined {
    first: Option<Bytes>,
    rest: BytesMut,
}

impl Joined {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(self.rest.len(), Bytes::len)
    }

    fn push(&mut self, chunk: Bytes) {
        match self.first.take() {
            None if self.rest.is_empty() => self.first = Some(chunk),
            None => self.rest.extend_from_slice(&chunk),
            Some(first) => {
                self.rest.reserve(first.len() + chunk.len());
                self.rest.extend_from_slice(&first);
                self.rest.extend_from_slice(&chunk);
            }
        }
    }

    fn freeze(self) -> Bytes {
        self.first.unwrap_or_else(|| self.rest.freeze())
    }
}

/// Why a request body was not read in full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyError {
    /// Over `max_body` (announced or arrived).
    TooLarge,
    /// Not complete within `body_timeout`.
    Timeout,
    /// The buffer budget is exhausted by the bytes that already arrived everywhere.
    BuffersFull,
    /// The body broke off (a connection error, bad chunking).
    Broken,
}

/// Reads a request body in full: at most `max_body` bytes, within `timeout`, each chunk charged
/// to the budget as it arrives (an announced `Content-Length` over `max_body` is refused before
/// anything is read, and reserves nothing otherwise).
pub(crate) async fn read_request<B: Chunks>(
    budget: &Arc<BufferBudget>,
    body: &mut B,
    announced: Option<u64>,
    max_body: usize,
    timeout: Duration,
) -> Result<(Bytes, BufferPermit), BodyError> {
    if announced.is_some_and(|n| n > max_body as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut permit = budget.permit();
    let read = {
        let mut reading = std::pin::pin!(async {
            let mut joined = Joined::default();
            while let Some(chunk) = next_chunk(body).await {
                let chunk = chunk.map_err(|_| BodyError::Broken)?;
                if chunk.len() > max_body - joined.len() {
                    return Err(BodyError::TooLarge);
                }
                if !permit.grow(chunk.len()) {
                    return Err(BodyError::BuffersFull);
                }
                joined.push(chunk);
            }
            Ok(joined.freeze())
        });
        // A body already in memory is read without reading the clock or arming a timer; the
        // timeout starts when the first read has to wait.
        match poll_fn(|cx| Poll::Ready(reading.as_mut().poll(cx))).await {
            Poll::Ready(read) => read,
            Poll::Pending => match tokio::time::timeout(timeout, reading).await {
                Ok(read) => read,
                Err(_elapsed) => Err(BodyError::Timeout),
            },
        }
    };
    read.map(|bytes| (bytes, permit))
}

/// A response body read to be recorded.
pub(crate) enum Collected<B: Chunks> {
    /// It ended within the cap: `bytes` is all of it, `drained` the body read to its end,
    /// `trailers` every trailer it sent (none where the framework has none).
    Complete {
        bytes: Bytes,
        drained: B,
        trailers: Trailers,
    },
    /// Past the cap or the budget, or broken: what was read, the error if reading failed, and
    /// the rest of the stream, to be sent as it comes, unrecorded.
    Partial {
        read: Bytes,
        error: Option<B::Error>,
        rest: B,
    },
}

/// Reads a response body of at most `cap` bytes. A sized body (its length known, so already
/// produced) is charged to the budget whatever others hold: refusing it would free nothing and
/// leave its key unrecorded. A body of unknown size is charged chunk by chunk and handed back
/// as [`Collected::Partial`] when the budget runs out. The permit holds the bytes until the
/// record is written.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) async fn collect_response<B: Chunks>(
    budget: &Arc<BufferBudget>,
    body: B,
    cap: usize,
) -> (Collected<B>, BufferPermit) {
    let mut collecting = Collecting::new(budget, body, cap);
    poll_fn(|cx| collecting.poll_read(cx)).await;
    collecting.finish()
}

/// [`collect_response`] as a value: polled where the caller chooses (in place first, then, if
/// the body is still streaming, from wherever the rest of the work goes), then
/// [finished](Self::finish). Unpin, so it moves freely between polls.
pub(crate) struct Collecting<B: Chunks> {
    body: B,
    joined: Joined,
    trailers: Trailers,
    permit: BufferPermit,
    /// The announced length, when the body has one within the cap (charged in full).
    sized: Option<u64>,
    cap: usize,
    /// How the reading ended, once it has.
    ended: Option<ReadEnd<B::Error>>,
}

enum ReadEnd<E> {
    /// The body's end, within the cap.
    Whole,
    /// Past the cap or the budget: the rest is not read.
    Over,
    /// The body failed.
    Broken(E),
}

impl<B: Chunks> Collecting<B> {
    pub(crate) fn new(budget: &Arc<BufferBudget>, body: B, cap: usize) -> Self {
        let mut permit = budget.permit();
        let sized = body.exact_len().filter(|&n| n <= cap as u64);
        if let Some(len) = sized {
            permit.charge(len as usize);
        }
        Self {
            body,
            joined: Joined::default(),
            trailers: Trailers::new(),
            permit,
            sized,
            cap,
            ended: None,
        }
    }

    /// Reads until the body ends, breaks or passes the cap (`Ready`), or has nothing more yet.
    pub(crate) fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        while self.ended.is_none() {
            let chunk = match self.body.poll_chunk_keeping(cx, &mut self.trailers) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.ended = Some(ReadEnd::Whole);
                    break;
                }
                Poll::Ready(Some(Err(error))) => {
                    self.ended = Some(ReadEnd::Broken(error));
                    break;
                }
                Poll::Ready(Some(Ok(chunk))) => chunk,
            };
            let len = self.joined.len() + chunk.len();
            let within = match self.sized {
                // A body longer than it announced is not what was charged.
                Some(announced) => len as u64 <= announced,
                None => len <= self.cap && self.permit.grow(chunk.len()),
            };
            self.joined.push(chunk);
            if !within {
                self.ended = Some(ReadEnd::Over);
            }
        }
        Poll::Ready(())
    }

    /// What was read, once [`poll_read`](Self::poll_read) answered `Ready`.
    pub(crate) fn finish(self) -> (Collected<B>, BufferPermit) {
        let read = self.joined.freeze();
        let collected = match self.ended.expect("finished after the reading ended") {
            ReadEnd::Whole => Collected::Complete {
                bytes: read,
                drained: self.body,
                trailers: self.trailers,
            },
            ReadEnd::Over => Collected::Partial {
                read,
                error: None,
                rest: self.body,
            },
            ReadEnd::Broken(error) => Collected::Partial {
                read,
                error: Some(error),
                rest: self.body,
            },
        };
        (collected, self.permit)
    }
}
