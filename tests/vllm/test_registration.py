"""How vLLM finds the plugin and picks the method: the entry point declared in pyproject.toml,
discovered and run by vLLM's own plugin loader (VLLM_PLUGINS filtering included), and vLLM's own
quantization override rules (ModelConfig._verify_quantization) on ModelOpt and other checkpoints.
"""

import os
import subprocess
import sys
import tomllib
import types

import pytest

ROOT = os.environ.get("MEGAMOE_TEST_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megamoe import vllm_plugin

NAME = "nvfp4_megamoe"


def write_dist_info(where):
    """A dist-info for megamoe whose entry_points.txt is pyproject.toml's entry points, so that
    importlib.metadata finds them as it would in an installed wheel (installing needs the CUDA
    build)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dist = where / f"megamoe-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: megamoe\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return project


DISCOVER = """
import sys
from importlib.metadata import entry_points
found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "nvfp4_megamoe"]
assert [e.value for e in found] == ["megamoe.vllm_plugin:register"], found
from vllm.model_executor.layers import quantization as q
assert "nvfp4_megamoe" not in q.QUANTIZATION_METHODS
from vllm.plugins import load_general_plugins
load_general_plugins()
if "nvfp4_megamoe" in q.QUANTIZATION_METHODS:
    from megamoe.vllm_plugin import MegaMoeNvFp4Config, register
    assert q.get_quantization_config("nvfp4_megamoe") is MegaMoeNvFp4Config
    register()  # vLLM may load plugins more than once in a process
    assert q.QUANTIZATION_METHODS.count("nvfp4_megamoe") == 1
    assert "megamoe._ops" not in sys.modules, "registering loaded the CUDA extension"
    print("registered")
else:
    print("not registered")
"""


@pytest.mark.parametrize("plugins,want", [(None, "registered"), ("nvfp4_megamoe", "registered"),
                                          ("some_other_plugin", "not registered")])
def test_vllm_discovers_and_registers_the_entry_point(tmp_path, plugins, want):
    project = write_dist_info(tmp_path)
    assert project["optional-dependencies"]["vllm"] == ["vllm>=0.33,<0.34"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(ROOT, "python")]))
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    run = subprocess.run([sys.executable, "-c", DISCOVER], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().splitlines()[-1] == want, run.stdout


@pytest.fixture(scope="module")
def registered():
    vllm_plugin.register()


def verify(hf_quant_cfg, user_quant):
    """vLLM's ModelConfig._verify_quantization on a model whose config.json carries
    ``hf_quant_cfg``; the method it settles on."""
    from vllm.config.model import ModelConfig

    model = types.SimpleNamespace(
        quantization=user_quant, hf_config=types.SimpleNamespace(),
        model_arch_config=types.SimpleNamespace(quantization_config=hf_quant_cfg),
        allow_deprecated_quantization=False)
    ModelConfig._verify_quantization(model)
    return model.quantization


MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
MODELOPT_W4A16 = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16}
MODELOPT_LEGACY = {"quant_method": "modelopt",  # hf_quant_config.json's nesting
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                    "kv_cache_quant_algo": None, "exclude_modules": []}}
MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
COMPRESSED_TENSORS = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                      "config_groups": {}}


@pytest.mark.parametrize("cfg", [MODELOPT_NVFP4, MODELOPT_W4A16, MODELOPT_LEGACY],
                         ids=["NVFP4", "W4A16_NVFP4", "hf_quant_config"])
def test_the_flag_picks_megamoe_on_modelopt_nvfp4(registered, cfg):
    assert verify(dict(cfg), NAME) == NAME
    # Without the flag the checkpoint keeps vLLM's own method: the plugin never takes over.
    assert verify(dict(cfg), None) == "modelopt_fp4"


@pytest.mark.parametrize("cfg", [MODELOPT_FP8, COMPRESSED_TENSORS], ids=["modelopt_fp8",
                                                                         "compressed_tensors"])
def test_the_flag_on_another_format_is_refused(registered, cfg):
    # By the plugin, naming what the checkpoint is: vLLM's own ModelOpt FP8 override would have
    # run that checkpoint with "modelopt" instead, silently.
    with pytest.raises(ValueError, match=r"--quantization nvfp4_megamoe runs ModelOpt NVFP4 "
                                         r"checkpoints .*; this one has quant_method "
                                         + repr(cfg["quant_method"])):
        verify(dict(cfg), NAME)


def test_the_config_is_modelopts_with_its_own_name(registered):
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    cls = get_quantization_config(NAME)
    config = cls.from_config(dict(MODELOPT_NVFP4))
    assert isinstance(config, ModelOptNvFp4Config) and config.get_name() == NAME
    assert config.is_checkpoint_nvfp4_serialized and config.group_size == 16
    assert cls.get_min_capability() == 90
    assert cls.FusedMoEMethodCls is vllm_plugin.ModelOptNvFp4MegaMoeMethod
