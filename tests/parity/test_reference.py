"""`megamoe reference` against transformers' own MoE block of the same model, fed the exact
dequantized weights (e2m1 * ue4m3 * s2 in float64) and run in float64.

The design's forward (docs/design.md §2) rounds twice to bf16: the SwiGLU activation a (it feeds a bf16
MMA) and the output. So per output element h the two may differ by at most
    2^-8 |y_h|  +  2^-8 sum_k w_k sum_i |W2_k[h, i]| |a_k,i|  (+ the shared expert's, weight 1)
(bf16 keeps 8 significant bits: a rounding moves a value by at most 2^-8 of itself), plus 2^-16 of
that sum for the fp32 steps on both sides (routing weights, global scales). A wrong weight, scale,
layout or routing is far outside it."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import nvfp4
from conftest import MODEL_NAMES, read_tensors, record, run_tool, tensor, u8
from models import MODELS, zeroed_expert

TOKENS = 96


def exact_weight(export, prefix):
    """float64 weight of one NVFP4 linear, in either layout, as megamoe reads its scales."""
    if prefix + ".weight_packed" in KEYS.setdefault(export, set(read_tensors(export))):
        packed = tensor(export, prefix + ".weight_packed")
        g = tensor(export, prefix + ".weight_global_scale").item()
        s2 = float(np.float32(1.0) / np.float32(g))  # compressed-tensors stores the reciprocal
    else:
        packed = tensor(export, prefix + ".weight")
        s2 = tensor(export, prefix + ".weight_scale_2").item()
    pk, sc = u8(packed), u8(tensor(export, prefix + ".weight_scale"))
    if s2 == 0.0 and np.all(sc & 0x7F == 0x7F) and np.all(pk == 0x77):
        return np.zeros((pk.shape[0], pk.shape[1] * 2))  # ModelOpt's all-zero weight
    return nvfp4.exact(pk, sc, s2)


KEYS = {}


def hf_block(model, export):
    """transformers' MoE block of the checked layer, float64, holding the exact weights."""
    from transformers import AutoConfig

    spec = MODELS[model]
    cfg = AutoConfig.from_pretrained(export)
    if model == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    block = Block(cfg).double().eval()
    mlp = f"model.layers.{spec.moe_layer}.mlp"
    w = {}
    with torch.no_grad():
        for e in range(block.experts.gate_up_proj.shape[0]):
            g, u, d = (exact_weight(export, f"{mlp}.experts.{e}.{p}_proj")
                       for p in ("gate", "up", "down"))
            w[e] = (g, u, d)
            block.experts.gate_up_proj[e].copy_(torch.from_numpy(np.concatenate([g, u])))
            block.experts.down_proj[e].copy_(torch.from_numpy(d))
        block.gate.weight.copy_(tensor(export, f"{mlp}.gate.weight").double())
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.copy_(
                tensor(export, f"{mlp}.gate.e_score_correction_bias").double())
        shared = None
        if getattr(block, "shared_experts", None) is not None:
            shared = tuple(exact_weight(export, f"{mlp}.shared_experts.{p}_proj")
                           for p in ("gate", "up", "down"))
            for p, m in zip(("gate_proj", "up_proj", "down_proj"), shared):
                getattr(block.shared_experts, p).weight.copy_(torch.from_numpy(m))
    return block, w, shared


def silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("exporter", ["modelopt", "llmcompressor"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_reference_matches_the_transformers_block(model, exporter, exports, megamoe, tmp_path):
    spec = MODELS[model]
    export = exports.get(model, exporter)
    block, w, shared = hf_block(model, export)
    hidden_size = block.gate.weight.shape[1]

    g = torch.Generator().manual_seed(spec.seed + 3)
    x = torch.randn(TOKENS, hidden_size, generator=g).to(torch.bfloat16)
    save_file({"hidden": x}, str(tmp_path / "x.safetensors"))
    r = run_tool(megamoe, "reference", "--checkpoint", str(export), "--layer",
                 str(spec.moe_layer), "--input", str(tmp_path / "x.safetensors"), "--output",
                 str(tmp_path / "y.safetensors"))
    y = load_file(str(tmp_path / "y.safetensors"))

    xd = x.double()
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(xd)
        hf_out = block(xd[None])[0].numpy()
    ids, weights = y["topk_ids"].long().numpy(), y["topk_weights"].double().numpy()
    hf_ids, hf_weights = hf_ids.numpy(), hf_weights.double().numpy()

    # Routing: the same experts for every token, weights equal to fp32 precision.
    order, hf_order = np.argsort(ids, axis=1), np.argsort(hf_ids, axis=1)
    ids_s, hf_ids_s = np.take_along_axis(ids, order, 1), np.take_along_axis(hf_ids, hf_order, 1)
    assert np.array_equal(ids_s, hf_ids_s), (
        f"routing differs for tokens {np.flatnonzero((ids_s != hf_ids_s).any(1)).tolist()}")
    w_s, hf_w_s = np.take_along_axis(weights, order, 1), np.take_along_axis(hf_weights, hf_order, 1)
    np.testing.assert_allclose(w_s, hf_w_s, rtol=2.0**-20, atol=0)

    # The bound of the design's two bf16 roundings, from the float64 intermediates.
    xn = xd.numpy()
    act_sum = np.zeros_like(hf_out)
    for t in range(TOKENS):
        for e, wt in zip(ids[t], weights[t]):
            gw, uw, dw = w[e]
            a = silu(gw @ xn[t]) * (uw @ xn[t])
            act_sum[t] += wt * (np.abs(dw) @ np.abs(a))
        if shared is not None:
            gw, uw, dw = shared
            act_sum[t] += np.abs(dw) @ np.abs(silu(gw @ xn[t]) * (uw @ xn[t]))
    bound = 2.0**-8 * (np.abs(hf_out) + act_sum) + 2.0**-16 * act_sum
    ours = nvfp4.bf16_to_f64(u8(y["output"]).view(np.uint16)).reshape(hf_out.shape)
    err = np.abs(ours - hf_out)
    worst = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-300)), err.shape)
    assert np.all(err <= bound), (
        f"{int((err > bound).sum())} of {err.size} outputs outside the bound; worst at token "
        f"{worst[0]}, element {worst[1]}: |{ours[worst]} - {hf_out[worst]}| > {bound[worst]}")
    cos = float((ours * hf_out).sum() / np.sqrt((ours**2).sum() * (hf_out**2).sum()))
    zero_routed = int((ids == zeroed_expert(spec)).sum())
    if exporter == "modelopt":
        assert "all-zero weight" in r.stderr  # the loader named the zero expert's tensors
    record(f"reference vs transformers ({model}, {exporter}): {TOKENS} tokens, routing identical "
           f"({zero_routed} selections of the all-zero expert), worst error "
           f"{float((err / bound).max()):.3f} of the bf16 bound, cosine {cos:.9f}")
