"""megamoe.vllm_adapter, the part of the vLLM plugin that needs no vLLM: the supported-shape rules,
the global -> local id mapping through vLLM's expert_map (-1 for another rank's experts), the
ModelOpt tensors as vLLM names them (both w13 global scales kept), chunking above max_tokens and
the workspace shared by a model's layers.

On the CPU (also run by tests/vllm/run.sh) the op is the CPU reference of
tests/vllm/reference_backend.py; on a Hopper GPU it is the real op, on vLLM-shaped tensors: an
E_loc slice of a DeepSeek-V3-shaped layer, global int32 ids with -1 entries, T = 1 ... 8192 in
chunks, CUDA-graph capture, and the device memory the prepared slice holds.
"""

import os
import sys

import pytest

from support import hopper_available, random_stacked, requires_hopper, torch
import nvfp4_oracle as oracle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm"))
from reference_backend import CpuReference, reference  # noqa: E402

from megamoe import vllm_adapter  # noqa: E402  (pure torch: no extension is loaded)

# The GPU tests' bound (test_moe.py): the output against the float64 reference rounded to bf16.
MAX_REL_L2 = 2e-3


def ep_slice(E_global, ranks, rank, device="cpu"):
    """vLLM's linear expert placement: rank r holds [r·E/R, (r+1)·E/R); the map is global ->
    local, -1 elsewhere (int32, as vLLM's ExpertMapManager makes it)."""
    per = E_global // ranks
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[rank * per:(rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    return expert_map.to(device), rank * per, per


def routing(T, E_global, k, generator=None):
    """Distinct global experts per token, positive weights summing to one."""
    ids = torch.rand(T, E_global, generator=generator).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=generator) + 0.05
    return w / w.sum(dim=1, keepdim=True), ids


def as_vllm_layer(tensors):
    """An object with vLLM's ModelOpt parameter names over the stacked tensors."""
    class Layer:
        pass
    layer = Layer()
    for name, vname in zip(("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"),
                           vllm_adapter.VLLM_NAMES):
        setattr(layer, vname, tensors[name])
    return layer


def local_reference(x, tensors, w, ids, expert_map, limit=None):
    """The rank's partial sum in float64: global ids through the map, -1 skipped."""
    local = expert_map.long()[ids.long()]
    return reference(x, tensors, w, local, limit)


# ---- CPU: no extension, no GPU

def test_unsupported_reason_names_the_value_and_the_rule():
    ok = dict(hidden_size=7168, intermediate_size=2048, num_local_experts=32, top_k=8)
    assert vllm_adapter.unsupported_reason(**ok) is None
    cases = [
        (dict(hidden_size=7000), "hidden size 7000 (must be a positive multiple of 64)"),
        (dict(intermediate_size=96), "intermediate size per partition 96"),
        (dict(num_local_experts=2000), "2000 local experts (1..1024 allowed)"),
        (dict(num_local_experts=4), "top_k 8 with 4 local experts"),
        (dict(top_k=17, num_local_experts=64), "top_k 17 with 64 local experts"),
        (dict(dtype=torch.float16), "activation dtype torch.float16"),
        (dict(has_bias=True), "expert biases"),
        (dict(swiglu_alpha=1.702), "SwiGLU alpha=1.702"),
    ]
    for change, want in cases:
        got = vllm_adapter.unsupported_reason(**{**ok, **change})
        assert got is not None and want in got, (change, got)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_local_ids_map_other_ranks_experts_to_minus_one(ids_dtype):
    expert_map, first, per = ep_slice(256, 8, 3)
    ids = torch.arange(256, dtype=ids_dtype).reshape(32, 8)
    local = vllm_adapter.local_expert_ids(ids, expert_map)
    assert local.dtype == torch.int32 and local.shape == ids.shape
    inside = (ids >= first) & (ids < first + per)
    assert torch.equal(local[inside].long(), ids[inside].long() - first)
    assert bool((local[~inside] == -1).all())
    assert torch.equal(vllm_adapter.local_expert_ids(ids, None), ids.to(torch.int32))
    with pytest.raises(ValueError, match=r"expert_map has shape \(8, 32\)"):
        vllm_adapter.local_expert_ids(ids, expert_map.reshape(8, 32))


def test_checkpoint_tensors_keep_both_gate_and_up_global_scales():
    t = random_stacked(4, 128, 64)
    got = vllm_adapter.checkpoint_tensors(as_vllm_layer(t))
    assert got["w13_scale_2"] is t["w13_scale_2"] and got["w13_scale_2"].shape == (4, 2)
    assert got["w13"] is t["w13"]  # the very parameters: prepared in place, held once
    column0 = dict(t, w13_scale_2=t["w13_scale_2"][:, 0].contiguous())  # what vLLM keeps
    with pytest.raises(ValueError, match=r"w13_weight_scale_2 has shape \(4,\).*expected \[4, 2\]"):
        vllm_adapter.checkpoint_tensors(as_vllm_layer(column0))
    with pytest.raises(ValueError, match="w2 has dtype torch.int8; expected uint8"):
        vllm_adapter.checkpoint_tensors(as_vllm_layer(dict(t, w2=t["w2"].view(torch.int8))))


@pytest.mark.parametrize("T", [1, 16, 17, 40])
def test_chunks_above_max_tokens_and_maps_ids(T):
    E_global, ranks, rank, H, I, k, max_tokens = 32, 4, 1, 128, 64, 4, 16
    gen = torch.Generator().manual_seed(1000 + T)
    torch.manual_seed(T)
    expert_map, _, per = ep_slice(E_global, ranks, rank)
    t = random_stacked(per, H, I)
    backend = CpuReference()
    prepared = vllm_adapter.PreparedExperts(t, top_k=k, max_tokens=max_tokens, backend=backend,
                                            workspace=vllm_adapter.SharedWorkspace())
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w, ids = routing(T, E_global, k, gen)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    assert prepared.forward(x, w, ids, expert_map, out=out) is out
    assert backend.calls == [min(max_tokens, T - s) for s in range(0, T, max_tokens)]
    want = local_reference(x, t, w, ids, expert_map).to(torch.bfloat16).float()
    # Each row is its own sum, so chunking changes nothing but the reference's own float64
    # rounding: within one bf16 ulp.
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max())


def test_shared_workspace_is_the_largest_need_for_every_layer():
    class Sized(CpuReference):
        def __init__(self, need):
            super().__init__()
            self.need = need

        def workspace_bytes(self, handle):
            return self.need

    pool = vllm_adapter.SharedWorkspace()
    t = random_stacked(2, 64, 64)
    small = vllm_adapter.PreparedExperts(t, top_k=1, max_tokens=4, backend=Sized(300),
                                         workspace=pool)
    big = vllm_adapter.PreparedExperts(t, top_k=1, max_tokens=4, backend=Sized(1000),
                                       workspace=pool)
    later = vllm_adapter.PreparedExperts(t, top_k=1, max_tokens=4, backend=Sized(500),
                                         workspace=pool)
    device = torch.device("cpu")
    assert pool.nbytes(device) == 1000
    buffers = {id(p.handle.workspace) for p in (small, big, later)}
    assert len(buffers) == 1 and small.handle.workspace.numel() == 1000


def test_bad_arguments_are_refused():
    t = random_stacked(2, 64, 64)
    with pytest.raises(ValueError, match="max_tokens = 0; it must be at least 1"):
        vllm_adapter.PreparedExperts(t, top_k=1, max_tokens=0, backend=CpuReference())
    with pytest.raises(ValueError, match="precision 'fp8' is not supported; allowed: 'w4a16'"):
        vllm_adapter.PreparedExperts(t, top_k=1, max_tokens=4, precision="fp8",
                                     backend=CpuReference())
    p = vllm_adapter.PreparedExperts(t, top_k=2, max_tokens=4, backend=CpuReference(),
                                     workspace=None)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_ids \(3, 1\).*expected \[3, 2\]"):
        p.forward(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"hidden has shape \(3, 32\); expected \[T, 64\]"):
        p.forward(x[:, :32], torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32))


# ---- Hopper GPU: the real op on a DeepSeek-V3-shaped slice (no vLLM needed)

# DeepSeek-V3's routed experts (H 7168, I 2048, 256 experts, top 8) split over 8 expert-parallel
# ranks: rank 3 holds experts 96..127.
DSV3 = dict(E_global=256, ranks=8, rank=3, H=7168, I=2048, k=8)
GPU_MAX_TOKENS = 1024  # T above it runs in chunks


@pytest.fixture(scope="module")
def dsv3_slice():
    if not hopper_available():
        pytest.skip("needs a Hopper GPU (sm_90): the megamoe kernels are built for sm_90a")
    torch.manual_seed(47)
    expert_map, _, per = ep_slice(DSV3["E_global"], DSV3["ranks"], DSV3["rank"], "cuda")
    cpu = random_stacked(per, DSV3["H"], DSV3["I"])
    dev = {n: v.cuda() for n, v in cpu.items()}
    nvfp4_bytes = sum(v.numel() * v.element_size() for v in dev.values())
    pool = vllm_adapter.SharedWorkspace()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    prepared = vllm_adapter.PreparedExperts(
        vllm_adapter.checkpoint_tensors(as_vllm_layer(dev)), top_k=DSV3["k"],
        max_tokens=GPU_MAX_TOKENS, workspace=pool)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = free_before - torch.cuda.mem_get_info()[0]
    return dict(prepared=prepared, cpu=cpu, expert_map=expert_map, nvfp4_bytes=nvfp4_bytes,
                prepare_bytes=used, workspace_bytes=pool.nbytes(torch.device("cuda", 0)))


@requires_hopper
def test_gpu_slice_holds_its_weights_once(dsv3_slice):
    # Counted: the NVFP4 bytes of the slice (codes, block scales, global scales; on the device before
    # preparing, as vLLM loads them) plus the device memory preparing added (torch.cuda.mem_get_info,
    # after empty_cache), less the workspace, which is one buffer per device shared by every layer of
    # the model (SharedWorkspace) and reported here.
    d = dsv3_slice
    held = d["nvfp4_bytes"] + d["prepare_bytes"] - d["workspace_bytes"]
    detail = (f"NVFP4 {d['nvfp4_bytes'] / 1e6:.1f} MB, preparing added "
              f"{d['prepare_bytes'] / 1e6:.1f} MB of which the shared workspace "
              f"{d['workspace_bytes'] / 1e6:.1f} MB (max_tokens={GPU_MAX_TOKENS})")
    assert held <= 1.02 * d["nvfp4_bytes"], detail
    print(detail)


@requires_hopper
@pytest.mark.parametrize("T", [1, 5, 64, 1000, 1024, 1025, 3000, 8192])
def test_gpu_slice_against_the_reference(dsv3_slice, T):
    d = dsv3_slice
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, DSV3["H"], generator=gen).to(torch.bfloat16)
    w, ids = routing(T, DSV3["E_global"], DSV3["k"], gen)
    assert bool((d["expert_map"].cpu()[ids.long()] == -1).any())  # other ranks' experts present
    out = torch.empty(T, DSV3["H"], dtype=torch.bfloat16, device="cuda")
    d["prepared"].forward(x.cuda(), w.cuda(), ids.cuda(), d["expert_map"], out=out)
    torch.cuda.synchronize()
    want = local_reference(x, d["cpu"], w, ids, d["expert_map"].cpu())
    err = oracle.rel_l2(out, want.to(torch.bfloat16))
    assert torch.isfinite(out).all() and err <= MAX_REL_L2, f"T={T} rel_l2={err:.3g}"


@requires_hopper
@pytest.mark.parametrize("T", [8, 2 * GPU_MAX_TOKENS + 5])
def test_gpu_slice_under_cuda_graph_capture(dsv3_slice, T):
    d = dsv3_slice
    gen = torch.Generator().manual_seed(10_000 + T)
    x = torch.zeros(T, DSV3["H"], dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(T, DSV3["k"], device="cuda")
    ids = torch.zeros(T, DSV3["k"], dtype=torch.int32, device="cuda")
    out = torch.empty(T, DSV3["H"], dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as vLLM does
        d["prepared"].forward(x, w, ids, d["expert_map"], out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d["prepared"].forward(x, w, ids, d["expert_map"], out=out)
    for _ in range(2):  # new inputs each replay
        hx = torch.randn(T, DSV3["H"], generator=gen).to(torch.bfloat16)
        hw, hids = routing(T, DSV3["E_global"], DSV3["k"], gen)
        x.copy_(hx), w.copy_(hw), ids.copy_(hids)
        graph.replay()
        torch.cuda.synchronize()
        want = local_reference(hx, d["cpu"], hw, hids, d["expert_map"].cpu())
        err = oracle.rel_l2(out, want.to(torch.bfloat16))
        assert err <= MAX_REL_L2, f"T={T} rel_l2={err:.3g}"
