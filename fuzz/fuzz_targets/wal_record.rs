//! The WAL record decoder must never panic, and every length it reports must
//! lie within its input (replay advances by it). The input is read twice:
//! as a log, and as one record's type and payload framed with a valid length
//! and checksum, so that mutations reach the payload parsers (a series batch
//! record's zstd frame among them) instead of failing the checksum.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::wal::record::decode;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok((_, len)) = decode(rest) {
        assert!(len > 0 && len <= rest.len());
        rest = &rest[len..];
    }
    if !data.is_empty() {
        let mut framed = Vec::with_capacity(data.len() + 8);
        framed.extend_from_slice(&(data.len() as u32).to_le_bytes());
        framed.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
        framed.extend_from_slice(data);
        if let Ok((_, len)) = decode(&framed) {
            assert_eq!(len, framed.len());
        }
    }
});
