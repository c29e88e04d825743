"""A compiled static-cache decode of a patched model gives the dynamic cache's tokens on a padded batch:
generate() declines to compile such a batch (and says so), and a compile that runs anyway (the user's own,
or one transformers applies) runs every patched call but the graph-safe step outside the graph, where it
is the eager call; the unpadded batch keeps its compiled graph-safe step."""
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import longpatch
from longpatch.families import hf
from longpatch.methods import common

MOBA = {"chunk_size": 16, "topk": 4, "selection": "hybrid", "estimate_queries": 8, "score_stride": 4,
        "decode_page": 4, "decode_topk": 2}
NSA = {"compress_block": 16, "compress_stride": 8, "select_block": 16, "num_selected": 4, "window": 24,
       "selection": "hybrid", "estimate_queries": 8, "score_stride": 4, "decode_page": 4, "decode_topk": 2}
SPARSE = {"window": 24, "global_tokens": 8, "block": 16, "random_blocks": 0}
CASES = [("moba", MOBA), ("nsa", NSA), ("sparse", SPARSE)]


def _model(method, params):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    longpatch.patch_model(model, {"method": method, "params": params, "layers": "all"})
    return model


def _batch(pad: int):
    ids = torch.randint(1, 100, (2, 120), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0  # row 1 left-padded
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)


def _compiled():
    config = CompileConfig(backend="eager", dynamic=False)
    config._compile_all_devices = True  # transformers auto-compiles on accelerators only
    return config


@pytest.mark.parametrize("method, params", CASES)
@pytest.mark.parametrize("pad", [37, 64])
def test_generate_declines_to_compile_a_padded_batch_and_says_so(method, params, pad, caplog, monkeypatch):
    monkeypatch.setattr(common, "_warned", set())
    model = _model(method, params)
    kw = _batch(pad)
    dynamic = model.generate(**kw)
    with caplog.at_level(logging.WARNING, logger="longpatch"):
        static = model.generate(**kw, cache_implementation="static", compile_config=_compiled())
    assert torch.equal(static, dynamic)
    assert "does not compile the static-cache steps of a padded batch" in caplog.text


@pytest.mark.parametrize("method, params", CASES)
def test_a_compile_that_runs_anyway_gives_the_eager_tokens_on_a_padded_batch(method, params, monkeypatch):
    """The auto-compile's padding check taken away: transformers compiles the padded batch's steps, whose
    patched calls then run outside the graph. Before, dynamo traced them: wrong tokens (sparse) or an
    IndexError while tracing the block-sparse decode (MoBA, NSA)."""
    monkeypatch.setattr(hf, "_padded", lambda mask: False, raising=False)
    model = _model(method, params)
    kw = _batch(45)
    dynamic = model.generate(**kw)
    torch._dynamo.reset()
    compiled = model.generate(**kw, cache_implementation="static", compile_config=_compiled())
    assert torch.equal(compiled, dynamic)


def test_an_unpadded_batch_still_compiles_its_graph_safe_step(monkeypatch):
    """Full graph: every patched step of the unpadded batch takes the graph-safe step (no call outside it)."""
    model = _model("moba", MOBA)
    kw = _batch(0)
    dynamic = model.generate(**kw)
    config = _compiled()
    config.fullgraph = True
    outside = []
    monkeypatch.setattr(hf, "_eager_outside_graph", lambda *a: outside.append(1) or hf._eager(*a), raising=False)
    torch._dynamo.reset()
    assert torch.equal(model.generate(**kw, cache_implementation="static", compile_config=config), dynamic)
    assert not outside
