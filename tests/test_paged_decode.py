"""The graph-safe decode step (methods/paged.py): its attention over a block list against a dense
definition, its bounds and selection against the eager step's (the same output, step after step, for
MoBA and NSA), no graph break under torch.compile(fullgraph=True), and a patched tiny Llama whose
static-cache generate (eager and compiled with fullgraph=True) gives the dynamic cache's tokens and logits."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import longpatch
from longpatch.families.hf import _static_extent, graph_safe
from longpatch.methods import get_method
from longpatch.methods.moba.op import moba_attention
from longpatch.methods.nsa.op import nsa_attention
from longpatch.methods.paged import PagedState, paged_attention_torch, select_blocks, step, write_bounds_
from longpatch.methods.sparse import sparse_attention

pytestmark = pytest.mark.usefixtures("one_thread")

MOBA = {"chunk_size": 16, "topk": 4, "selection": "hybrid", "estimate_queries": 8, "score_stride": 4,
        "local_blocks": 1, "decode_topk": 2, "decode_page": 4}
SPARSE = {"window": 40, "global_tokens": 20}  # a window over 2-3 of the step's blocks of 64, sinks in one
NSA = {"compress_block": 16, "compress_stride": 8, "select_block": 16, "num_selected": 4, "window": 24,
       "init_blocks": 1, "local_blocks": 2, "gates": [0.0, 0.9, 0.1], "selection": "hybrid", "estimate_queries": 8,
       "score_stride": 4, "decode_topk": 2, "decode_page": 4}


def _dense(q, k, v, visible, scale):
    """One query per head over the keys ``visible`` [b, hk, n] marks, densely."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    s = torch.einsum("bhgd,bhnd->bhgn", q.reshape(b, hk, hq // hk, d).double(), k.double()) * scale
    s = s.masked_fill(~visible.unsqueeze(2), float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v.double()).reshape(b, hq, 1, d)


@pytest.mark.parametrize("hq, hk", [(4, 2), (3, 1), (8, 8)])
def test_attention_over_a_block_list_equals_the_dense_definition(hq, hk):
    g = torch.Generator().manual_seed(1)
    b, cap, d, block = 2, 96, 8, 16
    q, k, v = torch.randn(b, hq, 1, d, generator=g), torch.randn(b, hk, cap, d, generator=g), \
        torch.randn(b, hk, cap, d, generator=g)
    blocks = torch.tensor([[[3, -1, 0, 5], [1, 2, -1, -1]]] * b, dtype=torch.int32)[:, :hk]
    if hk > 2:
        blocks = torch.randint(-1, 6, (b, hk, 3), generator=g).sort(-1).values
        blocks[..., 1:] = blocks[..., 1:].masked_fill(blocks[..., 1:] == blocks[..., :-1], -1)
    length, start = torch.tensor([90, 53]), torch.tensor([0, 20])  # ragged; row 1 left-padded by 20 keys
    pos = torch.arange(cap)
    listed = ((blocks.clamp(min=0).long().unsqueeze(-1) == (pos // block)) & (blocks >= 0).unsqueeze(-1)).any(2)
    visible = listed & (pos < length.view(b, 1, 1)) & (pos >= start.view(b, 1, 1))
    out, lse = paged_attention_torch(q, k, v, blocks.to(torch.int32), length, block, d ** -0.5, start)
    seen = visible.any(-1)  # [b, hk]: a head with no visible key gets zeros and lse -inf
    ref = torch.nan_to_num(_dense(q, k, v, visible, d ** -0.5))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert torch.equal(torch.isfinite(lse).view(b, hk, -1).all(-1), seen)


def test_bounds_are_written_in_place_for_the_new_key_only():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 64, 4, generator=g)
    state = PagedState(k, torch.full((1, 2, 1), -1), block=16, page=4)
    state.fill_bounds(k, 21)  # pages 0..4 full, page 5 holds key 20
    mins, maxs = state.mins.clone(), state.maxs.clone()
    torch.testing.assert_close(mins[:, :, 5], k[:, :, 20])
    write_bounds_(state, k, torch.tensor([22]))  # key 21 lands in page 5: widened
    torch.testing.assert_close(state.mins[:, :, 5], k[:, :, 20:22].amin(2))
    torch.testing.assert_close(state.maxs[:, :, 5], k[:, :, 20:22].amax(2))
    write_bounds_(state, k, torch.tensor([25]))  # key 24 opens page 6: reset to it
    torch.testing.assert_close(state.mins[:, :, 6], k[:, :, 24])
    others = [p for p in range(state.mins.shape[2]) if p not in (5, 6)]
    assert torch.equal(state.mins[:, :, others], mins[:, :, others])
    assert torch.equal(state.maxs[:, :, others], maxs[:, :, others])


def test_selection_lists_each_block_once_and_never_the_future():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 160, 8, generator=g)
    kept = torch.tensor([[[0, 3, 8], [0, 8, -1]], [[0, 1, -1], [2, 9, 4]]])
    state = PagedState(k, kept, block=16, page=4)
    state.fill_bounds(k, 150)
    length = torch.tensor([150, 70])
    lists = select_blocks(torch.randn(2, 4, 1, 8, generator=g), state, length, decode_topk=3, local_blocks=1)
    for row in range(2):
        own = (int(length[row]) - 1) // 16
        for ids in lists[row].tolist():
            real = [i for i in ids if i >= 0]
            assert len(real) == len(set(real)) and max(real) == own and own - 1 in real
            assert all(i <= own for i in real)
    assert 9 not in lists[1, 1].tolist()  # kept block 9 lies past row 1's own block (4)


def _steps(op, params, spec, b=2, hq=4, hk=2, d=16, n=150, cap=192, steps=24, compiled=False):
    """The eager decode step (the op on the cache so far) and the graph-safe step on the buffer, step by
    step after a prefill of n tokens: the largest difference of their outputs."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(b, h, cap, d, generator=g) for h in (hq, hk, hk))
    state = {}
    op(q[:, :, :n], k[:, :, :n], v[:, :, :n], state=state, **params)
    kb, vb = torch.zeros_like(k), torch.zeros_like(v)
    kb[:, :, :n], vb[:, :, :n] = k[:, :, :n], v[:, :, :n]
    paged = PagedState.for_spec(spec, kb, state.get("kept"), n)
    fn = step
    if compiled:
        fn = torch.compile(step, fullgraph=True, backend="eager", dynamic=False)
    worst = 0.0
    for t in range(n, n + steps):
        kb[:, :, t], vb[:, :, t] = k[:, :, t], v[:, :, t]
        ref = op(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state=state, **params)
        out = fn(spec, q[:, :, t:t + 1], kb, vb, paged, torch.full((b,), t + 1), d ** -0.5)
        worst = max(worst, (out - ref).abs().max().item())
    return worst


def _nsa_op(q, k, v, state, gates, **params):
    return nsa_attention(q, k, v, gates=tuple(gates), state=state, **params)


def _sparse_op(q, k, v, state, **params):
    return sparse_attention(q, k, v, **params)


OPS = {"moba": (moba_attention, MOBA), "nsa": (_nsa_op, NSA), "sparse": (_sparse_op, SPARSE)}


@pytest.mark.parametrize("name", ["moba", "nsa", "sparse"])
def test_the_step_equals_the_eager_step(name):
    op, params = OPS[name]
    spec = get_method(name).bind(params, 16).step_spec(150)
    assert spec is not None
    assert _steps(op, params, spec) < 1e-5


def test_the_step_compiles_without_a_graph_break():
    spec = get_method("moba").bind(MOBA, 16).step_spec(150)
    assert _steps(moba_attention, MOBA, spec, steps=6, compiled=True) < 1e-5


def test_which_params_have_a_graph_safe_step():
    moba, nsa = get_method("moba"), get_method("nsa")
    assert moba.bind({"chunk_size": 16, "topk": 3}, 16).step_spec(1000) is None  # the gate reads every chunk mean
    sparse = get_method("sparse")
    assert sparse.bind({"dilation": 2}, 16).step_spec(1000) is None  # a dilated window: no few runs of blocks
    assert sparse.bind({"random_blocks": 1}, 16).step_spec(1000) is None
    assert not sparse.bind({}, 16).step_spec(1000).ranked
    assert nsa.bind({}, 16).step_spec(100_000) is None  # the compressed selection
    assert nsa.bind(NSA, 16).step_spec(20) is None  # a prefill shorter than the sizes: the eager step
    spec = nsa.bind(NSA, 16).step_spec(200)
    assert (spec.block, spec.page, spec.local_blocks, spec.window, spec.gates) == (16, 4, 1, 24, (0.9, 0.1))


def test_static_extent_from_the_mask_and_the_positions():
    vis = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
    vis[0, ..., :7] = True
    vis[1, ..., 3:9] = True  # left-padded by 3 keys
    length, start = _static_extent(vis, {}, 2)
    assert length.tolist() == [7, 9] and start.tolist() == [0, 3]
    length, start = _static_extent(None, {"position_ids": torch.tensor([[11], [11]])}, 2)
    assert length.tolist() == [12, 12] and start is None
    assert _static_extent(torch.zeros(2, 1, 1, 10), {}, 2) is None  # a float mask: not read


def _llama(config: dict):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    longpatch.patch_model(model, config)
    return model


@pytest.mark.parametrize("method, params", [("moba", {**MOBA, "topk": 3}), ("nsa", NSA), ("sparse", SPARSE)])
def test_static_cache_generate_eager_and_compiled_give_the_dynamic_cache_tokens(method, params):
    model = _llama({"method": method, "params": params, "layers": "all"})
    route = model.longpatch.routes[0]
    ids = torch.randint(1, 100, (2, 100), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
              return_dict_in_generate=True, output_logits=True)
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert route.paged is not None  # fullgraph=True below fails unless every patched step takes it
    compile_config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    compile_config._compile_all_devices = True  # transformers auto-compiles on accelerators only
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kw)
    for run in (static, compiled):
        assert torch.equal(run.sequences, dynamic.sequences)
        for a, b in zip(run.logits, dynamic.logits):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_auto_compile_only_where_every_patched_step_is_graph_safe():
    safe = _llama({"method": "moba", "params": {**MOBA, "topk": 3}, "layers": "all"})
    gate = _llama({"method": "moba", "params": {"chunk_size": 16, "topk": 3}, "layers": "all"})
    from longpatch.routing import LayerRoute
    assert graph_safe([LayerRoute(0, get_method("moba"), {**MOBA, "topk": 3})])
    assert not graph_safe([LayerRoute(0, get_method("moba"), {"chunk_size": 16, "topk": 3})])
    assert safe._valid_auto_compile_criteria.graph_safe and not gate._valid_auto_compile_criteria.graph_safe


@pytest.mark.parametrize("method, params", [("moba", {**MOBA, "topk": 3}), ("nsa", NSA)])
def test_a_chunked_prefill_into_a_static_cache_builds_the_step_after_every_chunk(method, params):
    """generate(prefill_chunk_size=...) on a static cache: each chunk runs the selection, the step state is built
    again after each one (from all the keys written so far and the last chunk's lists), and the compiled steps
    give the tokens and logits of the same chunked prefill on a dynamic cache."""
    model = _llama({"method": method, "params": params, "layers": "all"})
    route = model.longpatch.routes[0]
    ids = torch.randint(1, 100, (1, 112), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids),
              return_dict_in_generate=True, output_logits=True, prefill_chunk_size=32)
    from transformers import DynamicCache
    dynamic = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    model.longpatch.reset_stats()
    compile_config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    compile_config._compile_all_devices = True
    built = []
    prepare = route.prepare_step
    route.prepare_step = lambda key, n, rows: (built.append(n), prepare(key, n, rows))
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kw)
    assert built == [32, 64, 96, 112] and route.paged is not None  # built again after every chunk
    prefill = model.longpatch.breakdown()["patched"]["prefill"]
    assert prefill["method"]["calls"] >= 2 * 3  # the chunks after the first ran the method in both layers
    assert torch.equal(compiled.sequences, dynamic.sequences)
    for a, b in zip(compiled.logits, dynamic.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_half_precision_bounds_rank_as_float32_ones():
    # bf16 bounds are multiplied as they are (no float32 copy): the best-bounded blocks stay those of the
    # float32 bounds where they stand apart (a key matching the query lifts its block's bound)
    from longpatch.methods.selection import bound_blocks, page_minmax
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 32, generator=g)
    k = torch.randn(1, 2, 1024, 32, generator=g)
    for h, pos in ((0, 700), (1, 130)):
        k[0, h, pos] = 4 * q[0, 2 * h].squeeze(0)  # a needle for each KV group
    mins, maxs = page_minmax(k, 4)
    full = bound_blocks(q, mins, maxs, 3, pages=16)
    half = bound_blocks(q.bfloat16(), mins.bfloat16(), maxs.bfloat16(), 3, pages=16)
    assert half.shape == full.shape
    assert half[0, 0, 0] == 700 // 64 and half[0, 1, 0] == 130 // 64
    assert torch.equal(half.sort(-1).values, full.sort(-1).values)


QUEST = {"decode_prefill": False, "final_topk": 3}  # a step without the prefill's list (Quest's step)


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_step_without_the_prefill_list_equals_the_eager_step(name):
    op, params = OPS[name]
    params = {**params, **QUEST}
    spec = get_method(name).bind(params, 16).step_spec(150)
    assert _steps(op, params, spec) < 1e-5
