//! MoE layers from checkpoints: per-expert tensors stacked into fmoe-moe's layout
//! (w13 [E, 2I, H] = gate rows then up rows, w2 [E, H, I]), the choice of MoE method, and
//! static activation scales.

use fmoe_core::env::FusedSwitches;
use fmoe_core::{DType, Device, Tensor};
use fmoe_moe::{ActScales, CheckpointExperts, QuantScheme};

use crate::config::{ActivationScheme, QuantizationConfig};
use crate::layers::linear::check_scales;
use crate::loader::Vb;
use crate::{Error, Result};

/// How a checkpoint names an expert's three projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl ExpertNames {
    /// Mixtral: `w1` (gate), `w3` (up), `w2` (down).
    pub const MIXTRAL: ExpertNames = ExpertNames {
        gate: "w1",
        up: "w3",
        down: "w2",
    };
    /// DeepSeek-V3 (routed and shared experts) and most others.
    pub const DEFAULT: ExpertNames = ExpertNames {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
}

/// How MoE layers are built: the method (None → the checkpoint's own format, unquantized for
/// bf16 checkpoints) and the `FMOE_*` switches that pick the kernel. The experts run where the
/// model does ([`crate::LoadOptions::device`]).
#[derive(Clone, Debug, Default)]
pub struct MoeOptions {
    pub scheme: Option<QuantScheme>,
    pub switches: FusedSwitches,
}

/// The MoE method for a checkpoint stored as `checkpoint`, given the requested one. bf16
/// checkpoints serve any method (fp8 ones quantize online); an fp8 checkpoint serves its own.
pub fn resolve_scheme(
    checkpoint: &QuantizationConfig,
    requested: Option<QuantScheme>,
) -> Result<QuantScheme> {
    let own = match checkpoint {
        QuantizationConfig::None => return Ok(requested.unwrap_or(QuantScheme::Unquantized)),
        QuantizationConfig::Fp8PerTensor { .. } => QuantScheme::Fp8PerTensor,
        QuantizationConfig::Fp8Block { .. } => QuantScheme::Fp8Block,
    };
    match requested {
        None => Ok(own),
        Some(s) if s == own => Ok(own),
        Some(s) => Err(Error::Options(format!(
            "the checkpoint's experts are {own}; they cannot be served as {s}"
        ))),
    }
}

/// Loads experts `0..num_experts` under `vb` (`…experts`), each `J.{gate,up,down}.weight`
/// (+ `weight_scale` / `weight_scale_inv` for fp8 checkpoints), stacked for fmoe-moe.
pub fn load_experts(
    vb: &Vb,
    names: ExpertNames,
    num_experts: usize,
    hidden: usize,
    inter: usize,
    quant: &QuantizationConfig,
) -> Result<CheckpointExperts> {
    let experts: Vec<Vb> = (0..num_experts).map(|j| vb.pp(j)).collect();
    load_expert_stack(&experts, &vb.name(""), names, hidden, inter, quant)
}

/// The activation scales of experts `0..num_experts` under `vb`: dynamic unless the checkpoint's
/// `activation_scheme` is static, in which case each expert's `J.{gate,up,down}.input_scale`
/// (shape \[\] or \[1\], f32/bf16/f16; a missing one is an error naming it) is read and
/// [`ActScales::from_expert_input_scales`] takes their maxima. Only the MoE experts use them:
/// the dense linears of such checkpoints ignore their `input_scale` (their activations stay
/// unquantized).
pub fn load_expert_act_scales(
    vb: &Vb,
    names: ExpertNames,
    num_experts: usize,
    quant: &QuantizationConfig,
) -> Result<ActScales> {
    match quant {
        QuantizationConfig::Fp8PerTensor {
            activation_scheme: ActivationScheme::Static,
        } => {
            let (mut a13, mut a2) = (Vec::new(), Vec::new());
            for j in 0..num_experts {
                let e = vb.pp(j);
                a13.push(e.pp(names.gate).get_scalar("input_scale")?);
                a13.push(e.pp(names.up).get_scalar("input_scale")?);
                a2.push(e.pp(names.down).get_scalar("input_scale")?);
            }
            Ok(ActScales::from_expert_input_scales(&a13, &a2)?)
        }
        _ => Ok(ActScales::Dynamic),
    }
}

/// Loads one unnumbered expert under `vb` (DeepSeek-V3's `mlp.shared_experts`:
/// `{gate,up,down}.weight` [+ scales]) as a stack of one (E = 1), the layout
/// [`fmoe_moe::FusedMoe`] takes for its shared expert.
pub fn load_single_expert(
    vb: &Vb,
    names: ExpertNames,
    hidden: usize,
    inter: usize,
    quant: &QuantizationConfig,
) -> Result<CheckpointExperts> {
    load_expert_stack(
        std::slice::from_ref(vb),
        &vb.name(""),
        names,
        hidden,
        inter,
        quant,
    )
}

/// Stacks the experts at `experts` (one cursor each); `label` names them in logs. fp8 scales are
/// checked as dense layers check theirs ([`check_scales`]): finite and positive.
fn load_expert_stack(
    experts: &[Vb],
    label: &str,
    names: ExpertNames,
    hidden: usize,
    inter: usize,
    quant: &QuantizationConfig,
) -> Result<CheckpointExperts> {
    const FLOATS: [DType; 3] = [DType::BF16, DType::F16, DType::F32];
    const OP: &str = "load_experts";
    if let QuantizationConfig::Fp8Block {
        activation_scheme: ActivationScheme::Static,
        ..
    } = quant
    {
        return Err(Error::Options(format!(
            "{label}: fp8 block-scaled checkpoints with activation_scheme `static` are not \
             supported (static activation scales exist for per-tensor fp8 only)"
        )));
    }
    let num_experts = experts.len();
    let (gate_dims, down_dims) = ([inter, hidden], [hidden, inter]);
    let mut w13 = Vec::with_capacity(num_experts);
    let mut w2 = Vec::with_capacity(num_experts);
    let mut ragged = false;
    let mut s13 = Scales::default();
    let mut s2 = Scales::default();
    for e in experts {
        let (g, u, d) = (e.pp(names.gate), e.pp(names.up), e.pp(names.down));
        let dtypes: &[DType] = match quant {
            QuantizationConfig::None => &FLOATS,
            _ => &[DType::F8E4M3],
        };
        let wg = g.get("weight", &gate_dims, dtypes)?;
        let wu = u.get("weight", &gate_dims, dtypes)?;
        let wd = d.get("weight", &down_dims, dtypes)?;
        w13.push(Tensor::stack0(&[wg, wu])?.reshape([2 * inter, hidden])?);
        w2.push(wd);
        match quant {
            QuantizationConfig::None => {}
            QuantizationConfig::Fp8PerTensor { .. } => {
                let scale = |vb: &Vb| -> Result<f32> {
                    let s = vb.get_scalar("weight_scale")?;
                    check_scales(OP, &vb.name("weight"), "weight_scale", &[s])?;
                    Ok(s)
                };
                s13.push(scale(&g)?);
                s13.push(scale(&u)?);
                s2.push(scale(&d)?);
            }
            QuantizationConfig::Fp8Block { block, .. } => {
                if !inter.is_multiple_of(block[0]) {
                    // The fused w13 [2I, H] is scaled in 128-row blocks; with I not a multiple of
                    // 128, gate and up rows would share a block, so their scales cannot be
                    // concatenated. Such (small) experts are dequantized here and requantized
                    // online by the method in fused blocks.
                    ragged = true;
                }
                let gs = [inter.div_ceil(block[0]), hidden.div_ceil(block[1])];
                let ds = [hidden.div_ceil(block[0]), inter.div_ceil(block[1])];
                let scale_inv = |vb: &Vb, dims: &[usize]| -> Result<Tensor> {
                    let t = vb.get("weight_scale_inv", dims, &[DType::F32])?;
                    check_scales(OP, &vb.name("weight"), "weight_scale_inv", &t.to_f32_vec()?)?;
                    Ok(t)
                };
                let sg = scale_inv(&g, &gs)?;
                let su = scale_inv(&u, &gs)?;
                let sd = scale_inv(&d, &ds)?;
                s13.push_tensor(Tensor::stack0(&[sg, su])?.reshape([2 * gs[0], gs[1]])?);
                s2.push_tensor(sd);
            }
        }
    }
    let w13 = Tensor::stack0(&w13)?;
    let w2 = Tensor::stack0(&w2)?;
    Ok(match quant {
        QuantizationConfig::None => CheckpointExperts::Dense { w13, w2 },
        QuantizationConfig::Fp8PerTensor { .. } => CheckpointExperts::Fp8PerTensor {
            w13,
            w13_scale: Tensor::from_vec(s13.scalars, [num_experts, 2], &Device::Cpu)?,
            w2,
            w2_scale: Tensor::from_vec(s2.scalars, [num_experts], &Device::Cpu)?,
        },
        QuantizationConfig::Fp8Block { block, .. } if ragged => {
            tracing::info!(
                experts = %label,
                "expert width {inter} is not a multiple of {}: fp8 block experts dequantized for online requantization",
                block[0]
            );
            let mut d13 = Vec::with_capacity(num_experts);
            let mut d2 = Vec::with_capacity(num_experts);
            for (j, (s13j, s2j)) in s13.tensors.iter().zip(&s2.tensors).enumerate() {
                // w13 of expert j is [w1; w3]: dequantize each half with its own scales.
                let half = |t: &Tensor, h: usize| -> Result<Tensor> {
                    let rows = t.index0(j)?.reshape([2, inter, hidden])?.index0(h)?;
                    Ok(rows)
                };
                let g = fmoe_kernels::quant_fp8::dequantize_block(
                    &half(&w13, 0)?,
                    &s13j
                        .reshape([2, s13j.dims()[0] / 2, s13j.dims()[1]])?
                        .index0(0)?,
                    *block,
                )?;
                let u = fmoe_kernels::quant_fp8::dequantize_block(
                    &half(&w13, 1)?,
                    &s13j
                        .reshape([2, s13j.dims()[0] / 2, s13j.dims()[1]])?
                        .index0(1)?,
                    *block,
                )?;
                d13.push(Tensor::stack0(&[g, u])?.reshape([2 * inter, hidden])?);
                d2.push(fmoe_kernels::quant_fp8::dequantize_block(
                    &w2.index0(j)?,
                    s2j,
                    *block,
                )?);
            }
            CheckpointExperts::Dense {
                w13: Tensor::stack0(&d13)?,
                w2: Tensor::stack0(&d2)?,
            }
        }
        QuantizationConfig::Fp8Block { .. } => CheckpointExperts::Fp8Block {
            w13,
            w13_scale_inv: Tensor::stack0(&s13.tensors)?,
            w2,
            w2_scale_inv: Tensor::stack0(&s2.tensors)?,
        },
    })
}

/// Scales gathered per expert: scalars (per-tensor) or tensors (blocks).
#[derive(Default)]
struct Scales {
    scalars: Vec<f32>,
    tensors: Vec<Tensor>,
}

impl Scales {
    fn push(&mut self, s: f32) {
        self.scalars.push(s);
    }
    fn push_tensor(&mut self, t: Tensor) {
        self.tensors.push(t);
    }
}
