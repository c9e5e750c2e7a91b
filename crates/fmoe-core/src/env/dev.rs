//! The `FMOE_DEV_*` developer overrides, all parsed here, once: each forces one choice of a kernel
//! selection rule of fmoe-kernels so that an A/B measurement can run both settings from one
//! binary. Every value is validated: a bad one is a [`DevOverrideError::Invalid`] naming the
//! variable and the accepted values; an override that cannot apply (two that contradict) is a
//! [`DevOverrideError::CannotApply`] naming the variable and the unmet condition; one that only the
//! device can rule out is reported by [`DevOverrides::check_device`] at the layer's first use.
//!
//! The experiment-only overrides ([`EXPERIMENT_ONLY`]: variants that lost, and arbitrary `-D`
//! flags) are accepted only in a build with the `dev-knobs` cargo feature (of fmoe-kernels, which
//! enables this crate's); without it setting one is a [`DevOverrideError::NeedsDevKnobs`].

use std::ops::Range;
use std::sync::OnceLock;

pub const FMOE_DEV_PDL: &str = "FMOE_DEV_PDL";
pub const FMOE_DEV_TALL_N: &str = "FMOE_DEV_TALL_N";
pub const FMOE_DEV_SM90_LARGE: &str = "FMOE_DEV_SM90_LARGE";
pub const FMOE_DEV_SM90_MID: &str = "FMOE_DEV_SM90_MID";
pub const FMOE_DEV_TALL_ROUTES: &str = "FMOE_DEV_TALL_ROUTES";
pub const FMOE_DEV_MIXED_ROUTES: &str = "FMOE_DEV_MIXED_ROUTES";
pub const FMOE_DEV_LARGE_ROUTES: &str = "FMOE_DEV_LARGE_ROUTES";
pub const FMOE_DEV_SWAPAB_ROUTES: &str = "FMOE_DEV_SWAPAB_ROUTES";
pub const FMOE_DEV_SWAPAB_WIDE_ROUTES: &str = "FMOE_DEV_SWAPAB_WIDE_ROUTES";
pub const FMOE_DEV_SPLITS: &str = "FMOE_DEV_SPLITS";
pub const FMOE_DEV_SKIP_PAD_WG: &str = "FMOE_DEV_SKIP_PAD_WG";
pub const FMOE_DEV_BF16_PAIR: &str = "FMOE_DEV_BF16_PAIR";
pub const FMOE_DEV_ONE_BLOCK_RASTER: &str = "FMOE_DEV_ONE_BLOCK_RASTER";
pub const FMOE_DEV_ROUTE_ROWS: &str = "FMOE_DEV_ROUTE_ROWS";
pub const FMOE_DEV_SWAPAB_PERSIST: &str = "FMOE_DEV_SWAPAB_PERSIST";
pub const FMOE_DEV_SWAPAB: &str = "FMOE_DEV_SWAPAB";
pub const FMOE_DEV_SWAPAB_BN: &str = "FMOE_DEV_SWAPAB_BN";
pub const FMOE_DEV_FP8_LARGE: &str = "FMOE_DEV_FP8_LARGE";
pub const FMOE_DEV_FP8_RASTER_GM: &str = "FMOE_DEV_FP8_RASTER_GM";
pub const FMOE_DEV_FP8_LONE_WG: &str = "FMOE_DEV_FP8_LONE_WG";
pub const FMOE_DEV_FP8_PAIR: &str = "FMOE_DEV_FP8_PAIR";
pub const FMOE_DEV_EXTRA_DEFINES: &str = "FMOE_DEV_EXTRA_DEFINES";

/// Every `FMOE_DEV_*` variable fmoe reads.
pub const ALL: [&str; 22] = [
    FMOE_DEV_PDL,
    FMOE_DEV_TALL_N,
    FMOE_DEV_SM90_LARGE,
    FMOE_DEV_SM90_MID,
    FMOE_DEV_TALL_ROUTES,
    FMOE_DEV_MIXED_ROUTES,
    FMOE_DEV_LARGE_ROUTES,
    FMOE_DEV_SWAPAB_ROUTES,
    FMOE_DEV_SWAPAB_WIDE_ROUTES,
    FMOE_DEV_SPLITS,
    FMOE_DEV_SKIP_PAD_WG,
    FMOE_DEV_BF16_PAIR,
    FMOE_DEV_ONE_BLOCK_RASTER,
    FMOE_DEV_ROUTE_ROWS,
    FMOE_DEV_SWAPAB_PERSIST,
    FMOE_DEV_SWAPAB,
    FMOE_DEV_SWAPAB_BN,
    FMOE_DEV_FP8_LARGE,
    FMOE_DEV_FP8_RASTER_GM,
    FMOE_DEV_FP8_LONE_WG,
    FMOE_DEV_FP8_PAIR,
    FMOE_DEV_EXTRA_DEFINES,
];

/// The overrides that select experiment variants which lost or were kept off (decisions D-007,
/// D-014, D-015, D-042, D-077) or inject arbitrary `-D` flags: only in a `dev-knobs` build.
pub const EXPERIMENT_ONLY: [&str; 5] = [
    FMOE_DEV_SM90_LARGE,
    FMOE_DEV_SM90_MID,
    FMOE_DEV_BF16_PAIR,
    FMOE_DEV_FP8_RASTER_GM,
    FMOE_DEV_EXTRA_DEFINES,
];

/// The overrides that only change the sm_90 kernels (every one but PDL, whose rule already needs
/// 9.0+, split-K and extra defines, which reach the other kernels too).
const SM90_ONLY: [&str; 19] = [
    FMOE_DEV_TALL_N,
    FMOE_DEV_SM90_LARGE,
    FMOE_DEV_SM90_MID,
    FMOE_DEV_TALL_ROUTES,
    FMOE_DEV_MIXED_ROUTES,
    FMOE_DEV_LARGE_ROUTES,
    FMOE_DEV_SWAPAB_ROUTES,
    FMOE_DEV_SWAPAB_WIDE_ROUTES,
    FMOE_DEV_SKIP_PAD_WG,
    FMOE_DEV_BF16_PAIR,
    FMOE_DEV_ONE_BLOCK_RASTER,
    FMOE_DEV_ROUTE_ROWS,
    FMOE_DEV_SWAPAB_PERSIST,
    FMOE_DEV_SWAPAB,
    FMOE_DEV_SWAPAB_BN,
    FMOE_DEV_FP8_LARGE,
    FMOE_DEV_FP8_RASTER_GM,
    FMOE_DEV_FP8_LONE_WG,
    FMOE_DEV_FP8_PAIR,
];

/// The names of the `FMOE_DEV_SM90_LARGE` experiments (fmoe-kernels' `SM90_LARGE_EXPERIMENTS`
/// holds their configs in this order); "default" is the kernel the rule runs.
pub const SM90_LARGE_EXPERIMENTS: [&str; 6] =
    ["default", "sync", "raster", "pipe", "persist", "dyn_gm8"];

/// The `FMOE_DEV_SM90_LARGE` experiments that are not the persistent claimed pipe kernel, which
/// the bf16 2-block clusters need.
const SM90_LARGE_UNPAIRED: [&str; 4] = ["sync", "raster", "pipe", "persist"];

/// The swap-AB route blocks `FMOE_DEV_SWAPAB_BN` accepts.
pub const SWAPAB_ROUTE_BLOCKS: [usize; 4] = [16, 32, 64, 128];

/// A `FMOE_DEV_*` value that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DevOverrideError {
    #[error("environment variable {var} has invalid value {value:?}: expected {expected}")]
    Invalid {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error(
        "environment variable {var}={value:?} is an experiment-only developer override: it needs \
         a build with `--features dev-knobs` (cargo feature of fmoe-kernels)"
    )]
    NeedsDevKnobs { var: &'static str, value: String },
    #[error("environment variable {var}={value:?} cannot apply: {condition}")]
    CannotApply {
        var: &'static str,
        value: String,
        condition: String,
    },
}

/// `FMOE_DEV_SM90_MID`: the upper end of the 64-row pipe tiles' range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sm90Mid {
    /// Never (the rule).
    #[default]
    Off,
    /// Up to `MID_TILE_MAX_ROUTES_PER_EXPERT` routes per expert.
    On,
    /// Up to 512 routes per expert.
    Wide,
}

/// `FMOE_DEV_SWAPAB_PERSIST`: which swap-AB GEMMs run persistent, and their tile order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwapAbPersist {
    /// Neither GEMM persistent (a block per tile).
    Off,
    /// GEMM1 persistent (N tiles fastest), GEMM2 a block per tile.
    Gemm1,
    /// Both GEMMs persistent, N tiles fastest.
    NFastest,
    /// Both GEMMs persistent, route blocks fastest (the per-tile grid's order).
    RouteBlocksFastest,
    /// Both GEMMs persistent, tiles claimed from a global counter (the rule).
    #[default]
    Dynamic,
    /// GEMM1 persistent with tiles claimed from a global counter, GEMM2 a block per tile.
    DynamicGemm1,
}

/// `FMOE_DEV_SWAPAB`: the swap-AB decode kernels on or off, and their ring depth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwapAb {
    /// On, each route block with its own depth (the rule).
    #[default]
    On,
    /// Off: the 64-route kernels the swap-AB ones replaced.
    Off,
    /// On, every route block with this ring depth (2..=6).
    Stages(usize),
}

/// `FMOE_DEV_FP8_LARGE`: the fp8 prefill kernels, or a block-scaled promotion schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Large {
    /// The kernels as selected.
    #[default]
    Default,
    /// The synchronous kernels the warp-specialized ones replaced.
    Sync,
    /// The block-scaled warp-specialized kernel with these `promote_pipe` (GEMM1, GEMM2) and
    /// `order_mma`.
    Promote {
        gemm1: usize,
        gemm2: usize,
        ordered: bool,
    },
}

/// The fp8 schemes an fp8 kernel feature applies to (`all`, `tensor`, `block`, `off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Schemes {
    pub tensor: bool,
    pub block: bool,
}

/// Every developer override, typed, each defaulted to the rule's own choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevOverrides {
    /// `FMOE_DEV_PDL` (`0|1|true|false`, default on): Programmatic Dependent Launch of the small-M
    /// MoE chain.
    pub pdl: bool,
    /// `FMOE_DEV_TALL_N` (`192|176`): weight rows per tile of every uniform 192-row bf16 launch.
    pub tall_n: Option<usize>,
    /// `FMOE_DEV_SM90_LARGE` (a name of [`SM90_LARGE_EXPERIMENTS`]; experiment-only).
    pub sm90_large: Option<&'static str>,
    /// `FMOE_DEV_SM90_MID` (`off|on|wide`; experiment-only).
    pub sm90_mid: Sm90Mid,
    /// `FMOE_DEV_TALL_ROUTES` (`<lo>-<hi>` or `0`): routes per expert of the 192-row bf16 tiles.
    pub tall_routes: Option<Range<usize>>,
    /// `FMOE_DEV_MIXED_ROUTES` (`<lo>-<hi>` or `0`): routes per expert of mixed tile heights.
    pub mixed_routes: Option<Range<usize>>,
    /// `FMOE_DEV_LARGE_ROUTES` (a positive integer): routes per expert from which large tiles run.
    pub large_routes: Option<usize>,
    /// `FMOE_DEV_SWAPAB_ROUTES` (an integer): the upper end of the swap-AB range.
    pub swapab_routes: Option<usize>,
    /// `FMOE_DEV_SWAPAB_WIDE_ROUTES` (an integer): the upper end of the 64-route swap-AB range.
    pub swapab_wide_routes: Option<usize>,
    /// `FMOE_DEV_SPLITS` (a positive integer): GEMM2's split-K factor (swap-AB's too).
    pub splits: Option<usize>,
    /// `FMOE_DEV_SKIP_PAD_WG` (`on|off`, default on): 192-row bf16 tiles skip all-padding
    /// warpgroups.
    pub skip_pad_wg: bool,
    /// `FMOE_DEV_BF16_PAIR` (`on|off`, default off; experiment-only): bf16 2-block clusters.
    pub bf16_pair: bool,
    /// `FMOE_DEV_ONE_BLOCK_RASTER` (`on|off`, default on): the one-M-block tile order rule.
    pub one_block_raster: bool,
    /// `FMOE_DEV_ROUTE_ROWS` (`auto|on|off`): `None` = the rule.
    pub route_rows: Option<bool>,
    /// `FMOE_DEV_SWAPAB_PERSIST` (`dyn|dyn1|gemm1|on|off|rb`).
    pub swapab_persist: SwapAbPersist,
    /// `FMOE_DEV_SWAPAB` (`on|off|2..=6`).
    pub swapab: SwapAb,
    /// `FMOE_DEV_SWAPAB_BN` (one of [`SWAPAB_ROUTE_BLOCKS`]): every swap-AB batch's route block.
    pub swapab_bn: Option<usize>,
    /// `FMOE_DEV_FP8_LARGE` (`default|sync|promote-…`).
    pub fp8_large: Fp8Large,
    /// `FMOE_DEV_FP8_RASTER_GM` (1..=64; experiment-only): M blocks per group of the
    /// warp-specialized fp8 kernels' tile order.
    pub fp8_raster_gm: Option<usize>,
    /// `FMOE_DEV_FP8_LONE_WG` (`all|tensor|block|off`, default all).
    pub fp8_lone_wg: Fp8Schemes,
    /// `FMOE_DEV_FP8_PAIR` (`all|tensor|block|off`, default tensor).
    pub fp8_pair: Fp8Schemes,
    /// `FMOE_DEV_EXTRA_DEFINES` (`<family>:<NAME>=<value>[,…][;<family>:…]`; experiment-only):
    /// `(family, "-DNAME=value")` options appended to every program of those families.
    pub extra_defines: Vec<(String, String)>,
    /// The variables that were set, with their values, in [`ALL`]'s order.
    pub set: Vec<(&'static str, String)>,
}

impl Default for DevOverrides {
    fn default() -> Self {
        DevOverrides {
            pdl: true,
            tall_n: None,
            sm90_large: None,
            sm90_mid: Sm90Mid::Off,
            tall_routes: None,
            mixed_routes: None,
            large_routes: None,
            swapab_routes: None,
            swapab_wide_routes: None,
            splits: None,
            skip_pad_wg: true,
            bf16_pair: false,
            one_block_raster: true,
            route_rows: None,
            swapab_persist: SwapAbPersist::Dynamic,
            swapab: SwapAb::On,
            swapab_bn: None,
            fp8_large: Fp8Large::Default,
            fp8_raster_gm: None,
            fp8_lone_wg: Fp8Schemes {
                tensor: true,
                block: true,
            },
            fp8_pair: Fp8Schemes {
                tensor: true,
                block: false,
            },
            extra_defines: Vec::new(),
            set: Vec::new(),
        }
    }
}

type Parsed<T> = std::result::Result<T, DevOverrideError>;

fn invalid(var: &'static str, value: &str, expected: &'static str) -> DevOverrideError {
    DevOverrideError::Invalid {
        var,
        value: value.to_string(),
        expected,
    }
}

fn on_off(var: &'static str, v: &str) -> Parsed<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(invalid(var, v, "on or off")),
    }
}

fn integer(var: &'static str, v: &str, expected: &'static str) -> Parsed<usize> {
    v.parse::<usize>().map_err(|_| invalid(var, v, expected))
}

fn positive(var: &'static str, v: &str) -> Parsed<usize> {
    const EXPECTED: &str = "a positive integer";
    match integer(var, v, EXPECTED)? {
        0 => Err(invalid(var, v, EXPECTED)),
        n => Ok(n),
    }
}

/// `<lo>-<hi>` with lo < hi, or `0` (the empty range: never).
fn range(var: &'static str, v: &str) -> Parsed<Range<usize>> {
    const EXPECTED: &str = "<lo>-<hi> (integers, lo below hi) or 0 (never)";
    if v == "0" {
        return Ok(0..0);
    }
    let (lo, hi) = v.split_once('-').ok_or_else(|| invalid(var, v, EXPECTED))?;
    match (lo.parse::<usize>(), hi.parse::<usize>()) {
        (Ok(lo), Ok(hi)) if lo < hi => Ok(lo..hi),
        _ => Err(invalid(var, v, EXPECTED)),
    }
}

fn schemes(var: &'static str, v: &str) -> Parsed<Fp8Schemes> {
    let (tensor, block) = match v {
        "all" => (true, true),
        "tensor" => (true, false),
        "block" => (false, true),
        "off" => (false, false),
        _ => return Err(invalid(var, v, "all, tensor, block or off")),
    };
    Ok(Fp8Schemes { tensor, block })
}

/// `(family, "-DNAME=value")` pairs of an `FMOE_DEV_EXTRA_DEFINES` value.
fn extra_defines(var: &'static str, v: &str) -> Parsed<Vec<(String, String)>> {
    const EXPECTED: &str = "<family>:<NAME>=<value>[,<NAME>=<value>...][;<family>:...]";
    let mut out = Vec::new();
    for part in v.split(';').filter(|p| !p.is_empty()) {
        let (fam, defs) = part
            .split_once(':')
            .ok_or_else(|| invalid(var, v, EXPECTED))?;
        if fam.is_empty() {
            return Err(invalid(var, v, EXPECTED));
        }
        for d in defs.split(',').filter(|d| !d.is_empty()) {
            match d.split_once('=') {
                Some((name, _)) if !name.is_empty() => {
                    out.push((fam.to_string(), format!("-D{d}")));
                }
                _ => return Err(invalid(var, v, EXPECTED)),
            }
        }
    }
    if out.is_empty() {
        return Err(invalid(var, v, EXPECTED));
    }
    Ok(out)
}

impl DevOverrides {
    /// Reads the process environment.
    pub fn from_env() -> Parsed<Self> {
        Self::parse(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads through `lookup` (tests pass a map), accepting the experiment-only overrides iff
    /// this build has the `dev-knobs` feature.
    pub fn parse(lookup: impl Fn(&str) -> Option<String>) -> Parsed<Self> {
        Self::parse_gated(lookup, cfg!(feature = "dev-knobs"))
    }

    /// [`Self::parse`] with the feature gate given: `dev_knobs` false makes every set
    /// [`EXPERIMENT_ONLY`] variable a [`DevOverrideError::NeedsDevKnobs`].
    pub fn parse_gated(lookup: impl Fn(&str) -> Option<String>, dev_knobs: bool) -> Parsed<Self> {
        let mut d = DevOverrides::default();
        for var in ALL {
            let Some(v) = lookup(var) else { continue };
            if !dev_knobs && EXPERIMENT_ONLY.contains(&var) {
                return Err(DevOverrideError::NeedsDevKnobs { var, value: v });
            }
            d.set_one(var, &v)?;
            d.set.push((var, v));
        }
        d.check_combinations()?;
        Ok(d)
    }

    /// Parses one variable's value into its field.
    fn set_one(&mut self, var: &'static str, v: &str) -> Parsed<()> {
        match var {
            FMOE_DEV_PDL => {
                self.pdl = super::parse_switch(var, Some(v), true)
                    .map_err(|_| invalid(var, v, "0, 1, true or false (case-insensitive)"))?;
            }
            FMOE_DEV_TALL_N => {
                self.tall_n = Some(match v {
                    "192" => 192,
                    "176" => 176,
                    _ => return Err(invalid(var, v, "192 or 176")),
                });
            }
            FMOE_DEV_SM90_LARGE => {
                let name = SM90_LARGE_EXPERIMENTS
                    .iter()
                    .find(|n| **n == v)
                    .ok_or_else(|| {
                        invalid(var, v, "default, sync, raster, pipe, persist or dyn_gm8")
                    })?;
                self.sm90_large = Some(name);
            }
            FMOE_DEV_SM90_MID => {
                self.sm90_mid = match v {
                    "off" => Sm90Mid::Off,
                    "on" => Sm90Mid::On,
                    "wide" => Sm90Mid::Wide,
                    _ => return Err(invalid(var, v, "off, on or wide")),
                };
            }
            FMOE_DEV_TALL_ROUTES => self.tall_routes = Some(range(var, v)?),
            FMOE_DEV_MIXED_ROUTES => self.mixed_routes = Some(range(var, v)?),
            FMOE_DEV_LARGE_ROUTES => self.large_routes = Some(positive(var, v)?),
            FMOE_DEV_SWAPAB_ROUTES => {
                self.swapab_routes = Some(integer(var, v, "an integer (routes per expert)")?);
            }
            FMOE_DEV_SWAPAB_WIDE_ROUTES => {
                self.swapab_wide_routes = Some(integer(var, v, "an integer (routes per expert)")?);
            }
            FMOE_DEV_SPLITS => self.splits = Some(positive(var, v)?),
            FMOE_DEV_SKIP_PAD_WG => self.skip_pad_wg = on_off(var, v)?,
            FMOE_DEV_BF16_PAIR => self.bf16_pair = on_off(var, v)?,
            FMOE_DEV_ONE_BLOCK_RASTER => self.one_block_raster = on_off(var, v)?,
            FMOE_DEV_ROUTE_ROWS => {
                self.route_rows = match v {
                    "auto" => None,
                    "on" => Some(true),
                    "off" => Some(false),
                    _ => return Err(invalid(var, v, "auto, on or off")),
                };
            }
            FMOE_DEV_SWAPAB_PERSIST => {
                self.swapab_persist = match v {
                    "dyn" => SwapAbPersist::Dynamic,
                    "dyn1" => SwapAbPersist::DynamicGemm1,
                    "gemm1" => SwapAbPersist::Gemm1,
                    "on" => SwapAbPersist::NFastest,
                    "off" => SwapAbPersist::Off,
                    "rb" => SwapAbPersist::RouteBlocksFastest,
                    _ => return Err(invalid(var, v, "dyn, dyn1, gemm1, on, off or rb")),
                };
            }
            FMOE_DEV_SWAPAB => {
                const EXPECTED: &str = "on, off or a ring depth 2..=6";
                self.swapab = match v {
                    "on" => SwapAb::On,
                    "off" => SwapAb::Off,
                    _ => match integer(var, v, EXPECTED)? {
                        n @ 2..=6 => SwapAb::Stages(n),
                        _ => return Err(invalid(var, v, EXPECTED)),
                    },
                };
            }
            FMOE_DEV_SWAPAB_BN => {
                const EXPECTED: &str = "16, 32, 64 or 128";
                let bn = integer(var, v, EXPECTED)?;
                if !SWAPAB_ROUTE_BLOCKS.contains(&bn) {
                    return Err(invalid(var, v, EXPECTED));
                }
                self.swapab_bn = Some(bn);
            }
            FMOE_DEV_FP8_LARGE => {
                let promote = |gemm1, gemm2, ordered| Fp8Large::Promote {
                    gemm1,
                    gemm2,
                    ordered,
                };
                self.fp8_large = match v {
                    "default" => Fp8Large::Default,
                    "sync" => Fp8Large::Sync,
                    "promote-halves" => promote(0, 0, false),
                    "promote-drain1" => promote(1, 1, false),
                    "promote-drain2" => promote(2, 2, false),
                    "promote-drain4" => promote(4, 4, false),
                    "promote-gemm2-halves" => promote(2, 0, false),
                    "promote-ordered" => promote(0, 0, true),
                    "promote-gemm2-ordered" => promote(2, 0, true),
                    _ => {
                        return Err(invalid(
                            var,
                            v,
                            "default, sync, promote-halves, promote-drain1, promote-drain2, \
                             promote-drain4, promote-gemm2-halves, promote-ordered or \
                             promote-gemm2-ordered",
                        ));
                    }
                };
            }
            FMOE_DEV_FP8_RASTER_GM => {
                const EXPECTED: &str = "an integer in 1..=64";
                match integer(var, v, EXPECTED)? {
                    n @ 1..=64 => self.fp8_raster_gm = Some(n),
                    _ => return Err(invalid(var, v, EXPECTED)),
                }
            }
            FMOE_DEV_FP8_LONE_WG => self.fp8_lone_wg = schemes(var, v)?,
            FMOE_DEV_FP8_PAIR => self.fp8_pair = schemes(var, v)?,
            FMOE_DEV_EXTRA_DEFINES => self.extra_defines = extra_defines(var, v)?,
            // Every name of ALL has an arm above (a test sets each to garbage and expects an error).
            _ => {}
        }
        Ok(())
    }

    /// The value `var` was set to, if it was.
    pub fn value_of(&self, var: &str) -> Option<&str> {
        self.set
            .iter()
            .find(|(n, _)| *n == var)
            .map(|(_, v)| v.as_str())
    }

    fn cannot_apply(&self, var: &'static str, condition: String) -> DevOverrideError {
        DevOverrideError::CannotApply {
            var,
            value: self.value_of(var).unwrap_or_default().to_string(),
            condition,
        }
    }

    /// The contradictions knowable without a device.
    fn check_combinations(&self) -> Parsed<()> {
        if self.swapab == SwapAb::Off {
            for var in [
                FMOE_DEV_SWAPAB_BN,
                FMOE_DEV_SWAPAB_ROUTES,
                FMOE_DEV_SWAPAB_WIDE_ROUTES,
                FMOE_DEV_SWAPAB_PERSIST,
            ] {
                if self.value_of(var).is_some() {
                    return Err(self.cannot_apply(
                        var,
                        format!(
                            "it tunes the swap-AB kernels, which {FMOE_DEV_SWAPAB}=off turns off"
                        ),
                    ));
                }
            }
        }
        if self.fp8_large == Fp8Large::Sync {
            for var in [
                FMOE_DEV_FP8_RASTER_GM,
                FMOE_DEV_FP8_PAIR,
                FMOE_DEV_FP8_LONE_WG,
            ] {
                if self.value_of(var).is_some() {
                    return Err(self.cannot_apply(
                        var,
                        format!(
                            "it tunes the warp-specialized fp8 prefill kernels, which \
                             {FMOE_DEV_FP8_LARGE}=sync replaces"
                        ),
                    ));
                }
            }
        }
        if self.bf16_pair
            && let Some(name) = self.sm90_large.filter(|n| SM90_LARGE_UNPAIRED.contains(n))
        {
            return Err(self.cannot_apply(
                FMOE_DEV_BF16_PAIR,
                format!(
                    "2-block clusters need the persistent claimed pipe kernel, which \
                     {FMOE_DEV_SM90_LARGE}={name} replaces"
                ),
            ));
        }
        Ok(())
    }

    /// Ok when every set override can apply on a device of compute capability `cc`: the sm_90
    /// kernels' overrides need an sm_90 device (elsewhere no kernel they tune runs). The kernels
    /// call it at a layer's first use on a CUDA device.
    pub fn check_device(&self, cc: (u32, u32)) -> Parsed<()> {
        if cc == (9, 0) {
            return Ok(());
        }
        match self.set.iter().find(|(var, _)| SM90_ONLY.contains(var)) {
            Some((var, _)) => Err(self.cannot_apply(
                var,
                format!(
                    "it tunes the sm_90 kernels and needs a device of compute capability 9.0; \
                     this one is {}.{}",
                    cc.0, cc.1
                ),
            )),
            None => Ok(()),
        }
    }
}

/// The process's overrides, parsed from the environment on first call and kept: the same
/// result (overrides or error) on every call. The CLI calls it at start-up; the kernels' layer
/// entry points call it (and [`DevOverrides::check_device`]) before any selection rule runs.
pub fn dev_overrides() -> Parsed<&'static DevOverrides> {
    static CELL: OnceLock<Parsed<DevOverrides>> = OnceLock::new();
    CELL.get_or_init(DevOverrides::from_env)
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
#[path = "dev_tests.rs"]
mod tests;
