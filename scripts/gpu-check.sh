#!/usr/bin/env bash
# GPU check of the CUDA backend, in two phases (the device machine has no Rust toolchain and no
# network):
#
#   scripts/gpu-check.sh build   # here: release-build the `zerolayer` binary and the GPU test
#                                # binaries, strip them, copy them and stories260K to .device/
#   scripts/gpu-check.sh run     # on the GPU machine, from the repository root (with .device/
#                                # carried): nvidia-smi, find the CUDA libraries, run the GPU
#                                # tests and `zerolayer bench gpu` (dummy:8b, bf16), and write
#                                # $OUT/gpu-results.json and $OUT/gpu-check.log
#
# Budget: the run phase stays under 8 minutes (tests ≤ 240 s, benchmark ≤ 150 s, each under
# `timeout`); every step runs even if an earlier one failed, and the results file says which
# failed. Environment: CARGO_TARGET_DIR (build), ZEROLAYER_MODELS_DIR (build: where
# stories260K is; default ../shared/models), OUT (run: output folder; default .device/out),
# GPU_CHECK_BENCH_ARGS (run: extra `bench gpu` arguments).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEV="$ROOT/.device"
# .device/ must stay well under the device tool's 64 MiB working-tree limit.
MAX_DEVICE_BYTES=$((56 * 1024 * 1024))

die() { echo "gpu-check: $*" >&2; exit 1; }

build() {
    set -e
    cd "$ROOT"
    local target="${CARGO_TARGET_DIR:-$ROOT/target}"
    export CARGO_TARGET_DIR="$target"
    local models="${ZEROLAYER_MODELS_DIR:-$ROOT/../shared/models}"
    [ -f "$models/stories260K/stories260K.bin" ] || die "stories260K not found under $models"
    echo "== building release binaries into $target"
    cargo build --release -p zerolayer-cli --bin zerolayer
    local json
    json="$(mktemp)"
    cargo test --release --no-run -p zerolayer-tests --test gpu --message-format=json >"$json"
    cargo test --release --no-run -p zerolayer-kernels --test nvrtc --message-format=json >>"$json"
    local gpu_tests nvrtc_tests
    gpu_tests="$(jq -r 'select(.reason == "compiler-artifact" and .target.name == "gpu" and .executable != null) | .executable' "$json" | tail -1)"
    nvrtc_tests="$(jq -r 'select(.reason == "compiler-artifact" and .target.name == "nvrtc" and .executable != null) | .executable' "$json" | tail -1)"
    rm -f "$json"
    [ -x "$gpu_tests" ] || die "GPU test executable not found in cargo's output"
    [ -x "$nvrtc_tests" ] || die "NVRTC test executable not found in cargo's output"
    rm -rf "$DEV"
    mkdir -p "$DEV/bin" "$DEV/models/stories260K"
    cp "$target/release/zerolayer" "$DEV/bin/zerolayer"
    cp "$gpu_tests" "$DEV/bin/gpu-tests"
    cp "$nvrtc_tests" "$DEV/bin/nvrtc-tests"
    strip "$DEV/bin/"*
    cp "$models/stories260K/stories260K.bin" "$models/stories260K/tok512.bin" "$DEV/models/stories260K/"
    {
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
        echo "host: $(uname -m), $(ldd --version | head -1)"
    } >"$DEV/manifest.txt"
    local bytes
    bytes="$(du -sb "$DEV" | cut -f1)"
    ls -l "$DEV/bin" "$DEV/models/stories260K"
    echo "== .device/ holds $((bytes / 1024 / 1024)) MiB"
    [ "$bytes" -lt "$MAX_DEVICE_BYTES" ] || die ".device/ is $bytes bytes, above $MAX_DEVICE_BYTES"
}

# Prints the directories holding a library matching $1 (e.g. 'libnvrtc.so*').
find_lib_dirs() {
    local pattern="$1" dirs=()
    local site
    site="$(python3 -c 'import site, sys; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)"
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 \
        /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && dirs+=("$d")
    done
    for s in $site /opt/torch/.venv/lib/python3*/site-packages; do
        [ -d "$s/nvidia" ] || continue
        for d in "$s"/nvidia/*/lib "$s"/nvidia/cu1*/lib; do
            [ -d "$d" ] && dirs+=("$d")
        done
    done
    for d in "${dirs[@]}"; do
        if compgen -G "$d/$pattern" >/dev/null; then
            echo "$d"
        fi
    done | awk '!seen[$0]++'
}

run() {
    cd "$ROOT"
    [ -x "$DEV/bin/gpu-tests" ] || die "run 'scripts/gpu-check.sh build' first (and carry .device)"
    local out="${OUT:-$DEV/out}"
    mkdir -p "$out"
    OUT="$out" run_body 2>&1 | tee "$out/gpu-check.log"
}

run_body() {
    local out="$OUT"
    local started
    started="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "== gpu-check run, $started"
    cat "$DEV/manifest.txt" 2>/dev/null
    echo "== nvidia-smi"
    nvidia-smi || echo "nvidia-smi failed"
    local smi
    smi="$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)"

    echo "== CUDA libraries"
    local libdirs=() found=()
    for lib in 'libcuda.so*' 'libnvrtc.so*' 'libcublas.so*' 'libcublasLt.so*'; do
        local first=""
        while read -r d; do
            [ -n "$d" ] || continue
            [ -z "$first" ] && first="$d"
            libdirs+=("$d")
        done < <(find_lib_dirs "$lib")
        echo "  $lib: ${first:-NOT FOUND}"
        found+=("$lib=${first:-missing}")
    done
    local ldpath
    ldpath="$(printf '%s\n' "${libdirs[@]}" | awk '!seen[$0]++' | paste -sd: -)"
    export LD_LIBRARY_PATH="${ldpath}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "  LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    export ZEROLAYER_MODELS_DIR="$DEV/models"

    echo "== NVRTC compile test (sm_90)"
    local nvrtc_rc=0
    ZEROLAYER_REQUIRE_NVRTC=1 timeout 60 "$DEV/bin/nvrtc-tests" --test-threads=1 --nocapture >"$out/nvrtc-tests.txt" 2>&1 || nvrtc_rc=$?
    cat "$out/nvrtc-tests.txt"

    echo "== GPU tests (ZEROLAYER_GPU_TESTS=1, ZEROLAYER_CUDA_SYNC=1: faults name their kernel)"
    local tests_rc=0
    ZEROLAYER_GPU_TESTS=1 ZEROLAYER_CUDA_SYNC=1 RUST_BACKTRACE=1 timeout 240 \
        "$DEV/bin/gpu-tests" --test-threads=1 --nocapture >"$out/gpu-tests.txt" 2>&1 || tests_rc=$?
    cat "$out/gpu-tests.txt"

    echo "== bench gpu (dummy:8b, bf16)"
    local bench_rc=0
    # shellcheck disable=SC2086
    timeout 150 "$DEV/bin/zerolayer" bench gpu --model dummy:8b --dtype bf16 \
        --json "$out/bench-gpu.json" ${GPU_CHECK_BENCH_ARGS:-} || bench_rc=$?

    echo "== results"
    STARTED="$started" SMI="$smi" LIBS="${found[*]}" NVRTC_RC="$nvrtc_rc" TESTS_RC="$tests_rc" \
        BENCH_RC="$bench_rc" OUTDIR="$out" python3 - <<'PY'
import json, os, re
out = os.environ["OUTDIR"]
def read(name):
    try:
        return open(os.path.join(out, name), errors="replace").read()
    except OSError:
        return ""
def summary(text):
    m = re.findall(r"test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored", text)
    failed = []
    sections = text.split("\nfailures:\n")
    if len(sections) > 1:
        for line in sections[-1].splitlines():
            if not line.startswith("    "):
                break
            failed.append(line.strip())
    if not m:
        return {"ran": False, "failed_tests": failed}
    ok, p, f, i = m[-1]
    return {"ran": True, "ok": ok == "ok", "passed": int(p), "failed": int(f), "ignored": int(i), "failed_tests": failed}
bench = None
try:
    bench = json.load(open(os.path.join(out, "bench-gpu.json")))
except (OSError, ValueError):
    pass
res = {
    "started": os.environ["STARTED"],
    "gpu": os.environ["SMI"],
    "libraries": os.environ["LIBS"].split(),
    "nvrtc_tests": {"exit_code": int(os.environ["NVRTC_RC"]), **summary(read("nvrtc-tests.txt"))},
    "gpu_tests": {"exit_code": int(os.environ["TESTS_RC"]), **summary(read("gpu-tests.txt"))},
    "bench": {"exit_code": int(os.environ["BENCH_RC"]), "report": bench},
}
json.dump(res, open(os.path.join(out, "gpu-results.json"), "w"), indent=2)
print(json.dumps({k: v for k, v in res.items() if k != "bench"}, indent=2))
if bench:
    b = bench
    print(f"bandwidth {b['copy_bandwidth_bytes_per_s']/1e9:.0f} GB/s | decode b1 {b['decode_batch1']['ms_per_token']:.2f} ms/token "
          f"({100*b['decode_batch1']['fraction_of_floor']:.0f}% of floor {b['decode_batch1']['floor_ms_per_token']:.2f} ms) | "
          f"prefill {b['prefill']['tokens_per_s']:.0f} tok/s | decode b{b['decode_batched']['batch']} "
          f"{b['decode_batched']['tokens_per_s']:.0f} tok/s | TTFT turn {b['ttft']['turn']} {b['ttft']['with_reuse_ms']:.1f} ms reuse vs "
          f"{b['ttft']['without_reuse_ms']:.1f} ms")
PY
    echo "== done: nvrtc=$nvrtc_rc tests=$tests_rc bench=$bench_rc (files in $out)"
    [ "$nvrtc_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
}

case "${1:-}" in
    build) build ;;
    run) run ;;
    *) die "usage: $0 build|run" ;;
esac
