//! A peer's health answer (events or GPU states, Arrow IPC over Flight) is
//! checked before it is merged: columns, types, nulls, kinds, severities,
//! states, GPU indexes. Whatever a broken or hostile peer sends must be an
//! error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        query::cluster::fuzzing::let_arrow_decoder_panics_unwind();
    },
    |data: &[u8]| {
        let _ = query::cluster::fuzzing::health_answer(data);
    }
);
