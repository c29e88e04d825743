"""Chunked prefill through the query-aware selections: a prefill chunk (the queries are the last q_len
positions of the keys, from a block start) runs the method, not exact attention.

Checked here: a chunk's antidiagonal scores equal the one-shot prefill's rows (float32 and int8 products);
the prompt's last chunk gets the one-shot's block lists (antidiagonal, hybrid); MoBA's and NSA's chunk
outputs equal a dense definition of the same selection (GQA, ragged lengths); causality by perturbing
later keys; chunks off the block grid run exact attention; for exact attention a chunked forward of a model
equals the one-shot forward; a patched model's chunks run the method (counted, no warning); a chunk size
the config cannot run is one clear line."""
import logging

import pytest
import torch
from helpers import dense_attention, logits

import longpatch
from longpatch.config import check_prefill_chunk, load_config, prefill_chunk_multiple
from longpatch.errors import ConfigError
from longpatch.methods import common, selection
from longpatch.methods.blocksparse import block_mask_reference, block_sparse_prefill
from longpatch.methods.exact import exact_attention
from longpatch.methods.selection import antidiagonal_scores, estimated_blocks
from longpatch.ops import moba_attention, nsa_attention
from longpatch.testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(n, hq=4, hk=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g).to(dtype) for h in (hq, hk, hk))


def _dense_of_lists(q, k, v, lists, block, scale, extra=None):
    """The executor's definition written densely: a chunk's rows attend to their listed blocks and their own
    block up to themselves (``extra``: more keys per row, e.g. NSA's window), by softmax in float64."""
    nq, n = q.shape[2], k.shape[2]
    mb = lists.shape[2]
    padded = torch.cat([torch.full((*lists.shape[:2], -(-n // block) - mb, lists.shape[-1]), -1), lists], 2)
    mask = block_mask_reference(padded, n, block)[:, :, n - nq:]
    if extra is not None:
        mask = mask | extra
    assert not (mask & ~torch.ones(nq, n, dtype=torch.bool).tril(n - nq)).any()  # never a later key
    return dense_attention(q, k, v, scale=scale, mask=mask.repeat_interleave(q.shape[1] // k.shape[1], 1))[0]


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n, block, stride, off", [(300, 32, 8, 64), (300, 32, 8, 256), (256, 64, 16, 128),
                                                   (200, 16, 4, 16)])
def test_a_chunks_antidiagonal_scores_are_the_prefills_rows(n, block, stride, off, int8, monkeypatch):
    """A query block's antidiagonal scores read its own rows and the keys before it: a chunk's are the
    one-shot prefill's rows, whichever products (float32, int8) compute them."""
    monkeypatch.setattr(selection, "INT8_PRODUCTS", int8)
    q, k, _ = qkv(n)
    whole = antidiagonal_scores(q, k, block, stride, 0.25)
    chunk = antidiagonal_scores(q[:, :, off:], k, block, stride, 0.25)
    assert chunk.shape == (1, 2, whole.shape[2] - off // block, whole.shape[3])
    torch.testing.assert_close(chunk, whole[:, :, off // block:], atol=0, rtol=0)


@pytest.mark.parametrize("scoring", [("antidiagonal", 8), ("hybrid", 16, 8)])
def test_the_last_chunk_gets_the_prefills_lists(scoring):
    """The prompt's last chunk holds the prompt's last queries: its lists (own antidiagonal blocks, the end's
    vertical, the final row's blocks) are the one-shot prefill's for those query blocks."""
    q, k, _ = qkv(512, seed=1)
    for i in range(4, 16):  # query block i reads block i // 3 strongly: lists that stand apart
        k[:, :, (i // 3) * 32:(i // 3 + 1) * 32] += 0.5 * q[:, ::2, i * 32:(i + 1) * 32].mean(2, keepdim=True)
    whole = estimated_blocks(q, k, 32, 5, 0.9, scoring, 1, 0.25, final_topk=3)
    chunk = estimated_blocks(q[:, :, 384:], k, 32, 5, 0.9, scoring, 1, 0.25, final_topk=3)
    assert torch.equal(chunk.sort(-1).values, whole[:, :, 12:].sort(-1).values)


def test_an_earlier_chunk_chooses_from_its_own_last_queries():
    """An earlier chunk's end list is its own last queries' (the prompt's end is not there yet): its lists
    name past blocks only, each at most once, within the budget."""
    q, k, _ = qkv(512, seed=2)
    lists = estimated_blocks(q[:, :, 128:256], k[:, :, :256], 32, 5, 0.9, ("hybrid", 16, 8), 1, 0.25)
    assert lists.shape[2] == 4 and lists.shape[-1] <= 5
    own = torch.arange(4, 8).view(1, 1, 4, 1)
    assert ((lists < own) | (lists == -1)).all()
    for row in lists.reshape(-1, lists.shape[-1]).tolist():
        kept = [j for j in row if j >= 0]
        assert len(kept) == len(set(kept))


@pytest.mark.parametrize("n, off, selection_", [(300, 128, "hybrid"), (256, 64, "antidiagonal"),
                                                (256, 192, "estimate"), (320, 32, "hybrid")])
def test_moba_chunk_equals_the_dense_definition_of_its_selection(n, off, selection_):
    q, k, v = qkv(n, seed=3)
    params = dict(chunk_size=32, topk=4, selection=selection_, mass=0.9, estimate_queries=16, score_stride=8,
                  local_blocks=1, decode_topk=2)
    out = moba_attention(q[:, :, off:], k, v, **params)
    scoring = selection.scoring_of(selection_, 16, 8)
    lists = estimated_blocks(q[:, :, off:], k, 32, 3, 0.9, scoring, 1, 0.25, final_topk=2)
    torch.testing.assert_close(out.double(), _dense_of_lists(q[:, :, off:], k, v, lists, 32, 0.25),
                               atol=2e-6, rtol=0)
    assert not torch.allclose(out, exact_attention(q[:, :, off:], k, v), atol=1e-3)  # sparse, not exact


def test_nsa_chunk_equals_the_dense_definition_of_its_selection():
    """NSA's chunk: g_slc x (own + listed blocks) + g_win x (its sliding window from the chunk's positions)."""
    n, off, window = 300, 128, 40
    q, k, v = qkv(n, seed=4)
    out = nsa_attention(q[:, :, off:], k, v, select_block=32, num_selected=4, window=window, init_blocks=1,
                        local_blocks=2, gates=(0.0, 0.75, 0.25), selection="hybrid", mass=0.9, estimate_queries=16,
                        score_stride=8, decode_topk=2)
    lists = estimated_blocks(q[:, :, off:], k, 32, 3, 0.9, ("hybrid", 16, 8), 1, 0.25, final_topk=2)
    pos = torch.arange(off, n).view(-1, 1)
    band = (torch.arange(n).view(1, -1) <= pos) & (torch.arange(n).view(1, -1) > pos - window)
    win = dense_attention(q[:, :, off:], k, v, scale=0.25, mask=band.expand(1, 4, -1, -1))[0]
    want = 0.75 * _dense_of_lists(q[:, :, off:], k, v, lists, 32, 0.25) + 0.25 * win
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)


def test_a_chunk_is_causal():
    """Changing the keys and values from block 7 on leaves the chunk's rows before block 7 as they were
    (antidiagonal: a query block's scores read only the keys before it)."""
    q, k, v = qkv(320, seed=5)
    params = dict(chunk_size=32, topk=4, selection="antidiagonal", mass=0.9, score_stride=8)
    before = moba_attention(q[:, :, 128:], k, v, **params)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 224:] = torch.randn(1, 2, 96, 16) * 4
    v2[:, :, 224:] = torch.randn(1, 2, 96, 16) * 4
    after = moba_attention(q[:, :, 128:], k2, v2, **params)
    assert torch.equal(before[:, :, :96], after[:, :, :96])
    assert not torch.allclose(before[:, :, 96:], after[:, :, 96:])


def test_the_executor_takes_a_chunk_and_refuses_lists_that_do_not_fit():
    q, k, v = qkv(256, seed=6)
    lists = torch.full((1, 2, 4, 2), -1, dtype=torch.long)
    lists[:, :, :, 0] = 0
    out, _ = block_sparse_prefill(q[:, :, 128:], k, v, lists, 32, 0.25)
    torch.testing.assert_close(out.double(), _dense_of_lists(q[:, :, 128:], k, v, lists, 32, 0.25), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="the queries must be the last positions"):
        block_sparse_prefill(q[:, :, 100:], k, v, lists, 32, 0.25)


def _moba(q, k, v, **kw):
    return moba_attention(q, k, v, chunk_size=32, topk=3, selection="hybrid", estimate_queries=16, score_stride=8,
                          **kw)


def _nsa(q, k, v, **kw):
    return nsa_attention(q, k, v, select_block=32, num_selected=3, window=32, gates=(0.0, 0.75, 0.25),
                         selection="hybrid", estimate_queries=16, score_stride=8, **kw)


@pytest.mark.parametrize("op", [_moba, _nsa])
def test_a_chunk_off_the_block_grid_runs_its_first_rows_exactly_and_the_rest_chunked(op):
    """A chunk starting at position 100 (blocks of 32): rows 100-127 before the first block start are exact
    attention, the rows from 128 on are the chunk that starts there (LSEs joined alike); a call of a few
    queries none of which reaches a block start is exact."""
    q, k, v = qkv(256, seed=7)
    out, lse = op(q[:, :, 100:], k, v, return_lse=True)
    want_head, want_lse = exact_attention(q[:, :, 100:128], k[:, :, :128], v[:, :, :128], return_lse=True)
    torch.testing.assert_close(out[:, :, :28], want_head, atol=1e-5, rtol=0)
    rest, rest_lse = op(q[:, :, 128:], k, v, return_lse=True)
    torch.testing.assert_close(out[:, :, 28:], rest, atol=0, rtol=0)
    torch.testing.assert_close(lse[:, :, 28:], rest_lse.to(lse.dtype), atol=0, rtol=0)
    assert lse.shape[:3] == (1, 4, 156)
    few = op(q[:, :, 120:124], k[:, :, :124], v[:, :, :124])
    torch.testing.assert_close(few, exact_attention(q[:, :, 120:124], k[:, :, :124], v[:, :, :124]), atol=1e-5,
                               rtol=0)


def _chunked_logits(model, ids, chunk):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    parts = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            parts.append(model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(parts, 1)


def test_a_chunked_forward_of_exact_attention_equals_the_one_shot_forward():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 200))
    torch.testing.assert_close(_chunked_logits(model, ids, 64), logits(model, ids), atol=1e-5, rtol=1e-5)


def test_a_patched_models_chunks_run_the_method(caplog):
    """Each chunk after the first runs the selection (counted as prefill calls of the method), with no
    warning; the last chunk's lists are what decode keeps."""
    model = tiny_model("llama")
    longpatch.patch_model(model, {"method": "moba", "layers": "all", "params": {
        "chunk_size": 16, "topk": 3, "selection": "hybrid", "mass": 0.9, "estimate_queries": 8, "score_stride": 4}})
    common._warned.discard("chunk:moba")
    ids = torch.randint(3, 256, (1, 256))
    with caplog.at_level(logging.WARNING, logger="longpatch"):
        out = _chunked_logits(model, ids, 64)
    assert "runs exact attention" not in caplog.text
    prefill = model.longpatch.breakdown()["patched"]["prefill"]
    assert prefill["method"]["calls"] == 4 * len(longpatch.patched_layers(model))
    assert "method_exact" not in prefill and "exact" not in prefill
    assert torch.isfinite(out).all()
    model.longpatch.reset_stats()
    with caplog.at_level(logging.WARNING, logger="longpatch"):
        _chunked_logits(model, ids, 40)  # chunks off the 16-key grid: their first rows exact, the rest chunked
    assert "runs exact attention" not in caplog.text
    prefill = model.longpatch.breakdown()["patched"]["prefill"]
    layers = len(longpatch.patched_layers(model))
    assert prefill["method_exact"]["calls"] == layers  # the first chunk only: 40 tokens, 3 chunks, top-3 covers them
    assert prefill["method"]["calls"] == 6 * layers


def test_a_chunk_size_the_config_cannot_run_is_one_line():
    cfg = load_config("demo-moba-32k")
    assert prefill_chunk_multiple(cfg) == 256
    assert prefill_chunk_multiple(load_config("demo-sparse")) == 1
    check_prefill_chunk(cfg, 8192)
    check_prefill_chunk(None, 100)
    for bad, why in [(4000, "a multiple of 256"), (0, "an int >= 1"), (True, "an int >= 1")]:
        with pytest.raises(ConfigError, match=why) as e:
            check_prefill_chunk(cfg, bad)
        assert "\n" not in str(e.value)


def test_hyper_runs_a_prefill_chunk_and_decodes_exactly():
    """hyper has no decode: a chunk runs its prefill (the keys before the queries one more rectangle), a
    one-token step exact attention."""
    from longpatch.methods import get_method
    from longpatch.ops import hyper_attention
    from longpatch.routing import LayerRoute

    params = {"block_size": 16, "sample_size": 16, "min_seq_len": 32}
    q, k, v = qkv(256, seed=8)
    route = LayerRoute(0, get_method("hyper"), params)
    assert route.choose(128, 256) == "method" and route.choose(1, 256) == "exact"
    out = route.run("method", q[:, :, 128:], k, v, causal=True, scale=None)
    want = hyper_attention(q[:, :, 128:], k, v, lsh_dirs=route.bound.buffers["lsh_dirs"], **params)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert not torch.allclose(out, exact_attention(q[:, :, 128:], k, v), atol=1e-3)
