//! `elementwise`: the small device-side operations around the MoE GEMMs, each with its CPU twin.
//!
//! - [`to_dtype`]: cast through f32 with round-to-nearest-even (the layer's f32 → bf16 output).
//!   On the CPU it is [`Tensor::to_dtype`]; on CUDA a kernel, so a device tensor never makes a
//!   round trip through the host (`Tensor::to_dtype` itself lives in fmoe-core, which compiles no
//!   kernels, and downloads).
//! - [`add`]: `DT(f32(a) + f32(b))` (the shared expert's sum).
//! - [`randn`]: a counter-based normal fill from a seed (benchmark weights: 22.5 GB of DeepSeek-V3
//!   bf16 experts are written on the device in milliseconds instead of generated on the host and
//!   uploaded). Value `i` is a function of (seed, i) only, so any device and any launch geometry
//!   gives the same tensor (CPU and CUDA agree to a few f32 ulps: ln/cos/sqrt differ slightly).
//! - [`sum`]: the f32 sum of a tensor (the benchmark's read-bandwidth ceiling on CUDA).
//! - [`rand_uniform`]: a counter-based uniform fill, bit-identical on every device (the models'
//!   dummy weights, written on the GPU without a host copy).
//! - [`silu_mul`]: `silu(gate) · up` over `[M, 2I]` rows (the dense MLP's activation).
//! - copies that reshape the model's activations: [`gather_rows`] (embedding lookup),
//!   [`gather_rows_at`] (the same with ids uploaded once as a [`RowIndex`], for calls repeated
//!   every layer), [`narrow_cols`], [`narrow_rows`], [`concat_heads`] (per-head `[a_h | b_h]`,
//!   MLA's keys).
//!   They move elements unchanged, so they take every dtype (fp8 and u32 included).
//!
//! CUDA kernels: `cuda/elementwise.cu` and, for the copies, `cuda/copy.cu` (a strided row copy in
//! the widest word the geometry allows, up to 16 bytes). Dtypes on CUDA: f32, bf16 and f16 (fp8
//! and u32 casts are [`fmoe_core::Error::Unsupported`] there); [`sum`] on CUDA takes bf16.

mod copy;
mod cpu;
pub(crate) mod cuda;

pub(crate) fn cuda_variants() -> Vec<crate::catalog::KernelVariant> {
    let mut v = cuda::variants();
    v.extend(copy::cuda_variants());
    v
}

use fmoe_core::{DType, Device, Storage, Tensor};

use crate::{Error, Result};

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// A copy of `t` in `dtype` (the same tensor if it already is), on `t`'s device.
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "elementwise::to_dtype";
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    match t.storage() {
        Storage::Cpu(_) => Ok(t.to_dtype(dtype)?),
        Storage::Cuda(s) => {
            let out = cuda::cast(OP, s, dtype)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), t.shape().clone())?)
        }
    }
}

/// `a + b` elementwise, computed in f32 and rounded once to the operands' dtype (f32, bf16 or
/// f16; same dims, dtype and device).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "elementwise::add";
    let dtype = a.expect_dtype(OP, "a", &FLOATS)?;
    b.expect_dtype(OP, "b", &[dtype])?;
    b.expect_dims(OP, "b", a.dims())?;
    b.expect_device(OP, "b", a.device())?;
    match (a.storage(), b.storage()) {
        (Storage::Cuda(x), Storage::Cuda(y)) => {
            let out = cuda::add(OP, x, y)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), a.shape().clone())?)
        }
        _ => {
            let sum = cpu::add(&a.to_f32_vec()?, &b.to_f32_vec()?);
            Ok(Tensor::from_f32(
                &sum,
                a.shape().clone(),
                dtype,
                &Device::Cpu,
            )?)
        }
    }
}

/// A tensor of `scale · z_i`, `z_i` standard normal from (`seed`, flat index i), in `dtype`
/// (f32, bf16 or f16) on `device`. See the module docs for the generator.
pub fn randn(
    dims: &[usize],
    dtype: DType,
    scale: f32,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    const OP: &str = "elementwise::randn";
    if !FLOATS.contains(&dtype) {
        return Err(crate::Error::invalid(
            OP,
            format!("randn fills f32, bf16 or f16 tensors, not {dtype}"),
        ));
    }
    // Checked: dims can come from a config (dummy weights), and a wrapped count would make a
    // tiny buffer pass for a huge shape.
    let n = fmoe_core::Shape::from(dims).checked_elem_count()?;
    match device {
        Device::Cpu => Ok(Tensor::from_f32(
            &cpu::randn(n, scale, seed),
            dims,
            dtype,
            device,
        )?),
        Device::Cuda(i) => {
            let backend = fmoe_core::cuda::cuda_backend(*i)?;
            let out = cuda::randn(OP, &backend, dtype, n, scale, seed)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), dims)?)
        }
    }
}

/// A tensor of `offset + scale · u_i`, `u_i` uniform in [-1, 1) from (`seed`, flat index i), in
/// `dtype` (f32, bf16, f16 or fp8 e4m3, round to nearest even) on `device`: the dummy weights'
/// generator. Unlike [`randn`] the f32 value is computed exactly alike on every device (integer
/// hash, exact scaling to [-1, 1), one IEEE multiply and one add), so CPU and CUDA tensors are
/// bit-identical.
pub fn rand_uniform(
    dims: &[usize],
    dtype: DType,
    scale: f32,
    offset: f32,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    const OP: &str = "elementwise::rand_uniform";
    if !(FLOATS.contains(&dtype) || dtype == DType::F8E4M3) {
        return Err(Error::invalid(
            OP,
            format!("rand_uniform fills f32, bf16, f16 or f8e4m3 tensors, not {dtype}"),
        ));
    }
    let n = fmoe_core::Shape::from(dims).checked_elem_count()?;
    match device {
        Device::Cpu => Ok(Tensor::from_cpu_storage(
            cpu::rand_uniform(n, dtype, [scale, offset], seed),
            dims,
            device,
        )?),
        Device::Cuda(i) => {
            let backend = fmoe_core::cuda::cuda_backend(*i)?;
            let out = cuda::rand_uniform(OP, &backend, dtype, n, [scale, offset], seed)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), dims)?)
        }
    }
}

/// The sum of all elements, f32 `[1]`, on `t`'s device. The CPU adds in f64 and rounds once; the
/// CUDA kernel (bf16 input only) adds in f32 in an unspecified order.
pub fn sum(t: &Tensor) -> Result<Tensor> {
    const OP: &str = "elementwise::sum";
    t.expect_dtype(OP, "x", &FLOATS)?;
    match t.storage() {
        Storage::Cpu(_) => {
            let s = cpu::sum(&t.to_f32_vec()?);
            Ok(Tensor::from_vec(vec![s], [1], &Device::Cpu)?)
        }
        Storage::Cuda(s) => {
            let out = cuda::sum(OP, s)?;
            Ok(Tensor::from_storage(Storage::Cuda(out), [1])?)
        }
    }
}

/// silu(x[:, :I]) · x[:, I:] for x [M, 2I] → [M, I] (f32 math, one rounding).
pub fn silu_mul(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "elementwise::silu_mul";
    let dtype = x.expect_dtype(OP, "x", &FLOATS)?;
    let &[m, w] = x.expect_rank(OP, "x", 2, "[M, 2I]")? else {
        unreachable!("rank checked")
    };
    if w % 2 != 0 {
        return Err(Error::invalid(
            OP,
            format!("x is [{m}, {w}]: the width must be even (gate | up)"),
        ));
    }
    match x.storage() {
        Storage::Cuda(s) => Ok(Tensor::from_storage(
            Storage::Cuda(cuda::silu_mul(OP, s, m, w / 2)?),
            [m, w / 2],
        )?),
        Storage::Cpu(_) => {
            let y = cpu::silu_mul(&x.to_f32_vec()?, w / 2, dtype);
            Ok(Tensor::from_f32(&y, [m, w / 2], dtype, &Device::Cpu)?)
        }
    }
}

/// `[R, W]` of a rank-2 tensor, or a shape error naming `name`.
fn dims2(op: &'static str, name: &str, t: &Tensor, what: &str) -> Result<(usize, usize)> {
    let &[r, w] = t.expect_rank(op, name, 2, what)? else {
        unreachable!("rank checked")
    };
    Ok((r, w))
}

/// Embedding lookup: rows `ids` of table [V, H] → [ids.len(), H]; an id ≥ V is an error naming it.
pub fn gather_rows(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    const OP: &str = "elementwise::gather_rows";
    let (v, h) = dims2(OP, "table", table, "[V, H]")?;
    if let Some((i, &id)) = ids.iter().enumerate().find(|&(_, &id)| id as usize >= v) {
        return Err(Error::invalid(
            OP,
            format!("id {id} at position {i} is out of range for a table of {v} rows"),
        ));
    }
    let n = ids.len();
    let parts = [copy::Part {
        src: 0,
        rows: copy::Rows::Ids(ids),
        src_stride: h,
        src_offset: 0,
        blocks: 1,
        block_stride: 0,
        width: h,
        dst_offset: 0,
        dst_block_stride: 0,
    }];
    copy::run(OP, &[table], &parts, n, h)
}

/// Row indices uploaded once and read by many calls (every layer of a forward pass:
/// [`gather_rows_at`], [`crate::kv_cache::append_rows`]): u32 `[n]` on a device, with the bound
/// the host knew them by, so those calls validate without reading them back.
#[derive(Clone, Debug)]
pub struct RowIndex {
    ids: Tensor,
    /// One past the largest id (0 when there is none).
    end: usize,
}

impl RowIndex {
    /// `ids` on `device` (one host-to-device copy on CUDA).
    pub fn new(ids: &[u32], device: Device) -> Result<RowIndex> {
        let end = ids.iter().max().map_or(0, |&m| m as usize + 1);
        Ok(RowIndex {
            ids: Tensor::from_vec(ids.to_vec(), [ids.len()], &device)?,
            end,
        })
    }

    pub fn len(&self) -> usize {
        self.ids.elem_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn device(&self) -> Device {
        self.ids.device()
    }

    /// The ids, u32 `[n]`.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// Errors unless every id indexes one of `rows` rows of `what` on `device`.
    pub(crate) fn check_for(
        &self,
        op: &'static str,
        what: &str,
        rows: usize,
        device: Device,
    ) -> Result<()> {
        self.ids.expect_device(op, "ids", device)?;
        if self.end > rows {
            return Err(Error::invalid(
                op,
                format!(
                    "row id {} is out of range for `{what}` of {rows} rows",
                    self.end - 1
                ),
            ));
        }
        Ok(())
    }

    /// The copy kernel's view of the ids: host ids on the CPU, the device buffer on CUDA.
    fn rows(&self, op: &'static str) -> Result<copy::Rows<'_>> {
        Ok(match self.ids.storage() {
            Storage::Cpu(_) => copy::Rows::Ids(self.ids.cpu_slice::<u32>(op, "ids")?),
            Storage::Cuda(s) => copy::Rows::Uploaded(s),
        })
    }
}

/// [`gather_rows`] with ids uploaded beforehand: rows `ids` of table [V, H] → [ids.len(), H], on
/// the table's device (the ids' too); an id ≥ V is an error. No upload, one kernel on CUDA.
pub fn gather_rows_at(table: &Tensor, ids: &RowIndex) -> Result<Tensor> {
    const OP: &str = "elementwise::gather_rows_at";
    let (v, h) = dims2(OP, "table", table, "[V, H]")?;
    ids.check_for(OP, "table", v, table.device())?;
    let parts = [copy::Part {
        src: 0,
        rows: ids.rows(OP)?,
        src_stride: h,
        src_offset: 0,
        blocks: 1,
        block_stride: 0,
        width: h,
        dst_offset: 0,
        dst_block_stride: 0,
    }];
    copy::run(OP, &[table], &parts, ids.len(), h)
}

/// Columns start..start+len of 2-D x [M, W] → [M, len].
pub fn narrow_cols(x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    const OP: &str = "elementwise::narrow_cols";
    let (m, w) = dims2(OP, "x", x, "[M, W]")?;
    if start.checked_add(len).is_none_or(|end| end > w) {
        return Err(Error::invalid(
            OP,
            format!("columns {start}..{start}+{len} are out of range for x [{m}, {w}]"),
        ));
    }
    let parts = [copy::Part {
        src: 0,
        rows: copy::Rows::Range(0),
        src_stride: w,
        src_offset: start,
        blocks: 1,
        block_stride: 0,
        width: len,
        dst_offset: 0,
        dst_block_stride: 0,
    }];
    copy::run(OP, &[x], &parts, m, len)
}

/// Rows start..start+len of x [R, W] (on CUDA a device-to-device copy).
pub fn narrow_rows(x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
    const OP: &str = "elementwise::narrow_rows";
    let (r, w) = dims2(OP, "x", x, "[R, W]")?;
    if start.checked_add(len).is_none_or(|end| end > r) {
        return Err(Error::invalid(
            OP,
            format!("rows {start}..{start}+{len} are out of range for x [{r}, {w}]"),
        ));
    }
    match x.storage() {
        Storage::Cuda(s) => Ok(Tensor::from_storage(
            Storage::Cuda(s.copy_range(start * w..(start + len) * w)?),
            [len, w],
        )?),
        Storage::Cpu(_) => {
            let parts = [copy::Part {
                src: 0,
                rows: copy::Rows::Range(start),
                src_stride: w,
                src_offset: 0,
                blocks: 1,
                block_stride: 0,
                width: w,
                dst_offset: 0,
                dst_block_stride: 0,
            }];
            copy::run(OP, &[x], &parts, len, w)
        }
    }
}

/// Per-head concatenation: a [R, heads·da], b [R, hb·db] with hb ∈ {1, heads} (1 = one b row part
/// shared by every head) → [R, heads·(da+db)], head h = [a_h | b_h]. heads = 1 is a plain column concat.
///
/// A rank-2 b `[R, db]` is the shared part (hb = 1: MLA's rotated key, the same for every head);
/// per-head parts are passed as rank 3, b `[R, heads, db]` (a free [`Tensor::reshape`]), because
/// `[R, heads·db]` alone cannot be told apart from a shared part of width heads·db. A rank-3
/// `[R, 1, db]` is shared too.
pub fn concat_heads(a: &Tensor, b: &Tensor, heads: usize) -> Result<Tensor> {
    const OP: &str = "elementwise::concat_heads";
    let (r, wa) = dims2(OP, "a", a, "[R, heads·da]")?;
    b.expect_dtype(OP, "b", &[a.dtype()])?;
    b.expect_device(OP, "b", a.device())?;
    if heads == 0 || wa % heads != 0 {
        return Err(Error::invalid(
            OP,
            format!("a is [{r}, {wa}]: its width is not heads·da for heads = {heads}"),
        ));
    }
    let da = wa / heads;
    let (hb, db) = match *b.dims() {
        [br, db] if br == r => (1, db),
        [br, hb, db] if br == r && (hb == 1 || hb == heads) => (hb, db),
        _ => {
            return Err(fmoe_core::Error::ShapeMismatch {
                op: OP,
                tensor: "b".into(),
                expected: format!("[{r}, db] (shared) or [{r}, 1 or {heads}, db]"),
                got: b.shape().clone(),
            }
            .into());
        }
    };
    let out_w = heads * (da + db);
    let parts = [
        copy::Part {
            src: 0,
            rows: copy::Rows::Range(0),
            src_stride: wa,
            src_offset: 0,
            blocks: heads,
            block_stride: da,
            width: da,
            dst_offset: 0,
            dst_block_stride: da + db,
        },
        copy::Part {
            src: 1,
            rows: copy::Rows::Range(0),
            src_stride: hb * db,
            src_offset: 0,
            blocks: heads,
            block_stride: if hb == 1 { 0 } else { db },
            width: db,
            dst_offset: da,
            dst_block_stride: da + db,
        },
    ];
    copy::run(OP, &[a, b], &parts, r, out_w)
}

/// The CPU twin's normal value `i` of `seed` (what [`randn`] writes before scaling and rounding).
pub fn normal_at(seed: u64, i: u64) -> f32 {
    cpu::normal(seed, i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_rows_at_is_gather_rows_with_ids_uploaded_once() {
        let cpu = Device::Cpu;
        let v: Vec<f32> = (0..5 * 3).map(|i| i as f32).collect();
        let table = Tensor::from_f32(&v, [5, 3], DType::BF16, &cpu).unwrap();
        let ids = [4u32, 0, 4, 2];
        let index = RowIndex::new(&ids, cpu).unwrap();
        assert_eq!((index.len(), index.device()), (4, cpu));
        let got = gather_rows_at(&table, &index).unwrap();
        let want = gather_rows(&table, &ids).unwrap();
        assert_eq!(got.dims(), &[4, 3]);
        assert_eq!(got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
        let short = Tensor::zeros([4, 3], DType::BF16, &cpu).unwrap();
        let e = gather_rows_at(&short, &index).unwrap_err().to_string();
        assert!(e.contains("row id 4") && e.contains("4 rows"), "{e}");
        let empty = RowIndex::new(&[], cpu).unwrap();
        assert_eq!(gather_rows_at(&short, &empty).unwrap().dims(), &[0, 3]);
    }

    #[test]
    fn randn_is_standard_normal_and_reproducible() {
        let t = randn(&[100_000], DType::F32, 1.0, 7, &Device::Cpu).unwrap();
        let v = t.to_f32_vec().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.03, "var {var}");
        assert!(v.iter().all(|x| x.is_finite()));
        let again = randn(&[100_000], DType::F32, 1.0, 7, &Device::Cpu).unwrap();
        assert_eq!(again.to_f32_vec().unwrap(), v);
        let other = randn(&[100_000], DType::F32, 1.0, 8, &Device::Cpu).unwrap();
        assert_ne!(other.to_f32_vec().unwrap(), v);
        // Scale and dtype: bf16 of scale·z.
        let b = randn(&[1000], DType::BF16, 0.5, 7, &Device::Cpu).unwrap();
        let want: Vec<f32> = v[..1000]
            .iter()
            .map(|&z| fmoe_core::bf16::from_f32(0.5 * z).to_f32())
            .collect();
        assert_eq!(b.to_f32_vec().unwrap(), want);
        assert!(randn(&[2], DType::U32, 1.0, 0, &Device::Cpu).is_err());
    }

    #[test]
    fn add_rounds_once_and_checks_operands() {
        let a = Tensor::from_f32(&[1.0, 2.0, 1.0 / 3.0], [3], DType::BF16, &Device::Cpu).unwrap();
        let b = Tensor::from_f32(&[0.5, -2.0, 1.0 / 3.0], [3], DType::BF16, &Device::Cpu).unwrap();
        let s = add(&a, &b).unwrap();
        assert_eq!(s.dtype(), DType::BF16);
        let third = fmoe_core::bf16::from_f32(1.0 / 3.0).to_f32();
        assert_eq!(
            s.to_f32_vec().unwrap(),
            vec![1.5, 0.0, fmoe_core::bf16::from_f32(third + third).to_f32()]
        );
        let c = Tensor::from_f32(&[1.0, 2.0], [2], DType::BF16, &Device::Cpu).unwrap();
        assert!(add(&a, &c).unwrap_err().to_string().contains("`b`"));
        let d = a.to_dtype(DType::F32).unwrap();
        assert!(add(&a, &d).is_err());
    }

    #[test]
    fn sum_and_to_dtype_on_the_cpu() {
        let t = Tensor::from_vec(vec![1.0f32, 2.5, -0.5], [3], &Device::Cpu).unwrap();
        assert_eq!(sum(&t).unwrap().to_f32_vec().unwrap(), vec![3.0]);
        let h = to_dtype(&t, DType::F16).unwrap();
        assert_eq!(h.dtype(), DType::F16);
        assert_eq!(h.to_f32_vec().unwrap(), vec![1.0, 2.5, -0.5]);
    }

    fn iota(r: usize, w: usize, dtype: DType) -> Tensor {
        let v: Vec<f32> = (0..r * w).map(|i| i as f32).collect();
        Tensor::from_f32(&v, [r, w], dtype, &Device::Cpu).unwrap()
    }

    #[test]
    fn silu_mul_rounds_once() {
        let x = Tensor::from_f32(
            &[1.0, -2.0, 0.5, 3.0, 0.0, 7.0, -1.0, 2.0],
            [2, 4],
            DType::BF16,
            &Device::Cpu,
        )
        .unwrap();
        let y = silu_mul(&x).unwrap();
        assert_eq!(y.dims(), &[2, 2]);
        let s = |v: f64| v / (1.0 + (-v).exp());
        let want = [s(1.0) * 0.5, s(-2.0) * 3.0, 0.0, s(7.0) * 2.0];
        for (g, w) in y.to_f32_vec().unwrap().iter().zip(want) {
            assert_eq!(*g, fmoe_core::bf16::from_f64(w).to_f32(), "{w}");
        }
        assert!(silu_mul(&iota(2, 3, DType::F32)).is_err());
        let empty = silu_mul(&iota(0, 4, DType::F32)).unwrap();
        assert_eq!(empty.dims(), &[0, 2]);
    }

    #[test]
    fn copies_move_the_right_elements_in_every_dtype() {
        for dtype in [
            DType::F32,
            DType::BF16,
            DType::F16,
            DType::F8E4M3,
            DType::U32,
        ] {
            // Values 0..r·w are exact in every dtype for small r·w (fp8: below 16).
            let t = iota(5, 3, dtype);
            let v = t.to_f32_vec().unwrap();
            let g = gather_rows(&t, &[4, 0, 4]).unwrap();
            assert_eq!(g.dtype(), dtype);
            let want: Vec<f32> = [4, 0, 4]
                .iter()
                .flat_map(|&r| v[r * 3..r * 3 + 3].to_vec())
                .collect();
            assert_eq!(g.to_f32_vec().unwrap(), want);
            let nc = narrow_cols(&t, 1, 2).unwrap();
            let want: Vec<f32> = (0..5)
                .flat_map(|r| v[r * 3 + 1..r * 3 + 3].to_vec())
                .collect();
            assert_eq!(nc.to_f32_vec().unwrap(), want);
            let nr = narrow_rows(&t, 3, 2).unwrap();
            assert_eq!(nr.dims(), &[2, 3]);
            assert_eq!(nr.to_f32_vec().unwrap(), v[9..15].to_vec());
        }
        let t = iota(2, 3, DType::F32);
        let msg = gather_rows(&t, &[0, 2]).unwrap_err().to_string();
        assert!(
            msg.contains("id 2 at position 1") && msg.contains("2 rows"),
            "{msg}"
        );
        assert!(narrow_cols(&t, 2, 2).is_err());
        assert!(narrow_rows(&t, 1, 2).is_err());
        assert_eq!(gather_rows(&t, &[]).unwrap().dims(), &[0, 3]);
    }

    #[test]
    fn concat_heads_per_head_and_shared() {
        let (r, heads, da, db) = (3, 2, 3, 2);
        let a = iota(r, heads * da, DType::F32);
        let bv: Vec<f32> = (0..r * heads * db).map(|i| 100.0 + i as f32).collect();
        let (av, cpu) = (a.to_f32_vec().unwrap(), Device::Cpu);
        let per_head = Tensor::from_vec(bv.clone(), [r, heads, db], &cpu).unwrap();
        let y = concat_heads(&a, &per_head, heads).unwrap();
        assert_eq!(y.dims(), &[r, heads * (da + db)]);
        let y = y.to_f32_vec().unwrap();
        let shared = Tensor::from_vec(bv[..r * db].to_vec(), [r, db], &cpu).unwrap();
        let ys = concat_heads(&a, &shared, heads)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        for row in 0..r {
            for h in 0..heads {
                let o = row * heads * (da + db) + h * (da + db);
                assert_eq!(&y[o..o + da], &av[row * heads * da + h * da..][..da]);
                assert_eq!(
                    &y[o + da..o + da + db],
                    &bv[row * heads * db + h * db..][..db]
                );
                assert_eq!(&ys[o..o + da], &av[row * heads * da + h * da..][..da]);
                assert_eq!(&ys[o + da..o + da + db], &bv[row * db..][..db]);
            }
        }
        // heads = 1: a plain column concatenation.
        let plain = concat_heads(&a, &shared, 1).unwrap().to_f32_vec().unwrap();
        for row in 0..r {
            let o = row * (heads * da + db);
            assert_eq!(
                &plain[o..o + heads * da],
                &av[row * heads * da..][..heads * da]
            );
            assert_eq!(
                &plain[o + heads * da..o + heads * da + db],
                &bv[row * db..][..db]
            );
        }
        assert!(concat_heads(&a, &shared, 4).is_err());
        let bad = Tensor::from_vec(bv.clone(), [r, 3, 4], &cpu);
        assert!(bad.is_err() || concat_heads(&a, &bad.unwrap(), heads).is_err());
        let b16 = shared.to_dtype(DType::BF16).unwrap();
        assert!(
            concat_heads(&a, &b16, heads)
                .unwrap_err()
                .to_string()
                .contains("`b`")
        );
    }

    #[test]
    fn rand_uniform_is_the_documented_hash() {
        // An independent spelling of the generator (splitmix64's finalizer over seed ^ i·φ).
        let u = |seed: u64, i: u64| {
            let mut z = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f64 / 8_388_608.0 - 1.0) as f32
        };
        let t = rand_uniform(&[3, 5], DType::F32, 0.5, 1.0, 42, &Device::Cpu).unwrap();
        let v = t.to_f32_vec().unwrap();
        for (i, x) in v.iter().enumerate() {
            assert_eq!(*x, 1.0 + 0.5 * u(42, i as u64));
        }
        let q = rand_uniform(&[15], DType::F8E4M3, 0.5, 1.0, 42, &Device::Cpu).unwrap();
        let want = Tensor::from_f32(&v, [15], DType::F8E4M3, &Device::Cpu).unwrap();
        assert_eq!(q.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
        assert!(rand_uniform(&[2], DType::U32, 1.0, 0.0, 0, &Device::Cpu).is_err());
    }
}
