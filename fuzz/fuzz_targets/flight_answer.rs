//! A peer's select answer (Arrow IPC over Flight) is checked before it is
//! merged: schema, nulls, list lengths, series keys, time order. Whatever a
//! broken or hostile peer sends must be an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        // libFuzzer's hook aborts on every panic, even one that is caught.
        // Arrow's IPC decoder panics on some malformed input (arrow-ipc
        // 59.3.2, convert.rs: a schema without a field list; arrow-buffer,
        // from the decoder: a validity buffer shorter than its array); the
        // node catches panics of that step (`ClusterReader::fetch`,
        // `fetch_health`) and so does `fuzzing`, so they unwind to that catch
        // here too. A panic anywhere else, gpulse's decoders included, is
        // still a crash.
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if query::cluster::fuzzing::in_arrow_decoder()
                || info.location().is_some_and(|l| l.file().contains("/arrow-ipc-"))
            {
                return;
            }
            abort(info);
        }));
    },
    |data: &[u8]| {
        let _ = query::cluster::fuzzing::answer(data);
    }
);
