//! CPU twin of the fused grouped GEMMs. Work is split into (expert, weight-row tile) items for
//! GEMM1 and weight-row tiles across all experts for GEMM2, so every output element has exactly one
//! writer and results do not depend on the thread count.

use fmoe_core::{CpuStorage, Device, Tensor};
use rayon::prelude::*;

use super::operand::{ActOperand, QBLOCK, WeightOperand};
use super::simd;
use crate::Result;
use crate::moe_align::{AlignedRoutes, mixed_blocks};

const OP1: &str = "moe_gemm::gemm1_silu_mul";
const OP2: &str = "moe_gemm::gemm2_weighted_sum";

/// Floats of converted weights per work item: 256 KiB of f32 keeps a tile in L2 while every route
/// of the expert streams through it.
const TILE_FLOATS: usize = 64 * 1024;

/// Weight rows per tile for a reduction length `cols` (a multiple of 4, the micro-kernel's width).
fn tile_rows(cols: usize) -> usize {
    ((TILE_FLOATS / cols.max(1)).clamp(4, 64) / 4) * 4
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Activation rows as f32 (exact codes for fp8) with the scales that turn them into values.
pub(super) struct ActRows {
    pub data: Vec<f32>,
    pub cols: usize,
    pub scale: ActScale,
}

pub(super) enum ActScale {
    One,
    Tensor(f32),
    /// [rows, ceil(cols / 128)]
    Group(Vec<f32>),
}

impl ActRows {
    pub fn from_operand(a: &ActOperand, op: &'static str) -> Result<ActRows> {
        let data = a.data();
        let cols = data.dims()[1];
        let values = data.cpu_storage(op, "activations")?.to_f32_vec();
        let scale = match a {
            ActOperand::Plain(_) => ActScale::One,
            ActOperand::Fp8PerTensor { scale, .. } => {
                ActScale::Tensor(scale.cpu_slice::<f32>(op, "activation_scale")?[0])
            }
            ActOperand::Fp8Group { scales, .. } => {
                ActScale::Group(scales.cpu_slice::<f32>(op, "activation_scales")?.to_vec())
            }
        };
        Ok(ActRows {
            data: values,
            cols,
            scale,
        })
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn groups(&self) -> usize {
        self.cols.div_ceil(QBLOCK)
    }

    /// Real values of row `r` (codes times scales), for the portable path.
    pub fn dequantized(&self) -> Vec<f32> {
        match &self.scale {
            ActScale::One => self.data.clone(),
            ActScale::Tensor(s) => self.data.iter().map(|v| v * s).collect(),
            ActScale::Group(scales) => {
                let g = self.groups();
                let mut out = self.data.clone();
                for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
                    for (c, v) in row.iter_mut().enumerate() {
                        *v *= scales[r * g + c / QBLOCK];
                    }
                }
                out
            }
        }
    }
}

/// Converts `dst.len()` elements of `s` starting at `start` into `dst`.
pub(crate) fn convert_into(s: &CpuStorage, start: usize, dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let end = start + dst.len();
    match s {
        CpuStorage::F32(v) => dst.copy_from_slice(&v[start..end]),
        CpuStorage::BF16(v) => v[start..end].convert_to_f32_slice(dst),
        CpuStorage::F16(v) => v[start..end].convert_to_f32_slice(dst),
        CpuStorage::F8E4M3(v) => {
            let lut = &fmoe_core::FP8_E4M3_TO_F32;
            for (d, q) in dst.iter_mut().zip(&v[start..end]) {
                *d = lut[q.to_bits() as usize];
            }
        }
        CpuStorage::U32(v) => {
            for (d, q) in dst.iter_mut().zip(&v[start..end]) {
                *d = *q as f32;
            }
        }
    }
}

/// Expert weights [E, rows, cols] on the host with their scales.
pub(super) struct WeightRows<'a> {
    pub storage: &'a CpuStorage,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub scale: WeightScale<'a>,
}

pub(super) enum WeightScale<'a> {
    One,
    PerExpert(&'a [f32]),
    /// [E, ceil(rows/128), ceil(cols/128)]
    Block(&'a [f32]),
}

impl<'a> WeightRows<'a> {
    pub fn new(w: &'a WeightOperand, op: &'static str, name: &str) -> Result<WeightRows<'a>> {
        let d = w.data().dims();
        let (experts, rows, cols) = (d[0], d[1], d[2]);
        let storage = w.data().cpu_storage(op, name)?;
        let scale = match w {
            WeightOperand::Plain(_) => WeightScale::One,
            WeightOperand::Fp8PerTensor { scales, .. } => {
                WeightScale::PerExpert(scales.cpu_slice::<f32>(op, name)?)
            }
            WeightOperand::Fp8Block { scale_inv, .. } => {
                WeightScale::Block(scale_inv.cpu_slice::<f32>(op, name)?)
            }
        };
        Ok(WeightRows {
            storage,
            experts,
            rows,
            cols,
            scale,
        })
    }

    /// Converts rows `rows` of expert `e` into `dst` ([rows.len(), cols], codes as f32).
    pub fn convert(&self, e: usize, rows: impl Iterator<Item = usize>, dst: &mut Vec<f32>) {
        dst.clear();
        for r in rows {
            let at = dst.len();
            dst.resize(at + self.cols, 0.0);
            convert_into(
                self.storage,
                (e * self.rows + r) * self.cols,
                &mut dst[at..],
            );
        }
    }

    /// The value scale of one whole row (`None` when it varies per 128-column block).
    fn row_scale(&self, e: usize) -> Option<f32> {
        match self.scale {
            WeightScale::One => Some(1.0),
            WeightScale::PerExpert(s) => Some(s[e]),
            WeightScale::Block(_) => None,
        }
    }

    /// Block scales of row `r` of expert `e` ([ceil(cols/128)]).
    fn block_scales(&self, e: usize, r: usize) -> &[f32] {
        let WeightScale::Block(s) = self.scale else {
            return &[];
        };
        let (rb, cb) = (self.rows.div_ceil(QBLOCK), self.cols.div_ceil(QBLOCK));
        let at = (e * rb + r / QBLOCK) * cb;
        &s[at..at + cb]
    }
}

/// out[i * nw + j] = value of Σ_c A[a_rows[i], c] · W[j, c] for converted weight rows `w`
/// (original row ids `w_ids`, needed for block scales), expert `e`. Routes go two at a time and
/// weight rows four at a time through the 2×4 micro-kernel; short edges repeat a row and drop it.
fn tile(
    act: &ActRows,
    a_rows: &[usize],
    wr: &WeightRows,
    e: usize,
    w: &[f32],
    w_ids: &[usize],
    out: &mut [f32],
) {
    let cols = act.cols;
    let nw = w_ids.len();
    let groups = act.groups();
    let row_scale = wr.row_scale(e);
    // Per-128-column promotion is needed as soon as either operand's scale varies along K.
    let blockwise = matches!(act.scale, ActScale::Group(_)) || row_scale.is_none();
    let a_scale = |row: usize, kb: usize| match &act.scale {
        ActScale::One => 1.0,
        ActScale::Tensor(s) => *s,
        ActScale::Group(s) => s[row * groups + kb],
    };
    for (pi, pair) in a_rows.chunks(2).enumerate() {
        let ra = [pair[0], pair[pair.len() - 1]];
        let (a0, a1) = (act.row(ra[0]), act.row(ra[1]));
        for (qj, quad) in w_ids.chunks(4).enumerate() {
            let j0 = qj * 4;
            let last = quad.len() - 1;
            let ws: [&[f32]; 4] = std::array::from_fn(|j| {
                let j = j0 + j.min(last);
                &w[j * cols..(j + 1) * cols]
            });
            let bs: [&[f32]; 4] = std::array::from_fn(|j| wr.block_scales(e, quad[j.min(last)]));
            let w_scale = |j: usize, kb: usize| row_scale.unwrap_or_else(|| bs[j][kb]);
            let mut acc = [[0f32; 4]; 2];
            if blockwise {
                for kb in 0..groups {
                    let (c0, c1) = (kb * QBLOCK, ((kb + 1) * QBLOCK).min(cols));
                    let d = simd::dot_2x4(&a0[c0..c1], &a1[c0..c1], ws.map(|r| &r[c0..c1]));
                    for i in 0..2 {
                        for j in 0..4 {
                            acc[i][j] += d[i][j] * (a_scale(ra[i], kb) * w_scale(j, kb));
                        }
                    }
                }
            } else {
                let d = simd::dot_2x4(a0, a1, ws);
                for i in 0..2 {
                    for j in 0..4 {
                        acc[i][j] = d[i][j] * (a_scale(ra[i], 0) * w_scale(j, 0));
                    }
                }
            }
            for (i, acc_i) in acc.iter().enumerate().take(pair.len()) {
                let o = (pi * 2 + i) * nw + j0;
                out[o..o + quad.len()].copy_from_slice(&acc_i[..quad.len()]);
            }
        }
    }
}

/// Each expert's routes, read from an alignment (mixed tiles: its short blocks, then its tall ones).
struct ExpertRuns<'a> {
    runs: Vec<Vec<u32>>,
    counts: &'a [u32],
}

impl<'a> ExpertRuns<'a> {
    fn new(routes: &'a AlignedRoutes, op: &'static str) -> Result<Self> {
        let sorted = routes.sorted_routes.cpu_slice::<u32>(op, "sorted_routes")?;
        let offsets = routes
            .expert_offsets
            .cpu_slice::<u32>(op, "expert_offsets")?;
        let counts = routes.expert_counts.cpu_slice::<u32>(op, "expert_counts")?;
        let tall = match &routes.tall {
            Some(t) => Some(
                t.expert_offsets
                    .cpu_slice::<u32>(op, "tall expert_offsets")?,
            ),
            None => None,
        };
        let runs = (0..routes.num_experts)
            .map(|e| {
                let c = counts[e] as usize;
                let in_short = match tall {
                    Some(_) => c.min(mixed_blocks(c, routes.block_m).0 * routes.block_m),
                    None => c,
                };
                let start = offsets[e] as usize;
                let mut run = sorted[start..start + in_short].to_vec();
                if let Some(t) = tall {
                    let start = t[e] as usize;
                    run.extend_from_slice(&sorted[start..start + c - in_short]);
                }
                run
            })
            .collect();
        Ok(ExpertRuns { runs, counts })
    }
    fn routes(&self, e: usize) -> &[u32] {
        &self.runs[e]
    }
}

pub(super) fn gemm1_silu_mul(
    a: &ActOperand,
    routes: &AlignedRoutes,
    top_k: usize,
    w13: &WeightOperand,
) -> Result<Tensor> {
    let act = ActRows::from_operand(a, OP1)?;
    let w = WeightRows::new(w13, OP1, "w13")?;
    let runs = ExpertRuns::new(routes, OP1)?;
    let n = w.rows / 2;
    let tn = tile_rows(2 * w.cols);
    let items: Vec<(usize, usize)> = (0..routes.num_experts)
        .filter(|&e| runs.counts[e] > 0)
        .flat_map(|e| (0..n).step_by(tn.max(1)).map(move |n0| (e, n0)))
        .collect();
    let tiles: Vec<Vec<f32>> = items
        .par_iter()
        .map(|&(e, n0)| {
            let n1 = (n0 + tn).min(n);
            let ids: Vec<usize> = (n0..n1).chain(n + n0..n + n1).collect();
            let mut wbuf = Vec::new();
            w.convert(e, ids.iter().copied(), &mut wbuf);
            let a_rows: Vec<usize> = runs.routes(e).iter().map(|&r| r as usize / top_k).collect();
            let nw = ids.len();
            let mut out = vec![0.0; a_rows.len() * nw];
            tile(&act, &a_rows, &w, e, &wbuf, &ids, &mut out);
            let half = n1 - n0;
            let mut h = vec![0.0; a_rows.len() * half];
            for (i, row) in out.chunks(nw).enumerate() {
                for j in 0..half {
                    h[i * half + j] = silu(row[j]) * row[half + j];
                }
            }
            h
        })
        .collect();
    let mut h = vec![0.0f32; routes.num_routes * n];
    for (&(e, n0), tile) in items.iter().zip(&tiles) {
        let half = (n0 + tn).min(n) - n0;
        for (i, &r) in runs.routes(e).iter().enumerate() {
            let r = r as usize;
            h[r * n + n0..r * n + n0 + half].copy_from_slice(&tile[i * half..(i + 1) * half]);
        }
    }
    Ok(Tensor::from_vec(h, [routes.num_routes, n], &Device::Cpu)?)
}

pub(super) fn gemm2_weighted_sum(
    h: &ActOperand,
    routes: &AlignedRoutes,
    topk_weights: &Tensor,
    w2: &WeightOperand,
) -> Result<Tensor> {
    let act = ActRows::from_operand(h, OP2)?;
    let w = WeightRows::new(w2, OP2, "w2")?;
    let runs = ExpertRuns::new(routes, OP2)?;
    let weights = topk_weights.cpu_slice::<f32>(OP2, "topk_weights")?;
    let (m, top_k) = (topk_weights.dims()[0], topk_weights.dims()[1]);
    let k = w.rows;
    let tk = tile_rows(w.cols);
    let starts: Vec<usize> = (0..k).step_by(tk.max(1)).collect();
    let tiles: Vec<Vec<f32>> = starts
        .par_iter()
        .map(|&k0| {
            let k1 = (k0 + tk).min(k);
            let width = k1 - k0;
            let ids: Vec<usize> = (k0..k1).collect();
            let mut y = vec![0.0f32; m * width];
            let mut wbuf = Vec::new();
            let mut out = Vec::new();
            for e in 0..routes.num_experts {
                let rs = runs.routes(e);
                if rs.is_empty() {
                    continue;
                }
                w.convert(e, k0..k1, &mut wbuf);
                let a_rows: Vec<usize> = rs.iter().map(|&r| r as usize).collect();
                out.clear();
                out.resize(a_rows.len() * width, 0.0);
                tile(&act, &a_rows, &w, e, &wbuf, &ids, &mut out);
                for (i, &r) in a_rows.iter().enumerate() {
                    let (t, wt) = (r / top_k, weights[r]);
                    let dst = &mut y[t * width..(t + 1) * width];
                    for (d, v) in dst.iter_mut().zip(&out[i * width..(i + 1) * width]) {
                        *d += wt * v;
                    }
                }
            }
            y
        })
        .collect();
    let mut y = vec![0.0f32; m * k];
    for (&k0, tile) in starts.iter().zip(&tiles) {
        let width = (k0 + tk).min(k) - k0;
        for t in 0..m {
            y[t * k + k0..t * k + k0 + width].copy_from_slice(&tile[t * width..(t + 1) * width]);
        }
    }
    Ok(Tensor::from_vec(y, [m, k], &Device::Cpu)?)
}

/// CPU twin of `moe_finalize.cu`: y[t, c] = Σ_j rows[t · top_k + j, c] for j ascending, in f32,
/// routes whose id is ≥ `num_experts` left out (`rows` already widened from bf16, exactly).
pub(crate) fn sum_route_rows(
    rows: &[f32],
    ids: &[u32],
    num_experts: usize,
    top_k: usize,
    k: usize,
) -> Vec<f32> {
    let m = ids.len() / top_k.max(1);
    let mut y = vec![0.0f32; m * k];
    for (t, yt) in y.chunks_mut(k.max(1)).enumerate().take(m) {
        for j in 0..top_k {
            let r = t * top_k + j;
            if ids[r] as usize >= num_experts {
                continue;
            }
            for (acc, v) in yt.iter_mut().zip(&rows[r * k..(r + 1) * k]) {
                *acc += v;
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::sum_route_rows;
    use crate::moe_align::{RouteTiling, align_routes_tiled};
    use crate::moe_gemm::{ActOperand, WeightOperand, gemm1_silu_mul, gemm2_weighted_sum};
    use fmoe_core::{Device, Tensor};

    /// The CPU GEMMs read mixed-tile alignments (experts in two segments) as the same per-expert
    /// routes as a uniform one: bit-identical h and y.
    #[test]
    fn mixed_tiles_give_the_same_products_as_uniform_ones() {
        let (m, e, k, n, top_k) = (40, 3, 16, 8, 2);
        let cpu = Device::Cpu;
        let val = |i: usize, s: usize| ((i * 7919 + s * 104_729) % 997) as f32 / 997.0 - 0.5;
        let x = Tensor::from_vec((0..m * k).map(|i| val(i, 1)).collect(), [m, k], &cpu).unwrap();
        let w13 = Tensor::from_vec(
            (0..e * 2 * n * k).map(|i| val(i, 2)).collect(),
            [e, 2 * n, k],
            &cpu,
        )
        .unwrap();
        let w2 =
            Tensor::from_vec((0..e * k * n).map(|i| val(i, 3)).collect(), [e, k, n], &cpu).unwrap();
        // Tiles of 4 and 6 rows: expert 0 takes 57 routes (15 short blocks), expert 1 18 (three
        // tall blocks), expert 2 5 (one tall block); interleaved over the tokens.
        let ids: Vec<u32> = (0..m * top_k)
            .map(|r| (r * 37) % (m * top_k))
            .map(|p| match p {
                0..57 => 0,
                57..75 => 1,
                _ => 2,
            })
            .collect();
        for (c, want) in [(57, (15, 0)), (18, (0, 3)), (5, (0, 1))] {
            assert_eq!(crate::moe_align::mixed_blocks(c, 4), want);
        }
        let ids = Tensor::from_vec(ids, [m, top_k], &cpu).unwrap();
        let weights = Tensor::from_vec(
            (0..m * top_k).map(|i| val(i, 4)).collect(),
            [m, top_k],
            &cpu,
        )
        .unwrap();
        let (a, w13, w2) = (
            ActOperand::Plain(x),
            WeightOperand::Plain(w13),
            WeightOperand::Plain(w2),
        );
        let run = |tiling| {
            let routes = align_routes_tiled(&ids, e, tiling).unwrap();
            let h = gemm1_silu_mul(&a, &routes, top_k, &w13).unwrap();
            let y =
                gemm2_weighted_sum(&ActOperand::Plain(h.clone()), &routes, &weights, &w2).unwrap();
            let v = |t: &Tensor| t.cpu_slice::<f32>("t", "t").unwrap().to_vec();
            (v(&h), v(&y))
        };
        let uniform = run(RouteTiling::Uniform(4));
        let mixed = run(RouteTiling::Mixed { short: 4, tall: 6 });
        assert_eq!(uniform, mixed);
    }

    #[test]
    fn sum_route_rows_adds_in_order_and_skips_dropped_routes() {
        // Token 0: routes 0, 1 (expert 9 ≥ E = 4: dropped), 2; token 1: routes 3, 4, 5.
        let rows = [
            1.0, 2.0, 100.0, 100.0, 0.5, 0.25, -1.0, 1.0, 3.0, 3.0, 1e8, -1e8,
        ];
        let ids = [0, 9, 3, 1, 2, 2];
        let y = sum_route_rows(&rows, &ids, 4, 3, 2);
        // Column 1 of token 1: (1 + 3) + (-1e8) in f32 is -1e8 + 4 rounded, in j order.
        assert_eq!(y, vec![1.5, 2.25, 2.0 + 1e8, (1.0f32 + 3.0) + -1e8]);
    }
}
