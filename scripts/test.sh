#!/usr/bin/env bash
# Sets up, builds and runs every test. GPU tests skip (reported as "Skipped") where there is no
# CUDA device; run this on a Hopper machine to exercise them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${MEGAMOE_BUILD_DIR:-${ROOT}/build}"
"${ROOT}/scripts/setup.sh"
cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "${BUILD}" -j "$(nproc)"
ctest --test-dir "${BUILD}" --output-on-failure -j "$(nproc)" "$@"
