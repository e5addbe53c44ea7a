//! Every CUDA kernel module compiles with NVRTC for Hopper (sm_90), and every registered kernel
//! is in the output. Needs only libnvrtc (no GPU): set `ZEROLAYER_NVRTC_LIB` to the library
//! file or put its directory on `LD_LIBRARY_PATH`; without it the test prints a visible skip
//! (CI has no CUDA toolkit).

use zerolayer_kernels::cuda::{CudaLibrary, compile_module, ensure_library, nvrtc_version, source};

/// NVRTC is loadable, or `None` after printing why the test is skipped (a failure instead when
/// `ZEROLAYER_REQUIRE_NVRTC=1`, as on the GPU machine).
fn nvrtc() -> Option<(i32, i32)> {
    if let Err(e) = ensure_library(CudaLibrary::Nvrtc) {
        let required = std::env::var("ZEROLAYER_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "ZEROLAYER_REQUIRE_NVRTC=1 but NVRTC cannot be loaded: {e}"
        );
        eprintln!("SKIPPED: NVRTC is not available here ({e})");
        return None;
    }
    Some(nvrtc_version().expect("nvrtcVersion"))
}

#[test]
fn every_kernel_module_compiles_for_sm_90_with_every_registered_kernel() {
    let Some((major, minor)) = nvrtc() else {
        return;
    };
    eprintln!("NVRTC {major}.{minor}");
    for spec in &source::MODULES {
        let m = compile_module(spec, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        assert!(!m.cubin.is_empty(), "{}: empty cubin", spec.name);
        // An ELF image for the driver, not PTX text.
        assert_eq!(&m.cubin[..4], b"\x7fELF", "{}: not a cubin", spec.name);
        for k in spec.kernels {
            assert!(
                m.ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX of {}",
                spec.name
            );
        }
        // No fused multiply-add other than the explicit fmaf calls: with --fmad=false the
        // kernels that use none must contain no fma instruction at all.
        if spec.name == "kv" {
            assert!(
                !m.ptx.contains("fma.rn.f32"),
                "kv.cu was contracted to FMAs"
            );
        }
    }
}

#[test]
fn kernels_compile_for_every_target_nvrtc_offers_from_ampere_on() {
    let Some(_) = nvrtc() else { return };
    for arch in ["sm_80", "sm_89", "sm_90"] {
        for spec in &source::MODULES {
            compile_module(spec, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        }
    }
}

#[test]
fn a_broken_module_reports_its_name_and_the_compiler_log() {
    let Some(_) = nvrtc() else { return };
    static BROKEN: source::ModuleSpec = source::ModuleSpec {
        name: "broken",
        source: "extern \"C\" __global__ void oops(float* x) { x[0] = undefined_name; }",
        kernels: &["oops"],
    };
    let e = compile_module(&BROKEN, "sm_90").expect_err("must not compile");
    let msg = e.to_string();
    assert!(msg.contains("broken") && msg.contains("sm_90"), "{msg}");
    assert!(msg.contains("undefined_name"), "the log is included: {msg}");
}
