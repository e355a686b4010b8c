//! The WAL record decoder must never panic, and every length it reports must
//! lie within its input (replay advances by it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::wal::record::decode;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok((_, len)) = decode(rest) {
        assert!(len > 0 && len <= rest.len());
        rest = &rest[len..];
    }
});
