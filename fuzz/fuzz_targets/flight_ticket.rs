//! A Flight `DoGet` ticket comes from any client that reaches a node's
//! Flight port: its decoder must refuse garbage with an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = query::cluster::fuzzing::ticket(data);
});
