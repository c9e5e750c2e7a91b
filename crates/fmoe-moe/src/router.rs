//! Router logits → top-k experts, as the layer's [`Routing`] says.

use fmoe_core::Tensor;
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::{self, GroupedTopKParams, TopK};

use crate::{Error, MoeConfig, Result, Routing};

/// Routes `logits` \[M, E\]. `bias` is DeepSeek-V3's `e_score_correction_bias` \[E\] (f32), required
/// for grouped sigmoid routing. On CUDA the kernels' non-finite flags are read before returning
/// (a synchronization; see [`route_deferred`]).
pub fn route(config: &MoeConfig, logits: &Tensor, bias: Option<&Tensor>) -> Result<TopK> {
    let (topk, check) = route_deferred(config, logits, bias)?;
    check.check()?;
    Ok(topk)
}

/// [`route`] without waiting for the device: on CUDA the NaN/Inf check of the logits (and bias)
/// comes back unread, to [`check`](FiniteCheck::check) where the caller synchronizes anyway; it
/// gives [`route`]'s error. Nothing is pending on the CPU.
pub fn route_deferred(
    config: &MoeConfig,
    logits: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(TopK, FiniteCheck)> {
    Ok(match config.routing {
        Routing::Softmax { renormalize } => {
            routing::topk_softmax_deferred(logits, config.top_k, renormalize)?
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
            routing::grouped_topk_deferred(logits, bias, &p)?
        }
    })
}
