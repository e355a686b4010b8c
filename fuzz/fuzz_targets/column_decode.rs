//! The column decoders must never panic or allocate beyond their bounds,
//! whatever the bytes and the declared sample count.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::column::{decode_ts, decode_values};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let n = u16::from_le_bytes([data[0], data[1]]) as usize;
    let (mut ts, mut vals) = (Vec::new(), Vec::new());
    if decode_ts(&data[2..], n, &mut ts).is_ok() {
        assert_eq!(ts.len(), n);
    }
    if decode_values(&data[2..], n, &mut vals).is_ok() {
        assert_eq!(vals.len(), n);
    }
});
