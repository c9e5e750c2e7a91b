//! Tensor maps for the grouped GEMMs that load their weight tiles through the copy engine
//! (`cp.async.bulk.tensor`, `cuda/common/sm90_pipeline.cuh`): the weights of every expert viewed as
//! one 2-D [rows, kd] matrix, boxes of 128 bytes along K × `box_rows` rows, 128-byte swizzle (the
//! layout `swz()` of `sm90_wgmma.cuh` writes), zero fill out of bounds.

use fmoe_core::cuda::CudaStorage;
use fmoe_core::cuda::cudarc::driver::sys;
use fmoe_core::cuda::cudarc::driver::{DevicePtr, DeviceRepr};

use crate::{Error, Result};

/// `CUtensorMap` as a kernel argument (128 bytes, 64-byte aligned, passed by value).
#[repr(C, align(64))]
pub(super) struct TensorMapArg(sys::CUtensorMap);

// SAFETY: plain bytes the driver encoded; the kernels declare the parameter as a 64-byte-aligned
// 128-byte struct (`TmaDesc`), which this layout matches.
unsafe impl DeviceRepr for TensorMapArg {}

/// Element type of the weights a tensor map describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TmaElem {
    Bf16,
    /// fp8 codes (e4m3), as bytes: the copy engine only moves them.
    Fp8,
}

impl TmaElem {
    const fn bytes(self) -> usize {
        match self {
            TmaElem::Bf16 => 2,
            TmaElem::Fp8 => 1,
        }
    }
    const fn data_type(self) -> sys::CUtensorMapDataType {
        match self {
            TmaElem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            TmaElem::Fp8 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        }
    }
}

/// The tensor map of `w` viewed as [rows, kd] elements of `elem`, boxes of 128 bytes along K ×
/// `box_rows` rows.
pub(super) fn weight_tensor_map(
    op: &'static str,
    w: &CudaStorage,
    elem: TmaElem,
    rows: usize,
    kd: usize,
    box_rows: usize,
) -> Result<TensorMapArg> {
    let row_bytes = kd * elem.bytes();
    if !row_bytes.is_multiple_of(16) || box_rows == 0 || box_rows > 256 {
        return Err(Error::invalid(
            op,
            format!(
                "tensor map for the weights [{rows}, {kd}]: rows of {row_bytes} bytes (need a multiple of 16), box of {box_rows} rows (need 1..=256)"
            ),
        ));
    }
    let stream = w.backend().stream().clone();
    let (ptr, _record) = DevicePtr::device_ptr(w.buffer(), &stream);
    let dims: [u64; 2] = [kd as u64, rows as u64];
    let strides: [u64; 1] = [row_bytes as u64];
    let boxes: [u32; 2] = [(128 / elem.bytes()) as u32, box_rows as u32];
    let elem_strides: [u32; 2] = [1, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer refers to a live local array of the rank the call is given (2; one
    // stride for rank 2); `ptr` is the weights' device address (256-byte aligned), the row stride
    // a multiple of 16 and the box within the limits (checked above; 128 bytes inner for the
    // 128-byte swizzle).
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            elem.data_type(),
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::invalid(
            op,
            format!("cuTensorMapEncodeTiled for the weights [{rows}, {kd}] failed: {rc:?}"),
        ));
    }
    // SAFETY: initialized by the successful call above.
    Ok(TensorMapArg(unsafe { map.assume_init() }))
}

impl<'a> crate::launch::PdlArg<'a> for &'a TensorMapArg {
    fn param(self, _: &fmoe_core::cuda::cudarc::driver::CudaStream) -> crate::launch::Param<'a> {
        crate::launch::Param::value(self)
    }
}
