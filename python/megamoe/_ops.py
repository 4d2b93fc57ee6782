"""The megamoe torch ops: loads the extension library and registers the fake (meta) kernels that
let torch.compile trace the ops, then wraps the ops that take options in plain functions.

The schemas and their documentation are in python/csrc/ops.cpp; the ops are also callable
directly as ``torch.ops.megamoe.<name>``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from ._precision import PRECISIONS, check_precision  # noqa: F401  (megamoe.PRECISIONS; used by ep, module)

_LIBRARY_NAME = "libmegamoe_torch.so"


def _library_path() -> str:
    # MEGAMOE_TORCH_LIBRARY points at a library built outside the package (a CMake build tree).
    return os.environ.get("MEGAMOE_TORCH_LIBRARY") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), _LIBRARY_NAME)


torch.ops.load_library(_library_path())

ops = torch.ops.megamoe


# Names of the shared-expert arguments of moe_prepare and fused_moe_nvfp4, in order.
SHARED_EXPERT_ARGS = ("shared_w13", "shared_w13_scale", "shared_w13_scale_2", "shared_w2",
                      "shared_w2_scale", "shared_w2_scale_2")


# ---- fake kernels: output metadata only, for tracing (torch.compile, FakeTensor, meta).

@torch.library.register_fake("megamoe::fused_moe_nvfp4")
def _fused_moe_nvfp4_fake(hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                          topk_weights, topk_ids, *, handle, swiglu_limit=None,
                          deterministic=False, shared_w13=None, shared_w13_scale=None,
                          shared_w13_scale_2=None, shared_w2=None, shared_w2_scale=None,
                          shared_w2_scale_2=None, check_ids=True, fp32_output=False):
    torch._check(hidden.dim() == 2, lambda: "megamoe.fused_moe_nvfp4: hidden must be [T, H]")
    torch._check(hidden.dtype == torch.bfloat16,
                 lambda: f"megamoe.fused_moe_nvfp4: hidden has dtype {hidden.dtype}; expected bfloat16")
    return hidden.new_empty(hidden.shape, dtype=torch.float32 if fp32_output else torch.bfloat16)


@torch.library.register_fake("megamoe::fused_moe_nvfp4_ep")
def _fused_moe_nvfp4_ep_fake(hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                             topk_weights, topk_ids, *, handle, shared_w13=None,
                             shared_w13_scale=None, shared_w13_scale_2=None, shared_w2=None,
                             shared_w2_scale=None, shared_w2_scale_2=None, check_ids=True):
    torch._check(hidden.dim() == 2, lambda: "megamoe.fused_moe_nvfp4_ep: hidden must be [T, H]")
    return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)


@torch.library.register_fake("megamoe::route")
def _route_fake(router_logits, *, top_k, method="softmax", renormalize=True, n_group=1,
                topk_group=1, routed_scaling_factor=1.0, e_score_correction_bias=None):
    torch._check(router_logits.dim() == 2, lambda: "megamoe.route: router_logits must be [T, E]")
    tokens = router_logits.shape[0]
    return (router_logits.new_empty((tokens, top_k), dtype=torch.float32),
            router_logits.new_empty((tokens, top_k), dtype=torch.int32))


@torch.library.register_fake("megamoe::quantize_nvfp4")
def _quantize_nvfp4_fake(weight):
    lead, (n, k) = weight.shape[:-2], weight.shape[-2:]
    return (weight.new_empty((*lead, n, k // 2), dtype=torch.uint8),
            weight.new_empty((*lead, n, k // 16), dtype=torch.float8_e4m3fn),
            weight.new_empty(lead, dtype=torch.float32))


@torch.library.register_fake("megamoe::dequantize_nvfp4")
def _dequantize_nvfp4_fake(weight, weight_scale, weight_scale_2):
    return weight.new_empty((*weight.shape[:-1], 2 * weight.shape[-1]), dtype=torch.bfloat16)


# ---- prepared layers

# Releases asked for while a CUDA graph was being captured: freeing (which synchronises the
# device) is not allowed then, so they wait for the next release outside capture.
_deferred_releases: list = []


def _release(free) -> None:
    _deferred_releases.append(free)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    while _deferred_releases:
        _deferred_releases.pop()()


class MoeHandle:
    """A prepared MoE layer (plan, prepacked weights, workspace) owned by this object.

    ``int(handle)`` is the id that ``torch.ops.megamoe.fused_moe_nvfp4`` takes; the layer is freed
    by :meth:`release` or when this object is garbage-collected. Keep it alive as long as any CUDA
    graph that replays calls with it.
    """

    def __init__(self, handle: int):
        self._id: Optional[int] = int(handle)

    def __int__(self) -> int:
        if self._id is None:
            raise ValueError("megamoe.MoeHandle: the prepared layer was released")
        return self._id

    def describe(self, tokens: int = 1) -> str:
        """The layer, its device memory, and the kernel configuration chosen for ``tokens``."""
        return ops.moe_describe(int(self), int(tokens))

    def layout(self) -> str:
        """The layout the layer reads its weights in ("sm90-prepacked-nvfp4")."""
        return ops.moe_weight_layout(int(self))

    def release(self) -> None:
        if self._id is not None:
            handle, self._id = self._id, None
            _release(lambda: self._free(handle))

    @staticmethod
    def _free(handle: int) -> None:
        ops.moe_release(handle)

    def __del__(self):
        # At interpreter exit the op library may already be gone; nothing is left to free then.
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"MoeHandle({self._id if self._id is not None else 'released'})"


def _shared_kwargs(shared_expert: Optional[Sequence[torch.Tensor]]) -> dict:
    if shared_expert is None:
        return {}
    if len(shared_expert) != len(SHARED_EXPERT_ARGS):
        raise ValueError(
            f"megamoe: shared_expert must hold the {len(SHARED_EXPERT_ARGS)} tensors "
            f"({', '.join(SHARED_EXPERT_ARGS)}); got {len(shared_expert)}")
    return dict(zip(SHARED_EXPERT_ARGS, shared_expert))


def prepare_moe(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *, top_k: int,
                max_tokens: int, swiglu_limit: Optional[float] = None, deterministic: bool = False,
                shared_expert: Optional[Sequence[torch.Tensor]] = None,
                precision: str = "w4a16", prepacked: bool = False) -> MoeHandle:
    """Prepares the stacked NVFP4 weights (CUDA tensors) for :func:`fused_moe_nvfp4`.

    A one-time load step: copies the weights to the host, checks every scale, prepacks them for
    the kernels, uploads the copy and sizes the workspace for ``max_tokens`` tokens. The device
    holds the prepacked copy beside the stacked tensors (:func:`prepare_moe_in_place` holds them
    once). With ``prepacked``, the tensors are ones :func:`prepare_moe_in_place` has rewritten:
    the layer reads them where they are (no copy, no check of the bytes). ``shared_expert`` is
    ``(shared_w13, shared_w13_scale, shared_w13_scale_2, shared_w2, shared_w2_scale,
    shared_w2_scale_2)`` or None. ``precision`` is one of :data:`PRECISIONS`: "w4a16" (exact),
    "w4a8" or "auto" (per batch size, w4a8 where it runs and is faster, else w4a16); a precision
    that no GPU kernel of this build serves raises NotImplementedError.
    """
    return MoeHandle(ops.moe_prepare(
        w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, top_k=int(top_k),
        max_tokens=int(max_tokens), swiglu_limit=swiglu_limit, deterministic=deterministic,
        precision=check_precision(precision, "megamoe.prepare_moe"), prepacked=bool(prepacked),
        **_shared_kwargs(shared_expert)))


def prepare_moe_in_place(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *, top_k: int,
                         max_tokens: int, swiglu_limit: Optional[float] = None,
                         deterministic: bool = False,
                         shared_expert: Optional[Sequence[torch.Tensor]] = None,
                         precision: str = "w4a16") -> MoeHandle:
    """:func:`prepare_moe` without a second copy of the weights on the device.

    Checks every scale first (a refused layer is left as it was), then rewrites ``w13``,
    ``w13_scale``, ``w2`` and ``w2_scale`` (and the shared expert's) in place into the kernels'
    layout, ``handle.layout()``; ModelOpt's all-zero weights get global scale 1 in place. The
    layer reads the tensors there: keep them alive and unchanged. With a shared expert, each of
    its code and scale tensors must follow the routed one in one storage (``shared_w13`` starts
    where ``w13`` ends, and so on). :func:`unprepack_moe` / :func:`unprepack_moe_in_place` give
    the checkpoint layout back.
    """
    return MoeHandle(ops.moe_prepare_in_place(
        w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, top_k=int(top_k),
        max_tokens=int(max_tokens), swiglu_limit=swiglu_limit, deterministic=deterministic,
        precision=check_precision(precision, "megamoe.prepare_moe_in_place"),
        **_shared_kwargs(shared_expert)))


def unprepack_moe(layout: str, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *,
                  shared_expert: Optional[Sequence[torch.Tensor]] = None) -> list:
    """Tensors that :func:`prepare_moe_in_place` rewrote into ``layout``, in the checkpoint layout:
    new CPU tensors in argument order (w13 .. w2_scale_2, then the shared expert's six)."""
    return ops.moe_unprepack(layout, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                             **_shared_kwargs(shared_expert))


def unprepack_moe_in_place(layout: str, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *,
                           shared_expert: Optional[Sequence[torch.Tensor]] = None) -> None:
    """:func:`unprepack_moe` written back into the tensors themselves (through the host)."""
    ops.moe_unprepack_in_place(layout, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                               **_shared_kwargs(shared_expert))


def fused_moe_nvfp4(hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
                    topk_ids, *, handle, swiglu_limit: Optional[float] = None,
                    deterministic: bool = False,
                    shared_expert: Optional[Sequence[torch.Tensor]] = None,
                    check_ids: bool = True, fp32_output: bool = False) -> torch.Tensor:
    """The fused NVFP4 MoE layer: hidden [T, H] bf16 -> [T, H] bf16 (see ops.cpp for shapes).

    ``handle`` (a :class:`MoeHandle` or its int) must come from :func:`prepare_moe` on exactly
    these tensors and options. With ``check_ids``, outside CUDA-graph capture, ids outside
    [0, E) raise IndexError (at the cost of one host synchronisation per call). With
    ``fp32_output`` the result is the fp32 sums before their bf16 rounding (a tensor-parallel
    rank's partial: :func:`tp_slice`).
    """
    return ops.fused_moe_nvfp4(
        hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids,
        handle=int(handle), swiglu_limit=swiglu_limit, deterministic=deterministic,
        check_ids=check_ids, fp32_output=fp32_output, **_shared_kwargs(shared_expert))


def route(router_logits: torch.Tensor, *, top_k: int, method: str = "softmax",
          renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0,
          e_score_correction_bias: Optional[torch.Tensor] = None):
    """Router logits [T, E] fp32 -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    ``method`` "softmax" (Qwen3, Mixtral) or "noaux_tc" (DeepSeek-V3). Ties go to the lower
    expert index; rows list experts by selection score, descending.
    """
    return ops.route(router_logits, top_k=top_k, method=method, renormalize=renormalize,
                     n_group=n_group, topk_group=topk_group,
                     routed_scaling_factor=routed_scaling_factor,
                     e_score_correction_bias=e_score_correction_bias)


def quantize_nvfp4(weight: torch.Tensor):
    """ModelOpt NVFP4 quantization, bit for bit: [.., N, K] -> (codes, block scales, global)."""
    return ops.quantize_nvfp4(weight)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2) -> torch.Tensor:
    """NVFP4 -> bf16 [.., N, K]; ``weight_scale_2`` a tensor ([] / [1], or [E]) or a float."""
    if not isinstance(weight_scale_2, torch.Tensor):
        weight_scale_2 = torch.tensor(float(weight_scale_2), dtype=torch.float32)
    return ops.dequantize_nvfp4(weight, weight_scale, weight_scale_2)


def quantize_experts(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> dict:
    """Stacked NVFP4 expert weights from unquantized ones, with the ModelOpt recipe.

    ``gate_up_proj`` [E, 2I, H] (rows gate then up, the transformers layout) and ``down_proj``
    [E, H, I]; or one expert (a shared expert) as [2I, H] and [H, I]. Gate and up are quantized
    as the separate linears a ModelOpt checkpoint holds, each with its own global scale. Returns
    w13, w13_scale, w13_scale_2 ([E, 2] or [2]), w2, w2_scale, w2_scale_2 ([E] or [1]).
    """
    if gate_up_proj.dim() not in (2, 3) or gate_up_proj.shape[-2] % 2:
        raise ValueError(f"megamoe.quantize_experts: gate_up_proj has shape "
                         f"{tuple(gate_up_proj.shape)}; expected [E, 2I, H] or [2I, H]")
    inter = gate_up_proj.shape[-2] // 2
    gate_codes, gate_scales, gate_global = ops.quantize_nvfp4(
        gate_up_proj[..., :inter, :].contiguous())
    up_codes, up_scales, up_global = ops.quantize_nvfp4(gate_up_proj[..., inter:, :].contiguous())
    w2, w2_scale, w2_scale_2 = ops.quantize_nvfp4(down_proj.contiguous())
    # float8 tensors are concatenated as their bytes (cat need not support float8 everywhere).
    scales = [gate_scales.view(torch.uint8), up_scales.view(torch.uint8)]
    return {
        "w13": torch.cat([gate_codes, up_codes], dim=-2),
        "w13_scale": torch.cat(scales, dim=-2).view(torch.float8_e4m3fn),
        "w13_scale_2": torch.stack([gate_global, up_global], dim=-1),
        "w2": w2,
        "w2_scale": w2_scale,
        "w2_scale_2": w2_scale_2.reshape(-1),
    }


def load_moe_layer(path, layer: int):
    """model.layers.{layer}.mlp of a ModelOpt / compressed-tensors checkpoint directory, stacked.

    Returns ``(description, tensors)``: a dict (shapes, routing, swiglu_limit, format) and a dict
    of CPU tensors named as :class:`NVFP4MoE`'s buffers, with the checkpoint's bits.
    """
    import json

    text, tensors = ops.load_moe_layer(os.fspath(path), int(layer))
    description = json.loads(text)
    return description, dict(zip(description["tensors"], tensors))


# ---- tensor parallelism (megamoe/tp.h)

TP_SLICE_MULTIPLE = 64  # kTpSliceMultiple: I/R and Is/R must be multiples of it


def tp_range(size: int, rank: int, world_size: int, what: str = "intermediate_size") -> tuple[int, int]:
    """Rank ``rank``'s rows [first, first + count) of an intermediate dimension of ``size`` split
    over ``world_size`` ranks (megamoe/tp.h); ValueError naming the values where it does not split."""
    if not 1 <= world_size <= 8 or not 0 <= rank < world_size:
        raise ValueError(f"megamoe: tensor-parallel rank {rank} of world size {world_size} is out of "
                         "range (world size 1..8)")
    if size % world_size or (size // world_size) % TP_SLICE_MULTIPLE:
        raise ValueError(f"megamoe: {what} = {size} does not split over {world_size} tensor-parallel "
                         f"ranks into slices of a multiple of {TP_SLICE_MULTIPLE}")
    count = size // world_size
    return rank * count, count


def tp_slice(tensors: dict, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s slice of a stacked NVFP4 layer (the names of :class:`NVFP4MoE`'s buffers):
    rows [r·I/R, (r+1)·I/R) of every expert's gate and up, the same columns (K) of its down, the
    shared expert's the same way with its own Is; global scales, router and bias unchanged
    (megamoe/tp.h). Contiguous copies; the input is not modified."""
    out = dict(tensors)

    def gate_up(w13, first, count, inter):  # [.., 2I, X] -> [.., 2·count, X]
        raw = w13.view(torch.uint8)  # the bytes (float8 scales included: no arithmetic on them)
        gate = raw[..., first:first + count, :]
        up = raw[..., inter + first:inter + first + count, :]
        return torch.cat([gate, up], dim=-2).contiguous().view(w13.dtype)

    def down(codes, scales, first, count):  # K columns of [.., H, I/2] and [.., H, I/16]
        return (codes[..., first // 2:(first + count) // 2].contiguous(),
                scales[..., first // 16:(first + count) // 16].contiguous())

    inter = tensors["w13"].shape[-2] // 2
    first, count = tp_range(inter, rank, world_size)
    out["w13"] = gate_up(tensors["w13"], first, count, inter)
    out["w13_scale"] = gate_up(tensors["w13_scale"], first, count, inter)
    out["w2"], out["w2_scale"] = down(tensors["w2"], tensors["w2_scale"], first, count)
    if "shared_w13" in tensors:
        shared = tensors["shared_w13"].shape[-2] // 2
        first, count = tp_range(shared, rank, world_size, "shared_intermediate_size")
        out["shared_w13"] = gate_up(tensors["shared_w13"], first, count, shared)
        out["shared_w13_scale"] = gate_up(tensors["shared_w13_scale"], first, count, shared)
        out["shared_w2"], out["shared_w2_scale"] = down(tensors["shared_w2"], tensors["shared_w2_scale"],
                                                        first, count)
    return out

