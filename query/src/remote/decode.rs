//! Decoding of remote read and write request bodies: snappy block format,
//! then protobuf. Depends on nothing but `snap`, `prost` and the wire types,
//! so the fuzz targets (`fuzz/fuzz_targets/remote_request.rs`) compile it
//! as it is.

use gpulse_proto::prometheus::{ReadRequest, WriteRequest};
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
