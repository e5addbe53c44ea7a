//! The CUDA C sources (`kernels/cuda/*.cu`) and the registry of the kernels each module must
//! define. The host prepends `common.cuh` to every module (NVRTC gets no include path).

/// One NVRTC compilation unit and the kernels it must define.
#[derive(Clone, Copy, Debug)]
pub struct ModuleSpec {
    /// Module name (the `.cu` file stem), used in errors.
    pub name: &'static str,
    /// The module's own source (without the common prelude).
    pub source: &'static str,
    /// Every `extern "C" __global__` kernel the module defines; loading fails, naming the kernel,
    /// if one is missing.
    pub kernels: &'static [&'static str],
}

/// Device helpers shared by every module (bf16 conversions, the oracle's `exp`, lane scheme).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// Every module, in load order.
pub const MODULES: [ModuleSpec; 5] = [
    ModuleSpec {
        name: "elementwise",
        source: include_str!("../../cuda/elementwise.cu"),
        kernels: &[
            "embed_f32",
            "embed_bf16",
            "rmsnorm_to_f32",
            "rmsnorm_to_bf16",
            "swiglu_to_f32",
            "swiglu_to_bf16",
            "cast_f32_to_bf16",
            "cast_bf16_to_f32",
            "fill_f32",
            "dummy_fill_f32",
            "dummy_fill_bf16",
        ],
    },
    ModuleSpec {
        name: "kv",
        source: include_str!("../../cuda/kv.cu"),
        kernels: &[
            "rope_append_f32",
            "rope_append_bf16",
            "kv_copy_f32",
            "kv_copy_bf16",
        ],
    },
    ModuleSpec {
        name: "matmul",
        source: include_str!("../../cuda/matmul.cu"),
        kernels: &["matmul_exact_f32"],
    },
    ModuleSpec {
        name: "attention",
        source: include_str!("../../cuda/attention.cu"),
        kernels: &[
            "attention_exact_f32",
            "attention_fast_bf16",
            "attention_combine_bf16",
        ],
    },
    ModuleSpec {
        name: "sampling",
        source: include_str!("../../cuda/sampling.cu"),
        kernels: &["sample_rows"],
    },
];

impl ModuleSpec {
    /// The full text handed to NVRTC: the common prelude, then the module.
    pub fn full_source(&self) -> String {
        let mut s = String::with_capacity(COMMON.len() + self.source.len() + 64);
        s.push_str(COMMON);
        s.push_str("\n// ---- module ");
        s.push_str(self.name);
        s.push_str(" ----\n");
        s.push_str(self.source);
        s
    }
}

/// The module that defines `kernel`, if any.
pub fn module_of(kernel: &str) -> Option<&'static ModuleSpec> {
    MODULES.iter().find(|m| m.kernels.contains(&kernel))
}

/// Constants shared with the CUDA sources (each `#define` in the `.cu` files has the same value;
/// a unit test compares them).
pub mod consts {
    /// Keys per shared-memory tile of `attention_fast_bf16` (`FA_KT`).
    pub const FA_KT: usize = 32;
    /// Query rows (tokens × heads of a KV group) per block of `attention_fast_bf16`
    /// (`FA_MAX_ROWS`): 4 warps × 8 rows of register accumulators.
    pub const FA_MAX_ROWS: usize = 32;
    /// Largest head dimension `attention_fast_bf16` supports (`FA_MAX_HD`: 4 × 32 lanes).
    pub const FA_MAX_HD: usize = 128;
    /// Threads per block of `attention_fast_bf16` (its `__launch_bounds__`).
    pub const FA_THREADS: u32 = 128;
    /// Prefix of the sampling order the device sorts exactly (`SAMPLE_CAP`).
    pub const SAMPLE_CAP: usize = 4096;
    /// Threads per block of `sample_rows` (`SAMPLE_THREADS`).
    pub const SAMPLE_THREADS: u32 = 1024;
    /// `sample_rows` status: a token was chosen.
    pub const SAMPLE_TOKEN: u32 = 0;
    /// `sample_rows` status: every token was masked.
    pub const SAMPLE_NOTHING_ALLOWED: u32 = 1;
    /// `sample_rows` status: the host must sample this row (see sampling.cu).
    pub const SAMPLE_HOST: u32 = 2;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `#define NAME VALUE` of a source, parsed as an integer.
    fn define(src: &str, name: &str) -> Option<u64> {
        src.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some("#define") && it.next() == Some(name))
                .then(|| it.next())
                .flatten()
                .and_then(|v| {
                    let v = v.trim_end_matches('u');
                    match v.strip_prefix("0x") {
                        Some(h) => u64::from_str_radix(h, 16).ok(),
                        None => v.parse().ok(),
                    }
                })
        })
    }

    /// The source without `__launch_bounds__(..)` annotations (they sit between the return
    /// type and the name).
    fn without_launch_bounds(src: &str) -> String {
        let mut out = String::with_capacity(src.len());
        let mut rest = src;
        while let Some(i) = rest.find("__launch_bounds__(") {
            out.push_str(&rest[..i]);
            let after = &rest[i..];
            let close = after.find(')').expect("closing parenthesis");
            rest = &after[close + 1..];
        }
        out.push_str(rest);
        out
    }

    /// The source without launch bounds, with every run of whitespace made one space.
    fn normalized(src: &str) -> String {
        without_launch_bounds(src)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn every_registered_kernel_is_defined_as_extern_c_global_in_its_module() {
        for m in MODULES {
            let src = normalized(m.source);
            for k in m.kernels {
                let pos = src
                    .find(&format!("void {k}("))
                    .unwrap_or_else(|| panic!("kernel {k} is not defined in {}.cu", m.name));
                let before = &src[..pos];
                let decl = before.rfind("extern \"C\"").expect("extern C");
                assert_eq!(
                    &before[decl..],
                    "extern \"C\" __global__ ",
                    "{k} is not an extern \"C\" __global__ kernel"
                );
            }
        }
    }

    #[test]
    fn every_extern_c_kernel_in_the_sources_is_registered() {
        for m in MODULES {
            let src = normalized(m.source);
            for (i, _) in src.match_indices("extern \"C\" __global__") {
                let rest = &src[i..];
                let open = rest.find('(').expect("parameter list");
                let name = rest[..open].split_whitespace().last().expect("name");
                assert!(
                    m.kernels.contains(&name),
                    "{name} in {}.cu is not registered",
                    m.name
                );
            }
        }
    }

    #[test]
    fn host_constants_match_the_cuda_defines() {
        let att = MODULES[3].source;
        let smp = MODULES[4].source;
        assert_eq!(define(att, "FA_KT"), Some(consts::FA_KT as u64));
        assert_eq!(define(att, "FA_MAX_ROWS"), Some(consts::FA_MAX_ROWS as u64));
        assert_eq!(define(att, "FA_MAX_HD"), Some(consts::FA_MAX_HD as u64));
        assert_eq!(define(smp, "SAMPLE_CAP"), Some(consts::SAMPLE_CAP as u64));
        assert_eq!(
            define(smp, "SAMPLE_THREADS"),
            Some(consts::SAMPLE_THREADS as u64)
        );
        assert_eq!(
            define(smp, "SAMPLE_TOKEN"),
            Some(consts::SAMPLE_TOKEN as u64)
        );
        assert_eq!(
            define(smp, "SAMPLE_NOTHING_ALLOWED"),
            Some(consts::SAMPLE_NOTHING_ALLOWED as u64)
        );
        assert_eq!(define(smp, "SAMPLE_HOST"), Some(consts::SAMPLE_HOST as u64));
        assert!(att.contains("__launch_bounds__(128)"));
        assert!(smp.contains("__launch_bounds__(1024)"));
    }

    #[test]
    fn sources_use_no_includes() {
        assert!(!COMMON.contains("#include"));
        for m in MODULES {
            assert!(
                !m.source.contains("#include"),
                "{} includes a header",
                m.name
            );
        }
    }

    /// The value of `#define NAME __uint_as_float(0x...u)` in the common prelude.
    fn f32_define(name: &str) -> f32 {
        let line = COMMON
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} is not defined"));
        let hex = line
            .split("__uint_as_float(0x")
            .nth(1)
            .and_then(|r| r.split('u').next())
            .unwrap_or_else(|| panic!("{name} is not a bit pattern"));
        f32::from_bits(u32::from_str_radix(hex, 16).expect("hex"))
    }

    /// The device `exp_f32` transcribed with the constants read from common.cuh.
    fn device_exp(x: f32) -> f32 {
        let x = x.min(f32_define("ZL_EXP_HI"));
        if x < f32_define("ZL_EXP_LO") {
            return 0.0;
        }
        let n = (x * f32_define("ZL_LOG2E")).round_ties_even();
        let r = n.mul_add(-f32_define("ZL_LN2_HI"), x);
        let r = n.mul_add(-f32_define("ZL_LN2_LO"), r);
        let mut p = f32_define("ZL_EXP_P0");
        for c in [
            "ZL_EXP_P1",
            "ZL_EXP_P2",
            "ZL_EXP_P3",
            "ZL_EXP_P4",
            "ZL_EXP_P5",
        ] {
            p = p.mul_add(r, f32_define(c));
        }
        let y = p.mul_add(r * r, r) + 1.0;
        y * f32::from_bits((((n as i32) + 127) as u32) << 23)
    }

    #[test]
    fn the_device_exp_constants_reproduce_the_cpu_exp_bit_for_bit() {
        let mut x = -90.0f32;
        while x < 90.0 {
            assert_eq!(
                device_exp(x).to_bits(),
                crate::cpu::exp_f32(x).to_bits(),
                "exp({x})"
            );
            x += 0.00731;
        }
        for x in [
            f32::NEG_INFINITY,
            -87.33655,
            -87.3365,
            0.0,
            -0.0,
            88.0,
            1e30,
        ] {
            assert_eq!(
                device_exp(x).to_bits(),
                crate::cpu::exp_f32(x).to_bits(),
                "exp({x})"
            );
        }
        assert_eq!(f32_define("ZL_TWO_M24"), 1.0 / (1u32 << 24) as f32);
    }
}
