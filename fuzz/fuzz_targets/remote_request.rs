//! Remote read and write request bodies (snappy, then protobuf) must never
//! panic, nor allocate what the snappy header claims beyond the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../query/src/remote/decode.rs"]
mod decode;

fuzz_target!(|data: &[u8]| {
    let _ = decode::write_request(data, 1 << 20);
    let _ = decode::read_request(data, 1 << 20);
});
