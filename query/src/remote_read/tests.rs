use super::xor::{XorChunk, decode};

#[test]
fn xor_chunk_matches_bytes_worked_out_by_hand() {
    let mut c = XorChunk::new();
    for t in [1000, 2000, 3000] {
        c.append(t, 1.0);
    }
    // 3 samples; zigzag varint of 1000 (2000 = d0 0f); 1.0's 64 bits;
    // uvarint delta 1000 (e8 07); then '0' (same value), '0' (same delta),
    // '0' (same value), padded to a byte.
    assert_eq!(
        c.bytes(),
        [
            0x00, 0x03, 0xd0, 0x0f, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0xe8, 0x07, 0x00
        ]
    );
}

#[test]
fn xor_chunks_round_trip_every_encoding_branch() {
    // Deltas that hit each delta-of-delta width, values that reuse and
    // replace the XOR window, NaN payloads, -0.0 and infinities.
    let mut samples = Vec::new();
    let mut t = -5_000i64;
    let deltas = [
        15_000i64,
        15_000,
        15_001,
        9_000,
        60_000,
        200_000,
        1_000_000,
        1,
        5_000_000_000,
        15_000,
        23_192, // +8192: the top of the 14-bit range
        15_000,
        6_809, // -8191: its bottom
    ];
    let values = [
        0.0,
        -0.0,
        1.5,
        1.5,
        1.75,
        f64::from_bits(0x7ff8_0000_0000_0123),
        f64::INFINITY,
        f64::NEG_INFINITY,
        123_456.789,
        f64::from_bits(1),
        f64::MAX,
        -3.0,
    ];
    for i in 0..120 {
        samples.push((
            t,
            values[i % values.len()] * if i % 7 == 0 { 1.0 } else { 2.0 },
        ));
        t += deltas[i % deltas.len()];
    }
    for n in [1, 2, 3, 120] {
        let mut c = XorChunk::new();
        for &(t, v) in &samples[..n] {
            c.append(t, v);
        }
        let got = decode(c.bytes()).unwrap();
        assert_eq!(got.len(), n);
        for (g, w) in got.iter().zip(&samples) {
            assert_eq!((g.0, g.1.to_bits()), (w.0, w.1.to_bits()));
        }
    }
}

#[test]
fn xor_decode_refuses_truncated_chunks() {
    let mut c = XorChunk::new();
    for t in 0..50 {
        c.append(t * 1000 + t * t, t as f64 * 0.1);
    }
    let b = c.bytes();
    assert_eq!(decode(b).unwrap().len(), 50);
    for cut in [0, 1, 2, 5, b.len() / 2, b.len() - 1] {
        assert!(decode(&b[..cut]).is_err(), "cut at {cut}");
    }
}
