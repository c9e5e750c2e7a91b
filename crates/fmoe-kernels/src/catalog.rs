//! Every CUDA kernel instantiation fmoe can launch: each family's source × the `-D` sets its
//! launch code builds, produced by the same functions that build them at launch (so the list
//! cannot drift from the code). A build check, not a registry: `tests/nvrtc_compile.rs` compiles
//! all of them for sm_90a with [`crate::nvrtc::compile_only`], on a machine without a GPU (CI).

use crate::nvrtc::KernelSpec;
use crate::{
    attention, elementwise, kv_cache, moe_align, moe_gemm, norm, quant_fp8, rotary, routing,
};

/// One loadable kernel: an entry point of a source compiled with some defines. Variants of one
/// program (same family, source and defines) differ only in `entry`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelVariant {
    pub family: &'static str,
    pub source: &'static str,
    pub entry: &'static str,
    pub defines: Vec<(&'static str, String)>,
}

impl KernelVariant {
    /// The spec [`crate::nvrtc`] compiles and loads.
    pub fn spec(&self) -> KernelSpec<'_> {
        KernelSpec {
            family: self.family,
            source: self.source,
            entry: self.entry,
            defines: &self.defines,
        }
    }

    /// `family/entry[NAME=value,...]`, as [`crate::nvrtc::trace_launches`] names a launch.
    pub fn name(&self) -> String {
        let mut s = format!("{}/{}", self.family, self.entry);
        if !self.defines.is_empty() {
            let d: Vec<String> = self
                .defines
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            s.push_str(&format!("[{}]", d.join(",")));
        }
        s
    }
}

/// All of them, family by family.
pub fn all() -> Vec<KernelVariant> {
    let mut v = routing::cuda_variants();
    v.extend(moe_align::cuda_variants(&moe_gemm::cuda_block_ms()));
    v.extend(quant_fp8::cuda::variants());
    v.extend(elementwise::cuda_variants());
    v.extend(norm::cuda::variants());
    v.extend(rotary::cuda::variants());
    v.extend(moe_gemm::cuda_variants());
    v.extend(attention::cuda_variants());
    v.extend(kv_cache::cuda_variants());
    v
}
