//! The Prometheus XOR chunk decoder must never panic, and what it decodes
//! must encode back to the same samples.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../query/src/remote_read/xor.rs"]
mod xor;

fuzz_target!(|data: &[u8]| {
    let Ok(samples) = xor::decode(data) else {
        return;
    };
    let mut c = xor::XorChunk::new();
    for &(t, v) in &samples {
        c.append(t, v);
    }
    let again = xor::decode(c.bytes()).expect("re-encoded chunk decodes");
    assert_eq!(again.len(), samples.len());
    for (a, b) in again.iter().zip(&samples) {
        assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()));
    }
});
