use super::*;
use std::collections::HashMap;

/// The overrides of `pairs` in a build with (`dev_knobs`) or without the feature.
fn parse_with(pairs: &[(&str, &str)], dev_knobs: bool) -> Parsed<DevOverrides> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    DevOverrides::parse_gated(|k| map.get(k).cloned(), dev_knobs)
}

fn parse(pairs: &[(&str, &str)]) -> Parsed<DevOverrides> {
    parse_with(pairs, true)
}

/// Each of `bad` is an `Invalid` error naming `var` and the value; `good` parses and `check`
/// holds of the result (and fails on the default, so the field did change).
fn knob(
    var: &'static str,
    good: &[&str],
    bad: &[&str],
    check: impl Fn(&str, &DevOverrides) -> bool,
) {
    for v in good {
        let d = parse(&[(var, v)]).unwrap_or_else(|e| panic!("{var}={v}: {e}"));
        assert!(check(v, &d), "{var}={v} parsed to {d:?}");
        assert_eq!(d.value_of(var), Some(*v));
    }
    for v in bad {
        let err = parse(&[(var, v)]).unwrap_err();
        assert!(matches!(err, DevOverrideError::Invalid { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(var), "{msg}");
        assert!(msg.contains(&format!("{v:?}")), "{msg}");
        assert!(msg.contains("expected "), "{msg}");
    }
}

#[test]
fn unset_is_the_default_and_every_variable_has_a_parser() {
    assert_eq!(parse(&[]).unwrap(), DevOverrides::default());
    let d = DevOverrides::default();
    assert!(d.pdl && d.skip_pad_wg && d.one_block_raster && !d.bf16_pair);
    assert_eq!(d.swapab_persist, SwapAbPersist::Dynamic);
    // Garbage in every variable is an error naming it (so none is ignored).
    for var in ALL {
        let msg = parse(&[(var, "garbage!")]).unwrap_err().to_string();
        assert!(msg.contains(var), "{msg}");
    }
}

#[test]
fn pdl() {
    knob(
        FMOE_DEV_PDL,
        &["0", "false", "FALSE"],
        &["garbage", "", "on"],
        |_, d| !d.pdl,
    );
    assert!(parse(&[(FMOE_DEV_PDL, "1")]).unwrap().pdl);
}

#[test]
fn tall_n() {
    knob(
        FMOE_DEV_TALL_N,
        &["176", "192"],
        &["160", "x", ""],
        |v, d| d.tall_n == v.parse().ok(),
    );
}

#[test]
fn sm90_large() {
    knob(
        FMOE_DEV_SM90_LARGE,
        &SM90_LARGE_EXPERIMENTS,
        &["tma", "", "Default"],
        |v, d| d.sm90_large == Some(v),
    );
}

#[test]
fn sm90_mid() {
    knob(
        FMOE_DEV_SM90_MID,
        &["on", "wide"],
        &["1", "", "narrow"],
        |v, d| {
            d.sm90_mid
                == if v == "on" {
                    Sm90Mid::On
                } else {
                    Sm90Mid::Wide
                }
        },
    );
    assert_eq!(
        parse(&[(FMOE_DEV_SM90_MID, "off")]).unwrap().sm90_mid,
        Sm90Mid::Off
    );
}

#[test]
fn tall_routes() {
    knob(
        FMOE_DEV_TALL_ROUTES,
        &["0", "96-192", "0-1000000"],
        &["5", "192-96", "10-10", "a-b", "-4", ""],
        |v, d| {
            d.tall_routes
                == Some(match v {
                    "0" => 0..0,
                    "96-192" => 96..192,
                    _ => 0..1_000_000,
                })
        },
    );
}

#[test]
fn mixed_routes() {
    knob(
        FMOE_DEV_MIXED_ROUTES,
        &["0", "96-100000"],
        &["96", "100-96", "x-1", ""],
        |v, d| d.mixed_routes == Some(if v == "0" { 0..0 } else { 96..100_000 }),
    );
}

#[test]
fn large_routes() {
    knob(
        FMOE_DEV_LARGE_ROUTES,
        &["32", "128"],
        &["0", "-1", "6.5", ""],
        |v, d| d.large_routes == v.parse().ok(),
    );
}

#[test]
fn swapab_routes() {
    knob(
        FMOE_DEV_SWAPAB_ROUTES,
        &["0", "16", "49"],
        &["x", "-1", ""],
        |v, d| d.swapab_routes == v.parse().ok(),
    );
}

#[test]
fn swapab_wide_routes() {
    knob(
        FMOE_DEV_SWAPAB_WIDE_ROUTES,
        &["0", "57"],
        &["wide", "1e3", ""],
        |v, d| d.swapab_wide_routes == v.parse().ok(),
    );
}

#[test]
fn splits() {
    knob(FMOE_DEV_SPLITS, &["1", "18"], &["0", "two", ""], |v, d| {
        d.splits == v.parse().ok()
    });
}

#[test]
fn skip_pad_wg() {
    knob(FMOE_DEV_SKIP_PAD_WG, &["off"], &["0", "ON", ""], |_, d| {
        !d.skip_pad_wg
    });
    assert!(parse(&[(FMOE_DEV_SKIP_PAD_WG, "on")]).unwrap().skip_pad_wg);
}

#[test]
fn bf16_pair() {
    knob(FMOE_DEV_BF16_PAIR, &["on"], &["1", "yes", ""], |_, d| {
        d.bf16_pair
    });
    assert!(!parse(&[(FMOE_DEV_BF16_PAIR, "off")]).unwrap().bf16_pair);
}

#[test]
fn one_block_raster() {
    knob(
        FMOE_DEV_ONE_BLOCK_RASTER,
        &["off"],
        &["false", ""],
        |_, d| !d.one_block_raster,
    );
}

#[test]
fn route_rows() {
    knob(
        FMOE_DEV_ROUTE_ROWS,
        &["on", "off"],
        &["1", "rule", ""],
        |v, d| d.route_rows == Some(v == "on"),
    );
    assert_eq!(
        parse(&[(FMOE_DEV_ROUTE_ROWS, "auto")]).unwrap().route_rows,
        None
    );
}

#[test]
fn swapab_persist() {
    knob(
        FMOE_DEV_SWAPAB_PERSIST,
        &["dyn1", "gemm1", "on", "off", "rb"],
        &["dynamic", "", "1"],
        |v, d| {
            d.swapab_persist
                == match v {
                    "dyn1" => SwapAbPersist::DynamicGemm1,
                    "gemm1" => SwapAbPersist::Gemm1,
                    "on" => SwapAbPersist::NFastest,
                    "off" => SwapAbPersist::Off,
                    _ => SwapAbPersist::RouteBlocksFastest,
                }
        },
    );
}

#[test]
fn swapab() {
    knob(
        FMOE_DEV_SWAPAB,
        &["off", "2", "6"],
        &["1", "7", "deep", ""],
        |v, d| {
            d.swapab
                == match v {
                    "off" => SwapAb::Off,
                    n => SwapAb::Stages(n.parse().unwrap()),
                }
        },
    );
    assert_eq!(
        parse(&[(FMOE_DEV_SWAPAB, "on")]).unwrap().swapab,
        SwapAb::On
    );
}

#[test]
fn swapab_bn() {
    knob(
        FMOE_DEV_SWAPAB_BN,
        &["16", "32", "64", "128"],
        &["48", "256", ""],
        |v, d| d.swapab_bn == v.parse().ok(),
    );
}

#[test]
fn fp8_large() {
    knob(
        FMOE_DEV_FP8_LARGE,
        &["sync", "promote-drain4", "promote-gemm2-ordered"],
        &["solo", "promote", ""],
        |v, d| {
            d.fp8_large
                == match v {
                    "sync" => Fp8Large::Sync,
                    "promote-drain4" => Fp8Large::Promote {
                        gemm1: 4,
                        gemm2: 4,
                        ordered: false,
                    },
                    _ => Fp8Large::Promote {
                        gemm1: 2,
                        gemm2: 0,
                        ordered: true,
                    },
                }
        },
    );
}

#[test]
fn fp8_raster_gm() {
    knob(
        FMOE_DEV_FP8_RASTER_GM,
        &["1", "8", "64"],
        &["0", "65", "x", ""],
        |v, d| d.fp8_raster_gm == v.parse().ok(),
    );
}

#[test]
fn fp8_lone_wg() {
    knob(
        FMOE_DEV_FP8_LONE_WG,
        &["block", "off"],
        &["none", ""],
        |v, d| {
            d.fp8_lone_wg
                == Fp8Schemes {
                    tensor: false,
                    block: v == "block",
                }
        },
    );
}

#[test]
fn fp8_pair() {
    knob(
        FMOE_DEV_FP8_PAIR,
        &["all", "block", "off"],
        &["both", ""],
        |v, d| {
            d.fp8_pair
                == Fp8Schemes {
                    tensor: v == "all",
                    block: v != "off",
                }
        },
    );
}

#[test]
fn extra_defines() {
    knob(
        FMOE_DEV_EXTRA_DEFINES,
        &["moe_gemm_fp8_sm90_ws:A_TMA=1;moe_align:X=2,Y=3"],
        &["A_TMA=1", ":A=1", "fam:=1", "fam:A", ";", ""],
        |_, d| {
            d.extra_defines
                == [
                    ("moe_gemm_fp8_sm90_ws", "-DA_TMA=1"),
                    ("moe_align", "-DX=2"),
                    ("moe_align", "-DY=3"),
                ]
                .map(|(f, o)| (f.to_string(), o.to_string()))
        },
    );
}

#[test]
fn experiment_only_knobs_need_the_dev_knobs_feature() {
    for var in EXPERIMENT_ONLY {
        let good = match var {
            FMOE_DEV_SM90_LARGE => "sync",
            FMOE_DEV_SM90_MID => "on",
            FMOE_DEV_BF16_PAIR => "on",
            FMOE_DEV_FP8_RASTER_GM => "8",
            _ => "moe_align:X=1",
        };
        assert!(parse_with(&[(var, good)], true).is_ok(), "{var}");
        let err = parse_with(&[(var, good)], false).unwrap_err();
        assert!(
            matches!(err, DevOverrideError::NeedsDevKnobs { .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(var) && msg.contains("--features dev-knobs"),
            "{msg}"
        );
    }
    // The other knobs parse in either build.
    for var in ALL.iter().filter(|v| !EXPERIMENT_ONLY.contains(v)) {
        let value = if *var == FMOE_DEV_PDL { "0" } else { "off" };
        let value = match *var {
            FMOE_DEV_TALL_N => "176",
            FMOE_DEV_TALL_ROUTES | FMOE_DEV_MIXED_ROUTES | FMOE_DEV_SWAPAB_ROUTES => "0",
            FMOE_DEV_SWAPAB_WIDE_ROUTES | FMOE_DEV_LARGE_ROUTES | FMOE_DEV_SPLITS => "1",
            FMOE_DEV_SWAPAB_BN => "64",
            FMOE_DEV_FP8_LARGE => "sync",
            _ => value,
        };
        parse_with(&[(var, value)], false).unwrap_or_else(|e| panic!("{var}={value}: {e}"));
    }
    // `parse` applies this build's gate.
    let built = parse_with(&[(FMOE_DEV_BF16_PAIR, "on")], cfg!(feature = "dev-knobs"));
    let map = [(FMOE_DEV_BF16_PAIR.to_string(), "on".to_string())];
    let got = DevOverrides::parse(|k| map.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()));
    assert_eq!(got, built);
}

/// `(var, condition)` of a `CannotApply` error.
fn cannot_apply(pairs: &[(&str, &str)]) -> (&'static str, String) {
    match parse(pairs).unwrap_err() {
        e @ DevOverrideError::CannotApply { var, .. } => (var, e.to_string()),
        e => panic!("{pairs:?}: {e:?}"),
    }
}

#[test]
fn swapab_tuning_with_swapab_off_cannot_apply() {
    for (var, v) in [
        (FMOE_DEV_SWAPAB_BN, "64"),
        (FMOE_DEV_SWAPAB_ROUTES, "16"),
        (FMOE_DEV_SWAPAB_WIDE_ROUTES, "49"),
        (FMOE_DEV_SWAPAB_PERSIST, "rb"),
    ] {
        let (got, msg) = cannot_apply(&[(FMOE_DEV_SWAPAB, "off"), (var, v)]);
        assert_eq!(got, var);
        assert!(
            msg.contains(&format!("{var}={v:?}")) && msg.contains("FMOE_DEV_SWAPAB=off"),
            "{msg}"
        );
        assert!(parse(&[(FMOE_DEV_SWAPAB, "3"), (var, v)]).is_ok());
    }
}

#[test]
fn warp_specialized_fp8_tuning_with_sync_kernels_cannot_apply() {
    for (var, v) in [
        (FMOE_DEV_FP8_RASTER_GM, "8"),
        (FMOE_DEV_FP8_PAIR, "all"),
        (FMOE_DEV_FP8_LONE_WG, "off"),
    ] {
        let (got, msg) = cannot_apply(&[(FMOE_DEV_FP8_LARGE, "sync"), (var, v)]);
        assert_eq!(got, var);
        assert!(msg.contains("FMOE_DEV_FP8_LARGE=sync"), "{msg}");
        assert!(parse(&[(FMOE_DEV_FP8_LARGE, "promote-drain2"), (var, v)]).is_ok());
    }
}

#[test]
fn bf16_pairs_with_an_unpaired_large_kernel_cannot_apply() {
    for name in SM90_LARGE_UNPAIRED {
        let (got, msg) = cannot_apply(&[(FMOE_DEV_BF16_PAIR, "on"), (FMOE_DEV_SM90_LARGE, name)]);
        assert_eq!(got, FMOE_DEV_BF16_PAIR);
        assert!(
            msg.contains(&format!("FMOE_DEV_SM90_LARGE={name}")),
            "{msg}"
        );
    }
    for name in ["default", "dyn_gm8"] {
        assert!(parse(&[(FMOE_DEV_BF16_PAIR, "on"), (FMOE_DEV_SM90_LARGE, name)]).is_ok());
    }
}

#[test]
fn sm90_overrides_on_another_device_cannot_apply() {
    let d = parse(&[(FMOE_DEV_TALL_N, "176"), (FMOE_DEV_SPLITS, "4")]).unwrap();
    assert!(d.check_device((9, 0)).is_ok());
    let err = d.check_device((8, 0)).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            DevOverrideError::CannotApply {
                var: FMOE_DEV_TALL_N,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("FMOE_DEV_TALL_N=\"176\"") && msg.contains("this one is 8.0"),
        "{msg}"
    );
    // Split-K and PDL are not sm_90-only; nothing set is fine anywhere.
    let d = parse(&[(FMOE_DEV_SPLITS, "4"), (FMOE_DEV_PDL, "0")]).unwrap();
    assert!(d.check_device((8, 9)).is_ok());
    assert!(DevOverrides::default().check_device((7, 5)).is_ok());
}
