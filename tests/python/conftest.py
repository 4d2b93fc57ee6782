"""Shared fixtures of the megamoe Python tests (pytest); helpers are in support.py."""

import os

import pytest

torch = pytest.importorskip("torch", reason="the megamoe Python tests need torch")


@pytest.fixture
def seed():
    """A fresh seed from the OS (or MEGAMOE_TEST_SEED, to replay a failure), also seeding torch:
    tests put it in their failure messages."""
    value = int(os.environ.get("MEGAMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    return value
