"""megamoe: NVFP4 Mixture-of-Experts layers on Hopper GPUs, as PyTorch custom ops.

Ops (``torch.ops.megamoe.*``, traceable by torch.compile, CUDA-graph capturable where noted in
python/csrc/ops.cpp): ``fused_moe_nvfp4`` (with a layer prepared by ``moe_prepare`` or
``moe_prepare_in_place``), ``route``,
``quantize_nvfp4``, ``dequantize_nvfp4``, ``load_moe_layer``. The module :class:`NVFP4MoE` wraps
them as a drop-in MoE block.
"""

from ._ops import (PRECISIONS, MoeHandle, dequantize_nvfp4, fused_moe_nvfp4, load_moe_layer, ops,
                   prepare_moe, prepare_moe_in_place, quantize_experts, quantize_nvfp4, route,
                   tp_range, tp_slice, unprepack_moe, unprepack_moe_in_place)
from .ep import EpGroup, EpLoopback
from .module import NVFP4MoE, share_workspace

__all__ = [
    "EpGroup", "EpLoopback", "PRECISIONS", "MoeHandle", "NVFP4MoE", "dequantize_nvfp4", "fused_moe_nvfp4", "load_moe_layer", "ops",
    "prepare_moe", "prepare_moe_in_place", "quantize_experts", "quantize_nvfp4", "route", "tp_range",
    "share_workspace", "tp_slice", "unprepack_moe", "unprepack_moe_in_place",
]
