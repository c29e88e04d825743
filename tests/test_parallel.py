"""Sequence parallelism (longpatch.parallel, docs/distributed.md) on gloo with 2 CPU processes.

Starting processes costs seconds, so each group of checks runs in ONE spawn (module-scoped fixtures)
and the tests read its results: the op for every method / causality / GQA layout, its gradients, and
the model level. Each worker compares its own slice with the single-process result it computes itself.
"""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longpatch.errors import ConfigError
from longpatch.parallel import head_plan, kv_heads_for, layout
from longpatch.parallel.comm import free_port

WORLD = 2
D = 16
N = 301  # odd: slices of 151 and 150
# small blocks so that every method approximates at this length (not its exact short-sequence path)
PARAMS = {
    "exact": {},
    "hyper": dict(min_seq_len=32, block_size=16, sample_size=16, seed=3),
    "moba": dict(chunk_size=32, topk=2),
    "nsa": dict(compress_block=16, compress_stride=8, select_block=16, num_selected=4, window=32),
    "sparse": dict(window=32, global_tokens=4, random_blocks=2, block=16, seed=5),
    "performer": dict(num_features=32, seed=7),
    "linear": {},
    "moba_shared": dict(chunk_size=32, topk=2, shared_selection=True),  # "moba" with the group voting together
}
OP_CASES = [(m, c, hq, hk) for m in PARAMS for c in (True, False) for hq, hk in ((4, 2), (4, 1))]
OP_CASES += [("exact", True, 4, 4), ("hyper", True, 6, 3), ("exact", False, 6, 3), ("nsa", True, 6, 3),
             ("moba_shared", True, 4, 1), ("moba_shared", False, 6, 3)]  # 6/3: uneven KV grouping


def _spawn(fn, *args):
    """fn(rank, port, *args) in WORLD processes; a failure in any of them fails the caller."""
    mp.spawn(_entry, args=(fn, free_port(), args), nprocs=WORLD, join=True)


def _entry(rank, fn, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _tensors(hq, hk, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, D, generator=g), torch.randn(1, hk, n, D, generator=g),
            torch.randn(1, hk, n, D, generator=g))


def _bounds(rank, n, lens=None):
    if lens is None:
        per = -(-n // WORLD)
        lens = [min(n, (r + 1) * per) - min(n, r * per) for r in range(WORLD)]
    s = sum(lens[:rank])
    return s, s + lens[rank]


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# --------------------------------------------------------------------------- the op

def _op_worker(rank, out_file):
    from longpatch.methods import get_method
    from longpatch.parallel import ulysses_attention

    res = {}
    for method, causal, hq, hk in OP_CASES:
        key = f"{method}-{'causal' if causal else 'full'}-{hq}/{hk}"
        q, k, v = _tensors(hq, hk)
        s, e = _bounds(rank, N)
        name = method.split("_")[0]
        try:
            ref = get_method(name).bind(PARAMS[method], D)(q, k, v, causal=causal)[:, :, s:e]
        except ValueError as exc:  # nsa is causal-only: SP must refuse the same call
            try:
                ulysses_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], method=name, causal=causal,
                                  **PARAMS[method])
                res[key] = "no error"
            except ValueError:
                res[key] = "refused"
            del exc
            continue
        got = ulysses_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], method=name, causal=causal,
                                **PARAMS[method])
        res[key] = _max_over_ranks(float((got - ref).abs().max()))

    # uneven slices given explicitly (seq_lens skips the all_gather)
    lens = [200, 101]
    q, k, v = _tensors(4, 2)
    s, e = _bounds(rank, N, lens)
    got = ulysses_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], seq_lens=lens)
    ref = get_method("exact").bind({}, D)(q, k, v)[:, :, s:e]
    res["exact-uneven-200/101"] = _max_over_ranks(float((got - ref).abs().max()))

    # gradients through both all-to-alls (exact, GQA 4/2): each rank's slice of dq, dk, dv
    q, k, v = (t.double().requires_grad_() for t in _tensors(4, 2))
    w = torch.randn(1, 4, N, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (get_method("exact").bind({}, D)(q, k, v) * w).sum().backward()
    s, e = _bounds(rank, N)
    want = [t.grad[:, :, s:e] for t in (q, k, v)]
    ql, kl, vl = (t.detach()[:, :, s:e].clone().requires_grad_() for t in (q, k, v))
    (ulysses_attention(ql, kl, vl) * w[:, :, s:e]).sum().backward()
    res["grad"] = _max_over_ranks(max(float((a.grad - b).abs().max()) for a, b in zip((ql, kl, vl), want)))

    # heads that do not divide over the ranks: one clear error, before any communication
    try:
        ulysses_attention(*(t[:, :3] for t in _tensors(4, 1, n=8)))
        res["heads-error"] = "no error"
    except ConfigError as exc:
        res["heads-error"] = str(exc)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)


@pytest.fixture(scope="module")
def op_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "op.json"
    _spawn(_op_worker, str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("method,causal,hq,hk", OP_CASES)
def test_op_equals_single_process(op_results, method, causal, hq, hk):
    got = op_results[f"{method}-{'causal' if causal else 'full'}-{hq}/{hk}"]
    if method == "nsa" and not causal:
        assert got == "refused"
    else:
        assert got < 1e-5, got


def test_op_uneven_slices_and_gradients(op_results):
    assert op_results["exact-uneven-200/101"] < 1e-5
    assert op_results["grad"] < 1e-10


def test_op_heads_error(op_results):
    msg = op_results["heads-error"]
    assert "3 query heads" in msg and "2 ranks" in msg and "\n" not in msg


def test_kv_head_plan():
    assert kv_heads_for(4, 2, 2) == [[0], [1]] and layout(4, 2, 2) == "split"
    assert kv_heads_for(4, 1, 2) == [[0], [0]] and layout(4, 1, 2) == "replicated"
    assert kv_heads_for(8, 2, 4) == [[0], [0], [1], [1]]
    assert kv_heads_for(6, 3, 2) == [[0, 0, 1], [1, 2, 2]]  # uneven grouping: one copy per query head
    assert kv_heads_for(8, 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a method coupling a group's heads (nsa) gets whole groups: rank 1 computes heads 2-5, keeps 3-5
    assert head_plan(6, 3, 2, whole_groups=True) == [([0, 1, 2, 3], [0, 1]), ([2, 3, 4, 5], [1, 2])]
    assert head_plan(4, 2, 2, whole_groups=True) == head_plan(4, 2, 2)
    with pytest.raises(ConfigError, match="6 query heads do not divide over 4 ranks"):
        kv_heads_for(6, 2, 4)


def test_needs_process_group():
    from longpatch.parallel import ulysses_attention
    with pytest.raises(ConfigError, match="init_process_group"):
        ulysses_attention(*_tensors(4, 2, n=8))
