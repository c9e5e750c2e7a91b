//! CPU twin of `rotary`.

use fmoe_core::DType;

use super::{Geometry, RotaryStyle};
use crate::norm::cpu::round_to;

/// Indices (within the head) of pair `i` of the rotated slice.
pub(crate) fn pair(g: &Geometry, i: usize) -> (usize, usize) {
    match g.style {
        RotaryStyle::HalfSplit => (g.rot_offset + i, g.rot_offset + i + g.rot_dim / 2),
        RotaryStyle::Interleaved => (g.rot_offset + 2 * i, g.rot_offset + 2 * i + 1),
    }
}

pub(super) fn apply(x: &[f32], cos: &[f32], sin: &[f32], g: &Geometry, dtype: DType) -> Vec<f32> {
    let mut y = x.to_vec();
    let half = g.rot_dim / 2;
    let row = g.heads * g.head_dim;
    for t in 0..g.tokens {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for h in 0..g.heads {
            let head = &mut y[t * row + h * g.head_dim..t * row + (h + 1) * g.head_dim];
            for i in 0..half {
                let (ia, ib) = pair(g, i);
                let (a, b) = (head[ia], head[ib]);
                head[ia] = round_to(dtype, a * c[i] - b * s[i]);
                head[ib] = round_to(dtype, b * c[i] + a * s[i]);
            }
        }
    }
    y
}
