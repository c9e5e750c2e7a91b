//! RMSNorm: `y = w ⊙ x / sqrt(mean(x²) + eps)`, in f32 (the mean accumulates in f64).

use fmoe_core::DType;

use crate::loader::Vb;
use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Vec<f32>, eps: f64) -> RmsNorm {
        RmsNorm {
            weight,
            eps: eps as f32,
        }
    }

    /// Loads `weight` \[dim\] under `vb`.
    pub fn load(vb: &Vb, dim: usize, eps: f64) -> Result<RmsNorm> {
        let w = vb.get("weight", &[dim], &[DType::BF16, DType::F16, DType::F32])?;
        Ok(RmsNorm::new(w.to_f32_vec()?, eps))
    }

    pub fn dim(&self) -> usize {
        self.weight.len()
    }

    /// Normalizes each row of `x` [rows, dim].
    pub fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let d = self.weight.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(Error::input(
                "RmsNorm::forward",
                format!("input of {} values is not rows of {d}", x.len()),
            ));
        }
        let mut out = vec![0f32; x.len()];
        for (o, row) in out.chunks_mut(d).zip(x.chunks(d)) {
            let ms = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / d as f64;
            let r = 1.0 / ((ms as f32) + self.eps).sqrt();
            for ((o, &v), &w) in o.iter_mut().zip(row).zip(&self.weight) {
                *o = w * (v * r);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_rows() {
        let n = RmsNorm::new(vec![1.0, 2.0], 0.0);
        let y = n.forward(&[3.0, 4.0, 0.5, -0.5]).unwrap();
        let r = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
        assert!((y[2] - 1.0).abs() < 1e-6 && (y[3] + 2.0).abs() < 1e-6);
        assert!(n.forward(&[1.0; 3]).is_err());
    }
}
