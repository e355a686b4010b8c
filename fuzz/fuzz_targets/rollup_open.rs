//! Opening a rollup file and decoding every block must never panic: every
//! malformed input is a located `Error`, at the open or (version 5 blocks)
//! at the first read of the block.
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
            let read = f.for_each(tier, level, i64::MIN, i64::MAX, |_, r| {
                assert!(r.count >= 1 && r.first_ts_ms <= r.last_ts_ms);
                n += 1;
            });
            if f.version() < 5 {
                read.expect("a file of version 1 to 4 that opened decodes");
            }
            let _ = n;
        }
    }
});
