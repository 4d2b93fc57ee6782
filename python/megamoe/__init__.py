"""megamoe: NVFP4 Mixture-of-Experts layers on Hopper GPUs, as PyTorch custom ops.

Ops (``torch.ops.megamoe.*``, traceable by torch.compile, CUDA-graph capturable where noted in
python/csrc/ops.cpp): ``fused_moe_nvfp4`` (with a layer prepared by ``moe_prepare`` or
``moe_prepare_in_place``), ``route``,
``quantize_nvfp4``, ``dequantize_nvfp4``, ``load_moe_layer``. The module :class:`NVFP4MoE` wraps
them as a drop-in MoE block.

The extension library is loaded at the first use of any of these names (PEP 562), not at
``import megamoe``: the pure-Python parts (``megamoe.vllm_adapter``, ``megamoe.vllm_plugin``)
import where the CUDA extension is not built.
"""

import importlib

# Each public name and the submodule that defines it.
_EXPORTS = {
    **{name: "._ops" for name in (
        "PRECISIONS", "MoeHandle", "dequantize_nvfp4", "fused_moe_nvfp4", "load_moe_layer", "ops",
        "prepare_moe", "prepare_moe_in_place", "quantize_experts", "quantize_nvfp4", "route",
        "tp_range", "tp_slice", "unprepack_moe", "unprepack_moe_in_place")},
    "EpGroup": ".ep", "EpLoopback": ".ep",
    "NVFP4MoE": ".module", "share_workspace": ".module",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
