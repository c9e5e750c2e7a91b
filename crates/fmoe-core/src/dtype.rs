//! Element types. fp8 is OCP "e4m3fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinity,
//! NaN = S.1111.111, largest finite value 448 (S.1111.110).

use std::fmt;
use std::str::FromStr;

pub use float8::F8E4M3;
pub use half::{bf16, f16};

use crate::tensor::CpuStorage;

/// Largest finite e4m3fn magnitude.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// Every e4m3fn code as f32 (exact), built at compile time: decoding is one table load, where
/// float8's bit-twiddling conversion through f16 costs tens of instructions per element.
pub const FP8_E4M3_TO_F32: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = F8E4M3::to_f32(&F8E4M3::from_bits(i as u8));
        i += 1;
    }
    t
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    F8E4M3,
    /// Indices (expert ids, token ids).
    U32,
}

impl DType {
    pub const ALL: [DType; 5] = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F8E4M3,
        DType::U32,
    ];

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
            DType::U32 => "u32",
        }
    }

    /// Unit roundoff (half an ulp at 1.0) of the type's round-to-nearest conversion.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => f64::from(f32::EPSILON) / 2.0,
            DType::BF16 => 2f64.powi(-8),
            DType::F16 => 2f64.powi(-11),
            DType::F8E4M3 => 2f64.powi(-4),
            DType::U32 => 0.0,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "fp16" | "float16" => Ok(DType::F16),
            "f8e4m3" | "fp8" | "float8_e4m3fn" => Ok(DType::F8E4M3),
            "u32" | "uint32" => Ok(DType::U32),
            _ => Err(format!(
                "unknown dtype `{s}` (expected f32, bf16, f16 or f8e4m3)"
            )),
        }
    }
}

/// A Rust element type with a [`DType`]. Conversions from f32 round to nearest even; for fp8 they
/// saturate to ±448 (±Inf included) and keep NaN as NaN.
pub trait WithDType: Copy + Send + Sync + fmt::Debug + 'static {
    const DTYPE: DType;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    fn into_storage(data: Vec<Self>) -> CpuStorage;
    fn slice_of(storage: &CpuStorage) -> Option<&[Self]>;
}

macro_rules! with_dtype {
    ($ty:ty, $variant:ident, $from:expr, $to:expr) => {
        impl WithDType for $ty {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                $from(v)
            }
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn into_storage(data: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(data)
            }
            fn slice_of(storage: &CpuStorage) -> Option<&[Self]> {
                match storage {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

with_dtype!(f32, F32, |v| v, |v| v);
// Indices convert through f32 only in casts and tests; kernels read them as u32.
with_dtype!(u32, U32, |v: f32| v as u32, |v: u32| v as f32);
with_dtype!(bf16, BF16, bf16::from_f32, bf16::to_f32);
with_dtype!(f16, F16, f16::from_f32, f16::to_f32);
// float8's `from_f32` is RNE with finite saturation (Inf -> ±448) and NaN -> NaN: the policy we want.
with_dtype!(
    F8E4M3,
    F8E4M3,
    F8E4M3::from_f32,
    |v: F8E4M3| F8E4M3::to_f32(&v)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_conversion_saturates_and_keeps_nan() {
        assert_eq!(<F8E4M3 as WithDType>::from_f32(448.0).to_bits(), 0x7E);
        assert_eq!(<F8E4M3 as WithDType>::from_f32(1e9).to_bits(), 0x7E);
        assert_eq!(
            <F8E4M3 as WithDType>::from_f32(f32::INFINITY).to_bits(),
            0x7E
        );
        assert_eq!(
            <F8E4M3 as WithDType>::from_f32(f32::NEG_INFINITY).to_bits(),
            0xFE
        );
        assert!(<F8E4M3 as WithDType>::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn fp8_table_matches_the_bit_level_conversion() {
        for b in 0..=255u8 {
            let v = F8E4M3::from_bits(b);
            let (t, f) = (<F8E4M3 as WithDType>::to_f32(v), F8E4M3::to_f32(&v));
            assert!(
                t == f || (t.is_nan() && f.is_nan()),
                "code {b:#04x}: {t} vs {f}"
            );
        }
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.as_str().parse::<DType>(), Ok(d));
        }
        assert!("int4".parse::<DType>().is_err());
    }
}
