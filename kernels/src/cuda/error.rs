//! Errors of the CUDA layer. Every failure names what failed: the library, the driver call,
//! the module that did not compile, or the kernel that is missing or failed to launch.

use super::host::StepError;

/// A CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library could not be loaded (no driver, toolkit library not on the search path).
    #[error("cannot load {library} (tried {searched}); {hint}")]
    LibraryMissing {
        /// `libcuda` (driver), `libnvrtc` or `libcublas`.
        library: &'static str,
        /// The file names tried.
        searched: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// The driver knows no device with this ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver API call failed.
    #[error("CUDA driver call {op} failed: {message}")]
    Driver {
        /// The operation (`cuCtxCreate`, `memcpy_htod`, …).
        op: &'static str,
        /// The driver's error.
        message: String,
    },
    /// NVRTC rejected a module.
    #[error("NVRTC cannot compile CUDA module {module} for {arch}: {log}")]
    Compile {
        /// Module name (`attention`, …).
        module: &'static str,
        /// Target (`sm_90`).
        arch: String,
        /// The compiler log.
        log: String,
    },
    /// A registered kernel is missing from its loaded module.
    #[error("CUDA kernel {kernel} (module {module}) is missing: {message}")]
    KernelMissing {
        /// Kernel name.
        kernel: &'static str,
        /// Module that should define it.
        module: &'static str,
        /// The driver's error.
        message: String,
    },
    /// A launch failed (at launch, or at the next synchronisation when
    /// `ZEROLAYER_CUDA_SYNC=1` checks every launch).
    #[error("CUDA kernel {kernel} failed: {message}")]
    Launch {
        /// Kernel name.
        kernel: &'static str,
        /// The driver's error.
        message: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS {op} failed: {message}")]
    Blas {
        /// The operation.
        op: &'static str,
        /// cuBLAS's error.
        message: String,
    },
    /// Device memory could not be allocated.
    #[error("cannot allocate {bytes} bytes of device memory for {what}: {message}")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// Bytes requested.
        bytes: u64,
        /// The driver's error.
        message: String,
    },
    /// A buffer, shape or dtype does not fit the operation (checked before any launch).
    #[error("{op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// The model's shape is outside what the kernels support.
    #[error("unsupported by the CUDA kernels: {0}")]
    Unsupported(String),
    /// A step's metadata was rejected.
    #[error(transparent)]
    Step(#[from] StepError),
}

impl CudaError {
    /// Stable machine-readable reason (metric label).
    pub fn error_type(&self) -> &'static str {
        match self {
            CudaError::LibraryMissing { .. } => "library_missing",
            CudaError::NoDevice { .. } => "no_device",
            CudaError::Driver { .. } => "driver",
            CudaError::Compile { .. } => "compile",
            CudaError::KernelMissing { .. } => "kernel_missing",
            CudaError::Launch { .. } => "launch",
            CudaError::Blas { .. } => "blas",
            CudaError::OutOfMemory { .. } => "out_of_memory",
            CudaError::Shape { .. } => "shape",
            CudaError::Unsupported(_) => "unsupported",
            CudaError::Step(_) => "step",
        }
    }

    /// A [`CudaError::Driver`] from a cudarc driver error.
    pub(crate) fn driver(op: &'static str, e: impl std::fmt::Debug) -> Self {
        CudaError::Driver {
            op,
            message: format!("{e:?}"),
        }
    }

    /// A [`CudaError::Shape`].
    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        CudaError::Shape {
            op,
            detail: detail.into(),
        }
    }
}
