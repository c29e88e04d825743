"""Bad input gives one line and exit 2 with nothing half-written; empty evals
fail; strict YAML; `--save` writes a loadable model; attention stats per path and phase; cosmetics."""
import json
import os
import stat

import pytest
import torch
from typer.testing import CliRunner

import longpatch
from longpatch import cli
from longpatch.errors import LongpatchError
from longpatch.testing.tiny import tiny_model

runner = CliRunner()


def invoke(*argv):
    return runner.invoke(cli.app, list(argv))


def assert_one_line_error(r, *needles):
    """exit 2, one line on stderr naming what is wrong, no traceback, nothing on stdout about it."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    err = r.stderr
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def record(doc_id, context, subset="lcc"):
    return {"input": "q", "context": context, "answers": ["a"], "length": len(context), "dataset": subset,
            "language": "en", "all_classes": None, "_id": doc_id}


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


EVAL = ("eval", "ppl", "--model", "tiny:llama", "--tokenizer", "bytes", "--no-progress", "--warmup", "0",
        "--subsets", "lcc")


# ---- one line, exit 2, nothing half-written ------------------------------------------------

def test_flash_attention_2_without_flash_attn_is_refused_when_the_config_is_built(monkeypatch):
    monkeypatch.setattr("transformers.utils.is_flash_attn_2_available", lambda: False)
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--set", "attn_implementation=flash_attention_2")
    assert_one_line_error(r, "attn_implementation", "flash_attention_2", "sdpa")


def test_wrong_family_is_one_line_from_the_cli_and_an_error_from_patch_model():
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--set", "family=chatglm2")
    assert_one_line_error(r, "family", "chatglm2", "hf")
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--set", "family=nope"), "family: got 'nope'")
    with pytest.raises(LongpatchError, match="family"):
        longpatch.patch_model(tiny_model("llama"), {"method": "exact", "family": "chatglm2"})


def test_non_utf8_config(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"method: exact\n# caf\xe9\n")
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--config", str(bad)), "UTF-8", str(bad))


def test_save_onto_a_file_or_an_uncreatable_path_fails_before_loading(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --save was checked")

    monkeypatch.setattr("longpatch.loading.load_model", no_load)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for target, needle in ((afile, "not a directory"), (afile / "sub", "cannot create")):
        r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--save", str(target))
        assert_one_line_error(r, "--save", str(target), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "keep"


def test_negative_prefill():
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--prefill", "-5"), "--prefill", "-5", "[0, ")


def test_triton_backend_without_cuda_or_interpreter_is_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--set", "backend=triton")
    assert_one_line_error(r, "backend", "triton", "TRITON_INTERPRET")
    data = write_jsonl(tmp_path / "lcc.jsonl", [record("d0", "x" * 100)])
    out = tmp_path / "out"
    r = invoke(*EVAL, "--seq-len", "64", "--data", str(data), "--out", str(out), "--set", "backend=triton")
    assert_one_line_error(r, "backend")
    assert not out.exists()
    with pytest.raises(LongpatchError, match="backend"):
        longpatch.patch_model(tiny_model("llama"), {"method": "exact", "backend": "triton"})


# ---- an eval that evaluated nothing fails ------------------------------------------------

@pytest.mark.parametrize("lines, needle", [
    ([], "0 records"),
    (['{"_id": "x", "context": ', "not json"], "2 malformed"),
    ([record("d0", "short"), record("d1", "also short")], "shorter than --seq-len 64"),
])
def test_eval_with_nothing_to_evaluate_fails_and_leaves_no_out(tmp_path, lines, needle):
    data = write_jsonl(tmp_path / "lcc.jsonl", lines)
    out = tmp_path / "out"
    r = invoke(*EVAL, "--seq-len", "64", "--data", str(data), "--out", str(out))
    assert_one_line_error(r, "nothing to evaluate", needle)
    assert not out.exists()


def test_failed_eval_leaves_no_empty_out(tmp_path):
    out = tmp_path / "out"
    r = invoke(*EVAL, "--seq-len", "64", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out))
    assert_one_line_error(r, "does not exist")
    assert not out.exists()


def test_no_data_and_no_hub_fails_fast_without_network_retries(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))

    def download(*a, local_files_only=False, **k):
        if not local_files_only:
            raise AssertionError("went to the network although the hub is unreachable")
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    r = invoke(*EVAL, "--seq-len", "64", "--out", str(tmp_path / "out"))
    assert_one_line_error(r, "--data", "cannot be reached")


def test_missing_local_model_path_says_no_such_directory(tmp_path):
    missing = tmp_path / "no" / "model"
    assert_one_line_error(invoke("apply", "--model", str(missing)), "no such directory", str(missing))


# ---- strict YAML ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("", "is empty"),
    ("# nothing but a comment\n", "is empty"),
    ("layers: 2\n", "no 'method'"),
    ("method: exact\nlayers: 2\nlayers: 3\n", "duplicate key 'layers'"),
    ("method: hyper\nparams:\n  block_size: 64\n  block_size: 32\n", "duplicate key 'block_size'"),
])
def test_yaml_without_method_empty_or_with_duplicate_keys_is_an_error(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(LongpatchError, match=needle):
        longpatch.load_config(p)
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--config", str(p)), needle)


# ---- --save writes a model plain transformers loads ----------------------------------------

def test_save_writes_weights_tokenizer_free_model_and_patch(tmp_path):
    from transformers import AutoModelForCausalLM

    target = tmp_path / "saved"
    r = invoke("apply", "--model", "tiny:llama", "--method", "hyper", "--layers", "2", "--set", "min_seq_len=16",
               "--set", "params.min_seq_len=16", "--save", str(target))
    assert r.exit_code == 0, r.output
    assert (target / "model.safetensors").is_file() and (target / "longpatch.yaml").is_file()
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]  # no temp dir left behind
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        want = tiny_model("llama")(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(target)
        torch.testing.assert_close(plain(ids).logits, want)  # the weights, without the patch's buffers
        patched = longpatch.from_pretrained(target)
        assert longpatch.patched_layers(patched) == [2, 3] and patched.longpatch.config.method == "hyper"
        assert patched.name_or_path == str(target)  # loaded from the saved weights, not rebuilt
        assert not torch.allclose(patched(ids).logits, want)  # hyper runs at 40 > 16 tokens


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- stats per path and phase; speedups within one run ------------------------------------

def test_stats_separate_method_exact_fallback_and_phases():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 24))
    longpatch.patch_model(model, {"method": "hyper", "layers": 2})  # min_seq_len 4096: exact at 24 tokens
    model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    b = model.longpatch.breakdown()
    assert set(b["patched"]["prefill"]) == {"method_exact"} and b["patched"]["prefill"]["method_exact"]["calls"] == 2
    assert b["patched"]["decode"]["exact"]["calls"] == 2 * 2  # hyper has no decode: the exact fallback
    assert b["unpatched"]["prefill"]["original"]["calls"] == 2 and b["unpatched"]["decode"]["original"]["calls"] == 4
    longpatch.unpatch_model(model)
    longpatch.patch_model(model, {"method": "moba", "layers": "all", "params": {"chunk_size": 4, "topk": 2}})
    model.longpatch.reset_stats()
    with torch.no_grad():
        model(ids)  # 6 chunks > topk 2: really sparse
    assert set(model.longpatch.breakdown()["patched"]["prefill"]) == {"method"}


def test_prefill_table_says_when_the_method_was_exact():
    r = invoke("apply", "--model", "tiny:llama", "--method", "hyper", "--layers", "2", "--prefill", "32")
    assert r.exit_code == 0, r.output
    assert "method (exact at this length)" in r.stdout and "prefill" in r.stdout


def test_reused_out_computes_speedups_within_one_run_only(tmp_path):
    data = write_jsonl(tmp_path / "lcc.jsonl", [record("d0", "abcdefgh" * 20)])
    out = tmp_path / "out"
    assert invoke(*EVAL, "--seq-len", "64", "--data", str(data), "--out", str(out), "--layers", "0").exit_code == 0
    r = invoke(*EVAL, "--seq-len", "64", "--data", str(data), "--out", str(out), "--layer-counts", "0,2")
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    two = next(c for c in results["configs"] if c["layers"] == 2)["all"]
    assert two["attention_speedup"] is None and two["speedup_docs"] == 0  # its baseline timing is another run's
    recs = [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]
    assert len({r["run_id"] for r in recs}) == 2


# ---- cosmetics ----------------------------------------------------------------------------

def test_model_names_print_verbatim_not_as_emoji():
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact")
    assert r.exit_code == 0 and "tiny:llama (float32):" in r.stdout and "\U0001f999" not in r.stdout


def test_help_shows_flags_without_a_value():
    for cmd in (("apply",), ("eval", "ppl")):
        out = invoke(*cmd, "--help").stdout
        assert "--trust-remote-code" in out and "<bool>" not in out and "BOOLEAN" not in out


def test_json_errors_name_the_real_column(tmp_path):
    from longpatch.eval.longbench.data import load_longbench

    path = write_jsonl(tmp_path / "lcc.jsonl", ['{"a": ', '{"context": "ab\tc"}', '{"a": 1,, "b": 2}'])
    msgs = [p.message for p in load_longbench(str(path), "lcc").problems]
    assert all(" at at " not in m for m in msgs), msgs
    assert msgs == ["invalid JSON at column 7: expecting value (the line ends early)",
                    "invalid JSON at column 16: invalid control character",
                    "invalid JSON at column 9: expecting property name enclosed in double quotes"]


def test_load_model_takes_a_name_and_is_documented():
    model, tok = longpatch.load_model("tiny:llama")
    assert tok is None and not hasattr(model, "longpatch")
    assert "Returns" in longpatch.load_model.__doc__
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "configs.md")).read()
    assert "longpatch.load_model(" in docs


def test_apply_layers_share_one_parser_with_ranges_and_no_trailing_comma():
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--layers", "1:2")
    assert r.exit_code == 0 and "patched 2 of 4 layers" in r.stdout
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--layers", "1,"), "--layers", "'1,'", "empty item")
    assert_one_line_error(invoke(*EVAL, "--layer-counts", "1,", "--data", "x"), "--layer-counts", "empty item")


@pytest.mark.parametrize("command", ["needle", "longbench"])
def test_generation_evals_refuse_a_missing_or_mismatched_tokenizer_in_one_line(tmp_path, command):
    # a tiny:* model has no tokenizer and generation must decode; the demo's 8192 ids overflow its 256 rows
    out = tmp_path / "out"
    base = ("eval", command, "--model", "tiny:llama", "--out", str(out), "--no-progress")
    base += ("--data", "demo") if command == "longbench" else ()
    assert_one_line_error(invoke(*base), "tokenizer", "tiny:llama", "--tokenizer")
    assert_one_line_error(invoke(*base, "--tokenizer", str(tmp_path / "nope")), "tokenizer", "no such directory")
    assert_one_line_error(invoke(*base, "--tokenizer", str(longpatch.demo_model_path())),
                          "tokenizer", "8192 ids", "256 embedding rows")
    assert not out.exists()


@pytest.mark.parametrize("option, value, needle", [
    ("--needle-length", "10", "got 10"),
    ("--needle-length", "300000", "the filler has only"),
    ("--needle-template", "nope", "neither a built-in template"),
    ("--needle-trials", "0", "got 0"),
    ("--needle-length", str(10 ** 12), "[64, "),  # issue 42: bounded like every length
    ("--needle-trials", str(10 ** 9), "[1, 10000]"),
    ("--headline-length", "-1", "got -1"),
])
def test_demo_refuses_a_bad_needle_option_before_any_work(tmp_path, option, value, needle):
    # checked before the perplexity part (minutes), and named by the demo's own flag
    out = tmp_path / "demo"
    r = invoke("demo", option, value, "--out", str(out), "--no-progress")
    assert_one_line_error(r, option, needle)
    assert not out.exists()


def test_needle_on_a_loaded_model_without_a_tokenizer_fails_at_once(tmp_path):
    # its class name is not a hub id to try (that took ~30 s of retries offline before the error)
    from longpatch.eval.needle.run import needle

    with pytest.raises(LongpatchError, match="the loaded model comes without a tokenizer"):
        needle(tiny_model("llama"), "0", lengths="256", depths="0.5", trials=1, out=str(tmp_path / "o"), progress=False)
    assert not (tmp_path / "o").exists()


# ---- options checked before any work -------------------------------------------------------------------

BENCH = {"attention": {"--methods": "exact", "--seq-lens": "64", "--mode": "causal", "--repeats": "1",
                       "--no-memory": None},
         "decode": {"--methods": "moba", "--cache-lens": "64", "--repeats": "1"}}


def bench_argv(which, **changes):
    """`bench <which>` with tiny shapes; changes: {'--flag': value} replacing or adding options."""
    opts = {**BENCH[which], **changes}
    return ("bench", which, *[x for k, v in opts.items() for x in ((k,) if v is None else (k, v))])


@pytest.fixture
def no_work(monkeypatch):
    """Every command fails loudly if it starts its real work (timing, loading the demo model)."""
    def work(*a, **k):
        raise AssertionError("the work started before the options were checked")

    monkeypatch.setattr("longpatch.bench.attention.time_calls", work)
    monkeypatch.setattr("longpatch.bench.decode.time_calls", work)
    monkeypatch.setattr("longpatch.eval.demo.demo_model_path", work)


def out_commands(tmp_path):
    """One cheap invocation of every command that writes --out (each fails after its --out check)."""
    return {"eval ppl": (*EVAL, "--data", str(tmp_path / "missing.jsonl")),
            "eval needle": ("eval", "needle", "--model", "tiny:llama", "--no-progress"),
            "eval longbench": ("eval", "longbench", "--model", "tiny:llama", "--data", "demo", "--no-progress"),
            "demo": ("demo", "--no-progress"),
            "bench attention": bench_argv("attention"),
            "bench decode": bench_argv("decode")}


# an --out that cannot be a directory fails before any work
@pytest.mark.parametrize("command", ["eval ppl", "eval needle", "eval longbench", "demo", "bench attention",
                                     "bench decode"])
def test_out_that_cannot_be_a_directory_fails_before_any_work(tmp_path, no_work, command):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    targets = [(afile, "not a directory"), (afile / "sub", "cannot create")]
    if os.path.isdir("/proc/self"):
        targets.append(("/proc/longpatch-out", "cannot create"))  # a directory nothing can be created in
    for target, needle in targets:
        r = invoke(*out_commands(tmp_path)[command], "--out", str(target))
        assert_one_line_error(r, "--out", str(target), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "keep"


# bench shapes, counts and --set keys are checked up front and named by their flag
@pytest.mark.parametrize("which, flag, value", [
    ("attention", "--seq-lens", "0"), ("attention", "--seq-lens", "-5"), ("attention", "--seq-lens", ""),
    ("attention", "--head-dim", "0"), ("attention", "--batch", "0"), ("attention", "--repeats", "0"),
    ("attention", "--heads", "0"), ("attention", "--kv-heads", "0"),
    ("decode", "--cache-lens", "0"), ("decode", "--cache-lens", "-5"), ("decode", "--cache-lens", ""),
    ("decode", "--head-dim", "0"), ("decode", "--batch", "0"), ("decode", "--repeats", "0"),
    ("decode", "--heads", "0"), ("decode", "--kv-heads", "3"),
])
def test_bench_bad_sizes_name_their_flag(tmp_path, no_work, which, flag, value):
    out = tmp_path / "b"
    r = invoke(*bench_argv(which, **{flag: value, "--out": str(out)}))
    assert_one_line_error(r, f"{flag}: got {value!r}" if "lens" in flag else f"{flag}: got {value}", "allowed")
    assert not out.exists()


@pytest.mark.parametrize("which", ["attention", "decode"])
def test_bench_set_names_a_param_of_a_benchmarked_method(tmp_path, no_work, which):
    # --set has one grammar in every command: KEY=VALUE, set for each benchmarked method that has KEY
    out = tmp_path / "b"
    other = "block_size" if which == "decode" else "topk"  # a param of a method this bench does not run
    for key in ("bogus=1", f"{other}=2"):
        r = invoke(*bench_argv(which, **{"--set": key, "--out": str(out)}))
        assert_one_line_error(r, f"--set {key.partition('=')[0]}: no benchmarked method", "allowed")
    r = invoke(*bench_argv(which, **{"--set": "moba.topk=2", "--out": str(out)}))  # the old spelling
    assert_one_line_error(r, "--set 'moba.topk=2'", "KEY=VALUE in every command", "--set topk=2")
    assert not out.exists()


# a malformed YAML value in --set
def test_set_with_malformed_yaml_is_one_line(tmp_path, no_work):
    r = invoke("apply", "--model", "tiny:llama", "--method", "hyper", "--set", "block_size=[1")
    assert_one_line_error(r, "--set", "block_size=[1", "YAML")
    r = invoke(*bench_argv("attention", **{"--methods": "exact,hyper", "--set": "hyper.block_size=[",
                                           "--out": str(tmp_path / "b")}))
    assert_one_line_error(r, "--set", "hyper.block_size=[", "YAML")


# digits that str.isdigit accepts but int() does not
@pytest.mark.parametrize("spec", ["²", "1:²", "٣"])
def test_layers_with_non_ascii_digits_is_one_line(spec):
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--layers", spec), "--layers", repr(spec))
    assert_one_line_error(invoke(*EVAL, "--layers", spec, "--data", "x"), "--layers")


# non-finite needle depths
@pytest.mark.parametrize("depths", ["nan", "0.5,inf", "0:inf:0.1", "0:1:nan"])
def test_needle_non_finite_depths_are_one_line(tmp_path, depths):
    out = tmp_path / "out"
    r = invoke("eval", "needle", "--model", "tiny:llama", "--depths", depths, "--out", str(out), "--no-progress")
    assert_one_line_error(r, "--depths", repr(depths))
    assert not out.exists()


# performer's feature count is bounded relative to head_dim (1e6 hung for minutes in QRs)
@pytest.mark.parametrize("m", [1025, 1000000])
def test_performer_num_features_is_bounded(tmp_path, m):
    from longpatch.methods.performer import MAX_FEATURES_PER_DIM, performer_attention

    assert MAX_FEATURES_PER_DIM * 16 == 1024  # tiny:llama's head_dim is 16
    r = invoke("apply", "--model", "tiny:llama", "--method", "performer", "--set", f"num_features={m}")
    assert_one_line_error(r, "num_features", str(m), "1024", "head_dim")
    with pytest.raises(LongpatchError, match="num_features"):
        longpatch.patch_model(tiny_model("llama"), {"method": "performer", "params": {"num_features": m}})
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="num_features"):
        performer_attention(q, q, q, num_features=m)
    r = invoke(*bench_argv("attention", **{"--methods": "performer", "--head-dim": "16",
                                           "--set": f"performer.num_features={m}", "--out": str(tmp_path / "b")}))
    assert_one_line_error(r, "num_features", str(m))


# a saved patch directory without its weights
def test_saved_dir_without_its_weights_is_an_error_naming_the_file(tmp_path):
    target = tmp_path / "saved"
    r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--layers", "1", "--save", str(target))
    assert r.exit_code == 0, r.output
    (target / "model.safetensors").unlink()
    assert_one_line_error(invoke("apply", "--model", str(target)), str(target / "model.safetensors"))
    with pytest.raises(LongpatchError, match="model.safetensors"):
        longpatch.from_pretrained(target)


# a directory another command wrote is refused, in one line, before anything in it changes
def test_out_written_by_another_command_is_refused(tmp_path, no_work):
    data = write_jsonl(tmp_path / "lcc.jsonl", [record("d0", "abcdefgh" * 20)])
    out = tmp_path / "out"
    ppl = (*EVAL, "--seq-len", "64", "--data", str(data), "--layers", "0", "--out", str(out))
    assert invoke(*ppl).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for command, argv in out_commands(tmp_path).items():
        if command != "eval ppl":
            assert_one_line_error(invoke(*argv, "--out", str(out)), "--out", str(out), "`longpatch eval ppl`",
                                  f"`longpatch {command}`")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert invoke(*ppl).exit_code == 0  # its own command resumes there


def test_eval_and_other_benches_refuse_a_bench_directory(tmp_path):
    out = tmp_path / "bench"
    assert invoke(*bench_argv("attention"), "--out", str(out)).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    data = write_jsonl(tmp_path / "lcc.jsonl", [record("d0", "abcdefgh" * 20)])
    r = invoke(*EVAL, "--seq-len", "64", "--data", str(data), "--out", str(out))
    assert_one_line_error(r, "--out", "`longpatch bench attention`", "`longpatch eval ppl`")
    assert_one_line_error(invoke(*bench_argv("decode"), "--out", str(out)), "`longpatch bench attention`")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert invoke(*bench_argv("attention"), "--out", str(out)).exit_code == 0  # its own command may rewrite it


# ---- a new user's surprises --------------------------------------------------------------

_GEN_ARGS = {"needle": ("--lengths", "256", "--depths", "0.5", "--trials", "1"),
             "longbench": ("--data", "demo", "--max-samples", "1", "--max-length", "256", "--max-new-tokens", "2"),
             "ppl": ("--data", "demo", "--seq-len", "64", "--max-docs", "1", "--warmup", "0")}


@pytest.mark.parametrize("command", ["needle", "longbench", "ppl"])
def test_every_eval_takes_the_bytes_tokenizer_and_fails_fast_on_an_uncached_hub_id(tmp_path, monkeypatch, command):
    # one tokenizer resolution everywhere: 'bytes' is not a hub id, and a hub id that is neither cached
    # nor reachable fails at once, as a model does (needle and longbench spent ~50 s in the hub's retries)
    def no_hub(*a, **k):
        raise AssertionError("AutoTokenizer.from_pretrained was asked")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_hub)
    out = tmp_path / "out"
    base = ("eval", command, "--model", "tiny:llama", "--layers", "0", "--out", str(out), "--no-progress",
            *_GEN_ARGS[command])
    assert_one_line_error(invoke(*base, "--tokenizer", "nobody/no-such-tokenizer"), "tokenizer",
                          "nobody/no-such-tokenizer", "not in the local cache")
    assert not out.exists()
    r = invoke(*base, "--tokenizer", "bytes")
    assert r.exit_code == 0, (r.output, r.exception)
    assert (out / "results.json").is_file()


def test_list_shows_the_offline_models(monkeypatch):
    # the tiny:* models (and demo) are what --model takes without a download; list names them
    from longpatch.testing.tiny import BUILDERS

    monkeypatch.setenv("COLUMNS", "200")
    r = invoke("list")
    assert r.exit_code == 0, r.output
    for name in ["demo", *(f"tiny:{f}" for f in BUILDERS)]:
        assert name in r.stdout, name


def test_eval_needle_defaults_to_the_demos_template():
    # `eval needle` and `longpatch demo` use the same template (passkey) unless told otherwise
    import inspect

    from longpatch.eval.demo import run_demo
    from longpatch.eval.needle.run import NeedleSpec

    demo_default = inspect.signature(run_demo).parameters["needle_template"].default
    assert demo_default == "passkey" and NeedleSpec().template == demo_default
    for fn, name in ((cli.eval_needle, "template"), (cli.demo, "needle_template")):
        assert inspect.signature(fn).parameters[name].default.default == demo_default


def test_csvs_hold_json_not_python_reprs_and_name_the_exact_rows(tmp_path):
    # a CSV cell holding a dict is JSON; the 0-layer rows say method 'exact', not ''
    import csv

    base = ("--model", "tiny:llama", "--tokenizer", "bytes", "--method", "moba", "--layer-counts", "0,1",
            "--no-progress")
    for command in ("needle", "longbench", "ppl"):
        out = tmp_path / command
        r = invoke("eval", command, *base, "--out", str(out), *_GEN_ARGS[command])
        assert r.exit_code == 0, (command, r.output, r.exception)
        rows = list(csv.DictReader((out / "results.csv").open()))
        assert {row["method"] for row in rows if row["layers"] == "0"} == {"exact"}, command
        assert {row["method"] for row in rows if row["layers"] == "1"} == {"moba"}, command
        if command == "needle":
            for row in rows:
                assert isinstance(json.loads(row["attention_seconds_by_path"]), dict)


def test_a_method_that_is_exact_for_the_whole_run_is_said_once(tmp_path, caplog):
    # MoBA's defaults (chunk 2048, top-4) cover every chunk of the demo's lengths; only the
    # method_exact label in the stats showed it
    base = ("--model", "tiny:llama", "--tokenizer", "bytes", "--method", "moba", "--no-progress")
    runs = iter(range(100))

    def said(command, *argv):
        caplog.clear()
        with caplog.at_level("WARNING", logger="longpatch"):
            r = invoke("eval", command, *base, *_GEN_ARGS[command], "--out", str(tmp_path / str(next(runs))), *argv)
        assert r.exit_code == 0, (r.output, r.exception)
        return [m for m in caplog.messages if "exact attention at every length" in m]

    lines = said("ppl", "--layer-counts", "0,1,2")  # one line for the run, not one per layer count
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("longpatch: moba (chunk_size=2048, topk=4") and "up to 64 tokens" in lines[0]
    assert len(said("needle", "--layer-counts", "0,1,2")) == 1  # its prefills and decode steps are all exact
    # 8-token chunks: 8 chunks at 64 tokens, 32 at 256 and more: top-4 approximates
    assert said("ppl", "--layer-counts", "0,1", "--set", "chunk_size=8") == []
    assert said("needle", "--layer-counts", "0,1", "--set", "chunk_size=8") == []


# ---- issue 42: a new user's third round ------------------------------------------------------------

def listing(root):
    """Every path under root with its bytes: what 'nothing written' compares."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# 1. an --out that holds the user's own files (no marker of ours) is refused before any work, '' and blank too
@pytest.mark.parametrize("command", ["eval ppl", "eval needle", "eval longbench", "demo", "bench attention",
                                     "bench decode"])
def test_out_with_the_users_files_is_refused_and_left_alone(tmp_path, no_work, command):
    mine = tmp_path / "d"
    mine.mkdir()
    (mine / "results.json").write_text('{"my": "important"}')
    (mine / "records.jsonl").write_text("notes\n")
    before = listing(tmp_path)
    argv = out_commands(tmp_path)[command]
    assert_one_line_error(invoke(*argv, "--out", str(mine)), "--out", str(mine), "non-empty", "did not write")
    for blank in ("", "   "):
        assert_one_line_error(invoke(*argv, "--out", blank), "--out", "empty")
    assert listing(tmp_path) == before


def test_out_that_is_an_empty_directory_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert invoke(*bench_argv("attention"), "--out", str(out)).exit_code == 0
    assert (out / ".longpatch-command").read_text().strip() == "bench attention"


def test_save_blank_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for blank in ("", "   "):
        r = invoke("apply", "--model", "tiny:llama", "--method", "exact", "--save", blank)
        assert_one_line_error(r, "--save", "empty")
    assert list(tmp_path.iterdir()) == []


# 4. a 5000-character path or name is one line, not an OSError, for every path option
LONG = "x" * 5000


@pytest.mark.parametrize("argv", [
    ("apply", "--model", LONG), ("apply", "--model", "tiny:llama", "--config", LONG),
    ("apply", "--model", "tiny:llama", "--method", "exact", "--save", LONG),
    ("eval", "ppl", "--model", "tiny:llama", "--out", LONG), ("eval", "ppl", "--model", "tiny:llama", "--data", LONG),
    ("eval", "ppl", "--model", "tiny:llama", "--tokenizer", LONG),
    ("eval", "needle", "--model", "tiny:llama", "--filler", LONG),
    ("eval", "needle", "--model", "tiny:llama", "--template", LONG),
    ("eval", "ruler", "--model", "tiny:llama", "--essays", LONG),
    ("eval", "ruler", "--model", "tiny:llama", "--qa", LONG),
    ("demo", "--needle-template", LONG),
])
def test_an_over_long_path_is_one_line(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    flag = next(a for a, b in zip(argv, argv[1:]) if b == LONG)
    assert_one_line_error(invoke(*argv), flag, "5000 characters", "at most 4096")
    assert list(tmp_path.iterdir()) == []


# 4. ranges are counted before they are expanded; sizes past any context are one line
@pytest.mark.parametrize("argv, flag", [
    (bench_argv("attention", **{"--seq-lens": "1:100000000000"}), "--seq-lens"),
    (bench_argv("attention", **{"--seq-lens": "99999999999999999999"}), "--seq-lens"),
    (bench_argv("decode", **{"--cache-lens": "1:100000000000"}), "--cache-lens"),
    ((*EVAL, "--layer-counts", "0:100000000", "--data", "x"), "--layer-counts"),
    (("eval", "needle", "--model", "tiny:llama", "--depths", "0:1:0.0000001"), "--depths"),
    (("eval", "needle", "--model", "tiny:llama", "--lengths", "64:99999999999"), "--lengths"),
    (("apply", "--model", "tiny:llama", "--prefill", "99999999999999999999"), "--prefill"),
    # other counts of the same kind: a typo, not days of work or an overflow inside torch
    (bench_argv("attention", **{"--heads": str(10 ** 20)}), "--heads"),
    (bench_argv("decode", **{"--repeats": str(10 ** 9)}), "--repeats"),
    (bench_argv("attention", **{"--threads": str(10 ** 20)}), "--threads"),
    (("eval", "needle", "--model", "tiny:llama", "--trials", str(10 ** 9)), "--trials"),
    (("eval", "ruler", "--model", "tiny:llama", "--samples", str(10 ** 9)), "--samples"),
])
def test_huge_ranges_and_sizes_are_one_line(tmp_path, no_work, argv, flag):
    out = tmp_path / "o"
    assert_one_line_error(invoke(*argv, *(("--out", str(out)) if argv[0] != "apply" else ())), flag)
    assert not out.exists()


# 6. nonsense that used to be accepted
def test_bench_max_exact_len_must_be_positive(tmp_path, no_work):
    out = tmp_path / "b"
    for bad in ("-1", "0"):
        assert_one_line_error(invoke(*bench_argv("attention", **{"--max-exact-len": bad, "--out": str(out)})),
                              "--max-exact-len", bad)
    assert not out.exists()


def test_a_400_digit_param_is_one_line():
    r = invoke("apply", "--model", "tiny:llama", "--method", "hyper", "--set", "block_size=" + "9" * 400)
    assert_one_line_error(r, "block_size", "400 digits", "2**62")


def test_bytes_tokenizer_for_a_model_with_its_own_is_refused(tmp_path):
    out = tmp_path / "o"
    r = invoke("eval", "ppl", "--model", "demo", "--data", "demo", "--seq-len", "64", "--max-docs", "1",
               "--tokenizer", "bytes", "--out", str(out), "--no-progress")
    assert_one_line_error(r, "--tokenizer bytes", "its own tokenizer")
    assert not out.exists()


# 5. one answer to one input
def test_repeated_layers_are_an_error_on_the_cli_as_in_a_config():
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--method", "exact", "--layers", "0,0"),
                          "--layers", "more than once")
    assert_one_line_error(invoke("apply", "--model", "tiny:llama", "--method", "exact", "--layers", "0:1,1:1"),
                          "--layers", "more than once")


def test_a_param_without_effect_under_the_selection_is_an_error():
    r = invoke("apply", "--model", "tiny:llama", "--method", "moba", "--set", "mass=0.5")
    assert_one_line_error(r, "params.mass", "no effect with selection 'gate'")
    r = invoke("apply", "--model", "tiny:llama", "--method", "moba", "--set", "mass=0.5", "--set", "selection=estimate",
               "--set", "chunk_size=16")
    assert r.exit_code == 0, r.output


# 7. messages name the flags a CLI user typed
@pytest.mark.parametrize("argv, flag", [
    ((*EVAL, "--max-docs", "0", "--data", "x"), "--max-docs: got 0"),
    ((*EVAL, "--seq-len", "1", "--data", "x"), "--seq-len: got 1"),
    ((*EVAL, "--loss-chunk", "0", "--data", "x"), "--loss-chunk: got 0"),
    ((*EVAL, "--device-map", "cuda", "--data", "x"), "--device-map: got 'cuda'"),
    (("eval", "needle", "--model", "tiny:llama", "--batch-size", "0"), "--batch-size: got 0"),
    (("eval", "longbench", "--model", "tiny:llama", "--data", "demo", "--max-length", "1"), "--max-length: got 1"),
    (("eval", "needle", "--model", "tiny:llama", "--num-processes", "0"), "--num-processes: got 0"),
])
def test_errors_name_the_flag(tmp_path, argv, flag):
    out = tmp_path / "o"
    assert_one_line_error(invoke(*argv, "--out", str(out), "--no-progress"), flag)
    assert not out.exists()


@pytest.mark.parametrize("argv, flag", [
    (("eval", "needle", "--model", "tiny:llama", "--tokenizer", "bytes", "--filler"), "--filler"),
    (("eval", "ruler", "--model", "tiny:llama", "--tokenizer", "bytes", "--tasks", "niah_single_2", "--essays"),
     "--essays"),
    (("eval", "ruler", "--model", "tiny:llama", "--tokenizer", "bytes", "--tasks", "qa_1", "--qa"), "--qa"),
])
def test_a_missing_input_file_says_it_does_not_exist(tmp_path, argv, flag):
    missing = str(tmp_path / "nope.txt")
    r = invoke(*argv, missing, "--lengths", "256", "--out", str(tmp_path / "o"), "--no-progress")
    assert_one_line_error(r, flag, "does not exist")


def test_bench_set_lists_each_benchmarked_method_once(tmp_path, no_work):
    r = invoke(*bench_argv("attention", **{"--methods": "exact,hyper", "--set": "bogus=1",
                                           "--out": str(tmp_path / "b")}))
    assert_one_line_error(r, "(exact, hyper)")


# 8. docs and output say the same thing
def test_demo_model_eval_output_names_one_document_the_dtype_and_no_loading_bars(tmp_path):
    out = tmp_path / "o"
    r = invoke("eval", "ppl", "--model", "demo", "--data", "demo", "--seq-len", "64", "--max-docs", "1",
               "--warmup", "0", "--layer-counts", "0", "--no-progress", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "Loading weights" not in r.stderr and "Loading weights" not in r.stdout
    title = " ".join(r.stdout.split())
    assert "(float32)" in title and "1 document (" in title and "1 documents" not in title
    results = json.loads((out / "results.json").read_text())
    assert results["dtype"] == "float32"
    assert [c["label"] for c in results["configs"]] == ["exact"]  # the baseline's one name (was baseline:0)


def test_apply_names_the_patch_keys_apart_from_the_method_params_and_the_dtype():
    r = invoke("apply", "--model", "tiny:llama", "--method", "hyper")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "(patch keys: min_seq_len=0, backend=auto)" in text and "min_seq_len=4096" in text
    assert "tiny:llama (float32)" in text


def test_the_demo_docs_name_every_config_the_demo_runs():
    from pathlib import Path

    from longpatch.eval.demo import demo_configs
    from longpatch.eval.headline import HEADLINE_CONFIGS

    text = (Path(__file__).parents[1] / "docs" / "demo.md").read_text()
    start = text.index("## The main job: `longpatch demo`")
    section = text[start:text.index("\n## ", start + 1)]
    for alias in (*HEADLINE_CONFIGS, *demo_configs()):
        assert f"`{alias}`" in section, alias
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert all(f"`{alias}`" in readme for alias in HEADLINE_CONFIGS)  # the README's results table


def test_bench_help_explains_its_columns():
    text = " ".join(invoke("bench", "attention", "--help").stdout.split())
    for column in ("pairs:", "ideal:", "ratio:", "err random / err structured:", "mem MiB:"):
        assert column in text, column
    text = " ".join(invoke("bench", "decode", "--help").stdout.split())
    assert "init_state ms" in text and "err random / err structured:" in text
