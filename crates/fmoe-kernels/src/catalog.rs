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

/// All of them, family by family, then the MoE chain's PDL builds.
pub fn all() -> Vec<KernelVariant> {
    let align = moe_align::cuda_variants(&moe_gemm::cuda_block_ms());
    let quant = quant_fp8::cuda::variants();
    let gemm = moe_gemm::cuda_variants();
    // `-D PDL=1` of every variant a chain under `crate::PdlChain` may load through
    // `launch::load_chain` (align, quantizations, grouped GEMMs, finalize; elementwise lists its
    // casts and zero fill itself); the portable glue kernels always launch plain.
    let pdl: Vec<KernelVariant> = align
        .iter()
        .chain(&quant)
        .chain(gemm.iter().filter(|k| k.family != moe_gemm::GLUE_FAMILY))
        .map(pdl_build)
        .collect();
    let mut v = routing::cuda_variants();
    v.extend(align);
    v.extend(quant);
    v.extend(elementwise::cuda_variants());
    v.extend(norm::cuda::variants());
    v.extend(rotary::cuda::variants());
    v.extend(gemm);
    v.extend(attention::cuda_variants());
    v.extend(kv_cache::cuda_variants());
    v.extend(pdl);
    v
}

/// `k`'s Programmatic Dependent Launch build: its defines and `PDL=1` last, as
/// `launch::load_chain` adds it.
pub(crate) fn pdl_build(k: &KernelVariant) -> KernelVariant {
    let mut k = k.clone();
    k.defines.push(crate::launch::pdl_define());
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant the MoE chain may load through `launch::load_chain` has its PDL build
    /// listed (so the NVRTC test compiles it), and the zero fill exists only as one.
    #[test]
    fn every_chain_variant_has_its_pdl_build() {
        let all = all();
        let is_pdl = |k: &KernelVariant| k.defines.last() == Some(&crate::launch::pdl_define());
        let chain = |k: &KernelVariant| {
            (k.family == "moe_align"
                || k.family == "quant_fp8"
                || k.family == "moe_finalize"
                || (k.family.starts_with("moe_gemm_") && k.family != moe_gemm::GLUE_FAMILY)
                || k.entry == "fmoe_cast")
                && !is_pdl(k)
        };
        let plain: Vec<&KernelVariant> = all.iter().filter(|k| chain(k)).collect();
        assert!(plain.len() > 50, "{} chain variants", plain.len());
        for k in plain {
            assert!(all.contains(&pdl_build(k)), "no PDL build of {}", k.name());
        }
        let zero: Vec<&KernelVariant> = all
            .iter()
            .filter(|k| k.entry == "fmoe_zero_words")
            .collect();
        assert!(!zero.is_empty() && zero.iter().all(|k| is_pdl(k)));
        // Nothing outside the chain has a PDL build.
        assert!(
            all.iter()
                .filter(|k| is_pdl(k))
                .all(|k| k.family != "moe_unfused" && k.family != "attention_decode")
        );
    }
}
