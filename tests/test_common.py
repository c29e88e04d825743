"""Shared helpers of the methods: run_units (independent CPU work spread over single-threaded workers)."""
import threading

import pytest
import torch

from longpatch.methods.common import run_units


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_run_units_runs_every_unit_on_workers_without_grad(two_threads):
    seen, lock = {}, threading.Lock()
    out = torch.zeros(10)

    def fn(i):
        x = torch.ones(3, requires_grad=True)
        with lock:
            seen[i] = (threading.current_thread() is threading.main_thread(), torch.get_num_threads(),
                       (x * 2).requires_grad)
        out[i] = i  # each unit writes its own slice

    run_units(fn, range(10))
    assert sorted(seen) == list(range(10))
    assert not any(main for main, _, _ in seen.values())  # workers, not the caller
    assert {n for _, n, _ in seen.values()} == {1}  # one torch thread each
    assert not any(grad for _, _, grad in seen.values())
    assert torch.get_num_threads() == 2  # restored for the caller
    torch.testing.assert_close(out, torch.arange(10.0))


@pytest.mark.usefixtures("one_thread")
def test_run_units_serial_with_one_thread():
    where = []
    run_units(lambda i: where.append(threading.current_thread() is threading.main_thread()), range(3))
    assert where == [True, True, True]


def test_run_units_raises_a_workers_error_and_restores_threads(two_threads):
    def fn(i):
        if i == 3:
            raise ValueError("unit 3 failed")

    with pytest.raises(ValueError, match="unit 3 failed"):
        run_units(fn, range(6))
    assert torch.get_num_threads() == 2


def test_run_units_keeps_the_callers_inference_mode(two_threads):
    """A patched model evaluated under torch.inference_mode: the workers write into the caller's
    inference tensors."""
    with torch.inference_mode():
        out = torch.zeros(6)

        def fn(i):
            out[i] = torch.ones(1) * i

        run_units(fn, range(6))
    torch.testing.assert_close(out, torch.arange(6.0))


@pytest.mark.parametrize("name", ["moba", "nsa", "sparse", "hyper"])
def test_torch_paths_run_where_the_fused_cpu_kernel_does_not(name, monkeypatch):
    """On a GPU the fused CPU kernel is not there: the methods' torch paths attend through
    lse_attention.attend, which falls back to the plain reference, so prefill and decode still run; here
    the kernel is switched off (and raises, as it does on CUDA tensors) and the results must not move."""
    from longpatch.methods import available_methods, cpu_flash

    params = {"moba": {"chunk_size": 16, "topk": 2}, "sparse": {"window": 16, "block": 8, "random_blocks": 1},
              "nsa": {"compress_block": 16, "compress_stride": 8, "select_block": 16, "num_selected": 4,
                      "window": 16}, "hyper": {"block_size": 16, "sample_size": 16, "min_seq_len": 32}}[name]
    bound = available_methods()[name].bind(params, 16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 96, 16, generator=g) for h in (4, 2, 2))

    def run():
        state = {}
        pre = bound(q[:, :, :95], k[:, :, :95], v[:, :, :95], backend="torch", state=state)
        dec = bound(q[:, :, 95:], k, v, backend="torch", state=state) if bound.method.decode else None
        return pre, dec

    fused = run()
    def no_kernel(*args, **kwargs):
        raise NotImplementedError("the fused CPU kernel on a CUDA tensor")

    import sys

    for mod in [m for n, m in sys.modules.items() if n.startswith("longpatch.") and hasattr(m, "fused_ok")]:
        monkeypatch.setattr(mod, "fused_ok", lambda *a: False)  # what every check answers for CUDA tensors
    monkeypatch.setattr(cpu_flash, "FA_CPU", no_kernel)
    plain = run()
    torch.testing.assert_close(plain[0], fused[0], atol=2e-5, rtol=2e-5)
    if fused[1] is not None:
        torch.testing.assert_close(plain[1], fused[1], atol=2e-5, rtol=2e-5)


def test_decode_softmax_of_rows_far_below_their_max_equals_its_definition():
    """``cpu_flash.softmax_lse`` floors exp's inputs at EXP_FLOOR (torch's slow exp path): on rows
    spread like a real model's (most keys 100+ below the max) it equals the float64 softmax and
    logsumexp, and an infinite score still makes its row NaN."""
    from longpatch.methods.common import EXP_FLOOR
    from longpatch.methods.cpu_flash import softmax_lse

    s = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 60
    assert float((s - s.amax(-1, keepdim=True)).min()) < 2 * EXP_FLOOR
    p, lse = softmax_lse(s.clone())
    torch.testing.assert_close(p.double(), torch.softmax(s.double(), -1), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s.double(), -1, keepdim=True), atol=1e-5, rtol=1e-6)
    assert softmax_lse(torch.tensor([[0.0, float("inf")]]))[0].isnan().all()
