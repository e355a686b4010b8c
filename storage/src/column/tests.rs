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

/// Golden bytes, by hand: ts 1000, 2000, 3003 -> kind 2, order 2, the
/// heads 1000 and 1000 (zigzag 2000 = d0 0f), then one frame of the
/// delta-of-delta 3: width 0, min 3 (zigzag 06). Too short for zstd.
#[test]
fn golden_ts_block() {
    let mut b = Vec::new();
    encode_ts(&[1000, 2000, 3003], &mut b);
    assert_eq!(b, [0x02, 0x02, 0xd0, 0x0f, 0xd0, 0x0f, 0x00, 0x06]);
}

/// A timestamp block of segment v2 (kind 1: zigzag varints of 1000, 1000, 3)
/// still decodes.
#[test]
fn version_2_ts_block_decodes() {
    let mut out = Vec::new();
    decode_ts(&[0x01, 0xd0, 0x0f, 0xd0, 0x0f, 0x06], 3, &mut out).unwrap();
    assert_eq!(out, [1000, 2000, 3003]);
}

/// 71.4, 71.4, 71.5 -> scale 1: 714, 714, 715.
/// Varints: order 0 is 3 two-byte varints (6 bytes); order 1: 714, 0, 1 ->
/// zigzag 1428, 0, 2 -> 94 0b, 00, 02 (4 bytes); order 2: 714, -714, 715
/// (6 bytes). Best: kind 2, scale 1, order 1, 94 0b 00 02: 7 bytes.
/// Packed: order 0 is one frame, min 714 (zigzag 94 0b), offsets 0, 0, 1
/// in 1 bit (0b100): kind 3, scale 1, order 0, width 1, 94 0b, 04: also
/// 7 bytes (orders 1 and 2 take 8). Packed decodes faster, so it wins.
#[test]
fn golden_decimal_block() {
    let (out, b) = val_round_trip(&[71.4, 71.4, 71.5]);
    assert_eq!(b, [0x03, 0x01, 0x00, 0x01, 0x94, 0x0b, 0x04]);
    assert_eq!(bits(&out), bits(&[71.4, 71.4, 71.5]));
    // The varint block of segment v2 still decodes.
    let mut v2 = Vec::new();
    decode_values(&[0x02, 0x01, 0x01, 0x94, 0x0b, 0x00, 0x02], 3, &mut v2).unwrap();
    assert_eq!(bits(&v2), bits(&[71.4, 71.4, 71.5]));
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
    // Bit-packed: 32 frames of width 0, each a width byte and its minimum
    // (2 to 3 bytes): under 0.02 B/sample. Varints under zstd would take
    // under 40 bytes, but within the packed encoding's slack of 1/64 byte
    // per sample, and packed frames decode faster.
    assert_eq!(b[0], VAL_PACKED);
    assert!(b.len() < 4096 / 50, "{} bytes", b.len());
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

fn unpacked(payload: &[u8], n: usize) -> Result<Vec<i64>, ColumnError> {
    let mut out = Vec::new();
    packed::unpack(payload, n, |f| out.extend_from_slice(f))?;
    Ok(out)
}

/// By hand: 5, 7, 6, 9 at order 0 -> min 5, offsets 0, 2, 1, 4 in 3 bits
/// (2 bits and an exception for the 4 would take 6 bytes, not 4): order 0,
/// width 3, zigzag 5 = 0x0a, then bits 000 010 001 100 from the lowest:
/// bit 4 and 6 (0x50), bit 11 (0x08).
#[test]
fn golden_packed_frame() {
    let mut p = Vec::new();
    packed::pack(&[5, 7, 6, 9], 0, &mut p);
    assert_eq!(p, [0x00, 0x03, 0x0a, 0x50, 0x08]);
    assert_eq!(unpacked(&p, 4).unwrap(), [5, 7, 6, 9]);
}

/// By hand: twenty zeros and a 1000. Packing 10 bits for all would take 29
/// bytes; width 0 with the 1000 as an exception takes 6: order 0, width 0
/// with the exception flag (0x80), min 0, one exception at index 20 (0x14)
/// of 1000 >> 0 (uvarint e8 07).
#[test]
fn golden_patched_frame() {
    let mut xs = vec![0i64; 20];
    xs.push(1000);
    let mut p = Vec::new();
    packed::pack(&xs, 0, &mut p);
    assert_eq!(p, [0x00, 0x80, 0x00, 0x01, 0x14, 0xe8, 0x07]);
    assert_eq!(unpacked(&p, 21).unwrap(), xs);
}

/// The first `order` values go before the frames: at order 1 a timestamp
/// grid is its start, then one frame of equal steps (width 0).
#[test]
fn packed_heads_keep_the_frames_narrow() {
    let ts: Vec<i64> = (0..300).map(|i| 1_775_000_000_000 + i * 1000).collect();
    let mut p = Vec::new();
    packed::pack(&ts, 1, &mut p);
    // order, a 6-byte head, then three frames of width 0 (1 + 2 bytes each).
    assert_eq!(p.len(), 1 + 6 + 3 * 3, "{p:02x?}");
    assert_eq!(unpacked(&p, 300).unwrap(), ts);
}

#[test]
fn forged_packed_payloads_are_errors_not_panics() {
    // Width over 64; an exception index past the frame; an exception on a
    // 64-bit frame; no exceptions behind the flag; trailing bytes; an order
    // over 2.
    for (p, n) in [
        (vec![0x00, 0x41, 0x00], 1),
        (vec![0x00, 0x80, 0x00, 0x01, 0x05, 0x01], 2),
        (
            vec![0x00, 0xc0, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x00, 0x01],
            1,
        ),
        (vec![0x00, 0x80, 0x00, 0x00], 1),
        (vec![0x00, 0x00, 0x00, 0x00], 1),
        (vec![0x03, 0x00, 0x00], 1),
    ] {
        assert_eq!(unpacked(&p, n), Err(ColumnError::BadLength), "{p:02x?}");
    }
}

/// Integers of a width picked first, with a few outliers: full frames of
/// every width (the unrolled unpack) and frames with exceptions.
fn narrow_with_outliers() -> impl Strategy<Value = Vec<i64>> {
    (0u32..=60, 1usize..600).prop_flat_map(|(w, n)| {
        prop::collection::vec(
            prop_oneof![
                30 => 0i64..=(1i64 << w),
                1 => any::<i64>(),
            ],
            n,
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn packed_round_trips_narrow(xs in narrow_with_outliers(), order in 0u8..3) {
        let mut p = Vec::new();
        packed::pack(&xs, order, &mut p);
        prop_assert_eq!(packed::plan(&xs, order).len, p.len());
        prop_assert_eq!(unpacked(&p, xs.len()).unwrap(), xs);
    }

    /// Every width, exceptions, the fast and slow unpack paths and wrapping
    /// differences at the ends of i64.
    #[test]
    fn packed_round_trips(
        xs in prop::collection::vec(prop_oneof![
            any::<i64>(),
            (-40i64..40),
            Just(i64::MIN),
            Just(i64::MAX),
            (0u32..64).prop_map(|b| 1i64 << b),
        ], 0..700),
        order in 0u8..3,
    ) {
        let mut p = Vec::new();
        packed::pack(&xs, order, &mut p);
        prop_assert_eq!(packed::plan(&xs, order).len, p.len());
        prop_assert_eq!(unpacked(&p, xs.len()).unwrap(), xs.clone());
        for cut in [0, p.len() / 2, p.len().saturating_sub(1)] {
            if cut < p.len() {
                prop_assert!(unpacked(&p[..cut], xs.len()).is_err());
            }
        }
    }
}

/// Noise at the sensor's resolution is stored bit-packed without zstd, the
/// fastest to decode; a mostly constant column stays a handful of bytes.
#[test]
fn noisy_columns_are_bit_packed() {
    let mut x = 12_345u64;
    let noisy: Vec<f64> = (0..4096)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 53) as f64 / 10.0
        })
        .collect();
    let (out, b) = val_round_trip(&noisy);
    assert_eq!(bits(&out), bits(&noisy));
    assert_eq!(b[0], VAL_PACKED);
    // 11 bits of noise per sample: 4096 × 11 / 8 = 5,632 bytes, plus frame headers.
    assert!(b.len() < 5_632 + 32 * 4 + 8, "{} bytes", b.len());
}

/// The varint value block (kind 2) at every delta order, unscaled and
/// scaled, with varints of one to ten bytes (zigzag deltas of 0, ±100,
/// ±10^4, ±2^40 and the order-2 deltas of ±2^52, which wrap), decodes to
/// the integers it was written from; cut anywhere it is an error.
#[test]
fn varint_blocks_of_every_order_and_length_decode() {
    let big = (1i64 << 52) - 1;
    let ints: Vec<i64> = [
        0,
        3,
        -50,
        50,
        10_000,
        -10_000,
        1 << 40,
        -(1 << 40),
        big,
        -big,
        7,
        7,
    ]
    .into_iter()
    .cycle()
    .take(300)
    .collect();
    for order in 0..=2u8 {
        for d in [0u8, 1, 6] {
            let mut payload = vec![d, order];
            diff_varints(&ints, order, &mut payload);
            let mut block = vec![VAL_DECIMAL];
            block.extend_from_slice(&payload);
            let mut out = vec![-1.0];
            decode_values(&block, ints.len(), &mut out).unwrap();
            let want: Vec<f64> = std::iter::once(-1.0)
                .chain(ints.iter().map(|&x| x as f64 / 10f64.powi(d as i32)))
                .collect();
            assert_eq!(bits(&out), bits(&want), "order {order}, scale {d}");
            for cut in [1, 2, 3, block.len() / 2, block.len() - 1] {
                let mut out = Vec::new();
                assert_eq!(
                    decode_values(&block[..cut], ints.len(), &mut out),
                    Err(ColumnError::BadLength),
                    "order {order}, scale {d}, cut at {cut}"
                );
            }
            // One value too many declared: the varints end early.
            assert!(decode_values(&block, ints.len() + 1, &mut Vec::new()).is_err());
            // One value too few: trailing bytes.
            assert!(decode_values(&block, ints.len() - 1, &mut Vec::new()).is_err());
        }
    }
}
