"""Test-wide settings: no network, Triton kernels in the interpreter, deterministic torch."""
import os

# Must be set before anything imports triton (kernel tests run on CPU tensors).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
