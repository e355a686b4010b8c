//! The agent's spool record decoder must never panic, and every length it
//! reports must lie within its input (loading advances by it).
#![no_main]

use agent::spool::decode_record;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok((batch, len)) = decode_record(rest) {
        assert!(len > 0 && len <= rest.len());
        assert_eq!(batch.series_ids.len(), batch.values.len());
        rest = &rest[len..];
    }
});
