//! Causal softmax attention on the CPU.
//!
//! [`attend_head`] (fmoe-kernels' attention CPU twin, re-exported) is the core: one query head of one sequence against that sequence's keys and
//! values (GQA picks the kv head; a sliding window hides keys `window` or more positions back).
//! q·k and v widths are separate parameters, so DeepSeek's MLA (q·k over 192 = 128 nope + 64
//! rope, v of 128, keys decompressed from the cached latent) reuses it unchanged.
//!
//! [`Attention`] is the standard block (Mixtral, Llama): q/k/v projections, rotary on q and k,
//! K and V appended to the cache as streams 0 and 1 (`[tokens, kv_heads·head_dim]` each), then
//! the core over every (sequence, head) pair in parallel, then o_proj.

use rayon::prelude::*;

use crate::Result;
use crate::config::QuantizationConfig;
use crate::layers::linear::Linear;
use crate::layers::rotary::{RopeTable, Rotary};
use crate::loader::Vb;
use crate::model::{ForwardBatch, KvCache};
pub use fmoe_kernels::attention::{HeadGeometry, attend_head};

/// Shape of a standard attention block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Keys at distance ≥ `sliding_window` from the query are masked.
    pub sliding_window: Option<usize>,
}

/// Standard multi-head / grouped-query attention with a KV cache.
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    spec: AttentionSpec,
    scale: f32,
}

impl Attention {
    /// Loads `{q,k,v,o}_proj` under `vb` (the layer's `self_attn`).
    pub fn load(vb: &Vb, spec: AttentionSpec, quant: &QuantizationConfig) -> Result<Attention> {
        let (h, d) = (spec.hidden, spec.head_dim);
        let q_out = spec.num_heads * d;
        let kv_out = spec.num_kv_heads * d;
        Ok(Attention {
            q_proj: Linear::load(&vb.pp("q_proj"), q_out, h, quant)?,
            k_proj: Linear::load(&vb.pp("k_proj"), kv_out, h, quant)?,
            v_proj: Linear::load(&vb.pp("v_proj"), kv_out, h, quant)?,
            o_proj: Linear::load(&vb.pp("o_proj"), h, q_out, quant)?,
            spec,
            scale: 1.0 / (d as f32).sqrt(),
        })
    }

    /// Cache streams per layer: K and V, `kv_heads·head_dim` each.
    pub fn cache_streams(spec: &AttentionSpec) -> Vec<usize> {
        vec![spec.num_kv_heads * spec.head_dim; 2]
    }

    /// `x` [tokens, hidden] → [tokens, hidden], appending this layer's K/V to `cache`.
    pub fn forward(
        &self,
        x: &[f32],
        batch: &ForwardBatch,
        rotary: &Rotary,
        rope: &RopeTable,
        layer: usize,
        cache: &mut dyn KvCache,
    ) -> Result<Vec<f32>> {
        let t = batch.num_tokens();
        let s = &self.spec;
        let d = s.head_dim;
        let mut q = self.q_proj.forward(x, t)?;
        let mut k = self.k_proj.forward(x, t)?;
        let v = self.v_proj.forward(x, t)?;
        for (i, (qr, kr)) in q
            .chunks_mut(s.num_heads * d)
            .zip(k.chunks_mut(s.num_kv_heads * d))
            .enumerate()
        {
            qr.chunks_mut(d).for_each(|h| rotary.apply(rope, i, h));
            kr.chunks_mut(d).for_each(|h| rotary.apply(rope, i, h));
        }
        let kv_w = s.num_kv_heads * d;
        for sp in &batch.spans {
            let rows = sp.offset * kv_w..(sp.offset + sp.len) * kv_w;
            cache.append(sp.seq, layer, 0, &k[rows.clone()])?;
            cache.append(sp.seq, layer, 1, &v[rows])?;
        }
        let cache: &dyn KvCache = cache;
        let group = s.num_heads / s.num_kv_heads;
        let q_w = s.num_heads * d;
        let work: Vec<(usize, usize)> = (0..batch.spans.len())
            .flat_map(|i| (0..s.num_heads).map(move |h| (i, h)))
            .collect();
        let heads: Vec<Vec<f32>> = work
            .par_iter()
            .map(|&(i, h)| -> Result<Vec<f32>> {
                let sp = &batch.spans[i];
                let kc = cache.stream(sp.seq, layer, 0)?;
                let vc = cache.stream(sp.seq, layer, 1)?;
                // This head's query rows, made dense.
                let qh: Vec<f32> = (sp.offset..sp.offset + sp.len)
                    .flat_map(|r| q[r * q_w + h * d..r * q_w + (h + 1) * d].iter().copied())
                    .collect();
                let kvh = h / group;
                let g = HeadGeometry {
                    qk_dim: d,
                    v_dim: d,
                    k_stride: kv_w,
                    k_offset: kvh * d,
                    v_stride: kv_w,
                    v_offset: kvh * d,
                    scale: self.scale,
                    sliding_window: s.sliding_window,
                };
                Ok(attend_head(&qh, kc, vc, sp.start_pos, &g))
            })
            .collect::<Result<_>>()?;
        let mut out = vec![0f32; t * q_w];
        for (&(i, h), o) in work.iter().zip(&heads) {
            let sp = &batch.spans[i];
            for (r, row) in o.chunks(d).enumerate() {
                let at = (sp.offset + r) * q_w + h * d;
                out[at..at + d].copy_from_slice(row);
            }
        }
        self.o_proj.forward(&out, t)
    }
}
