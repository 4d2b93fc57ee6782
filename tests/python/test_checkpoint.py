"""NVFP4MoE.from_checkpoint / megamoe.load_moe_layer: ModelOpt and compressed-tensors layers load
bit for bit into the stacked layout (CPU; no GPU needed), and broken checkpoints raise clear
errors. The checkpoints are written here with safetensors, as the exporters write them.
"""

import json
import os

import pytest

from support import megamoe, random_shared, random_stacked, torch, write_checkpoint

H, I, E = 64, 32, 6


def full_range_stacked():
    # Every valid ue4m3 block-scale byte can occur (0x00..0x7E, subnormals included).
    return random_stacked(E, H, I, scale_codes=(0x00, 0x7F))


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_qwen3_layer_loads_bit_identically(tmp_path, fmt, seed):
    stacked = full_range_stacked()
    router = torch.randn(E, H).to(torch.bfloat16)
    write_checkpoint(tmp_path, "qwen3_moe", fmt, layer=1, stacked=stacked, router=router, top_k=2)
    module = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 1, device="cpu")

    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        got = getattr(module, name)
        assert got.dtype == stacked[name].dtype, name
        assert same_bytes(got, stacked[name]), f"{name} differs (seed {seed})"
    for name in ("w13_scale_2", "w2_scale_2"):
        want = stacked[name]
        if fmt == "compressed-tensors":
            # Stored as the fp32 reciprocal, inverted once in fp32 by the loader.
            want = torch.tensor(1.0) / (torch.tensor(1.0) / want)
        assert torch.equal(getattr(module, name), want), f"{name} (seed {seed})"
    assert torch.equal(module.router_weight, router.float())
    assert module.top_k == 2 and module.method == "softmax" and module.renormalize
    assert module.shared_intermediate_size == 0 and module.swiglu_limit is None
    assert module.checkpoint_description["quant_format"] != ""


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_deepseek_layer_with_shared_expert_loads_bit_identically(tmp_path, fmt, seed):
    stacked = full_range_stacked()
    shared = random_shared(H, 2 * I, scale_codes=(0x00, 0x7F))
    router = torch.randn(E, H)
    bias = torch.randn(E) * 0.1
    write_checkpoint(tmp_path, "deepseek_v3", fmt, layer=0, stacked=stacked, shared=shared,
                     router=router, bias=bias, top_k=3, n_group=3, topk_group=2,
                     routed_scaling_factor=2.5, swiglu_limit=7.0)
    desc, tensors = megamoe.load_moe_layer(tmp_path, 0)
    assert desc["routing"] == {"method": "noaux_tc", "top_k": 3, "renormalize": True,
                               "n_group": 3, "topk_group": 2, "routed_scaling_factor": 2.5}
    assert desc["shared_intermediate_size"] == 2 * I and desc["swiglu_limit"] == 7.0
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert same_bytes(tensors[name], stacked[name]), f"{name} (seed {seed})"
        assert same_bytes(tensors["shared_" + name], shared[name]), f"shared_{name} (seed {seed})"
    assert tensors["shared_w2_scale_2"].shape == (1,)
    assert torch.equal(tensors["router_weight"], router)
    assert torch.equal(tensors["e_score_correction_bias"], bias)

    module = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    assert module.method == "noaux_tc" and module.n_group == 3 and module.topk_group == 2
    assert module.routed_scaling_factor == 2.5 and module.swiglu_limit == 7.0
    assert same_bytes(module.shared_w13, shared["w13"])


def test_state_dict_round_trip(tmp_path, seed):
    stacked = full_range_stacked()
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, stacked, router=torch.randn(E, H))
    a = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    b = megamoe.NVFP4MoE(H, I, E, 2, device="cpu")
    b.load_state_dict(a.state_dict())
    for name, buf in a.named_buffers():
        assert same_bytes(getattr(b, name), buf), name


def test_dtype_casts_leave_nvfp4_buffers_alone(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, full_range_stacked(),
                     router=torch.randn(E, H))
    module = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    before = {name: buf.clone() for name, buf in module.named_buffers()}
    module.to(torch.bfloat16)
    module.half()
    for name, buf in module.named_buffers():
        assert buf.dtype == before[name].dtype and same_bytes(buf, before[name]), name


def test_missing_tensor_is_named(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, full_range_stacked())
    from safetensors.torch import load_file, save_file

    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight_scale"]
    save_file(tensors, path)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight_scale"):
        megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")


def test_nan_block_scale_is_rejected_with_its_position(tmp_path):
    stacked = full_range_stacked()
    stacked["w2_scale"].view(torch.uint8)[2, 5, 1] = 0x7F
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, stacked)
    with pytest.raises(RuntimeError) as info:
        megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    text = str(info.value)
    assert "experts.2.down_proj.weight_scale" in text and "row 5, block 1" in text and "NaN" in text


def test_dense_layer_and_missing_config_are_rejected(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", "modelopt", 1, full_range_stacked(),
                     bias=torch.zeros(E), first_k_dense_replace=1, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="layer 0 .* is not a MoE layer"):
        megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    os.remove(os.path.join(tmp_path, "config.json"))
    with pytest.raises(RuntimeError, match="config.json' does not exist"):
        megamoe.NVFP4MoE.from_checkpoint(tmp_path, 1, device="cpu")


def test_unsupported_architecture_is_rejected(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, full_range_stacked())
    cfg_path = os.path.join(tmp_path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["MixtralForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(NotImplementedError, match="MixtralForCausalLM"):
        megamoe.load_moe_layer(tmp_path, 0)


def test_prepare_on_cpu_is_rejected(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", "modelopt", 0, full_range_stacked())
    module = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu")
    with pytest.raises(ValueError, match="move the module to a CUDA device"):
        module.prepare()
    x = torch.randn(3, H).to(torch.bfloat16)
    with pytest.raises(ValueError, match="move the module to a CUDA device"):
        module(x, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32))


class _TwoRankGroup:
    """What NVFP4MoE reads of a megamoe.EpGroup (rank 1 of 2), for a CPU module that is never
    prepared: the expert-parallel slicing without a GPU."""
    rank, world_size, hidden_size, top_k, max_tokens_per_rank = 1, 2, H, 2, 8

    def expert_range(self, num_experts):
        return num_experts // 2, num_experts // 2


def test_from_checkpoint_keeps_the_expert_parallel_ranks_experts(tmp_path):
    stacked = full_range_stacked()
    shared = random_shared(H, 2 * I)
    write_checkpoint(tmp_path, "deepseek_v3", "modelopt", 0, stacked, shared=shared,
                     router=torch.randn(E, H), bias=torch.randn(E), top_k=2, n_group=1,
                     topk_group=1)
    module = megamoe.NVFP4MoE.from_checkpoint(tmp_path, 0, device="cpu", ep_group=_TwoRankGroup())
    assert module.num_experts == E and module.num_local_experts == E // 2
    assert module.expert_first == E // 2 and "ep_rank=1, ep_size=2" in repr(module)
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert same_bytes(getattr(module, name), stacked[name][E // 2:]), name
        assert same_bytes(getattr(module, "shared_" + name), shared[name]), "shared_" + name
    assert module.router_weight.shape == (E, H)
    assert module.max_tokens == 8  # the group's max_tokens_per_rank
