//! Where weights come from: a safetensors [`Checkpoint`] (one file or shards listed by
//! `model.safetensors.index.json`), or [`DummyWeights`] (random values of the requested shapes
//! from a seed, `--load-format dummy`). [`WeightSource`] joins the two behind one interface, and
//! [`Vb`] walks it by checkpoint name prefixes (`vb.pp("model").pp("layers")`) so model files read
//! like a map of the checkpoint.
//!
//! Checkpoint files are read with positioned reads (`pread`), not memory-mapped: every tensor is
//! copied out and converted anyway, and a file that shrinks while it is read is then an error
//! naming it (a read past the end), where a mapping would kill the process with SIGBUS. Every
//! path opened here must be a regular file ([`open_regular`]): a directory, FIFO, socket or
//! device is an error naming the path and what it is, and a FIFO never blocks the open.

use fmoe_core::{DType, Device, Shape, Tensor};
use fmoe_kernels::elementwise;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::{Error, Result};

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
mod checkpoint;
mod files;

pub use checkpoint::{Checkpoint, MAX_HEADER_BYTES, MAX_INDEX_BYTES};
pub use files::{open_regular, read_regular_file};

/// Random weights from a seed, for `--load-format dummy`: any name exists, with the requested
/// shape and the first requested dtype (or `dtype`, when allowed). Values are uniform with a
/// standard deviation of 0.02 for weights, 1 ± 0.1 (std) for norms, and for fp8 checkpoints e4m3
/// codes of std 28 with scales of 0.02/28 (so the dequantized weights have std 0.02, as a
/// checkpoint's would); each tensor's values depend only on (seed, name).
///
/// Tensors are generated on `device` ([`elementwise::rand_uniform`], [`Tensor::full`]): on CUDA a
/// dummy model never exists on the host, and the values are bit for bit those of `Device::Cpu`.
pub struct DummyWeights {
    pub seed: u64,
    /// The preferred dtype for floating-point weights (the config's `dtype`, else bf16).
    pub dtype: DType,
    /// Where the tensors are created.
    pub device: Device,
}

impl DummyWeights {
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        let dtype = if dtypes.contains(&self.dtype) || dtypes.is_empty() {
            self.dtype
        } else {
            dtypes[0]
        };
        // The shape comes from the config: count it checked, and compare its bytes with what the
        // device has free before generating (each tensor, so a model too large for the device
        // stops at the tensor that no longer fits, with the error naming it).
        let shape = Shape::from(dims);
        let elems = shape.checked_elem_count()?;
        let bytes = fmoe_core::checked_bytes(
            &format!("dummy weight `{name}` {shape}"),
            elems,
            dtype.size_in_bytes(),
        )?;
        fmoe_core::memory::check_budget(
            &format!("dummy weight `{name}` {shape} {dtype}"),
            bytes,
            self.device,
        )?;
        let seed = self.seed ^ fnv1a(name);
        // (std, mean) of uniform values: a hash per element, cheap, so a dummy model of billions
        // of parameters builds in seconds.
        let uniform = |std: f32, mean: f32, dtype: DType| -> Result<Tensor> {
            let a = std * 3f32.sqrt();
            Ok(elementwise::rand_uniform(
                dims,
                dtype,
                a,
                mean,
                seed,
                &self.device,
            )?)
        };
        let norm = name.ends_with("norm.weight") || name.ends_with("layernorm.weight");
        Ok(if name.contains("scale") {
            // fp8 scales: e4m3 codes of std 28 (below) times this are weights of std 0.02.
            Tensor::full(dims, dtype, 0.02 / 28.0, &self.device)?
        } else if dtype == DType::U32 {
            // Integer tensors: the float values truncated (zeros, but for a U32 "norm").
            let values = if norm {
                uniform(0.1, 1.0, DType::F32)?.to_dtype(DType::U32)?
            } else {
                Tensor::zeros(dims, DType::U32, &self.device)?
            };
            values.to_device(self.device)?
        } else if norm {
            uniform(0.1, 1.0, dtype)?
        } else if dtype == DType::F8E4M3 {
            uniform(28.0, 0.0, dtype)?
        } else {
            uniform(0.02, 0.0, dtype)?
        })
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Weights from a checkpoint or from a seed.
pub enum WeightSource {
    Checkpoint(Checkpoint),
    Dummy(DummyWeights),
}

impl WeightSource {
    /// `name` with shape `dims` and one of `dtypes` (all dtypes when empty).
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        match self {
            WeightSource::Checkpoint(c) if dtypes.is_empty() => c.get_with_shape(name, dims),
            WeightSource::Checkpoint(c) => c.get_typed(name, dims, dtypes),
            WeightSource::Dummy(d) => d.get(name, dims, dtypes),
        }
    }

    /// Whether `name` exists (always, for dummy weights).
    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Checkpoint(c) => c.contains(name),
            WeightSource::Dummy(_) => true,
        }
    }
}

/// A cursor into a [`WeightSource`] at a name prefix, counting reads on a progress bar.
pub struct Vb<'a> {
    source: &'a WeightSource,
    prefix: String,
    progress: &'a ProgressBar,
}

impl<'a> Vb<'a> {
    pub fn new(source: &'a WeightSource, progress: &'a ProgressBar) -> Vb<'a> {
        Vb {
            source,
            prefix: String::new(),
            progress,
        }
    }

    /// The cursor at `prefix.sub`.
    pub fn pp(&self, sub: impl std::fmt::Display) -> Vb<'a> {
        let prefix = if self.prefix.is_empty() {
            sub.to_string()
        } else {
            format!("{}.{sub}", self.prefix)
        };
        Vb {
            source: self.source,
            prefix,
            progress: self.progress,
        }
    }

    /// The full checkpoint name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Reads `prefix.name`, checking its shape and dtype (any of `dtypes`).
    pub fn get(&self, name: &str, dims: &[usize], dtypes: &[DType]) -> Result<Tensor> {
        let full = self.name(name);
        let t = self.source.get(&full, dims, dtypes)?;
        self.progress.inc(1);
        Ok(t)
    }

    /// Reads a one-element tensor (shape `[]` or `[1]`, a float dtype) such as fp8's
    /// `weight_scale`.
    pub fn get_scalar(&self, name: &str) -> Result<f32> {
        let full = self.name(name);
        const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
        let t = match self.source {
            WeightSource::Checkpoint(c) => {
                let (shape, _) = c.info(&full)?;
                if shape.iter().product::<usize>() != 1 {
                    return Err(Error::TensorShape {
                        name: full,
                        file: c.describe_files(),
                        expected: vec![],
                        got: shape,
                    });
                }
                c.get_typed(&full, &shape, &FLOATS)?
            }
            WeightSource::Dummy(d) => d.get(&full, &[], &[DType::F32])?,
        };
        self.progress.inc(1);
        Ok(t.to_f32_vec()?.first().copied().unwrap_or(1.0))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(&self.name(name))
    }

    pub fn source(&self) -> &WeightSource {
        self.source
    }
}

/// A progress bar over `len` tensors on stderr (drawn only when stderr is a terminal), or a hidden
/// one.
pub fn progress_bar(len: u64, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors [{elapsed_precise}]")
    {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dummy generator as it was written here before moving to fmoe_kernels: dummy values of
    /// a (seed, name) must not change.
    fn old_values(seed: u64, n: usize, std: f32, offset: f32) -> Vec<f32> {
        let uniform = |seed: u64, i: u64| {
            let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let a = std * 3f32.sqrt();
        (0..n as u64)
            .map(|i| offset + a * uniform(seed, i))
            .collect()
    }

    fn cases() -> Vec<(&'static str, Vec<usize>, DType, f32, f32)> {
        vec![
            (
                "model.layers.0.mlp.gate_proj.weight",
                vec![7, 33],
                DType::BF16,
                0.02,
                0.0,
            ),
            (
                "model.layers.0.input_layernorm.weight",
                vec![64],
                DType::BF16,
                0.1,
                1.0,
            ),
            ("model.norm.weight", vec![64], DType::F32, 0.1, 1.0),
            ("lm_head.weight", vec![5, 16], DType::F16, 0.02, 0.0),
            (
                "model.layers.1.mlp.experts.0.w1.weight",
                vec![9, 130],
                DType::F8E4M3,
                28.0,
                0.0,
            ),
        ]
    }

    #[test]
    fn cpu_dummy_values_are_unchanged() {
        let d = DummyWeights {
            seed: 3,
            dtype: DType::BF16,
            device: Device::Cpu,
        };
        for (name, dims, dtype, std, offset) in cases() {
            let t = d.get(name, &dims, &[dtype]).unwrap();
            assert_eq!(
                (t.dims(), t.dtype(), t.device()),
                (&dims[..], dtype, Device::Cpu)
            );
            let n = dims.iter().product();
            let want = Tensor::from_f32(
                &old_values(3 ^ fnv1a(name), n, std, offset),
                dims,
                dtype,
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(
                t.to_f32_vec().unwrap(),
                want.to_f32_vec().unwrap(),
                "{name}"
            );
        }
        let s = d
            .get(
                "model.layers.1.mlp.experts.0.w1.weight_scale_inv",
                &[2, 3],
                &[DType::F32],
            )
            .unwrap();
        assert_eq!(s.to_f32_vec().unwrap(), vec![0.02 / 28.0; 6]);
        let u = d.get("some.index", &[4], &[DType::U32]).unwrap();
        assert_eq!(u.to_f32_vec().unwrap(), vec![0.0; 4]);
    }

    /// On a GPU the same tensors, generated there. Skips without one (FMOE_REQUIRE_CUDA=1 makes
    /// that a failure).
    #[test]
    fn cuda_dummy_values_equal_the_cpu_ones() {
        if fmoe_core::cuda::test_backend_or_skip().is_none() {
            return;
        }
        let mk = |device| DummyWeights {
            seed: 11,
            dtype: DType::BF16,
            device,
        };
        let (cpu, gpu) = (mk(Device::Cpu), mk(Device::Cuda(0)));
        let mut all = cases();
        all.push(("big.weight", vec![1000, 1001], DType::BF16, 0.02, 0.0));
        all.push(("big.fp8.weight", vec![1000, 1001], DType::F8E4M3, 28.0, 0.0));
        all.push(("x.weight_scale_inv", vec![8, 8], DType::F32, 0.0, 0.0));
        for (name, dims, dtype, _, _) in all {
            let c = cpu.get(name, &dims, &[dtype]).unwrap();
            let g = gpu.get(name, &dims, &[dtype]).unwrap();
            assert_eq!(g.device(), Device::Cuda(0));
            assert_eq!(g.dtype(), c.dtype());
            // Bitwise: compare the raw storages.
            let gc = g.to_device(Device::Cpu).unwrap();
            let bits = |t: &Tensor| format!("{:?}", t.storage());
            assert_eq!(bits(&gc), bits(&c), "{name}");
        }
    }
}
