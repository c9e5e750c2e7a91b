//! The dense SwiGLU MLP: `down(silu(gate(x)) ⊙ up(x))` (DeepSeek-V3's first
//! `first_k_dense_replace` layers, `mlp.{gate,up,down}_proj`), in f32 over the stored weights.

use crate::Result;
use crate::config::QuantizationConfig;
use crate::layers::linear::Linear;
use crate::loader::Vb;

/// A gated MLP of width `intermediate`.
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// Loads `{gate,up}_proj.weight` [intermediate, hidden] and `down_proj.weight`
    /// [hidden, intermediate] under `vb` (fp8 scales beside them when `quant` says so).
    pub fn load(
        vb: &Vb,
        hidden: usize,
        intermediate: usize,
        quant: &QuantizationConfig,
    ) -> Result<Mlp> {
        Ok(Mlp {
            gate_proj: Linear::load(&vb.pp("gate_proj"), intermediate, hidden, quant)?,
            up_proj: Linear::load(&vb.pp("up_proj"), intermediate, hidden, quant)?,
            down_proj: Linear::load(&vb.pp("down_proj"), hidden, intermediate, quant)?,
        })
    }

    /// `x` [rows, hidden] → [rows, hidden].
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut g = self.gate_proj.forward(x, rows)?;
        let u = self.up_proj.forward(x, rows)?;
        for (g, u) in g.iter_mut().zip(&u) {
            *g = silu(*g) * u;
        }
        self.down_proj.forward(&g, rows)
    }
}

/// `x · sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::linear::WeightScale;
    use fmoe_core::{DType, Device, Tensor};

    #[test]
    fn swiglu_by_hand() {
        let lin = |name: &str, v: &[f32], dims: [usize; 2]| {
            let t = Tensor::from_f32(v, dims, DType::F32, &Device::Cpu).unwrap();
            Linear::new(name, t, WeightScale::None).unwrap()
        };
        // hidden 2, intermediate 1: gate = x0, up = x1, down = [2; 1].
        let mlp = Mlp {
            gate_proj: lin("g", &[1.0, 0.0], [1, 2]),
            up_proj: lin("u", &[0.0, 1.0], [1, 2]),
            down_proj: lin("d", &[2.0, -1.0], [2, 1]),
        };
        let y = mlp.forward(&[1.0, 3.0, 0.0, 5.0], 2).unwrap();
        let s = 1.0 / (1.0 + (-1f32).exp());
        let want = [2.0 * 3.0 * s, -3.0 * s, 0.0, 0.0];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{y:?}");
        }
        assert!(silu(-100.0).abs() < 1e-30 && silu(100.0) == 100.0);
    }
}
