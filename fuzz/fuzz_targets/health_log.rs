//! Reading the health event log (`health/events.log`, which a crash can
//! tear and a disk can damage) must never panic: every input is either
//! refused (no header, another version) or read up to its first bad record.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("events.log");
    if let Ok(r) = health::log::read(data, path) {
        assert!(r.dropped_bytes <= data.len() as u64);
        assert!(r.events.len() as u64 <= r.records);
        // Ids are unique and in order: the last record of an id wins.
        assert!(r.events.windows(2).all(|w| w[0].id < w[1].id));
    }
});
