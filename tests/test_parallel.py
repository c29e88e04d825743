"""Sequence parallelism (longpatch.parallel, docs/distributed.md) on gloo with 2 CPU processes.

Starting processes costs seconds, so each group of checks runs in ONE spawn (module-scoped fixtures)
and the tests read its results: the op for every method / causality / GQA layout, its gradients, and
the model level. Each worker compares its own slice with the single-process result it computes itself.
"""
import json
import sys

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
# a query-aware selection is made per KV group too (Method.couples_heads): causal only, group spanning ranks
PARAMS["moba_estimate"] = dict(chunk_size=32, topk=4, selection="estimate")
OP_CASES += [("moba_estimate", True, 4, 1), ("moba_estimate", True, 6, 3)]


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

def _dump(res: dict, rank: int, out_file: str) -> None:
    """Rank 0 writes what its worker measured (the values are already maxima over the ranks)."""
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)


def _results(tmp_path_factory, worker) -> dict:
    """Run `worker` on 2 gloo processes once per module and read what rank 0 wrote."""
    out = tmp_path_factory.mktemp("sp") / "results.json"
    _spawn(worker, str(out))
    return json.loads(out.read_text())


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
    _dump(res, rank, out_file)


@pytest.fixture(scope="module")
def op_results(tmp_path_factory):
    return _results(tmp_path_factory, _op_worker)


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


# --------------------------------------------------------------------------- the model level

MODEL_N = 257  # slices of 129 and 128
MODEL_CASES = [  # (model, patch config or None); small blocks so the methods approximate at this length
    ("demo", None),
    ("demo", dict(method="hyper", layers="all", min_seq_len=0, params=dict(min_seq_len=32, block_size=16,
                                                                          sample_size=16))),
    ("demo", dict(method="moba", layers=2, params=dict(chunk_size=32, topk=2))),
    ("tiny:chatglm2", None),
    ("tiny:chatglm2", dict(method="nsa", layers="all", params=PARAMS["nsa"])),
    ("tiny:qwen2", dict(method="nsa", layers="all", params=PARAMS["nsa"])),  # 1 KV head: the group spans ranks
]


def _logits(out):
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def _model_worker(rank, out_file):
    from longpatch import load_model, patch_model
    from longpatch.parallel import sequence_parallel

    res = {}
    for i, (name, cfg) in enumerate(MODEL_CASES):
        model, _ = load_model(name)
        if cfg is not None:
            patch_model(model, cfg)
        vocab = model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.padded_vocab_size
        ids = torch.randint(0, vocab, (2, MODEL_N), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            ref = _logits(model(input_ids=ids))
            ref_loss = float(torch.nn.functional.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]),
                                                               ids[:, 1:].reshape(-1)))
            with sequence_parallel(model) as sp:
                out = model(input_ids=sp.shard(ids), labels=sp.shard(ids))
                if isinstance(out, tuple):  # chatglm2's tuple: (loss, logits, cache) with labels
                    loss, got = float(out[0]), out[1].float()
                else:
                    loss, got = float(out.loss), _logits(out)
                errors = []
                local = sp.shard(ids)
                for call, kwargs in ((model, dict(input_ids=local, use_cache=True)),
                                     (model.generate, dict(input_ids=local, max_new_tokens=1))):
                    try:
                        call(**kwargs)
                        errors.append("no error")
                    except ConfigError as exc:
                        errors.append(str(exc))
            s, e = sp.bounds(MODEL_N)
            after = _logits(model(input_ids=ids))  # the context restored the model
        key = f"{name}-{cfg['method'] if cfg else 'unpatched'}"
        res[key] = {"logits": _max_over_ranks(float((got - ref[:, s:e]).abs().max())),
                    "scale": float(ref.abs().max()), "loss": _max_over_ranks(abs(loss - ref_loss)),
                    "restored": _max_over_ranks(float((after - ref).abs().max())), "errors": errors}
        if cfg is not None:
            res[key]["calls"] = sum(n for r in model.longpatch.routes for (_, path), n in r.calls.items()
                                    if path in ("method", "method_exact"))
    _dump(res, rank, out_file)


@pytest.fixture(scope="module")
def model_results(tmp_path_factory):
    return _results(tmp_path_factory, _model_worker)


@pytest.mark.parametrize("name,cfg", MODEL_CASES, ids=[f"{n}-{c['method'] if c else 'unpatched'}"
                                                      for n, c in MODEL_CASES])
def test_model_same_logits_and_loss(model_results, name, cfg):
    r = model_results[f"{name}-{cfg['method'] if cfg else 'unpatched'}"]
    assert r["logits"] < 1e-4 * max(1.0, r["scale"]), r
    assert r["loss"] < 1e-5, r
    assert r["restored"] == 0.0
    if cfg is not None:
        assert r["calls"] > 0  # the method itself ran (through its route) under sequence parallelism
    for msg in r["errors"]:  # decoding is refused with one line
        assert "prefill / scoring only" in msg and "\n" not in msg


# --------------------------------------------------------------------------- eval ppl --sequence-parallel

def _cli(argv, monkeypatch, capsys):
    from test_cli import run
    return run(argv, monkeypatch, capsys)


def test_eval_ppl_sequence_parallel_matches_one_process(tmp_path, monkeypatch, capsys):
    """The CLI starts 2 processes with torch.distributed.run; results.json and the per-document NLLs agree."""
    from test_eval_longbench import write_longbench

    from longpatch.eval.records import read_records

    data = str(write_longbench(tmp_path / "lb"))
    common = ["eval", "ppl", "--model", "tiny:llama", "--layer-counts", "0,2", "--method", "moba", "--set",
              "params.chunk_size=16", "--set", "params.topk=2", "--set", "min_seq_len=0", "--data", data,
              "--tokenizer", "bytes", "--seq-len", "64", "--warmup", "0", "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert _cli([*common, "--out", str(one)], monkeypatch, capsys)[0] == 0
    assert _cli([*common, "--out", str(two), "--sequence-parallel", "2"], monkeypatch, capsys)[0] == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (one, two))
    assert len(a["configs"]) == len(b["configs"]) == 2
    for ca, cb in zip(a["configs"], b["configs"]):
        assert ca["config_id"] == cb["config_id"]
        for key in ("ppl", "ppl_doc_mean", "nll_mean", "scored_tokens", "docs"):
            if key in ca["all"]:
                assert cb["all"][key] == pytest.approx(ca["all"][key], rel=1e-6), key
    per_doc = [{(x["config_id"], x["doc_id"]): (x["nll_sum"], x["scored_tokens"]) for x in read_records(d)}
               for d in (one, two)]
    assert per_doc[0].keys() == per_doc[1].keys()
    for k, (nll, n) in per_doc[0].items():
        assert per_doc[1][k][1] == n and per_doc[1][k][0] == pytest.approx(nll, rel=1e-6)
    assert [p.name for p in two.glob("records*.jsonl")] == ["records.jsonl"]  # rank 0 writes, once per document


def test_eval_ppl_sequence_parallel_errors(tmp_path, monkeypatch, capsys):
    code, _, err = _cli(["eval", "ppl", "--model", "tiny:llama", "--sequence-parallel", "2", "--num-processes", "2",
                         "--out", str(tmp_path / "x")], monkeypatch, capsys)
    assert code == 2 and "cannot be combined with --num-processes" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(["eval", "ppl", "--model", "tiny:llama", "--sequence-parallel", "0"], monkeypatch, capsys)
    assert code == 2 and "--sequence-parallel: got 0" in err


def test_eval_ppl_sequence_parallel_worker_error_is_one_line(tmp_path, monkeypatch, capfd):
    """A bad input found in the workers (heads vs ranks): their one-line errors, no launcher traceback,
    a non-zero exit and no output directory."""
    from longpatch import cli

    out = tmp_path / "x"
    monkeypatch.setattr(sys, "argv", ["longpatch", "eval", "ppl", "--model", "tiny:llama", "--tokenizer", "bytes",
                                      "--data", "demo", "--seq-len", "64", "--max-docs", "1", "--layers", "0",
                                      "--no-progress", "--sequence-parallel", "3", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capfd.readouterr().err
    assert e.value.code == 2 and "4 query heads do not divide over 3 ranks" in err
    assert "Traceback" not in err and not out.exists()


def test_token_nll_of_a_one_token_slice_is_empty():
    """The last rank's slice of a short document can hold one token, which predicts nothing."""
    from longpatch.eval.ppl.scoring import token_nll
    from longpatch.testing.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.tensor([[5]])
    hidden = torch.zeros(1, 1, model.config.hidden_size)
    assert token_nll(model, hidden, ids).shape == (0,)
