"""Fixtures of the vLLM plugin suite (tests/vllm/run.sh): vLLM 0.33 on the CPU, no GPU."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("MEGAMOE_TEST_ROOT") or os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

torch = pytest.importorskip("torch", reason="the vLLM suite needs torch (tests/vllm/run.sh)")
vllm = pytest.importorskip("vllm", reason="the vLLM suite needs vLLM 0.33 (tests/vllm/run.sh)")


@pytest.fixture(scope="session")
def vllm_worker():
    """What a vLLM worker sets up before it builds layers, on the CPU: the current VllmConfig (CPU
    device), a one-rank gloo process group with its tensor/pipeline-parallel groups, and the
    workspace manager that the modular kernel takes its buffers from."""
    import socket

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.platforms import current_platform
    from vllm.v1.worker import workspace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        if not current_platform.is_cpu() and workspace._manager is None:
            workspace.init_workspace_manager(torch.device("cpu"))
        yield config


@pytest.fixture
def cpu_reference(monkeypatch):
    """megamoe's op replaced by the CPU reference in every MegaMoeExperts made meanwhile."""
    from megamoe import vllm_plugin
    from reference_backend import CpuReference

    backend = CpuReference()
    monkeypatch.setattr(vllm_plugin.MegaMoeExperts, "backend", backend)
    return backend


@pytest.fixture
def hopper(monkeypatch):
    """vLLM's device query answering sm_90, for the checks past the device's."""
    from megamoe import vllm_plugin

    monkeypatch.setattr(vllm_plugin, "_device_capability", lambda: (9, 0))
