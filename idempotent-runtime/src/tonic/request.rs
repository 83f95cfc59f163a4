//! A unary call's request body as the sequence reads it: the gRPC frame undone, so what is
//! bounded by `max_body` and fingerprinted is the message itself (decompressed when the client
//! sent it gzip-compressed), and the same message sent compressed or not is the same request.

use std::io::Write as _;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use flate2::write::GzDecoder;
use http_body::Body as _;

use crate::adapter::Chunks;

/// The length-prefixed message header: a compressed flag and a 4-byte big-endian length.
pub(super) const FRAME_HEADER: usize = 5;

/// How much compressed input is inflated at a time, so a small input that inflates to a huge
/// message (a decompression bomb) is stopped soon after it passes the cap.
const INFLATE_STEP: usize = 1024;

/// Why a request body is not one readable message.
#[derive(Debug)]
pub(crate) enum MessageError {
    /// The transport broke (the connection, the stream).
    Transport,
    /// A second message: the method streams requests, so it is not for the sequence.
    SecondMessage,
    /// A compressed message in an encoding this layer cannot undo.
    Encoding,
    /// Corrupt compressed data, a bad flag, or a body that ends inside a frame.
    Malformed,
}

enum Framing {
    /// Reading a frame header: `have` bytes of it so far.
    Header {
        buf: [u8; FRAME_HEADER],
        have: usize,
    },
    /// Reading a message: `remaining` bytes of it to come, inflated when compressed.
    Message {
        remaining: usize,
        inflate: Option<Box<GzDecoder<Vec<u8>>>>,
    },
}

/// The request body of a call the layer applies to.
pub(crate) struct MessageBody {
    /// The body as it came; `None` for a message already read ([`From<Bytes>`]).
    raw: Option<::tonic::body::Body>,
    /// A message to yield before anything else (one already read).
    ready: Option<Bytes>,
    /// Raw bytes received and not yet taken apart.
    pending: Bytes,
    framing: Framing,
    messages: usize,
    /// Whether the request said `grpc-encoding: gzip`.
    gzip: bool,
    /// Inflated bytes so far, to stop inflating past the cap.
    inflated: usize,
    cap: usize,
    touched: bool,
    /// Said when a second message shows the method streams.
    on_streaming: Option<Box<dyn FnOnce() + Send>>,
}

impl MessageBody {
    pub(crate) fn new(
        raw: ::tonic::body::Body,
        gzip: bool,
        cap: usize,
        on_streaming: Box<dyn FnOnce() + Send>,
    ) -> Self {
        Self {
            raw: Some(raw),
            ready: None,
            pending: Bytes::new(),
            framing: Framing::Header {
                buf: [0; FRAME_HEADER],
                have: 0,
            },
            messages: 0,
            gzip,
            inflated: 0,
            cap,
            touched: false,
            on_streaming: Some(on_streaming),
        }
    }

    /// The body for the inner service when the call passes: the original when nothing was
    /// read from it, else the message read, framed again.
    pub(crate) fn into_inner(self) -> ::tonic::body::Body {
        match (self.raw, self.ready) {
            (Some(raw), None) if !self.touched => raw,
            (_, Some(message)) => framed(&message),
            // A pass happens before the body is read, or after it was read in full into
            // `ready`: nothing else reaches here.
            (_, None) => ::tonic::body::Body::empty(),
        }
    }

    /// Takes raw bytes apart: the next piece of the message, if these bytes hold one.
    fn take(&mut self) -> Result<Option<Bytes>, MessageError> {
        loop {
            if self.pending.is_empty() {
                return Ok(None);
            }
            match &mut self.framing {
                Framing::Header { buf, have } => {
                    if self.messages > 0 {
                        if let Some(say) = self.on_streaming.take() {
                            say();
                        }
                        return Err(MessageError::SecondMessage);
                    }
                    let n = (FRAME_HEADER - *have).min(self.pending.len());
                    buf[*have..*have + n].copy_from_slice(&self.pending[..n]);
                    self.pending.advance(n);
                    *have += n;
                    if *have < FRAME_HEADER {
                        continue;
                    }
                    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                    let inflate = match buf[0] {
                        0 => None,
                        1 if self.gzip => Some(Box::new(GzDecoder::new(Vec::new()))),
                        1 => return Err(MessageError::Encoding),
                        _ => return Err(MessageError::Malformed),
                    };
                    self.framing = Framing::Message {
                        remaining: len,
                        inflate,
                    };
                    if len == 0 {
                        return self.finish_message().map(Some);
                    }
                }
                Framing::Message { remaining, inflate } => {
                    // Compressed input is inflated a step at a time, so what one step yields
                    // stays small whatever the ratio.
                    let step = if inflate.is_some() {
                        INFLATE_STEP
                    } else {
                        usize::MAX
                    };
                    let n = (*remaining).min(self.pending.len()).min(step);
                    let piece = self.pending.split_to(n);
                    *remaining -= n;
                    let out = match inflate {
                        None => piece,
                        Some(decoder) => {
                            decoder
                                .write_all(&piece)
                                .map_err(|_| MessageError::Malformed)?;
                            let out = Bytes::from(std::mem::take(decoder.get_mut()));
                            self.inflated += out.len();
                            if self.inflated > self.cap {
                                // Past the cap the sequence refuses the request: inflate no
                                // further.
                                self.pending = Bytes::new();
                                self.raw = None;
                                return Ok(Some(out));
                            }
                            out
                        }
                    };
                    if !matches!(self.framing, Framing::Message { remaining: 0, .. }) {
                        if out.is_empty() {
                            continue;
                        }
                        return Ok(Some(out));
                    }
                    let last = self.finish_message()?;
                    return Ok(Some(match (out.is_empty(), last.is_empty()) {
                        (_, true) => out,
                        (true, false) => last,
                        (false, false) => {
                            let mut joined = BytesMut::with_capacity(out.len() + last.len());
                            joined.put(out);
                            joined.put(last);
                            joined.freeze()
                        }
                    }));
                }
            }
        }
    }

    /// The end of the current message: the inflater's last output.
    fn finish_message(&mut self) -> Result<Bytes, MessageError> {
        let framing = std::mem::replace(
            &mut self.framing,
            Framing::Header {
                buf: [0; FRAME_HEADER],
                have: 0,
            },
        );
        self.messages += 1;
        match framing {
            Framing::Message {
                inflate: Some(decoder),
                ..
            } => {
                let out = decoder.finish().map_err(|_| MessageError::Malformed)?;
                self.inflated += out.len();
                Ok(Bytes::from(out))
            }
            _ => Ok(Bytes::new()),
        }
    }
}

impl From<Bytes> for MessageBody {
    fn from(message: Bytes) -> Self {
        Self {
            raw: None,
            ready: Some(message),
            pending: Bytes::new(),
            framing: Framing::Header {
                buf: [0; FRAME_HEADER],
                have: 0,
            },
            messages: 1,
            gzip: false,
            inflated: 0,
            cap: usize::MAX,
            touched: true,
            on_streaming: None,
        }
    }
}

impl Chunks for MessageBody {
    type Error = MessageError;

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, MessageError>>> {
        self.touched = true;
        if let Some(message) = self.ready.take() {
            return Poll::Ready((!message.is_empty()).then_some(Ok(message)));
        }
        loop {
            match self.take() {
                Err(error) => return Poll::Ready(Some(Err(error))),
                Ok(Some(piece)) if !piece.is_empty() => return Poll::Ready(Some(Ok(piece))),
                Ok(_) => {}
            }
            let Some(raw) = self.raw.as_mut() else {
                return Poll::Ready(None);
            };
            let frame = match ready!(Pin::new(raw).poll_frame(cx)) {
                None => {
                    self.raw = None;
                    return Poll::Ready(match self.framing {
                        Framing::Header { have: 0, .. } => None,
                        _ => Some(Err(MessageError::Malformed)),
                    });
                }
                Some(Err(_)) => return Poll::Ready(Some(Err(MessageError::Transport))),
                Some(Ok(frame)) => frame,
            };
            // Request trailers carry nothing a unary call's sequence reads.
            if let Ok(data) = frame.into_data() {
                self.pending = if self.pending.is_empty() {
                    data
                } else {
                    let mut joined = BytesMut::from(std::mem::take(&mut self.pending));
                    joined.put(data);
                    joined.freeze()
                };
            }
        }
    }
}

/// `message` in one uncompressed gRPC frame.
pub(super) fn framed(message: &Bytes) -> ::tonic::body::Body {
    ::tonic::body::Body::new(http_body_util::Full::new(frame(message)))
}

/// `message` with its frame header: not compressed, its length.
pub(super) fn frame(message: &[u8]) -> Bytes {
    let mut framed = BytesMut::with_capacity(FRAME_HEADER + message.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    framed.put_slice(message);
    framed.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    async fn read(body: ::tonic::body::Body, gzip: bool) -> Result<Vec<u8>, MessageError> {
        let mut body = MessageBody::new(body, gzip, 1 << 20, Box::new(|| {}));
        let mut out = Vec::new();
        while let Some(piece) = poll_fn(|cx| body.poll_chunk(cx)).await {
            out.extend_from_slice(&piece?);
        }
        Ok(out)
    }

    fn chunked(chunks: Vec<Bytes>) -> ::tonic::body::Body {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(c)));
        let stream = futures_util::stream::iter(frames);
        ::tonic::body::Body::new(http_body_util::StreamBody::new(stream))
    }

    fn gzip(message: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(message).expect("in memory");
        encoder.finish().expect("in memory")
    }

    #[tokio::test]
    async fn the_message_is_read_without_its_frame_whatever_the_chunking() {
        let message = b"a protobuf message".repeat(100);
        let framed = frame(&message);
        for size in [1, 3, 5, 6, 700, framed.len()] {
            let chunks = framed.chunks(size).map(Bytes::copy_from_slice).collect();
            let read = read(chunked(chunks), false).await.expect("one message");
            assert_eq!(read, message, "chunks of {size}");
        }
    }

    #[tokio::test]
    async fn a_gzip_compressed_message_reads_as_the_same_message() {
        let message = b"the same request, compressed".repeat(500);
        let compressed = gzip(&message);
        let mut framed = vec![1];
        framed.extend_from_slice(&(compressed.len() as u32).to_be_bytes());
        framed.extend_from_slice(&compressed);
        for size in [1, 7, 2000, framed.len()] {
            let chunks = framed.chunks(size).map(Bytes::copy_from_slice).collect();
            let read = read(chunked(chunks), true).await.expect("one message");
            assert_eq!(read, message, "chunks of {size}");
        }
    }

    #[tokio::test]
    async fn a_second_message_a_cut_frame_and_an_unknown_encoding_are_errors() {
        let mut two = frame(b"one").to_vec();
        two.extend_from_slice(&frame(b"two"));
        let second = read(chunked(vec![Bytes::from(two)]), false).await;
        assert!(matches!(second, Err(MessageError::SecondMessage)));
        let cut = frame(b"cut short").slice(..8);
        let cut = read(chunked(vec![cut]), false).await;
        assert!(matches!(cut, Err(MessageError::Malformed)));
        let compressed = Bytes::from_static(&[1, 0, 0, 0, 1, 0]);
        let unknown = read(chunked(vec![compressed]), false).await;
        assert!(matches!(unknown, Err(MessageError::Encoding)));
    }

    #[tokio::test]
    async fn an_empty_message_and_an_empty_body_read_as_nothing() {
        let empty = read(chunked(vec![frame(b"")]), false).await.expect("ok");
        assert!(empty.is_empty());
        let none = read(::tonic::body::Body::empty(), false).await.expect("ok");
        assert!(none.is_empty());
    }
}
