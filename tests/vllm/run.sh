#!/usr/bin/env bash
# The vLLM plugin suite: megamoe.vllm_plugin inside the real vLLM 0.33 on the CPU (entry-point
# discovery, the quantization override, the experts class's support matrix, and vLLM's own
# FusedMoEKernel running our experts class end to end with the op replaced by a CPU reference);
# tests/vllm/*.py say what is checked.
#
#   tests/vllm/run.sh [PYTEST_ARGS...]   (the tests to run, default all; run from tests/vllm)
#
# Needs no build: the plugin and adapter are pure Python (python/megamoe, put on PYTHONPATH) and
# the suite never loads the CUDA extension. The Python packages (requirements.txt, every one
# pinned) live in a virtual environment under $MEGAMOE_VLLM_CACHE (default ~/.cache/megamoe-vllm),
# one per hash of requirements.txt and the Python version, built on first use (several GB: vLLM and
# torch's CUDA build from PyPI) and reused after; older ones are removed.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"

# shellcheck source=../../scripts/cached_venv.sh
source "${ROOT}/scripts/cached_venv.sh"
cached_venv vllm "${HERE}/requirements.txt" \
  "${MEGAMOE_VLLM_CACHE:-${XDG_CACHE_HOME:-${HOME}/.cache}/megamoe-vllm}"

cd "${HERE}"
# No hub, no telemetry, no GPU: the suite builds its layers here. VLLM_PLUGINS is left unset so
# that vLLM's loader finds every plugin the way a server does; the discovery test sets its own.
export PYTHONPATH="${ROOT}/python${PYTHONPATH:+:${PYTHONPATH}}" MEGAMOE_TEST_ROOT="${ROOT}" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1 CUDA_VISIBLE_DEVICES=""
# Without arguments: this suite and the CPU part of tests/python/test_vllm_adapter.py (the adapter
# without vLLM; its GPU part skips here).
if [ $# -eq 0 ]; then
  set -- . "${ROOT}/tests/python/test_vllm_adapter.py"
fi
exec "${VENV}/bin/python" -m pytest -p no:cacheprovider -q "$@"
