"""Helpers of the megamoe Python tests: skips, random layers, checkpoint writers.

Importing this module skips the importing test module (with the reason shown) where torch or the
megamoe package is not installed. GPU tests are marked ``requires_hopper``: the kernels are built
for sm_90a only.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="the megamoe Python tests need torch")
megamoe = pytest.importorskip(
    "megamoe", reason="the megamoe package is not installed (pip install --no-build-isolation .)")


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


requires_hopper = pytest.mark.skipif(
    not hopper_available(),
    reason="needs a Hopper GPU (sm_90): the megamoe kernels are built for sm_90a")


def random_experts(E: int, H: int, I: int, dtype=torch.float32):
    """Unquantized expert weights (gate_up [E, 2I, H], down [E, H, I]) with a different scale per
    expert, per projection and per row (uniform data hides layout bugs), entries ~ 1/sqrt(K)."""
    def weights(shape, k):
        per_expert = torch.exp(torch.empty(shape[0], 1, 1).uniform_(-1.0, 1.0))
        per_row = torch.exp(torch.empty(shape[0], shape[1], 1).uniform_(-1.0, 1.0))
        return (torch.randn(shape) * per_expert * per_row / k ** 0.5).to(dtype)
    gate_up = torch.cat([weights((E, I, H), H), weights((E, I, H), H) * 3.0], dim=1)
    return gate_up, weights((E, H, I), I)


def random_stacked(E: int, H: int, I: int, scale_codes=(0x20, 0x48)) -> dict:
    """Stacked NVFP4 tensors with random bytes: every e2m1 code, block scale bytes drawn from
    ``scale_codes`` (a half-open range of ue4m3 codes; (1, 8) is the subnormals alone), random
    global scales per expert and projection that keep the outputs of order one."""
    lo, hi = scale_codes
    typical = 2.0 ** ((lo + hi) / 2 / 8 - 7) if lo >= 8 else 2.0 ** -9 * (lo + hi) / 2

    def scales(*shape):
        return torch.randint(lo, hi, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)

    def global_scales(*shape, k):
        return torch.empty(shape).uniform_(0.5, 2.0) / (3.0 * typical * k ** 0.5)

    return {
        "w13": torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8),
        "w13_scale": scales(E, 2 * I, H // 16),
        "w13_scale_2": global_scales(E, 2, k=H),
        "w2": torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8),
        "w2_scale": scales(E, H, I // 16),
        "w2_scale_2": global_scales(E, k=I),
    }


def random_shared(H: int, Is: int, scale_codes=(0x20, 0x48)) -> dict:
    """A shared expert's tensors (no E axis; w2_scale_2 of shape [1])."""
    t = {name: v[0] for name, v in random_stacked(1, H, Is, scale_codes).items()}
    t["w2_scale_2"] = t["w2_scale_2"].reshape(1)
    return t


def layer_tensors(module) -> dict:
    """The stacked tensors of an NVFP4MoE in the checkpoint layout, on its device, for the oracle
    (a prepared module's buffers hold the kernels' layout)."""
    return {name: t.to(module.w13.device) for name, t in module.checkpoint_tensors().items()}


# ---- synthetic checkpoints (what a ModelOpt or compressed-tensors export holds)

def _linear_tensors(prefix: str, codes, scales, global_scale: float, fmt: str) -> dict:
    if fmt == "modelopt":
        return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scales,
                f"{prefix}.weight_scale_2": torch.tensor(global_scale, dtype=torch.float32),
                f"{prefix}.input_scale": torch.tensor(0.01, dtype=torch.float32)}
    # compressed-tensors stores the reciprocal global scale, shape [1].
    return {f"{prefix}.weight_packed": codes, f"{prefix}.weight_scale": scales,
            f"{prefix}.weight_global_scale": torch.tensor([1.0 / global_scale], dtype=torch.float32)}


def write_checkpoint(path, arch: str, fmt: str, layer: int, stacked: dict,
                     shared: dict | None = None, router: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, top_k: int = 2, **config) -> None:
    """Writes config.json and model.safetensors holding model.layers.{layer}.mlp in the HF
    per-expert naming, from stacked tensors (gate = first half of w13's rows)."""
    from safetensors.torch import save_file

    E, two_i, half_h = stacked["w13"].shape
    I, H = two_i // 2, 2 * half_h
    mlp = f"model.layers.{layer}.mlp"
    tensors = {}

    def add_expert(prefix, t, idx):
        pick = (lambda x: x[idx]) if idx is not None else (lambda x: x)
        w13, s13, g13 = pick(t["w13"]), pick(t["w13_scale"]), pick(t["w13_scale_2"])
        inter = w13.shape[0] // 2
        tensors.update(_linear_tensors(f"{prefix}.gate_proj", w13[:inter].clone(),
                                       s13[:inter].clone(), float(g13[0]), fmt))
        tensors.update(_linear_tensors(f"{prefix}.up_proj", w13[inter:].clone(),
                                       s13[inter:].clone(), float(g13[1]), fmt))
        tensors.update(_linear_tensors(f"{prefix}.down_proj", pick(t["w2"]).clone(),
                                       pick(t["w2_scale"]).clone(),
                                       float(pick(t["w2_scale_2"]).reshape(-1)[0]), fmt))

    for e in range(E):
        add_expert(f"{mlp}.experts.{e}", stacked, e)
    if shared is not None:
        add_expert(f"{mlp}.shared_experts", shared, None)
    if router is not None:
        tensors[f"{mlp}.gate.weight"] = router.contiguous()
    if bias is not None:
        tensors[f"{mlp}.gate.e_score_correction_bias"] = bias.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))

    if fmt == "modelopt":
        quant = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    else:
        quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    cfg = {"hidden_size": H, "moe_intermediate_size": I, "num_experts_per_tok": top_k,
           "num_hidden_layers": layer + 1, "quantization_config": quant}
    if arch == "qwen3_moe":
        cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                    "num_experts": E, "norm_topk_prob": True})
    else:
        cfg.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "n_routed_experts": E, "first_k_dense_replace": 0,
                    "n_shared_experts": 0 if shared is None else shared["w13"].shape[0] // (2 * I)})
    cfg.update(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


# ---- multi-process tests (torch.distributed)

def nccl_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_nccl_available()


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for init_process_group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
