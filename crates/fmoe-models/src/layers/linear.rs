//! Dense linear layers and embeddings on the CPU: f32 activations, weights widened to f32 one
//! block of rows at a time (so a bf16 weight is never held twice), rayon over output rows.

use fmoe_core::{DType, F8E4M3, Tensor, WithDType, bf16, f16};
use rayon::prelude::*;

use crate::config::QuantizationConfig;
use crate::loader::Vb;
use crate::{Error, Result};

const OP: &str = "Linear::forward";

/// Weight rows widened per parallel task.
const ROW_BLOCK: usize = 16;

/// How stored weight values become real values.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightScale {
    /// bf16/f16/f32 weights as stored.
    None,
    /// e4m3 weights × one scale (`weight_scale`, Mixtral-FP8).
    PerTensor(f32),
    /// e4m3 weights × `scale_inv[r/128, c/128]` (DeepSeek-V3 `weight_scale_inv`
    /// [⌈out/128⌉, ⌈in/128⌉], row-major).
    Block { scale_inv: Vec<f32>, block: usize },
}

/// fp8 weight scales (`weight_scale`, every value of a `weight_scale_inv`) multiply the codes:
/// each must be finite and positive, or the layer's output is silently zero, negated or NaN.
/// Dense layers and MoE experts check theirs with this at load. `name` is the weight, `what`
/// the scale's kind.
pub fn check_scales(op: &'static str, name: &str, what: &str, scales: &[f32]) -> Result<()> {
    if let Some((i, s)) = scales
        .iter()
        .enumerate()
        .find(|(_, s)| !(s.is_finite() && **s > 0.0))
    {
        let at = if scales.len() == 1 {
            String::new()
        } else {
            format!(" at flat index {i}")
        };
        return Err(Error::input(
            op,
            format!("`{name}`: {what} must be finite and positive, got {s}{at}"),
        ));
    }
    Ok(())
}

/// `y = x·Wᵀ` with W [out, in].
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    scale: WeightScale,
    out_features: usize,
    in_features: usize,
    name: String,
}

impl Linear {
    /// Wraps a weight [out, in]: bf16/f16/f32 with [`WeightScale::None`], or e4m3 with a scale.
    pub fn new(name: impl Into<String>, weight: Tensor, scale: WeightScale) -> Result<Linear> {
        let name = name.into();
        let dims = weight.expect_rank("Linear::new", &name, 2, "[out, in]")?;
        let (out_features, in_features) = (dims[0], dims[1]);
        match &scale {
            WeightScale::None => {
                weight.expect_dtype(
                    "Linear::new",
                    &name,
                    &[DType::BF16, DType::F16, DType::F32],
                )?;
            }
            WeightScale::PerTensor(s) => {
                weight.expect_dtype("Linear::new", &name, &[DType::F8E4M3])?;
                check_scales("Linear::new", &name, "weight_scale", &[*s])?;
            }
            WeightScale::Block { scale_inv, block } => {
                weight.expect_dtype("Linear::new", &name, &[DType::F8E4M3])?;
                let want = match block {
                    0 => usize::MAX,
                    b => out_features.div_ceil(*b) * in_features.div_ceil(*b),
                };
                if scale_inv.len() != want {
                    return Err(Error::input(
                        "Linear::new",
                        format!(
                            "`{name}`: weight_scale_inv has {} values, expected {want} for {out_features}×{in_features} in {block}×{block} blocks",
                            scale_inv.len()
                        ),
                    ));
                }
                check_scales("Linear::new", &name, "weight_scale_inv", scale_inv)?;
            }
        }
        Ok(Linear {
            weight,
            scale,
            out_features,
            in_features,
            name,
        })
    }

    /// Loads `weight` [out, in] under `vb` (and its scale when `quant` says the layer is fp8).
    pub fn load(
        vb: &Vb,
        out_features: usize,
        in_features: usize,
        quant: &QuantizationConfig,
    ) -> Result<Linear> {
        let dims = [out_features, in_features];
        let name = vb.name("weight");
        let (weight, scale) = match quant {
            QuantizationConfig::None => (
                vb.get("weight", &dims, &[DType::BF16, DType::F16, DType::F32])?,
                WeightScale::None,
            ),
            QuantizationConfig::Fp8PerTensor { .. } => {
                let w = vb.get("weight", &dims, &[DType::F8E4M3])?;
                (w, WeightScale::PerTensor(vb.get_scalar("weight_scale")?))
            }
            QuantizationConfig::Fp8Block { block, .. } => {
                let w = vb.get("weight", &dims, &[DType::F8E4M3])?;
                let sdims = [
                    out_features.div_ceil(block[0]),
                    in_features.div_ceil(block[1]),
                ];
                let s = vb.get("weight_scale_inv", &sdims, &[DType::F32])?;
                (
                    w,
                    WeightScale::Block {
                        scale_inv: s.to_f32_vec()?,
                        block: block[0],
                    },
                )
            }
        };
        Linear::new(name, weight, scale)
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The real weight [out, in] in `dtype`, on the weight's device: the stored tensor itself
    /// when it already is `dtype` and unscaled; else computed on the host (a device weight is
    /// downloaded) as the CPU matmul widens it (code × scale in f32), rounded once to `dtype`.
    /// The device path's dense weights (fp8 checkpoints' linears are dequantized at load).
    pub fn dequantized(&self, dtype: DType) -> Result<Tensor> {
        if self.scale == WeightScale::None && self.weight.dtype() == dtype {
            return Ok(self.weight.clone());
        }
        let device = self.weight.device();
        let host = self.weight.to_device(fmoe_core::Device::Cpu)?;
        let s = host.cpu_storage("Linear::dequantized", &self.name)?;
        let k = self.in_features;
        let mut out = vec![0f32; self.out_features * k];
        fn rows<T: WithDType>(l: &Linear, w: &[T], out: &mut [f32]) {
            out.par_chunks_mut(l.in_features)
                .enumerate()
                .for_each(|(r, row)| l.widen_row(w, r, row));
        }
        use fmoe_core::CpuStorage as S;
        match s {
            S::F32(w) => rows(self, w, &mut out),
            S::BF16(w) => rows(self, w, &mut out),
            S::F16(w) => rows(self, w, &mut out),
            S::F8E4M3(w) => rows(self, w, &mut out),
            S::U32(_) => {
                return Err(fmoe_core::Error::DTypeMismatch {
                    op: "Linear::dequantized",
                    tensor: self.name.clone(),
                    expected: "bf16, f16, f32 or f8e4m3".into(),
                    got: DType::U32,
                }
                .into());
            }
        }
        Ok(Tensor::from_f32(
            &out,
            [self.out_features, k],
            dtype,
            &device,
        )?)
    }

    /// `x` [rows, in] → [rows, out].
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if x.len() != rows * self.in_features {
            return Err(Error::input(
                OP,
                format!(
                    "`{}`: input has {} values, expected {rows}×{}",
                    self.name,
                    x.len(),
                    self.in_features
                ),
            ));
        }
        let s = self.weight.cpu_storage(OP, &self.name)?;
        use fmoe_core::CpuStorage as S;
        Ok(match s {
            S::F32(w) => self.matmul(x, rows, w),
            S::BF16(w) => self.matmul::<bf16>(x, rows, w),
            S::F16(w) => self.matmul::<f16>(x, rows, w),
            S::F8E4M3(w) => self.matmul::<F8E4M3>(x, rows, w),
            S::U32(_) => {
                return Err(fmoe_core::Error::DTypeMismatch {
                    op: OP,
                    tensor: self.name.clone(),
                    expected: "bf16, f16, f32 or f8e4m3".into(),
                    got: DType::U32,
                }
                .into());
            }
        })
    }

    /// Widens weight row `r` into `out` (len = in_features), applying the scale.
    fn widen_row<T: WithDType>(&self, w: &[T], r: usize, out: &mut [f32]) {
        let k = self.in_features;
        let src = &w[r * k..(r + 1) * k];
        for (o, v) in out.iter_mut().zip(src) {
            *o = v.to_f32();
        }
        match &self.scale {
            WeightScale::None => {}
            WeightScale::PerTensor(s) => out.iter_mut().for_each(|o| *o *= s),
            WeightScale::Block { scale_inv, block } => {
                let kb = k.div_ceil(*block);
                let srow = &scale_inv[(r / block) * kb..(r / block + 1) * kb];
                for (chunk, s) in out.chunks_mut(*block).zip(srow) {
                    chunk.iter_mut().for_each(|o| *o *= s);
                }
            }
        }
    }

    fn matmul<T: WithDType>(&self, x: &[f32], rows: usize, w: &[T]) -> Vec<f32> {
        let (n, k) = (self.out_features, self.in_features);
        let starts: Vec<usize> = (0..n).step_by(ROW_BLOCK).collect();
        // Each task widens ROW_BLOCK weight rows once and dots them with every input row, so the
        // weight is read once per call whatever the number of tokens.
        let blocks: Vec<Vec<f32>> = starts
            .par_iter()
            .map(|&r0| {
                let nb = ROW_BLOCK.min(n - r0);
                let mut wf = vec![0f32; nb * k];
                for (j, row) in wf.chunks_mut(k).enumerate() {
                    self.widen_row(w, r0 + j, row);
                }
                let mut out = vec![0f32; rows * nb];
                tiles(x, rows, k, &wf, nb, &mut out);
                out
            })
            .collect();
        let mut y = vec![0f32; rows * n];
        for (&r0, block) in starts.iter().zip(&blocks) {
            let nb = ROW_BLOCK.min(n - r0);
            for i in 0..rows {
                y[i * n + r0..i * n + r0 + nb].copy_from_slice(&block[i * nb..(i + 1) * nb]);
            }
        }
        y
    }
}

/// `out[i·nb + j] = x_i · w_j` for `rows` rows of `x` and `nb` rows of `w` (both `[.., k]`), in
/// register tiles of 4 x-rows × 2 w-rows.
fn tiles(x: &[f32], rows: usize, k: usize, w: &[f32], nb: usize, out: &mut [f32]) {
    let xr = |i: usize| &x[i * k..(i + 1) * k];
    let wr = |j: usize| &w[j * k..(j + 1) * k];
    let mut i = 0;
    while i < rows {
        let r = if rows - i >= 4 { 4 } else { 1 };
        let mut j = 0;
        while j < nb {
            let c = if nb - j >= 2 { 2 } else { 1 };
            match (r, c) {
                (4, 2) => {
                    let t = dot_tile::<4, 2>(
                        [xr(i), xr(i + 1), xr(i + 2), xr(i + 3)],
                        [wr(j), wr(j + 1)],
                    );
                    for (a, row) in t.iter().enumerate() {
                        out[(i + a) * nb + j..(i + a) * nb + j + 2].copy_from_slice(row);
                    }
                }
                (4, _) => {
                    let t = dot_tile::<4, 1>([xr(i), xr(i + 1), xr(i + 2), xr(i + 3)], [wr(j)]);
                    for (a, row) in t.iter().enumerate() {
                        out[(i + a) * nb + j] = row[0];
                    }
                }
                (_, 2) => {
                    let t = dot_tile::<1, 2>([xr(i)], [wr(j), wr(j + 1)]);
                    out[i * nb + j..i * nb + j + 2].copy_from_slice(&t[0]);
                }
                _ => out[i * nb + j] = dot(xr(i), wr(j)),
            }
            j += c;
        }
        i += r;
    }
}

/// Dot product in f32 (AVX2/FMA when the CPU has them) over the first `min(a.len(), b.len())`
/// elements, as `a.iter().zip(b)` would pair them.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_tile::<1, 1>([a], [b])[0][0]
}

/// All R×C dot products of `x` rows with `w` rows, each over the shortest row's length (callers
/// pass rows of equal length; any lengths are sound).
fn dot_tile<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    let k = x.iter().chain(&w).map(|r| r.len()).min().unwrap_or(0);
    let (x, w) = (x.map(|r| &r[..k]), w.map(|r| &r[..k]));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above), which is all `avx2::dot_tile`
        // needs; its loads are in bounds for rows of any equal length, which they are here.
        return unsafe { avx2::dot_tile(x, w) };
    }
    dot_tile_portable(x, w)
}

/// Eight independent accumulators per product (vectorizes; no FMA libcalls).
fn dot_tile_portable<const R: usize, const C: usize>(
    x: [&[f32]; R],
    w: [&[f32]; C],
) -> [[f32; C]; R] {
    let mut out = [[0f32; C]; R];
    for (r, xr) in x.iter().enumerate() {
        for (c, wc) in w.iter().enumerate() {
            let mut acc = [0f32; 8];
            let ca = xr.chunks_exact(8);
            let cb = wc.chunks_exact(8);
            let tail: f32 = ca
                .remainder()
                .iter()
                .zip(cb.remainder())
                .map(|(a, b)| a * b)
                .sum();
            for (a, b) in ca.zip(cb) {
                for l in 0..8 {
                    acc[l] += a[l] * b[l];
                }
            }
            out[r][c] = ((acc[0] + acc[4]) + (acc[1] + acc[5]))
                + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
                + tail;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// R×C dot products, 8 lanes at a time with FMA; the `k % 8` tail in scalar. Every row is
    /// read over the shortest row's length `k`, so the loads stay in bounds whatever the lengths.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_tile<const R: usize, const C: usize>(
        x: [&[f32]; R],
        w: [&[f32]; C],
    ) -> [[f32; C]; R] {
        let k = x.iter().chain(&w).map(|r| r.len()).min().unwrap_or(0);
        let k8 = k - k % 8;
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut p = 0;
        while p < k8 {
            let mut wv = [_mm256_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: p + 8 <= k8 <= k, and k is the length of the shortest row, so the 8
                // floats from p are inside w[c] (an unaligned load needs no more).
                wv[c] = unsafe { _mm256_loadu_ps(w[c].as_ptr().add(p)) };
            }
            for r in 0..R {
                // SAFETY: as above, for x[r].
                let xv = unsafe { _mm256_loadu_ps(x[r].as_ptr().add(p)) };
                for c in 0..C {
                    acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
            p += 8;
        }
        let mut out = [[0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                let hi = _mm256_extractf128_ps(acc[r][c], 1);
                let lo = _mm256_castps256_ps128(acc[r][c]);
                let s = _mm_add_ps(lo, hi);
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
                let mut v = _mm_cvtss_f32(s);
                for q in k8..k {
                    v += x[r][q] * w[c][q];
                }
                out[r][c] = v;
            }
        }
        out
    }
}

/// Token embeddings [vocab, hidden] (any float dtype), looked up into f32 rows.
#[derive(Clone, Debug)]
pub struct Embedding {
    weight: Tensor,
    vocab: usize,
    hidden: usize,
}

impl Embedding {
    pub fn load(vb: &Vb, vocab: usize, hidden: usize) -> Result<Embedding> {
        let weight = vb.get(
            "weight",
            &[vocab, hidden],
            &[DType::BF16, DType::F16, DType::F32],
        )?;
        Ok(Embedding {
            weight,
            vocab,
            hidden,
        })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Rows of `ids` as f32 [ids.len(), hidden]; an id ≥ vocab is an error naming it.
    pub fn forward(&self, ids: &[u32]) -> Result<Vec<f32>> {
        const OP: &str = "Embedding::forward";
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(Error::input(
                OP,
                format!(
                    "token id {bad} is out of range for vocab_size {}",
                    self.vocab
                ),
            ));
        }
        let h = self.hidden;
        let mut out = vec![0f32; ids.len() * h];
        fn rows<T: WithDType>(w: &[T], ids: &[u32], h: usize, out: &mut [f32]) {
            for (o, &id) in out.chunks_mut(h).zip(ids) {
                let src = &w[id as usize * h..(id as usize + 1) * h];
                for (d, s) in o.iter_mut().zip(src) {
                    *d = s.to_f32();
                }
            }
        }
        match self.weight.cpu_storage(OP, "embed_tokens.weight")? {
            fmoe_core::CpuStorage::F32(w) => rows(w, ids, h, &mut out),
            fmoe_core::CpuStorage::BF16(w) => rows(w, ids, h, &mut out),
            fmoe_core::CpuStorage::F16(w) => rows(w, ids, h, &mut out),
            _ => {
                return Err(fmoe_core::Error::DTypeMismatch {
                    op: OP,
                    tensor: "embed_tokens.weight".into(),
                    expected: "bf16, f16 or f32".into(),
                    got: self.weight.dtype(),
                }
                .into());
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fmoe_core::Device;

    fn reference(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; rows * n];
        for i in 0..rows {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]))
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{i}: {x} vs {y}");
        }
    }

    #[test]
    fn matmul_matches_f64_for_every_dtype_and_odd_sizes() {
        let (rows, n, k) = (3, 37, 21);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let want = reference(&x, &w, rows, n, k);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = Tensor::from_f32(&w, [n, k], dtype, &Device::Cpu).unwrap();
            let lin = Linear::new("w", t, WeightScale::None).unwrap();
            close(&lin.forward(&x, rows).unwrap(), &want, 1e-5);
        }
        // fp8 with a per-tensor scale: codes = w / s exactly representable (multiples of 1/8 × 8).
        let s = 0.125;
        let codes: Vec<f32> = w.iter().map(|v| v / s).collect();
        let q = Tensor::from_f32(&codes, [n, k], DType::F8E4M3, &Device::Cpu).unwrap();
        let lin = Linear::new("wq", q.clone(), WeightScale::PerTensor(s)).unwrap();
        close(&lin.forward(&x, rows).unwrap(), &want, 1e-5);
        // Block scales: every block scale = s gives the same result.
        let nb = n.div_ceil(16) * k.div_ceil(16);
        let lin = Linear::new(
            "wb",
            q,
            WeightScale::Block {
                scale_inv: vec![s; nb],
                block: 16,
            },
        )
        .unwrap();
        close(&lin.forward(&x, rows).unwrap(), &want, 1e-5);
    }

    #[test]
    fn dot_of_unequal_rows_pairs_the_common_prefix() {
        // The AVX2 path used to read every row with the first row's length: b shorter than a
        // was read out of bounds. Now any lengths are sound and pair like zip.
        let a: Vec<f32> = (0..1000).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..13).map(|i| (i % 5) as f32 - 2.0).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(&a, &b), want);
        assert_eq!(dot(&b, &a), want);
        assert_eq!(dot(&a, &[]), 0.0);
        let exact: f32 = a.iter().map(|x| x * x).sum();
        assert_eq!(dot(&a, &a), exact);
    }

    #[test]
    fn bad_fp8_scales_are_refused_naming_the_weight() {
        let q = Tensor::from_f32(&[1.0; 6], [2, 3], DType::F8E4M3, &Device::Cpu).unwrap();
        for s in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = Linear::new("dense.weight", q.clone(), WeightScale::PerTensor(s))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("dense.weight") && e.contains("weight_scale"),
                "{e}"
            );
            let e = Linear::new(
                "blocked.weight",
                q.clone(),
                WeightScale::Block {
                    scale_inv: vec![1.0, s],
                    block: 2,
                },
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("blocked.weight")
                    && e.contains("weight_scale_inv")
                    && e.contains("index 1"),
                "{e}"
            );
        }
    }

    #[test]
    fn block_scales_apply_per_block() {
        // 2×3 weight of ones in 1×1 blocks... with block 2: rows 0-1 / cols 0-1 and col 2.
        let q = Tensor::from_f32(&[1.0; 6], [2, 3], DType::F8E4M3, &Device::Cpu).unwrap();
        let lin = Linear::new(
            "w",
            q,
            WeightScale::Block {
                scale_inv: vec![2.0, 3.0],
                block: 2,
            },
        )
        .unwrap();
        assert_eq!(lin.forward(&[1.0, 1.0, 1.0], 1).unwrap(), vec![7.0, 7.0]);
    }

    #[test]
    fn bad_inputs_name_the_layer() {
        let t = Tensor::zeros([2, 3], DType::BF16, &Device::Cpu).unwrap();
        let lin = Linear::new("model.q_proj.weight", t.clone(), WeightScale::None).unwrap();
        let e = lin.forward(&[0.0; 5], 2).unwrap_err().to_string();
        assert!(e.contains("model.q_proj.weight"), "{e}");
        let e = Linear::new("w", t, WeightScale::PerTensor(1.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("f8e4m3"), "{e}");
        let emb = Embedding {
            weight: Tensor::zeros([4, 2], DType::BF16, &Device::Cpu).unwrap(),
            vocab: 4,
            hidden: 2,
        };
        assert!(
            emb.forward(&[1, 4])
                .unwrap_err()
                .to_string()
                .contains("token id 4")
        );
    }
}
