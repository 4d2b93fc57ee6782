#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip (reported as "Skipped") where there is no
# CUDA device; run this on a Hopper machine to exercise them. Then, on the CPU:
#   - the CPU tests once more in a CPU-only clang build with AddressSanitizer and
#     UndefinedBehaviorSanitizer (build-asan/; the tool the tests run is instrumented too);
#   - the fuzz target of the safetensors parser and the checkpoint loader, with the seed corpus
#     of tests/fuzz/corpus, for MEGAMOE_FUZZ_SECONDS (default 60).
# MEGAMOE_SANITIZE=0 skips both (e.g. on the GPU machine). Each stage's time is printed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${MEGAMOE_BUILD_DIR:-${ROOT}/build}"
ASAN_BUILD="${MEGAMOE_ASAN_BUILD_DIR:-${ROOT}/build-asan}"
FUZZ_SECONDS="${MEGAMOE_FUZZ_SECONDS:-60}"
JOBS="$(nproc)"

stage() {
  local name="$1"
  shift
  local start=$SECONDS
  echo "test.sh: === ${name}" >&2
  "$@"
  echo "test.sh: === ${name}: $((SECONDS - start)) s" >&2
}

stage "setup" "${ROOT}/scripts/setup.sh"
stage "build" bash -c "cmake -S '${ROOT}' -B '${BUILD}' -G Ninja -DCMAKE_BUILD_TYPE=Release &&
                       cmake --build '${BUILD}' -j ${JOBS}"
stage "tests" ctest --test-dir "${BUILD}" --output-on-failure -j "${JOBS}" "$@"

if [ "${MEGAMOE_SANITIZE:-1}" = 0 ]; then
  echo "test.sh: MEGAMOE_SANITIZE=0: sanitizer tests and fuzzing skipped" >&2
  exit 0
fi

# -O1 keeps the instrumented tests quick; every sanitizer report is fatal (the build passes
# -fno-sanitize-recover=all), and leaks are reported at exit.
stage "sanitizer build" bash -c "CC=clang CXX=clang++ cmake -S '${ROOT}' -B '${ASAN_BUILD}' -G Ninja \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG='-O1 -g' -DMEGAMOE_CUDA=OFF \
    -DMEGAMOE_SANITIZE=ON -DMEGAMOE_FUZZ=ON && cmake --build '${ASAN_BUILD}' -j ${JOBS}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
stage "sanitizer tests" ctest --test-dir "${ASAN_BUILD}" --output-on-failure -j "${JOBS}" -L cpu

# New inputs go to a scratch corpus; the committed seeds are only read. A crash leaves its input
# as ${ASAN_BUILD}/fuzz-crash-* (replay: megamoe_fuzz_checkpoint FILE).
fuzz_corpus="$(mktemp -d)"
trap 'rm -rf "${fuzz_corpus}"' EXIT
stage "fuzz (${FUZZ_SECONDS} s)" "${ASAN_BUILD}/megamoe_fuzz_checkpoint" \
  -max_total_time="${FUZZ_SECONDS}" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="${ASAN_BUILD}/fuzz-" "${fuzz_corpus}" "${ROOT}/tests/fuzz/corpus"
