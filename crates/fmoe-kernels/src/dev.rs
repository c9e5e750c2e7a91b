//! The kernels' read of the `FMOE_DEV_*` developer overrides ([`fmoe_core::env::DevOverrides`],
//! parsed once per process). The layer's entry points ([`crate::moe_gemm::block_m`],
//! [`crate::moe_gemm::tiling_for`], [`crate::PdlChain::enter`], the NVRTC compile) call
//! [`checked`] first, so a bad value or an override that cannot apply on the device is their
//! error before any selection rule reads [`dev`].

use fmoe_core::env::{DevOverrides, dev_overrides};

use crate::Result;

/// The overrides, for the selection rules. An environment that does not parse never reaches a
/// rule through the layer (its entry points return the error first); a direct caller of a rule
/// (a unit test) gets the rules' own choices then.
pub(crate) fn dev() -> &'static DevOverrides {
    static DEFAULT: std::sync::OnceLock<DevOverrides> = std::sync::OnceLock::new();
    match dev_overrides() {
        Ok(d) => d,
        Err(_) => DEFAULT.get_or_init(DevOverrides::default),
    }
}

/// The overrides, or the parse error; with `cc`, also the error of an override that cannot apply
/// on a device of that compute capability.
pub(crate) fn checked(cc: Option<(u32, u32)>) -> Result<&'static DevOverrides> {
    let d = dev_overrides().map_err(fmoe_core::Error::from)?;
    if let Some(cc) = cc {
        d.check_device(cc).map_err(fmoe_core::Error::from)?;
    }
    Ok(d)
}
