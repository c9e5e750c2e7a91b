//! Shaped, typed buffers. Tensors are immutable and cheap to clone (the storage is shared); kernels
//! produce new tensors.
//!
//! On CUDA, [`Tensor::reshape`] shares the storage, [`Tensor::index0`] and [`Tensor::stack0`] copy
//! device to device, [`Tensor::zeros`] and [`Tensor::full`] are memsets, and [`Tensor::to_dtype`]
//! goes through the host (download, convert, upload): this crate compiles no kernels. The device
//! cast is `fmoe_kernels::elementwise::to_dtype` (a CUDA kernel; on the CPU it is this
//! `to_dtype`), which is what the MoE layer uses. [`Tensor::cpu_slice`] and [`Tensor::cpu_storage`] are host-only:
//! on a CUDA tensor they return [`Error::DeviceMismatch`]; use [`Tensor::to_device`] or
//! [`Tensor::to_f32_vec`] to read device data.

use std::sync::Arc;

use crate::cuda::{CudaStorage, cuda_backend};
use crate::{DType, Device, Error, F8E4M3, Result, Shape, WithDType, bf16, f16};

/// Host memory, one variant per dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F8E4M3(Vec<F8E4M3>),
    U32(Vec<u32>),
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::F8E4M3(_) => DType::F8E4M3,
            CpuStorage::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::F8E4M3(v) => v.len(),
            CpuStorage::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element as f32 (exact for every dtype but u32 above 2^24).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        fn conv<T: WithDType>(v: &[T]) -> Vec<f32> {
            v.iter().map(|x| x.to_f32()).collect()
        }
        match self {
            CpuStorage::F32(v) => v.clone(),
            CpuStorage::BF16(v) => conv(v),
            CpuStorage::F16(v) => conv(v),
            CpuStorage::F8E4M3(v) => conv(v),
            CpuStorage::U32(v) => conv(v),
        }
    }

    pub(crate) fn from_f32_slice(v: &[f32], dtype: DType) -> CpuStorage {
        fn conv<T: WithDType>(v: &[f32]) -> CpuStorage {
            T::into_storage(v.iter().map(|&x| T::from_f32(x)).collect())
        }
        match dtype {
            DType::F32 => CpuStorage::F32(v.to_vec()),
            DType::BF16 => conv::<bf16>(v),
            DType::F16 => conv::<f16>(v),
            DType::F8E4M3 => conv::<F8E4M3>(v),
            DType::U32 => conv::<u32>(v),
        }
    }
}

/// Device memory. A backend adds a variant here; kernels match on it.
#[derive(Clone, Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => s.device(),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Debug)]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Shape,
}

impl Tensor {
    /// Wraps host data; `data.len()` must equal the shape's element count.
    pub fn from_vec<T: WithDType>(
        data: Vec<T>,
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        Tensor::from_cpu_storage(T::into_storage(data), shape, device)
    }

    pub fn from_cpu_storage(
        storage: CpuStorage,
        shape: impl Into<Shape>,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.checked_elem_count()? {
            return Err(Error::DataLength {
                op: "Tensor::from_vec",
                len: storage.len(),
                shape,
            });
        }
        let storage = match device {
            Device::Cpu => Storage::Cpu(storage),
            Device::Cuda(i) => Storage::Cuda(CudaStorage::from_cpu(&cuda_backend(*i)?, &storage)?),
        };
        Ok(Tensor {
            storage: Arc::new(storage),
            shape,
        })
    }

    /// Wraps storage a kernel produced; its length must equal the shape's element count.
    pub fn from_storage(storage: Storage, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if storage.len() != shape.checked_elem_count()? {
            return Err(Error::DataLength {
                op: "Tensor::from_storage",
                len: storage.len(),
                shape,
            });
        }
        Ok(Tensor {
            storage: Arc::new(storage),
            shape,
        })
    }

    /// Converts f32 data to `dtype` (round to nearest even; fp8 saturates) and wraps it.
    pub fn from_f32(
        data: &[f32],
        shape: impl Into<Shape>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        Tensor::from_cpu_storage(CpuStorage::from_f32_slice(data, dtype), shape, device)
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.checked_elem_count()?;
        match device {
            Device::Cpu => Tensor::from_f32(&vec![0.0; n], shape, dtype, device),
            Device::Cuda(i) => {
                let s = CudaStorage::zeros(&cuda_backend(*i)?, dtype, n)?;
                Tensor::from_storage(Storage::Cuda(s), shape)
            }
        }
    }

    /// A tensor of `value` (converted to `dtype` as [`Tensor::from_f32`] does). On CUDA one
    /// stream-ordered memset of the element's bit pattern: no host data, no synchronization.
    pub fn full(
        shape: impl Into<Shape>,
        dtype: DType,
        value: f32,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.checked_elem_count()?;
        match device {
            Device::Cpu => Tensor::from_f32(&vec![value; n], shape, dtype, device),
            Device::Cuda(i) => {
                let mut s = CudaStorage::alloc(&cuda_backend(*i)?, dtype, n)?;
                s.fill(value)?;
                Tensor::from_storage(Storage::Cuda(s), shape)
            }
        }
    }

    /// This tensor on `device`: the same tensor if it is already there, else a copy (host to
    /// device, device to host, or between two devices through the host).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        match self.storage.as_ref() {
            Storage::Cpu(s) => Tensor::from_cpu_storage(s.clone(), self.shape.clone(), &device),
            Storage::Cuda(s) => Tensor::from_cpu_storage(s.to_cpu()?, self.shape.clone(), &device),
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn elem_count(&self) -> usize {
        self.shape.elem_count()
    }
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }
    pub fn device(&self) -> Device {
        self.storage.device()
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    pub fn size_in_bytes(&self) -> usize {
        // The storage exists, so this fits; saturating keeps it panic-free regardless.
        self.elem_count()
            .saturating_mul(self.dtype().size_in_bytes())
    }

    /// Same storage, new shape with the same element count.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.checked_elem_count()? != self.elem_count() {
            return Err(Error::DataLength {
                op: "Tensor::reshape",
                len: self.elem_count(),
                shape,
            });
        }
        Ok(Tensor {
            storage: self.storage.clone(),
            shape,
        })
    }

    /// A copy of entry `i` along the first dimension (e.g. one expert of a stacked weight).
    pub fn index0(&self, i: usize) -> Result<Tensor> {
        const OP: &str = "Tensor::index0";
        let dims = self.dims();
        let Some((&n, rest)) = dims.split_first() else {
            return Err(Error::invalid(OP, "cannot index a rank-0 tensor"));
        };
        if i >= n {
            return Err(Error::invalid(
                OP,
                format!("index {i} out of range for dimension 0 of size {n}"),
            ));
        }
        let per: usize = rest.iter().product();
        fn part<T: WithDType>(v: &[T], r: std::ops::Range<usize>) -> CpuStorage {
            T::into_storage(v[r].to_vec())
        }
        let r = i * per..(i + 1) * per;
        let s = match self.storage.as_ref() {
            Storage::Cpu(s) => s,
            Storage::Cuda(s) => return Tensor::from_storage(Storage::Cuda(s.copy_range(r)?), rest),
        };
        let out = match s {
            CpuStorage::F32(v) => part(v, r),
            CpuStorage::BF16(v) => part(v, r),
            CpuStorage::F16(v) => part(v, r),
            CpuStorage::F8E4M3(v) => part(v, r),
            CpuStorage::U32(v) => part(v, r),
        };
        Tensor::from_cpu_storage(out, rest, &self.device())
    }

    /// Stacks equally shaped tensors of one dtype along a new first dimension.
    pub fn stack0(parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "Tensor::stack0";
        let Some(first) = parts.first() else {
            return Err(Error::invalid(OP, "nothing to stack"));
        };
        for (i, p) in parts.iter().enumerate() {
            p.expect_dims(OP, &format!("parts[{i}]"), first.dims())?;
            p.expect_dtype(OP, &format!("parts[{i}]"), &[first.dtype()])?;
            p.expect_device(OP, &format!("parts[{i}]"), first.device())?;
        }
        let mut dims = vec![parts.len()];
        dims.extend_from_slice(first.dims());
        if let Storage::Cuda(_) = first.storage() {
            let cuda: Vec<&CudaStorage> = parts
                .iter()
                .filter_map(|p| match p.storage() {
                    Storage::Cuda(s) => Some(s),
                    Storage::Cpu(_) => None,
                })
                .collect();
            return Tensor::from_storage(Storage::Cuda(CudaStorage::concat(&cuda)?), dims);
        }
        fn cat<T: WithDType>(parts: &[Tensor]) -> Result<CpuStorage> {
            let mut out = Vec::new();
            for p in parts {
                out.extend_from_slice(p.cpu_slice::<T>(OP, "part")?);
            }
            Ok(T::into_storage(out))
        }
        let storage = match first.dtype() {
            DType::F32 => cat::<f32>(parts)?,
            DType::BF16 => cat::<bf16>(parts)?,
            DType::F16 => cat::<f16>(parts)?,
            DType::F8E4M3 => cat::<F8E4M3>(parts)?,
            DType::U32 => cat::<u32>(parts)?,
        };
        Tensor::from_cpu_storage(storage, dims, &first.device())
    }

    /// Overwrites rows `dst_row..dst_row + rows` of this 2-D tensor `[R, W]` with the block of the
    /// 2-D `src` at rows `src_row..src_row + rows`, columns `src_col..src_col + W` (same dtype
    /// and device). The one in-place write on tensors, for buffers allocated once and filled
    /// over time (a KV-cache slab): it needs this tensor's storage unshared (no clone alive),
    /// else an error, so no other tensor ever sees the change. On CUDA one stream-ordered
    /// device-to-device copy (`cuMemcpy2DAsync`), no synchronization.
    pub fn copy_rows_from(
        &mut self,
        dst_row: usize,
        src: &Tensor,
        src_row: usize,
        src_col: usize,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "Tensor::copy_rows_from";
        let dst_dims = self
            .expect_rank(OP, "destination", 2, "[rows, width]")?
            .to_vec();
        let src_dims = src.expect_rank(OP, "source", 2, "[rows, width]")?;
        let (width, src_width) = (dst_dims[1], src_dims[1]);
        src.expect_dtype(OP, "source", &[self.dtype()])?;
        src.expect_device(OP, "source", self.device())?;
        if dst_row + rows > dst_dims[0]
            || src_row + rows > src_dims[0]
            || src_col + width > src_width
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "rows {src_row}..{} × columns {src_col}..{} of a {:?} source into rows {dst_row}..{} of a {dst_dims:?} destination: out of bounds",
                    src_row + rows,
                    src_col + width,
                    src_dims,
                    dst_row + rows
                ),
            ));
        }
        let shared = || {
            Error::invalid(
                OP,
                "the destination's storage is shared with another tensor (tensors are immutable)",
            )
        };
        let src_storage = src.storage.clone();
        let dst = Arc::get_mut(&mut self.storage).ok_or_else(shared)?;
        match (dst, src_storage.as_ref()) {
            (Storage::Cuda(d), Storage::Cuda(s)) => d.copy_2d_from(
                dst_row * width,
                width,
                s,
                src_row * src_width + src_col,
                src_width,
                rows,
                width,
            ),
            (Storage::Cpu(d), Storage::Cpu(s)) => {
                fn copy<T: Copy>(
                    d: &mut [T],
                    s: &[T],
                    (dst_row, src_row, src_col, rows, width, src_width): (
                        usize,
                        usize,
                        usize,
                        usize,
                        usize,
                        usize,
                    ),
                ) {
                    for r in 0..rows {
                        let from = (src_row + r) * src_width + src_col;
                        d[(dst_row + r) * width..][..width].copy_from_slice(&s[from..from + width]);
                    }
                }
                let g = (dst_row, src_row, src_col, rows, width, src_width);
                match (d, s) {
                    (CpuStorage::F32(d), CpuStorage::F32(s)) => copy(d, s, g),
                    (CpuStorage::BF16(d), CpuStorage::BF16(s)) => copy(d, s, g),
                    (CpuStorage::F16(d), CpuStorage::F16(s)) => copy(d, s, g),
                    (CpuStorage::F8E4M3(d), CpuStorage::F8E4M3(s)) => copy(d, s, g),
                    (CpuStorage::U32(d), CpuStorage::U32(s)) => copy(d, s, g),
                    _ => return Err(Error::invalid(OP, "dtypes differ")),
                }
                Ok(())
            }
            _ => Err(Error::invalid(OP, "devices differ")),
        }
    }

    /// The storage, for a kernel that writes into this tensor in place (a KV-cache slab). Like
    /// [`Tensor::copy_rows_from`], it needs the storage unshared (no clone alive), else an error
    /// naming `op`, so no other tensor ever sees the change.
    pub fn storage_mut(&mut self, op: &'static str) -> Result<&mut Storage> {
        Arc::get_mut(&mut self.storage).ok_or_else(|| {
            Error::invalid(
                op,
                "the destination's storage is shared with another tensor (tensors are immutable)",
            )
        })
    }

    /// Host slice of element type `T`; `op`/`name` go into the error if the dtype or device differ.
    pub fn cpu_slice<T: WithDType>(&self, op: &'static str, name: &str) -> Result<&[T]> {
        let s = self.cpu_storage(op, name)?;
        T::slice_of(s).ok_or_else(|| Error::DTypeMismatch {
            op,
            tensor: name.to_string(),
            expected: T::DTYPE.to_string(),
            got: self.dtype(),
        })
    }

    /// Host storage of any dtype; on another device an [`Error::DeviceMismatch`] naming `op` and
    /// `name`.
    pub fn cpu_storage(&self, op: &'static str, name: &str) -> Result<&CpuStorage> {
        match self.storage.as_ref() {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(s) => Err(Error::DeviceMismatch {
                op,
                tensor: name.to_string(),
                expected: Device::Cpu,
                got: s.device(),
            }),
        }
    }

    /// All elements as f32 (a copy; downloaded from a device).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        match self.storage.as_ref() {
            Storage::Cpu(s) => Ok(s.to_f32_vec()),
            Storage::Cuda(s) => Ok(s.to_cpu()?.to_f32_vec()),
        }
    }

    /// A copy converted to `dtype` (through f32). On CUDA this goes through the host (a
    /// synchronizing download and an upload); device code calls
    /// `fmoe_kernels::elementwise::to_dtype`, which casts on the device.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let v = self.to_f32_vec()?;
        Tensor::from_f32(&v, self.shape.clone(), dtype, &self.device())
    }

    /// Checks the dims, naming the op and tensor on failure.
    pub fn expect_dims(&self, op: &'static str, name: &str, dims: &[usize]) -> Result<()> {
        if self.dims() != dims {
            return Err(Error::ShapeMismatch {
                op,
                tensor: name.to_string(),
                expected: format!("{dims:?}"),
                got: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// Checks the rank, naming the op and tensor on failure; returns the dims.
    pub fn expect_rank(
        &self,
        op: &'static str,
        name: &str,
        rank: usize,
        what: &str,
    ) -> Result<&[usize]> {
        if self.shape.rank() != rank {
            return Err(Error::ShapeMismatch {
                op,
                tensor: name.to_string(),
                expected: format!("rank {rank} {what}"),
                got: self.shape.clone(),
            });
        }
        Ok(self.dims())
    }

    pub fn expect_dtype(&self, op: &'static str, name: &str, allowed: &[DType]) -> Result<DType> {
        let d = self.dtype();
        if !allowed.contains(&d) {
            let expected = allowed
                .iter()
                .map(|d| d.as_str())
                .collect::<Vec<_>>()
                .join(" or ");
            return Err(Error::DTypeMismatch {
                op,
                tensor: name.to_string(),
                expected,
                got: d,
            });
        }
        Ok(d)
    }

    pub fn expect_device(&self, op: &'static str, name: &str, device: Device) -> Result<()> {
        if self.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                tensor: name.to_string(),
                expected: device,
                got: self.device(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_vec_checks_length() {
        let err = Tensor::from_vec(vec![1.0f32; 5], [2, 3], &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("[2, 3]"), "{err}");
    }

    #[test]
    fn shapes_whose_element_count_overflows_are_errors() {
        // 2^58 × 64 wraps to 0 elements unchecked: an empty vector used to fill it.
        let huge = [1usize << 58, 64];
        for e in [
            Tensor::from_vec(Vec::<f32>::new(), huge, &Device::Cpu).unwrap_err(),
            Tensor::zeros(huge, DType::BF16, &Device::Cpu).unwrap_err(),
            Tensor::full(huge, DType::F32, 1.0, &Device::Cpu).unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(e.contains("overflows"), "{e}");
            assert!(e.contains(&format!("dim 0 {}", 1usize << 58)), "{e}");
        }
        let t = Tensor::zeros([4], DType::F32, &Device::Cpu).unwrap();
        let e = t.reshape(huge).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn dtype_checks_name_the_tensor() {
        let t = Tensor::zeros([2, 2], DType::BF16, &Device::Cpu).unwrap();
        let err = t
            .cpu_slice::<f32>("test_op", "w13")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("test_op") && err.contains("w13") && err.contains("bf16"),
            "{err}"
        );
        let err = t
            .expect_dims("test_op", "w2", &[3, 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("w2") && err.contains("[3, 2]") && err.contains("[2, 2]"),
            "{err}"
        );
    }

    #[test]
    fn index0_and_stack0_invert_each_other() {
        let t = Tensor::from_vec((0..12u32).collect::<Vec<_>>(), [3, 2, 2], &Device::Cpu).unwrap();
        let parts: Vec<Tensor> = (0..3).map(|i| t.index0(i).unwrap()).collect();
        assert_eq!(parts[1].cpu_slice::<u32>("t", "p").unwrap(), &[4, 5, 6, 7]);
        let back = Tensor::stack0(&parts).unwrap();
        assert_eq!(back.dims(), &[3, 2, 2]);
        assert_eq!(
            back.cpu_slice::<u32>("t", "b").unwrap(),
            t.cpu_slice::<u32>("t", "t").unwrap()
        );
        assert!(
            t.index0(3)
                .unwrap_err()
                .to_string()
                .contains("out of range")
        );
    }

    #[test]
    fn copy_rows_from_writes_a_column_block_in_place() {
        let src = Tensor::from_vec((0..12u32).collect::<Vec<_>>(), [3, 4], &Device::Cpu).unwrap();
        let mut dst = Tensor::zeros([4, 2], DType::U32, &Device::Cpu).unwrap();
        // Rows 1..3, columns 2..4 of src into rows 2..4 of dst.
        dst.copy_rows_from(2, &src, 1, 2, 2).unwrap();
        assert_eq!(
            dst.cpu_slice::<u32>("t", "d").unwrap(),
            &[0, 0, 0, 0, 6, 7, 10, 11]
        );
        let err = dst
            .copy_rows_from(3, &src, 0, 0, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("out of bounds"), "{err}");
        assert!(dst.copy_rows_from(0, &src, 0, 3, 1).is_err());
        let f = Tensor::zeros([3, 4], DType::F32, &Device::Cpu).unwrap();
        assert!(dst.copy_rows_from(0, &f, 0, 0, 1).is_err());
        // A clone alive: the write would be visible through it, so it is refused.
        let view = dst.clone();
        let err = dst
            .copy_rows_from(0, &src, 0, 0, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shared"), "{err}");
        drop(view);
        dst.copy_rows_from(0, &src, 0, 0, 1).unwrap();
        assert_eq!(&dst.cpu_slice::<u32>("t", "d").unwrap()[..2], &[0, 1]);
    }

    #[test]
    fn full_converts_the_value_once() {
        let t = Tensor::full([2, 3], DType::BF16, 1.0 / 3.0, &Device::Cpu).unwrap();
        let want = bf16::from_f32(1.0 / 3.0).to_f32();
        assert_eq!(t.to_f32_vec().unwrap(), vec![want; 6]);
        let u = Tensor::full([2], DType::U32, 7.0, &Device::Cpu).unwrap();
        assert_eq!(u.cpu_slice::<u32>("t", "u").unwrap(), &[7, 7]);
    }

    #[test]
    fn cuda_tensors_need_a_device() {
        // Without a GPU (here, CI) creating one is the one-line NoCuda error; with one, it works.
        match Tensor::zeros([1], DType::F32, &Device::Cuda(0)) {
            Ok(t) => assert_eq!(t.to_f32_vec().unwrap(), vec![0.0]),
            Err(e) => {
                let err = e.to_string();
                assert!(err.starts_with("no CUDA device/driver found: "), "{err}");
            }
        }
    }

    #[test]
    fn casts_round_trip_exactly_representable_values() {
        let v = vec![0.0f32, 1.0, -2.0, 0.5, 448.0];
        let t = Tensor::from_vec(v.clone(), [5], &Device::Cpu).unwrap();
        for d in DType::ALL.into_iter().filter(|d| *d != DType::U32) {
            assert_eq!(t.to_dtype(d).unwrap().to_f32_vec().unwrap(), v, "{d}");
        }
    }
}
