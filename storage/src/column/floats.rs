//! Decoded integers to the floats they stand for: `x as f64`, or
//! `x as f64 / 10^d` for a decimal column, two at a time with SSE2.
//!
//! x86-64 has no packed conversion from 64-bit integers to doubles before
//! AVX-512, so the compiler converts and divides one value at a time
//! (`cvtsi2sd`, `divsd`). An integer below 2^51 in magnitude converts
//! exactly by adding it to the mantissa of 2^52 + 2^51 and subtracting
//! that double; the quotient is then `divpd`'s, correctly rounded as
//! `divsd`'s is, so the bits are those of the scalar expression. A run of
//! integers with one outside that range is converted the scalar way.

/// Appends `xs` to `out`, each as `x as f64`, divided by `scale` if there
/// is one: bit for bit the scalar expression.
pub(super) fn extend(out: &mut Vec<f64>, xs: &[i64], scale: Option<f64>) {
    #[cfg(target_arch = "x86_64")]
    {
        out.reserve(xs.len());
        let start = out.len();
        let spare = &mut out.spare_capacity_mut()[..xs.len()];
        if sse2::convert(xs, scale, spare) {
            // SAFETY: `convert` returned true: it wrote every one of the
            // `xs.len()` slots after `start`, within the capacity reserved.
            unsafe { out.set_len(start + xs.len()) };
            return;
        }
    }
    match scale {
        None => out.extend(xs.iter().map(|&x| x as f64)),
        Some(s) => out.extend(xs.iter().map(|&x| x as f64 / s)),
    }
}

#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi64, _mm_castsi128_pd, _mm_div_pd, _mm_loadu_si128, _mm_or_si128,
        _mm_set1_epi64x, _mm_set1_pd, _mm_setzero_si128, _mm_storeu_pd, _mm_storeu_si128,
        _mm_sub_pd,
    };
    use std::mem::MaybeUninit;

    /// 2^51: added to an integer in [-2^51, 2^51), it gives one in [0, 2^52).
    const BIAS: i64 = 1 << 51;
    /// The bits of 2^52, whose mantissa then holds that integer exactly.
    const EXP: i64 = 0x4330_0000_0000_0000;
    /// 2^52 + 2^51, the double subtracted to leave the integer.
    const MAGIC: f64 = 6_755_399_441_055_744.0;

    /// Writes `xs` converted (and divided) into `out` (as long as `xs`) and
    /// returns true, or false, with `out` partly written, if an integer is
    /// outside [-2^51, 2^51).
    pub(super) fn convert(xs: &[i64], scale: Option<f64>, out: &mut [MaybeUninit<f64>]) -> bool {
        assert_eq!(xs.len(), out.len(), "BUG: one slot a value");
        // SAFETY: SSE2 is part of x86-64: every processor this code runs
        // on has it.
        unsafe {
            match scale {
                None => convert_sse2::<false>(xs, 1.0, out),
                Some(s) => convert_sse2::<true>(xs, s, out),
            }
        }
    }

    #[target_feature(enable = "sse2")]
    fn convert_sse2<const DIVIDE: bool>(
        xs: &[i64],
        scale: f64,
        out: &mut [MaybeUninit<f64>],
    ) -> bool {
        let (bias, exp) = (_mm_set1_epi64x(BIAS), _mm_set1_epi64x(EXP));
        let (magic, scale_v) = (_mm_set1_pd(MAGIC), _mm_set1_pd(scale));
        // Every biased integer ORed together: a bit at 52 or above means
        // one was out of range.
        let mut seen = _mm_setzero_si128();
        let pairs = xs.chunks_exact(2);
        let last = pairs.remainder();
        for (x, o) in pairs.zip(out.chunks_exact_mut(2)) {
            // SAFETY: `x` is two i64s and `o` two f64 slots: 16 bytes
            // each; the load and the store are unaligned.
            let v = unsafe { _mm_loadu_si128(x.as_ptr().cast::<__m128i>()) };
            let biased = _mm_add_epi64(v, bias);
            seen = _mm_or_si128(seen, biased);
            let mut f = _mm_sub_pd(_mm_castsi128_pd(_mm_or_si128(biased, exp)), magic);
            if DIVIDE {
                f = _mm_div_pd(f, scale_v);
            }
            // SAFETY: as above.
            unsafe { _mm_storeu_pd(o.as_mut_ptr().cast::<f64>(), f) };
        }
        if let (Some(&x), Some(o)) = (last.first(), out.last_mut()) {
            o.write(if DIVIDE { x as f64 / scale } else { x as f64 });
        }
        let mut lanes = [0u64; 2];
        // SAFETY: `lanes` is 16 bytes; the store is unaligned.
        unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast::<__m128i>(), seen) };
        (lanes[0] | lanes[1]) >> 52 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Integers around every edge of the fast path (zero, ±2^51, ±2^53,
    /// the extremes) and a pseudo-random spread, with every scale the
    /// columns use and none, odd and even lengths: each float's bits
    /// against the scalar expression's.
    #[test]
    fn floats_are_the_scalar_conversions_bit_for_bit() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let edges = [
            0,
            1,
            -1,
            (1 << 51) - 1,
            -(1 << 51),
            1 << 51,
            -(1 << 51) - 1,
            1 << 53,
            (1 << 53) + 1,
            i64::MAX,
            i64::MIN,
        ];
        let mut cases: Vec<Vec<i64>> = vec![Vec::new(), vec![7], vec![-3, 12_345]];
        for shift in [4u32, 20, 40, 50] {
            let spread = 1u64 << shift;
            cases.push(
                (0..37)
                    .map(|_| (next() % (2 * spread)) as i64 - spread as i64)
                    .collect(),
            );
        }
        for &edge in &edges {
            // The edge first, last and in the middle of a run of small ones.
            cases.push(vec![edge, 5, 6]);
            cases.push(vec![5, 6, 7, edge]);
            cases.push(vec![5, edge, 6, 7, 8]);
        }
        for xs in &cases {
            for scale in [None, Some(1e1), Some(1e3), Some(1e9)] {
                let mut out = vec![0.5];
                extend(&mut out, xs, scale);
                assert_eq!(out.len(), xs.len() + 1);
                assert_eq!(out[0], 0.5, "what was there stays");
                for (&x, &f) in xs.iter().zip(&out[1..]) {
                    let want = match scale {
                        None => x as f64,
                        Some(s) => x as f64 / s,
                    };
                    assert_eq!(f.to_bits(), want.to_bits(), "{x} / {scale:?}");
                }
            }
        }
    }
}
