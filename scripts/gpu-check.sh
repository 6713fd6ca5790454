#!/usr/bin/env bash
# scripts/gpu-check.sh [OUTDIR] -- the whole GPU check on an H100/H200 machine
# (docs/design/gpu.md). Run from the repository root. It builds the GPU part alone with the
# machine's cc against CUDA's cuda.h and OpenSSL's libcrypto (the pool's prefix keys) and
# the kernels with its nvcc; where OpenSSL's headers or library are missing there, it runs
# the binaries `make GPU=1` built here instead (libcrypto linked in, glibc >= 2.34: carry
# build/gpu/pagekv-gpu and build/gpu/pagekv-gpu-test). It prints the driver and the device, runs
# the GPU tests (tests/support/gpu_cases.c) and `pagekv bench gpu`, and writes their
# output under OUTDIR (default: $OUT, else ./gpu-check-out). About 1-2 minutes on an H100;
# bounded by timeouts well under 5. Exit 0 when the tests pass and the bench ran.
set -u
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out" || exit 1
cuda=${CUDA:-/usr/local/cuda}
if [ ! -f "$cuda/include/cuda.h" ] && command -v nvcc >/dev/null; then
    cuda=$(dirname "$(dirname "$(command -v nvcc)")")
fi
{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
    command -v nvcc >/dev/null && nvcc --version | tail -2
    cc --version | head -1
    echo "cuda.h: $cuda/include/cuda.h"
} | tee "$out/device.txt"
bin=$(mktemp -d)
flags=(-std=c11 -O2 -g -pthread -D_GNU_SOURCE -DPKV_GPU=1 -Iinclude -Isrc -I. "-I$cuda/include")
core=(src/gpu/driver.c src/gpu/arena.c src/gpu/attn.c src/gpu/kv_storage.c src/kv/kv.c
      src/kv/pool.c src/kv/dense.c src/prim/*.c src/core/core.c src/core/fault.c)
# The kernels: without them the arena tests and parts of the bench still run (the decode
# test and section say they were skipped).
nvcc=${NVCC:-$cuda/bin/nvcc}
kflags=(-fatbin -O3 -gencode arch=compute_90,code=sm_90 -o "$bin/pagekv-kernels.fatbin")
: >"$out/build.txt"
"$nvcc" "${kflags[@]}" src/gpu/kernels.cu 2>>"$out/build.txt" ||
    "$nvcc" "${kflags[@]}" -allow-unsupported-compiler src/gpu/kernels.cu 2>>"$out/build.txt" ||
    { [ -f build/gpu/pagekv-kernels.fatbin ] && cp build/gpu/pagekv-kernels.fatbin "$bin/" &&
      echo "gpu-check: NOTE nvcc failed here (build.txt); using the kernels built by make GPU=1"; } ||
    echo "gpu-check: nvcc could not build the kernels (build.txt); going on without them"
# The pool's prefix keys need OpenSSL (libcrypto). Where the machine lacks its headers, the
# binaries `make GPU=1` built here (libcrypto linked in statically, glibc >= 2.34) are used:
# carry build/gpu/pagekv-gpu and build/gpu/pagekv-gpu-test.
if ! cc "${flags[@]}" -o "$bin/pagekv-gpu-test" tests/gpu/main.c tests/support/gpu_cases.c \
        "${core[@]}" -lcrypto -ldl -lm 2>>"$out/build.txt" ||
   ! cc "${flags[@]}" -o "$bin/pagekv-gpu" tools/standalone/pagekv_gpu.c bench/bench_gpu.c bench/bench_gpu_replay.c \
        "${core[@]}" -lcrypto -ldl -lm 2>>"$out/build.txt"; then
    if grep -q -e 'openssl/' -e 'lcrypto' "$out/build.txt" &&
       [ -x build/gpu/pagekv-gpu-test ] && [ -x build/gpu/pagekv-gpu ]; then
        echo "gpu-check: no OpenSSL here (build.txt); using the carried build/gpu binaries"
        cp build/gpu/pagekv-gpu-test build/gpu/pagekv-gpu "$bin/"
    else
        cat "$out/build.txt"
        echo "gpu-check: the build failed (above)"
        exit 1
    fi
fi
echo "== GPU tests"
timeout 150 "$bin/pagekv-gpu-test" "$bin/pagekv-kernels.fatbin" 2>&1 | tee "$out/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "== pagekv bench gpu"
timeout 200 "$bin/pagekv-gpu" --kernels "$bin/pagekv-kernels.fatbin" --json "$out/bench-gpu.json" \
    2>&1 | tee "$out/bench-gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "gpu-check: tests exit $tests_rc, bench exit $bench_rc; output in $out"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
