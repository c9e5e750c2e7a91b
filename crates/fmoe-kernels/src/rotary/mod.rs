//! `rotary`: rotary position embeddings applied to a batch of token rows.
//!
//! x `[T, heads·head_dim]`; in every head, dims `rot_offset..rot_offset + rot_dim` are rotated by
//! the token's angles (cos/sin `[T, rot_dim / 2]`, f32), the others are copied. Pair i of the
//! rotated slice `s` is (`s[i]`, `s[i + rot_dim/2]`) for [`RotaryStyle::HalfSplit`] (Llama,
//! Mixtral) and (`s[2i]`, `s[2i + 1]`) for [`RotaryStyle::Interleaved`] (DeepSeek-V3, which
//! rotates its `qk_rope_head_dim` dims after `qk_nope_head_dim` ones: offset 128, 64 dims); each
//! pair (a, b) becomes `(a·c − b·s, b·c + a·s)` in f32, rounded once to x's dtype, written back
//! in place of the pair (so q and k agree on the layout, whatever the style).
//!
//! cos/sin hold whatever the model's schedule computed (YaRN's attention factor included). Dtypes
//! of x: f32, bf16, f16. CUDA: `cuda/rotary.cu`, one block per token row.

mod cpu;
pub(crate) mod cuda;

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotaryStyle {
    /// (`x[i]`, `x[i + d/2]`) pairs, Llama/Mixtral.
    HalfSplit,
    /// (`x[2i]`, `x[2i + 1]`) pairs, DeepSeek.
    Interleaved,
}

/// Where the rotated dims of a head are.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rot_offset: usize,
    pub rot_dim: usize,
    pub style: RotaryStyle,
}

/// x [T, heads·head_dim]; in each head, dims rot_offset..rot_offset+rot_dim are rotated by
/// cos/sin [T, rot_dim/2] (f32, one row per token, any device → moved to x's device); the other dims
/// are copied. Returns a new tensor in x's dtype (f32 math, one rounding).
#[allow(clippy::too_many_arguments)]
pub fn apply_rotary(
    x: &Tensor,
    heads: usize,
    head_dim: usize,
    rot_offset: usize,
    rot_dim: usize,
    cos: &Tensor,
    sin: &Tensor,
    style: RotaryStyle,
) -> Result<Tensor> {
    const OP: &str = "rotary::apply_rotary";
    let dtype = x.expect_dtype(OP, "x", &[DType::F32, DType::BF16, DType::F16])?;
    let &[t, width] = x.expect_rank(OP, "x", 2, "[T, heads·head_dim]")? else {
        unreachable!("rank checked")
    };
    if heads.checked_mul(head_dim) != Some(width) {
        return Err(Error::invalid(
            OP,
            format!("x is [{t}, {width}], not [T, heads·head_dim] = [T, {heads}·{head_dim}]"),
        ));
    }
    if !rot_dim.is_multiple_of(2)
        || rot_offset
            .checked_add(rot_dim)
            .is_none_or(|end| end > head_dim)
    {
        return Err(Error::invalid(
            OP,
            format!(
                "rotated dims {rot_offset}..{rot_offset}+{rot_dim} must be an even count within the head's {head_dim}"
            ),
        ));
    }
    for (name, c) in [("cos", cos), ("sin", sin)] {
        c.expect_dims(OP, name, &[t, rot_dim / 2])?;
        c.expect_dtype(OP, name, &[DType::F32])?;
    }
    let g = Geometry {
        tokens: t,
        heads,
        head_dim,
        rot_offset,
        rot_dim,
        style,
    };
    match x.storage() {
        Storage::Cuda(xs) => {
            let (cos, sin) = (cos.to_device(x.device())?, sin.to_device(x.device())?);
            let y = cuda::apply(OP, xs, &cos, &sin, &g)?;
            Ok(Tensor::from_storage(Storage::Cuda(y), [t, width])?)
        }
        Storage::Cpu(_) => {
            let (cos, sin) = (cos.to_f32_vec()?, sin.to_f32_vec()?);
            let y = cpu::apply(&x.to_f32_vec()?, &cos, &sin, &g, dtype);
            Ok(Tensor::from_f32(&y, [t, width], dtype, &Device::Cpu)?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(t: usize, half: usize) -> (Tensor, Tensor, Vec<f64>) {
        let ang: Vec<f64> = (0..t * half).map(|i| 0.37 * i as f64 - 1.0).collect();
        let c: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let s: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        (
            Tensor::from_vec(c, [t, half], &Device::Cpu).unwrap(),
            Tensor::from_vec(s, [t, half], &Device::Cpu).unwrap(),
            ang,
        )
    }

    #[test]
    fn rotates_the_right_pairs_and_copies_the_rest() {
        let (t, heads, hd, off, rd) = (3, 2, 12, 4, 6);
        let x: Vec<f32> = (0..t * heads * hd).map(|i| i as f32 * 0.25 - 3.0).collect();
        let xt = Tensor::from_vec(x.clone(), [t, heads * hd], &Device::Cpu).unwrap();
        let (c, s, ang) = table(t, rd / 2);
        for style in [RotaryStyle::HalfSplit, RotaryStyle::Interleaved] {
            let y = apply_rotary(&xt, heads, hd, off, rd, &c, &s, style).unwrap();
            let y = y.to_f32_vec().unwrap();
            for tok in 0..t {
                for h in 0..heads {
                    let base = tok * heads * hd + h * hd;
                    let mut want: Vec<f64> =
                        x[base..base + hd].iter().map(|&v| f64::from(v)).collect();
                    for i in 0..rd / 2 {
                        let (ia, ib) = match style {
                            RotaryStyle::HalfSplit => (off + i, off + i + rd / 2),
                            RotaryStyle::Interleaved => (off + 2 * i, off + 2 * i + 1),
                        };
                        let (a, b) = (want[ia], want[ib]);
                        let th = ang[tok * rd / 2 + i];
                        want[ia] = a * th.cos() - b * th.sin();
                        want[ib] = b * th.cos() + a * th.sin();
                    }
                    for d in 0..hd {
                        let got = f64::from(y[base + d]);
                        assert!(
                            (got - want[d]).abs() < 1e-5,
                            "{style:?} {tok} {h} {d}: {got} vs {}",
                            want[d]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_geometry_is_an_error() {
        let cpu = Device::Cpu;
        let x = Tensor::zeros([2, 16], DType::BF16, &cpu).unwrap();
        let (c, s, _) = table(2, 2);
        let hs = RotaryStyle::HalfSplit;
        assert!(apply_rotary(&x, 3, 8, 0, 4, &c, &s, hs).is_err());
        assert!(apply_rotary(&x, 2, 8, 6, 4, &c, &s, hs).is_err());
        assert!(apply_rotary(&x, 2, 8, 0, 3, &c, &s, hs).is_err());
        let msg = apply_rotary(&x, 2, 8, 0, 6, &c, &s, hs)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`cos`"), "{msg}");
        assert!(apply_rotary(&x, 2, 8, 4, 4, &c, &s, hs).is_ok());
    }
}
