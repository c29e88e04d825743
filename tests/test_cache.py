"""longpatch.cache.GrowingCache (a KV cache that does not copy itself every token) and the ways a
decode step reads it in place (common.gather_blocks, cpu_flash.attend_spans)."""
import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from longpatch import patch_model
from longpatch.bench.generate import greedy_generate
from longpatch.cache import GrowingCache, GrowingLayer, takes_cache_objects
from longpatch.methods.common import gather_blocks
from longpatch.testing.tiny import tiny_model


def _kv(t, b=2, h=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_update_returns_what_a_dynamic_cache_returns_and_copies_only_on_growth():
    grow, dyn = GrowingCache(), DynamicCache()
    k, v = _kv(300)
    grow.update(k[:, :, :40], v[:, :, :40], 0)
    dyn.update(k[:, :, :40], v[:, :, :40], 0)
    buffers = set()
    for t in range(40, 300):
        gk, gv = grow.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
        dk, dv = dyn.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
        assert torch.equal(gk, dk) and torch.equal(gv, dv)
        buffers.add(gk.data_ptr())
    assert grow.get_seq_length() == 300 and isinstance(grow.layers[0], GrowingLayer)
    # 40 tokens -> capacity 40 + 256; one reallocation when it fills (at 297): no copy per token
    assert len(buffers) == 2
    assert not gk.is_contiguous()  # a view of a larger buffer: what the methods must read in place


def test_reserve_allocates_the_generation_with_the_prompt():
    cache = GrowingCache(reserve=1000)
    k, v = _kv(1051)
    cache.update(k[:, :, :50], v[:, :, :50], 0)
    ptr = cache.layers[0].keys.data_ptr()
    for t in range(50, 1050):  # 1000 tokens after the prompt: the same buffer
        cache.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0)
    assert cache.layers[0].keys.data_ptr() == ptr
    cache.update(k[:, :, 1050:], v[:, :, 1050:], 0)  # one more: it grows
    assert cache.layers[0].keys.data_ptr() != ptr and cache.get_seq_length() == 1051


def test_crop_reorder_and_batch_select_are_adopted():
    k, v = _kv(64)
    cache = GrowingCache()
    cache.update(k[:, :, :60], v[:, :, :60], 0)
    cache.crop(-10)  # speculative decoding: drop the last 10
    out_k, _ = cache.update(k[:, :, 60:61], v[:, :, 60:61], 0)
    assert torch.equal(out_k, torch.cat([k[:, :, :50], k[:, :, 60:61]], 2))
    cache.reorder_cache(torch.tensor([1, 0]))  # beam search
    out_k, _ = cache.update(k[:, :, 61:62], v[:, :, 61:62], 0)
    want = torch.cat([k[:, :, :50], k[:, :, 60:61]], 2)[[1, 0]]
    assert torch.equal(out_k, torch.cat([want, k[:, :, 61:62]], 2))
    cache.batch_select_indices(torch.tensor([1]))
    out_k, out_v = cache.update(k[:1, :, 62:63], v[:1, :, 62:63], 0)
    assert torch.equal(out_k, torch.cat([want[1:], k[:, :, 61:62][1:], k[:1, :, 62:63]], 2))
    assert out_v.shape == out_k.shape
    # reset(): whatever transformers' own layer does (drops the rows in 5.x, zeroes them in 4.56)
    got, ref = GrowingCache(), DynamicCache()
    for cache in (got, ref):
        cache.update(k[:, :, :5], v[:, :, :5], 0)
        cache.reset()
    assert torch.equal(got.update(k[:, :, :3], v[:, :, :3], 0)[0], ref.update(k[:, :, :3], v[:, :, :3], 0)[0])


@pytest.mark.parametrize("config", [None, {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": "all"},
                                    {"method": "nsa", "params": {"compress_block": 16, "compress_stride": 8,
                                                                 "select_block": 16, "num_selected": 4, "window": 32},
                                     "layers": "all"}])
def test_generation_with_a_growing_cache_equals_the_dynamic_cache(config, one_thread):
    model = tiny_model("llama").eval()
    if config is not None:
        patch_model(model, config)
    assert takes_cache_objects(model)
    ids = torch.randint(0, 200, (1, 300), generator=torch.Generator().manual_seed(1))
    grow = greedy_generate(model, ids, 12, cache="growing")
    dyn = greedy_generate(model, ids, 12, cache="dynamic")
    assert grow["tokens"] == dyn["tokens"]
    if config is not None:  # the method's own decode path ran on the growing cache's views
        assert model.longpatch.breakdown()["patched"]["decode"]["method"]["calls"] > 0


# --------------------------------------------------------------------------- gather_blocks

def _buffer_view(b, h, n, d, cap, seed=0):
    """A [b, h, n, d] view of a [b, h, cap, d] buffer: what GrowingCache hands out."""
    return torch.randn(b, h, cap, d, generator=torch.Generator().manual_seed(seed))[:, :, :n]


@pytest.mark.parametrize("layout", ["contiguous", "buffer", "transposed"])
@pytest.mark.parametrize("n", [64, 70, 5])  # whole blocks, a partial last block, no complete block
def test_gather_blocks_reads_the_listed_blocks(layout, n):
    b, h, d, block = 2, 3, 4, 16
    x = {"contiguous": lambda: torch.randn(b, h, n, d),
         "buffer": lambda: _buffer_view(b, h, n, d, n + 37),
         "transposed": lambda: torch.randn(b, n, h, d).transpose(1, 2)}[layout]()
    nb_all = -(-n // block)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, nb_all, (b, h, 5), generator=g)
    ids[..., 0] = nb_all - 1  # the last (maybe partial) block is listed everywhere
    got = gather_blocks(x, ids, block).view(b, h, 5, block, d)
    for bi in range(b):
        for hi in range(h):
            for si, blk in enumerate(ids[bi, hi].tolist()):
                if blk < 0:
                    continue  # not a row of the result: callers mask it (only its finiteness matters)
                rows = x[bi, hi, blk * block:min(n, (blk + 1) * block)]
                torch.testing.assert_close(got[bi, hi, si, :rows.shape[0]], rows, rtol=0, atol=0)
                assert torch.isfinite(got[bi, hi, si]).all()  # rows past n: zeros, maskable


def test_attend_spans_is_one_softmax_over_the_spans():
    """The one-token decode's in-place attention: per group of query heads, one softmax over the
    union of its spans of its KV head's rows (widths differ: the narrower group is padded)."""
    from longpatch.methods.cpu_flash import attend_spans, merge_spans
    from longpatch.methods.lse_attention import attention_lse_reference

    assert merge_spans([(32, 48), (0, 16), (16, 20), (40, 50)]) == [(0, 20), (32, 50)]
    b, hq, hk, n, d = 2, 4, 2, 60, 8
    q = torch.randn(b, hq, 1, d, dtype=torch.float64)
    k, v = _buffer_view(b, hk, n, d, 80).double(), _buffer_view(b, hk, n, d, 80, seed=1).double()
    spans = {(0, 0): [(0, 16), (40, 60)], (0, 1): [(16, 32)], (1, 0): [(50, 60)], (1, 1): [(0, 8), (20, 30), (59, 60)]}
    groups = [(bi, hi, spans[bi, hi]) for bi in range(b) for hi in range(hk)]
    out, lse = attend_spans(q, k, v, groups, 0.3)
    for (bi, hi), sp in spans.items():
        mask = torch.zeros(n, dtype=torch.bool)
        for s0, s1 in sp:
            mask[s0:s1] = True
        heads = slice(hi * 2, hi * 2 + 2)
        ro, rl = attention_lse_reference(q[bi:bi + 1, heads], k[bi:bi + 1, hi:hi + 1], v[bi:bi + 1, hi:hi + 1], 0.3,
                                         mask=mask.view(1, 1, 1, n))
        torch.testing.assert_close(out[bi:bi + 1, heads], ro, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse[bi:bi + 1, heads], rl, atol=1e-12, rtol=1e-10)


def test_model_generate_takes_a_growing_cache(one_thread):
    """The README's usage: transformers' generate with a GrowingCache gives its default cache's tokens."""
    model = tiny_model("llama").eval()
    patch_model(model, {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": "all"})
    ids = torch.randint(0, 200, (1, 300), generator=torch.Generator().manual_seed(2))
    from longpatch.bench.generate import _forward_names

    name = _forward_names(model)[1]  # `cache` in newer transformers, `past_key_values` before
    grown = model.generate(ids, max_new_tokens=8, do_sample=False, **{name: GrowingCache(reserve=8)})
    assert torch.equal(grown, model.generate(ids, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("layout", ["buffer", "transposed", "expanded"])
def test_attend_rows_is_one_softmax_over_listed_rows_read_in_place(layout):
    """The sparse one-token attention (two sparse calls for all heads): per query head, one softmax
    over its listed rows of its KV head, on any layout whose rows are contiguous; None otherwise.
    Lists shared by a KV head's query heads and lists of every head give the same result."""
    from longpatch.methods.cpu_flash import attend_rows, cache_rows, row_scores, row_sum, softmax_lse
    from longpatch.methods.lse_attention import attention_lse_reference

    b, hq, hk, n, d = 2, 4, 2, 60, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, 1, d, generator=g)
    if layout == "buffer":
        k, v = _buffer_view(b, hk, n, d, 80), _buffer_view(b, hk, n, d, 80, seed=1)
    elif layout == "transposed":  # transformers' [b, n, h, d] seen as [b, h, n, d]
        k, v = (torch.randn(b, n, hk, d, generator=g).transpose(1, 2) for _ in range(2))
    else:  # one KV head broadcast to two
        k, v = (torch.randn(b, 1, n, d, generator=g).expand(b, hk, n, d) for _ in range(2))
    pos = torch.stack([torch.randperm(n, generator=g)[:12].sort().values for _ in range(b * hq)]).view(b, hq, 12)
    out, lse = attend_rows(q, k, v, pos, 0.3)
    for bi in range(b):
        for h in range(hq):
            mask = torch.zeros(n, dtype=torch.bool)
            mask[pos[bi, h]] = True
            kv = slice(h // 2, h // 2 + 1)
            ro, rl = attention_lse_reference(q[bi:bi + 1, h:h + 1], k[bi:bi + 1, kv], v[bi:bi + 1, kv], 0.3,
                                             mask=mask.view(1, 1, 1, n))
            torch.testing.assert_close(out[bi, h], ro[0, 0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(lse[bi, h], rl[0, 0], atol=1e-6, rtol=1e-5)
    # two lists, one per KV head and one shared by all heads, each its own softmax
    shared = pos[:, ::2]
    window = torch.arange(n - 10, n)
    rows = cache_rows(k, v, hq, shared, window)
    s_a, s_b = row_scores(q, rows, 0.3)
    out2 = row_sum(rows, [softmax_lse(s_a)[0], softmax_lse(s_b)[0]]).view(b, hq, 1, d)
    o_a = attend_rows(q, k, v, shared.repeat_interleave(2, 1), 0.3)[0]
    o_b = attend_rows(q, k, v, window.expand(b, hq, -1), 0.3)[0]
    torch.testing.assert_close(out2, o_a + o_b, atol=1e-6, rtol=1e-5)
    assert attend_rows(q, torch.randn(b, hk, n, 2 * d)[..., ::2], v, pos, 0.3) is None  # rows not contiguous


def test_window_summaries_append_in_place_and_keep_handed_out_views():
    """Summaries grow inside buffers with spare room (a completed window copies only itself), and
    views handed out earlier keep their data when the cache is cut and the summaries rebuilt."""
    from longpatch.methods.common import window_summaries

    k = torch.randn(1, 2, 200, 4)

    def summarize(kk, _):
        return (kk.unflatten(2, (-1, 8)).sum(3),)

    state: dict = {}
    first = window_summaries(state, ("sums",), k[:, :, :100], None, 8, 8, summarize)[0]
    before = first.clone()
    grown = window_summaries(state, ("sums",), k[:, :, :130], None, 8, 8, summarize)[0]
    assert grown.data_ptr() == first.data_ptr()  # appended in place
    torch.testing.assert_close(grown, summarize(k[:, :, :128], None)[0], rtol=0, atol=0)
    k2 = k.clone()
    k2[:, :, 50:] += 1  # another cache from position 50: rebuilt, in new buffers
    again = window_summaries(state, ("sums",), k2[:, :, :130], None, 8, 8, summarize)[0]
    torch.testing.assert_close(again, summarize(k2[:, :, :128], None)[0], rtol=0, atol=0)
    torch.testing.assert_close(first, before, rtol=0, atol=0)


# --------------------------------------------------------------------------- transformers' StaticCache

_STATIC_CONFIGS = {
    "moba-hybrid": {"method": "moba", "params": {"chunk_size": 32, "topk": 4, "selection": "hybrid", "mass": 0.9,
                                                 "estimate_queries": 16, "score_stride": 16, "decode_topk": 2,
                                                 "decode_page": 4}, "layers": "all"},
    "moba": {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": "all"},
    "nsa-hybrid": {"method": "nsa", "params": {"compress_block": 16, "compress_stride": 8, "select_block": 32,
                                               "num_selected": 4, "window": 32, "selection": "hybrid", "mass": 0.9,
                                               "estimate_queries": 16, "score_stride": 16}, "layers": "all"},
    "sparse": {"method": "sparse", "layers": "all"},
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(_STATIC_CONFIGS))
def test_generation_with_a_static_cache_equals_the_dynamic_cache(name, attn, one_thread):
    """transformers' StaticCache hands every call its whole preallocated buffer: the columns after the
    tokens written so far are empty, and the first call may come without a mask (SDPA's top-left causal
    mask is right there). A patched layer reads where its queries sit from the mask (or its absence) and
    attends to the written keys only: generate gives the dynamic cache's tokens, also for a left-padded
    batch. (Before, the queries were taken as the buffer's last rows: empty keys and future ones were
    read, and the tokens went wrong without a word.)"""
    model = tiny_model("llama", attn_implementation=attn).eval()
    patch_model(model, {**_STATIC_CONFIGS[name], "min_seq_len": 0})
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 200, (2, 200), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # the second row left-padded
    for kw in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
        with torch.no_grad():
            dyn = model.generate(**kw, max_new_tokens=8, do_sample=False)
            static = model.generate(**kw, max_new_tokens=8, do_sample=False, cache_implementation="static")
        assert torch.equal(static, dyn)
    counts = model.longpatch.breakdown()["patched"]
    assert counts["prefill"]["method"]["calls"] > 0 and counts["decode"]["method"]["calls"] > 0


def test_generate_auto_compiles_a_patched_models_static_cache_steps_only_where_graph_safe():
    """generate() compiles the steps of a static cache (on a GPU; here forced with the compile config's
    all-devices switch): patching keeps that only where every patched step is graph-safe (MoBA's gate is
    not; its query-aware selections are), on the model and not in its generation config (which
    save_pretrained writes), and unpatching restores it."""
    from transformers.cache_utils import StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    from longpatch import unpatch_model

    model = tiny_model("llama")
    before = model.generation_config.disable_compile
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True
    static = StaticCache(config=model.config, max_cache_len=64)
    kwargs = {"cache": static, "past_key_values": static}  # the cache argument's name in newer and older transformers

    def auto_compiles() -> bool:
        gen = copy.deepcopy(model.generation_config)
        gen.compile_config = compile_config
        return model._valid_auto_compile_criteria(kwargs, gen)

    assert auto_compiles()
    patch_model(model, {"method": "moba", "params": {"chunk_size": 32, "topk": 2}, "layers": "all"})
    assert model.generation_config.disable_compile == before and not auto_compiles()
    unpatch_model(model)
    assert model.generation_config.disable_compile == before and auto_compiles()
    patch_model(model, {"method": "moba", "params": {"chunk_size": 32, "topk": 3, "selection": "hybrid",
                                                      "estimate_queries": 16, "score_stride": 8}, "layers": "all"})
    assert auto_compiles()
    unpatch_model(model)
