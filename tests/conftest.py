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


@pytest.fixture
def one_thread():
    """Small shapes: one thread avoids waking thread pools for tiny ops (slow on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A LongBench directory of the suite's fixture documents (test_eval_longbench.write_longbench), per module."""
    from test_eval_longbench import write_longbench
    return str(write_longbench(tmp_path_factory.mktemp("longbench")))
