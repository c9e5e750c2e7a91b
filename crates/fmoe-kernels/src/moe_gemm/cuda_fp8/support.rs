//! Which operands and devices the fp8 kernels take: Hopper only, fp8 activations and weights of
//! the same scheme, K and N multiples of 16; errors name the combination or the dimension.

use fmoe_core::{Device, Error as CoreError};

use super::{FP8_K_MULTIPLE, Fp8Scheme};
use crate::moe_gemm::{ActOperand, ActQuant, WeightOperand};
use crate::{Error, Result};

pub(super) fn unsupported(op: &'static str, device: Device, reason: String) -> Error {
    CoreError::Unsupported { op, device, reason }.into()
}

/// The fp8 kernels run on Hopper (compute capability 9.0) only.
pub(super) fn check_arch(op: &'static str, device: Device, cc: (u32, u32)) -> Result<()> {
    if cc == (9, 0) {
        return Ok(());
    }
    Err(unsupported(
        op,
        device,
        format!(
            "the CUDA fp8 grouped GEMMs use wgmma and need sm_90 (Hopper: H100/H200); this device \
             is sm_{}{}",
            cc.0, cc.1
        ),
    ))
}

pub(crate) fn is_fp8_act(a: &ActOperand) -> bool {
    !matches!(a, ActOperand::Plain(_))
}

pub(crate) fn is_fp8_weight(w: &WeightOperand) -> bool {
    !matches!(w, WeightOperand::Plain(_))
}

pub(super) fn act_kind(a: ActQuant) -> &'static str {
    match a {
        ActQuant::None => "unquantized",
        ActQuant::Fp8PerTensor => "fp8 per-tensor",
        ActQuant::Fp8Group => "fp8 1×128-group",
    }
}

fn weight_kind(w: &WeightOperand) -> String {
    match w {
        WeightOperand::Plain(t) => t.dtype().to_string(),
        WeightOperand::Fp8PerTensor { .. } => "fp8 per-tensor".into(),
        WeightOperand::Fp8Block { .. } => "fp8 128×128-block".into(),
    }
}

/// The scheme of matching fp8 operands, or `Unsupported` naming the combination.
pub(super) fn pair_scheme(
    op: &'static str,
    device: Device,
    act: ActQuant,
    w: &WeightOperand,
    wname: &str,
) -> Result<Fp8Scheme> {
    match (act, w) {
        (ActQuant::Fp8PerTensor, WeightOperand::Fp8PerTensor { .. }) => Ok(Fp8Scheme::PerTensor),
        (ActQuant::Fp8Group, WeightOperand::Fp8Block { .. }) => Ok(Fp8Scheme::Block),
        _ => Err(unsupported(
            op,
            device,
            format!(
                "no CUDA kernel for {} activations with {} weights `{wname}` (the CUDA fp8 GEMMs \
                 take fp8 per-tensor with fp8 per-tensor, fp8 1×128-group with fp8 128×128-block; \
                 bf16 with bf16)",
                act_kind(act),
                weight_kind(w)
            ),
        )),
    }
}

/// Ok if the fp8 kernels can run these operands on `device` (see [`crate::moe_gemm::check_device_support`]).
pub(crate) fn check_support(
    op: &'static str,
    device: Device,
    act_quant: ActQuant,
    w13: &WeightOperand,
    w2: &WeightOperand,
) -> Result<()> {
    let s1 = pair_scheme(op, device, act_quant, w13, "w13")?;
    let s2 = pair_scheme(op, device, act_quant, w2, "w2")?;
    debug_assert_eq!(s1, s2);
    let Device::Cuda(i) = device else {
        return Ok(());
    };
    check_arch(
        op,
        device,
        fmoe_core::cuda::cuda_backend(i)?.compute_capability(),
    )
}

/// `K` and `N` must be multiples of 16.
pub(super) fn check_dims(op: &'static str, k: usize, n: usize) -> Result<()> {
    for (what, v) in [
        ("K (hidden size, GEMM1's reduction length)", k),
        ("N (intermediate size, GEMM2's reduction length)", n),
    ] {
        if !v.is_multiple_of(FP8_K_MULTIPLE) {
            return Err(Error::invalid(
                op,
                format!(
                    "{what} = {v} must be a multiple of {FP8_K_MULTIPLE} for the CUDA fp8 GEMMs \
                     (16-byte rows of e4m3 codes)"
                ),
            ));
        }
    }
    Ok(())
}
