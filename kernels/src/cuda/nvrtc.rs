//! Loading the CUDA libraries without panicking, and compiling the kernel modules with NVRTC
//! (once per process and target, cached).
//!
//! cudarc's dynamic loading panics when a library is absent, so every entry point first checks
//! that the library can be loaded and returns [`CudaError::LibraryMissing`] otherwise.

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

use super::error::CudaError;
use super::source::{MODULES, ModuleSpec};

/// Environment variable with an explicit path to `libnvrtc.so*`: loaded first, so that the
/// search by file name finds it (the loader matches already-loaded libraries by soname).
pub const NVRTC_LIB_ENV: &str = "ZEROLAYER_NVRTC_LIB";

/// NVRTC options besides the target: no contraction of `a * b + c` into fused multiply-adds,
/// so the kernels round exactly like the CPU oracle (see common.cuh).
pub const NVRTC_OPTIONS: [&str; 1] = ["--fmad=false"];

/// A CUDA library the backend needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// `libcuda` (the driver; comes with the GPU driver, not the toolkit).
    Driver,
    /// `libnvrtc` (run-time compiler).
    Nvrtc,
    /// `libcublas` (GEMMs of the bf16 mode).
    Cublas,
}

impl CudaLibrary {
    /// The name cudarc searches for (`cuda`, `nvrtc`, `cublas`).
    fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::Cublas => "cublas",
        }
    }

    /// Name for messages.
    fn display(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "libcuda (the NVIDIA driver)",
            CudaLibrary::Nvrtc => "libnvrtc (CUDA run-time compiler)",
            CudaLibrary::Cublas => "libcublas",
        }
    }

    /// What to do when it is missing.
    fn hint(self) -> &'static str {
        match self {
            CudaLibrary::Driver => {
                "no usable NVIDIA driver on this machine: use --device cpu, or install the driver"
            }
            CudaLibrary::Nvrtc => {
                "put the CUDA toolkit's lib directory (or pip's nvidia/cuda_nvrtc/lib) on LD_LIBRARY_PATH, or set ZEROLAYER_NVRTC_LIB to the library file"
            }
            CudaLibrary::Cublas => {
                "put the CUDA toolkit's lib directory (or pip's nvidia/cublas/lib) on LD_LIBRARY_PATH"
            }
        }
    }

    /// Whether cudarc can load it (tries every candidate name; loads and unloads).
    fn present(self) -> bool {
        match self {
            // SAFETY: loading NVIDIA's libraries runs their initialisers, which have no
            // preconditions; cudarc loads the same files by the same names.
            CudaLibrary::Driver => unsafe { cudarc::driver::sys::is_culib_present() },
            // SAFETY: as above.
            CudaLibrary::Nvrtc => unsafe { nvrtc_sys::is_culib_present() },
            // SAFETY: as above.
            CudaLibrary::Cublas => unsafe { cudarc::cublas::sys::is_culib_present() },
        }
    }
}

/// Libraries loaded from explicit paths; kept loaded for the life of the process.
static PRELOADED: OnceLock<Result<Option<libloading::Library>, String>> = OnceLock::new();

/// Loads `$ZEROLAYER_NVRTC_LIB` once, if set.
fn preload_nvrtc() -> Result<(), CudaError> {
    let result = PRELOADED.get_or_init(|| match std::env::var_os(NVRTC_LIB_ENV) {
        None => Ok(None),
        Some(path) => {
            // SAFETY: loading NVIDIA's NVRTC runs its initialisers, which have no
            // preconditions; the handle is kept for the life of the process (in this static),
            // so nothing unloads it while cudarc uses it.
            unsafe { libloading::Library::new(&path) }
                .map(Some)
                .map_err(|e| format!("{} ({e})", path.to_string_lossy()))
        }
    });
    match result {
        Ok(_) => Ok(()),
        Err(msg) => Err(CudaError::LibraryMissing {
            library: CudaLibrary::Nvrtc.display(),
            searched: format!("{NVRTC_LIB_ENV}={msg}"),
            hint: CudaLibrary::Nvrtc.hint(),
        }),
    }
}

/// Checks (once per process and library) that `lib` can be loaded.
pub fn ensure_library(lib: CudaLibrary) -> Result<(), CudaError> {
    static CHECKED: OnceLock<Mutex<HashMap<CudaLibrary, bool>>> = OnceLock::new();
    if lib == CudaLibrary::Nvrtc {
        preload_nvrtc()?;
    }
    let map = CHECKED.get_or_init(|| Mutex::new(HashMap::new()));
    // A poisoned map only means another thread panicked between insert calls; the data is a
    // plain cache and stays valid.
    let mut map = map.lock().unwrap_or_else(|e| e.into_inner());
    let ok = *map.entry(lib).or_insert_with(|| lib.present());
    if ok {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            library: lib.display(),
            searched: cudarc::get_lib_name_candidates(lib.stem()).join(", "),
            hint: lib.hint(),
        })
    }
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    ensure_library(CudaLibrary::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded (checked above) and both pointers are valid for writes.
    let rc = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    rc.result()
        .map_err(|e| CudaError::driver("nvrtcVersion", e))?;
    Ok((major, minor))
}

/// One module compiled for one target.
#[derive(Clone, Debug)]
pub struct CompiledModule {
    /// What was compiled.
    pub spec: &'static ModuleSpec,
    /// Target, e.g. `sm_90`.
    pub arch: String,
    /// Machine code for the target (loaded by the driver without a PTX JIT step, so a newer
    /// NVRTC than the driver works).
    pub cubin: Vec<u8>,
    /// The PTX (for inspection and tests: every kernel appears as `.entry NAME`).
    pub ptx: String,
}

/// Owns an NVRTC program and destroys it on every path.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed exactly once.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

/// Bytes of a NUL-terminated C buffer as a `String` (lossy).
fn c_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles one module for `arch` (`sm_90`, …).
pub fn compile_module(spec: &'static ModuleSpec, arch: &str) -> Result<CompiledModule, CudaError> {
    ensure_library(CudaLibrary::Nvrtc)?;
    let compile_err = |log: String| CudaError::Compile {
        module: spec.name,
        arch: arch.to_string(),
        log,
    };
    let src = CString::new(spec.full_source())
        .map_err(|_| compile_err("the source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", spec.name))
        .map_err(|_| compile_err("the module name contains a NUL byte".into()))?;
    let prog = Program(
        nvrtc_result::create_program(&src, Some(&name))
            .map_err(|e| compile_err(format!("nvrtcCreateProgram: {e:?}")))?,
    );
    let mut options: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    options.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is a live program; the options are NUL-free ASCII strings.
    let compiled = unsafe { nvrtc_result::compile_program(prog.0, &options) };
    if let Err(e) = compiled {
        // SAFETY: `prog` is a live program.
        let log = unsafe { nvrtc_result::get_program_log(prog.0) }
            .map(|l| c_text(&l))
            .unwrap_or_default();
        return Err(compile_err(format!("{e:?}: {log}")));
    }
    // SAFETY: `prog` compiled successfully.
    let ptx = unsafe { nvrtc_result::get_ptx(prog.0) }
        .map_err(|e| compile_err(format!("nvrtcGetPTX: {e:?}")))?;
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is valid for writes.
    let rc = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) };
    rc.result().map_err(|e| {
        compile_err(format!(
            "nvrtcGetCUBINSize: {e:?} (is {arch} a real target?)"
        ))
    })?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the size NVRTC reported for this program's CUBIN.
    let rc = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) };
    rc.result()
        .map_err(|e| compile_err(format!("nvrtcGetCUBIN: {e:?}")))?;
    Ok(CompiledModule {
        spec,
        arch: arch.to_string(),
        cubin,
        ptx: c_text(&ptx),
    })
}

/// Every module compiled for `arch`, compiled on first use and cached for the process.
pub fn compiled_modules(arch: &str) -> Result<Arc<[CompiledModule]>, CudaError> {
    type Cache = Mutex<HashMap<String, Arc<[CompiledModule]>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    // The lock is held while compiling so two threads never compile the same target twice; a
    // poisoned cache is still a valid map.
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = cache.get(arch) {
        return Ok(Arc::clone(m));
    }
    let modules: Vec<CompiledModule> = MODULES
        .iter()
        .map(|spec| compile_module(spec, arch))
        .collect::<Result<_, _>>()?;
    let modules: Arc<[CompiledModule]> = modules.into();
    cache.insert(arch.to_string(), Arc::clone(&modules));
    Ok(modules)
}

/// The NVRTC target of a device of compute capability `major.minor` (`sm_90`).
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_named_like_nvrtc_expects() {
        assert_eq!(arch_for(9, 0), "sm_90");
        assert_eq!(arch_for(8, 6), "sm_86");
    }

    #[test]
    fn missing_libraries_are_typed_errors_naming_the_library() {
        // On a machine without the driver this must be an error, never a panic; on a GPU
        // machine it succeeds.
        match ensure_library(CudaLibrary::Driver) {
            Ok(()) => eprintln!("libcuda is present here; nothing to check"),
            Err(e) => {
                assert_eq!(e.error_type(), "library_missing");
                let msg = e.to_string();
                assert!(msg.contains("libcuda"), "{msg}");
                assert!(msg.contains("libcuda.so.1"), "{msg}");
            }
        }
    }
}
