"""The engine-free part of the vLLM backend (longpatch/serving): a paged cache written by slot and a packed
batch of ragged sequences give each sequence what its contiguous cache gives, for exact attention and a
replaced layer's route (the same selection on the same q/k); the plugin without and with a bad config."""
import subprocess
import sys

import pytest
import torch

from longpatch.config import load_config
from longpatch.methods.exact import exact_attention
from longpatch.methods.paged import listed_step
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
    pages.attend_packed(query, starts, lengths, out, lambda i, q, n: exact_attention(
        q, *pages.sequence_kv(key_cache, value_cache, table[i], n), causal=True))
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
    pages.attend_packed(query, starts, lengths, out, lambda i, q, n: route.run(
        "method", q, *pages.sequence_kv(key_cache, value_cache, table[i], n), causal=True, scale=None, state={}))
    alone = build_routes(cfg, 4)[0]
    for i, (k, v) in enumerate(seqs):
        want = alone.run("method", qs[i], k, v, causal=True, scale=None, state={})[0].transpose(0, 1)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, rtol=0, atol=0)
        exact = exact_attention(qs[i], k, v, causal=True)[0].transpose(0, 1)
        assert (out[starts[i]:starts[i + 1]] - exact).abs().max() > 1e-3  # the selection left blocks out


@pytest.mark.parametrize("order", ["scattered", "in runs"])
def test_an_exact_step_read_in_place_is_exact_attention(order):
    """One query per head over a sequence's blocks read in place, run by run of consecutive physical blocks
    (unwritten rows NaN: never read), equals exact attention on its contiguous keys."""
    g = torch.Generator().manual_seed(4)
    n = 77  # 9 full blocks and 5 rows of a tenth
    kv_cache = torch.full((64, HK, BS, 2 * D), float("nan"))
    key_cache, value_cache = pages.split_cache(kv_cache)
    ids = torch.randperm(64, generator=g)[:10] if order == "scattered" else torch.tensor([3, 4, 5, 9, 10, 11, 12,
                                                                                          30, 31, 50])
    k, v = torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g)
    pages.write_slots(key_cache, value_cache, k, v, torch.tensor([int(ids[p // BS]) * BS + p % BS for p in range(n)]))
    q = torch.randn(1, H, 1, D, generator=g)
    got = pages.exact_step(q, key_cache, value_cache, ids.to(torch.int32), n, D ** -0.5)
    want = exact_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True)
    torch.testing.assert_close(got, want)
    assert len(pages.runs_of(ids[:9].tolist())) == (9 if order == "scattered" else 3)


def _small(name: str, **extra):
    """A bundled 32k config on blocks of 16 keys (two cache blocks), pages of 4."""
    cfg = load_config(name)
    small = {"moba": {"chunk_size": 16, "topk": 4, "final_topk": 2},
             "nsa": {"select_block": 16, "num_selected": 4, "window": 12, "compress_block": 8, "compress_stride": 4,
                     "final_topk": 2}}[cfg.method]
    return cfg.replace(params={**cfg.params, **small, "score_stride": 4, "estimate_queries": 8, "decode_topk": 2,
                               "decode_page": 4, **extra})


@pytest.mark.parametrize("name", ["demo-moba-32k", "demo-nsa-32k"])
def test_a_step_over_the_listed_pages_is_the_routes_own_step(name):
    """A replaced layer's one-token step in the paged cache (bounds widened by slot as the backend writes, the
    blocks ranked from the sequence's gathered bounds, only the listed pages read) gives what the route's own
    step gives on the contiguous cache after the same prefill, at each of several positions; not exact's."""
    route = build_routes(_small(name), 4)[0]
    n0, steps = 150, 20
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H, n0 + steps, D, generator=g)
    k, v = torch.randn(1, HK, n0 + steps, D, generator=g), torch.randn(1, HK, n0 + steps, D, generator=g)
    # rows past a sequence hold what was there (an engine zeroes its cache once): large, finite, never counted
    kv_cache = torch.full((64, HK, BS, 2 * D), 1e4)
    key_cache, value_cache = pages.split_cache(kv_cache)
    mins, maxs = pages.bounds_buffers(kv_cache, 4)
    row = torch.randperm(64, generator=g)[: -(-(n0 + steps) // BS)].to(torch.int32)

    def write(p0, p1):
        slots = torch.tensor([int(row[p // BS]) * BS + p % BS for p in range(p0, p1)])
        kk, vv = k[0, :, p0:p1].transpose(0, 1), v[0, :, p0:p1].transpose(0, 1)
        pages.write_slots(key_cache, value_cache, kk, vv, slots)
        pages.write_bounds(mins, maxs, kk, slots, 4)
    write(0, 70)  # the prompt in two chunks, as the engine writes them
    write(70, n0)
    state = {}
    route.run("method", q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], causal=True, scale=None, state=state)
    kept = state["kept"]
    for n in range(n0 + 1, n0 + steps + 1):
        write(n - 1, n)
        qn = q[:, :, n - 1:n]
        want = route.run("method", qn, k[:, :, :n], v[:, :, :n], causal=True, scale=None, state=state)
        spec = route.bound.step_spec(n)
        bounds = pages.SequenceBounds(mins, maxs, row, n, BS, spec.block, spec.page, kept)
        got = listed_step(spec, qn, bounds, torch.tensor([n]),
                          pages.ListedAttention(qn, kv_cache, row, spec.block, D ** -0.5))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - exact_attention(qn, k[:, :, :n], v[:, :, :n])).abs().max() > 1e-3


@pytest.mark.parametrize("fill", [1e4, float("nan")])
def test_listed_blocks_read_in_place_are_attention_over_those_blocks(fill):
    """The float32 executor reads the listed rows in place (one sparse score call, one weighted sum): the
    same output and lse as softmax attention over the listed blocks' keys below the length, per KV head its
    own list (pads, a block ending past the length); rows past the sequence never counted, even NaN ones;
    the copying executor (other dtypes) gives the same on finite rows."""
    g = torch.Generator().manual_seed(3)
    n, block = 75, 16  # 5 listed blocks of two cache blocks each; the last one partial
    kv_cache = torch.full((64, HK, BS, 2 * D), fill)
    key_cache, value_cache = pages.split_cache(kv_cache)
    row = torch.randperm(64, generator=g)[: -(-n // BS)].to(torch.int32)
    k, v = torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g)
    slots = torch.tensor([int(row[p // BS]) * BS + p % BS for p in range(n)])
    pages.write_slots(key_cache, value_cache, k, v, slots)
    q = torch.randn(1, H, 1, D, generator=g)
    blocks = torch.tensor([[[4, 0, 2, -1], [1, -1, 3, 4]]], dtype=torch.int32)  # per KV head
    length, start = torch.tensor([n]), torch.tensor([5])
    attend = pages.ListedAttention(q, kv_cache, row, block, D ** -0.5)
    out, lse = attend(blocks, length, start)
    for h in range(H):
        keys = [p for j in blocks[0, h // (H // HK)].tolist() if j >= 0 for p in range(j * block, (j + 1) * block)
                if 5 <= p < n]
        s = (q[0, h, 0] @ k[keys, h // (H // HK)].T) * D ** -0.5
        want = torch.softmax(s, -1) @ v[keys, h // (H // HK)]
        torch.testing.assert_close(out[0, h, 0], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[0, h, 0], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    if fill == fill:  # finite rows: the copying executor agrees
        per = block // BS
        cols = (blocks.clamp(min=0).to(torch.int64).unsqueeze(-1) * per + torch.arange(per)).clamp(max=row.shape[0] - 1)
        pos = (blocks.clamp(min=0).to(torch.int64).unsqueeze(-1) * block + torch.arange(block)).flatten(-2)
        valid = (blocks >= 0).repeat_interleave(block, -1) & (pos < n) & (pos >= 5)
        copied, _ = attend._copied(row.to(torch.int64)[cols].view(1, HK, -1), valid)
        torch.testing.assert_close(copied, out, rtol=1e-5, atol=1e-5)


def test_page_bounds_written_by_slot_bound_every_key_of_their_page():
    """Bounds reset by a page's first key: a block reused by another sequence keeps none of the old keys."""
    kv_cache = torch.zeros(4, HK, BS, 2 * D)
    key_cache, value_cache = pages.split_cache(kv_cache)
    mins, maxs = pages.bounds_buffers(kv_cache, 4)
    g = torch.Generator().manual_seed(2)
    for scale in (100.0, 1.0):  # the second writer of block 2 has keys 100x smaller
        k = torch.randn(BS, HK, D, generator=g) * scale
        slots = torch.arange(2 * BS, 3 * BS)
        pages.write_bounds(mins, maxs, k[:3], slots[:3], 4)
        pages.write_bounds(mins, maxs, torch.cat([k[3:], k[:1]]), torch.cat([slots[3:], torch.tensor([-1])]), 4)
    pages_k = k.view(2, 4, HK, D)
    assert torch.equal(mins[4:6], pages_k.amin(1)) and torch.equal(maxs[4:6], pages_k.amax(1))


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
