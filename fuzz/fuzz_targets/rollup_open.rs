//! Opening a rollup file and decoding every block must never panic: every
//! malformed input is a located `Error`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::{RollupFile, RollupLevel, RollupTier};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = RollupFile::from_bytes(data) else {
        return;
    };
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let mut n = 0u64;
            f.for_each(tier, level, i64::MIN, i64::MAX, |_, r| {
                assert!(r.count >= 1 && r.first_ts_ms <= r.last_ts_ms);
                n += 1;
            })
            .expect("a file that opened decodes");
            let _ = n;
        }
    }
});
