//! CPU twin of `quant_fp8`: slice-level kernels on row-major f32 data. They are `pub` so the fused
//! GEMM kernels can quantize and dequantize tiles with exactly the same arithmetic.
//!
//! Slice lengths are the caller's contract (the tensor API validates shapes first); a mismatch is
//! a bug in the caller and panics with a message. Non-finite input never panics: the dynamic
//! kernels return `Err((flat_index, value))` for the first one in row-major order.

use fmoe_core::F8E4M3;

use super::scale_from_amax;

/// f32 -> e4m3fn: round to nearest even, ±Inf and overflow saturate to ±448, NaN stays NaN.
/// float8's conversion has exactly these semantics (checked code by code and at every rounding
/// boundary in the tests); this wrapper is the one place to swap it out.
#[inline(always)]
pub fn f32_to_fp8(x: f32) -> F8E4M3 {
    F8E4M3::from_f32(x)
}

/// Largest |x|, or the first non-finite element as `Err((index, value))`.
pub fn amax(x: &[f32]) -> Result<f32, (usize, f32)> {
    let mut m = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err((i, v));
        }
        m = m.max(v.abs());
    }
    Ok(m)
}

/// `out[i] = sat_rne(x[i] / scale)`. Division, not a multiply by 1/scale: the quotient is then
/// rounded once before the fp8 rounding, so ties resolve as for the exact x/s.
pub fn quantize_slice(x: &[f32], scale: f32, out: &mut [F8E4M3]) {
    assert_eq!(
        x.len(),
        out.len(),
        "quantize_slice: input and output lengths differ"
    );
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f32_to_fp8(v / scale);
    }
}

/// `out[i] = q[i] * scale` in f32.
pub fn dequantize_slice(q: &[F8E4M3], scale: f32, out: &mut [f32]) {
    assert_eq!(
        q.len(),
        out.len(),
        "dequantize_slice: input and output lengths differ"
    );
    let lut = &fmoe_core::FP8_E4M3_TO_F32;
    for (o, &c) in out.iter_mut().zip(q) {
        *o = lut[usize::from(c.to_bits())] * scale;
    }
}

/// Dynamic quantization of one row in groups of `group` columns (the last group may be shorter);
/// `scales` gets one entry per group. Err carries the row-relative index of the first non-finite.
pub fn quantize_row_groups(
    row: &[f32],
    group: usize,
    q: &mut [F8E4M3],
    scales: &mut [f32],
) -> Result<(), (usize, f32)> {
    assert!(group > 0, "quantize_row_groups: group must be > 0");
    assert_eq!(
        row.len(),
        q.len(),
        "quantize_row_groups: row and q lengths differ"
    );
    assert_eq!(
        scales.len(),
        row.len().div_ceil(group),
        "quantize_row_groups: wrong scale count"
    );
    let groups = row.chunks(group).zip(q.chunks_mut(group));
    for (g, ((xs, qs), s)) in groups.zip(scales.iter_mut()).enumerate() {
        let a = amax(xs).map_err(|(i, v)| (g * group + i, v))?;
        *s = scale_from_amax(a);
        quantize_slice(xs, *s, qs);
    }
    Ok(())
}

/// [`quantize_row_groups`] over consecutive rows of width `k`; Err carries the flat index.
pub fn quantize_token_groups(
    x: &[f32],
    k: usize,
    group: usize,
    q: &mut [F8E4M3],
    scales: &mut [f32],
) -> Result<(), (usize, f32)> {
    assert!(group > 0, "quantize_token_groups: group must be > 0");
    if k == 0 {
        return Ok(());
    }
    let g = k.div_ceil(group);
    assert_eq!(
        x.len() % k,
        0,
        "quantize_token_groups: length is not a multiple of k"
    );
    assert_eq!(
        scales.len(),
        x.len() / k * g,
        "quantize_token_groups: wrong scale count"
    );
    let rows = x.chunks(k).zip(q.chunks_mut(k)).zip(scales.chunks_mut(g));
    for (r, ((xr, qr), sr)) in rows.enumerate() {
        quantize_row_groups(xr, group, qr, sr).map_err(|(i, v)| (r * k + i, v))?;
    }
    Ok(())
}

/// Inverse of [`quantize_token_groups`]: `out = q * scales[row, col / group]`.
pub fn dequantize_token_groups(
    q: &[F8E4M3],
    scales: &[f32],
    k: usize,
    group: usize,
    out: &mut [f32],
) {
    assert!(group > 0, "dequantize_token_groups: group must be > 0");
    if k == 0 {
        return;
    }
    let g = k.div_ceil(group);
    assert_eq!(
        q.len() % k,
        0,
        "dequantize_token_groups: length is not a multiple of k"
    );
    assert_eq!(
        scales.len(),
        q.len() / k * g,
        "dequantize_token_groups: wrong scale count"
    );
    let rows = q.chunks(k).zip(out.chunks_mut(k)).zip(scales.chunks(g));
    for ((qr, or), sr) in rows {
        for ((qs, os), &s) in qr.chunks(group).zip(or.chunks_mut(group)).zip(sr) {
            dequantize_slice(qs, s, os);
        }
    }
}

/// Number of `[block[0], block[1]]` blocks covering a `rows x cols` matrix, per dimension.
pub fn block_grid(rows: usize, cols: usize, block: [usize; 2]) -> (usize, usize) {
    (rows.div_ceil(block[0]), cols.div_ceil(block[1]))
}

/// Dynamic block quantization of `w`, a stack of row-major `rows x cols` matrices. `scale_inv`
/// gets one scale per block, `[matrix][block_row][block_col]`; edge blocks use the amax of the
/// elements they actually cover. Err carries the flat index of the first non-finite element.
pub fn quantize_blocks(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    q: &mut [F8E4M3],
    scale_inv: &mut [f32],
) -> Result<(), (usize, f32)> {
    assert!(
        block[0] > 0 && block[1] > 0,
        "quantize_blocks: block sizes must be > 0"
    );
    assert_eq!(w.len(), q.len(), "quantize_blocks: w and q lengths differ");
    let n = rows * cols;
    if n == 0 {
        return Ok(());
    }
    let (br, bc) = block_grid(rows, cols, block);
    assert_eq!(
        w.len() % n,
        0,
        "quantize_blocks: length is not a multiple of rows * cols"
    );
    assert_eq!(
        scale_inv.len(),
        w.len() / n * br * bc,
        "quantize_blocks: wrong scale count"
    );
    let mats = w
        .chunks(n)
        .zip(q.chunks_mut(n))
        .zip(scale_inv.chunks_mut(br * bc));
    for (m, ((wm, qm), sm)) in mats.enumerate() {
        // Amax pass in row-major order, so the first non-finite found is the first in flat order.
        sm.fill(0.0);
        for (r, row) in wm.chunks(cols).enumerate() {
            let srow = &mut sm[r / block[0] * bc..][..bc];
            for (c, (seg, s)) in row.chunks(block[1]).zip(srow.iter_mut()).enumerate() {
                let a = amax(seg).map_err(|(i, v)| (m * n + r * cols + c * block[1] + i, v))?;
                *s = s.max(a);
            }
        }
        for s in sm.iter_mut() {
            *s = scale_from_amax(*s);
        }
        for (r, (row, qrow)) in wm.chunks(cols).zip(qm.chunks_mut(cols)).enumerate() {
            let srow = &sm[r / block[0] * bc..][..bc];
            let segs = row.chunks(block[1]).zip(qrow.chunks_mut(block[1]));
            for ((seg, qseg), &s) in segs.zip(srow) {
                quantize_slice(seg, s, qseg);
            }
        }
    }
    Ok(())
}

/// Inverse of [`quantize_blocks`]: `out[r, c] = q[r, c] * scale_inv[r / b0, c / b1]` per matrix.
pub fn dequantize_blocks(
    q: &[F8E4M3],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    out: &mut [f32],
) {
    assert!(
        block[0] > 0 && block[1] > 0,
        "dequantize_blocks: block sizes must be > 0"
    );
    assert_eq!(
        q.len(),
        out.len(),
        "dequantize_blocks: q and out lengths differ"
    );
    let n = rows * cols;
    if n == 0 {
        return;
    }
    let (br, bc) = block_grid(rows, cols, block);
    assert_eq!(
        q.len() % n,
        0,
        "dequantize_blocks: length is not a multiple of rows * cols"
    );
    assert_eq!(
        scale_inv.len(),
        q.len() / n * br * bc,
        "dequantize_blocks: wrong scale count"
    );
    let mats = q
        .chunks(n)
        .zip(out.chunks_mut(n))
        .zip(scale_inv.chunks(br * bc));
    for ((qm, om), sm) in mats {
        for (r, (qrow, orow)) in qm.chunks(cols).zip(om.chunks_mut(cols)).enumerate() {
            let srow = &sm[r / block[0] * bc..][..bc];
            let segs = qrow.chunks(block[1]).zip(orow.chunks_mut(block[1]));
            for ((qseg, oseg), &s) in segs.zip(srow) {
                dequantize_slice(qseg, s, oseg);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Decodes from the bit fields (bias 7, 3 mantissa bits), independently of float8.
    fn decode(b: u8) -> f32 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (i32::from((b >> 3) & 0xF), f32::from(b & 7));
        if b & 0x7F == 0x7F {
            f32::NAN
        } else if e == 0 {
            sign * m * 2f32.powi(-9)
        } else {
            sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
        }
    }

    #[test]
    fn lut_matches_bit_field_decode() {
        let lut = &fmoe_core::FP8_E4M3_TO_F32;
        for b in 0..=255u8 {
            let (got, want) = (lut[usize::from(b)], decode(b));
            if want.is_nan() {
                assert!(got.is_nan(), "code {b:#04x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "code {b:#04x}");
            }
        }
        assert_eq!(lut[0x7E], fmoe_core::FP8_E4M3_MAX);
    }

    // The dynamic scale's top element dequantizes to fl(448 * fl(a / 448)). Over one binade this is
    // within 1 ulp of a for every a; scaling a by 2^k scales both roundings exactly (normal range),
    // so the bound holds for every normal a. The integration tests rely on it.
    #[test]
    fn amax_round_trip_within_one_ulp_over_a_binade() {
        for m in 0..(1u32 << 23) {
            let a = f32::from_bits(0x3F80_0000 | m);
            let d = 448.0 * (a / 448.0);
            assert!(
                d.to_bits().abs_diff(a.to_bits()) <= 1,
                "a = {a:e}, got {d:e}"
            );
        }
    }

    #[test]
    fn non_finite_index_is_flat_in_row_major_order() {
        // 4 x 4 matrix, 2 x 2 blocks: flat 4 (row 1) lies in block (0, 0), flat 2 (row 0) in block
        // (0, 1); a block-by-block scan would report 4, but 2 is first in flat order.
        let mut w = vec![1.0f32; 16];
        w[4] = f32::NAN;
        w[2] = f32::INFINITY;
        let mut q = vec![F8E4M3::from_bits(0); 16];
        let mut s = vec![0.0; 4];
        let err = quantize_blocks(&w, 4, 4, [2, 2], &mut q, &mut s).unwrap_err();
        assert_eq!(err.0, 2);
        let err = quantize_token_groups(&w, 4, 3, &mut q, &mut [0.0; 8]).unwrap_err();
        assert_eq!(err.0, 2);
    }

    #[test]
    fn empty_shapes_do_not_panic() {
        let mut q: Vec<F8E4M3> = vec![];
        quantize_token_groups(&[], 0, 128, &mut q, &mut []).unwrap();
        quantize_blocks(&[], 0, 5, [128, 128], &mut q, &mut []).unwrap();
        dequantize_blocks(&[], &[], 5, 0, [128, 128], &mut []);
    }
}
