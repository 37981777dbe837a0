#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds a release and an
# AddressSanitizer + UndefinedBehaviorSanitizer build, runs every test in both.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc 2>/dev/null || echo 2)

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
# built (not run) so that they cannot rot: the micro-benchmarks, the fuzz harnesses (compiled only)
cmake --build build -j "$jobs" --target bench_kernels bench_grammar bench_sampler fuzz_compile
ctest --test-dir build --output-on-failure -j "$jobs"
# The kernels and what runs on them again at each lower SIMD level the CPU is
# forced down to (every level must agree with the float references).
simd_tests='test_kernels|test_kv_quant|test_kv_cache|test_batch|test_forward_refs|test_kv_model|test_paged$'
for level in scalar avx2; do
  echo "== KVQ_SIMD=$level"
  KVQ_SIMD=$level ctest --test-dir build --output-on-failure -j "$jobs" -R "$simd_tests"
done

# Everything built again with clang: the warning flags (-Wall -Wextra -Werror) hold for
# both compilers, and clang compiles the SIMD kernels its own way (the kernels' tests
# check them; the rest of the suite runs in the release and sanitizer builds).
echo "== clang"
cmake -S . -B build-clang -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang >/dev/null
cmake --build build-clang -j "$jobs"
cmake --build build-clang -j "$jobs" --target bench_kernels bench_sampler
ctest --test-dir build-clang --output-on-failure -j "$jobs" -R "$simd_tests"

# The CUDA backend is compiled wherever nvcc is (CI has it, without a GPU) so it
# cannot rot; its test skips without a GPU (run it on a GPU machine). One architecture
# (sm_90a, a superset of the code) is enough to check that it compiles: nvcc builds each
# listed one separately, and the default's PTX for newer GPUs adds 60% to nvcc's time.
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc" ]; then
  echo "== CUDA backend ($nvcc)"
  cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_CUDA_ARCHITECTURES=90a-real >/dev/null
  cmake --build build-cuda -j "$jobs"
  ctest --test-dir build-cuda --output-on-failure -R 'test_cuda$'
fi

cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVQ_SANITIZE=ON -DCMAKE_C_FLAGS_DEBUG="-O1 -g" >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -LE slow
