//! Routing: router logits `[M, E]` → for each of the M tokens, `k` expert ids and their weights.
//!
//! Two schemes:
//! - [`topk_softmax`] (Mixtral, Qwen-MoE): softmax over the E experts, top-k, optional
//!   renormalization of the k weights.
//! - [`grouped_topk`] (DeepSeek-V3 "noaux_tc"): sigmoid scores, a bias used only to *choose*
//!   experts, selection restricted to the best expert groups, weights from the unbiased scores.
//!
//! Both return a [`TopK`]: `weights` f32 `[M, k]` and `ids` u32 `[M, k]`, each row ordered by
//! descending selection score with ties going to the lower expert index, so the output is
//! deterministic (and identical between the serial and parallel CPU paths).
//!
//! Logits may be f32, bf16 or f16; they are converted to f32 before any arithmetic. A NaN or
//! infinite logit is an error ([`fmoe_core::Error::NonFinite`] naming `router_logits`): NaN has no
//! place in a top-k order and softmax of +Inf is undefined, so neither is silently routed.
//!
//! The functions validate, then dispatch on the logits' storage; `cpu.rs` holds the CPU twin and
//! `cuda.rs` the CUDA one (one warp per token, E ≤ 1024, any k ≤ E; more experts is an
//! [`fmoe_core::Error::Unsupported`]). On CUDA, finiteness is checked by the kernel, which flags
//! the first non-finite logit (and, for `grouped_topk`, bias entry). [`topk_softmax`] and
//! [`grouped_topk`] read the flags back (one host synchronization) and return the same
//! [`fmoe_core::Error::NonFinite`] as the CPU twin; [`topk_softmax_deferred`] and
//! [`grouped_topk_deferred`] return them unread as a [`FiniteCheck`], to be
//! [checked](FiniteCheck::check) where the caller synchronizes anyway (a model's forward pass
//! checks every layer's routing once, with its logits), giving that same error. On the CPU the
//! check is always made at once and the returned [`FiniteCheck`] has nothing pending. The CUDA
//! `grouped_topk` computes sigmoid with an exp rounded from f64, so its ids equal
//! the twin's and its weights differ from them by an ulp at most where the host's `expf` is
//! correctly rounded. Outputs stay on the logits' device.

mod cpu;
mod cuda;

pub(crate) use cuda::variants as cuda_variants;

use fmoe_core::{CpuStorage, DType, Storage, Tensor};

pub use crate::quant_fp8::FiniteCheck;
use crate::{Error, Result};

/// Name under which the router logits appear in errors.
const LOGITS: &str = "router_logits";
/// Name under which the DeepSeek-V3 selection bias appears in errors.
const BIAS: &str = "e_score_correction_bias";

/// Result of routing M tokens: `weights` f32 `[M, k]`, `ids` u32 `[M, k]`. Row order: descending
/// by the selection score, ties broken by lower expert index (deterministic).
#[derive(Clone, Debug)]
pub struct TopK {
    pub weights: Tensor,
    pub ids: Tensor,
}

/// Parameters of [`grouped_topk`], named as in the DeepSeek-V3 config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupedTopKParams {
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Number of groups of consecutive experts; must divide E.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Divide the k weights by their sum (`norm_topk_prob`).
    pub renormalize: bool,
    /// Multiplies the weights last, renormalized or not.
    pub routed_scaling_factor: f32,
}

/// Mixtral routing: softmax over the E experts in f32 → top-k → (if `renormalize`) divide the k
/// weights by their sum.
///
/// `logits` is `[M, E]`, f32, bf16 or f16. Requires `1 <= top_k <= E` and finite logits.
/// The order is that of the logits (softmax is monotonic), ties to the lower index. On CUDA the
/// finiteness flag is read before returning (a synchronization; see [`topk_softmax_deferred`]).
pub fn topk_softmax(logits: &Tensor, top_k: usize, renormalize: bool) -> Result<TopK> {
    let (topk, check) = topk_softmax_deferred(logits, top_k, renormalize)?;
    check.check()?;
    Ok(topk)
}

/// [`topk_softmax`] without waiting for the device: on CUDA the routing comes back with the
/// kernel's non-finite flag unread, as a [`FiniteCheck`] whose [`check`](FiniteCheck::check)
/// gives [`topk_softmax`]'s error (a row with a NaN/Inf logit is routed meaninglessly, to valid
/// expert ids, in the meantime). On the CPU non-finite logits are an error at once and nothing
/// is pending.
pub fn topk_softmax_deferred(
    logits: &Tensor,
    top_k: usize,
    renormalize: bool,
) -> Result<(TopK, FiniteCheck)> {
    const OP: &str = "topk_softmax";
    let (rows, experts) = check_logits(OP, logits)?;
    check_top_k(OP, top_k, experts)?;
    check_finite_logits(OP, logits)?;

    match logits.storage() {
        Storage::Cpu(s) => {
            let mut weights = vec![0f32; rows * top_k];
            let mut ids = vec![0u32; rows * top_k];
            let (w, i) = (&mut weights[..], &mut ids[..]);
            match s {
                CpuStorage::F32(v) => cpu::topk_softmax(v, experts, top_k, renormalize, w, i),
                CpuStorage::BF16(v) => cpu::topk_softmax(v, experts, top_k, renormalize, w, i),
                CpuStorage::F16(v) => cpu::topk_softmax(v, experts, top_k, renormalize, w, i),
                other => return Err(logits_dtype_error(OP, other.dtype())),
            }
            Ok((
                output(logits, rows, top_k, weights, ids)?,
                FiniteCheck::none(),
            ))
        }
        Storage::Cuda(s) => {
            let r = cuda::topk_softmax(&cuda::TopKSoftmaxArgs {
                logits: s,
                rows,
                experts,
                top_k,
                renormalize,
            })?;
            let mut check = FiniteCheck::none();
            if let Some(flags) = r.flags {
                let flags = Tensor::from_storage(Storage::Cuda(flags), [2])?;
                check.merge(FiniteCheck::lowest_index(
                    OP,
                    LOGITS,
                    flags,
                    0,
                    logits.clone(),
                ));
            }
            Ok((cuda_topk(r.weights, r.ids, rows, top_k)?, check))
        }
    }
}

/// DeepSeek-V3 "noaux_tc" routing.
///
/// - `s = sigmoid(logits)` in f32; `b = s + bias` (the bias only steers selection).
/// - Experts form `n_group` groups of `E / n_group` consecutive experts; a group's score is the
///   sum of its two best `b` (its one `b` if the group has a single expert). The `topk_group`
///   best groups are kept (ties → lower group index); experts of other groups cannot be chosen.
/// - The `top_k` best experts by `b` among the kept groups are chosen (ties → lower index).
/// - Weights are the *unbiased* `s` of the chosen experts; if `renormalize`, divided by their
///   sum (+1e-20 so that all-underflowed scores give 0, not NaN); then always multiplied by
///   `routed_scaling_factor`, as Hugging Face's DeepseekV3 does.
///
/// `logits` is `[M, E]` f32, bf16 or f16; `bias` is `[E]` f32, on the same device. On CUDA the
/// finiteness flags are read before returning (a synchronization; see [`grouped_topk_deferred`]).
pub fn grouped_topk(logits: &Tensor, bias: &Tensor, p: &GroupedTopKParams) -> Result<TopK> {
    let (topk, check) = grouped_topk_deferred(logits, bias, p)?;
    check.check()?;
    Ok(topk)
}

/// [`grouped_topk`] without waiting for the device: on CUDA the routing comes back with the
/// kernel's flags unread, as a [`FiniteCheck`] whose [`check`](FiniteCheck::check) gives
/// [`grouped_topk`]'s error (a non-finite logit before a non-finite bias entry). On the CPU
/// non-finite input is an error at once and nothing is pending.
pub fn grouped_topk_deferred(
    logits: &Tensor,
    bias: &Tensor,
    p: &GroupedTopKParams,
) -> Result<(TopK, FiniteCheck)> {
    const OP: &str = "grouped_topk";
    let (rows, experts) = check_logits(OP, logits)?;
    check_top_k(OP, p.top_k, experts)?;
    bias.expect_device(OP, BIAS, logits.device())?;
    bias.expect_dims(OP, BIAS, &[experts])?;
    bias.expect_dtype(OP, BIAS, &[DType::F32])?;
    check_groups(OP, p, experts)?;
    if !p.routed_scaling_factor.is_finite() {
        return Err(Error::invalid(
            OP,
            format!(
                "routed_scaling_factor must be finite, got {}",
                p.routed_scaling_factor
            ),
        ));
    }
    check_finite_logits(OP, logits)?;

    match logits.storage() {
        Storage::Cpu(s) => {
            let b = bias.cpu_slice::<f32>(OP, BIAS)?;
            // A NaN bias would corrupt the order as surely as a NaN logit.
            if let Some((index, value)) = cpu::first_non_finite(b) {
                return Err(non_finite(OP, BIAS, index, value));
            }
            let mut weights = vec![0f32; rows * p.top_k];
            let mut ids = vec![0u32; rows * p.top_k];
            let (w, i) = (&mut weights[..], &mut ids[..]);
            match s {
                CpuStorage::F32(v) => cpu::grouped_topk(v, b, p, w, i),
                CpuStorage::BF16(v) => cpu::grouped_topk(v, b, p, w, i),
                CpuStorage::F16(v) => cpu::grouped_topk(v, b, p, w, i),
                other => return Err(logits_dtype_error(OP, other.dtype())),
            }
            Ok((
                output(logits, rows, p.top_k, weights, ids)?,
                FiniteCheck::none(),
            ))
        }
        Storage::Cuda(s) => {
            let bias_s = crate::launch::cuda_storage(OP, BIAS, bias, logits.device())?;
            let r = cuda::grouped_topk(&cuda::GroupedTopKArgs {
                logits: s,
                bias: bias_s,
                rows,
                experts,
                params: *p,
            })?;
            let mut check = FiniteCheck::none();
            if let Some(flags) = r.flags {
                let flags = Tensor::from_storage(Storage::Cuda(flags), [4])?;
                // Logits first: the CPU twin reports them before the bias.
                check.merge(FiniteCheck::lowest_index(
                    OP,
                    LOGITS,
                    flags.clone(),
                    0,
                    logits.clone(),
                ));
                check.merge(FiniteCheck::lowest_index(OP, BIAS, flags, 2, bias.clone()));
            }
            Ok((cuda_topk(r.weights, r.ids, rows, p.top_k)?, check))
        }
    }
}

fn cuda_topk(
    weights: fmoe_core::cuda::CudaStorage,
    ids: fmoe_core::cuda::CudaStorage,
    rows: usize,
    top_k: usize,
) -> Result<TopK> {
    Ok(TopK {
        weights: Tensor::from_storage(Storage::Cuda(weights), [rows, top_k])?,
        ids: Tensor::from_storage(Storage::Cuda(ids), [rows, top_k])?,
    })
}

/// Rank 2 and a float dtype; returns (M, E).
fn check_logits(op: &'static str, logits: &Tensor) -> Result<(usize, usize)> {
    let dims = logits.expect_rank(op, LOGITS, 2, "[tokens, experts]")?;
    let (rows, experts) = (dims[0], dims[1]);
    logits.expect_dtype(op, LOGITS, &[DType::F32, DType::BF16, DType::F16])?;
    Ok((rows, experts))
}

fn check_top_k(op: &'static str, k: usize, experts: usize) -> Result<()> {
    if k == 0 || k > experts {
        return Err(Error::TopK { op, k, experts });
    }
    Ok(())
}

fn check_groups(op: &'static str, p: &GroupedTopKParams, experts: usize) -> Result<()> {
    // checked_rem covers n_group = 0 too (and avoids `is_multiple_of`, newer than our MSRV).
    if experts.checked_rem(p.n_group) != Some(0) {
        return Err(Error::invalid(
            op,
            format!(
                "n_group {} must be >= 1 and divide the {experts} experts",
                p.n_group
            ),
        ));
    }
    if p.topk_group == 0 || p.topk_group > p.n_group {
        return Err(Error::invalid(
            op,
            format!(
                "topk_group {} is not in 1..={} (n_group)",
                p.topk_group, p.n_group
            ),
        ));
    }
    let group_size = experts / p.n_group;
    let reachable = p.topk_group * group_size;
    if p.top_k > reachable {
        return Err(Error::invalid(
            op,
            format!(
                "top_k {} exceeds the {reachable} experts of the kept groups \
                 (topk_group {} x {group_size} experts per group)",
                p.top_k, p.topk_group
            ),
        ));
    }
    Ok(())
}

/// Host logits are scanned here; device logits are checked by the kernel itself.
fn check_finite_logits(op: &'static str, logits: &Tensor) -> Result<()> {
    let hit = match logits.storage() {
        Storage::Cpu(s) => match s {
            CpuStorage::F32(v) => cpu::first_non_finite(v),
            CpuStorage::BF16(v) => cpu::first_non_finite(v),
            CpuStorage::F16(v) => cpu::first_non_finite(v),
            other => return Err(logits_dtype_error(op, other.dtype())),
        },
        Storage::Cuda(_) => None,
    };
    match hit {
        Some((index, value)) => Err(non_finite(op, LOGITS, index, value)),
        None => Ok(()),
    }
}

fn non_finite(op: &'static str, tensor: &str, index: usize, value: f32) -> Error {
    fmoe_core::Error::NonFinite {
        op,
        tensor: tensor.to_string(),
        index,
        value,
    }
    .into()
}

// Unreachable after `check_logits`, but an error is cheaper than a panic to reason about.
fn logits_dtype_error(op: &'static str, got: DType) -> Error {
    fmoe_core::Error::DTypeMismatch {
        op,
        tensor: LOGITS.to_string(),
        expected: "f32 or bf16 or f16".to_string(),
        got,
    }
    .into()
}

fn output(
    logits: &Tensor,
    rows: usize,
    top_k: usize,
    weights: Vec<f32>,
    ids: Vec<u32>,
) -> Result<TopK> {
    let device = logits.device();
    Ok(TopK {
        weights: Tensor::from_vec(weights, [rows, top_k], &device)?,
        ids: Tensor::from_vec(ids, [rows, top_k], &device)?,
    })
}
