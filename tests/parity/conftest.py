"""Fixtures of the parity suite: the megamoe binary, and the tiny models exported once per run
by the real libraries (export.py, one process per export)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
MODEL_NAMES = ["qwen3_moe", "deepseek_v3"]


def pytest_configure(config):
    # Nothing may be fetched: every model, tokenizer and dataset here is made locally.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"


# Lines the tests report (what was compared, how much), printed at the end of the run.
RECORDS = []


def record(line: str) -> None:
    RECORDS.append(line)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("parity: what was compared")
    for line in RECORDS:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def megamoe() -> str:
    path = os.environ.get("MEGAMOE_BIN", "")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"MEGAMOE_BIN='{path}' is not an executable megamoe tool; run tests/parity/run.sh")
    return path


def run_tool(megamoe: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([megamoe, *args], capture_output=True, text=True)
    assert r.returncode == 0, f"megamoe {' '.join(args)} failed ({r.returncode}):\n{r.stderr}"
    return r


class Exports:
    """Runs each export step once per session, in its own process, and remembers where it went."""

    def __init__(self, root: Path):
        self.root = root
        self.done = {}

    def get(self, model: str, step: str) -> Path:
        key = (model, step)
        if key in self.done:
            return self.done[key]
        out = self.root / f"{model}-{step}"
        if (out / ".complete").exists():  # a finished export in a reused PARITY_WORK directory
            self.done[key] = out
            return out
        src = model if step == "base" else str(self.get(model, "base"))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(HERE / "export.py"), step, src, str(out)],
                           cwd=HERE, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.fail(f"export.py {step} {model} failed ({r.returncode}):\n{r.stdout[-4000:]}\n"
                        f"{r.stderr[-8000:]}")
        record(f"export {model} {step}: {time.monotonic() - t0:.1f} s")
        (out / ".complete").touch()
        self.done[key] = out
        return out


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> Exports:
    root = os.environ.get("PARITY_WORK")
    return Exports(Path(root) if root else tmp_path_factory.mktemp("exports"))


def read_tensors(path: Path) -> dict:
    """Every tensor of a .safetensors file (or a directory's model.safetensors) as raw numpy bytes
    with its dtype name and shape: {name: (dtype, shape, uint8 array)}."""
    if path.is_dir():
        path = path / "model.safetensors"
    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            raw = t.contiguous().view(torch.uint8).numpy().copy() if t.dim() else \
                t.reshape(1).contiguous().view(torch.uint8).numpy().copy()
            out[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw.reshape(-1))
    return out


def tensor(path: Path, name: str) -> torch.Tensor:
    if path.is_dir():
        path = path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name)


def u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
