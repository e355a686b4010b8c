//! A peer's select answer (Arrow IPC over Flight) is checked before it is
//! merged: schema, nulls, list lengths, series keys, time order; so is its
//! answer to a PromQL ticket (the same schema, read as partial results).
//! Whatever a broken or hostile peer sends must be an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        query::cluster::fuzzing::let_arrow_decoder_panics_unwind();
    },
    |data: &[u8]| {
        let _ = query::cluster::fuzzing::answer(data);
        let _ = query::cluster::fuzzing::partials_answer(data);
    }
);
