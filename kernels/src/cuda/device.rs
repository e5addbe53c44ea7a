//! The device: context, stream, compiled kernels, cuBLAS, and **safe** wrappers for every
//! launch. Each wrapper checks every buffer length, dtype and shape it relies on before
//! launching (returning [`CudaError::Shape`] otherwise); indices read from device memory come
//! only from a [`DeviceStep`], whose contents were validated on the host by
//! [`StepBuilder`](super::host::StepBuilder). That is what makes the `unsafe` launches sound.
//!
//! One stream per device, used in order; cudarc's per-buffer event tracking is disabled (it
//! only matters with several streams and costs two events per launch argument).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cudarc::cublas::{CudaBlas, result as blas_result, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits, sys as dsys,
};
use cudarc::nvrtc::Ptx;
pub use half::bf16;

use super::error::CudaError;
use super::host::{StepBuilder, StepGeometry, StepLayout, plan_splits};
use super::nvrtc::{CudaLibrary, arch_for, compiled_modules, ensure_library, nvrtc_version};
use super::source::consts::{FA_KT, FA_MAX_HD, FA_MAX_ROWS, FA_THREADS, SAMPLE_THREADS};

/// Environment variable: `1` synchronises after every launch, so an asynchronous fault is
/// reported with the name of the kernel that caused it (slow; for debugging and GPU tests).
pub const SYNC_EACH_LAUNCH_ENV: &str = "ZEROLAYER_CUDA_SYNC";
/// Default dynamic shared memory per block without opting in (all CUDA GPUs since Kepler).
pub const DEFAULT_SMEM_BYTES: usize = 48 * 1024;
/// Threads of the row-wise kernels (norms, embedding, RoPE): a multiple of 32 (the lane-scheme
/// reductions use whole warps) that keeps several blocks per multiprocessor.
const ROW_THREADS: u32 = 256;
/// Threads of the exact attention kernel (8 half-warps computing scores).
const EXACT_ATTENTION_THREADS: u32 = 128;
/// Threads of the exact matmul kernel: 16 half-warps = 16 output columns per block.
const MATMUL_THREADS: u32 = 256;
/// Largest grid.y / grid.z.
const MAX_GRID_YZ: usize = 65_535;
/// Grid size of grid-stride element-wise kernels (≥ 8 blocks per multiprocessor on any GPU).
const ELEMENTWISE_BLOCKS: usize = 4096;

/// Element types of device buffers.
pub trait DeviceElem:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static
{
}
impl DeviceElem for f32 {}
impl DeviceElem for u32 {}
impl DeviceElem for bf16 {}

/// Floating-point storage type of weights, activations and the KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision (the exact mode).
    F32,
    /// bfloat16 (8-bit mantissa; f32 accumulation everywhere).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    /// Lower-case name (`f32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// A device allocation of `len` elements (plain device memory, zero-initialised).
pub struct DeviceBuffer<T> {
    /// The allocation (at least one element, so every buffer has a valid address).
    slice: CudaSlice<T>,
    /// Elements the caller asked for.
    len: usize,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl<T> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A buffer of f32 or bf16 elements.
#[derive(Debug)]
pub enum FloatBuffer {
    /// f32 elements.
    F32(DeviceBuffer<f32>),
    /// bf16 elements.
    Bf16(DeviceBuffer<bf16>),
}

impl FloatBuffer {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            FloatBuffer::F32(_) => DType::F32,
            FloatBuffer::Bf16(_) => DType::Bf16,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            FloatBuffer::F32(b) => b.len,
            FloatBuffer::Bf16(b) => b.len,
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A row-major `[rows][cols]` weight matrix on the device.
#[derive(Debug)]
pub struct Matrix {
    /// Elements (exactly `rows × cols`).
    buf: FloatBuffer,
    /// Output features.
    rows: usize,
    /// Input features (the reduction length).
    cols: usize,
}

impl Matrix {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    /// The elements, for filling (`upload_f32`, `dummy_fill`).
    pub fn buffer_mut(&mut self) -> &mut FloatBuffer {
        &mut self.buf
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        (self.rows * self.cols * self.dtype().size()) as u64
    }
}

/// Model shapes the kernels need; [`ModelDims::validate`] is called by every wrapper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelDims {
    /// Residual width.
    pub dim: usize,
    /// SwiGLU width.
    pub hidden_dim: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Context length.
    pub max_seq_len: usize,
}

impl ModelDims {
    /// Width of a head.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads.max(1)
    }

    /// Width of the K (and V) projection.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim()
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads.max(1)
    }

    /// Width of a fused q|k|v row.
    pub fn qkv_width(&self) -> usize {
        self.dim + 2 * self.kv_dim()
    }

    /// Checks the shape relations the kernels' index arithmetic relies on, and that every
    /// size passed as an `int` fits.
    pub fn validate(&self) -> Result<(), CudaError> {
        let bad = |d: String| Err(CudaError::shape("model dims", d));
        if self.dim == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.hidden_dim == 0 {
            return bad(format!("zero-sized model {self:?}"));
        }
        if !self.dim.is_multiple_of(self.n_heads)
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            return bad(format!("inconsistent heads {self:?}"));
        }
        let limit = i32::MAX as usize / 4;
        for (name, v) in [
            ("dim", self.qkv_width()),
            ("hidden_dim", 2 * self.hidden_dim),
            ("vocab_size", self.vocab_size),
            ("max_seq_len", self.max_seq_len),
        ] {
            if v > limit {
                return bad(format!("{name} {v} exceeds {limit}"));
            }
        }
        Ok(())
    }
}

/// The paged KV pool: per K and V one allocation `[n_layers][num_blocks][block_size][kv_dim]`
/// (the CPU backend's per-layer layout and block ids), allocated once.
#[derive(Debug)]
pub struct KvPool {
    /// Keys.
    k: FloatBuffer,
    /// Values.
    v: FloatBuffer,
    /// Layers.
    n_layers: usize,
    /// Blocks per layer.
    num_blocks: usize,
    /// Positions per block.
    block_size: usize,
    /// Elements per position.
    kv_dim: usize,
}

impl KvPool {
    /// Elements of one layer of K (or V).
    pub fn layer_len(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_dim
    }

    /// Storage type.
    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }

    /// Bytes of K and V together.
    pub fn bytes(&self) -> u64 {
        2 * (self.n_layers * self.layer_len() * self.dtype().size()) as u64
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Checks that the pool fits a step's geometry and the model.
    fn check(
        &self,
        op: &'static str,
        g: &StepGeometry,
        dims: &ModelDims,
        layer: usize,
    ) -> Result<(), CudaError> {
        if self.num_blocks != g.num_blocks || self.block_size != g.block_size {
            return Err(CudaError::shape(
                op,
                format!(
                    "pool of {}×{} does not match the step's {}×{}",
                    self.num_blocks, self.block_size, g.num_blocks, g.block_size
                ),
            ));
        }
        if self.kv_dim != dims.kv_dim() || layer >= self.n_layers {
            return Err(CudaError::shape(
                op,
                format!(
                    "pool kv_dim {} / {} layers vs model kv_dim {} / layer {layer}",
                    self.kv_dim,
                    self.n_layers,
                    dims.kv_dim()
                ),
            ));
        }
        Ok(())
    }
}

/// One step's metadata on the device (uploaded from a validated [`StepBuilder`]).
#[derive(Debug)]
pub struct DeviceStep {
    /// The staging words (grown to the largest step).
    buf: Option<DeviceBuffer<u32>>,
    /// Section ranges of the last upload.
    layout: StepLayout,
    /// Limits its contents were validated against.
    geometry: StepGeometry,
    /// An upload succeeded (the contents match `layout`).
    ready: bool,
}

impl DeviceStep {
    /// An empty step for `geometry` (allocates on first upload).
    pub fn new(geometry: StepGeometry) -> Self {
        DeviceStep {
            buf: None,
            layout: StepLayout::default(),
            geometry,
            ready: false,
        }
    }

    /// The layout of the last upload.
    pub fn layout(&self) -> &StepLayout {
        &self.layout
    }

    /// The staging buffer, once uploaded.
    fn ready(&self, op: &'static str) -> Result<&DeviceBuffer<u32>, CudaError> {
        match (&self.buf, self.ready) {
            (Some(b), true) => Ok(b),
            _ => Err(CudaError::shape(op, "no step uploaded")),
        }
    }
}

/// Which rows an [`Gpu::rmsnorm`] normalises.
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    /// Rows `0..n`.
    All(usize),
    /// The last token of each chunk wanting logits (the step's `logit_rows`).
    Logits(&'a DeviceStep),
}

/// What the device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// NVRTC target the kernels were compiled for (`sm_90`).
    pub arch: String,
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// NVRTC version used.
    pub nvrtc_version: (i32, i32),
}

/// A CUDA device with the kernels loaded.
pub struct Gpu {
    /// The primary context.
    ctx: Arc<CudaContext>,
    /// The one stream every operation runs on, in order.
    stream: Arc<CudaStream>,
    /// cuBLAS on that stream (`None` when libcublas is absent: only the F32 mode works).
    blas: Option<CudaBlas>,
    /// Every registered kernel by name.
    functions: HashMap<&'static str, CudaFunction>,
    /// Device description.
    info: DeviceInfo,
    /// Synchronise after each launch ([`SYNC_EACH_LAUNCH_ENV`]).
    sync_each_launch: bool,
    /// Kernel launches and cuBLAS calls so far (see [`Gpu::launches`]).
    launches: AtomicU64,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .field("cublas", &self.blas.is_some())
            .finish()
    }
}

/// `n` as an `i32` kernel argument, or a shape error naming `what`.
fn int(op: &'static str, what: &str, n: usize) -> Result<i32, CudaError> {
    i32::try_from(n).map_err(|_| CudaError::shape(op, format!("{what} = {n} exceeds i32")))
}

/// Requires `len >= needed`.
fn need(op: &'static str, what: &str, len: usize, needed: usize) -> Result<(), CudaError> {
    if len < needed {
        Err(CudaError::shape(
            op,
            format!("{what} has {len} elements, needs {needed}"),
        ))
    } else {
        Ok(())
    }
}

/// Grid of a grid-stride kernel over `n` elements.
fn elementwise_grid(n: usize) -> LaunchConfig {
    let blocks = n
        .div_ceil(ROW_THREADS as usize)
        .clamp(1, ELEMENTWISE_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Gpu {
    /// Opens device `ordinal`: checks the libraries, creates the context, compiles (once per
    /// process) and loads every kernel. Fails with a typed error — never panics — when the
    /// driver, the device, NVRTC or a kernel is missing.
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        ensure_library(CudaLibrary::Driver)?;
        let count = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            Err(e) if format!("{e:?}").contains("NO_DEVICE") => 0,
            Err(e) => return Err(CudaError::driver("cuInit/cuDeviceGetCount", e)),
        };
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: this context is used through one stream only (`stream` below), so cudarc's
        // cross-stream event synchronisation has nothing to order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let arch = arch_for(major, minor);
        let nvrtc = nvrtc_version()?;
        let modules = compiled_modules(&arch)?;
        let mut functions = HashMap::new();
        for m in modules.iter() {
            let module = ctx
                .load_module(Ptx::from_binary(m.cubin.clone()))
                .map_err(|e| CudaError::KernelMissing {
                    kernel: m.spec.kernels.first().copied().unwrap_or("?"),
                    module: m.spec.name,
                    message: format!("cuModuleLoadData of module {}: {e:?}", m.spec.name),
                })?;
            for &k in m.spec.kernels {
                let f = module
                    .load_function(k)
                    .map_err(|e| CudaError::KernelMissing {
                        kernel: k,
                        module: m.spec.name,
                        message: format!("{e:?}"),
                    })?;
                functions.insert(k, f);
            }
        }
        let smem = fast_attention_smem(FA_MAX_HD);
        if smem > DEFAULT_SMEM_BYTES {
            let f = &functions["attention_fast_bf16"];
            f.set_attribute(
                dsys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| CudaError::Launch {
                kernel: "attention_fast_bf16",
                message: format!("raising its shared memory limit to {smem} bytes: {e:?}"),
            })?;
        }
        let blas = match ensure_library(CudaLibrary::Cublas) {
            Ok(()) => Some(CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas {
                op: "cublasCreate",
                message: format!("{e:?}"),
            })?),
            Err(e) => {
                tracing::warn!(cause = %e, "cuBLAS unavailable: only the f32 mode can run");
                None
            }
        };
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))
        };
        let multiprocessors =
            attr(dsys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1)
                as usize;
        let info = DeviceInfo {
            ordinal,
            name: ctx
                .name()
                .map_err(|e| CudaError::driver("cuDeviceGetName", e))?,
            compute_capability: (major, minor),
            arch,
            multiprocessors,
            total_memory: ctx
                .total_mem()
                .map_err(|e| CudaError::driver("cuDeviceTotalMem", e))?,
            nvrtc_version: nvrtc,
        };
        let sync_each_launch = std::env::var(SYNC_EACH_LAUNCH_ENV).is_ok_and(|v| v == "1");
        tracing::info!(device = %info.name, arch = %info.arch, sms = info.multiprocessors, "CUDA device ready");
        Ok(Gpu {
            ctx,
            stream,
            blas,
            functions,
            info,
            sync_each_launch,
            launches: AtomicU64::new(0),
        })
    }

    /// Device description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether cuBLAS is available (needed by the bf16 mode).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))
    }

    /// Kernel launches plus cuBLAS GEMM calls issued so far (to count launches per token).
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("cuStreamSynchronize", e))
    }

    /// The registered kernel `name`.
    fn function(&self, name: &'static str) -> Result<&CudaFunction, CudaError> {
        self.functions.get(name).ok_or(CudaError::KernelMissing {
            kernel: name,
            module: super::source::module_of(name).map_or("?", |m| m.name),
            message: "not loaded".into(),
        })
    }

    /// Maps a launch result, and synchronises in debug mode so a fault names its kernel.
    fn launched<T>(
        &self,
        kernel: &'static str,
        r: Result<T, cudarc::driver::DriverError>,
    ) -> Result<(), CudaError> {
        r.map_err(|e| CudaError::Launch {
            kernel,
            message: format!("{e:?}"),
        })?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        if self.sync_each_launch {
            self.stream.synchronize().map_err(|e| CudaError::Launch {
                kernel,
                message: format!("{e:?} (reported by the synchronisation after it)"),
            })?;
        }
        Ok(())
    }

    /// Device address of `b`'s element `offset`.
    fn ptr<T>(&self, b: &DeviceBuffer<T>, offset: usize) -> u64 {
        let (p, _sync) = b.slice.device_ptr(&self.stream);
        p + (offset * std::mem::size_of::<T>()) as u64
    }

    /// Device address of a float buffer's element `offset`.
    fn fptr(&self, b: &FloatBuffer, offset: usize) -> u64 {
        match b {
            FloatBuffer::F32(b) => self.ptr(b, offset),
            FloatBuffer::Bf16(b) => self.ptr(b, offset),
        }
    }

    // ---- memory ----

    /// Allocates `len` zeroed elements of plain device memory.
    pub fn alloc<T: DeviceElem>(
        &self,
        len: usize,
        what: &'static str,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        let slice =
            self.stream
                .alloc_zeros::<T>(len.max(1))
                .map_err(|e| CudaError::OutOfMemory {
                    what,
                    bytes: (len * std::mem::size_of::<T>()) as u64,
                    message: format!("{e:?}"),
                })?;
        Ok(DeviceBuffer { slice, len })
    }

    /// Allocates `len` zeroed elements of `dtype`.
    pub fn alloc_float(
        &self,
        dtype: DType,
        len: usize,
        what: &'static str,
    ) -> Result<FloatBuffer, CudaError> {
        Ok(match dtype {
            DType::F32 => FloatBuffer::F32(self.alloc(len, what)?),
            DType::Bf16 => FloatBuffer::Bf16(self.alloc(len, what)?),
        })
    }

    /// Allocates a zeroed `[rows][cols]` matrix.
    pub fn alloc_matrix(
        &self,
        dtype: DType,
        rows: usize,
        cols: usize,
        what: &'static str,
    ) -> Result<Matrix, CudaError> {
        let len = rows
            .checked_mul(cols)
            .ok_or_else(|| CudaError::shape("alloc_matrix", format!("{rows}×{cols} overflows")))?;
        Ok(Matrix {
            buf: self.alloc_float(dtype, len, what)?,
            rows,
            cols,
        })
    }

    /// Allocates the KV pool.
    pub fn alloc_kv_pool(
        &self,
        dtype: DType,
        n_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
    ) -> Result<KvPool, CudaError> {
        let len = n_layers
            .checked_mul(num_blocks)
            .and_then(|n| n.checked_mul(block_size))
            .and_then(|n| n.checked_mul(kv_dim))
            .ok_or_else(|| CudaError::shape("alloc_kv_pool", "pool size overflows"))?;
        Ok(KvPool {
            k: self.alloc_float(dtype, len, "KV pool (keys)")?,
            v: self.alloc_float(dtype, len, "KV pool (values)")?,
            n_layers,
            num_blocks,
            block_size,
            kv_dim,
        })
    }

    /// Copies `src` to `dst[offset..]` (synchronous).
    pub fn upload<T: DeviceElem>(
        &self,
        src: &[T],
        dst: &mut DeviceBuffer<T>,
        offset: usize,
    ) -> Result<(), CudaError> {
        let end = offset
            .checked_add(src.len())
            .filter(|&e| e <= dst.len)
            .ok_or_else(|| {
                CudaError::shape(
                    "upload",
                    format!("{}+{} past {}", offset, src.len(), dst.len),
                )
            })?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst
            .slice
            .try_slice_mut(offset..end)
            .ok_or_else(|| CudaError::shape("upload", "view out of range"))?;
        self.stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| CudaError::driver("cuMemcpyHtoD", e))
    }

    /// Copies `src[offset..offset + dst.len()]` to `dst` (waits for all queued work).
    pub fn download<T: DeviceElem>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        let end = offset
            .checked_add(dst.len())
            .filter(|&e| e <= src.len)
            .ok_or_else(|| {
                CudaError::shape(
                    "download",
                    format!("{}+{} past {}", offset, dst.len(), src.len),
                )
            })?;
        if dst.is_empty() {
            return self.synchronize();
        }
        let view = src
            .slice
            .try_slice(offset..end)
            .ok_or_else(|| CudaError::shape("download", "view out of range"))?;
        self.stream
            .memcpy_dtoh(&view, dst)
            .map_err(|e| CudaError::driver("cuMemcpyDtoH", e))?;
        self.synchronize()
    }

    /// Uploads host f32 values into `dst[offset..]`, converting to `dst`'s dtype on the device
    /// (bf16: round to nearest even) through `staging`, in pieces of `staging.len()`.
    pub fn upload_f32(
        &self,
        src: &[f32],
        dst: &mut FloatBuffer,
        offset: usize,
        staging: &mut DeviceBuffer<f32>,
    ) -> Result<(), CudaError> {
        need(
            "upload_f32",
            "destination",
            dst.len(),
            offset.saturating_add(src.len()),
        )?;
        match dst {
            FloatBuffer::F32(d) => self.upload(src, d, offset),
            FloatBuffer::Bf16(_) => {
                let piece = staging.len().max(1);
                for (i, chunk) in src.chunks(piece).enumerate() {
                    self.upload(chunk, staging, 0)?;
                    self.cast_f32_to_bf16(staging, chunk.len(), dst, offset + i * piece)?;
                }
                Ok(())
            }
        }
    }

    /// Uploads a validated step's staging words.
    pub fn upload_step(
        &self,
        builder: &StepBuilder,
        step: &mut DeviceStep,
    ) -> Result<(), CudaError> {
        let layout = builder.layout();
        if layout.words == 0 || layout.words != builder.staging().len() {
            return Err(CudaError::shape(
                "upload_step",
                "the builder was not finished",
            ));
        }
        if builder.geometry() != step.geometry {
            return Err(CudaError::shape("upload_step", "geometry mismatch"));
        }
        step.ready = false;
        if step.buf.as_ref().is_none_or(|b| b.len < layout.words) {
            step.buf = None;
            step.buf = Some(self.alloc(layout.words.next_power_of_two(), "step metadata")?);
        }
        // Invariant: allocated just above when missing.
        let buf = step.buf.as_mut().expect("step buffer allocated");
        self.upload(builder.staging(), buf, 0)?;
        step.layout = layout.clone();
        step.ready = true;
        Ok(())
    }

    // ---- kernels ----

    /// `x[t] = table[tokens[t]]` for every token of the step.
    pub fn embed(
        &self,
        step: &DeviceStep,
        table: &Matrix,
        x: &mut DeviceBuffer<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "embed";
        let meta = step.ready(OP)?;
        let l = &step.layout;
        if table.rows != step.geometry.vocab_size {
            return Err(CudaError::shape(
                OP,
                format!(
                    "table has {} rows, vocab is {}",
                    table.rows, step.geometry.vocab_size
                ),
            ));
        }
        need(OP, "x", x.len, l.n_tokens * table.cols)?;
        let kernel = match table.dtype() {
            DType::F32 => "embed_f32",
            DType::Bf16 => "embed_bf16",
        };
        let (tab, tokens, out) = (
            self.fptr(&table.buf, 0),
            self.ptr(meta, l.tokens.start),
            self.ptr(x, 0),
        );
        let dim = int(OP, "dim", table.cols)?;
        let cfg = LaunchConfig {
            grid_dim: (int(OP, "tokens", l.n_tokens)? as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&tab).arg(&tokens).arg(&dim).arg(&out);
        // SAFETY: the kernel reads table[tokens[t] * dim + i] and writes x[t * dim + i] for
        // t < n_tokens, i < dim: tokens < vocab = table.rows (validated by the builder, checked
        // above), x holds n_tokens × dim elements (checked above).
        let r = unsafe { b.launch(cfg) };
        self.launched(kernel, r)
    }

    /// RMSNorm of the selected rows of `x` (`[rows][dim]`, `dim = weight.len()`) into `out`
    /// (`[selected][dim]`, f32 or bf16), with the oracle's operation order.
    pub fn rmsnorm(
        &self,
        x: &DeviceBuffer<f32>,
        rows: Rows<'_>,
        weight: &DeviceBuffer<f32>,
        eps: f32,
        out: &mut FloatBuffer,
    ) -> Result<(), CudaError> {
        const OP: &str = "rmsnorm";
        let dim = weight.len;
        let (n_src, n_out, rows_ptr, use_rows) = match rows {
            Rows::All(n) => (n, n, self.ptr(weight, 0), 0i32),
            Rows::Logits(step) => {
                let meta = step.ready(OP)?;
                let l = &step.layout;
                (
                    l.n_tokens,
                    l.n_logit_rows,
                    self.ptr(meta, l.logit_rows.start),
                    1i32,
                )
            }
        };
        need(OP, "x", x.len, n_src * dim)?;
        need(OP, "out", out.len(), n_out * dim)?;
        if n_out == 0 {
            return Ok(());
        }
        let kernel = match out.dtype() {
            DType::F32 => "rmsnorm_to_f32",
            DType::Bf16 => "rmsnorm_to_bf16",
        };
        let (xp, wp, op) = (self.ptr(x, 0), self.ptr(weight, 0), self.fptr(out, 0));
        let dim_i = int(OP, "dim", dim)?;
        let cfg = LaunchConfig {
            grid_dim: (int(OP, "rows", n_out)? as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&xp)
            .arg(&wp)
            .arg(&rows_ptr)
            .arg(&use_rows)
            .arg(&dim_i)
            .arg(&eps)
            .arg(&op);
        // SAFETY: block r reads x[src * dim .. +dim] with src = r < n (All) or src =
        // logit_rows[r] < n_tokens (validated by the builder), weight[..dim], and writes
        // out[r * dim .. +dim] for r < n_out; all lengths were checked above. `rows` is only
        // read when use_rows = 1.
        let r = unsafe { b.launch(cfg) };
        self.launched(kernel, r)
    }

    /// `y[r] (+)= x[r] · wᵀ` for `r < rows` (`x: [rows][w.cols]`, `y: [rows][w.rows]` f32).
    /// f32 weights use the exact lane-scheme kernel (bit-identical to the CPU oracle); bf16
    /// weights use cuBLAS (bf16 inputs, f32 accumulation and output). With `accumulate`, the
    /// product is added to `y` (the residual add).
    pub fn matmul(
        &self,
        x: &FloatBuffer,
        rows: usize,
        w: &Matrix,
        y: &mut DeviceBuffer<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        const OP: &str = "matmul";
        let (n, k) = (w.rows, w.cols);
        need(OP, "x", x.len(), rows * k)?;
        need(OP, "y", y.len, rows * n)?;
        if x.dtype() != w.dtype() {
            return Err(CudaError::shape(
                OP,
                format!("x is {}, w is {}", x.dtype().name(), w.dtype().name()),
            ));
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let (m_i, n_i, k_i) = (int(OP, "rows", rows)?, int(OP, "n", n)?, int(OP, "k", k)?);
        let (xp, wp, yp) = (self.fptr(x, 0), self.fptr(&w.buf, 0), self.ptr(y, 0));
        match w.dtype() {
            DType::F32 => {
                let acc = accumulate as i32;
                let cols_per_block = (MATMUL_THREADS / 16) as usize;
                let cfg = LaunchConfig {
                    grid_dim: (
                        n.div_ceil(cols_per_block) as u32,
                        rows.min(MAX_GRID_YZ) as u32,
                        1,
                    ),
                    block_dim: (MATMUL_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let f = self.function("matmul_exact_f32")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&xp)
                    .arg(&wp)
                    .arg(&yp)
                    .arg(&m_i)
                    .arg(&n_i)
                    .arg(&k_i)
                    .arg(&acc);
                // SAFETY: reads x[r*k .. +k] for r < rows and w[c*k .. +k] for c < n, writes
                // y[r*n + c]; x, w (exactly n×k) and y lengths were checked above.
                let r = unsafe { b.launch(cfg) };
                self.launched("matmul_exact_f32", r)
            }
            DType::Bf16 => {
                let blas = self.blas.as_ref().ok_or_else(|| CudaError::LibraryMissing {
                    library: "libcublas",
                    searched: cudarc::get_lib_name_candidates("cublas").join(", "),
                    hint: "the bf16 mode needs cuBLAS: put its lib directory on LD_LIBRARY_PATH",
                })?;
                let alpha = 1.0f32;
                let beta = if accumulate { 1.0f32 } else { 0.0f32 };
                self.ctx
                    .bind_to_thread()
                    .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
                // Row-major y[rows][n] = x[rows][k] · w[n][k]ᵀ is column-major
                // yᵀ (n × rows) = op(w) · xᵀ with w seen as a k × n column-major matrix, transposed.
                // SAFETY: A = w is k×n (lda = k), B = x is k×rows (ldb = k), C = y is n×rows
                // (ldc = n), all within the lengths checked above; alpha and beta are host f32
                // (the handle's default pointer mode); the handle is bound to our stream.
                let r = unsafe {
                    blas_result::gemm_ex(
                        *blas.handle(),
                        blas_sys::cublasOperation_t::CUBLAS_OP_T,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        n_i,
                        m_i,
                        k_i,
                        (&alpha as *const f32).cast::<c_void>(),
                        wp as usize as *const c_void,
                        blas_sys::cudaDataType_t::CUDA_R_16BF,
                        k_i,
                        xp as usize as *const c_void,
                        blas_sys::cudaDataType_t::CUDA_R_16BF,
                        k_i,
                        (&beta as *const f32).cast::<c_void>(),
                        yp as usize as *mut c_void,
                        blas_sys::cudaDataType_t::CUDA_R_32F,
                        n_i,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                };
                r.map_err(|e| CudaError::Blas {
                    op: "cublasGemmEx(bf16, f32 out)",
                    message: format!("{e:?} (m={n}, n={rows}, k={k})"),
                })?;
                self.launches.fetch_add(1, Ordering::Relaxed);
                if self.sync_each_launch {
                    self.synchronize()?;
                }
                Ok(())
            }
        }
    }

    /// RoPE on the q and k parts of each token's qkv row, then stores k and v in layer
    /// `layer` of the pool at the token's position.
    pub fn rope_append(
        &self,
        step: &DeviceStep,
        dims: &ModelDims,
        qkv: &mut DeviceBuffer<f32>,
        rope: &DeviceBuffer<f32>,
        pool: &mut KvPool,
        layer: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_append";
        dims.validate()?;
        let meta = step.ready(OP)?;
        let (l, g) = (&step.layout, &step.geometry);
        pool.check(OP, g, dims, layer)?;
        need(OP, "qkv", qkv.len, l.n_tokens * dims.qkv_width())?;
        need(OP, "rope table", rope.len, g.max_seq_len * dims.head_dim())?;
        let kernel = match pool.dtype() {
            DType::F32 => "rope_append_f32",
            DType::Bf16 => "rope_append_bf16",
        };
        let base = layer * pool.layer_len();
        let (qp, rp) = (self.ptr(qkv, 0), self.ptr(rope, 0));
        let (pos, tbl, tables) = (
            self.ptr(meta, l.pos.start),
            self.ptr(meta, l.tbl.start),
            self.ptr(meta, l.tables.start),
        );
        let (kp, vp) = (self.fptr(&pool.k, base), self.fptr(&pool.v, base));
        let stride = int(OP, "qkv width", dims.qkv_width())?;
        let (dim, kvd, hd, bs) = (
            int(OP, "dim", dims.dim)?,
            int(OP, "kv_dim", dims.kv_dim())?,
            int(OP, "head_dim", dims.head_dim())?,
            int(OP, "block_size", g.block_size)?,
        );
        let cfg = LaunchConfig {
            grid_dim: (int(OP, "tokens", l.n_tokens)? as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&qp)
            .arg(&stride)
            .arg(&rp)
            .arg(&pos)
            .arg(&tbl)
            .arg(&tables)
            .arg(&dim)
            .arg(&kvd)
            .arg(&hd)
            .arg(&bs)
            .arg(&kp)
            .arg(&vp);
        // SAFETY: token t < n_tokens touches qkv[t * stride .. +stride] (checked), rope[pos *
        // hd .. +hd] with pos < max_seq_len (builder), and the pool row of (table[pos /
        // block_size] < num_blocks, pos % block_size) in this layer: the builder validated
        // every table entry a position reaches; the pool matches the geometry and kv_dim
        // (checked), and dims are consistent (validated).
        let r = unsafe { b.launch(cfg) };
        self.launched(kernel, r)
    }

    /// Attention of every token of the step over its sequence's positions `0..=pos` in layer
    /// `layer`: exact (oracle order) for an f32 pool, tiled split-KV for a bf16 pool. Writes
    /// `out` (`[tokens][dim]`: f32 for an f32 pool, bf16 for a bf16 pool); `partial` is scratch
    /// for split-KV partials (its size bounds the number of splits).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        step: &DeviceStep,
        dims: &ModelDims,
        qkv: &DeviceBuffer<f32>,
        pool: &KvPool,
        layer: usize,
        out: &mut FloatBuffer,
        partial: &mut DeviceBuffer<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention";
        dims.validate()?;
        let meta = step.ready(OP)?;
        let (l, g) = (&step.layout, &step.geometry);
        pool.check(OP, g, dims, layer)?;
        need(OP, "qkv", qkv.len, l.n_tokens * dims.qkv_width())?;
        need(OP, "out", out.len(), l.n_tokens * dims.dim)?;
        if out.dtype() != pool.dtype() {
            return Err(CudaError::shape(OP, "out and pool dtypes differ"));
        }
        let base = layer * pool.layer_len();
        let (kp, vp) = (self.fptr(&pool.k, base), self.fptr(&pool.v, base));
        let qp = self.ptr(qkv, 0);
        let op = self.fptr(out, 0);
        let stride = int(OP, "qkv width", dims.qkv_width())?;
        let (nh, nkv, hd, kvd, bs, d) = (
            int(OP, "n_heads", dims.n_heads)?,
            int(OP, "n_kv_heads", dims.n_kv_heads)?,
            int(OP, "head_dim", dims.head_dim())?,
            int(OP, "kv_dim", dims.kv_dim())?,
            int(OP, "block_size", g.block_size)?,
            int(OP, "dim", dims.dim)?,
        );
        let tables = self.ptr(meta, l.tables.start);
        match pool.dtype() {
            DType::F32 => {
                let smem = l.max_end * 4;
                if smem > DEFAULT_SMEM_BYTES || dims.n_heads > MAX_GRID_YZ {
                    return Err(CudaError::Unsupported(format!(
                        "exact attention over {} positions needs {smem} bytes of shared memory (limit {DEFAULT_SMEM_BYTES})",
                        l.max_end
                    )));
                }
                let (pos, tbl) = (self.ptr(meta, l.pos.start), self.ptr(meta, l.tbl.start));
                let sqrt_hd = (dims.head_dim() as f32).sqrt();
                let cfg = LaunchConfig {
                    grid_dim: (
                        int(OP, "tokens", l.n_tokens)? as u32,
                        dims.n_heads as u32,
                        1,
                    ),
                    block_dim: (EXACT_ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                let f = self.function("attention_exact_f32")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&qp)
                    .arg(&stride)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&pos)
                    .arg(&tbl)
                    .arg(&tables)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&kvd)
                    .arg(&bs)
                    .arg(&sqrt_hd)
                    .arg(&op)
                    .arg(&d);
                // SAFETY: block (t, h) reads q of row t (< n_tokens, checked), the pool rows
                // of positions 0..=pos[t] < max_end through the validated block table, writes
                // out[t * dim + h * hd .. +hd] (checked) and pos[t] + 1 <= max_end scores to
                // the shared memory sized max_end floats.
                let r = unsafe { b.launch(cfg) };
                self.launched("attention_exact_f32", r)
            }
            DType::Bf16 => {
                if dims.head_dim() > FA_MAX_HD || dims.group() * g.tile_tokens > FA_MAX_ROWS {
                    return Err(CudaError::Unsupported(format!(
                        "fast attention needs head_dim <= {FA_MAX_HD} and tile rows <= {FA_MAX_ROWS} (head_dim {}, group {}, tile {})",
                        dims.head_dim(),
                        dims.group(),
                        g.tile_tokens
                    )));
                }
                let per_split = dims.n_heads * (dims.head_dim() + 2);
                let plan = plan_splits(
                    l.n_tiles * dims.n_kv_heads,
                    l.max_end,
                    l.n_tokens,
                    self.info.multiprocessors,
                    partial.len / per_split,
                );
                if plan.n_splits > 1 {
                    need(
                        OP,
                        "partial",
                        partial.len,
                        l.n_tokens * plan.n_splits * per_split,
                    )?;
                }
                let tiles = self.ptr(meta, l.tiles.start);
                let pp = self.ptr(partial, 0);
                let scale = 1.0 / (dims.head_dim() as f32).sqrt();
                let (split_len, n_splits) =
                    (int(OP, "split_len", plan.split_len)?, plan.n_splits as i32);
                let cfg = LaunchConfig {
                    grid_dim: (
                        int(OP, "tiles", l.n_tiles)? as u32,
                        dims.n_kv_heads.min(MAX_GRID_YZ) as u32,
                        plan.n_splits as u32,
                    ),
                    block_dim: (FA_THREADS, 1, 1),
                    shared_mem_bytes: fast_attention_smem(dims.head_dim()) as u32,
                };
                if dims.n_kv_heads > MAX_GRID_YZ {
                    return Err(CudaError::Unsupported("more than 65535 KV heads".into()));
                }
                let f = self.function("attention_fast_bf16")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(&qp)
                    .arg(&stride)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&tiles)
                    .arg(&tables)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&kvd)
                    .arg(&bs)
                    .arg(&scale)
                    .arg(&split_len)
                    .arg(&n_splits)
                    .arg(&op)
                    .arg(&d)
                    .arg(&pp);
                // SAFETY: each tile (validated by the builder: tokens < n_tokens, positions <
                // max_end, its table offset) reads q rows of its tokens, pool rows of
                // positions < pos0 + n through the validated table, and writes either out rows
                // of its tokens (checked size) or partial[(t * n_heads + h) * n_splits + z]
                // (checked size when n_splits > 1). Rows ≤ FA_MAX_ROWS and head_dim ≤
                // FA_MAX_HD (checked) keep the shared-memory tiles in the allocated size.
                let r = unsafe { b.launch(cfg) };
                self.launched("attention_fast_bf16", r)?;
                if plan.n_splits > 1 {
                    let cfg = LaunchConfig {
                        grid_dim: (l.n_tokens as u32, dims.n_heads as u32, 1),
                        block_dim: (FA_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let f = self.function("attention_combine_bf16")?;
                    let mut b = self.stream.launch_builder(f);
                    b.arg(&pp).arg(&nh).arg(&hd).arg(&n_splits).arg(&op).arg(&d);
                    // SAFETY: reads the partials written above (same sizes, checked) and
                    // writes out rows t < n_tokens (checked).
                    let r = unsafe { b.launch(cfg) };
                    self.launched("attention_combine_bf16", r)?;
                }
                Ok(())
            }
        }
    }

    /// `out[r] = swiglu(h13[r])` where each `h13` row is `[gate (hidden) | up (hidden)]`.
    pub fn swiglu(
        &self,
        h13: &DeviceBuffer<f32>,
        rows: usize,
        hidden: usize,
        out: &mut FloatBuffer,
    ) -> Result<(), CudaError> {
        const OP: &str = "swiglu";
        need(OP, "h13", h13.len, rows * 2 * hidden)?;
        need(OP, "out", out.len(), rows * hidden)?;
        if rows * hidden == 0 {
            return Ok(());
        }
        let kernel = match out.dtype() {
            DType::F32 => "swiglu_to_f32",
            DType::Bf16 => "swiglu_to_bf16",
        };
        let (hp, op) = (self.ptr(h13, 0), self.fptr(out, 0));
        let (rows_u, hid) = (rows as u64, int(OP, "hidden", hidden)?);
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&hp).arg(&rows_u).arg(&hid).arg(&op);
        // SAFETY: element i < rows × hidden reads h13 at row-major [r][0..2·hidden] and writes
        // out[i]; both lengths were checked above.
        let r = unsafe { b.launch(elementwise_grid(rows * hidden)) };
        self.launched(kernel, r)
    }

    /// Samples one token per logits row with the oracle's procedure (safety mask first).
    /// `logits` (`[W][vocab]`) is modified (banned ids become -inf); `probs` is scratch of the
    /// same size; `result[2i] = status`, `result[2i + 1] = token` (see `source::consts`).
    pub fn sample(
        &self,
        step: &DeviceStep,
        logits: &mut DeviceBuffer<f32>,
        probs: &mut DeviceBuffer<f32>,
        result: &mut DeviceBuffer<u32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "sample";
        let meta = step.ready(OP)?;
        let l = &step.layout;
        let vocab = step.geometry.vocab_size;
        if l.n_sample_rows != l.n_logit_rows {
            return Err(CudaError::shape(OP, "the step has no sampling rows"));
        }
        let w = l.n_sample_rows;
        need(OP, "logits", logits.len, w * vocab)?;
        need(OP, "probs", probs.len, w * vocab)?;
        need(OP, "result", result.len, 2 * w)?;
        if w == 0 {
            return Ok(());
        }
        let (lp, pp, rp) = (self.ptr(logits, 0), self.ptr(probs, 0), self.ptr(result, 0));
        let (params, banned) = (
            self.ptr(meta, l.params.start),
            self.ptr(meta, l.banned.start),
        );
        let v = int(OP, "vocab", vocab)?;
        let cfg = LaunchConfig {
            grid_dim: (int(OP, "rows", w)? as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function("sample_rows")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&lp)
            .arg(&v)
            .arg(&params)
            .arg(&banned)
            .arg(&pp)
            .arg(&rp);
        // SAFETY: block i reads params[6i .. 6i+6] (i < n_sample_rows), the banned ids of its
        // range (validated < vocab, offsets built by the builder), logits and probs row i
        // (checked sizes), and writes result[2i], result[2i + 1] (checked).
        let r = unsafe { b.launch(cfg) };
        self.launched("sample_rows", r)
    }

    /// `dst[offset + i] = bf16(src[i])` for `i < n` (`dst` must be bf16).
    pub fn cast_f32_to_bf16(
        &self,
        src: &DeviceBuffer<f32>,
        n: usize,
        dst: &mut FloatBuffer,
        offset: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "cast_f32_to_bf16";
        need(OP, "src", src.len, n)?;
        need(OP, "dst", dst.len(), offset.saturating_add(n))?;
        if dst.dtype() != DType::Bf16 {
            return Err(CudaError::shape(OP, "destination is not bf16"));
        }
        if n == 0 {
            return Ok(());
        }
        let (sp, dp, nn) = (self.ptr(src, 0), self.fptr(dst, offset), n as u64);
        let f = self.function(OP)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&sp).arg(&nn).arg(&dp);
        // SAFETY: reads src[..n], writes dst[offset..offset + n]; both checked above.
        let r = unsafe { b.launch(elementwise_grid(n)) };
        self.launched(OP, r)
    }

    /// `dst[i] = f32(src[offset + i])` for `i < n` (`src` must be bf16).
    pub fn cast_bf16_to_f32(
        &self,
        src: &FloatBuffer,
        offset: usize,
        n: usize,
        dst: &mut DeviceBuffer<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "cast_bf16_to_f32";
        need(OP, "src", src.len(), offset.saturating_add(n))?;
        need(OP, "dst", dst.len, n)?;
        if src.dtype() != DType::Bf16 {
            return Err(CudaError::shape(OP, "source is not bf16"));
        }
        if n == 0 {
            return Ok(());
        }
        let (sp, dp, nn) = (self.fptr(src, offset), self.ptr(dst, 0), n as u64);
        let f = self.function(OP)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&sp).arg(&nn).arg(&dp);
        // SAFETY: reads src[offset..offset + n], writes dst[..n]; both checked above.
        let r = unsafe { b.launch(elementwise_grid(n)) };
        self.launched(OP, r)
    }

    /// `dst[..] = value`.
    pub fn fill_f32(&self, dst: &mut DeviceBuffer<f32>, value: f32) -> Result<(), CudaError> {
        const OP: &str = "fill_f32";
        if dst.len == 0 {
            return Ok(());
        }
        let (dp, n) = (self.ptr(dst, 0), dst.len as u64);
        let f = self.function(OP)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&dp).arg(&n).arg(&value);
        // SAFETY: writes dst[..len], its own length.
        let r = unsafe { b.launch(elementwise_grid(dst.len)) };
        self.launched(OP, r)
    }

    /// `dst[offset + i] = dummy_weight(seed, tensor, element0 + i) * scale` for `i < n`, in
    /// `dst`'s dtype (zerolayer_model::dummy_weight's formula; bf16 rounds to nearest even).
    #[allow(clippy::too_many_arguments)]
    pub fn dummy_fill(
        &self,
        dst: &mut FloatBuffer,
        offset: usize,
        n: usize,
        seed: u64,
        tensor: u32,
        element0: u64,
        scale: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "dummy_fill";
        need(OP, "dst", dst.len(), offset.saturating_add(n))?;
        if n == 0 {
            return Ok(());
        }
        let kernel = match dst.dtype() {
            DType::F32 => "dummy_fill_f32",
            DType::Bf16 => "dummy_fill_bf16",
        };
        let (dp, nn) = (self.fptr(dst, offset), n as u64);
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&dp)
            .arg(&nn)
            .arg(&seed)
            .arg(&tensor)
            .arg(&element0)
            .arg(&scale);
        // SAFETY: writes dst[offset..offset + n], checked above.
        let r = unsafe { b.launch(elementwise_grid(n)) };
        self.launched(kernel, r)
    }

    /// Copies the K and V rows of positions `0..len` of every layer from the blocks of `src`
    /// to those of `dst` (forking a sequence); `tables` is scratch for the two tables.
    pub fn kv_copy(
        &self,
        pool: &mut KvPool,
        src: &[u32],
        dst: &[u32],
        len: usize,
        tables: &mut DeviceBuffer<u32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_copy";
        if len == 0 {
            return Ok(());
        }
        let needed = len.div_ceil(pool.block_size);
        for t in [src, dst] {
            if t.len() < needed || t[..needed].iter().any(|&b| b as usize >= pool.num_blocks) {
                return Err(CudaError::shape(
                    OP,
                    "block table too short or out of range",
                ));
            }
        }
        need(OP, "tables scratch", tables.len, 2 * needed)?;
        self.upload(&src[..needed], tables, 0)?;
        self.upload(&dst[..needed], tables, needed)?;
        let kernel = match pool.dtype() {
            DType::F32 => "kv_copy_f32",
            DType::Bf16 => "kv_copy_bf16",
        };
        let (kp, vp) = (self.fptr(&pool.k, 0), self.fptr(&pool.v, 0));
        let (sp, dp) = (self.ptr(tables, 0), self.ptr(tables, needed));
        let layer_stride = pool.layer_len() as u64;
        let (bs, kvd) = (
            int(OP, "block_size", pool.block_size)?,
            int(OP, "kv_dim", pool.kv_dim)?,
        );
        if pool.n_layers > MAX_GRID_YZ {
            return Err(CudaError::Unsupported("more than 65535 layers".into()));
        }
        let cfg = LaunchConfig {
            grid_dim: (int(OP, "len", len)? as u32, pool.n_layers as u32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&kp)
            .arg(&vp)
            .arg(&sp)
            .arg(&dp)
            .arg(&layer_stride)
            .arg(&bs)
            .arg(&kvd);
        // SAFETY: block (p, layer) copies one kv_dim row of each pool between the rows of
        // (table[p / block_size], p % block_size) in that layer; both tables cover 0..len with
        // ids < num_blocks (checked above) and layer < n_layers.
        let r = unsafe { b.launch(cfg) };
        self.launched(kernel, r)
    }

    /// Measures device-to-device copy bandwidth: copies a `bytes`-sized buffer `reps` times
    /// after one warm-up and returns the median of (bytes read + bytes written) / time, in
    /// bytes per second.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let n = (bytes / 4).max(1);
        let src = self.alloc::<u32>(n, "bandwidth probe")?;
        let mut dst = self.alloc::<u32>(n, "bandwidth probe")?;
        let mut times = Vec::with_capacity(reps.max(1));
        for i in 0..=reps.max(1) {
            self.synchronize()?;
            let start = self
                .ctx
                .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| CudaError::driver("cuEventCreate", e))?;
            let end = self
                .ctx
                .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| CudaError::driver("cuEventCreate", e))?;
            start
                .record(&self.stream)
                .map_err(|e| CudaError::driver("cuEventRecord", e))?;
            self.stream
                .memcpy_dtod(&src.slice, &mut dst.slice)
                .map_err(|e| CudaError::driver("cuMemcpyDtoD", e))?;
            end.record(&self.stream)
                .map_err(|e| CudaError::driver("cuEventRecord", e))?;
            end.synchronize()
                .map_err(|e| CudaError::driver("cuEventSynchronize", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| CudaError::driver("cuEventElapsedTime", e))?;
            if i > 0 {
                times.push(ms as f64 / 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        Ok(2.0 * (n * 4) as f64 / median)
    }

    /// Runs `f` and returns its wall time in seconds after synchronising before and after.
    pub fn timed<T>(
        &self,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<(T, f64), CudaError> {
        self.synchronize()?;
        let t0 = Instant::now();
        let v = f()?;
        self.synchronize()?;
        Ok((v, t0.elapsed().as_secs_f64()))
    }
}

/// Dynamic shared memory of `attention_fast_bf16` for `head_dim`: q tile `FA_MAX_ROWS × hd`, K
/// tile `FA_KT × (hd + 1)`, V tile `FA_KT × hd`, all f32.
pub fn fast_attention_smem(head_dim: usize) -> usize {
    (FA_MAX_ROWS * head_dim + FA_KT * (2 * head_dim + 1)) * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_without_a_driver_is_a_typed_error() {
        match Gpu::new(0) {
            Ok(gpu) => eprintln!("a GPU is present ({}); nothing to check", gpu.info().name),
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        CudaError::LibraryMissing { .. } | CudaError::NoDevice { .. }
                    ),
                    "{e}"
                );
                eprintln!("as expected without a GPU: {e}");
            }
        }
    }

    #[test]
    fn fast_attention_shared_memory_fits_hopper_with_the_opt_in() {
        assert_eq!(fast_attention_smem(128), (32 * 128 + 32 * 257) * 4);
        assert!(fast_attention_smem(128) <= 227 * 1024);
        assert!(fast_attention_smem(64) <= DEFAULT_SMEM_BYTES);
    }

    #[test]
    fn model_dims_reject_inconsistent_heads() {
        let ok = ModelDims {
            dim: 64,
            hidden_dim: 172,
            n_layers: 5,
            n_heads: 8,
            n_kv_heads: 4,
            vocab_size: 512,
            max_seq_len: 512,
        };
        ok.validate().unwrap();
        assert_eq!(
            (ok.head_dim(), ok.kv_dim(), ok.group(), ok.qkv_width()),
            (8, 32, 2, 128)
        );
        for bad in [
            ModelDims {
                n_kv_heads: 3,
                ..ok
            },
            ModelDims { dim: 60, ..ok },
            ModelDims { n_heads: 0, ..ok },
            ModelDims {
                dim: 8,
                n_heads: 8,
                n_kv_heads: 8,
                ..ok
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
