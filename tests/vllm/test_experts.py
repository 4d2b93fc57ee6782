"""MegaMoeExperts inside vLLM 0.33 on the CPU: the is_supported_config matrix (with the reasons
vLLM prints), and vLLM's own RoutedExperts layer (ModelOpt's create_weights, vLLM's expert weight
loader, process_weights_after_loading building a FusedMoEKernel with vLLM's prepare/finalize)
running our experts class end to end, with the op replaced by the CPU reference on our NVFP4
numerics (reference_backend.py). Its output is compared with a plain torch MoE on vLLM's own
dequantization of the same weights (vLLM's NVFP4 EMULATION backend is Triton: it does not run on
the CPU), for whole layers and expert-parallel slices (global ids that map to -1), T below and
above max_tokens, the SwiGLU clamp and the router weight applied on the input.
"""

import pytest
import torch

from support import random_stacked
from megamoe import vllm_plugin

from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                         RoutingMethodType)
from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8StaticTensorSym,
                                                                       kNvfp4Dynamic, kNvfp4Static)

STANDARD = mk.FusedMoEActivationFormat.Standard
BATCHED = mk.FusedMoEActivationFormat.BatchedExperts
Experts = vllm_plugin.MegaMoeExperts


def parallel(ranks=1, rank=0, dp=1, backend="allgather_reducescatter", eplb=False):
    """vLLM's MoE parallel config: expert parallelism over ``ranks`` (tp_size 1 then, as vLLM
    flattens TP into EP), data parallelism ``dp``."""
    return FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=dp, ep_size=ranks, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=rank, sp_size=1, use_ep=ranks > 1, all2all_backend=backend, enable_eplb=eplb)


def moe_config(E=16, k=4, H=256, I=128, ranks=1, rank=0, **change):
    options = dict(num_experts=E, experts_per_token=k, hidden_dim=H, intermediate_size=I,
                   num_local_experts=E // ranks, num_logical_experts=E,
                   activation=MoEActivation.SILU, device="cpu",
                   routing_method=RoutingMethodType.Renormalize,
                   moe_parallel_config=parallel(ranks, rank), in_dtype=torch.bfloat16,
                   max_num_tokens=256)
    options.update(change)
    return FusedMoEConfig(**options)


MATRIX = [
    # name, FusedMoEConfig changes, (weight key, activation key, format), device, reason or None
    ("whole layer", {}, None, (9, 0), None),
    ("W4A4 checkpoint", {}, (kNvfp4Static, kNvfp4Dynamic, STANDARD), (9, 0), None),
    ("EP slice", dict(E=256, k=8, H=7168, I=2048, ranks=8, rank=3), None, (9, 0), None),
    ("swiglu_limit", dict(swiglu_limit=7.0), None, (9, 0), None),
    ("DP allgather", dict(moe_parallel_config=parallel(4, 1, dp=4)), None, (9, 0), None),
    ("DeepEP high-throughput", dict(moe_parallel_config=parallel(4, 1, 4, "deepep_high_throughput")),
     None, (9, 0), None),
    ("Blackwell", {}, None, (10, 0), "compute capability 10.0 (megamoe's kernels run on Hopper"),
    ("no GPU", {}, None, None, "no CUDA device"),
    ("DeepEP low-latency", dict(moe_parallel_config=parallel(4, 1, 4, "deepep_low_latency")),
     None, (9, 0), "the batched activation format of all2all backend 'deepep_low_latency'"),
    ("batched format", {}, (kNvfp4Static, None, BATCHED), (9, 0), "batched_experts"),
    ("MoonEP", dict(moe_parallel_config=parallel(4, 1, 4, "moonep")), None, (9, 0),
     "all2all backend 'moonep' (supported: allgather_reducescatter"),
    ("EPLB", dict(moe_parallel_config=parallel(4, 1, eplb=True)), None, (9, 0),
     "expert-parallel load balancing (EPLB)"),
    ("GELU", dict(activation=MoEActivation.GELU), None, (9, 0), "activation 'gelu' (SiLU-gated"),
    ("SwiGLU-OAI", dict(activation=MoEActivation.SWIGLUOAI), None, (9, 0), "activation 'swigluoai'"),
    ("FP8 weights", {}, (kFp8StaticTensorSym, None, STANDARD), (9, 0), "quantization scheme"),
    ("fp16", dict(in_dtype=torch.float16), None, (9, 0), "activation dtype torch.float16"),
    ("hidden 200", dict(H=200), None, (9, 0), "200 hidden dim is not supported"),
    ("I 96", dict(I=96), None, (9, 0), "intermediate size per partition 96"),
    ("E_loc < top_k", dict(E=16, k=8, ranks=4), None, (9, 0), "top_k 8 with 4 local experts"),
    ("bias", dict(has_bias=True), None, (9, 0), "expert biases"),
    ("swiglu alpha", dict(swiglu_alpha=1.702, swiglu_beta=1.0), None, (9, 0), "SwiGLU alpha=1.702"),
    ("LoRA", dict(is_lora_enabled=True), None, (9, 0), "LoRA"),
]


@pytest.mark.parametrize("change,keys,device,reason", [m[1:] for m in MATRIX],
                         ids=[m[0] for m in MATRIX])
def test_is_supported_config(monkeypatch, vllm_worker, change, keys, device, reason):
    monkeypatch.setattr(vllm_plugin, "_device_capability", lambda: device)
    config = moe_config(**{k: v for k, v in change.items()
                           if k in ("E", "k", "H", "I", "ranks", "rank")},
                        **{k: v for k, v in change.items()
                           if k not in ("E", "k", "H", "I", "ranks", "rank")})
    weight_key, activation_key, fmt = keys or (kNvfp4Static, None, STANDARD)
    ok, why = Experts.is_supported_config(Experts, config, weight_key, activation_key, fmt)
    if reason is None:
        assert (ok, why) == (True, None)
    else:
        assert not ok and why.startswith("kernel does not support") and reason in why, why


# ---- vLLM's own layer, end to end

def build_layer(E, k, H, I, ranks=1, rank=0, swiglu_limit=None, router_weight_on_input=False):
    """vLLM's RoutedExperts with the nvfp4_megamoe config: vLLM calls our method's constructor
    (the support check) and ModelOpt's create_weights."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization import get_quantization_config

    vllm_plugin.register()
    quant = get_quantization_config("nvfp4_megamoe").from_config(
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    config = moe_config(E, k, H, I, ranks, rank, swiglu_limit=swiglu_limit)
    experts_map = ExpertMapManager(
        max_num_batched_tokens=256, top_k=k, global_num_experts=E, num_redundant_experts=0,
        num_expert_group=None, moe_parallel_config=config.moe_parallel_config,
        placement_strategy="linear", enable_eplb=False)
    return RoutedExperts("model.layers.0.mlp.experts", torch.bfloat16, config, quant, experts_map,
                         swiglu_limit=swiglu_limit,
                         apply_router_weight_on_input=router_weight_on_input)


def load(layer, t):
    """The checkpoint's per-expert tensors (HF names) through vLLM's expert weight loader: gate and
    up rows into w13 as shards w1 and w3, each with its own weight_scale_2."""
    E, I = t["w13"].shape[0], t["w13"].shape[1] // 2
    for e in range(E):
        for shard, rows, col, proj in (("w1", slice(0, I), 0, "gate_proj"),
                                       ("w3", slice(I, 2 * I), 1, "up_proj")):
            prefix = f"experts.{e}.{proj}"
            layer.weight_loader(layer.w13_weight, t["w13"][e, rows], f"{prefix}.weight", shard, e)
            layer.weight_loader(layer.w13_weight_scale, t["w13_scale"][e, rows],
                                f"{prefix}.weight_scale", shard, e)
            layer.weight_loader(layer.w13_weight_scale_2, t["w13_scale_2"][e, col],
                                f"{prefix}.weight_scale_2", shard, e)
            layer.weight_loader(layer.w13_input_scale, torch.tensor(0.01),
                                f"{prefix}.input_scale", shard, e)
        prefix = f"experts.{e}.down_proj"
        layer.weight_loader(layer.w2_weight, t["w2"][e], f"{prefix}.weight", "w2", e)
        layer.weight_loader(layer.w2_weight_scale, t["w2_scale"][e], f"{prefix}.weight_scale",
                            "w2", e)
        layer.weight_loader(layer.w2_weight_scale_2, t["w2_scale_2"][e],
                            f"{prefix}.weight_scale_2", "w2", e)
        layer.weight_loader(layer.w2_input_scale, torch.tensor(0.01), f"{prefix}.input_scale",
                            "w2", e)


def vllm_dequantized(layer):
    """vLLM's own dequantization of the layer's ModelOpt NVFP4 experts (fp32, both w13 global
    scales), the one its requantization and emulation paths use."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_nvfp4_moe_weights)

    return dequantize_nvfp4_moe_weights(
        layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2, layer.w2_weight,
        layer.w2_weight_scale, layer.w2_weight_scale_2, torch.float32, group_size=16,
        invert_global_scales=False)


def torch_moe(x, w13, w2, topk_weights, topk_ids, expert_map, swiglu_limit=None):
    """A plain MoE in float64 on dequantized weights (the W4A16 forward: SwiGLU output rounded to
    bf16 once), the rank's experts only: ids that map to -1 contribute nothing."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    ids = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = x[rows] @ w13[e].T
        g, u = h[:, :I], h[:, I:]
        if swiglu_limit is not None:
            g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
        a = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).double()
        out.index_add_(0, rows, (a @ w2[e].T) * topk_weights.double()[rows, slots, None])
    return out


CASES = [
    # name, E, k, H, I, EP ranks, rank, T, swiglu_limit
    ("whole_T5", 16, 4, 256, 128, 1, 0, 5, None),
    ("whole_T41_chunked", 16, 4, 256, 128, 1, 0, 41, None),
    ("ep_slice_T7", 32, 6, 128, 64, 4, 1, 7, None),
    ("ep_slice_T40_chunked", 32, 6, 128, 64, 4, 3, 40, None),
    ("ep_slice_clamped_T33", 32, 4, 128, 192, 2, 0, 33, 0.75),
]
MAX_TOKENS = 16


@pytest.mark.parametrize("E,k,H,I,ranks,rank,T,limit", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_vllm_layer_runs_our_experts(monkeypatch, vllm_worker, hopper, cpu_reference,
                                     E, k, H, I, ranks, rank, T, limit):
    from vllm.config import set_current_vllm_config

    monkeypatch.setenv("MEGAMOE_VLLM_MAX_TOKENS", str(MAX_TOKENS))
    torch.manual_seed(1000 * E + 10 * T + rank)
    t = random_stacked(E, H, I)  # gate and up global scales differ per expert
    with set_current_vllm_config(vllm_worker):
        layer = build_layer(E, k, H, I, ranks, rank, limit)
        assert isinstance(layer.quant_method, vllm_plugin.ModelOptNvFp4MegaMoeMethod)
        load(layer, t)
        expert_map = layer.expert_map
        per = E // ranks
        assert layer.w13_weight.shape[0] == per
        assert (expert_map is None) == (ranks == 1)
        want_w13, want_w2 = vllm_dequantized(layer)
        params = dict(layer.named_parameters())
        layer.quant_method.process_weights_after_loading(layer)

        # Held once: the same parameters, prepared in place, both w13 global scales kept.
        assert dict(layer.named_parameters()).keys() == params.keys()
        assert all(p is params[n] for n, p in layer.named_parameters())
        handle = cpu_reference.prepared[-1]
        assert handle.tensors[0] is layer.w13_weight and handle.tensors[2] is layer.w13_weight_scale_2
        assert handle.tensors[2].shape == (per, 2) and handle.max_tokens == MAX_TOKENS
        assert handle.swiglu_limit == limit
        kernel = layer.quant_method.moe_kernel
        assert isinstance(kernel, mk.FusedMoEKernel) and kernel.fused_experts.__class__ is Experts

        x = torch.randn(T, H).to(torch.bfloat16)
        ids = torch.rand(T, E).argsort(dim=1)[:, :k].to(torch.int32)  # global ids
        w = torch.rand(T, k) + 0.05
        w = w / w.sum(dim=1, keepdim=True)
        if ranks > 1:
            assert bool((expert_map[ids.long()] == -1).any())  # other ranks' experts present
        out = layer.quant_method.apply(layer, x, w, ids, None, None)

    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert cpu_reference.calls == [min(MAX_TOKENS, T - s) for s in range(0, T, MAX_TOKENS)]
    want = torch_moe(x, want_w13, want_w2, w, ids, expert_map, limit).to(torch.bfloat16).float()
    # Within bf16 rounding: both sides are rounded to bf16 once; what differs before that is the
    # fp32 rounding of vLLM's scale products and the order of the sums.
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max())


def test_router_weight_on_the_input(monkeypatch, vllm_worker, hopper, cpu_reference):
    """Top-1 layers that weight the input (Llama 4): vLLM's prepare scales the input, the op then
    runs with weight 1."""
    from vllm.config import set_current_vllm_config

    E, k, H, I, T = 8, 1, 128, 64, 9
    torch.manual_seed(7)
    t = random_stacked(E, H, I)
    with set_current_vllm_config(vllm_worker):
        layer = build_layer(E, k, H, I, router_weight_on_input=True)
        load(layer, t)
        want_w13, want_w2 = vllm_dequantized(layer)
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(T, H).to(torch.bfloat16)
        ids = torch.randint(0, E, (T, 1), dtype=torch.int32)
        w = torch.rand(T, 1) + 0.5
        out = layer.quant_method.apply(layer, x, w, ids, None, None)
    scaled = (x * w.to(torch.bfloat16))  # what vLLM's prepare hands the experts
    want = torch_moe(scaled, want_w13, want_w2, torch.ones(T, 1), ids, None).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7,
                               atol=1e-3 * want.float().abs().max())


def test_vllm_layer_refuses_what_megamoe_cannot_run(vllm_worker, hopper):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_worker), pytest.raises(
            ValueError, match=r"nvfp4_megamoe: megamoe cannot run this MoE layer: kernel does not "
                              r"support top_k 8 with 4 local experts"):
        build_layer(16, 8, 128, 64, ranks=4, rank=0)
