//! Settling a claimed request's response: recorded, or the key released.
//!
//! In one synchronous pass where nothing has to wait (the memory store answers at once, and a
//! body already in memory is read in place), else in a box of its own from where it had to stop:
//! the body still streaming, or a store that answers over the network. The future of the work
//! around it then carries a pointer and the response, not the settling's state machine.

use std::future::{Future, poll_fn};
use std::task::{Context, Poll};

use bytes::Bytes;

use super::body::{Collected, Collecting};
use super::{Chunks, Reply};
use crate::budget::BufferPermit;
use crate::config::{Config, Oversized, Recording};
use crate::handle::Idempotency;
use crate::record;
use crate::reservation::Reservation;
use crate::store::{RecordedResponse, at_once};

/// Records a recordable response before it is returned; releases the key otherwise (or, under
/// [`Oversized::RecordWithoutBody`], records a body too large to keep as its status and
/// headers alone). The first response is never marked replayed. A sized response already in
/// memory is recorded whatever the buffer budget ([the contract](crate::design) §5, "Buffers in
/// flight").
///
/// `reservation` is borrowed, not held: settled, it holds nothing, and the work that owns it
/// keeps one copy of it rather than one here too.
pub(crate) fn settle<'a, R: Reply + 'a>(
    handle: &'a Idempotency,
    reservation: &'a mut Reservation,
    response: R,
) -> impl Future<Output = R> + 'a {
    // A block returned by a function, not an `async fn`: it keeps `response` once, where an
    // `async fn` keeps its arguments and the copies it rebinds them to.
    let mut response = Some(response);
    async move {
        // On the task's own waker: a body that is still streaming wakes it.
        let begun = poll_fn(|cx| {
            let response = response.take().expect("ready at its first poll");
            Poll::Ready(begin(handle, &mut *reservation, response, cx))
        });
        // What is left is boxed within this statement: a value bound outside it would keep its
        // bytes in this future across the await.
        let finishing = match begun.await {
            Settling::Done(answer) => return answer,
            Settling::Later(later) => Box::pin(later.finish(handle, reservation)),
        };
        finishing.await
    }
}

enum Settling<R: Reply> {
    /// Recorded or released: the answer.
    Done(R),
    /// What is left, to be awaited.
    Later(Later<R>),
}

/// What is left of a settling that has to wait.
enum Later<R: Reply> {
    /// The body is still streaming: read the rest, then the store's step.
    Reading(Reading<R>),
    /// The store's step, on a store that answers over the network.
    Storing(Step<R>),
}

/// The store's step, and the answer that follows it.
enum Step<R: Reply> {
    Release(R),
    Record {
        recorded: RecordedResponse,
        answer: Answer<R>,
        /// The body's charge on the buffer budget, held until its record is written.
        permit: Option<BufferPermit>,
    },
}

/// The answer after a record is written.
enum Answer<R: Reply> {
    /// Already whole (a record without the body).
    Whole(R),
    /// Put together from the record once it is written: its body moves into the answer, where
    /// a copy made before the store's step would have shared it (an allocation, for a body
    /// that was one `Vec`). `trailers` are every trailer the handler sent; the record keeps
    /// those allowlisted.
    FromRecord {
        head: R::Head,
        drained: R::Body,
        trailers: Vec<(String, Bytes)>,
    },
}

impl<R: Reply> Answer<R> {
    fn after(self, recorded: RecordedResponse) -> R {
        match self {
            Answer::Whole(answer) => answer,
            Answer::FromRecord {
                head,
                drained,
                trailers,
            } => R::recorded(head, recorded.body, drained).with_trailers(&trailers),
        }
    }
}

/// A response whose body is being read to be recorded.
struct Reading<R: Reply> {
    head: R::Head,
    collecting: Collecting<R::Body>,
    status: u16,
    headers: Vec<(String, Bytes)>,
    without_body: bool,
}

/// Everything that can be done without waiting.
fn begin<R: Reply>(
    handle: &Idempotency,
    reservation: &mut Reservation,
    response: R,
    cx: &mut Context<'_>,
) -> Settling<R> {
    let config = handle.config();
    let status = response.status();
    let recording = reservation.recording();
    if !reservation.is_guarded() || !recording.is_recordable_status(config, status) {
        return store(reservation, Step::Release(response));
    }
    let Some(headers) = record::recorded_headers_for(config, recording, response.headers()) else {
        return store(reservation, Step::Release(response));
    };
    let cap = reservation.max_response();
    let without_body = recording.oversized(config) == Oversized::RecordWithoutBody;
    let (head, body) = response.into_parts();
    if body.exact_len().is_some_and(|n| n > cap as u64) {
        let answer = R::from_parts(head, body);
        return store(
            reservation,
            Step::bodiless(without_body, status, headers, answer),
        );
    }
    let mut reading = Reading {
        head,
        collecting: Collecting::new(handle.budget(), body, cap),
        status,
        headers,
        without_body,
    };
    match reading.collecting.poll_read(cx) {
        Poll::Ready(()) => {
            let step = reading.read(config, reservation.recording());
            store(reservation, step)
        }
        Poll::Pending => Settling::Later(Later::Reading(reading)),
    }
}

/// The store's step now, when the reservation settles at once; else later.
fn store<R: Reply>(reservation: &mut Reservation, step: Step<R>) -> Settling<R> {
    if reservation.settles_at_once() {
        Settling::Done(at_once(std::pin::pin!(step.take(reservation))))
    } else {
        Settling::Later(Later::Storing(step))
    }
}

impl<R: Reply> Later<R> {
    async fn finish(self, handle: &Idempotency, reservation: &mut Reservation) -> R {
        let step = match self {
            Later::Storing(step) => step,
            Later::Reading(mut reading) => {
                // Still renewed while the body streams: a slow answer must not lose its key to
                // a duplicate.
                let read = poll_fn(|cx| reading.collecting.poll_read(cx));
                reservation.renewing(read).await;
                reading.read(handle.config(), reservation.recording())
            }
        };
        step.take(reservation).await
    }
}

impl<R: Reply> Step<R> {
    /// An answer whose body is not kept: recorded as its status and headers alone when
    /// `keep_head` ([`Oversized::RecordWithoutBody`]), else its key released.
    fn bodiless(keep_head: bool, status: u16, headers: Vec<(String, Bytes)>, answer: R) -> Self {
        if keep_head {
            Step::Record {
                recorded: record::without_body(status, headers),
                answer: Answer::Whole(answer),
                permit: None,
            }
        } else {
            Step::Release(answer)
        }
    }

    /// Releases or records, then answers.
    async fn take(self, reservation: &mut Reservation) -> R {
        match self {
            Step::Release(answer) => {
                reservation.release().await;
                answer
            }
            Step::Record {
                recorded,
                answer,
                permit,
            } => {
                reservation.complete(&recorded).await;
                drop(permit);
                answer.after(recorded)
            }
        }
    }
}

impl<R: Reply> Reading<R> {
    /// The body read: recorded with the response's status and kept headers, or, past the cap
    /// or broken, sent on as it comes.
    fn read(self, config: &Config, recording: &Recording) -> Step<R> {
        let Self {
            head,
            collecting,
            status,
            headers,
            without_body,
        } = self;
        match collecting.finish() {
            (
                Collected::Complete {
                    bytes,
                    drained,
                    trailers,
                },
                permit,
            ) => {
                let kept = record::recorded_trailers_for(config, recording, &trailers);
                let recorded = RecordedResponse::new(status, headers, bytes).with_trailers(kept);
                Step::Record {
                    recorded,
                    answer: Answer::FromRecord {
                        head,
                        drained,
                        trailers,
                    },
                    permit: Some(permit),
                }
            }
            (Collected::Partial { read, error, rest }, permit) => {
                drop(permit);
                // Past the cap (or the budget) the answer is whole but cannot be kept; a broken
                // body is not an answer to keep at all.
                let keep_head = without_body && error.is_none();
                let answer = R::resumed(head, read, error, rest);
                Step::bodiless(keep_head, status, headers, answer)
            }
        }
    }
}
