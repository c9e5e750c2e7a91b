//! Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`
//! computes it, with a compressed-latent KV cache.
//!
//! Per token `x`:
//! - `q = q_b(RMSNorm(q_a(x)))` (or `q_proj(x)` when `q_lora_rank` is null), per head
//!   `[nope | rope]`; the rope part is rotated (interleaved pairs, YaRN frequencies);
//! - `kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]`; the latent
//!   is normalized (`kv_a_layernorm`), `k_rope` rotated; it is shared by all heads;
//! - keys and values per head: `kv_b(latent) = [k_nope | v]`, `k = [k_nope | k_rope]`;
//! - `softmax(q·k · scale)·v` with `scale = (nope + rope)^-0.5 · mscale²`
//!   (`mscale = 0.1·mscale_all_dim·ln(factor) + 1` under YaRN), then `o_proj`.
//!
//! q_a/kv_a norms use eps 1e-6 whatever `rms_norm_eps` says (transformers hard-codes it).
//!
//! The cache holds what the heads share, per token: stream 0 the normalized latent
//! (`kv_lora_rank`), stream 1 the rotated `k_rope` (`qk_rope_head_dim`): 576 values per token and
//! layer for DeepSeek-V3 instead of 128 heads × (192 + 128).
//!
//! Two equal ways to attend over it (f32 rounding apart), picked per sequence by arithmetic
//! cost:
//! - decompress: `kv_b` over every cached latent, then standard attention (cheapest for prefill);
//! - absorb (DeepSeek's inference "absorb" mode): fold `kv_b`'s key half into the query,
//!   `q_nope·k_nope = (W_ukᵀ·q_nope)·latent`, attend in latent space (keys `[latent | k_rope]`,
//!   values `latent`), and apply `kv_b`'s value half to the result: the per-token work no
//!   longer grows with the cache (decode).

use fmoe_core::{DType, Tensor};
use rayon::prelude::*;

use crate::config::{DeepseekV3Config, QuantizationConfig, RopeScaling};
use crate::layers::attention::{HeadGeometry, attend_head};
use crate::layers::linear::{Linear, WeightScale};
use crate::layers::rms_norm::RmsNorm;
use crate::layers::rotary::{RopeTable, Rotary, yarn_mscale};
use crate::loader::Vb;
use crate::model::{ForwardBatch, KvCache, Span};
use crate::{Error, Result};

/// eps of `q_a_layernorm` and `kv_a_layernorm` (fixed in transformers, not `rms_norm_eps`).
pub const MLA_NORM_EPS: f64 = 1e-6;

/// Shape of an MLA block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSpec {
    pub hidden: usize,
    pub num_heads: usize,
    /// None: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Softmax scale (`(nope + rope)^-0.5 · mscale²`).
    pub scale: f32,
}

impl MlaSpec {
    /// The block `cfg` describes; the scale follows transformers: `qk_head_dim^-0.5`, times
    /// `yarn_mscale(factor, mscale_all_dim)²` when the rope is YaRN with a nonzero
    /// `mscale_all_dim`.
    pub fn from_config(cfg: &DeepseekV3Config) -> std::result::Result<MlaSpec, String> {
        if cfg.qk_nope_head_dim == 0 {
            return Err("qk_nope_head_dim must be positive".into());
        }
        let qk = cfg.qk_head_dim();
        let mut scale = (qk as f64).powf(-0.5);
        if let RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } = cfg.rope()?.scaling
            && m != 0.0
        {
            let ms = yarn_mscale(factor, m);
            scale *= ms * ms;
        }
        Ok(MlaSpec {
            hidden: cfg.hidden_size,
            num_heads: cfg.num_attention_heads,
            q_lora_rank: cfg.q_lora_rank,
            kv_lora_rank: cfg.kv_lora_rank,
            qk_nope_head_dim: cfg.qk_nope_head_dim,
            qk_rope_head_dim: cfg.qk_rope_head_dim,
            v_head_dim: cfg.v_head_dim,
            scale: scale as f32,
        })
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Cache streams per layer: the normalized latent and the rotated shared rope key.
    pub fn cache_streams(&self) -> Vec<usize> {
        vec![self.kv_lora_rank, self.qk_rope_head_dim]
    }
}

/// How the heads attend over the cache (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaPath {
    /// Whichever costs fewer multiply-adds for the sequence.
    Auto,
    Decompress,
    Absorb,
}

enum QProj {
    Lora { a: Linear, norm: RmsNorm, b: Linear },
    Plain(Linear),
}

/// Multi-head latent attention with a compressed KV cache.
pub struct Mla {
    q: QProj,
    kv_a_proj_with_mqa: Linear,
    kv_a_layernorm: RmsNorm,
    kv_b_proj: Linear,
    /// Per head `W_ukᵀ` [kv_lora_rank, nope] (kv_b's key rows, transposed).
    uk_t: Vec<Linear>,
    /// Per head `W_uv` [v_head_dim, kv_lora_rank] (kv_b's value rows).
    uv: Vec<Linear>,
    o_proj: Linear,
    spec: MlaSpec,
    path: MlaPath,
}

impl Mla {
    /// Loads the block under `vb` (a layer's `self_attn`).
    pub fn load(vb: &Vb, spec: MlaSpec, quant: &QuantizationConfig) -> Result<Mla> {
        let (h, nh) = (spec.hidden, spec.num_heads);
        let q = match spec.q_lora_rank {
            Some(rank) => QProj::Lora {
                a: Linear::load(&vb.pp("q_a_proj"), rank, h, quant)?,
                norm: RmsNorm::load(&vb.pp("q_a_layernorm"), rank, MLA_NORM_EPS)?,
                b: Linear::load(&vb.pp("q_b_proj"), nh * spec.qk_head_dim(), rank, quant)?,
            },
            None => QProj::Plain(Linear::load(
                &vb.pp("q_proj"),
                nh * spec.qk_head_dim(),
                h,
                quant,
            )?),
        };
        let r = spec.kv_lora_rank;
        let kv_a_proj_with_mqa = Linear::load(
            &vb.pp("kv_a_proj_with_mqa"),
            r + spec.qk_rope_head_dim,
            h,
            quant,
        )?;
        let kv_a_layernorm = RmsNorm::load(&vb.pp("kv_a_layernorm"), r, MLA_NORM_EPS)?;
        let kv_b = vb.pp("kv_b_proj");
        let kv_b_out = nh * (spec.qk_nope_head_dim + spec.v_head_dim);
        let (w, scale) = load_weight(&kv_b, kv_b_out, r, quant)?;
        let name = kv_b.name("weight");
        let (uk_t, uv) = split_kv_b(&name, &w, &scale, &spec)?;
        let kv_b_proj = Linear::new(name, w, scale)?;
        let o_proj = Linear::load(&vb.pp("o_proj"), h, nh * spec.v_head_dim, quant)?;
        Ok(Mla {
            q,
            kv_a_proj_with_mqa,
            kv_a_layernorm,
            kv_b_proj,
            uk_t,
            uv,
            o_proj,
            spec,
            path: MlaPath::Auto,
        })
    }

    pub fn spec(&self) -> &MlaSpec {
        &self.spec
    }

    /// Forces one way of attending (tests, benchmarks); the default is [`MlaPath::Auto`].
    pub fn set_path(&mut self, path: MlaPath) {
        self.path = path;
    }

    /// `x` [tokens, hidden] → [tokens, hidden], appending this layer's latent and rope key to
    /// `cache`.
    pub fn forward(
        &self,
        x: &[f32],
        batch: &ForwardBatch,
        rotary: &Rotary,
        rope: &RopeTable,
        layer: usize,
        cache: &mut dyn KvCache,
    ) -> Result<Vec<f32>> {
        let s = &self.spec;
        let t = batch.num_tokens();
        let (nh, dn, dr, r) = (
            s.num_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.kv_lora_rank,
        );
        let qk = s.qk_head_dim();
        let mut q = match &self.q {
            QProj::Lora { a, norm, b } => {
                let qa = norm.forward(&a.forward(x, t)?)?;
                b.forward(&qa, t)?
            }
            QProj::Plain(p) => p.forward(x, t)?,
        };
        for (i, row) in q.chunks_mut(nh * qk).enumerate() {
            row.chunks_mut(qk)
                .for_each(|head| rotary.apply(rope, i, &mut head[dn..]));
        }
        let ckv = self.kv_a_proj_with_mqa.forward(x, t)?;
        let mut latent = Vec::with_capacity(t * r);
        let mut k_rope = Vec::with_capacity(t * dr);
        for row in ckv.chunks(r + dr) {
            latent.extend_from_slice(&row[..r]);
            k_rope.extend_from_slice(&row[r..]);
        }
        let latent = self.kv_a_layernorm.forward(&latent)?;
        for (i, kr) in k_rope.chunks_mut(dr).enumerate() {
            rotary.apply(rope, i, kr);
        }
        for sp in &batch.spans {
            let rows = sp.offset..sp.offset + sp.len;
            cache.append(sp.seq, layer, 0, &latent[rows.start * r..rows.end * r])?;
            cache.append(sp.seq, layer, 1, &k_rope[rows.start * dr..rows.end * dr])?;
        }
        let cache: &dyn KvCache = cache;
        let mut out = vec![0f32; t * nh * s.v_head_dim];
        let mut absorbed = Vec::new();
        for sp in &batch.spans {
            let absorb = match self.path {
                MlaPath::Auto => self.absorb_is_cheaper(sp.len, sp.start_pos + sp.len),
                MlaPath::Decompress => false,
                MlaPath::Absorb => true,
            };
            if absorb {
                absorbed.push(sp);
            } else {
                self.attend_decompressed(&q, sp, layer, cache, &mut out)?;
            }
        }
        if !absorbed.is_empty() {
            self.attend_absorbed(&q, &absorbed, layer, cache, &mut out)?;
        }
        self.o_proj.forward(&out, t)
    }

    /// Multiply-adds of the two paths for `n` new tokens over `total` cached ones.
    fn absorb_is_cheaper(&self, n: usize, total: usize) -> bool {
        let s = &self.spec;
        let (nh, dn, dr, dv, r) = (
            s.num_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.v_head_dim,
            s.kv_lora_rank,
        );
        let decompress = total * nh * (dn + dv) * r + n * total * nh * (dn + dr + dv);
        let absorb = n * nh * (dn + dv) * r + n * total * nh * (2 * r + dr);
        absorb < decompress
    }

    /// The cached latent and rope key of `sp`, checked against its length.
    fn cached<'c>(
        &self,
        sp: &Span,
        layer: usize,
        cache: &'c dyn KvCache,
    ) -> Result<(&'c [f32], &'c [f32])> {
        let s = &self.spec;
        let total = sp.start_pos + sp.len;
        let lat = cache.stream(sp.seq, layer, 0)?;
        let kr = cache.stream(sp.seq, layer, 1)?;
        if lat.len() != total * s.kv_lora_rank || kr.len() != total * s.qk_rope_head_dim {
            return Err(Error::input(
                "Mla::forward",
                format!(
                    "sequence {} layer {layer}: the cache holds {} latent and {} rope values, expected {total} tokens",
                    sp.seq,
                    lat.len(),
                    kr.len()
                ),
            ));
        }
        Ok((lat, kr))
    }

    /// Keys and values of every cached token through `kv_b`, then standard attention per head.
    fn attend_decompressed(
        &self,
        q: &[f32],
        sp: &Span,
        layer: usize,
        cache: &dyn KvCache,
        out: &mut [f32],
    ) -> Result<()> {
        let s = &self.spec;
        let (nh, dn, dr, dv) = (
            s.num_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.v_head_dim,
        );
        let qk = dn + dr;
        let kvw = dn + dv;
        let total = sp.start_pos + sp.len;
        let (lat, kr) = self.cached(sp, layer, cache)?;
        let kv = self.kv_b_proj.forward(lat, total)?;
        let mut k = vec![0f32; total * nh * qk];
        for (j, kj) in k.chunks_mut(nh * qk).enumerate() {
            let rope = &kr[j * dr..(j + 1) * dr];
            for (h, kh) in kj.chunks_mut(qk).enumerate() {
                let src = j * nh * kvw + h * kvw;
                kh[..dn].copy_from_slice(&kv[src..src + dn]);
                kh[dn..].copy_from_slice(rope);
            }
        }
        let heads: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|h| {
                let qh = head_rows(q, sp.offset..sp.offset + sp.len, nh * qk, h * qk, qk);
                let g = HeadGeometry {
                    qk_dim: qk,
                    v_dim: dv,
                    k_stride: nh * qk,
                    k_offset: h * qk,
                    v_stride: nh * kvw,
                    v_offset: h * kvw + dn,
                    scale: s.scale,
                    sliding_window: None,
                };
                attend_head(&qh, &k, &kv, sp.start_pos, &g)
            })
            .collect();
        for (h, o) in heads.iter().enumerate() {
            for (i, row) in o.chunks(dv).enumerate() {
                let at = (sp.offset + i) * nh * dv + h * dv;
                out[at..at + dv].copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// Attention in latent space for the tokens of `spans` (kv_b folded into q and the output).
    fn attend_absorbed(
        &self,
        q: &[f32],
        spans: &[&Span],
        layer: usize,
        cache: &dyn KvCache,
        out: &mut [f32],
    ) -> Result<()> {
        let s = &self.spec;
        let (nh, dn, dr, dv, r) = (
            s.num_heads,
            s.qk_nope_head_dim,
            s.qk_rope_head_dim,
            s.v_head_dim,
            s.kv_lora_rank,
        );
        let qk = dn + dr;
        let rows: Vec<usize> = spans
            .iter()
            .flat_map(|sp| sp.offset..sp.offset + sp.len)
            .collect();
        let n = rows.len();
        // Per sequence, keys [total, r + dr] = [latent | k_rope] (shared by the heads).
        let mut keys = Vec::with_capacity(spans.len());
        let mut values = Vec::with_capacity(spans.len());
        for sp in spans {
            let (lat, kr) = self.cached(sp, layer, cache)?;
            let k: Vec<f32> = lat
                .chunks(r)
                .zip(kr.chunks(dr))
                .flat_map(|(l, k)| l.iter().chain(k).copied())
                .collect();
            keys.push(k);
            values.push(lat);
        }
        let heads: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|h| -> Result<Vec<f32>> {
                let q_nope: Vec<f32> = rows
                    .iter()
                    .flat_map(|&i| q[i * nh * qk + h * qk..][..dn].iter().copied())
                    .collect();
                let q_lat = self.uk_t[h].forward(&q_nope, n)?;
                let mut ctx = Vec::with_capacity(n * r);
                let mut at = 0;
                for ((sp, k), v) in spans.iter().zip(&keys).zip(&values) {
                    let mut qh = Vec::with_capacity(sp.len * (r + dr));
                    for i in 0..sp.len {
                        qh.extend_from_slice(&q_lat[(at + i) * r..(at + i + 1) * r]);
                        let src = (sp.offset + i) * nh * qk + h * qk + dn;
                        qh.extend_from_slice(&q[src..src + dr]);
                    }
                    let g = HeadGeometry {
                        qk_dim: r + dr,
                        v_dim: r,
                        k_stride: r + dr,
                        k_offset: 0,
                        v_stride: r,
                        v_offset: 0,
                        scale: s.scale,
                        sliding_window: None,
                    };
                    ctx.extend(attend_head(&qh, k, v, sp.start_pos, &g));
                    at += sp.len;
                }
                self.uv[h].forward(&ctx, n)
            })
            .collect::<Result<_>>()?;
        for (h, o) in heads.iter().enumerate() {
            for (&i, row) in rows.iter().zip(o.chunks(dv)) {
                let at = i * nh * dv + h * dv;
                out[at..at + dv].copy_from_slice(row);
            }
        }
        Ok(())
    }
}

/// Rows `rows` of `x` (row stride `stride`), `width` values from `offset` each, made dense.
fn head_rows(
    x: &[f32],
    rows: std::ops::Range<usize>,
    stride: usize,
    offset: usize,
    width: usize,
) -> Vec<f32> {
    rows.flat_map(|i| x[i * stride + offset..][..width].iter().copied())
        .collect()
}

/// `weight` [out, in] under `vb` and its scale, as [`Linear::load`] reads them.
fn load_weight(
    vb: &Vb,
    out: usize,
    inp: usize,
    quant: &QuantizationConfig,
) -> Result<(Tensor, WeightScale)> {
    let dims = [out, inp];
    Ok(match quant {
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
            let sdims = [out.div_ceil(block[0]), inp.div_ceil(block[1])];
            let s = vb.get("weight_scale_inv", &sdims, &[DType::F32])?;
            (
                w,
                WeightScale::Block {
                    scale_inv: s.to_f32_vec()?,
                    block: block[0],
                },
            )
        }
    })
}

/// kv_b [heads·(nope + v), r] split per head into `W_ukᵀ` [r, nope] and `W_uv` [v, r] for the
/// absorbed path: in the stored dtype when unscaled (exact), else dequantized to f32.
fn split_kv_b(
    name: &str,
    w: &Tensor,
    scale: &WeightScale,
    s: &MlaSpec,
) -> Result<(Vec<Linear>, Vec<Linear>)> {
    let (dn, dv, r) = (s.qk_nope_head_dim, s.v_head_dim, s.kv_lora_rank);
    let mut vals = w.to_f32_vec()?;
    let dtype = match scale {
        WeightScale::None => w.dtype(),
        WeightScale::PerTensor(sc) => {
            vals.iter_mut().for_each(|v| *v *= sc);
            DType::F32
        }
        WeightScale::Block { scale_inv, block } => {
            let kb = r.div_ceil(*block);
            for (row, vr) in vals.chunks_mut(r).enumerate() {
                let srow = &scale_inv[(row / block) * kb..(row / block + 1) * kb];
                for (chunk, sc) in vr.chunks_mut(*block).zip(srow) {
                    chunk.iter_mut().for_each(|v| *v *= sc);
                }
            }
            DType::F32
        }
    };
    let cpu = fmoe_core::Device::Cpu;
    let mut uk_t = Vec::with_capacity(s.num_heads);
    let mut uv = Vec::with_capacity(s.num_heads);
    for (h, head) in vals.chunks(r * (dn + dv)).enumerate() {
        let (k, v) = head.split_at(dn * r);
        let mut kt = vec![0f32; r * dn];
        for (d, row) in k.chunks(r).enumerate() {
            for (c, &x) in row.iter().enumerate() {
                kt[c * dn + d] = x;
            }
        }
        uk_t.push(Linear::new(
            format!("{name} (head {h} keys, transposed)"),
            Tensor::from_f32(&kt, [r, dn], dtype, &cpu)?,
            WeightScale::None,
        )?);
        uv.push(Linear::new(
            format!("{name} (head {h} values)"),
            Tensor::from_f32(v, [dv, r], dtype, &cpu)?,
            WeightScale::None,
        )?);
    }
    Ok((uk_t, uv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeConfig;
    use crate::layers::rotary::RopeStyle;
    use crate::model::{KvLayout, SeqChunk, SeqId};
    use fmoe_core::Device;
    use std::collections::HashMap;

    struct Cache {
        layout: KvLayout,
        seqs: HashMap<SeqId, Vec<Vec<f32>>>,
    }

    impl KvCache for Cache {
        fn cached(&self, seq: SeqId, _: usize) -> Result<usize> {
            Ok(self.seqs.get(&seq).map_or(0, |s| s[0].len()) / self.layout.streams[0])
        }
        fn append(&mut self, seq: SeqId, _: usize, stream: usize, rows: &[f32]) -> Result<()> {
            let n = self.layout.streams.len();
            self.seqs.entry(seq).or_insert_with(|| vec![Vec::new(); n])[stream]
                .extend_from_slice(rows);
            Ok(())
        }
        fn stream(&self, seq: SeqId, _: usize, stream: usize) -> Result<&[f32]> {
            Ok(&self.seqs[&seq][stream])
        }
    }

    /// Deterministic values in [-a, a).
    fn values(n: usize, seed: u64, a: f32) -> Vec<f32> {
        let mut z = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
            })
            .collect()
    }

    fn linear(out: usize, inp: usize, seed: u64) -> Linear {
        let a = 2.0 / (inp as f32).sqrt();
        let t = Tensor::from_f32(
            &values(out * inp, seed, a),
            [out, inp],
            DType::BF16,
            &Device::Cpu,
        )
        .unwrap();
        Linear::new(format!("w{seed}"), t, WeightScale::None).unwrap()
    }

    /// An MLA block with weights large enough that attention is far from uniform; kv_b in e4m3
    /// with 4×4 block scales when `fp8`.
    fn block(q_lora_rank: Option<usize>, fp8: bool) -> Mla {
        let s = MlaSpec {
            hidden: 32,
            num_heads: 3,
            q_lora_rank,
            kv_lora_rank: 20,
            qk_nope_head_dim: 12,
            qk_rope_head_dim: 6,
            v_head_dim: 10,
            scale: 0.3,
        };
        let (nh, qk, r) = (s.num_heads, s.qk_head_dim(), s.kv_lora_rank);
        let q = match q_lora_rank {
            Some(rank) => QProj::Lora {
                a: linear(rank, s.hidden, 1),
                norm: RmsNorm::new(vec![1.0; rank], MLA_NORM_EPS),
                b: linear(nh * qk, rank, 2),
            },
            None => QProj::Plain(linear(nh * qk, s.hidden, 3)),
        };
        let kv_b_out = nh * (s.qk_nope_head_dim + s.v_head_dim);
        let (w, scale) = if fp8 {
            let codes = values(kv_b_out * r, 4, 200.0);
            let blocks = kv_b_out.div_ceil(4) * r.div_ceil(4);
            let scale_inv: Vec<f32> = values(blocks, 5, 1.0)
                .iter()
                .map(|v| (v.abs() + 0.5) / 200.0)
                .collect();
            (
                Tensor::from_f32(&codes, [kv_b_out, r], DType::F8E4M3, &Device::Cpu).unwrap(),
                WeightScale::Block {
                    scale_inv,
                    block: 4,
                },
            )
        } else {
            (linear(kv_b_out, r, 6).weight().clone(), WeightScale::None)
        };
        let (uk_t, uv) = split_kv_b("kv_b", &w, &scale, &s).unwrap();
        Mla {
            q,
            kv_a_proj_with_mqa: linear(r + s.qk_rope_head_dim, s.hidden, 7),
            kv_a_layernorm: RmsNorm::new(vec![1.0; r], MLA_NORM_EPS),
            kv_b_proj: Linear::new("kv_b", w, scale).unwrap(),
            uk_t,
            uv,
            o_proj: linear(s.hidden, nh * s.v_head_dim, 8),
            spec: s,
            path: MlaPath::Auto,
        }
    }

    /// Two batches (two sequences prefilled, then one and two more tokens) through `path`; the
    /// outputs of both.
    fn run(mla: &mut Mla, path: MlaPath) -> Vec<f32> {
        mla.set_path(path);
        let rotary = Rotary::new(
            &RopeConfig {
                theta: 10000.0,
                scaling: RopeScaling::Default,
            },
            mla.spec.qk_rope_head_dim,
            RopeStyle::Interleaved,
        );
        let mut cache = Cache {
            layout: KvLayout {
                num_layers: 1,
                streams: mla.spec.cache_streams(),
            },
            seqs: HashMap::new(),
        };
        let chunk = |seq, n, start_pos| SeqChunk {
            seq,
            tokens: vec![0; n],
            start_pos,
        };
        let mut outs = Vec::new();
        for (step, chunks) in [
            vec![chunk(0, 5, 0), chunk(1, 3, 0)],
            vec![chunk(0, 1, 5), chunk(1, 2, 3)],
        ]
        .into_iter()
        .enumerate()
        {
            let batch = ForwardBatch::new(&chunks, &cache, 64).unwrap();
            let table = rotary.table(&batch.positions);
            let x = values(batch.num_tokens() * mla.spec.hidden, 10 + step as u64, 1.5);
            outs.extend(
                mla.forward(&x, &batch, &rotary, &table, 0, &mut cache)
                    .unwrap(),
            );
        }
        outs
    }

    #[test]
    fn absorbed_and_decompressed_attention_agree() {
        for (q_lora, fp8) in [(Some(16), false), (None, false), (Some(16), true)] {
            let mut mla = block(q_lora, fp8);
            let a = run(&mut mla, MlaPath::Decompress);
            let b = run(&mut mla, MlaPath::Absorb);
            let c = run(&mut mla, MlaPath::Auto);
            let max = a.iter().map(|v| v.abs()).fold(0f32, f32::max);
            assert!(max > 0.1, "{max}");
            for ((x, y), z) in a.iter().zip(&b).zip(&c) {
                assert!((x - y).abs() <= 1e-5 * max, "{x} vs {y} (max {max})");
                assert!((x - z).abs() <= 1e-5 * max, "{x} vs {z} (max {max})");
            }
            // Auto decompresses for a prefill and absorbs for decode.
            assert!(!mla.absorb_is_cheaper(5, 5) && mla.absorb_is_cheaper(1, 6));
        }
    }

    #[test]
    fn kv_b_splits_into_transposed_keys_and_values() {
        let mla = block(None, true);
        let (nh, dn, dv, r) = (3, 12, 10, 20);
        // kv_b applied to a unit latent e_c gives column c: compare with the split halves.
        for c in [0, 7, 19] {
            let mut e = vec![0f32; r];
            e[c] = 1.0;
            let col = mla.kv_b_proj.forward(&e, 1).unwrap();
            for h in 0..nh {
                let mut unit = vec![0f32; dn];
                for d in 0..dn {
                    unit.iter_mut().for_each(|u| *u = 0.0);
                    unit[d] = 1.0;
                    let kt = mla.uk_t[h].forward(&unit, 1).unwrap();
                    assert_eq!(kt[c], col[h * (dn + dv) + d]);
                }
                let v = mla.uv[h].forward(&e, 1).unwrap();
                assert_eq!(v[..], col[h * (dn + dv) + dn..(h + 1) * (dn + dv)]);
            }
        }
    }
}
