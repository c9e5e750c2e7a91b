//! `quant_fp8`: fp8 quantization of activations and weights.
//!
//! # Format
//! Codes are OCP fp8 e4m3fn ([`F8E4M3`]): 1 sign, 4 exponent (bias 7) and 3 mantissa bits; the
//! largest finite magnitude is 448 (`S.1111.110`), `S.1111.111` is NaN and there is no infinity.
//! Normals start at 2^-6, subnormals are multiples of 2^-9. f32 -> e4m3 rounds to nearest, ties to
//! even, and saturates: anything beyond ±448 (±Inf included) becomes ±448.
//!
//! # Scales
//! A scale `s` is the dequantization multiplier (vLLM / DeepSeek-V3 convention): `x ≈ q · s` with
//! `q = sat_rne(x / s)`. The quotient is computed by division, not by multiplying with `1 / s`, so
//! only one f32 rounding precedes the fp8 rounding. A dynamic scale is
//! `max(amax, AMAX_FLOOR) / 448` ([`scale_from_amax`]), so the largest element maps to ±448 and an
//! all-zero tensor, group or block gets a tiny positive scale, codes 0 and an exact-zero
//! dequantization (no division by zero).
//!
//! Schemes:
//! - per tensor ([`quantize_per_tensor`], [`quantize_with_scale`]): one scale, shape `[1]`;
//! - per token group ([`quantize_per_token_group`]): `x [.., K]` gets `scales [.., ceil(K / g)]`,
//!   1 × g groups along the last dim (g = [`FP8_GROUP`] = 128 for activations);
//! - per block ([`quantize_block`]): `w [.., R, C]` gets `scale_inv [.., ceil(R / b0), ceil(C / b1)]`
//!   ([`FP8_BLOCK`] = 128 × 128 as DeepSeek-V3 stores `weight_scale_inv`).
//!
//! Ragged edge groups and blocks use the amax of the elements they actually cover.
//!
//! # Special values
//! - Dynamic quantization (scale from the data): a NaN or ±Inf anywhere is an error,
//!   [`fmoe_core::Error::NonFinite`] with the first offending flat index, because a non-finite amax
//!   makes every scale it touches meaningless.
//! - Quantization with a given scale: NaN -> NaN code (sign kept), ±Inf and |x / s| > 448 -> ±448.
//!   The scale itself must be finite and > 0.
//! - Dequantization multiplies and does not inspect scale values; NaN codes give NaN.
//!
//! Inputs may be f32, bf16 or f16 (converted exactly to f32 first). Codes come back as
//! [`DType::F8E4M3`] tensors, scales and dequantized values as [`DType::F32`], on the input's
//! device.
//!
//! # CUDA
//! The dynamic quantizations ([`quantize_per_tensor`], [`quantize_per_token_group`] with
//! `group` = [`FP8_GROUP`], [`quantize_block`] with [`FP8_BLOCK`]) have a CUDA twin
//! (`cuda/quant_fp8.cu`) that gives the same codes and scales bit for bit, for bf16 and f32 input
//! (f16, other group or block sizes, [`quantize_with_scale`] and the dequantizations are
//! [`fmoe_core::Error::Unsupported`] on CUDA). Outputs stay on the device, scales included.
//!
//! NaN/Inf: the kernels set a device flag instead of failing, because reading it is a
//! synchronization. The `_deferred` functions return it as a [`FiniteCheck`], to be
//! [checked](FiniteCheck::check) where the caller synchronizes anyway (the MoE layer's hot path
//! uses these); the plain functions check it before returning, so they report the CPU twin's
//! [`fmoe_core::Error::NonFinite`] (same index) on every device, at the price of one
//! synchronization on CUDA. On the CPU the check is always done eagerly and the returned
//! [`FiniteCheck`] has nothing pending.

pub mod cpu;
pub(crate) mod cuda;

use std::borrow::Cow;

use fmoe_core::{CpuStorage, DType, F8E4M3, FP8_E4M3_MAX, Shape, Storage, Tensor, WithDType};

use crate::{Error, Result};

/// DeepSeek-V3 weight block (rows, cols).
pub const FP8_BLOCK: [usize; 2] = [128, 128];
/// Activation token-group width.
pub const FP8_GROUP: usize = 128;
/// Smallest amax a dynamic scale is computed from.
pub const AMAX_FLOOR: f32 = 1e-10;

/// Dynamic scale for data whose largest magnitude is `amax`: `max(amax, AMAX_FLOOR) / 448`.
#[inline]
pub fn scale_from_amax(amax: f32) -> f32 {
    amax.max(AMAX_FLOOR) / FP8_E4M3_MAX
}

/// NaN/Inf checks whose flags are still on the device: the dynamic quantizations' here (see the
/// module docs) and the routing kernels' (`fmoe_kernels::routing`'s `_deferred` functions). Empty
/// on the CPU, where non-finite input is reported at once. Holding one keeps the flags' device
/// words (and the flagged data, to report the offending value) alive: see
/// [`FiniteCheck::held_bytes`].
#[derive(Clone, Debug, Default)]
pub struct FiniteCheck {
    pending: Vec<PendingFlag>,
}

#[derive(Clone, Debug)]
struct PendingFlag {
    op: &'static str,
    tensor: String,
    /// u32 words on the device; the flag starts at word `word`.
    flags: Tensor,
    word: usize,
    kind: FlagKind,
    /// The flagged data, to report the first non-finite element (None where it was never
    /// materialized, e.g. GEMM1's h inside the fused block-scaled kernel).
    data: Option<Tensor>,
}

/// How a kernel marks non-finite data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FlagKind {
    /// One u32 word, nonzero once set; the data is scanned for the first non-finite element.
    Set,
    /// A u64 (words `word`, `word + 1`, low first) lowered by `atomicMin` to the lowest flat
    /// index of a non-finite element; `u64::MAX` when there is none (the routing kernels).
    LowestIndex,
}

impl FiniteCheck {
    /// Nothing to check.
    pub fn none() -> FiniteCheck {
        FiniteCheck::default()
    }

    /// The flag in word `word` of the device u32 tensor `flags`, set by a kernel of `op` that
    /// quantized `tensor` (`data`, if still available, locates the first non-finite element).
    pub fn device_flag(
        op: &'static str,
        tensor: impl Into<String>,
        flags: Tensor,
        word: usize,
        data: Option<Tensor>,
    ) -> FiniteCheck {
        FiniteCheck {
            pending: vec![PendingFlag {
                op,
                tensor: tensor.into(),
                flags,
                word,
                kind: FlagKind::Set,
                data,
            }],
        }
    }

    /// The lowest flat index of a non-finite element of `data` (named `tensor`), which a kernel
    /// of `op` writes as a u64 into words `word`, `word + 1` of the device u32 tensor `flags`
    /// (`u64::MAX`: none). Reported as the NonFinite error of that index and its value.
    pub(crate) fn lowest_index(
        op: &'static str,
        tensor: impl Into<String>,
        flags: Tensor,
        word: usize,
        data: Tensor,
    ) -> FiniteCheck {
        FiniteCheck {
            pending: vec![PendingFlag {
                op,
                tensor: tensor.into(),
                flags,
                word,
                kind: FlagKind::LowestIndex,
                data: Some(data),
            }],
        }
    }

    /// Adds `other`'s flags to this check (after its own: [`Self::check`] reports the first
    /// flag set, in this order).
    pub fn merge(&mut self, other: FiniteCheck) {
        self.pending.extend(other.pending);
    }

    /// Whether any flag still has to be read.
    pub fn is_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Device bytes this check keeps alive (the flagged data and the flag words): a caller that
    /// defers many checks (a forward pass over every layer) reads them early past a bound.
    pub fn held_bytes(&self) -> usize {
        self.pending
            .iter()
            .map(|p| p.flags.size_in_bytes() + p.data.as_ref().map_or(0, |d| d.size_in_bytes()))
            .sum()
    }

    /// Reads every flag and reports the first one set as [`fmoe_core::Error::NonFinite`] with the
    /// first offending flat index of its tensor, or, when the data was not kept, an error naming
    /// the tensor. On CUDA the flags are gathered into one buffer (device-to-device copies) and
    /// downloaded once: one synchronization however many checks were merged.
    pub fn check(&self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let words = self.read_flags()?;
        for (p, w) in self.pending.iter().zip(&words) {
            let missing = || {
                Error::invalid(
                    p.op,
                    format!(
                        "the error flag of `{}` is word {} of {} words",
                        p.tensor,
                        p.word,
                        w.len()
                    ),
                )
            };
            match p.kind {
                FlagKind::Set => {
                    if *w.get(p.word).ok_or_else(missing)? == 0 {
                        continue;
                    }
                    return Err(p.scan());
                }
                FlagKind::LowestIndex => {
                    let (Some(&lo), Some(&hi)) = (w.get(p.word), w.get(p.word + 1)) else {
                        return Err(missing());
                    };
                    let index = u64::from(lo) | (u64::from(hi) << 32);
                    if index == u64::MAX {
                        continue;
                    }
                    let index = usize::try_from(index).unwrap_or(usize::MAX);
                    let value = match &p.data {
                        Some(d) => d.to_f32_vec()?.get(index).copied().unwrap_or(f32::NAN),
                        None => f32::NAN,
                    };
                    return Err(non_finite(p.op, &p.tensor, index, value));
                }
            }
        }
        Ok(())
    }

    /// Every pending flag's words, in order.
    fn read_flags(&self) -> Result<Vec<Vec<u32>>> {
        let cuda: Option<Vec<&fmoe_core::cuda::CudaStorage>> = self
            .pending
            .iter()
            .map(|p| match p.flags.storage() {
                Storage::Cuda(s) if s.dtype() == DType::U32 => Some(s),
                _ => None,
            })
            .collect();
        if let Some(parts) =
            cuda.filter(|v| v.len() > 1 && v.iter().all(|s| s.device() == v[0].device()))
        {
            let all = fmoe_core::cuda::CudaStorage::concat(&parts)?.to_cpu()?;
            let CpuStorage::U32(all) = all else {
                return Err(Error::invalid("FiniteCheck::check", "flags are not u32"));
            };
            let mut at = 0;
            return Ok(parts
                .iter()
                .map(|s| {
                    let w = all[at..at + s.len()].to_vec();
                    at += s.len();
                    w
                })
                .collect());
        }
        self.pending
            .iter()
            .map(|p| {
                let flags = p.flags.to_device(fmoe_core::Device::Cpu)?;
                Ok(flags.cpu_slice::<u32>(p.op, "error_flag")?.to_vec())
            })
            .collect()
    }
}

impl PendingFlag {
    /// The error of a set flag: the first non-finite element of the data, when kept.
    fn scan(&self) -> Error {
        let Some(data) = &self.data else {
            return Error::invalid(
                self.op,
                format!(
                    "`{}` holds NaN or Inf (flagged by the CUDA quantization kernel; the \
                     position is not reported)",
                    self.tensor
                ),
            );
        };
        let values = match data.to_f32_vec() {
            Ok(v) => v,
            Err(e) => return e.into(),
        };
        match values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            Some((i, &v)) => non_finite(self.op, &self.tensor, i, v),
            None => Error::invalid(
                self.op,
                format!(
                    "the CUDA kernel flagged NaN or Inf in `{}`, but it holds none now",
                    self.tensor
                ),
            ),
        }
    }
}

/// Dynamic per-tensor: one scale for the whole tensor. Returns (q same shape, scale f32 `[1]`),
/// both on x's device. NaN/Inf is an error (on CUDA found by reading the kernel's flag: a
/// synchronization; see [`quantize_per_tensor_deferred`]).
pub fn quantize_per_tensor(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (q, scale, check) = quantize_per_tensor_deferred(x)?;
    check.check()?;
    Ok((q, scale))
}

/// [`quantize_per_tensor`] without waiting for the NaN/Inf check on CUDA: returns it instead
/// (codes and scale are still written for every element; they are meaningless if it fails).
pub fn quantize_per_tensor_deferred(x: &Tensor) -> Result<(Tensor, Tensor, FiniteCheck)> {
    const OP: &str = "quant_fp8::quantize_per_tensor";
    match x.storage() {
        Storage::Cuda(s) => {
            let (q, scale, ctrl) = cuda::per_tensor(OP, s)?;
            let ctrl = Tensor::from_storage(Storage::Cuda(ctrl), [2])?;
            Ok((
                Tensor::from_storage(Storage::Cuda(q), x.shape().clone())?,
                Tensor::from_storage(Storage::Cuda(scale), [1])?,
                FiniteCheck::device_flag(OP, "x", ctrl, 1, Some(x.clone())),
            ))
        }
        Storage::Cpu(s) => {
            let xs = input_f32(OP, "x", s)?;
            let a = cpu::amax(&xs).map_err(|(i, v)| non_finite(OP, "x", i, v))?;
            let scale = scale_from_amax(a);
            let mut q = fp8_buffer(xs.len());
            cpu::quantize_slice(&xs, scale, &mut q);
            Ok((
                output(q, x.shape().clone(), x)?,
                output(vec![scale], [1], x)?,
                FiniteCheck::none(),
            ))
        }
    }
}

/// Static: quantizes with a given scale (NaN -> NaN, ±Inf and overflow -> ±448).
pub fn quantize_with_scale(x: &Tensor, scale: f32) -> Result<Tensor> {
    const OP: &str = "quant_fp8::quantize_with_scale";
    check_scale(OP, scale)?;
    match x.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(s) => {
            let xs = input_f32(OP, "x", s)?;
            let mut q = fp8_buffer(xs.len());
            cpu::quantize_slice(&xs, scale, &mut q);
            output(q, x.shape().clone(), x)
        }
    }
}

/// Static per-tensor with the scale as data: `scale` f32 `[1]` on x's device (a checkpoint's
/// `input_scale`, uploaded once; on CUDA never read by the host). Codes are those of
/// [`quantize_with_scale`] (round to nearest even, saturating to ±448). NaN/Inf in `x` is an
/// error, as for the dynamic scale: at once on the CPU, through the returned check on CUDA (the
/// codes are still written for every element).
pub fn quantize_static_deferred(x: &Tensor, scale: &Tensor) -> Result<(Tensor, FiniteCheck)> {
    const OP: &str = "quant_fp8::quantize_static";
    scale.expect_dtype(OP, "scale", &[DType::F32])?;
    scale.expect_dims(OP, "scale", &[1])?;
    scale.expect_device(OP, "scale", x.device())?;
    match (x.storage(), scale.storage()) {
        (Storage::Cuda(s), Storage::Cuda(sc)) => {
            let (q, flag) = cuda::per_tensor_static(OP, s, sc)?;
            let flag = Tensor::from_storage(Storage::Cuda(flag), [1])?;
            Ok((
                Tensor::from_storage(Storage::Cuda(q), x.shape().clone())?,
                FiniteCheck::device_flag(OP, "x", flag, 0, Some(x.clone())),
            ))
        }
        (Storage::Cpu(s), _) => {
            let sv = scale.cpu_slice::<f32>(OP, "scale")?[0];
            check_scale(OP, sv)?;
            let xs = input_f32(OP, "x", s)?;
            cpu::amax(&xs).map_err(|(i, v)| non_finite(OP, "x", i, v))?;
            let mut q = fp8_buffer(xs.len());
            cpu::quantize_slice(&xs, sv, &mut q);
            Ok((output(q, x.shape().clone(), x)?, FiniteCheck::none()))
        }
        _ => Err(Error::invalid(OP, "x and scale are on different devices")),
    }
}

/// `q · scale` as f32, same shape as `q`.
pub fn dequantize_per_tensor(q: &Tensor, scale: f32) -> Result<Tensor> {
    const OP: &str = "quant_fp8::dequantize_per_tensor";
    match q.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => {
            let qs = q.cpu_slice::<F8E4M3>(OP, "q")?;
            let mut out = vec![0.0f32; qs.len()];
            cpu::dequantize_slice(qs, scale, &mut out);
            output(out, q.shape().clone(), q)
        }
    }
}

/// Dynamic per-token-group along the last dim: `x [.., K]` -> `q [.., K]`,
/// `scales [.., ceil(K / group)]`. A ragged last group uses the amax of its own columns. On CUDA
/// `group` must be [`FP8_GROUP`], and NaN/Inf is found by a synchronization (see
/// [`quantize_per_token_group_deferred`]).
pub fn quantize_per_token_group(x: &Tensor, group: usize) -> Result<(Tensor, Tensor)> {
    let (q, scales, check) = quantize_per_token_group_deferred(x, group)?;
    check.check()?;
    Ok((q, scales))
}

/// [`quantize_per_token_group`] without waiting for the NaN/Inf check on CUDA: returns it instead.
pub fn quantize_per_token_group_deferred(
    x: &Tensor,
    group: usize,
) -> Result<(Tensor, Tensor, FiniteCheck)> {
    const OP: &str = "quant_fp8::quantize_per_token_group";
    check_group(OP, group)?;
    let scale_dims = group_scale_dims(OP, "x", x.shape(), group)?;
    let k = last_dim(x.shape());
    match x.storage() {
        Storage::Cuda(s) => {
            if group != cuda::GROUP {
                return Err(fmoe_core::Error::Unsupported {
                    op: OP,
                    device: s.device(),
                    reason: format!(
                        "the CUDA kernel quantizes groups of {}, not {group}",
                        cuda::GROUP
                    ),
                }
                .into());
            }
            let rows = s.len().checked_div(k).unwrap_or(0);
            let (q, scales, flag) = cuda::per_group(OP, s, rows, k)?;
            let flag = Tensor::from_storage(Storage::Cuda(flag), [1])?;
            Ok((
                Tensor::from_storage(Storage::Cuda(q), x.shape().clone())?,
                Tensor::from_storage(Storage::Cuda(scales), scale_dims)?,
                FiniteCheck::device_flag(OP, "x", flag, 0, Some(x.clone())),
            ))
        }
        Storage::Cpu(s) => {
            let xs = input_f32(OP, "x", s)?;
            let mut q = fp8_buffer(xs.len());
            let mut scales = vec![0.0f32; scale_dims.iter().product()];
            cpu::quantize_token_groups(&xs, k, group, &mut q, &mut scales)
                .map_err(|(i, v)| non_finite(OP, "x", i, v))?;
            Ok((
                output(q, x.shape().clone(), x)?,
                output(scales, scale_dims, x)?,
                FiniteCheck::none(),
            ))
        }
    }
}

/// Inverse of [`quantize_per_token_group`]; `scales` must be f32 `[.., ceil(K / group)]`.
pub fn dequantize_per_token_group(q: &Tensor, scales: &Tensor, group: usize) -> Result<Tensor> {
    const OP: &str = "quant_fp8::dequantize_per_token_group";
    check_group(OP, group)?;
    let scale_dims = group_scale_dims(OP, "q", q.shape(), group)?;
    check_scales(OP, "scales", q, scales, &scale_dims)?;
    match q.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => {
            let qs = q.cpu_slice::<F8E4M3>(OP, "q")?;
            let ss = scales.cpu_slice::<f32>(OP, "scales")?;
            let mut out = vec![0.0f32; qs.len()];
            cpu::dequantize_token_groups(qs, ss, last_dim(q.shape()), group, &mut out);
            output(out, q.shape().clone(), q)
        }
    }
}

/// Dynamic block quantization over the last two dims: `w [.., R, C]` -> `q [.., R, C]`,
/// `scale_inv [.., ceil(R / b0), ceil(C / b1)]`. Ragged edge blocks use the amax of their elements.
/// On CUDA `block` must be [`FP8_BLOCK`]; the NaN/Inf check reads the kernel's flag (a
/// synchronization: this is a weight-loading operation).
pub fn quantize_block(w: &Tensor, block: [usize; 2]) -> Result<(Tensor, Tensor)> {
    const OP: &str = "quant_fp8::quantize_block";
    check_block(OP, block)?;
    let (rows, cols, scale_dims) = block_scale_dims(OP, "w", w.shape(), block)?;
    match w.storage() {
        Storage::Cuda(s) => {
            if block != cuda::BLOCK {
                return Err(fmoe_core::Error::Unsupported {
                    op: OP,
                    device: s.device(),
                    reason: format!(
                        "the CUDA kernel quantizes {:?} blocks, not {block:?}",
                        cuda::BLOCK
                    ),
                }
                .into());
            }
            let n = rows * cols;
            let mats = s.len().checked_div(n).unwrap_or(0);
            let (q, scale_inv, flag) = cuda::per_block(OP, s, mats, rows, cols)?;
            let flag = Tensor::from_storage(Storage::Cuda(flag), [1])?;
            FiniteCheck::device_flag(OP, "w", flag, 0, Some(w.clone())).check()?;
            Ok((
                Tensor::from_storage(Storage::Cuda(q), w.shape().clone())?,
                Tensor::from_storage(Storage::Cuda(scale_inv), scale_dims)?,
            ))
        }
        Storage::Cpu(s) => {
            let ws = input_f32(OP, "w", s)?;
            let mut q = fp8_buffer(ws.len());
            let mut scale_inv = vec![0.0f32; scale_dims.iter().product()];
            cpu::quantize_blocks(&ws, rows, cols, block, &mut q, &mut scale_inv)
                .map_err(|(i, v)| non_finite(OP, "w", i, v))?;
            Ok((
                output(q, w.shape().clone(), w)?,
                output(scale_inv, scale_dims, w)?,
            ))
        }
    }
}

/// Inverse of [`quantize_block`]; `scale_inv` must be f32 `[.., ceil(R / b0), ceil(C / b1)]`.
pub fn dequantize_block(q: &Tensor, scale_inv: &Tensor, block: [usize; 2]) -> Result<Tensor> {
    const OP: &str = "quant_fp8::dequantize_block";
    check_block(OP, block)?;
    let (rows, cols, scale_dims) = block_scale_dims(OP, "q", q.shape(), block)?;
    check_scales(OP, "scale_inv", q, scale_inv, &scale_dims)?;
    match q.storage() {
        Storage::Cuda(s) => Err(crate::error::no_cuda_kernel(OP, s)),
        Storage::Cpu(_) => {
            let qs = q.cpu_slice::<F8E4M3>(OP, "q")?;
            let ss = scale_inv.cpu_slice::<f32>(OP, "scale_inv")?;
            let mut out = vec![0.0f32; qs.len()];
            cpu::dequantize_blocks(qs, ss, rows, cols, block, &mut out);
            output(out, q.shape().clone(), q)
        }
    }
}

/// The input as f32, borrowed when it already is f32.
fn input_f32<'a>(op: &'static str, name: &str, s: &'a CpuStorage) -> Result<Cow<'a, [f32]>> {
    fn widen<T: WithDType>(v: &[T]) -> Cow<'_, [f32]> {
        Cow::Owned(v.iter().map(|x| x.to_f32()).collect())
    }
    match s {
        CpuStorage::F32(v) => Ok(Cow::Borrowed(v)),
        CpuStorage::BF16(v) => Ok(widen(v)),
        CpuStorage::F16(v) => Ok(widen(v)),
        other => Err(fmoe_core::Error::DTypeMismatch {
            op,
            tensor: name.to_string(),
            expected: "f32 or bf16 or f16".to_string(),
            got: other.dtype(),
        }
        .into()),
    }
}

fn fp8_buffer(len: usize) -> Vec<F8E4M3> {
    vec![F8E4M3::from_bits(0); len]
}

/// Wraps a result on the device of `like`.
fn output<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>, like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, shape, &like.device())?)
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

fn check_scale(op: &'static str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            op,
            format!("scale must be finite and > 0, got {scale}"),
        ))
    }
}

fn check_group(op: &'static str, group: usize) -> Result<()> {
    if group == 0 {
        return Err(Error::invalid(op, "group size must be > 0"));
    }
    Ok(())
}

fn check_block(op: &'static str, block: [usize; 2]) -> Result<()> {
    if block[0] == 0 || block[1] == 0 {
        return Err(Error::invalid(
            op,
            format!("block sizes must be > 0, got {block:?}"),
        ));
    }
    Ok(())
}

fn last_dim(shape: &Shape) -> usize {
    shape.dims().last().copied().unwrap_or(0)
}

/// `[.., ceil(K / group)]` for a tensor `[.., K]` of rank >= 1.
fn group_scale_dims(
    op: &'static str,
    name: &str,
    shape: &Shape,
    group: usize,
) -> Result<Vec<usize>> {
    let Some((&k, lead)) = shape.dims().split_last() else {
        return Err(rank_error(op, name, shape, "rank >= 1 [.., K]"));
    };
    let mut dims = lead.to_vec();
    dims.push(k.div_ceil(group));
    Ok(dims)
}

/// (R, C, `[.., ceil(R / b0), ceil(C / b1)]`) for a tensor `[.., R, C]` of rank >= 2.
fn block_scale_dims(
    op: &'static str,
    name: &str,
    shape: &Shape,
    block: [usize; 2],
) -> Result<(usize, usize, Vec<usize>)> {
    let dims = shape.dims();
    let [lead @ .., rows, cols] = dims else {
        return Err(rank_error(op, name, shape, "rank >= 2 [.., R, C]"));
    };
    let (br, bc) = cpu::block_grid(*rows, *cols, block);
    let mut out = lead.to_vec();
    out.extend([br, bc]);
    Ok((*rows, *cols, out))
}

fn rank_error(op: &'static str, name: &str, shape: &Shape, expected: &str) -> Error {
    fmoe_core::Error::ShapeMismatch {
        op,
        tensor: name.to_string(),
        expected: expected.to_string(),
        got: shape.clone(),
    }
    .into()
}

/// `scales` must be f32 with exactly `expected` dims, on the device of `q`.
fn check_scales(
    op: &'static str,
    name: &str,
    q: &Tensor,
    scales: &Tensor,
    expected: &[usize],
) -> Result<()> {
    q.expect_dtype(op, "q", &[DType::F8E4M3])?;
    scales.expect_dtype(op, name, &[DType::F32])?;
    scales.expect_device(op, name, q.device())?;
    if scales.dims() != expected {
        return Err(Error::ScaleShape {
            op,
            tensor: name.to_string(),
            expected: format!("{expected:?}"),
            got: scales.shape().clone(),
        });
    }
    Ok(())
}
