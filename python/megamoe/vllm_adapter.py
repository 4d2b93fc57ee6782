"""What runs megamoe's fused NVFP4 layer under an inference engine's MoE interface, with torch alone.

vLLM's experts classes (megamoe.vllm_plugin) receive the rank's stacked ModelOpt tensors, global
top-k ids with an ``expert_map`` (global -> local, -1 for another rank's experts) and batches of any
size. This module holds the parts that need neither vLLM nor the CUDA extension, so that they are
tested on their own: the supported-configuration rules, the id mapping, the global scales, the
prepared layer that chunks batches above its ``max_tokens``, and the workspace shared by a model's
layers. The op itself is reached through a backend (:class:`MegaMoeOps` by default); tests give a
CPU reference instead.
"""

from __future__ import annotations

import weakref
from typing import Optional, Protocol

import torch

from ._precision import check_precision

# MoePlan's rules (megamoe/runtime.h): H and I multiples of 64, 1..1024 experts, top_k 1..min(E, 16).
SHAPE_MULTIPLE = 64
MAX_EXPERTS = 1024
MAX_TOP_K = 16
# The GPUs the kernels are built for (sm_90a).
SUPPORTED_CAPABILITY = (9, 0)

# The stacked tensors in the op's argument order, named as vLLM's ModelOpt layer names them.
VLLM_NAMES = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight",
              "w2_weight_scale", "w2_weight_scale_2")


def unsupported_reason(*, hidden_size: int, intermediate_size: int, num_local_experts: int,
                       top_k: int, dtype: torch.dtype = torch.bfloat16, has_bias: bool = False,
                       swiglu_alpha: Optional[float] = None,
                       swiglu_beta: Optional[float] = None) -> Optional[str]:
    """None where the fused layer runs this rank's MoE shape, else why not (what it is and what is
    allowed). ``intermediate_size`` is the rank's (after tensor-parallel slicing)."""
    if dtype != torch.bfloat16:
        return f"activation dtype {dtype} (the kernels take bfloat16)"
    if hidden_size <= 0 or hidden_size % SHAPE_MULTIPLE:
        return f"hidden size {hidden_size} (must be a positive multiple of {SHAPE_MULTIPLE})"
    if intermediate_size <= 0 or intermediate_size % SHAPE_MULTIPLE:
        return (f"intermediate size per partition {intermediate_size} (must be a positive multiple "
                f"of {SHAPE_MULTIPLE}: with tensor parallelism, I/TP)")
    if not 1 <= num_local_experts <= MAX_EXPERTS:
        return f"{num_local_experts} local experts (1..{MAX_EXPERTS} allowed)"
    if not 1 <= top_k <= min(num_local_experts, MAX_TOP_K):
        return (f"top_k {top_k} with {num_local_experts} local experts (top_k must be in "
                f"1..min(local experts, {MAX_TOP_K}))")
    if has_bias:
        return "expert biases (the checkpoint's experts have none in ModelOpt NVFP4)"
    if swiglu_alpha is not None or swiglu_beta is not None:
        return (f"SwiGLU alpha={swiglu_alpha}, beta={swiglu_beta} (only silu(gate) * up, with an "
                "optional swiglu_limit clamp)")
    return None


def local_expert_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 ids in the rank's expert space: ``expert_map[topk_ids]`` (-1 for experts of other
    ranks, which the op skips), or ``topk_ids`` where there is no map. Device ops only, no host
    synchronisation: safe under CUDA-graph capture."""
    if expert_map is None:
        return topk_ids.to(torch.int32).contiguous()
    if expert_map.dim() != 1:
        raise ValueError(f"megamoe: expert_map has shape {tuple(expert_map.shape)}; expected "
                         "[global experts] (global -> local id, -1 elsewhere)")
    local = expert_map.index_select(0, topk_ids.reshape(-1).to(torch.int64))
    return local.to(torch.int32).view(topk_ids.shape)


def checkpoint_tensors(layer) -> dict:
    """The six stacked tensors of a vLLM ModelOpt NVFP4 experts layer, by the op's names, checked:
    the very parameters (prepared in place, so the device holds them once), with
    ``w13_weight_scale_2`` [E, 2] kept whole (gate and up each keep their global scale) and
    ``w2_weight_scale_2`` viewed as [E]."""
    t = {name: getattr(layer, vname) for name, vname in zip(
        ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"), VLLM_NAMES)}
    E, two_i, half_h = t["w13"].shape
    if t["w13_scale_2"].shape != (E, 2) or t["w13_scale_2"].dtype != torch.float32:
        raise ValueError(
            f"megamoe: w13_weight_scale_2 has shape {tuple(t['w13_scale_2'].shape)} and dtype "
            f"{t['w13_scale_2'].dtype}; expected [{E}, 2] float32 (gate and up global scales)")
    if t["w2_scale_2"].numel() != E or t["w2_scale_2"].dtype != torch.float32:
        raise ValueError(
            f"megamoe: w2_weight_scale_2 has shape {tuple(t['w2_scale_2'].shape)} and dtype "
            f"{t['w2_scale_2'].dtype}; expected [{E}] float32")
    t["w2_scale_2"] = t["w2_scale_2"].view(E)
    for name in ("w13", "w2"):
        if t[name].dtype != torch.uint8:
            raise ValueError(f"megamoe: {name} has dtype {t[name].dtype}; expected uint8 (packed e2m1)")
    for name in ("w13_scale", "w2_scale"):
        if t[name].dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"megamoe: {name} has dtype {t[name].dtype}; expected float8_e4m3fn")
    return t


class Backend(Protocol):
    """The op and its load-time steps (:class:`MegaMoeOps` on the GPU; tests give a CPU one)."""

    def prepare_in_place(self, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *,
                         top_k: int, max_tokens: int, swiglu_limit: Optional[float],
                         precision: str): ...

    def run(self, hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
            topk_ids, *, handle, swiglu_limit: Optional[float]) -> torch.Tensor: ...

    def workspace_bytes(self, handle) -> int: ...

    def set_workspace(self, handle, workspace: torch.Tensor) -> None: ...


class MegaMoeOps:
    """The CUDA ops of the megamoe extension (loaded at the first call)."""

    @staticmethod
    def _ops():
        from . import _ops
        return _ops

    def prepare_in_place(self, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *,
                         top_k, max_tokens, swiglu_limit, precision):
        return self._ops().prepare_moe_in_place(
            w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, top_k=top_k,
            max_tokens=max_tokens, swiglu_limit=swiglu_limit, precision=precision)

    def run(self, hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
            topk_ids, *, handle, swiglu_limit):
        # check_ids=False: -1 (another rank's expert) is a valid input here, and the check would
        # synchronise the host on every eager call.
        return self._ops().ops.fused_moe_nvfp4(
            hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids,
            handle=int(handle), swiglu_limit=swiglu_limit, check_ids=False)

    def workspace_bytes(self, handle) -> int:
        return int(self._ops().ops.moe_workspace_bytes(int(handle)))

    def set_workspace(self, handle, workspace) -> None:
        self._ops().ops.moe_set_workspace(int(handle), workspace)


class SharedWorkspace:
    """One workspace per device for every layer prepared through it: a model's MoE layers run one
    after another, so the largest need suffices (a DeepSeek-V3 layer at 4096 tokens: 0.27 GB once
    instead of once per layer). Set before CUDA-graph capture: a layer that needs more replaces the
    buffer of every layer."""

    def __init__(self):
        self._handles: dict = {}     # device -> WeakSet of handles
        self._buffers: dict = {}     # device -> uint8 tensor

    def add(self, backend: Backend, handle, device: torch.device) -> None:
        need = backend.workspace_bytes(handle)
        handles = self._handles.setdefault(device, weakref.WeakSet())
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < need:
            buffer = torch.empty(need, dtype=torch.uint8, device=device)
            self._buffers[device] = buffer
            for other in list(handles):
                backend.set_workspace(other, buffer)
        backend.set_workspace(handle, buffer)
        handles.add(handle)

    def nbytes(self, device: torch.device) -> int:
        buffer = self._buffers.get(device)
        return 0 if buffer is None else buffer.numel()


SHARED_WORKSPACE = SharedWorkspace()


class PreparedExperts:
    """A rank's experts prepared once for the fused op, in place on the given tensors.

    ``tensors`` are the six stacked tensors (:func:`checkpoint_tensors`); after this they hold the
    kernels' layout and must stay alive and unchanged. :meth:`forward` maps global ids through the
    ``expert_map``, applies the routing weights and sums the top-k contributions (the op's
    combine), and runs batches above ``max_tokens`` in chunks.
    """

    def __init__(self, tensors: dict, *, top_k: int, max_tokens: int,
                 swiglu_limit: Optional[float] = None, precision: str = "w4a16",
                 backend: Optional[Backend] = None,
                 workspace: Optional[SharedWorkspace] = SHARED_WORKSPACE):
        if max_tokens < 1:
            raise ValueError(f"megamoe: max_tokens = {max_tokens}; it must be at least 1")
        check_precision(precision, "megamoe")
        self.backend = backend if backend is not None else MegaMoeOps()
        self.tensors = tuple(tensors[n] for n in ("w13", "w13_scale", "w13_scale_2", "w2",
                                                  "w2_scale", "w2_scale_2"))
        self.num_experts = self.tensors[0].shape[0]
        self.hidden_size = self.tensors[0].shape[2] * 2
        self.top_k = int(top_k)
        self.max_tokens = int(max_tokens)
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.precision = precision
        self.handle = self.backend.prepare_in_place(
            *self.tensors, top_k=self.top_k, max_tokens=self.max_tokens,
            swiglu_limit=self.swiglu_limit, precision=precision)
        if workspace is not None:
            workspace.add(self.backend, self.handle, self.tensors[0].device)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, H] bf16 -> ``out`` [T, H]: sum_k w_k expert_k(x) over the rank's experts (ids that
        map to -1 contribute nothing). No host synchronisation."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"megamoe: hidden has shape {tuple(hidden.shape)}; expected "
                             f"[T, {self.hidden_size}]")
        tokens = hidden.shape[0]
        if topk_ids.shape != (tokens, self.top_k) or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"megamoe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                f"{tuple(topk_weights.shape)}; expected [{tokens}, {self.top_k}] (T, top_k)")
        ids = local_expert_ids(topk_ids, expert_map)
        weights = topk_weights.contiguous()
        hidden = hidden.contiguous()
        if out is None:
            out = torch.empty_like(hidden)
        for first in range(0, tokens, self.max_tokens):
            last = min(first + self.max_tokens, tokens)
            result = self.backend.run(
                hidden[first:last], *self.tensors, weights[first:last], ids[first:last],
                handle=self.handle, swiglu_limit=self.swiglu_limit)
            out[first:last].copy_(result)
        return out
