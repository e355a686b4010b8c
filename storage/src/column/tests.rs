use super::*;
use proptest::prelude::*;

fn ts_round_trip(ts: &[i64]) -> Vec<i64> {
    let mut b = Vec::new();
    encode_ts(ts, &mut b);
    let mut out = Vec::new();
    decode_ts(&b, ts.len(), &mut out).expect("decode ts");
    out
}

/// A value block made by `encode` (a rollup file's or a segment's), and its
/// decoding.
fn round_trip_with(encode: fn(&[f64], &mut Vec<u8>), vals: &[f64]) -> (Vec<f64>, Vec<u8>) {
    let mut b = Vec::new();
    encode(vals, &mut b);
    let mut out = Vec::new();
    decode_values(&b, vals.len(), &mut out).expect("decode values");
    (out, b)
}

fn val_round_trip(vals: &[f64]) -> (Vec<f64>, Vec<u8>) {
    round_trip_with(encode_values, vals)
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

    /// The head's encoders (no zstd) write blocks the segment decoders read
    /// back bit-exact, whatever the values.
    #[test]
    fn head_blocks_round_trip_bit_exact(
        vals in prop::collection::vec(arb_f64(), 1..600),
        ts in prop::collection::vec(any::<i64>(), 1..300),
    ) {
        let (out, b) = round_trip_with(encode_head_values, &vals);
        prop_assert_eq!(bits(&out), bits(&vals));
        prop_assert!(b[0] & ZSTD_FLAG == 0);
        let mut block = Vec::new();
        encode_head_ts(&ts, &mut block);
        prop_assert!(block[0] & ZSTD_FLAG == 0);
        let mut got = Vec::new();
        decode_ts(&block, ts.len(), &mut got).expect("decode ts");
        prop_assert_eq!(got, ts);
    }

    /// The one-pass scale search finds what the two-pass one did: the
    /// smallest scale that holds the values seen in order, then every value
    /// at it, or nothing.
    #[test]
    fn as_decimal_matches_the_two_pass_search(
        vals in prop::collection::vec(prop_oneof![
            (-100_000i64..100_000, 0u32..11).prop_map(|(n, d)| n as f64 / 10f64.powi(d as i32)),
            arb_f64(),
            // Near the rescaling's limit (2^50) and the integers' (2^53).
            (-(1i64 << 53)..(1i64 << 53), 0u32..4).prop_map(|(n, d)| n as f64 / 10f64.powi(d as i32)),
            ((1i64 << 45)..(1i64 << 50), 0u32..6).prop_map(|(n, d)| n as f64 / 10f64.powi(d as i32)),
        ], 0..40),
    ) {
        let mut d = 0u8;
        let mut two_pass = Some(());
        for &v in &vals {
            while exact_at(v, d).is_none() {
                d += 1;
                if d > MAX_SCALE {
                    two_pass = None;
                    break;
                }
            }
            if two_pass.is_none() {
                break;
            }
        }
        let want = two_pass.and_then(|()| {
            vals.iter()
                .map(|&v| exact_at(v, d))
                .collect::<Option<Vec<i64>>>()
                .map(|ints| (d, ints))
        });
        prop_assert_eq!(as_decimal(&vals), want);
    }

    #[test]
    fn head_decimals_round_trip(start in -10_000i64..10_000, steps in prop::collection::vec(-3i64..4, 1..600), d in 0u32..7) {
        let mut x = start;
        let vals: Vec<f64> = steps.iter().map(|s| { x += s; x as f64 / 10f64.powi(d as i32) }).collect();
        let (out, b) = round_trip_with(encode_head_values, &vals);
        prop_assert_eq!(bits(&out), bits(&vals));
        prop_assert_eq!(b[0], VAL_PACKED);
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
/// Integers of every width, small ones, and the ends of i64, whose
/// differences wrap.
fn edge_i64s() -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec(
        prop_oneof![
            any::<i64>(),
            (-40i64..40),
            Just(i64::MIN),
            Just(i64::MAX),
            (0u32..64).prop_map(|b| 1i64 << b),
        ],
        0..700,
    )
}

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
        xs in edge_i64s(),
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

/// A segment's value block, and its decoding.
fn segment_round_trip(vals: &[f64]) -> (Vec<f64>, Vec<u8>) {
    round_trip_with(encode_segment_values, vals)
}

/// Gaussian-like noise (the sum of four uniforms) around a level, like a
/// PCIe rate in bytes/s: what byte planes are for.
fn gaussian_noise(n: usize, seed: u64, level: i64, spread: u64) -> Vec<i64> {
    let mut x = seed;
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        x >> 33
    };
    (0..n)
        .map(|_| {
            let s: u64 = (0..4).map(|_| next() % spread).sum();
            level + s as i64
        })
        .collect()
}

/// By hand: 300, 301, 556 at order 0 -> base 300 (zigzag 600 = d8 04),
/// offsets 0, 1, 256 in two bytes: plane 0 is 00 01 00, plane 1 is
/// 00 00 01, each a raw block (kind 0, too short for zstd) of 4 bytes.
#[test]
fn golden_planes_payload() {
    let mut p = Vec::new();
    assert!(planes::write(
        &packed::plan(&[300, 301, 556], 0),
        usize::MAX,
        &mut p
    ));
    assert_eq!(
        p,
        [
            0x00, 0xd8, 0x04, 0x02, 0x04, 0x00, 0x00, 0x01, 0x00, 0x04, 0x00, 0x00, 0x00, 0x01
        ]
    );
    let mut out = Vec::new();
    planes::unpack(&p, 3, |f| out.extend_from_slice(f)).unwrap();
    assert_eq!(out, [300, 301, 556]);
    // A budget the estimate does not fit under writes nothing.
    assert!(!planes::write(
        &packed::plan(&[300, 301, 556], 0),
        8,
        &mut Vec::new()
    ));
}

/// Noise whose bytes above the lowest take few values is stored as byte
/// planes, smaller than the bit-packed frames that rollup files keep, and
/// reads back bit for bit.
#[test]
fn gaussian_noise_is_stored_as_byte_planes() {
    let noisy: Vec<f64> = gaussian_noise(4096, 7, 386_000_000, 1 << 22)
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let (out, b) = segment_round_trip(&noisy);
    assert_eq!(bits(&out), bits(&noisy));
    assert_eq!(b[0], VAL_PLANES);
    let (_, packed) = val_round_trip(&noisy);
    assert_eq!(packed[0], VAL_PACKED);
    assert!(b.len() < packed.len(), "{} >= {}", b.len(), packed.len());
}

/// A noisy column that repeats its previous value at a tenth of the polls
/// (a counter refreshed more slowly than it is polled) is stored as a
/// repeat mask over the other values, smaller than without the mask.
#[test]
fn repeats_are_stored_as_a_mask() {
    let fresh = gaussian_noise(4096, 11, 5_000, 1 << 14);
    let mut x = 99u64;
    let mut vals: Vec<f64> = Vec::with_capacity(fresh.len());
    for (i, &v) in fresh.iter().enumerate() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        let repeat = i > 0 && (x >> 60) < 2; // 2 in 16
        vals.push(if repeat {
            vals[i - 1]
        } else {
            v as f64 / 100.0
        });
    }
    let (out, b) = segment_round_trip(&vals);
    assert_eq!(bits(&out), bits(&vals));
    assert_eq!(b[0], VAL_REPEATS);
    let mut without = Vec::new();
    encode_values_with(&vals, &mut without, true);
    assert!(b.len() < without.len(), "{} >= {}", b.len(), without.len());
}

/// Blocks of kinds 4 and 5 cut anywhere, or with one byte changed, are an
/// error or some values, never a panic; a mask inside a mask, a mask that
/// marks the first value or a bit past the last, and a plane of the wrong
/// length are errors.
#[test]
fn damaged_mask_and_plane_blocks_are_errors() {
    let noisy: Vec<f64> = gaussian_noise(600, 3, 1 << 40, 1 << 30)
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let mut repeating = noisy.clone();
    for i in (5..600).step_by(7) {
        repeating[i] = repeating[i - 1];
    }
    for vals in [&noisy, &repeating] {
        let (_, b) = segment_round_trip(vals);
        assert!(b[0] == VAL_PLANES || b[0] == VAL_REPEATS, "kind {}", b[0]);
        for cut in 0..b.len() {
            assert!(decode_values(&b[..cut], vals.len(), &mut Vec::new()).is_err());
        }
        for at in 0..b.len() {
            let mut bad = b.clone();
            bad[at] ^= 0x5a;
            let mut out = Vec::new();
            if decode_values(&bad, vals.len(), &mut out).is_ok() {
                assert_eq!(out.len(), vals.len());
            }
        }
    }
    // Hand-made: n = 3, mask 0b110 (values 1 and 2 repeat value 0), then
    // one value. The same with a mask inside is refused.
    let mut inner = Vec::new();
    encode_values(&[7.0], &mut inner);
    let block = |mask: u8, inner: &[u8]| {
        let mut b = vec![VAL_REPEATS, 2, MASK_BITMAP, mask];
        b.extend_from_slice(inner);
        b
    };
    let mut out = Vec::new();
    decode_values(&block(0b110, &inner), 3, &mut out).unwrap();
    assert_eq!(out, [7.0, 7.0, 7.0]);
    let nested = block(0b000, &block(0b110, &inner));
    assert_eq!(
        decode_values(&nested, 3, &mut Vec::new()),
        Err(ColumnError::UnknownEncoding(VAL_REPEATS))
    );
    for mask in [0b111, 0b1110] {
        assert_eq!(
            decode_values(&block(mask, &inner), 3, &mut Vec::new()),
            Err(ColumnError::BadLength),
            "mask {mask:#b}"
        );
    }
    // A plane one byte short of the two values after order 0's none.
    let short = [VAL_PLANES, 0, 0x00, 0x00, 0x01, 0x02, 0x00, 0x05];
    assert_eq!(
        decode_values(&short, 2, &mut Vec::new()),
        Err(ColumnError::BadLength)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any values, with runs of repeats, read back bit for bit from a
    /// segment's block.
    #[test]
    fn segment_values_round_trip_bit_exact(
        vals in prop::collection::vec((arb_f64(), 1usize..5), 1..400),
    ) {
        let vals: Vec<f64> = vals.iter().flat_map(|&(v, n)| std::iter::repeat_n(v, n)).collect();
        let (out, _) = segment_round_trip(&vals);
        prop_assert_eq!(bits(&out), bits(&vals));
    }

    /// Byte planes of any integers, at every order, read back as written;
    /// cut short they are an error.
    #[test]
    fn planes_round_trip(
        xs in edge_i64s(),
        order in 0u8..3,
    ) {
        let mut p = Vec::new();
        prop_assert!(planes::write(&packed::plan(&xs, order), usize::MAX, &mut p));
        let mut out = Vec::new();
        planes::unpack(&p, xs.len(), |f| out.extend_from_slice(f)).unwrap();
        prop_assert_eq!(out, xs.clone());
        for cut in [0, p.len() / 2, p.len().saturating_sub(1)] {
            if cut < p.len() {
                let mut seen = 0;
                let cut_short = planes::unpack(&p[..cut], xs.len(), |f| seen += f.len());
                prop_assert!(cut_short.is_err());
            }
        }
    }
}

/// Blocks of kinds 5 and 4 encode to the committed golden files, which also
/// seed the `column_decode` fuzz target (whose input is the sample count as
/// u16 LE, then a block), and read back as the values they were made from.
/// After a deliberate format change, regenerate them with `GPULSE_BLESS=1`.
#[test]
fn plane_and_mask_blocks_match_their_golden_files() {
    let noisy: Vec<f64> = gaussian_noise(1000, 7, 386_000_000, 1 << 22)
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let mut repeating = noisy.clone();
    for i in (3..1000).step_by(5) {
        repeating[i] = repeating[i - 1];
    }
    for (name, kind, vals) in [
        ("planes.bin", VAL_PLANES, &noisy),
        ("mask.bin", VAL_REPEATS, &repeating),
    ] {
        let (_, b) = segment_round_trip(vals);
        assert_eq!(b[0], kind, "{name}");
        let mut seed = (vals.len() as u16).to_le_bytes().to_vec();
        seed.extend_from_slice(&b);
        let committed = crate::golden::check("column_decode", name, &seed);
        let mut out = Vec::new();
        decode_values(&committed[2..], vals.len(), &mut out).unwrap();
        assert_eq!(bits(&out), bits(vals));
    }
}

/// The repeat mask's spreading against a forward reading of its rule (slot
/// i takes the value of the last clear bit at or before it): masks from
/// empty to almost full, lengths around whole bytes, so that both the run
/// of eight and the bit-by-bit paths meet each other at every offset.
#[test]
fn repeats_spread_as_the_mask_says() {
    let mut x = 7u64;
    for n in [1usize, 7, 8, 9, 15, 16, 17, 64, 65, 100, 4096] {
        for density in [0u64, 1, 4, 8, 12, 15] {
            let mut bits = vec![0u8; n.div_ceil(8)];
            for i in 1..n {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if (x >> 60) < density {
                    bits[i / 8] |= 1 << (i % 8);
                }
            }
            let repeats: usize = bits.iter().map(|b| b.count_ones() as usize).sum();
            let kept = n - repeats;
            let mut dst: Vec<f64> = (0..kept).map(|i| i as f64 + 0.5).collect();
            dst.resize(n, f64::NAN);
            spread_repeats(&bits, &mut dst, kept);
            let mut want = Vec::with_capacity(n);
            let mut next = 0usize;
            for i in 0..n {
                if bits[i / 8] >> (i % 8) & 1 == 0 {
                    next += 1;
                }
                want.push((next - 1) as f64 + 0.5);
            }
            assert_eq!(dst, want, "n {n} density {density}");
        }
    }
}
