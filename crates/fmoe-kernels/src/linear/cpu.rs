//! CPU twin of `linear`: weight rows widened to f32 a tile at a time (in parallel over tiles), two
//! x rows × four weight rows per micro-kernel call. Every output element has one writer and one
//! summation order, whatever the thread count.

use fmoe_core::CpuStorage;
use rayon::prelude::*;

use crate::moe_gemm::cpu::convert_into;
use crate::moe_gemm::simd::{dot, dot_2x4};

/// Weight rows per work item (a multiple of 4, the micro-kernel's width), sized so the widened tile
/// stays within ~256 KiB for any K.
fn tile_rows(k: usize) -> usize {
    ((64 * 1024 / k.max(1)).clamp(4, 256) / 4) * 4
}

/// y [m, n] (f32) = x [m, k] · w [n, k]ᵀ.
pub(super) fn linear(x: &CpuStorage, w: &CpuStorage, [m, n, k]: [usize; 3]) -> Vec<f32> {
    if m == 0 || n == 0 {
        return Vec::new();
    }
    let xf = x.to_f32_vec();
    let tile = tile_rows(k);
    let tiles: Vec<Vec<f32>> = (0..n.div_ceil(tile))
        .into_par_iter()
        .map(|t| {
            let (j0, j1) = (t * tile, ((t + 1) * tile).min(n));
            let rows = j1 - j0;
            let mut wf = vec![0f32; rows * k];
            convert_into(w, j0 * k, &mut wf);
            let wrow = |j: usize| &wf[j * k..(j + 1) * k];
            let xrow = |i: usize| &xf[i * k..(i + 1) * k];
            // [m, rows] block of y.
            let mut out = vec![0f32; m * rows];
            let quads = rows / 4 * 4;
            let mut i = 0;
            while i < m {
                let pair = i + 1 < m;
                let a1 = if pair { xrow(i + 1) } else { xrow(i) };
                for j in (0..quads).step_by(4) {
                    let d = dot_2x4(
                        xrow(i),
                        a1,
                        [wrow(j), wrow(j + 1), wrow(j + 2), wrow(j + 3)],
                    );
                    out[i * rows + j..i * rows + j + 4].copy_from_slice(&d[0]);
                    if pair {
                        out[(i + 1) * rows + j..(i + 1) * rows + j + 4].copy_from_slice(&d[1]);
                    }
                }
                for j in quads..rows {
                    out[i * rows + j] = dot(xrow(i), wrow(j));
                    if pair {
                        out[(i + 1) * rows + j] = dot(xrow(i + 1), wrow(j));
                    }
                }
                i += 2;
            }
            out
        })
        .collect();
    let mut y = vec![0f32; m * n];
    for (t, block) in tiles.iter().enumerate() {
        let j0 = t * tile;
        let rows = block.len() / m;
        for i in 0..m {
            y[i * n + j0..i * n + j0 + rows].copy_from_slice(&block[i * rows..(i + 1) * rows]);
        }
    }
    y
}
