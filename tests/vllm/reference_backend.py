"""megamoe's op replaced by a CPU reference built on our NVFP4 numerics (tests/python/nvfp4_oracle.py,
the oracle the GPU op is checked against): the backend that megamoe.vllm_adapter.PreparedExperts
calls, for the tests that run without the CUDA extension. Preparing leaves the tensors in the
checkpoint layout; every call is recorded, so that tests can see the chunks."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import nvfp4_oracle  # noqa: E402

WORKSPACE_BYTES = 256  # what the op asks for at the least (moe_workspace_bytes)


class Handle:
    """What prepare returns: the options the op is held to, as the real handle holds them."""

    def __init__(self, tensors, top_k, max_tokens, swiglu_limit, precision):
        self.tensors, self.top_k, self.max_tokens = tensors, top_k, max_tokens
        self.swiglu_limit, self.precision = swiglu_limit, precision
        self.workspace = None


class CpuReference:
    """prepare_in_place / run / workspace_bytes / set_workspace with the op's rules (T at most
    max_tokens, ids in [0, E) or else skipped, the tensors of the handle) on the float64 oracle."""

    def __init__(self):
        self.calls = []  # (T of each run)
        self.prepared = []

    def prepare_in_place(self, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, *, top_k,
                         max_tokens, swiglu_limit, precision):
        handle = Handle((w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2), top_k,
                        max_tokens, swiglu_limit, precision)
        self.prepared.append(handle)
        return handle

    def run(self, hidden, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
            topk_ids, *, handle, swiglu_limit):
        given = (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        assert all(a is b for a, b in zip(given, handle.tensors)), "not the prepared tensors"
        assert swiglu_limit == handle.swiglu_limit
        assert hidden.dtype == torch.bfloat16 and hidden.is_contiguous()
        assert topk_ids.dtype == torch.int32 and topk_ids.shape == (hidden.shape[0], handle.top_k)
        assert hidden.shape[0] <= handle.max_tokens, (hidden.shape[0], handle.max_tokens)
        self.calls.append(hidden.shape[0])
        return reference(hidden, dict(zip(("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale",
                                           "w2_scale_2"), given)),
                         topk_weights, topk_ids, swiglu_limit).to(torch.bfloat16)

    def workspace_bytes(self, handle):
        return WORKSPACE_BYTES

    def set_workspace(self, handle, workspace):
        assert workspace.numel() >= WORKSPACE_BYTES
        handle.workspace = workspace


def reference(hidden, layer, topk_weights, topk_ids, swiglu_limit=None) -> torch.Tensor:
    """The fused layer's float64 result [T, H] (before its bf16 rounding) for local ids, skipping
    the slots whose id is outside [0, E) as the op does."""
    E = layer["w13"].shape[0]
    ids = topk_ids.detach().cpu().long()
    valid = (ids >= 0) & (ids < E)
    weights = torch.where(valid, topk_weights.detach().cpu().float(), torch.zeros(()))
    return nvfp4_oracle.moe_forward(hidden, layer, weights, torch.where(valid, ids, 0),
                                    swiglu_limit)
