use super::*;
use proptest::prelude::*;

fn ts_round_trip(ts: &[i64]) -> Vec<i64> {
    let mut b = Vec::new();
    encode_ts(ts, &mut b);
    let mut out = Vec::new();
    decode_ts(&b, ts.len(), &mut out).expect("decode ts");
    out
}

fn val_round_trip(vals: &[f64]) -> (Vec<f64>, Vec<u8>) {
    let mut b = Vec::new();
    encode_values(vals, &mut b);
    let mut out = Vec::new();
    decode_values(&b, vals.len(), &mut out).expect("decode values");
    (out, b)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Golden bytes, by hand: ts 1000, 2000, 3003 -> varints of 1000, 1000, 3
/// (zigzag 2000 = d0 0f; 6 = 06), kind 1, too short for zstd.
#[test]
fn golden_ts_block() {
    let mut b = Vec::new();
    encode_ts(&[1000, 2000, 3003], &mut b);
    assert_eq!(b, [0x01, 0xd0, 0x0f, 0xd0, 0x0f, 0x06]);
}

/// 71.4, 71.4, 71.5 -> scale 1: 714, 714, 715. Order 0: 3 two-byte varints
/// (6 bytes); order 1: 714, 0, 1 -> zigzag 1428, 0, 2 -> 94 0b, 00, 02
/// (4 bytes); order 2: 714, -714, 715 (6 bytes). So: kind 2, scale 1,
/// order 1, 94 0b 00 02.
#[test]
fn golden_decimal_block() {
    let (out, b) = val_round_trip(&[71.4, 71.4, 71.5]);
    assert_eq!(b, [0x02, 0x01, 0x01, 0x94, 0x0b, 0x00, 0x02]);
    assert_eq!(bits(&out), bits(&[71.4, 71.4, 71.5]));
}

#[test]
fn picks_xor_or_raw_for_non_decimals() {
    let vals = [f64::NAN, -0.0, 1.0 / 3.0, f64::INFINITY];
    let (out, b) = val_round_trip(&vals);
    assert!(b[0] & !ZSTD_FLAG == VAL_XOR || b[0] & !ZSTD_FLAG == VAL_RAW);
    assert_eq!(bits(&out), bits(&vals));
}

#[test]
fn long_repeats_compress_to_almost_nothing() {
    let vals: Vec<f64> = (0..4096)
        .map(|i| if i < 3000 { 120.5 } else { 121.25 })
        .collect();
    let (out, b) = val_round_trip(&vals);
    assert_eq!(bits(&out), bits(&vals));
    assert!(b.len() < 40, "{} bytes", b.len());
    let ts: Vec<i64> = (0..4096).map(|i| 1_775_000_000_000 + i * 100).collect();
    let mut tb = Vec::new();
    encode_ts(&ts, &mut tb);
    assert!(tb.len() < 40, "{} bytes", tb.len());
    assert_eq!(ts_round_trip(&ts), ts);
}

#[test]
fn decimal_detection_is_exact() {
    assert_eq!(as_decimal(&[1.0, 2.0]).unwrap().0, 0);
    assert_eq!(as_decimal(&[0.000006, 5e-6]).unwrap().0, 6);
    assert_eq!(as_decimal(&[238749445947.0]).unwrap().0, 0);
    assert!(
        as_decimal(&[0.1 + 0.2]).is_none(),
        "0.30000000000000004 has 17 digits"
    );
    assert!(
        as_decimal(&[-0.0]).is_none(),
        "-0.0 would come back as +0.0"
    );
    assert!(as_decimal(&[f64::NAN]).is_none());
    assert!(as_decimal(&[1e300]).is_none());
}

#[test]
fn truncated_blocks_are_errors_not_panics() {
    for vals in [
        vec![71.4; 50],
        vec![f64::NAN; 50],
        (0..50).map(|i| i as f64 / 3.0).collect(),
    ] {
        let mut b = Vec::new();
        encode_values(&vals, &mut b);
        for cut in 0..b.len() {
            let mut out = Vec::new();
            assert!(
                decode_values(&b[..cut], vals.len(), &mut out).is_err(),
                "cut {cut}"
            );
        }
    }
    let mut b = Vec::new();
    encode_ts(&(0..50).map(|i| i * 1000).collect::<Vec<_>>(), &mut b);
    for cut in 0..b.len() {
        assert!(
            decode_ts(&b[..cut], 50, &mut Vec::new()).is_err(),
            "cut {cut}"
        );
    }
    // A zstd header that declares a huge size is refused before allocating.
    assert_eq!(
        decode_values(
            &[VAL_DECIMAL | ZSTD_FLAG, 0xff, 0xff, 0xff, 0x7f],
            4,
            &mut Vec::new()
        ),
        Err(ColumnError::BadLength)
    );
}

fn arb_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        Just(f64::NAN),
        Just(-0.0),
        (-100_000i64..100_000).prop_map(|i| i as f64 / 10.0),
        (0i64..1_000_000).prop_map(|i| i as f64 / 1e6),
        any::<i32>().prop_map(|i| i as f64),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn decimals_with_negative_zero_round_trip(vals in prop::collection::vec(prop_oneof![Just(-0.0), (-50i64..50).prop_map(|i| i as f64 / 4.0)], 1..100)) {
        let (out, _) = val_round_trip(&vals);
        prop_assert_eq!(bits(&out), bits(&vals));
    }

    #[test]
    fn values_round_trip_bit_exact(vals in prop::collection::vec(arb_f64(), 1..600)) {
        let (out, _) = val_round_trip(&vals);
        prop_assert_eq!(bits(&out), bits(&vals));
    }

    #[test]
    fn decimal_series_round_trip(start in -10_000i64..10_000, steps in prop::collection::vec(-3i64..4, 1..2000), d in 0u32..7) {
        let mut x = start;
        let vals: Vec<f64> = steps.iter().map(|s| { x += s; x as f64 / 10f64.powi(d as i32) }).collect();
        let (out, _) = val_round_trip(&vals);
        prop_assert_eq!(bits(&out), bits(&vals));
    }

    #[test]
    fn ts_round_trip_any(ts in prop::collection::vec(any::<i64>(), 1..300)) {
        prop_assert_eq!(ts_round_trip(&ts), ts);
    }
}

/// The reused per-thread context writes the bytes a fresh one does, so the
/// files' bytes (and their golden copies in docs/format) do not depend on
/// what the thread compressed before.
#[test]
fn the_reused_zstd_context_writes_what_a_fresh_one_does() {
    let payloads: Vec<Vec<u8>> = vec![
        (0..10_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect(),
        b"DCGM_FI_DEV_GPU_TEMP".repeat(300),
        (0..5_000u64)
            .flat_map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes())
            .collect(),
        vec![7; 33],
    ];
    for round in 0..2 {
        for p in &payloads {
            assert_eq!(
                zstd_compress(p).unwrap(),
                zstd::bulk::compress(p, 3).unwrap(),
                "round {round}, {} bytes",
                p.len()
            );
        }
    }
}
