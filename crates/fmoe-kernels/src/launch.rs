//! Small helpers shared by the CUDA twins: argument conversion with errors instead of truncation,
//! grid sizes for grid-stride kernels, access to a tensor's device storage, and the shared-memory
//! opt-in of the big-tile kernels, and [`PdlLaunch`], the launch of the MoE layer's kernel chain
//! with Programmatic Dependent Launch (`FMOE_DEV_PDL`).

use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use fmoe_core::cuda::cudarc::driver::sys::{self, CUfunction_attribute};
use fmoe_core::cuda::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig,
};
use fmoe_core::cuda::{CudaBackend, CudaStorage, cuda_error};
use fmoe_core::{Device, Storage, Tensor};

use crate::{Error, Result};

/// Dynamic shared memory a block may use without opting in (`cuFuncSetAttribute`).
const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

/// Lets `f` launch with `bytes` of dynamic shared memory (a no-op up to the default 48 KiB);
/// `what` names the kernel in the error.
pub(crate) fn opt_in_smem(f: &CudaFunction, bytes: u32, what: &'static str) -> Result<()> {
    if bytes > DEFAULT_SMEM_LIMIT {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| cuda_error(what, e))?;
    }
    Ok(())
}

/// Threads per block of the grid-stride elementwise kernels.
pub(crate) const ELEMENTWISE_THREADS: u32 = 256;

/// Most blocks a grid-stride kernel is launched with: a few waves on any current GPU (132 SMs on
/// an H200); more blocks only add scheduling work.
pub(crate) const MAX_GRID_STRIDE_BLOCKS: usize = 4096;

/// Blocks for a grid-stride loop over `n` items, `per_block` items per block per pass (at least 1
/// block, so a launch over nothing is still valid).
pub(crate) fn grid_stride_blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block.max(1))
        .clamp(1, MAX_GRID_STRIDE_BLOCKS) as u32
}

/// `v` as a kernel's `unsigned int`, or an error naming what overflowed.
pub(crate) fn u32_arg(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::invalid(
            op,
            format!("{what} = {v} exceeds the CUDA kernel's 32-bit range"),
        )
    })
}

/// The device storage of `t`, or a device-mismatch error naming `op` and `name`.
pub(crate) fn cuda_storage<'a>(
    op: &'static str,
    name: &str,
    t: &'a Tensor,
    device: Device,
) -> Result<&'a CudaStorage> {
    t.expect_device(op, name, device)?;
    match t.storage() {
        Storage::Cuda(s) => Ok(s),
        Storage::Cpu(_) => Err(fmoe_core::Error::DeviceMismatch {
            op,
            tensor: name.to_string(),
            expected: device,
            got: Device::Cpu,
        }
        .into()),
    }
}

/// Environment switch of Programmatic Dependent Launch for the MoE layer's kernel chain.
pub const FMOE_DEV_PDL: &str = fmoe_core::env::FMOE_DEV_PDL;

/// `FMOE_DEV_PDL` (parsed once per process with the other developer overrides,
/// [`fmoe_core::env::DevOverrides`]; default on: it measured 2-3.6 % faster at M = 1-2 for the fp8
/// methods under graph replay on an H200 and neutral elsewhere, decisions D-037, D-038): the
/// switch, or the overrides' error naming the variable and its value. [`PdlChain::enter`] reads
/// it on every device, so a bad value (of any `FMOE_DEV_*`) is an error on the CPU too; the CLI
/// calls it at start-up.
pub fn pdl_switch() -> Result<bool> {
    Ok(crate::dev::checked(None)?.pdl)
}

/// Whether Programmatic Dependent Launch may be used on `backend`: `FMOE_DEV_PDL` (default on)
/// and a device of compute capability 9.0 or newer (`griddepcontrol`).
pub(crate) fn pdl_enabled(backend: &CudaBackend) -> Result<bool> {
    Ok(pdl_switch()? && backend.compute_capability().0 >= 9)
}

/// Largest batch (tokens) whose MoE kernel chain launches with Programmatic Dependent Launch.
/// On the H200 (decision D-038) PDL made the fp8 chain 1.5-3 % faster
/// at M = 1-2, tied at M = 4 and was 0.5-1 % slower at M = 16, where the chain's kernels are long
/// enough to hide the launch gap and the PDL builds' waits only cost; above 4 tokens the plain
/// kernels (no wait, no laundered pointers) run as before.
pub const PDL_MAX_TOKENS: usize = 4;

thread_local! {
    /// Whether the MoE chain being launched on this thread uses PDL (set by [`PdlChain`]).
    static CHAIN_PDL: Cell<bool> = const { Cell::new(false) };
}

/// Scope of one MoE layer's kernel chain on the calling thread: while it lives, the chain's
/// launches (align, activation quantizations, grouped GEMMs, zero fills, finalize, cast) use the
/// `-D PDL=1` build of their kernels and Programmatic Dependent Launch if the batch has at most
/// [`PDL_MAX_TOKENS`] tokens, the device is CUDA of compute capability ≥ 9.0 and `FMOE_DEV_PDL`
/// is not off. Outside a scope, or when not chosen, every kernel launches plain, as without PDL.
/// Dropping it restores the enclosing scope's choice.
#[must_use = "the chain uses PDL only while the scope lives"]
pub struct PdlChain {
    prev: bool,
}

impl PdlChain {
    /// Enters the scope of a chain on `device` for a batch of `tokens` rows. Errors: an invalid
    /// `FMOE_DEV_PDL`, or no backend for a CUDA device.
    pub fn enter(device: Device, tokens: usize) -> Result<PdlChain> {
        // Read on every device: an invalid value is an error wherever the chain runs.
        let switch = pdl_switch()?;
        let on = match device {
            Device::Cuda(ordinal) if switch && tokens <= PDL_MAX_TOKENS => {
                let backend = fmoe_core::cuda::cuda_backend(ordinal)?;
                pdl_enabled(&backend)?
            }
            _ => false,
        };
        Ok(PdlChain {
            prev: CHAIN_PDL.with(|c| c.replace(on)),
        })
    }

    /// Whether launches in the current scope use PDL.
    pub fn active() -> bool {
        CHAIN_PDL.with(Cell::get)
    }
}

impl Drop for PdlChain {
    fn drop(&mut self) {
        CHAIN_PDL.with(|c| c.set(self.prev));
    }
}

/// The define that selects a kernel's PDL build (`cuda/common/pdl.cuh`).
pub(crate) fn pdl_define() -> (&'static str, String) {
    ("PDL", "1".to_string())
}

/// Loads a kernel of the MoE chain: its `-D PDL=1` build when the current [`PdlChain`] uses PDL,
/// the plain one otherwise. Returns whether it is the PDL build, for [`PdlLaunch::new`].
pub(crate) fn load_chain(
    backend: &Arc<CudaBackend>,
    family: &'static str,
    source: &'static str,
    entry: &str,
    defines: &[(&'static str, String)],
) -> Result<(CudaFunction, bool)> {
    let pdl = PdlChain::active();
    let f = if pdl {
        let mut d = defines.to_vec();
        d.push(pdl_define());
        crate::nvrtc::load(backend, family, source, entry, &d)?
    } else {
        crate::nvrtc::load(backend, family, source, entry, defines)?
    };
    Ok((f, pdl))
}

/// One kernel argument of a [`PdlLaunch`]: a pointer to a value the caller keeps alive, or a
/// device address held here.
pub(crate) enum Param<'a> {
    Ref(*mut c_void, PhantomData<&'a ()>),
    Addr(Box<u64>),
}

impl<'a> Param<'a> {
    /// A value the kernel takes by value (plain data, e.g. a tensor map), borrowed for the launch.
    pub(crate) fn value<T>(v: &'a T) -> Param<'a> {
        Param::Ref((v as *const T).cast_mut().cast(), PhantomData)
    }
}

/// A kernel argument [`PdlLaunch::arg`] accepts: the plain values and device buffers of the
/// kernel chain (concrete types: a blanket impl over cudarc's `DeviceRepr` would overlap).
pub(crate) trait PdlArg<'a> {
    fn param(self, stream: &CudaStream) -> Param<'a>;
}

macro_rules! pdl_value_arg {
    ($($t:ty),*) => {$(
        impl<'a> PdlArg<'a> for &'a $t {
            fn param(self, _: &CudaStream) -> Param<'a> {
                Param::value(self)
            }
        }
    )*};
}
pdl_value_arg!(u32, i32, u64, f32, sys::CUtensorMap);

impl<'a, T> PdlArg<'a> for &'a CudaSlice<T> {
    fn param(self, stream: &CudaStream) -> Param<'a> {
        let (ptr, _sync) = self.device_ptr(stream);
        Param::Addr(Box::new(ptr))
    }
}

impl<'a, T> PdlArg<'a> for &'a mut CudaSlice<T> {
    fn param(self, stream: &CudaStream) -> Param<'a> {
        let (ptr, _sync) = self.device_ptr_mut(stream);
        Param::Addr(Box::new(ptr))
    }
}

impl<'a, 'b: 'a, T> PdlArg<'a> for &'a CudaView<'b, T> {
    fn param(self, stream: &CudaStream) -> Param<'a> {
        let (ptr, _sync) = self.device_ptr(stream);
        Param::Addr(Box::new(ptr))
    }
}

/// The launch of a kernel of the MoE layer's chain (align, activation quantizations, grouped
/// GEMMs, zero fills, finalize, cast) on the backend's stream: as cudarc's `launch_builder`, with
/// Programmatic Dependent Launch when `pdl` (the kernel's PDL build, from [`load_chain`]). The
/// kernel may then start while the previous kernel of the stream still runs; its PDL build
/// begins with `fmoe_pdl_enter()` (`cuda/common/pdl.cuh`), which waits for the previous kernel to
/// complete before it touches anything the chain writes. A captured graph keeps the launch as a
/// programmatic edge. Without `pdl` a plain launch.
pub(crate) struct PdlLaunch<'a> {
    backend: &'a CudaBackend,
    func: &'a CudaFunction,
    pdl: bool,
    params: Vec<Param<'a>>,
}

impl<'a> PdlLaunch<'a> {
    pub(crate) fn new(backend: &'a CudaBackend, func: &'a CudaFunction, pdl: bool) -> Self {
        PdlLaunch {
            backend,
            func,
            pdl,
            params: Vec::new(),
        }
    }

    pub(crate) fn arg<A: PdlArg<'a>>(&mut self, a: A) -> &mut Self {
        let p = a.param(self.backend.stream());
        self.params.push(p);
        self
    }

    /// Launches with `cfg`.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments match the kernel's parameters in order and
    /// type and every pointer is valid for what the kernel does with it; with `pdl`, `func` is
    /// the kernel's `-D PDL=1` build, which begins with `fmoe_pdl_enter()`.
    pub(crate) unsafe fn launch(
        &mut self,
        cfg: LaunchConfig,
    ) -> std::result::Result<(), DriverError> {
        let pdl = self.pdl;
        let mut params: Vec<*mut c_void> = self
            .params
            .iter_mut()
            .map(|p| match p {
                Param::Ref(ptr, _) => *ptr,
                Param::Addr(b) => (&mut **b as *mut u64).cast(),
            })
            .collect();
        // SAFETY: an all-zero launch attribute is a valid value of the plain-data union.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.backend.stream().cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        self.backend.context().bind_to_thread()?;
        // SAFETY: `config`, `attr` and `params` (pointing at values borrowed for 'a or boxed in
        // self.params) outlive the call, which copies the values; the caller vouches for the
        // arguments and the kernel.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large batches and the CPU never use PDL (no backend needed to decide), and a scope
    /// restores the enclosing choice when dropped.
    #[test]
    fn pdl_chain_only_for_small_cuda_batches() {
        assert!(!PdlChain::active());
        {
            let _outer = PdlChain::enter(Device::Cpu, 1).unwrap();
            assert!(!PdlChain::active());
            let _big = PdlChain::enter(Device::Cuda(0), PDL_MAX_TOKENS + 1).unwrap();
            assert!(!PdlChain::active());
        }
        CHAIN_PDL.with(|c| c.set(true));
        {
            let _big = PdlChain::enter(Device::Cuda(0), PDL_MAX_TOKENS + 1).unwrap();
            assert!(!PdlChain::active());
        }
        assert!(
            PdlChain::active(),
            "dropping the scope restores the enclosing choice"
        );
        CHAIN_PDL.with(|c| c.set(false));
    }
}
