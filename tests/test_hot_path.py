"""The hot path: a decode step's non-finite guard reads only what the step attends, timing
is opt-in, ops leave the process-wide thread count alone, and the wheel holds every subpackage."""
import threading
import zipfile

import pytest
import torch

import longpatch
from longpatch.methods import common
from longpatch.ops import moba_attention, moba_chunk_means, nsa_attention, nsa_compress, sparse_attention
from longpatch.testing.tiny import tiny_model

NSA = dict(compress_block=16, compress_stride=8, select_block=16, num_selected=4, window=16)
DECODE = {
    "moba": lambda q, k, v: moba_attention(q, k, v, chunk_size=16, topk=2,
                                           chunk_means=moba_chunk_means(k, chunk_size=16)),
    "nsa": lambda q, k, v: nsa_attention(q, k, v, **NSA,
                                         compressed=nsa_compress(k, v, compress_block=16, compress_stride=8)),
    "sparse": lambda q, k, v: sparse_attention(q, k, v, window=16, global_tokens=2, block=16),
}


def _cache(n=256, hq=2, hk=1, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, 1, d, generator=g), torch.randn(1, hk, n, d, generator=g),
            torch.randn(1, hk, n, d, generator=g))


@pytest.fixture
def full_passes(monkeypatch):
    """Rows of k/v read by the guard's whole-cache pass (nonfinite_rows), call by call."""
    seen = []
    real = common.nonfinite_rows

    def counting(k, v):
        seen.append(k.shape[2])
        return real(k, v)
    monkeypatch.setattr(common, "nonfinite_rows", counting)
    return seen


@pytest.mark.parametrize("name", list(DECODE))
def test_a_finite_decode_step_does_not_read_the_whole_cache(name, full_passes):
    q, k, v = _cache()
    out = DECODE[name](q, k, v)
    assert torch.isfinite(out).all()
    assert full_passes == []  # before #26: one pass over all 256 rows per step
    # prefill keeps its guard: one pass over k and v
    qp = torch.randn(1, 2, 64, 16)
    sparse_attention(qp, k[:, :, :64], v[:, :, :64], window=16, global_tokens=2, block=16)
    assert full_passes == [64]


@pytest.mark.parametrize("name", list(DECODE))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_decode_step_that_reads_a_bad_row_is_nan_and_one_that_does_not_is_unchanged(name, bad):
    q, k, v = _cache()
    ref = DECODE[name](q, k, v)
    near, far = k.clone(), v.clone()
    near[0, 0, 250, 3] = bad  # in the window / own chunk of the last position: attended by every method
    assert not torch.isfinite(DECODE[name](q, near, v)).all()
    if name == "nsa":  # NSA's compressed branch pools every position: no row goes unread
        return
    # a value row the step does not read: MoBA's chunk 6 made the worst match for q (its keys -q), the
    # sparse pattern is positional (global tokens 0-1 and the last 16 positions)
    k[0, 0, 96:112] = -q[0, 0, 0]
    ref = DECODE[name](q, k, v)
    far = v.clone()
    far[0, 0, 100, 3] = bad
    torch.testing.assert_close(DECODE[name](q, k, far), ref)


def test_timing_is_opt_in():
    model = tiny_model("llama")
    longpatch.patch_model(model, {"method": "moba", "layers": 1, "params": {"chunk_size": 8, "topk": 2}})
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        model(ids)
    stats = model.longpatch.stats()
    assert stats["patched"]["method"]["calls"] == 1 and stats["patched"]["method"]["seconds"] == 0.0
    assert stats["unpatched"]["original"]["seconds"] == 0.0
    assert not any(r.timed for r in model.longpatch.routes)
    with torch.no_grad(), longpatch.timing(model):
        model(ids)
    stats = model.longpatch.stats()
    assert stats["patched"]["method"]["calls"] == 2 and stats["patched"]["method"]["seconds"] > 0
    assert not any(r.timed for r in model.longpatch.routes)  # restored after the block
    longpatch.unpatch_model(model)
    longpatch.patch_model(model, {"method": "moba", "layers": 1}, timed=True)
    assert all(r.timed for r in model.longpatch.routes)
    with pytest.raises(ValueError, match="not patched"):
        with longpatch.timing(tiny_model("llama")):
            pass


def test_ops_leave_the_global_thread_count_alone(monkeypatch):
    """NSA's units run on worker threads and HyperAttention's small-op stretches on one thread, each
    limiting only its own thread: torch.set_num_threads (process-wide) is never called."""
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    q, k, v = torch.randn(1, 2, 512, 16), torch.randn(1, 1, 512, 16), torch.randn(1, 1, 512, 16)
    seen = []

    def other_thread():  # a thread started while an op runs sees the caller's count
        seen.append(torch.get_num_threads())
    nsa_attention(q, k, v, **NSA)
    longpatch.ops.hyper_attention(q, k, v, block_size=16, sample_size=16, min_seq_len=64)
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert calls == [] and seen == [torch.get_num_threads()]


def test_a_limited_worker_thread_does_not_change_other_threads():
    if not common.can_limit_threads():
        pytest.skip("the OpenMP runtime cannot be reached here")
    before = torch.get_num_threads()
    inside = []

    def worker():
        with common.one_thread():
            inside.append(torch.get_num_threads())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert inside == [1] and torch.get_num_threads() == before


def test_a_limited_worker_limits_mkl_too_after_a_global_set_num_threads():
    """torch.set_num_threads also sets MKL's process-wide count, which overrides OpenMP's per-thread one
    in MKL's GEMMs: one_thread sets MKL's per-thread count as well (measured: NSA prefill at 32k ran
    2x slower, two workers each on two threads, without it)."""
    import ctypes
    import os

    if common._mkl_set_local() is None or not common.can_limit_threads():
        pytest.skip("no MKL inside torch here")
    get = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).MKL_Get_Max_Threads
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []

    def worker():
        with common.one_thread():
            seen.append(get())
        seen.append(get())
    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_the_wheel_holds_every_subpackage(tmp_path):
    """Packages are discovered (setup.py): every folder of longpatch/ with an __init__.py, and the
    top-level kernels/ and configs/, are in the wheel."""
    pytest.importorskip("setuptools")
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(root)], capture_output=True, text=True, cwd=tmp_path)
    if r.returncode != 0:
        pytest.skip(f"pip wheel failed here: {r.stderr.strip().splitlines()[-1:]}")
    names = zipfile.ZipFile(next(tmp_path.glob("longpatch-*.whl"))).namelist()
    want = {str(p.parent.relative_to(root)) for p in (root / "longpatch").rglob("__init__.py")}
    want |= {"longpatch/kernels", "longpatch/configs"}
    have = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert want <= have, sorted(want - have)
    assert any(n.startswith("longpatch/configs/") and n.endswith(".yaml") for n in names)
