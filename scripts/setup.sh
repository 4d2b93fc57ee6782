#!/usr/bin/env bash
# Installs every build and test dependency of nvfp4-megamoe on a fresh Debian 12 machine with the
# CUDA 13 toolkit: Debian packages (compiler tools, GoogleTest, nlohmann-json, CLI11) and the
# CUTLASS/CuTe C++ headers from the pinned `nvidia-cutlass` PyPI wheel (hash-checked; only the
# headers are unpacked, into the git-ignored third_party/cutlass).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUTLASS_VERSION="4.2.0.0"
CUTLASS_WHEEL="nvidia_cutlass-${CUTLASS_VERSION}-py3-none-any.whl"
CUTLASS_SHA256="f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6"
CUTLASS_DIR="${ROOT}/third_party/cutlass"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

DEBS=(cmake ninja-build g++ libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev unzip python3-pip)
missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: the CUDA 13 toolkit (nvcc) is required and was not found in PATH or /usr/local/cuda" >&2
  exit 1
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
if [ "$(cat "$stamp" 2>/dev/null)" != "${CUTLASS_VERSION}" ]; then
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
# NCCL 2.28.9 (expert parallelism): the headers and libnccl.so.2 of the pinned PyPI wheel, the
# version the GPU machines' torch ships, unpacked into the git-ignored third_party/nccl.
NCCL_VERSION="2.28.9"
NCCL_WHEEL="nvidia_nccl_cu13-${NCCL_VERSION}-py3-none-manylinux_2_18_x86_64.whl"
NCCL_SHA256="e4553a30f34195f3fa1da02a6da3d6337d28f2003943aa0a3d247bbc25fefc42"
NCCL_DIR="${ROOT}/third_party/nccl"
if [ "$(cat "${NCCL_DIR}/.version" 2>/dev/null)" != "${NCCL_VERSION}" ]; then
  tmp_nccl="$(mktemp -d)"
  echo "setup: fetching NCCL ${NCCL_VERSION} (PyPI nvidia-nccl-cu13)" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "nvidia-nccl-cu13==${NCCL_VERSION}" -d "$tmp_nccl"
  echo "${NCCL_SHA256}  ${tmp_nccl}/${NCCL_WHEEL}" | sha256sum --check --quiet - || {
    echo "setup: ${NCCL_WHEEL} does not have the pinned sha256 ${NCCL_SHA256}" >&2
    exit 1
  }
  rm -rf "${NCCL_DIR}"
  mkdir -p "${NCCL_DIR}"
  unzip -q "${tmp_nccl}/${NCCL_WHEEL}" 'nvidia/nccl/include/*' 'nvidia/nccl/lib/*' -d "$tmp_nccl/x"
  mv "$tmp_nccl/x/nvidia/nccl/include" "$tmp_nccl/x/nvidia/nccl/lib" "${NCCL_DIR}/"
  ln -sf libnccl.so.2 "${NCCL_DIR}/lib/libnccl.so"
  rm -rf "$tmp_nccl"
  echo "${NCCL_VERSION}" > "${NCCL_DIR}/.version"
fi
echo "setup: dependencies ready (CUTLASS headers in ${CUTLASS_DIR}/include, NCCL in ${NCCL_DIR})" >&2
