#!/usr/bin/env bash
# The parity suite: megamoe's quantize, dequantize and reference against what the real
# nvidia-modelopt, llm-compressor/compressed-tensors and transformers write and compute, on tiny
# Qwen3-MoE and DeepSeek-V3 models built here (tests/parity/*.py say what is checked).
#
#   tests/parity/run.sh [PYTEST_ARGS...]
#
# Needs the built tool: $MEGAMOE_BUILD_DIR/megamoe (default build/megamoe). The Python packages
# (requirements.txt, every one pinned) live in a virtual environment under
# $MEGAMOE_PARITY_CACHE (default ~/.cache/megamoe-parity), one per hash of requirements.txt and
# the Python version, built on first use (several GB: torch from PyPI is its CUDA build) and
# reused after; older ones are removed. PARITY_WORK=DIR keeps the exports in DIR (reused by a
# later run with the same DIR) instead of a temporary directory.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"
BUILD="${MEGAMOE_BUILD_DIR:-${ROOT}/build}"
MEGAMOE_BIN="${BUILD}/megamoe"
if [ ! -x "${MEGAMOE_BIN}" ]; then
  echo "parity: ${MEGAMOE_BIN} does not exist; build it first (cmake --build ${BUILD} --target megamoe)" >&2
  exit 1
fi

# shellcheck source=../../scripts/cached_venv.sh
source "${ROOT}/scripts/cached_venv.sh"
cached_venv parity "${HERE}/requirements.txt" \
  "${MEGAMOE_PARITY_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/megamoe-parity}"

WORK="${PARITY_WORK:-}"
if [ -z "${WORK}" ]; then
  WORK="$(mktemp -d -t megamoe-parity.XXXXXX)"
  trap 'rm -rf "${WORK}"' EXIT
fi
mkdir -p "${WORK}"
cd "${HERE}"
# No hub, no telemetry: everything the suite uses is made here.
export MEGAMOE_BIN PARITY_WORK="${WORK}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false \
  PYTHONDONTWRITEBYTECODE=1
exec "${VENV}/bin/python" -m pytest -p no:cacheprovider -q "$@" .
