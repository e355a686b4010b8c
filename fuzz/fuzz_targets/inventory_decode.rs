//! The inventory file decoder must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = storage::inventory::decode(data);
});
