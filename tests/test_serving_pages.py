"""The engine-free part of the vLLM backend (longpatch/serving): a paged cache written by slot and a packed
batch of ragged sequences give each sequence what its contiguous cache gives, for exact attention and a
replaced layer's route (the same selection on the same q/k); the plugin without and with a bad config."""
import subprocess
import sys

import pytest
import torch

from longpatch.config import load_config
from longpatch.methods.exact import exact_attention
from longpatch.patching import build_routes
from longpatch.serving import pages

H, HK, D, BS = 4, 2, 16, 8


def _paged(lengths, blocks_total=64, seed=0):
    """A cache of shuffled physical blocks holding sequences of ``lengths`` keys, their block table and the
    contiguous keys/values [1, hk, n, d] of each."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.full((blocks_total, HK, BS, 2 * D), float("nan"))  # unwritten rows must never be read
    key_cache, value_cache = pages.split_cache(kv_cache)
    free = torch.randperm(blocks_total, generator=g).tolist()
    table = torch.full((len(lengths), blocks_total), -1, dtype=torch.int32)
    seqs = []
    for i, n in enumerate(lengths):
        nb = -(-n // BS)
        ids = [free.pop() for _ in range(nb)]
        table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k, v = torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g)
        slots = torch.tensor([ids[p // BS] * BS + p % BS for p in range(n)])
        # written in two calls, with a padding slot (-1) in the second, as an engine's batches do
        half = n // 2
        pages.write_slots(key_cache, value_cache, k[:half], v[:half], slots[:half])
        pages.write_slots(key_cache, value_cache, torch.cat([k[half:], k[:1]]), torch.cat([v[half:], v[:1]]),
                          torch.cat([slots[half:], torch.tensor([-1])]))
        seqs.append((k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)))
    return kv_cache, table, seqs


def test_slots_written_are_the_rows_read():
    lengths = [13, 40, 1]
    kv_cache, table, seqs = _paged(lengths)
    key_cache, value_cache = pages.split_cache(kv_cache)
    for i, n in enumerate(lengths):
        k, v = pages.sequence_kv(key_cache, value_cache, table[i], n)
        assert torch.equal(k, seqs[i][0]) and torch.equal(v, seqs[i][1])


def _packed(lengths, q_lens, seqs, seed=1):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(1, H, ql, D, generator=g) for ql in q_lens]
    query = torch.cat([q[0].transpose(0, 1) for q in qs])
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    return qs, query, starts


@pytest.mark.parametrize("q_lens", [[13, 40, 1], [1, 8, 1], [5, 17, 1]])  # prefill, decode steps, chunks
def test_a_packed_batch_gives_each_sequence_its_own_exact_attention(q_lens):
    lengths = [13, 40, 1]
    kv_cache, table, seqs = _paged(lengths)
    key_cache, value_cache = pages.split_cache(kv_cache)
    qs, query, starts = _packed(lengths, q_lens, seqs)
    out = torch.zeros(query.shape)
    pages.attend_packed(query, key_cache, value_cache, starts, lengths, table, out,
                        lambda q, k, v: exact_attention(q, k, v, causal=True))
    for i, (k, v) in enumerate(seqs):
        want = exact_attention(qs[i], k, v, causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want)


def test_a_replaced_layer_runs_its_route_on_the_sequence_as_patch_model_does():
    """MoBA's hybrid selection (blocks of 8, 2 chosen) on two sequences long enough to choose: the packed,
    paged call gives what the route gives on each sequence's contiguous q/k/v, and that is not exact."""
    cfg = load_config("demo-moba-32k").replace(
        params={**load_config("demo-moba-32k").params, "chunk_size": BS, "topk": 3, "score_stride": 4,
                "estimate_queries": 8, "final_topk": 2, "decode_topk": 2, "decode_page": 4})
    lengths = [96, 64]
    kv_cache, table, seqs = _paged(lengths)
    key_cache, value_cache = pages.split_cache(kv_cache)
    g = torch.Generator().manual_seed(3)
    qs = [torch.randn(1, H, n, D, generator=g) for n in lengths]
    query = torch.cat([q[0].transpose(0, 1) for q in qs])
    starts = [0, lengths[0], sum(lengths)]
    route = build_routes(cfg, 4)[0]
    out = torch.zeros(query.shape)
    pages.attend_packed(query, key_cache, value_cache, starts, lengths, table, out,
                        lambda q, k, v: route.run("method", q, k, v, causal=True, scale=None, state={}))
    alone = build_routes(cfg, 4)[0]
    for i, (k, v) in enumerate(seqs):
        want = alone.run("method", qs[i], k, v, causal=True, scale=None, state={})[0].transpose(0, 1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, rtol=0, atol=0)
        exact = exact_attention(qs[i], k, v, causal=True)[0].transpose(0, 1)
        assert (out[starts[i]:starts[i + 1]] - exact).abs().max() > 1e-3  # the selection left blocks out


def _register(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from longpatch.serving.plugin import register; register(); "
                           "print('registered')"], capture_output=True, text=True, env=env, timeout=120)


def test_the_plugin_without_its_variable_leaves_vllm_alone(monkeypatch):
    import os
    env = {k: v for k, v in os.environ.items() if k != "LONGPATCH_CONFIG"}
    r = _register(env)
    assert r.returncode == 0 and r.stdout.strip() == "registered", r.stderr
    assert "vllm" not in r.stderr


def test_a_bad_config_is_one_line_and_a_nonzero_exit():
    import os
    r = _register({**os.environ, "LONGPATCH_CONFIG": "no-such-config"})
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("longpatch: LONGPATCH_CONFIG='no-such-config': config:") and "aliases:" in lines[0]
