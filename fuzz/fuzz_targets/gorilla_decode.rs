//! The Gorilla decoder must never panic, whatever the bytes and sample count,
//! and must stop after `count` samples or at the first error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::gorilla::GorillaDecoder;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let count = u16::from_le_bytes([data[0], data[1]]) as u32;
    let mut n = 0u32;
    let mut errors = 0;
    for s in GorillaDecoder::new(&data[2..], count) {
        n += 1;
        if s.is_err() {
            errors += 1;
        }
    }
    assert!(n <= count);
    assert!(errors <= 1);
});
