//! The engine's bookkeeping when a sequence's numbers go bad where the forward pass cannot flag
//! them (a NaN in the logits after the last router): a model that returns fixed logits, NaN in
//! the rows of the request that asks for prompt logprobs, run beside a healthy request. The bad request
//! must finish once, with an error; the other must finish normally; the pool must end empty.

use std::sync::Arc;

use fmoe_core::{DType, Device, Tensor};
use fmoe_engine::{Engine, EngineConfig, FinishReason, Request, RequestParams, SchedulerConfig};
use fmoe_kernels::attention::AttentionParams;
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_models::{
    AttentionLayout, CausalLm, ForwardInput, ForwardOutput, KvLayout, KvPool, ModelInfo,
};

const VOCAB: usize = 8;

/// Logits favour token 3; a sequence that asks for every row's logits (prompt logprobs: only the
/// bad request does) gets NaN rows.
struct Fixed {
    info: ModelInfo,
}

impl CausalLm for Fixed {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn forward(
        &self,
        input: &ForwardInput,
        _kv: &mut KvPool,
    ) -> fmoe_models::Result<ForwardOutput> {
        let mut rows = Vec::new();
        for &(_, n) in input.logit_spans() {
            rows.extend(std::iter::repeat_n(n > 1, n));
        }
        let v: Vec<f32> = rows
            .iter()
            .flat_map(|&bad| {
                (0..VOCAB).map(move |t| {
                    if bad {
                        f32::NAN
                    } else if t == 3 {
                        1.0
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        Ok(ForwardOutput {
            logits: Tensor::from_vec(v, [rows.len(), VOCAB], &Device::Cpu)?,
            checks: FiniteCheck::none(),
        })
    }
}

fn model() -> Arc<dyn CausalLm> {
    Arc::new(Fixed {
        info: ModelInfo {
            architecture: "Fixed",
            vocab_size: VOCAB,
            max_position_embeddings: 64,
            eos_token_ids: vec![],
            bos_token_id: None,
            kv_layout: KvLayout {
                num_layers: 1,
                streams: vec![1],
            },
            device: Device::Cpu,
            dtype: DType::F32,
            attention_layout: AttentionLayout::Paged,
            attention: AttentionParams {
                num_heads: 1,
                num_kv_heads: 1,
                qk_dim: 1,
                v_dim: 1,
                scale: 1.0,
                sliding_window: None,
            },
            moe: None,
        },
    })
}

#[test]
fn a_prompt_logprobs_failure_finishes_that_request_once_and_no_other() {
    let config = EngineConfig {
        block_size: 4,
        num_blocks: 16,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            max_num_seqs: 4,
        },
        prefix_caching: true,
        seed: 0,
    };
    let mut e = Engine::new(model(), None, config).unwrap();
    let bad = e
        .add_request(Request {
            prompt: vec![1, 2, 3, 4],
            params: RequestParams {
                max_tokens: 1,
                prompt_logprobs: Some(1),
                ..RequestParams::default()
            },
        })
        .unwrap();
    let good = e
        .add_request(Request {
            prompt: vec![2, 2],
            params: RequestParams {
                max_tokens: 5,
                ..RequestParams::default()
            },
        })
        .unwrap();
    let mut finishes = Vec::new();
    let mut good_ids = Vec::new();
    for _ in 0..20 {
        for o in e.step().unwrap() {
            if o.id == good {
                good_ids.extend(o.new_token_ids.clone());
            }
            if let Some(r) = o.finish_reason {
                finishes.push((o.id, r));
            }
        }
        if !e.has_unfinished() {
            break;
        }
    }
    assert_eq!(finishes.len(), 2, "{finishes:?}");
    assert!(
        matches!(&finishes.iter().find(|f| f.0 == bad).unwrap().1, FinishReason::Error(m) if m.contains("NaN")),
        "{finishes:?}"
    );
    assert_eq!(
        finishes.iter().find(|f| f.0 == good).unwrap().1,
        FinishReason::Length
    );
    assert_eq!(good_ids, vec![3; 5]);
    assert_eq!(e.stats().used_blocks, 0);
}
