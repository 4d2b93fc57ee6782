"""Builds the tiny models and exports them with the real libraries, one step per process.

    python export.py base MODEL OUT_DIR             bf16 checkpoint (random init, fixed seed)
    python export.py modelopt BASE_DIR OUT_DIR      mtq.quantize + export_hf_checkpoint (CPU)
    python export.py modelopt-gpu BASE_DIR OUT_DIR  the same, with torch's CUDA arithmetic emulated
    python export.py llmcompressor BASE_DIR OUT_DIR oneshot(QuantizationModifier NVFP4), compressed

Each exporter runs in its own process: ModelOpt and llm-compressor both patch transformers'
modules and torch state, and neither may see the other's changes.
"""

import json
import sys
from pathlib import Path

import torch

from models import MODELS, calibration_ids, make_tokenizer, zeroed_expert


def build_base(model: str, out: Path) -> None:
    spec = MODELS[model]
    torch.manual_seed(spec.seed)
    m = spec.model_class()(spec.config()).to(torch.bfloat16)
    layer = m.model.layers[spec.moe_layer].mlp
    with torch.no_grad():
        # An all-zero expert (gate, up and down): ModelOpt exports it as its zero-weight signature.
        e = zeroed_expert(spec)
        layer.experts.gate_up_proj[e].zero_()
        layer.experts.down_proj[e].zero_()
        if hasattr(layer.gate, "e_score_correction_bias"):
            # transformers initialises the noaux_tc bias to zeros; a random one tests its use. It
            # stays fp32, as in DeepSeek's checkpoints (transformers keeps it fp32 on loading).
            g = torch.Generator().manual_seed(spec.seed + 1)
            bias = 0.05 * torch.randn(layer.gate.e_score_correction_bias.shape, generator=g)
            layer.gate.e_score_correction_bias.data = bias.to(torch.float32)
    m.save_pretrained(out)
    make_tokenizer(spec).save_pretrained(out)


def load(base: Path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    m.eval()
    return m


class CudaArithmetic(torch.overrides.TorchFunctionMode):
    """Torch on a CUDA tensor, where its CPU results differ, for ModelOpt's unmodified code:

    - `tensor / python_scalar` multiplies by the scalar's fp32 reciprocal (the CUDA kernel's
      `a * (opmath_t(1) / b)`): ModelOpt's `amax.float() / (6.0 * 448.0)` becomes
      amax * fl32(1/2688), one ulp from the CPU quotient for about a fifth of amax values;
    - a NaN made by a division is the GPU's canonical NaN, sign bit clear (x86 makes 0/0 with the
      sign bit set), so an all-zero weight's block scales become 0x7F instead of 0xFF.

    Both were measured with torch 2.11 on an H100 (every positive bf16 amax; an all-zero weight).
    """

    DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide,
                 torch.Tensor.__itruediv__, torch.Tensor.div_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DIVISIONS and kwargs.get("rounding_mode") is None and len(args) == 2:
            a, b = args
            if (isinstance(a, torch.Tensor) and a.is_floating_point()
                    and isinstance(b, (int, float)) and not isinstance(b, bool)):
                # The kernel's opmath type: fp32 for fp32/bf16/fp16 tensors, fp64 for fp64.
                opmath = torch.float64 if a.dtype == torch.float64 else torch.float32
                reciprocal = torch.tensor(1.0, dtype=opmath) / torch.tensor(float(b), dtype=opmath)
                out = (a.to(opmath) * reciprocal).to(a.dtype)
                if func in (torch.Tensor.__itruediv__, torch.Tensor.div_):
                    return a.copy_(out)
                return out
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                out = out.masked_fill(torch.isnan(out), float("nan"))  # +NaN, sign bit clear
            return out
        return func(*args, **kwargs)


def export_modelopt(base: Path, out: Path, gpu: bool) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    m = load(base)
    ids = calibration_ids(MODELS[json.loads((base / "config.json").read_text())["model_type"]])

    def forward_loop(model):
        with torch.no_grad():
            for i in range(0, ids.shape[0], 2):
                model(ids[i:i + 2])

    mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    if gpu:
        with CudaArithmetic():
            export_hf_checkpoint(m, export_dir=out)
    else:
        export_hf_checkpoint(m, export_dir=out)


def export_llmcompressor(base: Path, out: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoTokenizer

    m = load(base)
    spec = MODELS[m.config.model_type]
    ids = calibration_ids(spec)
    data = Dataset.from_dict({"input_ids": ids.tolist(),
                              "attention_mask": torch.ones_like(ids).tolist()})
    # The router stays unquantized, as in ModelOpt's export (and in published checkpoints).
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4",
                                  ignore=["lm_head", r"re:.*mlp\.gate$"])
    oneshot(model=m, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
            max_seq_length=ids.shape[1], processor=AutoTokenizer.from_pretrained(base))
    m.save_pretrained(out, save_compressed=True)


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    step, src, out = argv[1], argv[2], Path(argv[3])
    if step == "base":
        build_base(src, out)
    elif step in ("modelopt", "modelopt-gpu"):
        export_modelopt(Path(src), out, gpu=step == "modelopt-gpu")
    elif step == "llmcompressor":
        export_llmcompressor(Path(src), out)
    else:
        sys.exit(f"unknown step '{step}'; expected base, modelopt, modelopt-gpu or llmcompressor")


if __name__ == "__main__":
    main(sys.argv)
