"""Shipped architectures (longpatch/assets/architectures): real configs, random weights, offline; bench
generate --random-weights on a shrunken variant (the full models are for a GPU)."""
import json

import pytest
import torch
from typer.testing import CliRunner

from longpatch import cli, patch_model
from longpatch.bench.generate import run_generate_bench
from longpatch.errors import ConfigError
from longpatch.loading import ARCH_OVERRIDES, load_model, random_model, shipped_architectures

runner = CliRunner()
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}

# (model_type, layers, hidden, heads, KV heads, vocab, max positions): the published configurations
FACTS = {"llama-3.1-8b": ("llama", 32, 4096, 32, 8, 128256, 131072),
         "qwen2.5-7b": ("qwen2", 28, 3584, 28, 4, 152064, 131072),
         "glm-4-9b": ("glm4", 40, 4096, 32, 2, 151552, 32768)}


def test_shipped_configs_are_the_published_architectures():
    from transformers import AutoConfig

    assert set(shipped_architectures()) == set(FACTS)
    for name, facts in FACTS.items():
        c = AutoConfig.from_pretrained(shipped_architectures()[name])
        got = (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
               c.vocab_size, c.max_position_embeddings)
        assert got == facts, name
    llama = AutoConfig.from_pretrained(shipped_architectures()["llama-3.1-8b"])
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize("name", sorted(FACTS))
def test_random_weights_build_offline_and_patch(name, one_thread):
    model, tok = random_model(name, "float32", "cpu", overrides=SMALL)
    assert tok is None and model.config.model_type == FACTS[name][0]
    ids = torch.randint(1000, (1, 96))
    with torch.no_grad():
        ref = model(ids).logits
        patch_model(model, {"method": "sparse", "params": {"window": 1000, "global_tokens": 0}})  # exact here
        out = model(ids).logits
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_bad_spellings_are_one_line():
    with pytest.raises(ConfigError) as e:
        random_model("llama-3-8b")
    assert "no shipped architecture 'llama-3-8b'; allowed: glm-4-9b, llama-3.1-8b, qwen2.5-7b" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_model("qwen2.5-7b")  # a name without weights: never the hub, never random weights silently
    assert "--random-weights" in str(e.value) and "\n" not in str(e.value)


def test_cli_random_weights_with_an_unknown_architecture(tmp_path):
    r = runner.invoke(cli.app, ["bench", "generate", "--model", "tiny:llama", "--random-weights", "--contexts", "64",
                                "--new-tokens", "2", "--out", str(tmp_path / "o"), "--no-progress"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert "no shipped architecture 'tiny:llama'" in r.stderr


def test_bench_generate_on_a_shrunken_llama(tmp_path, monkeypatch, one_thread):
    """TTFT, per-token decode and peak memory, unpatched and patched in one run, on the real llama
    architecture shrunk to 2 layers of 128 (the test-only $LONGPATCH_ARCH_OVERRIDES)."""
    monkeypatch.setenv(ARCH_OVERRIDES, json.dumps(SMALL))
    res = run_generate_bench("llama-3.1-8b", method="moba", layers="all", contexts="256", new_tokens=3,
                             out=tmp_path / "o", random_weights=True, progress=False, plots=False,
                             sets=["selection=estimate", "chunk_size=64", "topk=3", "dtype=float32"])
    recs = res["records"]
    assert [r["config"] for r in recs] == ["exact", "moba"]
    assert res["meta"]["random_weights"] and "whatever the weights" in res["meta"]["note"]
    for r in recs:
        assert r["ttft_s"] > 0 and r["decode_ms_per_token"] > 0 and r["peak_rss_mib"] > 0 and r["warmup_s"] >= 0
    assert recs[1]["paths"]["prefill"] == {"method": 2}  # every layer's prefill ran MoBA


@pytest.mark.slow
def test_a_patched_model_on_flex_generates_like_the_torch_path(tmp_path, monkeypatch, one_thread):
    """`backend: flex` through a patched model's route on the CPU (compiled flex: prefill and
    one-token steps) against `backend: torch`: the same greedy tokens on the shrunken llama."""
    monkeypatch.setenv(ARCH_OVERRIDES, json.dumps(SMALL))
    sets = ["selection=estimate", "chunk_size=64", "topk=3", "dtype=float32"]
    toks = {}
    for backend in ("torch", "flex"):
        res = run_generate_bench("llama-3.1-8b", method="moba", layers="all", contexts="300", new_tokens=4,
                                 out=tmp_path / backend, random_weights=True, progress=False, plots=False,
                                 sets=[*sets, f"backend={backend}"], warmup=0)
        toks[backend] = res["records"][1]["tokens"]
        assert res["records"][1]["paths"]["decode"] == {"method": 6}  # 3 steps x 2 layers ran the method
    assert toks["flex"] == toks["torch"]
