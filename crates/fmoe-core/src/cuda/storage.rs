//! [`CudaStorage`]: a typed buffer in device memory.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, result};

use super::{CudaBackend, cuda_error, poison_allocations};
use crate::{CpuStorage, DType, Device, Error, F8E4M3, Result, WithDType, bf16, f16};

/// Device memory holding `len` elements of `dtype`, allocated on (and freed through) its
/// backend's stream.
///
/// The bytes live in a `CudaSlice<u8>`; the element type is `dtype`. Kernels take the buffer as a
/// raw device pointer ([`Self::buffer`] for inputs, [`Self::buffer_mut`] for outputs, both usable
/// as cudarc launch arguments) and their family's `mod.rs` has checked `dtype` before launching.
/// Cloning shares the buffer (tensors are immutable); [`Self::buffer_mut`] refuses a shared one.
#[derive(Clone)]
pub struct CudaStorage {
    /// At least one byte long (zero-byte allocations are not portable across drivers), so its
    /// length is not the element count: use `len`.
    buf: Arc<CudaSlice<u8>>,
    dtype: DType,
    len: usize,
    backend: Arc<CudaBackend>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStorage")
            .field("device", &self.device())
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .finish()
    }
}

impl CudaStorage {
    /// A new buffer of `len` elements whose contents are unspecified (a pooled block may hold old
    /// data); the kernel that fills it must write every element. Filled with `0xFF` bytes while
    /// [`set_poison_allocations`](super::set_poison_allocations) is on.
    pub fn alloc(backend: &Arc<CudaBackend>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let mut s = CudaStorage::alloc_raw(backend, dtype, len)?;
        if poison_allocations() {
            s.fill_bytes(0xFF)?;
        }
        Ok(s)
    }

    /// A new buffer of `len` zero elements (all-zero bytes are 0 in every dtype, fp8 included).
    pub fn zeros(backend: &Arc<CudaBackend>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let mut s = CudaStorage::alloc_raw(backend, dtype, len)?;
        s.fill_bytes(0)?;
        Ok(s)
    }

    /// Uploads host data (one host-to-device copy on the backend's stream; the host buffer may be
    /// dropped as soon as this returns).
    pub fn from_cpu(backend: &Arc<CudaBackend>, cpu: &CpuStorage) -> Result<CudaStorage> {
        let mut s = CudaStorage::alloc_raw(backend, cpu.dtype(), cpu.len())?;
        let src = match cpu {
            CpuStorage::F32(v) => bytes_of(v),
            CpuStorage::BF16(v) => bytes_of(v),
            CpuStorage::F16(v) => bytes_of(v),
            CpuStorage::F8E4M3(v) => bytes_of(v),
            CpuStorage::U32(v) => bytes_of(v),
        };
        if !src.is_empty() {
            refuse_during_capture(backend, "CudaStorage::from_cpu")?;
            let stream = backend.stream().clone();
            let dst = s.buffer_mut()?;
            stream
                .memcpy_htod(src, dst)
                .map_err(|e| cuda_error("CudaStorage::from_cpu", e))?;
        }
        Ok(s)
    }

    /// Downloads to host memory. Waits for the work issued before it on the stream, so it also
    /// reports errors of earlier asynchronous work.
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        Ok(match self.dtype {
            DType::F32 => CpuStorage::F32(self.download()?),
            DType::BF16 => CpuStorage::BF16(self.download()?),
            DType::F16 => CpuStorage::F16(self.download()?),
            DType::F8E4M3 => CpuStorage::F8E4M3(self.download()?),
            DType::U32 => CpuStorage::U32(self.download()?),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_in_bytes(&self) -> usize {
        self.len * self.dtype.size_in_bytes()
    }

    pub fn backend(&self) -> &Arc<CudaBackend> {
        &self.backend
    }

    pub fn device(&self) -> Device {
        self.backend.device()
    }

    /// The device buffer, for reading (kernel inputs): `launch_builder(..).arg(s.buffer())`. The
    /// kernel sees a pointer to the first element; the allocation holds at least
    /// [`Self::size_in_bytes`] bytes.
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buf
    }

    /// The device buffer, for writing (kernel outputs). Errors if the buffer is shared with another
    /// storage (a clone, or a tensor), since tensors are immutable.
    pub fn buffer_mut(&mut self) -> Result<&mut CudaSlice<u8>> {
        Arc::get_mut(&mut self.buf).ok_or_else(|| {
            Error::invalid(
                "CudaStorage::buffer_mut",
                "the buffer is shared (tensors are immutable); write to a fresh allocation",
            )
        })
    }

    /// Sets every byte to `byte` (a stream-ordered memset).
    pub fn fill_bytes(&mut self, byte: u8) -> Result<()> {
        let stream = self.backend.stream().clone();
        let buf = self.buffer_mut()?;
        let num_bytes = buf.len();
        let (ptr, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &stream);
        // SAFETY: `ptr` is this live allocation of `num_bytes` bytes, allocated on `stream`; every
        // byte pattern is a valid value of every dtype.
        unsafe { result::memset_d8_async(ptr, byte, num_bytes, stream.cu_stream()) }
            .map_err(|e| cuda_error("CudaStorage::fill_bytes", e))
    }

    /// Sets every element to `value` converted to this storage's dtype (round to nearest even;
    /// fp8 saturates; u32 takes `value as u32`): one stream-ordered `cuMemsetD8/16/32Async` of the
    /// element's bit pattern, no kernel and no host synchronization.
    pub fn fill(&mut self, value: f32) -> Result<()> {
        const OP: &str = "CudaStorage::fill";
        if self.len == 0 {
            return Ok(());
        }
        let bits = match CpuStorage::from_f32_slice(&[value], self.dtype) {
            CpuStorage::F32(v) => v.first().map(|x| u64::from(x.to_bits())),
            CpuStorage::U32(v) => v.first().map(|&x| u64::from(x)),
            CpuStorage::BF16(v) => v.first().map(|x| u64::from(x.to_bits())),
            CpuStorage::F16(v) => v.first().map(|x| u64::from(x.to_bits())),
            CpuStorage::F8E4M3(v) => v.first().map(|x| u64::from(x.to_bits())),
        }
        .unwrap_or(0);
        let len = self.len;
        let size = self.dtype.size_in_bytes();
        let stream = self.backend.stream().clone();
        let buf = self.buffer_mut()?;
        let (ptr, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &stream);
        use cudarc::driver::sys;
        // SAFETY: `ptr` is this live allocation, at least `len * size` bytes long, allocated on
        // `stream`; each call writes exactly `len` elements of `size` bytes, and every bit
        // pattern is a valid value of every dtype.
        let r = unsafe {
            match size {
                4 => sys::cuMemsetD32Async(ptr, bits as u32, len, stream.cu_stream()),
                2 => sys::cuMemsetD16Async(ptr, bits as u16, len, stream.cu_stream()),
                _ => sys::cuMemsetD8Async(ptr, bits as u8, len, stream.cu_stream()),
            }
        };
        r.result().map_err(|e| cuda_error(OP, e))
    }

    /// A new buffer holding elements `range` of this one (a device-to-device copy).
    pub fn copy_range(&self, range: Range<usize>) -> Result<CudaStorage> {
        const OP: &str = "CudaStorage::copy_range";
        if range.start > range.end || range.end > self.len {
            return Err(Error::invalid(
                OP,
                format!("range {range:?} out of bounds for {} elements", self.len),
            ));
        }
        let mut out = CudaStorage::alloc_raw(&self.backend, self.dtype, range.len())?;
        out.copy_from(0, self, range)?;
        Ok(out)
    }

    /// The concatenation of `parts` (same dtype and device), in order.
    pub fn concat(parts: &[&CudaStorage]) -> Result<CudaStorage> {
        const OP: &str = "CudaStorage::concat";
        let Some(first) = parts.first() else {
            return Err(Error::invalid(OP, "nothing to concatenate"));
        };
        let mut len = 0usize;
        for (i, p) in parts.iter().enumerate() {
            if p.dtype != first.dtype || p.device() != first.device() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "part {i} is {} on {}, part 0 is {} on {}",
                        p.dtype,
                        p.device(),
                        first.dtype,
                        first.device()
                    ),
                ));
            }
            len = len
                .checked_add(p.len)
                .ok_or_else(|| Error::invalid(OP, "total length overflows usize"))?;
        }
        let mut out = CudaStorage::alloc_raw(&first.backend, first.dtype, len)?;
        let mut at = 0;
        for p in parts {
            out.copy_from(at, p, 0..p.len)?;
            at += p.len;
        }
        Ok(out)
    }

    /// Copies a block of `rows` rows × `cols` elements from `src` (row `r` starting at element
    /// `src_offset + r·src_pitch`) into this buffer (row `r` at `dst_offset + r·dst_pitch`): one
    /// stream-ordered `cuMemcpy2DAsync`, e.g. a batch's keys (a column range of the q/k/v rows)
    /// into a preallocated KV-cache slab. Same dtype and device; every row must be in bounds.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d_from(
        &mut self,
        dst_offset: usize,
        dst_pitch: usize,
        src: &CudaStorage,
        src_offset: usize,
        src_pitch: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        const OP: &str = "CudaStorage::copy_2d_from";
        if src.dtype != self.dtype || src.device() != self.device() {
            return Err(Error::invalid(
                OP,
                format!(
                    "source is {} on {}, destination {} on {}",
                    src.dtype,
                    src.device(),
                    self.dtype,
                    self.device()
                ),
            ));
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let end = |offset: usize, pitch: usize| {
            pitch
                .checked_mul(rows - 1)
                .and_then(|v| v.checked_add(offset))
                .and_then(|v| v.checked_add(cols))
        };
        let in_bounds = |offset, pitch, len| {
            (rows == 1 || pitch >= cols) && end(offset, pitch).is_some_and(|e| e <= len)
        };
        if !in_bounds(src_offset, src_pitch, src.len) || !in_bounds(dst_offset, dst_pitch, self.len)
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "{rows}×{cols} block out of bounds: source offset {src_offset} pitch {src_pitch} of {} elements, destination offset {dst_offset} pitch {dst_pitch} of {}",
                    src.len, self.len
                ),
            ));
        }
        let size = self.dtype.size_in_bytes();
        let stream = self.backend.stream().clone();
        let (src_ptr, _src_record) =
            cudarc::driver::DevicePtr::device_ptr(src.buf.as_ref(), &stream);
        let buf = self.buffer_mut()?;
        let (dst_ptr, _dst_record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &stream);
        use cudarc::driver::sys;
        // A single row needs no pitch; keep it valid (≥ the width) for the driver.
        let pitch = |p: usize| p.max(cols) * size;
        // Device to device; the host and array fields are unused (null).
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src_ptr + (src_offset * size) as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: pitch(src_pitch),
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst_ptr + (dst_offset * size) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: pitch(dst_pitch),
            WidthInBytes: cols * size,
            Height: rows,
        };
        // SAFETY: both buffers are live allocations on `stream` and every byte the descriptor
        // touches is in bounds (checked above); the destination is not shared (buffer_mut).
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
            .result()
            .map_err(|e| cuda_error(OP, e))
    }

    /// Copies `src[range]` (elements) to `self[at..]`.
    fn copy_from(&mut self, at: usize, src: &CudaStorage, range: Range<usize>) -> Result<()> {
        const OP: &str = "CudaStorage::copy";
        let size = self.dtype.size_in_bytes();
        let n = range.len() * size;
        if n == 0 {
            return Ok(());
        }
        let (s0, d0) = (range.start * size, at * size);
        let stream = self.backend.stream().clone();
        let src_view = src
            .buf
            .try_slice(s0..s0 + n)
            .ok_or_else(|| Error::invalid(OP, "source range out of bounds"))?;
        let buf = self.buffer_mut()?;
        let mut dst_view = buf
            .try_slice_mut(d0..d0 + n)
            .ok_or_else(|| Error::invalid(OP, "destination range out of bounds"))?;
        stream
            .memcpy_dtod(&src_view, &mut dst_view)
            .map_err(|e| cuda_error(OP, e))
    }

    fn alloc_raw(backend: &Arc<CudaBackend>, dtype: DType, len: usize) -> Result<CudaStorage> {
        let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
            Error::invalid(
                "CudaStorage::alloc",
                format!("{len} elements of {dtype} overflow usize"),
            )
        })?;
        // SAFETY: the bytes are uninitialized device memory, which is fine for `u8`: every reader
        // either writes first (kernel outputs, copies) or treats the contents as unspecified.
        let buf = unsafe { backend.stream().alloc::<u8>(bytes.max(1)) }
            .map_err(|e| cuda_error("CudaStorage::alloc", e))?;
        Ok(CudaStorage {
            buf: Arc::new(buf),
            dtype,
            len,
            backend: backend.clone(),
        })
    }

    fn download<T: Pod>(&self) -> Result<Vec<T>> {
        let mut out = vec![T::ZERO; self.len];
        let dst = bytes_of_mut(&mut out);
        if !dst.is_empty() {
            refuse_during_capture(&self.backend, "CudaStorage::to_cpu")?;
            let src = self.buf.try_slice(0..dst.len()).ok_or_else(|| {
                Error::invalid("CudaStorage::to_cpu", "buffer shorter than its length")
            })?;
            // A device-to-pageable-host copy returns only once the data has arrived.
            self.backend
                .stream()
                .memcpy_dtoh(&src, dst)
                .map_err(|e| cuda_error("CudaStorage::to_cpu", e))?;
        }
        Ok(out)
    }
}

/// Copies between pageable host memory and the device are synchronous, which is what makes
/// [`CudaStorage::to_cpu`] and [`CudaStorage::from_cpu`] correct; while the stream captures a CUDA
/// graph the driver records them instead of running them (the download would return unfilled
/// memory, and every replay would touch a host buffer long gone), so they are refused.
fn refuse_during_capture(backend: &CudaBackend, op: &'static str) -> Result<()> {
    use cudarc::driver::sys::CUstreamCaptureStatus;
    let status = backend
        .stream()
        .capture_status()
        .map_err(|e| cuda_error(op, e))?;
    if status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Ok(());
    }
    Err(Error::Unsupported {
        op,
        device: backend.device(),
        reason: "the stream is capturing a CUDA graph, which would record this host copy \
                 instead of running it"
            .into(),
    })
}

/// Element types that are plain bytes.
///
/// # Safety
/// Implementors have no padding and every bit pattern is a valid value.
unsafe trait Pod: WithDType {
    const ZERO: Self;
}

// SAFETY: IEEE and integer types; `bf16`, `f16` and `F8E4M3` are `#[repr(transparent)]` over
// `u16`/`u8`, and every bit pattern of theirs is a value (NaN payloads included).
unsafe impl Pod for f32 {
    const ZERO: Self = 0.0;
}
unsafe impl Pod for u32 {
    const ZERO: Self = 0;
}
unsafe impl Pod for bf16 {
    const ZERO: Self = bf16::ZERO;
}
unsafe impl Pod for f16 {
    const ZERO: Self = f16::ZERO;
}
unsafe impl Pod for F8E4M3 {
    const ZERO: Self = F8E4M3::ZERO;
}

fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding, so all `size_of_val(v)` bytes are initialized; `u8` has
    // alignment 1; the borrow keeps `v` alive and shared.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; any bytes written make valid `T`s since every bit pattern is one.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use crate::cuda::cuda_backend;
    use crate::{DType, Device, Error, Tensor};

    /// Runs only where a CUDA device is present (the kernels crate's GPU tests enforce that under
    /// `FMOE_REQUIRE_CUDA=1`).
    #[test]
    fn tensors_round_trip_through_the_device() {
        if let Err(e) = cuda_backend(0) {
            println!("skipping: {e}");
            return;
        }
        let cuda = Device::Cuda(0);
        let v: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        for dtype in DType::ALL {
            let cpu = Tensor::from_f32(&v, [2, 3, 4], dtype, &Device::Cpu).unwrap();
            let gpu = cpu.to_device(cuda).unwrap();
            assert_eq!(
                (gpu.device(), gpu.dtype(), gpu.dims()),
                (cuda, dtype, &[2, 3, 4][..])
            );
            assert_eq!(
                gpu.to_f32_vec().unwrap(),
                cpu.to_f32_vec().unwrap(),
                "{dtype}"
            );
            let back = gpu.to_device(Device::Cpu).unwrap();
            assert_eq!(
                back.to_f32_vec().unwrap(),
                cpu.to_f32_vec().unwrap(),
                "{dtype}"
            );

            // index0 / stack0 copy on the device; reshape shares.
            let parts: Vec<Tensor> = (0..2).map(|i| gpu.index0(i).unwrap()).collect();
            assert_eq!(parts[1].device(), cuda);
            assert_eq!(
                parts[1].to_f32_vec().unwrap(),
                cpu.index0(1).unwrap().to_f32_vec().unwrap()
            );
            let stacked = Tensor::stack0(&parts).unwrap();
            assert_eq!(stacked.device(), cuda);
            assert_eq!(stacked.to_f32_vec().unwrap(), cpu.to_f32_vec().unwrap());
            let r = gpu.reshape([6, 4]).unwrap();
            assert!(std::ptr::eq(r.storage(), gpu.storage()) || r.dims() == [6, 4]);
            assert_eq!(r.to_f32_vec().unwrap(), cpu.to_f32_vec().unwrap());

            let z = Tensor::zeros([5, 3], dtype, &cuda).unwrap();
            assert_eq!(z.to_f32_vec().unwrap(), vec![0.0; 15]);
            // A memset of the element's bit pattern, for every element width.
            let f = Tensor::full([7], dtype, 1.5, &cuda).unwrap();
            assert_eq!(
                f.to_f32_vec().unwrap(),
                Tensor::full([7], dtype, 1.5, &Device::Cpu)
                    .unwrap()
                    .to_f32_vec()
                    .unwrap(),
                "{dtype}"
            );
            let err = gpu.cpu_storage("op_x", "t").unwrap_err();
            assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
        }
        // In-place row block copies (the KV cache's appends) agree with the host's.
        let src: Vec<f32> = (0..35).map(|i| i as f32).collect();
        let src_cpu = Tensor::from_f32(&src, [5, 7], DType::BF16, &Device::Cpu).unwrap();
        let src_gpu = src_cpu.to_device(cuda).unwrap();
        let mut dst_cpu = Tensor::full([6, 3], DType::BF16, -1.0, &Device::Cpu).unwrap();
        let mut dst_gpu = dst_cpu.to_device(cuda).unwrap();
        for (dst_row, src_row, src_col, rows) in [(1, 2, 4, 3), (0, 0, 0, 1), (5, 4, 1, 1)] {
            dst_cpu
                .copy_rows_from(dst_row, &src_cpu, src_row, src_col, rows)
                .unwrap();
            dst_gpu
                .copy_rows_from(dst_row, &src_gpu, src_row, src_col, rows)
                .unwrap();
        }
        assert_eq!(dst_gpu.to_f32_vec().unwrap(), dst_cpu.to_f32_vec().unwrap());
        assert!(dst_gpu.copy_rows_from(4, &src_gpu, 0, 0, 3).is_err());
        let gpu = Tensor::from_vec(vec![1.5f32, -2.0], [2], &cuda).unwrap();
        let h = gpu.to_dtype(DType::BF16).unwrap();
        assert_eq!((h.device(), h.dtype()), (cuda, DType::BF16));
        assert_eq!(h.to_f32_vec().unwrap(), vec![1.5, -2.0]);
        let empty = Tensor::from_vec(Vec::<u32>::new(), [0, 4], &cuda).unwrap();
        assert_eq!(empty.to_f32_vec().unwrap(), Vec::<f32>::new());
        let mixed = [
            gpu.clone(),
            Tensor::from_vec(vec![0f32; 2], [2], &Device::Cpu).unwrap(),
        ];
        assert!(Tensor::stack0(&mixed).is_err());
    }
}
