"""Swap the MoE blocks of a small transformers model for megamoe.NVFP4MoE and compare the logits.

    python examples/swap_moe_block.py [--arch qwen3_moe|deepseek_v3] [--tool PATH] [--keep DIR]

1. Builds a small, randomly initialised Qwen3-MoE or DeepSeek-V3 model from the installed
   transformers (bf16, on the GPU).
2. Writes its MoE layers (routed experts, shared expert, router) in the Hugging Face per-expert
   naming to a safetensors file and quantizes the experts to ModelOpt NVFP4 with
   `megamoe quantize` (--tool, else `megamoe` on PATH, else build*/megamoe of this repository);
   without the tool, with megamoe.quantize_nvfp4, the same recipe bit for bit.
3. Loads every MoE layer with NVFP4MoE.from_checkpoint and puts it in place of the model's block.
4. Compares the logits with (a) the same model whose experts hold the dequantized NVFP4 weights in
   bf16 (what the kernels must reproduce) and (b) the original bf16 model (the quantization error).

Needs a Hopper GPU, transformers and safetensors. Exits with status 1 when (a) is not close.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

import megamoe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERTS_REGEX = r"mlp\.(experts|shared_experts)\."
MIN_COSINE_VS_DEQUANTIZED = 0.999


def build_model(arch: str):
    """A small random model; H and I are multiples of 64 (the kernels' granularity)."""
    import transformers

    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  moe_intermediate_size=128, num_attention_heads=4, num_experts_per_tok=4,
                  max_position_embeddings=256)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_hidden_layers=2, num_key_value_heads=2,
                                             head_dim=64, num_experts=16, norm_topk_prob=True,
                                             **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.DeepseekV3Config(
            num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
            n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, **common)
        model = transformers.DeepseekV3ForCausalLM(config)
    # Routers initialised to zero route by index alone; give them (and the correction bias) a
    # spread so that every expert sees tokens.
    with torch.no_grad():
        for block in moe_blocks(model).values():
            block.gate.weight.normal_(0.0, 1.0 / config.hidden_size ** 0.5)
            if hasattr(block.gate, "e_score_correction_bias"):
                block.gate.e_score_correction_bias.normal_(0.0, 0.02)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def moe_blocks(model) -> dict:
    return {i: layer.mlp for i, layer in enumerate(model.model.layers)
            if hasattr(layer.mlp, "experts")}


def layer_tensors(index: int, block) -> dict:
    """The block's weights under the Hugging Face checkpoint names (bf16, CPU)."""
    prefix = f"model.layers.{index}.mlp"
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # [E, 2I, H], [E, H, I]
    inter = gate_up.shape[1] // 2
    out = {f"{prefix}.gate.weight": block.gate.weight}
    if hasattr(block.gate, "e_score_correction_bias"):
        out[f"{prefix}.gate.e_score_correction_bias"] = block.gate.e_score_correction_bias.float()
    for e in range(gate_up.shape[0]):
        out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        out[f"{prefix}.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        out[f"{prefix}.experts.{e}.down_proj.weight"] = down[e]
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{prefix}.shared_experts.{proj}.weight"] = getattr(shared, proj).weight
    return {name: t.detach().cpu().contiguous() for name, t in out.items()}


def find_tool(given: str | None) -> str | None:
    if given:
        return given
    candidates = [shutil.which("megamoe")] + sorted(glob.glob(os.path.join(REPO, "build*", "megamoe")))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def quantize_in_process(src: str, dst: str) -> None:
    """What `megamoe quantize --include EXPERTS_REGEX` writes, through megamoe.quantize_nvfp4."""
    import re

    from safetensors.torch import load_file, save_file

    out = {}
    for name, t in load_file(src).items():
        if re.search(EXPERTS_REGEX, name) and name.endswith(".weight") and t.dim() == 2:
            base = name[: -len(".weight")]
            codes, scales, global_scale = megamoe.quantize_nvfp4(t)
            out.update({f"{base}.weight": codes, f"{base}.weight_scale": scales,
                        f"{base}.weight_scale_2": global_scale})
        else:
            out[name] = t
    save_file(out, dst)


def write_checkpoint(model, directory: str, tool: str | None) -> str:
    from safetensors.torch import save_file

    tensors = {}
    for index, block in moe_blocks(model).items():
        tensors.update(layer_tensors(index, block))
    unquantized = os.path.join(directory, "unquantized.safetensors")
    save_file(tensors, unquantized)
    quantized_dir = os.path.join(directory, "nvfp4")
    os.makedirs(quantized_dir, exist_ok=True)
    quantized = os.path.join(quantized_dir, "model.safetensors")
    if tool:
        subprocess.run([tool, "quantize", unquantized, quantized, "--include", EXPERTS_REGEX],
                       check=True)
        how = f"megamoe quantize ({tool})"
    else:
        quantize_in_process(unquantized, quantized)
        how = "megamoe.quantize_nvfp4 (no megamoe tool found; the same ModelOpt recipe)"
    config = json.loads(model.config.to_json_string(use_diff=False))
    config["architectures"] = [type(model).__name__]
    if "num_local_experts" in config and "n_routed_experts" not in config:
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the checkpoints on
        # the hub (and megamoe's config reader) use the Qwen3MoeConfig name, num_experts.
        config["num_experts"] = config["num_local_experts"]
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                     "group_size": 16}
    with open(os.path.join(quantized_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"quantized with: {how}")
    return quantized_dir


def dequantized_copy(model, nvfp4_blocks: dict):
    """The original model with each MoE block's expert weights replaced by the bf16 values of
    the NVFP4 weights (routers unchanged)."""
    reference = copy.deepcopy(model)

    def dequantized(codes, scales, global_scales):
        return megamoe.dequantize_nvfp4(codes.contiguous(), scales.contiguous(),
                                        global_scales.contiguous())

    with torch.no_grad():
        for index, block in moe_blocks(reference).items():
            q = nvfp4_blocks[index]
            # A prepared block's buffers hold the kernels' layout: read the checkpoint's.
            t = q.checkpoint_tensors()
            inter = q.intermediate_size
            gate = dequantized(t["w13"][:, :inter], t["w13_scale"][:, :inter], t["w13_scale_2"][:, 0])
            up = dequantized(t["w13"][:, inter:], t["w13_scale"][:, inter:], t["w13_scale_2"][:, 1])
            block.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            block.experts.down_proj.copy_(dequantized(t["w2"], t["w2_scale"], t["w2_scale_2"]))
            if q.shared_intermediate_size:
                s_inter = q.shared_intermediate_size
                shared = block.shared_experts
                shared.gate_proj.weight.copy_(dequantized(
                    t["shared_w13"][:s_inter], t["shared_w13_scale"][:s_inter],
                    t["shared_w13_scale_2"][0]))
                shared.up_proj.weight.copy_(dequantized(
                    t["shared_w13"][s_inter:], t["shared_w13_scale"][s_inter:],
                    t["shared_w13_scale_2"][1]))
                shared.down_proj.weight.copy_(dequantized(t["shared_w2"], t["shared_w2_scale"],
                                                          t["shared_w2_scale_2"]))
    return reference


def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.float().flatten(0, -2), want.float().flatten(0, -2)
    cosine = torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0).item()
    top1 = (g.argmax(-1) == w.argmax(-1)).float().mean().item()
    print(f"logits vs {name}: cosine {cosine:.6f}, max |diff| {(g - w).abs().max().item():.4g} "
          f"(max |logit| {w.abs().max().item():.4g}), top-1 agreement {100 * top1:.1f}%")
    return cosine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe")
    parser.add_argument("--tool", help="the megamoe executable (default: PATH, then build*/)")
    parser.add_argument("--keep", help="write the checkpoints here and keep them")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = build_model(args.arch)
    blocks = moe_blocks(model)
    print(f"model: {type(model).__name__}, random init, {len(model.model.layers)} layers, "
          f"MoE layers {sorted(blocks)}")
    input_ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    with torch.no_grad():
        original = model(input_ids).logits

    directory = args.keep or tempfile.mkdtemp(prefix="megamoe_example_")
    os.makedirs(directory, exist_ok=True)
    try:
        checkpoint = write_checkpoint(model, directory, find_tool(args.tool))
        nvfp4_blocks = {i: megamoe.NVFP4MoE.from_checkpoint(checkpoint, i, max_tokens=256)
                        for i in blocks}
    finally:
        if not args.keep:
            shutil.rmtree(directory)
    print(nvfp4_blocks[min(nvfp4_blocks)])
    print(nvfp4_blocks[min(nvfp4_blocks)].describe(args.batch * args.seq))

    reference = dequantized_copy(model, nvfp4_blocks)
    for i, block in nvfp4_blocks.items():
        model.model.layers[i].mlp = block
    with torch.no_grad():
        swapped = model(input_ids).logits
        dequantized = reference(input_ids).logits

    cosine = compare("the bf16 model with the dequantized NVFP4 experts", swapped, dequantized)
    compare("the original bf16 model", swapped, original)
    if cosine < MIN_COSINE_VS_DEQUANTIZED:
        print(f"FAILED: cosine {cosine:.6f} < {MIN_COSINE_VS_DEQUANTIZED} against the dequantized "
              "reference")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
