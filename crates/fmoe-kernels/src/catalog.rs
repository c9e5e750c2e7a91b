//! Every CUDA kernel instantiation fmoe can launch: each family's source × the `-D` sets its
//! launch code builds, produced by the same functions that build them at launch (so the list
//! cannot drift from the code). A build check, not a registry: `tests/nvrtc_compile.rs` compiles
//! all of them for sm_90a with [`crate::nvrtc::compile_only`], on a machine without a GPU (CI).
//! `fmoe kernels --catalog-json` prints it ([`programs`], sources by [`SOURCES`] file name) for
//! the scripts under `scripts/cuda/`.

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

/// `(name, include_str!("../cuda/<name>"))` for each file name.
macro_rules! sources {
    ($($file:literal),* $(,)?) => {
        [$(($file, include_str!(concat!("../cuda/", $file)))),*]
    };
}

/// Every program source under `cuda/`, `(file name, text)`: how tools outside the binary (the
/// scripts under `scripts/cuda/`) name a variant's source, see [`KernelVariant::source_file`]. A
/// test checks it against the folder (and that it names every catalog variant's source).
pub const SOURCES: &[(&str, &str)] = &sources![
    "attention_decode.cu",
    "attention_prefill.cu",
    "copy.cu",
    "elementwise.cu",
    "grouped_topk.cu",
    "kv_append.cu",
    "moe_align.cu",
    "moe_finalize.cu",
    "moe_gemm_bf16.cu",
    "moe_gemm_bf16_sm90.cu",
    "moe_gemm_bf16_sm90_pipe.cu",
    "moe_gemm_fp8_block_sm90.cu",
    "moe_gemm_fp8_sm90.cu",
    "moe_gemm_fp8_sm90_ws.cu",
    "moe_gemm_swapab_sm90.cu",
    "moe_unfused.cu",
    "norm.cu",
    "quant_fp8.cu",
    "rotary.cu",
    "topk_softmax.cu",
];

impl KernelVariant {
    /// The file name under `cuda/` of its source ([`SOURCES`]); `None` if the source is none of
    /// them (no catalog variant: tested).
    pub fn source_file(&self) -> Option<&'static str> {
        SOURCES
            .iter()
            .find(|(_, text)| *text == self.source)
            .map(|(name, _)| *name)
    }

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
    let align = moe_align::cuda_variants(&moe_gemm::cuda_block_ms(), &moe_gemm::cuda_mixed_tiles());
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

/// One NVRTC program per (family, source, defines) of `variants`, in their order, with its entry
/// points in their order: what a build compiles once and loads each entry of.
pub fn programs(variants: &[KernelVariant]) -> Vec<(KernelVariant, Vec<&'static str>)> {
    let mut out: Vec<(KernelVariant, Vec<&'static str>)> = Vec::new();
    for v in variants {
        let same = |p: &KernelVariant| {
            p.family == v.family && p.defines == v.defines && p.source == v.source
        };
        match out.iter_mut().find(|(p, _)| same(p)) {
            Some((_, entries)) => entries.push(v.entry),
            None => out.push((v.clone(), vec![v.entry])),
        }
    }
    out
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

    /// Entries of one (family, source, defines) share a program, in first-seen order; a
    /// different define, family or source is another program.
    #[test]
    fn programs_group_entries_of_one_build() {
        let (a, b) = (SOURCES[0].1, SOURCES[1].1);
        let v = |family, source, entry, d: &str| KernelVariant {
            family,
            source,
            entry,
            defines: vec![("X", d.to_string())],
        };
        let all = [
            v("f", a, "k1", "1"),
            v("f", a, "k1", "2"),
            v("f", a, "k2", "1"),
            v("g", a, "k1", "1"),
            v("f", b, "k3", "1"),
        ];
        let p = programs(&all);
        let got: Vec<(&str, &str, String, Vec<&str>)> = p
            .iter()
            .map(|(k, e)| {
                (
                    k.family,
                    k.source_file().unwrap(),
                    k.defines[0].1.clone(),
                    e.clone(),
                )
            })
            .collect();
        let (fa, fb) = (SOURCES[0].0, SOURCES[1].0);
        assert_eq!(
            got,
            [
                ("f", fa, "1".to_string(), vec!["k1", "k2"]),
                ("f", fa, "2".to_string(), vec!["k1"]),
                ("g", fa, "1".to_string(), vec!["k1"]),
                ("f", fb, "1".to_string(), vec!["k3"]),
            ]
        );
    }

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
