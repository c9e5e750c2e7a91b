//! Router logits → top-k experts, as the layer's [`Routing`] says.

use fmoe_core::Tensor;
use fmoe_kernels::routing::{self, GroupedTopKParams, TopK};

use crate::{Error, MoeConfig, Result, Routing};

/// Routes `logits` [M, E]. `bias` is DeepSeek-V3's `e_score_correction_bias` [E] (f32), required
/// for grouped sigmoid routing.
pub fn route(config: &MoeConfig, logits: &Tensor, bias: Option<&Tensor>) -> Result<TopK> {
    Ok(match config.routing {
        Routing::Softmax { renormalize } => {
            routing::topk_softmax(logits, config.top_k, renormalize)?
        }
        Routing::GroupedSigmoid {
            n_group,
            topk_group,
            renormalize,
            routed_scaling_factor,
        } => {
            let bias = bias.ok_or_else(|| {
                Error::Config("grouped sigmoid routing needs e_score_correction_bias".to_string())
            })?;
            let p = GroupedTopKParams {
                top_k: config.top_k,
                n_group,
                topk_group,
                renormalize,
                routed_scaling_factor,
            };
            routing::grouped_topk(logits, bias, &p)?
        }
    })
}
