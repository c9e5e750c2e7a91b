use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_kernels::elementwise;
use fmoe_kernels::quant_fp8::FiniteCheck;
use fmoe_kernels::routing::TopK;

use crate::dispatch::{self, KernelChoice};
use crate::method::{self, CheckpointExperts, MoeMethod};
use crate::{ActScales, Error, MoeConfig, QuantScheme, Result, router};

const OP: &str = "FusedMoe::forward";

/// DeepSeek-V3's always-on expert: a dense SwiGLU MLP of width `shared_intermediate`, stored like
/// one extra expert (w13 [1, 2Ns, K], w2 [1, K, Ns]) and served by the same method.
pub struct SharedExpert {
    method: Box<dyn MoeMethod>,
}

/// One MoE layer: router → experts (→ + shared expert).
pub struct FusedMoe {
    config: MoeConfig,
    scheme: QuantScheme,
    device: Device,
    choice: KernelChoice,
    method: Box<dyn MoeMethod>,
    shared: Option<SharedExpert>,
    /// DeepSeek-V3 `e_score_correction_bias` [E], f32.
    bias: Option<Tensor>,
}

impl FusedMoe {
    /// Creates the method, resolves the kernel from `switches`, and processes the weights for it.
    ///
    /// Checkpoint tensors (and the bias) are moved to `device` first (a no-op for tensors already
    /// there). Dense weights given to an fp8 method are quantized on `device` (on CUDA: bf16 or
    /// f32 weights). On CUDA the fp8 methods need an sm_90 GPU: elsewhere their forward is an
    /// error naming it.
    pub fn new(
        config: MoeConfig,
        scheme: QuantScheme,
        experts: CheckpointExperts,
        shared: Option<CheckpointExperts>,
        bias: Option<Tensor>,
        switches: &FusedSwitches,
        device: Device,
    ) -> Result<FusedMoe> {
        config.validate()?;
        let experts = experts.to_device(device)?;
        let shared = shared.map(|s| s.to_device(device)).transpose()?;
        let bias = bias.map(|b| b.to_device(device)).transpose()?;
        let choice = dispatch::resolve(switches, scheme, device)?;
        dispatch::log_choice_once(scheme, device, &choice);
        let dims = (config.num_experts, config.hidden, config.intermediate);
        let mut method = method::create(scheme, experts, dims)?;
        method.process_weights_after_loading(choice.family)?;
        let shared = match (shared, config.shared_intermediate) {
            (Some(ckpt), Some(ns)) => {
                let mut m = method::create(scheme, ckpt, (1, config.hidden, ns))?;
                m.process_weights_after_loading(choice.family)?;
                Some(SharedExpert { method: m })
            }
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::Config(
                    "shared expert weights given but shared_intermediate is unset".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(Error::Config(
                    "shared_intermediate is set but no shared expert weights were given".into(),
                ));
            }
        };
        if matches!(config.routing, crate::Routing::GroupedSigmoid { .. }) && bias.is_none() {
            return Err(Error::Config(
                "grouped sigmoid routing needs e_score_correction_bias".into(),
            ));
        }
        if let Some(b) = &bias {
            b.expect_dims(
                "FusedMoe::new",
                "e_score_correction_bias",
                &[config.num_experts],
            )?;
            b.expect_dtype("FusedMoe::new", "e_score_correction_bias", &[DType::F32])?;
        }
        Ok(FusedMoe {
            config,
            scheme,
            device,
            choice,
            method,
            shared,
            bias,
        })
    }

    /// The layer with static activation scales for its routed experts (a static fp8 checkpoint's
    /// `input_scale`s, see [`ActScales::from_expert_input_scales`]); `Dynamic` restores the
    /// default. Only the fp8 per-tensor method takes static scales, and a layer with a shared
    /// expert does not (its inputs would need scales of their own).
    pub fn with_act_scales(mut self, scales: ActScales) -> Result<FusedMoe> {
        if self.shared.is_some() && scales != ActScales::Dynamic {
            return Err(Error::Config(
                "static activation scales are not supported with a shared expert".into(),
            ));
        }
        self.method.set_act_scales(scales)?;
        Ok(self)
    }

    pub fn config(&self) -> &MoeConfig {
        &self.config
    }
    pub fn scheme(&self) -> QuantScheme {
        self.scheme
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn kernel(&self) -> &KernelChoice {
        &self.choice
    }
    pub fn method(&self) -> &dyn MoeMethod {
        self.method.as_ref()
    }

    /// Routes `router_logits` [M, E] and runs the layer on `x` [M, K].
    ///
    /// On CUDA: the output is issued on the device's stream and not waited for; routing (Mixtral's
    /// `topk_softmax`) waits once for its non-finite-logit flag. `hidden_states` is not scanned
    /// for NaN/Inf there (see [`Self::forward_routed`]).
    pub fn forward(&self, x: &Tensor, router_logits: &Tensor) -> Result<Tensor> {
        self.check_input(x)?;
        router_logits.expect_dims(OP, "router_logits", &[x.dims()[0], self.config.num_experts])?;
        let topk = router::route(&self.config, router_logits, self.bias.as_ref())?;
        self.forward_routed(x, &topk)
    }

    /// Runs the layer with a routing decided elsewhere.
    ///
    /// On CUDA nothing here waits for the device: the NaN/Inf scan of `hidden_states` is skipped
    /// (non-finite inputs propagate to their token's output; with fp8 per-tensor activations
    /// to every token's, since they share the scale), the fp8 quantization kernels' NaN/Inf flags
    /// are not read (see [`Self::forward_routed_deferred`]), and expert ids are not checked
    /// against E (an id `>= E` contributes nothing to its token; validate an external routing with
    /// `fmoe_kernels::moe_align::align_routes(..)?.check()`, which synchronizes).
    pub fn forward_routed(&self, x: &Tensor, topk: &TopK) -> Result<Tensor> {
        Ok(self.forward_routed_deferred(x, topk)?.0)
    }

    /// [`Self::forward_routed`], also returning the NaN/Inf check of the batch's dynamic fp8
    /// quantizations (activations, intermediate): call [`FiniteCheck::check`] where the caller
    /// synchronizes anyway (it reads a few device words: one synchronization). Nothing is pending
    /// on the CPU or for unquantized layers.
    pub fn forward_routed_deferred(
        &self,
        x: &Tensor,
        topk: &TopK,
    ) -> Result<(Tensor, FiniteCheck)> {
        self.check_input(x)?;
        check_topk(x, topk)?;
        // Small batches launch the kernel chain (routed and shared experts) with Programmatic
        // Dependent Launch, the others plain (fmoe_kernels::PdlChain says when and why).
        let _pdl = fmoe_kernels::PdlChain::enter(self.device, x.dims()[0])?;
        let (y, mut check) = self.method.apply_deferred(x, topk, self.choice.family)?;
        let Some(shared) = &self.shared else {
            return Ok((y, check));
        };
        let m = x.dims()[0];
        // Memsets on CUDA: nothing is uploaded per batch.
        let all = TopK {
            ids: Tensor::zeros([m, 1], DType::U32, &self.device)?,
            weights: Tensor::full([m, 1], DType::F32, 1.0, &self.device)?,
        };
        let (s, c) = shared.method.apply_deferred(x, &all, self.choice.family)?;
        check.merge(c);
        // y + s in f32, rounded once to x's dtype (a kernel on CUDA).
        Ok((elementwise::add(&y, &s)?, check))
    }

    fn check_input(&self, x: &Tensor) -> Result<()> {
        x.expect_rank(OP, "hidden_states", 2, "[tokens, hidden]")?;
        x.expect_dims(OP, "hidden_states", &[x.dims()[0], self.config.hidden])?;
        x.expect_dtype(OP, "hidden_states", &[DType::BF16, DType::F16, DType::F32])?;
        x.expect_device(OP, "hidden_states", self.device)?;
        // On CUDA the scan would download the whole input and wait for the device on every batch,
        // so it is skipped there: a NaN or Inf input propagates to the outputs of its token.
        if !self.device.is_cpu() {
            return Ok(());
        }
        // A NaN or Inf would poison every expert it reaches; refuse it here with its position.
        if let Some((index, value)) = x
            .to_f32_vec()?
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite())
        {
            return Err(fmoe_core::Error::NonFinite {
                op: OP,
                tensor: "hidden_states".into(),
                index,
                value: *value,
            }
            .into());
        }
        Ok(())
    }
}

/// A routing must be ids u32 [M, top_k] and weights f32 of the same shape, M being x's rows; checked
/// here so that both kernel families name the tensor instead of an internal route count.
fn check_topk(x: &Tensor, topk: &TopK) -> Result<()> {
    let m = x.dims()[0];
    let ids = topk.ids.expect_rank(OP, "topk_ids", 2, "[tokens, top_k]")?;
    if ids[0] != m {
        return Err(fmoe_core::Error::ShapeMismatch {
            op: OP,
            tensor: "topk_ids".into(),
            expected: format!("[{m}, top_k] (one row per row of hidden_states)"),
            got: topk.ids.shape().clone(),
        }
        .into());
    }
    topk.ids.expect_dtype(OP, "topk_ids", &[DType::U32])?;
    topk.weights.expect_dims(OP, "topk_weights", ids)?;
    topk.weights
        .expect_dtype(OP, "topk_weights", &[DType::F32])?;
    Ok(())
}
