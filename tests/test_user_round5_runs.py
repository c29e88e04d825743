"""A user's fifth round (issue 66), runs and caches: one run owns an --out (a second refuses in one line, the
lock goes with the run, even a killed one) and needle's report counts each generation once; needle batches
under --prefill-chunk give batch size 1's records; QuantizedCache and GrowingCache deep-copy and pickle
(transformers' prompt-reuse recipe), and a format given where the config goes is a clear error."""
import copy
import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from longpatch import cli
from longpatch.cache import GrowingCache, cache_argument
from longpatch.errors import ConfigError
from longpatch.eval.needle.run import needle, summarize
from longpatch.eval.records import read_records
from longpatch.outdir import LOCK, MARKER, claim_out, hold_out
from longpatch.quantized import QuantizedCache, QuantizedKV
from longpatch.testing.tiny import tiny_model

runner = CliRunner()


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# ---- 3. one run per --out; every report counts an item once ---------------------------------------

def _commands(tmp_path):
    """A cheap invocation of each command that writes an --out: today each fails after its --out check."""
    missing = str(tmp_path / "missing.jsonl")
    return {"eval needle": ("eval", "needle", "--model", "tiny:llama", "--no-progress"),
            "eval ppl": ("eval", "ppl", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", missing,
                         "--no-progress"),
            "eval longbench": ("eval", "longbench", "--model", "tiny:llama", "--data", "demo", "--no-progress"),
            "eval ruler": ("eval", "ruler", "--model", "tiny:llama", "--no-progress"),
            "calibrate": ("calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", missing,
                          "--no-progress"),
            "demo": ("demo", "--no-progress"),
            "bench decode": ("bench", "decode", "--cache-lens", "64", "--repeats", "1")}


@pytest.mark.parametrize("command", ["eval needle", "eval ppl", "eval longbench", "eval ruler", "calibrate", "demo",
                                     "bench decode"])
def test_a_second_run_on_a_held_out_refuses_in_one_line(tmp_path, monkeypatch, command):
    def work(*a, **k):
        raise AssertionError("the work started on a directory another run holds")

    monkeypatch.setattr("longpatch.eval.demo.demo_model_path", work)
    monkeypatch.setattr("longpatch.bench.decode.time_calls", work)
    out = tmp_path / "out"
    claim_out(out, command)  # a run of the same command writes there (a resume started before it finished)
    with hold_out(out, command):
        before = _snapshot(out)
        r = runner.invoke(cli.app, [*_commands(tmp_path)[command], "--out", str(out)])
        assert r.exit_code == 2, (r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        err = r.stderr
        # (eval ruler says first which tasks it skips without their data: its own warning, before the check)
        errors = [line for line in err.splitlines() if line.startswith("longpatch: error")]
        assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
        assert str(out) in errors[0] and "in use by another longpatch run" in errors[0], err
        assert _snapshot(out) == before  # nothing written, the holder's lock untouched
    assert sorted(p.name for p in out.iterdir()) == [MARKER]  # the lock goes with its run


def test_a_lock_attempt_on_a_held_directory_refuses_and_a_killed_holder_releases_it(tmp_path):
    out = tmp_path / "runs" / "needle"
    with hold_out(out, "eval needle"):
        with pytest.raises(ConfigError, match="in use by another longpatch run"):
            with hold_out(out, "eval needle"):
                pass
    assert not (tmp_path / "runs").exists()  # nothing was written: what the hold created is gone
    with pytest.raises(RuntimeError):  # a run that fails releases it too
        with hold_out(out, "eval needle"):
            raise RuntimeError
    # a crashed run: the OS releases its flock, so the next run goes on (the stale file is taken over)
    code = ("import sys, time\nfrom longpatch.outdir import hold_out\nwith hold_out(sys.argv[1], 'eval needle'):\n"
            "    print('held', flush=True)\n    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {p.pid}"):  # the refusal names the holder
            with hold_out(out, "eval needle"):
                pass
    finally:
        p.kill()
        p.wait()
    assert (out / LOCK).exists()  # killed: it had no chance to remove its file
    with hold_out(out, "eval needle"):
        pass
    assert not (out / LOCK).exists()


NEEDLE = dict(lengths="256", depths="0.5", trials=2, plots=False)


@pytest.fixture(scope="module")
def needle_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("needle") / "run"
    needle("demo", "0", out=str(out), progress=False, **NEEDLE)
    return out


def test_needle_reports_each_generation_once(needle_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(needle_run, out)
    records = out / "records.jsonl"
    lines = records.read_text().splitlines()
    assert len(lines) == 2
    # two runs that both did every item (before --out was locked): each record twice, in two files
    records.write_text("\n".join(lines + lines) + "\n")
    (out / "records.rank0.jsonl").write_text(lines[0] + "\n")
    res = summarize(out, plots=False)
    assert len(res["records"]) == 2 and [s["prompts"] for s in res["summary"]] == [2]
    assert json.loads((out / "results.json").read_text())["summary"][0]["prompts"] == 2


def test_the_lock_goes_with_the_run_so_a_resume_works(needle_run, capsys):
    assert not (needle_run / LOCK).exists()
    before = (needle_run / "records.jsonl").read_text()
    with hold_out(needle_run, "eval needle"):  # free: no run holds it any more
        pass
    capsys.readouterr()
    res = needle("demo", "0", out=str(needle_run), progress=True, **NEEDLE)
    assert "resuming: 2 of 2 generations" in capsys.readouterr().err
    assert (needle_run / "records.jsonl").read_text() == before and len(res["records"]) == 2
    assert not (needle_run / LOCK).exists()


# ---- 5. needle: --batch-size with --prefill-chunk ----------------------------------------------------

def test_needle_batches_with_prefill_chunks_give_the_records_of_batch_size_one(tmp_path, one_thread):
    """Prompts of 300 and 420 tokens, hyper active on 64-token chunks: a mixed batch would left-pad the
    300-token prompt and move its chunks; prompts of one length share a batch instead."""
    keep = ("config", "layers", "length", "depth", "trial", "expected", "predicted", "correct")

    def records(out):
        return sorted(tuple(r[k] for k in keep) for r in read_records(out))

    opts = dict(config="demo", lengths="300,420", depths="0.25,0.75", trials=1, progress=False, plots=False,
                sets=["params.min_seq_len=64", "min_seq_len=0"], prefill_chunk=64)
    needle("demo", "4", out=str(tmp_path / "one"), **opts)
    needle("demo", "4", out=str(tmp_path / "three"), batch_size=3, **opts)
    assert records(tmp_path / "one") == records(tmp_path / "three") and len(records(tmp_path / "one")) == 4
    batched = read_records(tmp_path / "three")  # in the order written: a batch's records one after another
    assert {r["batch"] for r in batched} == {2} and {r["prefill_chunk"] for r in batched} == {64}
    i = 0
    while i < len(batched):  # every batch holds prompts of one length (2 of each: one batch per length)
        assert len({r["length"] for r in batched[i:i + batched[i]["batch"]]}) == 1
        i += batched[i]["batch"]


# ---- 6. QuantizedCache / GrowingCache: deepcopy, pickle, a format where the config goes ----------------

def _filled(model, ids, cache):
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_argument(model): cache})
    return cache


def _continue(model, ids, cache, steps=6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **{cache_argument(model): cache})


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_filled_quantized_cache_deep_copies_for_prompt_reuse(fmt, one_thread):
    """transformers' prompt-reuse recipe: prefill a prefix once, deepcopy the cache per request."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 256, (1, 80), generator=g)
    asks = [torch.cat([prefix, torch.randint(3, 256, (1, n), generator=g)], 1) for n in (9, 14)]
    shared = _filled(model, prefix, QuantizedCache(config=model.config, fmt=fmt))
    copies = [copy.deepcopy(shared) for _ in asks]
    layer, copied = shared.layers[0], copies[0].layers[0]
    assert isinstance(copied.keys, QuantizedKV) and copied.keys.fmt == fmt
    assert copied._bufs[0].data_ptr() != layer._bufs[0].data_ptr()  # its own buffers...
    assert copied.keys.rows.data_ptr() == copied._bufs[0].data_ptr()  # ...that its keys still view
    got = [_continue(model, ask, c) for ask, c in zip(asks, copies)]
    for ask, g_ in zip(asks, got):  # as from a prefix prefilled for that request alone
        _same(g_, _continue(model, ask, _filled(model, prefix, QuantizedCache(config=model.config, fmt=fmt))))
    assert shared.get_seq_length() == 80  # the copies' requests left the original as it was
    _same(_continue(model, asks[0], shared), got[0])


@pytest.mark.parametrize("make", [lambda m: GrowingCache(config=m.config, reserve=8),
                                  lambda m: QuantizedCache(config=m.config),
                                  lambda m: QuantizedCache(config=m.config, fmt="fp8", reserve=8)],
                         ids=["growing", "int8", "fp8"])
def test_a_filled_cache_pickles_and_goes_on_as_the_original(make, one_thread):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 256, (1, 70), generator=g)
    ask = torch.cat([prefix, torch.randint(3, 256, (1, 7), generator=g)], 1)
    cache = _filled(model, prefix, make(model))
    back = pickle.loads(pickle.dumps(cache))
    assert type(back) is type(cache) and back.get_seq_length() == 70
    for a, b in zip(cache.layers, back.layers):
        plain = [t.dequantize() if isinstance(t, QuantizedKV) else t for t in (a.keys, a.values, b.keys, b.values)]
        assert torch.equal(plain[0], plain[2]) and torch.equal(plain[1], plain[3])
    _same(_continue(model, ask, back), _continue(model, ask, cache))
    # an empty one pickles too (its layers are made as the model's first forward reaches them)
    assert type(pickle.loads(pickle.dumps(make(model)))) is type(cache)


def test_a_format_or_reserve_where_the_config_goes_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"QuantizedCache\(fmt='fp8'\)"):
        QuantizedCache("fp8")
    with pytest.raises(TypeError, match=r"GrowingCache\(reserve=64\)"):
        GrowingCache(64)
    with pytest.raises(TypeError):  # the format by keyword only
        QuantizedCache(None, "fp8")
    assert QuantizedCache(fmt="fp8").fmt == "fp8"
