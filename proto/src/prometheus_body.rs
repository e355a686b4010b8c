//! The framing of Prometheus remote read and write bodies: snappy block
//! format, then protobuf. Shared by remote write (`ingest`) and remote read
//! (`query`); fuzzed by `fuzz/fuzz_targets/remote_request.rs`.

use crate::prometheus::{ReadRequest, WriteRequest};
use prost::Message;

/// Why a request body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// The snappy header declares more bytes than allowed; nothing was allocated.
    TooLarge { len: usize, max: usize },
    /// Not snappy block format.
    Snappy(String),
    /// Not the expected protobuf message.
    Protobuf {
        message: &'static str,
        error: String,
    },
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge { len, max } => write!(
                f,
                "decompressed body would be {len} bytes, more than the limit of {max}"
            ),
            Self::Snappy(e) => write!(f, "body is not snappy-compressed: {e}"),
            Self::Protobuf { message, error } => {
                write!(f, "body is not a {message}: {error}")
            }
        }
    }
}

impl BodyError {
    /// The HTTP status that answers it: 413 for a body over the limit, 400
    /// for the rest.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::TooLarge { .. } => 413,
            _ => 400,
        }
    }
}

/// Snappy-decodes a body after checking the length its header declares.
///
/// # Errors
/// [`BodyError::TooLarge`] or [`BodyError::Snappy`].
pub fn decompress(body: &[u8], max: usize) -> Result<Vec<u8>, BodyError> {
    let len = snap::raw::decompress_len(body).map_err(|e| BodyError::Snappy(e.to_string()))?;
    if len > max {
        return Err(BodyError::TooLarge { len, max });
    }
    snap::raw::Decoder::new()
        .decompress_vec(body)
        .map_err(|e| BodyError::Snappy(e.to_string()))
}

/// A remote-write body.
///
/// # Errors
/// As [`decompress`], or [`BodyError::Protobuf`].
pub fn write_request(body: &[u8], max: usize) -> Result<WriteRequest, BodyError> {
    let raw = decompress(body, max)?;
    WriteRequest::decode(raw.as_slice()).map_err(|e| BodyError::Protobuf {
        message: "prometheus.WriteRequest",
        error: e.to_string(),
    })
}

/// A remote-read body.
///
/// # Errors
/// As [`write_request`].
pub fn read_request(body: &[u8], max: usize) -> Result<ReadRequest, BodyError> {
    let raw = decompress(body, max)?;
    ReadRequest::decode(raw.as_slice()).map_err(|e| BodyError::Protobuf {
        message: "prometheus.ReadRequest",
        error: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snappy_length_is_checked_before_allocating() {
        // A header that claims 4 GiB - 1 followed by nothing: refused on the header.
        // (The uvarint of 2^32 - 1: four bytes of 7 ones with the high bit, then 15.)
        let lie = [0xff, 0xff, 0xff, 0xff, 0x0f];
        let e = decompress(&lie, 1 << 20).unwrap_err();
        assert_eq!(
            e,
            BodyError::TooLarge {
                len: u32::MAX as usize,
                max: 1 << 20
            }
        );
        assert!(e.to_string().contains("4294967295"), "{e}");

        let e = decompress(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 1 << 20).unwrap_err();
        assert!(matches!(e, BodyError::Snappy(_)), "{e:?}");

        let data = b"hello hello hello hello".repeat(10);
        let packed = snap::raw::Encoder::new().compress_vec(&data).unwrap();
        assert_eq!(decompress(&packed, 1 << 20).unwrap(), data);
        assert_eq!(
            decompress(&packed, data.len() - 1).unwrap_err(),
            BodyError::TooLarge {
                len: data.len(),
                max: data.len() - 1
            }
        );
    }
}
