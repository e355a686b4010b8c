//! Opening a segment and decoding all of it must never panic: every malformed
//! input is a located `Error`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::segment::Segment;

fuzz_target!(|data: &[u8]| {
    let Ok(seg) = Segment::from_bytes(data) else {
        return;
    };
    let (mut ts, mut vals) = (Vec::new(), Vec::new());
    for ord in 0..seg.num_series() as u32 {
        for c in seg.chunks(ord) {
            if seg.read_chunk(c, &mut ts, &mut vals).is_ok() {
                assert_eq!(ts.len(), vals.len());
            }
        }
    }
});
