//! The two ends every causal LM here shares: token embeddings in, final RMSNorm and the language-
//! model head out (`model.embed_tokens`, `model.norm`, `lm_head`, or the embeddings themselves when
//! `tie_word_embeddings`).

use fmoe_core::{Device, Tensor};

use crate::Result;
use crate::config::QuantizationConfig;
use crate::layers::{Embedding, Linear, RmsNorm, WeightScale};
use crate::loader::Vb;
use crate::model::{ForwardBatch, LogitsFor};

pub struct LmEnds {
    embed_tokens: Embedding,
    norm: RmsNorm,
    lm_head: Linear,
}

impl LmEnds {
    /// Loads from the checkpoint root `vb` (`model.embed_tokens`, `model.norm`, `lm_head`).
    pub fn load(
        vb: &Vb,
        vocab: usize,
        hidden: usize,
        eps: f64,
        tie_word_embeddings: bool,
    ) -> Result<LmEnds> {
        let m = vb.pp("model");
        let embed_tokens = Embedding::load(&m.pp("embed_tokens"), vocab, hidden)?;
        let norm = RmsNorm::load(&m.pp("norm"), hidden, eps)?;
        let lm_head = if tie_word_embeddings {
            Linear::new(
                "model.embed_tokens.weight",
                embed_tokens.weight().clone(),
                WeightScale::None,
            )?
        } else {
            Linear::load(&vb.pp("lm_head"), vocab, hidden, &QuantizationConfig::None)?
        };
        Ok(LmEnds {
            embed_tokens,
            norm,
            lm_head,
        })
    }

    /// Hidden states [tokens, hidden] of the batch's token ids.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.embed_tokens.forward(tokens)
    }

    /// f32 logits [rows, vocab] for the rows of `h` that `which` asks for.
    pub fn logits(
        &self,
        h: &[f32],
        batch: &ForwardBatch,
        which: LogitsFor,
        vocab: usize,
    ) -> Result<Tensor> {
        let hidden = self.embed_tokens.weight().dims()[1];
        let rows = batch.logit_rows(which);
        let picked: Vec<f32> = rows
            .iter()
            .flat_map(|&r| h[r * hidden..(r + 1) * hidden].iter().copied())
            .collect();
        let normed = self.norm.forward(&picked)?;
        let logits = self.lm_head.forward(&normed, rows.len())?;
        Ok(Tensor::from_vec(logits, [rows.len(), vocab], &Device::Cpu)?)
    }
}
