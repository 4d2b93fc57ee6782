#!/usr/bin/env bash
# Installs every build and test dependency of nvfp4-megamoe on a fresh Debian 12 machine with the
# CUDA 13 toolkit: Debian packages (compiler tools, GoogleTest, nlohmann-json, CLI11; clang with
# its sanitizer and libFuzzer runtimes for the sanitizer build and the fuzz run of
# scripts/test.sh) and the CUTLASS/CuTe C++ headers from the pinned `nvidia-cutlass` PyPI wheel
# (hash-checked; only the headers are unpacked, into the git-ignored third_party/cutlass).
# Without a CUDA toolkit it prepares a CPU-only build (CMake then defaults to MEGAMOE_CUDA=OFF)
# and skips CUTLASS, which only the device code needs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUTLASS_VERSION="4.2.0.0"
CUTLASS_WHEEL="nvidia_cutlass-${CUTLASS_VERSION}-py3-none-any.whl"
CUTLASS_SHA256="f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6"
CUTLASS_DIR="${ROOT}/third_party/cutlass"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

DEBS=(cmake ninja-build g++ libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev unzip python3-pip
      clang libclang-rt-14-dev)
missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

have_cuda=1
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no CUDA toolkit (nvcc in PATH or /usr/local/cuda): only the CPU-only build" \
       "(MEGAMOE_CUDA=OFF) is possible here; the GPU code needs the CUDA 13 toolkit" >&2
  have_cuda=0
fi

# The nlohmann-json headers of the Debian package, vendored into the git-ignored
# third_party/nlohmann: CMake falls back to them where the package cannot be installed (the GPU
# machine that builds only the library and the Python extension gets third_party/ carried along).
NLOHMANN_DIR="${ROOT}/third_party/nlohmann"
nlohmann_version="$(dpkg-query -W -f='${Version}' nlohmann-json3-dev)"
if [ "$(cat "${NLOHMANN_DIR}/.version" 2>/dev/null)" != "${nlohmann_version}" ]; then
  rm -rf "${NLOHMANN_DIR}"
  mkdir -p "${NLOHMANN_DIR}/include"
  cp -r /usr/include/nlohmann "${NLOHMANN_DIR}/include/"
  echo "${nlohmann_version}" > "${NLOHMANN_DIR}/.version"
fi

stamp="${CUTLASS_DIR}/.version"
if [ "${have_cuda}" = 1 ] && [ "$(cat "$stamp" 2>/dev/null)" != "${CUTLASS_VERSION}" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "setup: fetching CUTLASS ${CUTLASS_VERSION} headers (PyPI nvidia-cutlass)" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "nvidia-cutlass==${CUTLASS_VERSION}" -d "$tmp"
  echo "${CUTLASS_SHA256}  ${tmp}/${CUTLASS_WHEEL}" | sha256sum --check --quiet - || {
    echo "setup: ${CUTLASS_WHEEL} does not have the pinned sha256 ${CUTLASS_SHA256}" >&2
    exit 1
  }
  rm -rf "${CUTLASS_DIR}"
  mkdir -p "${CUTLASS_DIR}"
  unzip -q "${tmp}/${CUTLASS_WHEEL}" 'cutlass_library/source/include/*' -d "$tmp/x"
  mv "$tmp/x/cutlass_library/source/include" "${CUTLASS_DIR}/include"
  echo "${CUTLASS_VERSION}" > "$stamp"
fi
if [ "${have_cuda}" = 1 ]; then
  echo "setup: dependencies ready (CUTLASS headers in ${CUTLASS_DIR}/include)" >&2
else
  echo "setup: dependencies of the CPU-only build ready" >&2
fi
