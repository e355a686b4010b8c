//! Opening a segment and decoding all of it must never panic: every malformed
//! input is a located `Error`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::segment::Segment;

fuzz_target!(|data: &[u8]| {
    let Ok(seg) = Segment::from_bytes(data) else {
        return;
    };
    for ord in 0..seg.num_series() as u32 {
        for c in seg.chunks(ord) {
            if let Ok(dec) = seg.chunk_decoder(c) {
                for s in dec {
                    if s.is_err() {
                        break;
                    }
                }
            }
        }
    }
});
