#!/usr/bin/env bash
# Runs the CUDA kernels (kernels/cuda/*.cu) on a CPU emulator (kernels/cuda/emu/emu.h) against
# reference implementations (kernels/cuda/emu/test_kernels.cpp). Needs only g++: a check of
# the kernels' logic (indexing, synchronisation, exact operation order, the sampler's
# algorithm) on machines without a GPU. It cannot catch what the emulator does not model
# (memory-model races beyond __syncthreads, device-specific math, performance).
#
#   scripts/cuda-emulate.sh [TEST]   # TEST: matmul_exact, rowwise, rope_attention_exact,
#                                    # fast_attention, kv_copy, sampling (default: all)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CXX="${CXX:-g++}"
command -v "$CXX" >/dev/null || { echo "SKIPPED: no C++ compiler ($CXX)"; exit 0; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
{
    cat "$ROOT/kernels/cuda/common.cuh"
    for m in elementwise kv matmul attention sampling; do
        cat "$ROOT/kernels/cuda/$m.cu"
    done
} | sed -E 's/extern __shared__ float ([A-Za-z_]+)\[\];/float* \1 = (float*)emu::g_dyn_smem.data();/' >"$WORK/kernels_all.inc"
"$CXX" -std=c++17 -O2 -ffp-contract=off -fno-fast-math -Wall -Wno-unused-function -Wno-unknown-pragmas \
    -I "$ROOT/kernels/cuda/emu" -I "$WORK" "$ROOT/kernels/cuda/emu/test_kernels.cpp" -o "$WORK/test_kernels"
"$WORK/test_kernels" "$@"
