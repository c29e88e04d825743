"""Bad inputs a user met (issue 66): YAML alias bombs in a config, a saved directory or --set; damaged or
unsafe weight files; --save onto a symlink; RULER tasks named without their data; the demo trainer's
checkpoint unpickled unsafely; calibrate's interrupt line and its resume key (dtype, attention)."""
import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_eval_longbench import record
from typer.testing import CliRunner

import longpatch
from longpatch import cli
from longpatch.calibrate import parse_grid
from longpatch.config import LoadSpec, PatchConfig, read_config
from longpatch.errors import ConfigError, LongpatchError, shown
from longpatch.eval.ruler import run as ruler_run
from longpatch.eval.sweep import Prepared, loading_identity
from longpatch.options import parse_set
from longpatch.testing.tiny import tiny_model
from longpatch.yamlio import MAX_NODES, load_yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:  # scripts/ is no package (as test_build_demo_model)
    sys.path.insert(0, str(ROOT / "scripts"))

from demo_model import train  # noqa: E402

runner = CliRunner()
RULER_FIXTURES = ROOT / "tests" / "fixtures" / "ruler"
RULER = ["eval", "ruler", "--model", "tiny:llama", "--tokenizer", "bytes", "--lengths", "2048", "--no-progress",
         "--samples", "1", "--layer-counts", "0"]


def invoke(*argv):
    return runner.invoke(cli.app, [str(a) for a in argv])


def assert_one_line_error(r, *needles, longest: int = 600):
    """exit 2, one short line on stderr naming what is wrong, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    err = r.stderr
    assert err.count("\n") == 1 and "Traceback" not in err, err[:2000]
    assert len(err) < longest, (len(err), err[:300])
    for n in needles:
        assert n in err, err


# ---- 2. YAML alias bombs ---------------------------------------------------------------------------------

def bomb(depth: int = 9, width: int = 9) -> str:
    """A YAML flow list whose last item stands for width**depth scalars: a few hundred bytes."""
    parts = ["&c0 [" + ",".join(["x"] * width) + "]"]
    parts += [f"&c{i} [" + ",".join([f"*c{i - 1}"] * width) + "]" for i in range(1, depth)]
    return "[" + ", ".join(parts) + "]"


def test_an_alias_bomb_is_measured_not_expanded():
    text = bomb()
    assert len(text) < 500
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"expands to more than {MAX_NODES} values"):
        load_yaml(text, "config: x.yaml")
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(ConfigError, match="contains itself"):
        load_yaml("a: &a [1, *a]", "config: x.yaml")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_yaml("[" * 50_000 + "]" * 50_000, "config: x.yaml")
    # a real config's aliases (shared params) still load
    assert load_yaml("p: &p {topk: 4}\nq: *p\n", "config: x.yaml") == {"p": {"topk": 4}, "q": {"topk": 4}}


def test_an_alias_bomb_in_a_config_file_is_refused_fast_in_one_line(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(f"method: moba\nparams:\n  topk: {bomb()}\n")
    assert cfg.stat().st_size < 500
    t0 = time.perf_counter()
    r = invoke("apply", "--model", "tiny:llama", "--config", cfg)
    assert time.perf_counter() - t0 < 1.0
    assert_one_line_error(r, str(cfg), "expands to more than", "allowed")


def test_an_alias_bomb_in_a_saved_directory_is_refused_fast_in_one_line(tmp_path):
    saved = tmp_path / "saved"
    tiny_model("llama").save_pretrained(saved)
    (saved / "longpatch.yaml").write_text(f"model: tiny:llama\nmethod: moba\nlayers: {bomb()}\n")
    for argv in (["--model", saved], ["--model", "tiny:llama", "--config", saved]):
        t0 = time.perf_counter()
        r = invoke("apply", *argv)
        assert time.perf_counter() - t0 < 1.0
        assert_one_line_error(r, str(saved / "longpatch.yaml"), "expands to more than")


def test_an_alias_bomb_in_set_and_grid_is_refused_fast_in_one_line():
    t0 = time.perf_counter()
    r = invoke("apply", "--model", "tiny:llama", "--method", "moba", "--set", f"topk={bomb()}")
    assert time.perf_counter() - t0 < 1.0
    assert_one_line_error(r, "--set topk", "expands to more than")
    with pytest.raises(ConfigError, match="--set layers: expands"):
        parse_set(f"layers={bomb()}")
    with pytest.raises(ConfigError, match="--grid topk: expands"):
        parse_grid([f"topk={bomb()}"], "moba")


def test_errors_quote_a_bounded_excerpt_of_a_value():
    shared = ["x"] * 9
    for _ in range(9):
        shared = [shared] * 9  # 9**10 items, shared: its repr would be gigabytes
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        PatchConfig(layers=shared)
    assert time.perf_counter() - t0 < 0.5 and len(str(e.value)) < 300 and "layers: got [[[" in str(e.value)
    loop: list = []
    loop.append(loop)
    assert len(shown(loop)) <= 83 and len(shown("y" * 10**6)) <= 83
    assert shown(10**5000) == "<an int of about 5001 digits>"
    assert shown({"a": (1,), "b": [None, True]}) == repr({"a": (1,), "b": [None, True]})


def test_a_long_message_is_cut_to_one_short_line(tmp_path):
    # 5000 values pass the size check; a method's own check quotes its value whole, the CLI cuts the line
    cfg = tmp_path / "long.yaml"
    cfg.write_text("method: moba\nparams:\n  topk: [" + ", ".join(["1"] * 5000) + "]\n")
    r = invoke("apply", "--model", "tiny:llama", "--config", cfg)
    assert_one_line_error(r, "params.topk", "allowed", longest=cli.MAX_MESSAGE + 100)


def test_bundled_configs_still_load():
    for alias in ("demo-moba-32k", "llama-3.1-8b-moba-hybrid", "tiny-llama"):
        assert read_config(alias).patch.method


# ---- 7. damaged and unsafe weight files -----------------------------------------------------------------

class NotWeights:
    """A class a pickle names: torch's weights_only loader refuses to build it."""


def test_a_truncated_safetensors_file_is_one_line(tmp_path):
    d = tmp_path / "model"
    tiny_model("llama").save_pretrained(d)
    weights = d / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    r = invoke("apply", "--model", d)
    assert_one_line_error(r, str(weights), "truncated or damaged safetensors")
    with pytest.raises(LongpatchError, match="model.safetensors"):
        longpatch.load_model(str(d))


def test_a_pytorch_bin_the_safe_loader_refuses_is_one_line(tmp_path):
    d = tmp_path / "model"
    model = tiny_model("llama")
    model.save_pretrained(d)
    (d / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "extra": NotWeights()}, d / "pytorch_model.bin")
    r = invoke("apply", "--model", d)
    assert_one_line_error(r, str(d / "pytorch_model.bin"), "weights_only", "NotWeights")


def test_a_truncated_pytorch_bin_is_one_line(tmp_path):
    d = tmp_path / "model"
    model = tiny_model("llama")
    model.save_pretrained(d)
    (d / "model.safetensors").unlink()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    os.truncate(d / "pytorch_model.bin", (d / "pytorch_model.bin").stat().st_size // 2)
    assert_one_line_error(invoke("apply", "--model", d), str(d / "pytorch_model.bin"), "truncated or damaged")


# ---- 8. --save onto a symlink ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["to an empty directory", "dangling", "through a dangling one"])
def test_save_onto_a_symlink_is_refused_before_loading(tmp_path, monkeypatch, kind):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --save was checked")

    monkeypatch.setattr("longpatch.loading.load_model", no_load)
    target = tmp_path / "target"
    if kind == "to an empty directory":
        target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    save = link / "sub" if kind == "through a dangling one" else link
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--save", save)
    assert_one_line_error(r, "--save", str(link), "symbolic link")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["link"] + (["target"] if target.exists() else []))
    assert not target.exists() or not any(target.iterdir())


# ---- 9. RULER tasks named without their data ------------------------------------------------------------

def test_ruler_qa_with_a_missing_path_is_an_error(tmp_path):
    out = tmp_path / "out"
    r = invoke(*RULER, "--tasks", "vt,qa_1", "--qa", tmp_path / "nowhere", "--out", out)
    assert_one_line_error(r, "--qa", "does not exist")
    assert not out.exists()


def test_ruler_tasks_named_without_their_data_are_an_error(tmp_path):
    only_squad = tmp_path / "qa"
    only_squad.mkdir()
    (only_squad / "squad.json").write_text((RULER_FIXTURES / "squad.json").read_text())
    out = tmp_path / "out"
    for argv, needles in ((["--tasks", "vt,qa_2", "--qa", only_squad], ["qa_2 cannot run", "no hotpotqa.json"]),
                          (["--tasks", "vt,niah_single_2"], ["niah_single_2 cannot run", "no --essays"]),
                          (["--tasks", "vt,qa"], ["qa_1, qa_2 cannot run", "no --qa"])):
        assert_one_line_error(invoke(*RULER, *argv, "--out", out), "--tasks:", *needles)
        assert not out.exists()


def test_ruler_all_skips_what_has_no_data_and_says_why():
    spec = SimpleNamespace(tasks="all", essays=None, qa=None)
    sources = ruler_run.load_sources(spec)
    assert "vt" in sources.tasks and "niah_single_1" in sources.tasks
    assert sources.skipped["niah_single_2"].startswith("no --essays")
    assert sources.skipped["qa_2"] == "no --qa (hotpotqa)"


# ---- 10. the demo trainer's checkpoint; calibrate interrupted ------------------------------------------

def test_demo_trainer_checkpoint_round_trips_with_the_safe_loader(tmp_path):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()  # the optimizer's state holds tensors now
    args = argparse.Namespace(rope_theta=1e6, rope_scaling="none", ckpt=tmp_path, seed=0)
    build = SimpleNamespace(ckpt=tmp_path, model=model, opt=opt, args=args,
                            state={"step": 3, "curve": [{"step": 1, "loss": 2.5}], "evals": [], "seconds": 1.5,
                                   "tokens": 9})
    train.save_checkpoint(build)
    saved = train.load_checkpoint(tmp_path / "state.pt")
    assert saved["state"] == build.state and saved["args"]["ckpt"] == str(tmp_path)
    assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(saved["opt"])  # what a resumed build does
    assert train.load_checkpoint(tmp_path / "missing.pt") is None


def test_demo_trainer_refuses_a_checkpoint_that_names_code(tmp_path):
    torch.save({"model": {}, "state": NotWeights()}, tmp_path / "state.pt")
    with pytest.raises(SystemExit, match="safe loader refuses it.*NotWeights"):
        train.load_checkpoint(tmp_path / "state.pt")
    assert "weights_only=False" not in Path(train.__file__).read_text()


SEQ = 256
CALIBRATE = ["calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--seq-len", str(SEQ), "--method", "moba",
             "--set", "chunk_size=16", "--set", "selection=hybrid", "--set", "estimate_queries=8",
             "--set", "score_stride=4", "--set", "mass=null", "--grid", "topk=3,4", "--no-progress"]


@pytest.fixture
def calibration_text(tmp_path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "key", "value", "def", "return", "x", "y"]
    docs = [" ".join(rng.choice(words) for _ in range(80))[:300] for _ in range(2)]
    d = tmp_path / "text"
    d.mkdir()
    (d / "narrativeqa.jsonl").write_text("".join(json.dumps(record("narrativeqa", f"d{i}", t)) + "\n"
                                                 for i, t in enumerate(docs)))
    return str(d)


def test_calibrate_resumes_only_a_run_loaded_the_same_way(calibration_text, tmp_path, one_thread):
    out = tmp_path / "cal"
    args = [*CALIBRATE, "--data", calibration_text, "--out", out]
    records = out / "records.jsonl"
    assert invoke(*args).exit_code == 0
    assert len(records.read_text().splitlines()) == 2  # two documents, float32
    r = invoke(*args, "--set", "dtype=bfloat16")
    assert r.exit_code == 0, r.output
    assert len(records.read_text().splitlines()) == 4  # recomputed in bfloat16, not the float32 errors again
    r = invoke(*args, "--set", "attn_implementation=eager")
    assert r.exit_code == 0, r.output
    assert len(records.read_text().splitlines()) == 6
    assert invoke(*args).exit_code == 0
    assert len(records.read_text().splitlines()) == 6  # the float32 run again: resumed


def test_eval_keys_hold_a_loaded_models_own_dtype():
    def prep(model, load):
        p = Prepared(model, None, "m", load, [(None, PatchConfig())])
        return p.load, p.model

    f32, bf16 = tiny_model("llama"), tiny_model("llama", dtype=torch.bfloat16)
    given = [loading_identity(*prep(m, LoadSpec())) for m in (f32, bf16)]
    assert given[0] != given[1] and given[1]["loaded_dtype"] == "bfloat16"
    # a model loaded by name: its options say it all, and a CPU run's ids stay what they were
    assert loading_identity(*prep(f32, LoadSpec(model="tiny:llama"))) == {"dtype": "auto", "attn_implementation": None}


def test_an_interrupted_calibrate_says_where_its_work_is(calibration_text, tmp_path, monkeypatch, caplog, one_thread):
    from longpatch.eval.ppl import scoring

    real, calls = scoring.final_hidden_states, []

    def interrupted_on_the_second_document(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(scoring, "final_hidden_states", interrupted_on_the_second_document)
    out = tmp_path / "cal"
    monkeypatch.setattr(sys, "argv", ["longpatch", *[str(a) for a in CALIBRATE], "--data", calibration_text,
                                      "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130
    assert f"finished work is saved in {out}" in caplog.text
    assert len((out / "records.jsonl").read_text().splitlines()) == 1  # the first document's tallies
