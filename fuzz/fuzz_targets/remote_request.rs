//! Remote read and write request bodies (snappy, then protobuf) must never
//! panic, nor allocate what the snappy header claims beyond the limit; and
//! the write path's zero-copy reader (`ingest/src/remote_write/wire.rs`) must take every body
//! prost takes and decode it exactly as prost does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;

use gpulse_proto::prometheus_body as decode;
use ingest::remote_write::wire;

fuzz_target!(|data: &[u8]| {
    let _ = decode::write_request(data, 1 << 20);
    let _ = decode::read_request(data, 1 << 20);

    // The same bytes as an uncompressed WriteRequest.
    let prost = gpulse_proto::prometheus::WriteRequest::decode(data);
    let mut raw = wire::RawWrite::default();
    let ours = raw.read(data);
    match prost {
        // Refused by prost: the reader may still take it when only a field
        // it skips (exemplars, metadata) is malformed.
        Err(_) => {}
        Ok(req) => {
            assert!(ours.is_ok(), "the raw reader refused what prost took: {ours:?}");
            assert_eq!(req.timeseries.len(), raw.series.len());
            for (p, r) in req.timeseries.iter().zip(&raw.series) {
                let labels = wire::labels(&raw.label_bytes[r.labels.clone()]).unwrap();
                let want: Vec<(String, String)> =
                    p.labels.iter().map(|l| (l.name.clone(), l.value.clone())).collect();
                assert_eq!(labels, want);
                let got: Vec<(i64, u64)> = raw.timestamps[r.samples.clone()]
                    .iter()
                    .zip(&raw.values[r.samples.clone()])
                    .map(|(&t, v)| (t, v.to_bits()))
                    .collect();
                let want: Vec<(i64, u64)> =
                    p.samples.iter().map(|s| (s.timestamp, s.value.to_bits())).collect();
                assert_eq!(got, want);
                assert_eq!(r.histograms, !p.histograms.is_empty());
            }
        }
    }
});
