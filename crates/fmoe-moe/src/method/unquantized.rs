use fmoe_core::DType;
use fmoe_kernels::moe_gemm::{ActQuant, ActScale, WeightOperand};

use super::{CheckpointExperts, MoeMethod, not_processed};
use crate::stages::ExpertOperands;
use crate::{Error, KernelFamily, QuantScheme, Result};

const NAME: &str = "UnquantizedMoeMethod";

/// bf16/f16/f32 expert weights, unquantized activations (Mixtral).
#[derive(Debug)]
pub struct UnquantizedMoeMethod {
    checkpoint: Option<CheckpointExperts>,
    operands: Option<ExpertOperands>,
}

impl UnquantizedMoeMethod {
    pub fn create_weights(
        experts: CheckpointExperts,
        (e, k, n): (usize, usize, usize),
    ) -> Result<Self> {
        let CheckpointExperts::Dense { w13, w2 } = &experts else {
            return Err(Error::Weights {
                method: NAME,
                msg: format!(
                    "needs dense (bf16/f16/f32) experts, got {} experts",
                    experts.kind()
                ),
            });
        };
        experts.check_dims(NAME, e, k, n)?;
        for (name, t) in [("w13", w13), ("w2", w2)] {
            t.expect_dtype(NAME, name, &[DType::BF16, DType::F16, DType::F32])?;
        }
        Ok(UnquantizedMoeMethod {
            checkpoint: Some(experts),
            operands: None,
        })
    }
}

impl MoeMethod for UnquantizedMoeMethod {
    fn scheme(&self) -> QuantScheme {
        QuantScheme::Unquantized
    }

    /// Both CPU kernel families read the checkpoint layout as is: rows are contiguous K-vectors,
    /// so the fused tile can pair gate row n with up row N+n without a shuffle.
    fn process_weights_after_loading(&mut self, _kernel: KernelFamily) -> Result<()> {
        if let Some(CheckpointExperts::Dense { w13, w2 }) = self.checkpoint.take() {
            self.operands = Some(ExpertOperands {
                w13: WeightOperand::Plain(w13),
                w2: WeightOperand::Plain(w2),
                act_quant: ActQuant::None,
                a13_scale: ActScale::Dynamic,
                a2_scale: ActScale::Dynamic,
            });
        }
        Ok(())
    }

    fn operands(&self) -> Result<&ExpertOperands> {
        self.operands.as_ref().ok_or_else(|| not_processed(NAME))
    }
}
