"""`megamoe quantize` against ModelOpt's own export of the same bf16 weights: every tensor it writes
must be the exporter's, byte for byte, for an export run on the CPU and (emulated) on a GPU."""

import json
import re

import numpy as np
import pytest

from conftest import MODEL_NAMES, read_tensors, record, run_tool, tensor, u8
from models import MODELS, zeroed_expert

STEPS = {"cpu": "modelopt", "gpu": "modelopt-gpu"}


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_quantize_is_byte_identical_to_the_modelopt_export(model, device, exports, megamoe,
                                                            tmp_path):
    base = exports.get(model, "base")
    export = exports.get(model, STEPS[device])
    # Leave out what the exporter left out (its hf_quant_config.json says which modules).
    excluded = json.loads((export / "hf_quant_config.json").read_text())["quantization"][
        "exclude_modules"]
    regex = "^(" + "|".join(re.escape(m) for m in excluded) + r")\.weight$"
    out = tmp_path / "quantized.safetensors"
    run_tool(megamoe, "quantize", str(base / "model.safetensors"), str(out), "--exclude", regex,
             "--export-device", device)

    ours, theirs = read_tensors(out), read_tensors(export)
    # The exporter also writes the activation calibration (input_scale), which needs data that
    # quantize does not have; every other tensor must be there on both sides.
    assert sorted(set(theirs) - set(ours)) == sorted(n for n in theirs if n.endswith(".input_scale"))
    assert sorted(set(ours) - set(theirs)) == []
    quantized = [n[: -len(".weight_scale_2")] for n in ours if n.endswith(".weight_scale_2")]
    assert quantized, "quantize wrote no NVFP4 tensor"
    mismatched = []
    compared = 0
    for name, (dtype, shape, raw) in sorted(ours.items()):
        t_dtype, t_shape, t_raw = theirs[name]
        if (dtype, shape) != (t_dtype, t_shape) or not np.array_equal(raw, t_raw):
            differ = int((raw != t_raw).sum()) if raw.shape == t_raw.shape else -1
            mismatched.append(f"{name}: ours {dtype}{list(shape)}, export {t_dtype}"
                              f"{list(t_shape)}, {differ} of {t_raw.size} bytes differ")
        compared += raw.size
    assert not mismatched, f"{len(mismatched)} tensors differ:\n" + "\n".join(mismatched[:20])
    record(f"quantize vs ModelOpt export ({model}, {device}): {len(ours)} tensors, "
           f"{len(quantized)} NVFP4 linears, {compared} bytes identical")


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_the_exports_exercise_grouping_division_and_zero_weights(model, exports):
    """What the byte comparison relies on to be able to fail: fused groups whose members' own
    amax differ, CPU and GPU exports that differ, and the zero-weight signature in both."""
    spec = MODELS[model]
    base = exports.get(model, "base")
    cpu, gpu = exports.get(model, "modelopt"), exports.get(model, "modelopt-gpu")
    mlp = f"model.layers.{spec.moe_layer}.mlp"

    # Gate and up of every non-zero expert share one weight_scale_2 in the export, while their
    # own amax differ in most experts: quantizing each alone would give other bytes.
    own_amax_differ = 0
    for e in range(8):
        p = f"{mlp}.experts.{e}"
        g, u = (tensor(cpu, f"{p}.{n}_proj.weight_scale_2").item() for n in ("gate", "up"))
        assert g == u, f"{p}: the export's gate/up global scales differ ({g} vs {u})"
        amax = [tensor(base, f"{p}.{n}_proj.weight").abs().max().item() for n in ("gate", "up")]
        own_amax_differ += amax[0] != amax[1]
    assert own_amax_differ > 0

    # The two divisions: some global scales one ulp apart, and the codes they move.
    names = [n for n in read_tensors(cpu) if n.endswith(".weight_scale_2")]
    s2_differ = sum(tensor(cpu, n).item() != tensor(gpu, n).item() for n in names)
    codes_differ = sum(int((u8(tensor(cpu, n[:-8])) != u8(tensor(gpu, n[:-8]))).sum())
                       for n in names)
    assert s2_differ > 0 and codes_differ > 0
    # The all-zero expert: weight_scale_2 0, NaN block scales (x86's negative NaN on the CPU, the
    # GPU's positive one), codes 0x77.
    z = f"{mlp}.experts.{zeroed_expert(spec)}"
    for export, nan in ((cpu, 0xFF), (gpu, 0x7F)):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert tensor(export, f"{z}.{proj}.weight_scale_2").item() == 0.0
            assert np.all(u8(tensor(export, f"{z}.{proj}.weight_scale")) == nan)
            assert np.all(u8(tensor(export, f"{z}.{proj}.weight")) == 0x77)
    record(f"exports ({model}): gate/up own amax differ in {own_amax_differ} of 8 experts; "
           f"CPU vs GPU export: {s2_differ} of {len(names)} global scales and {codes_differ} "
           f"code bytes differ")
