#!/usr/bin/env bash
# Installs every build and test dependency of nvfp4-megamoe on a fresh Debian 12 machine with the
# CUDA 13 toolkit: Debian packages (compiler tools, GoogleTest, nlohmann-json, CLI11; clang with
# its sanitizer and libFuzzer runtimes for the sanitizer build and the fuzz run of
# scripts/test.sh) and the CUTLASS/CuTe C++ headers from the pinned `nvidia-cutlass` PyPI wheel
# (hash-checked; only the headers are unpacked, into the git-ignored third_party/cutlass) and
# NCCL 2.28.9 from the pinned `nvidia-nccl-cu13` wheel (headers and libnccl.so.2, into
# third_party/nccl).
# Without a CUDA toolkit it prepares a CPU-only build (CMake then defaults to MEGAMOE_CUDA=OFF)
# and skips CUTLASS and NCCL, which only the device code needs.
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

# Fetches a pinned PyPI wheel (no dependencies), checks its sha256, unpacks the members matching
# the given patterns into a temporary folder and runs the caller's install step on it; skipped
# where DEST/.version already names the version.
fetch_wheel() {  # NAME VERSION WHEEL SHA256 DEST INSTALL_FN PATTERN...
  local name="$1" version="$2" wheel="$3" sha="$4" dest="$5" install="$6"
  shift 6
  if [ "$(cat "${dest}/.version" 2>/dev/null)" = "${version}" ]; then return 0; fi
  local tmp
  tmp="$(mktemp -d)"
  echo "setup: fetching ${name}==${version} (PyPI)" >&2
  python3 -m pip download --quiet --no-deps --only-binary=:all: "${name}==${version}" -d "$tmp"
  echo "${sha}  ${tmp}/${wheel}" | sha256sum --check --quiet - || {
    echo "setup: ${wheel} does not have the pinned sha256 ${sha}" >&2
    rm -rf "$tmp"
    exit 1
  }
  unzip -q "${tmp}/${wheel}" "$@" -d "$tmp/x"
  rm -rf "${dest}"
  mkdir -p "${dest}"
  "${install}" "$tmp/x" "${dest}"
  rm -rf "$tmp"
  echo "${version}" > "${dest}/.version"
}

install_cutlass() { mv "$1/cutlass_library/source/include" "$2/include"; }
# NCCL 2.28.9 (expert parallelism, src/ep): the headers and libnccl.so.2 of the version the GPU
# machines' torch ships.
install_nccl() {
  mv "$1/nvidia/nccl/include" "$1/nvidia/nccl/lib" "$2/"
  ln -sf libnccl.so.2 "$2/lib/libnccl.so"
}
NCCL_VERSION="2.28.9"
NCCL_DIR="${ROOT}/third_party/nccl"

if [ "${have_cuda}" = 1 ]; then
  fetch_wheel nvidia-cutlass "${CUTLASS_VERSION}" "${CUTLASS_WHEEL}" "${CUTLASS_SHA256}" "${CUTLASS_DIR}" \
    install_cutlass 'cutlass_library/source/include/*'
  fetch_wheel nvidia-nccl-cu13 "${NCCL_VERSION}" "nvidia_nccl_cu13-${NCCL_VERSION}-py3-none-manylinux_2_18_x86_64.whl" \
    e4553a30f34195f3fa1da02a6da3d6337d28f2003943aa0a3d247bbc25fefc42 "${NCCL_DIR}" \
    install_nccl 'nvidia/nccl/include/*' 'nvidia/nccl/lib/*'
  echo "setup: dependencies ready (CUTLASS headers in ${CUTLASS_DIR}/include, NCCL in ${NCCL_DIR})" >&2
else
  echo "setup: dependencies of the CPU-only build ready" >&2
fi
