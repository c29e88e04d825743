"""Patched models with transformers' own features: remote code only with consent, bundled aliases not
shadowed by folders, flex_attention models refused, one rule per sliding-window layer, save_pretrained
leaving the generation config alone, chunked prefills and torch.compile said at run time."""
import json
import logging

import pytest
import torch
from typer.testing import CliRunner

import longpatch
from longpatch import cli
from longpatch.errors import LongpatchError, UnsupportedModelError
from longpatch.methods import common
from longpatch.specs import resolve
from longpatch.testing.tiny import tiny_model

runner = CliRunner()

REMOTE_CODE = """import os, pathlib
pathlib.Path(os.environ["LONGPATCH_TEST_MARKER"]).write_text("ran")
from transformers import LlamaConfig


class XConfig(LlamaConfig):
    pass
"""


def _remote_code_dir(tmp_path, monkeypatch, saved_yaml: bool):
    """A tiny Llama's weights whose config.json points AutoConfig at a local file that writes a marker."""
    d = tmp_path / "downloaded"
    tiny_model("llama").save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "conf_x.XConfig"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "conf_x.py").write_text(REMOTE_CODE)
    if saved_yaml:
        (d / "longpatch.yaml").write_text("model: somewhere/else\ntrust_remote_code: true\nmethod: exact\n")
    marker = tmp_path / "marker"
    monkeypatch.setenv("LONGPATCH_TEST_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    return d, marker


def test_a_saved_directory_asking_for_remote_code_needs_the_users_consent(tmp_path, monkeypatch):
    d, marker = _remote_code_dir(tmp_path, monkeypatch, saved_yaml=True)
    r = runner.invoke(cli.app, ["apply", "--model", str(d)])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "--trust-remote-code" in r.stderr, r.stderr
    assert not marker.exists()
    with pytest.raises(LongpatchError, match="--trust-remote-code"):
        longpatch.load_model(str(d))
    assert not marker.exists()
    # consent given: the model's code runs (what it does after is the model's business)
    runner.invoke(cli.app, ["apply", "--model", str(d), "--trust-remote-code"])
    assert marker.exists()


def test_a_config_file_asking_for_remote_code_needs_the_users_consent(tmp_path, monkeypatch):
    d, marker = _remote_code_dir(tmp_path, monkeypatch, saved_yaml=False)
    cfg = tmp_path / "copied.yaml"
    cfg.write_text("trust_remote_code: true\nmethod: exact\n")
    r = runner.invoke(cli.app, ["apply", "--model", str(d), "--config", str(cfg)])
    assert r.exit_code == 2 and "--trust-remote-code" in r.stderr and "copied.yaml" in r.stderr, r.output
    assert not marker.exists()
    assert resolve(str(d), str(cfg), trust_remote_code=True).load.trust_remote_code is True
    assert resolve(str(d), str(cfg), sets=["trust_remote_code=true"]).load.trust_remote_code is True
    assert resolve(str(d)).load.trust_remote_code is False


def test_a_bundled_alias_keeps_its_remote_code_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="longpatch"):
        spec = resolve("chatglm2-6b-32k")
    assert spec.load.trust_remote_code is True
    assert "chatglm2-6b-32k" in caplog.text and "own code" in caplog.text


def test_a_folder_named_like_a_bundled_alias_does_not_shadow_it(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # e.g. what `longpatch demo --out demo` writes
    with caplog.at_level(logging.WARNING, logger="longpatch"):
        spec = resolve("demo")
    assert spec.load.model == "demo" and spec.patch.method == longpatch.config.read_config("demo").patch.method
    assert "./demo" in caplog.text  # says which was taken, and how to name the folder
    with pytest.raises(LongpatchError, match="no longpatch.yaml"):  # the folder, written as a path
        longpatch.config.read_config("./demo")
    r = runner.invoke(cli.app, ["apply", "--model", "demo"])
    assert r.exit_code == 0, r.output


def test_flex_attention_models_are_refused_at_patch_time():
    model = tiny_model("llama", attn_implementation="flex_attention")
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'") as e:
        longpatch.patch_model(model, {"method": "moba", "params": {"chunk_size": 64, "topk": 2}})
    assert "\n" not in str(e.value)
    assert getattr(model, "longpatch", None) is None and model.config._attn_implementation == "flex_attention"


def _sliding(family: str):
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, sliding_window=128)
    torch.manual_seed(0)
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        return MistralForCausalLM(MistralConfig(**small)), {0, 1}
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        return Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, max_window_layers=1)), {1}
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**small, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg), {0}


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3"])
def test_a_sliding_window_layer_follows_one_rule_for_prefill_and_decode(family):
    model, sliding = _sliding(family)
    model = model.eval()
    ids = torch.randint(3, 256, (1, 300))  # no pad token: generate() would read it as padding
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
               output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **gen)
        longpatch.patch_model(model, {"method": "linear", "layers": "all"})
        out = model.generate(ids, **gen)
    for r in model.longpatch.routes:
        paths = {phase: {path for (ph, path) in r.calls if ph == phase} for phase in ("prefill", "decode")}
        if r.layer_idx in sliding:
            assert paths == {"prefill": {"original"}, "decode": {"original"}}, (r.layer_idx, paths)
        else:
            assert "original" not in paths["prefill"] | paths["decode"], (r.layer_idx, paths)
    if len(sliding) == 2:  # every layer slides: the patched model is the model itself
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b)


def test_save_pretrained_of_a_patched_model_leaves_the_generation_config_as_it_was(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "plain")
    longpatch.patch_model(model, {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": "all"})
    model.save_pretrained(tmp_path / "patched")
    plain = json.loads((tmp_path / "plain" / "generation_config.json").read_text())
    patched = json.loads((tmp_path / "patched" / "generation_config.json").read_text())
    assert patched == plain and not patched.get("disable_compile")


def test_torch_compile_of_a_patched_model_says_once_that_it_cannot_be_faster(caplog):
    import torch._dynamo

    model = tiny_model("llama", num_hidden_layers=1)
    longpatch.patch_model(model, {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": 1})
    common._warned.discard("torch.compile")  # said once per process: this test must see the first time
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    ids = torch.randint(0, 256, (1, 128))
    with caplog.at_level(logging.WARNING, logger="longpatch"), torch.no_grad():
        out = compiled(ids).logits
        compiled(ids)
    assert caplog.text.count("torch.compile of a patched model") == 1, caplog.text
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids).logits)
    torch._dynamo.reset()


@pytest.mark.parametrize("method, params, says", [
    ("probe", {}, True),  # a prefill-only method: its chunks run exact attention, said once
    ("hyper", {"block_size": 16, "sample_size": 16, "min_seq_len": 32}, False),  # hyper runs its chunks
])
def test_a_chunked_prefill_that_runs_exact_attention_says_so(method, params, says, caplog):
    import helpers  # noqa: F401  (registers the probe method)
    from transformers import DynamicCache

    model = tiny_model("llama")
    longpatch.patch_model(model, {"method": method, "params": params, "layers": "all"})
    common._warned.discard(f"chunk:{method}")
    ids = torch.randint(3, 256, (1, 256))
    with caplog.at_level(logging.WARNING, logger="longpatch"), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert "prefill_chunk_size" not in caplog.text  # a one-call prefill and one-token steps: nothing to say
        model.longpatch.reset_stats()
        # a cache given: transformers 5.0 chunks a prefill only into one it is handed
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       prefill_chunk_size=64, past_key_values=DynamicCache())
    assert caplog.text.count(f"'{method}' runs exact attention") == int(says), caplog.text
    chunks = model.longpatch.breakdown()["patched"]["prefill"]
    layers = len(longpatch.patched_layers(model))
    if says:  # what the warning says: the later chunks ran exact attention
        assert chunks["exact"]["calls"] == 3 * layers
    else:  # hyper: chunks of 64 against 128-256 keys approximate their rectangle of earlier keys
        assert chunks["method"]["calls"] == 4 * layers and "exact" not in chunks
