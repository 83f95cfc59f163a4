//! The framing every hash of the crate shares (fingerprint, scope, derived keys, lock keys) and
//! the short form in which a hash appears in log lines.
//!
//! Each value is framed so that an absent value differs from an empty one:
//!
//! | frame | bytes |
//! |---|---|
//! | absent | `0x00` |
//! | bytes | `0x01`, length as u64 big-endian, the bytes |
//! | list | `0x02`, count as u64 big-endian, each element framed |

use std::fmt;

use sha2::{Digest, Sha256};

/// Writes framed values into a running SHA-256.
pub(crate) struct Encoder<'h>(pub(crate) &'h mut Sha256);

impl Encoder<'_> {
    pub(crate) fn absent(&mut self) {
        self.0.update([0x00]);
    }

    pub(crate) fn bytes(&mut self, value: &[u8]) {
        self.0.update(Self::frame(0x01, value.len()));
        self.0.update(value);
    }

    pub(crate) fn opt_bytes(&mut self, value: Option<&[u8]>) {
        match value {
            Some(v) => self.bytes(v),
            None => self.absent(),
        }
    }

    pub(crate) fn list(&mut self, count: usize) {
        self.0.update(Self::frame(0x02, count));
    }

    /// A frame's tag and length, as one update: the hash sees the same bytes as from two, for
    /// half the calls (each copies into the hash's block buffer).
    fn frame(tag: u8, len: usize) -> [u8; 9] {
        let mut frame = [tag; 9];
        frame[1..].copy_from_slice(&(len as u64).to_be_bytes());
        frame
    }
}

/// The first eight bytes of a hash in hex, for log lines.
pub(crate) struct ShortHash<'a>(pub &'a [u8; 32]);

impl fmt::Display for ShortHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
