use super::*;
use proptest::prelude::*;

fn encode(samples: &[(i64, f64)]) -> GorillaEncoder {
    let mut e = GorillaEncoder::new();
    for &(t, v) in samples {
        e.append(t, v);
    }
    e
}

fn decode(bytes: &[u8], count: u32) -> Result<Vec<(i64, f64)>, DecodeError> {
    GorillaDecoder::new(bytes, count).collect()
}

fn assert_bit_exact(got: &[(i64, f64)], want: &[(i64, f64)]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.0, w.0, "timestamp of sample {i}");
        assert_eq!(g.1.to_bits(), w.1.to_bits(), "value bits of sample {i}");
    }
}

/// Golden bytes, derived by hand from the format in the module docs:
/// ts 1000 -> zigzag 2000 -> LEB128 d0 0f; 1.0 -> 3ff0000000000000;
/// delta 1000 -> d0 0f; then '0' (same value), '0' (dod 0), '0' (same value),
/// padded to one zero byte.
#[test]
fn golden_constant_series() {
    let e = encode(&[(1000, 1.0), (2000, 1.0), (3000, 1.0)]);
    assert_eq!(
        e.bytes(),
        &[0xd0, 0x0f, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0xd0, 0x0f, 0x00]
    );
}

/// 1.0 ^ 2.0 = 0x7ff0000000000000: 1 leading zero, 52 trailing, 11 meaningful.
/// '11' + 00001 + 001011 + 11111111111 = c2 5f ff; then '0' '0' -> 00.
#[test]
fn golden_value_change() {
    let e = encode(&[(1000, 1.0), (2000, 2.0), (3000, 2.0)]);
    assert_eq!(
        e.bytes(),
        &[
            0xd0, 0x0f, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0xd0, 0x0f, 0xc2, 0x5f, 0xff, 0x00
        ]
    );
}

/// Jitter of +3 ms lands in the '10' + 14-bit delta-of-delta bucket.
#[test]
fn golden_jitter_bucket() {
    let e = encode(&[(0, 5.0), (1000, 5.0), (2003, 5.0)]);
    let b = e.bytes();
    // ts0 0 -> 00; value 5.0 -> 4014000000000000; delta 1000 -> d0 0f; '0'.
    assert_eq!(&b[..11], &[0x00, 0x40, 0x14, 0, 0, 0, 0, 0, 0, 0xd0, 0x0f]);
    // The first sample-1 bit ('0' for the value) is the top bit of b[11]; the
    // dod bucket follows it: 0 10 00000000000011 0 -> 0100 0000 0000 0001 10..
    assert_eq!(&b[11..], &[0x40, 0x01, 0x80]);
}

#[test]
fn edge_cases_round_trip() {
    let cases: Vec<Vec<(i64, f64)>> = vec![
        vec![(42, 1.5)],
        vec![(0, 0.0), (1, -0.0), (2, 0.0)],
        vec![
            (1, f64::NAN),
            (2, f64::from_bits(0x7ff8_dead_beef_0001)),
            (3, f64::INFINITY),
            (4, f64::NEG_INFINITY),
            (5, f64::MIN_POSITIVE),
            (6, f64::MAX),
        ],
        vec![(i64::MIN, 1.0), (i64::MAX, 2.0), (0, 3.0), (i64::MIN, 4.0)],
        (0..1000).map(|i| (i * 1000, 100.0)).collect(),
        // counter with a reset
        vec![
            (0, 10.0),
            (1000, 20.0),
            (2000, 30.0),
            (3000, 1.0),
            (4000, 2.0),
        ],
        // huge delta-of-delta (a stall of a day)
        vec![(0, 1.0), (1000, 1.0), (86_400_000, 1.0), (86_401_000, 1.0)],
    ];
    for samples in cases {
        let e = encode(&samples);
        let got = decode(e.bytes(), e.count()).expect("decode");
        assert_bit_exact(&got, &samples);
        // The first timestamp, read back from the bytes, and the last.
        assert_eq!(e.first_ts(), samples.first().map(|s| s.0));
        assert_eq!(e.last_ts(), samples.last().map(|s| s.0));
    }
    assert_eq!(GorillaEncoder::new().first_ts(), None);
}

#[test]
fn appending_keeps_earlier_bytes() {
    let mut e = encode(&[(1000, 1.0), (2000, 2.5)]);
    let before = e.bytes().to_vec();
    e.append(3000, 7.25);
    // Everything but the last (partial) byte of the earlier output is unchanged.
    let n = before.len() - 1;
    assert_eq!(&e.bytes()[..n], &before[..n]);
}

#[test]
fn truncated_input_is_an_error_not_a_panic() {
    let samples: Vec<(i64, f64)> = (0..50).map(|i| (i * 997, i as f64 * 1.1)).collect();
    let e = encode(&samples);
    for cut in 0..e.bytes().len() {
        let r = decode(&e.bytes()[..cut], e.count());
        assert!(r.is_err(), "cut at {cut} decoded");
    }
}

#[test]
fn garbage_never_panics() {
    // A fixed, seeded sweep of byte patterns; the fuzz target goes further.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..2000 {
        let mut bytes = Vec::new();
        for _ in 0..(x % 40) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bytes.push(x as u8);
        }
        let _ = decode(&bytes, (x % 100) as u32);
    }
}

fn arb_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        Just(f64::NAN),
        Just(-0.0),
        Just(0.0),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        (0i32..1000).prop_map(|i| i as f64),
        (0i32..1000).prop_map(|i| i as f64 / 10.0),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_is_bit_exact(samples in prop::collection::vec((any::<i64>(), arb_f64()), 0..300)) {
        let e = encode(&samples);
        let got = decode(e.bytes(), e.count()).expect("decode");
        assert_bit_exact(&got, &samples);
    }

    #[test]
    fn round_trip_regular_series(
        start in -1_000_000_000_000i64..2_000_000_000_000,
        jitter in prop::collection::vec(-50i64..50, 1..500),
        values in prop::collection::vec(arb_f64(), 500),
    ) {
        let samples: Vec<(i64, f64)> = jitter
            .iter()
            .enumerate()
            .map(|(i, j)| (start + i as i64 * 1000 + j, values[i]))
            .collect();
        let e = encode(&samples);
        let got = decode(e.bytes(), e.count()).expect("decode");
        assert_bit_exact(&got, &samples);
    }
}

/// The XOR window shares a word with the count: its widest values (63
/// trailing zeros from a sign flip, leading zeros capped at 31) survive it,
/// and a buffer made with room writes the bytes a growing one does.
#[test]
fn widest_windows_and_a_preallocated_buffer_round_trip() {
    let values = [1.0, -1.0, -1.0, 1.0, f64::from_bits(1), f64::from_bits(3)];
    let samples: Vec<(i64, f64)> = (0..1000)
        .map(|i| (i * 1000, values[i as usize % values.len()]))
        .collect();
    let mut e = GorillaEncoder::new();
    e.append(0, 1.0);
    e.append(1000, -1.0);
    assert_eq!(e.window(), Some((0, 63)));
    assert_eq!(e.count(), 2);
    e.append(2000, f64::from_bits(1));
    // 0xBFF0.. ^ 1: no leading zeros; the window does not fit, a new one is set.
    assert_eq!(e.window(), Some((0, 0)));

    let grown = encode(&samples);
    let mut pre = GorillaEncoder::with_capacity(5000);
    for &(t, v) in &samples {
        pre.append(t, v);
    }
    assert_eq!(pre.bytes(), grown.bytes());
    assert_eq!((pre.count(), grown.count()), (1000, 1000));
    assert_bit_exact(&decode(grown.bytes(), grown.count()).unwrap(), &samples);
}
