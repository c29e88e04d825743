"""The method contract, held by every registered method (a newly registered one is covered without a
line here) on tiny models of the families: decode equals prefill, the params a method declares
exact (``Method.exact_params``) reproduce the unpatched logits, unpatching restores the state_dict,
a patched model pickles, and ``redraw_buffers`` redraws what the patch drew. See docs/methods.md."""
import copy
import io

import pytest
import torch
from helpers import logits

from longpatch import patch_model, redraw_buffers, unpatch_model
from longpatch.methods import available_methods
from longpatch.testing.tiny import BUILDERS, tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # the one cache argument both ChatGLM2's remote code and every transformers version take
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

# Every method longpatch registers (test helpers register their own probes: not part of the contract).
METHODS = sorted(name for name, m in available_methods().items() if m.prefill.__module__.startswith("longpatch."))
FAMILIES = sorted(BUILDERS)
N = 40  # tokens: several chunks/blocks of the small params below

# Small params that make each method approximate at N tokens, so decode-equals-prefill compares two
# runs of the approximation, not of exact attention. A method missing here runs with its defaults.
SMALL = {
    "hyper": {"block_size": 8, "sample_size": 8, "min_seq_len": 16, "seed": 3},
    "moba": {"chunk_size": 8, "topk": 2},
    "nsa": {"compress_block": 8, "compress_stride": 4, "select_block": 8, "num_selected": 2, "window": 8,
            "init_blocks": 1, "local_blocks": 1},
    "sparse": {"window": 6, "global_tokens": 2, "random_blocks": 1, "block": 4, "seed": 5},
    "performer": {"num_features": 16, "seed": 2},
}


def _config(name: str, exact: bool = False) -> dict:
    method = available_methods()[name]
    params = method.resolve_params(SMALL.get(name, {}))
    if exact:
        params.update(method.exact_params(N, params) or {})
    return {"method": name, "layers": "all", "params": params}


def _ids(batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, N))


def _step(model, ids, cache=None):
    """(logits, cache) of one forward with a KV cache, for HF models and ChatGLM2's tuple outputs."""
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    return (out[0], out[1]) if isinstance(out, tuple) else (out.logits, out.past_key_values)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_exact_params_reproduce_unpatched_logits(name, family):
    method = available_methods()[name]
    if method.exact_params(N, method.resolve_params(SMALL.get(name, {}))) is None:
        pytest.skip(f"{name}: no setting makes it exact (exact_params returns None)")
    model = tiny_model(family)
    ids = _ids(2)
    ref = logits(model, ids)
    patch_model(model, _config(name, exact=True))
    torch.testing.assert_close(logits(model, ids), ref, atol=1e-5, rtol=1e-5)
    stats = model.longpatch.breakdown()["patched"]["prefill"]
    assert set(stats) <= {"method", "method_exact"}  # the method's code served every call


@pytest.mark.parametrize("family", ["llama", "qwen2", "chatglm2"])
@pytest.mark.parametrize("name", METHODS)
def test_decode_equals_prefill(name, family):
    """Each decode step's logits equal one prefill of the whole sequence. A method without its own
    decode decodes with exact attention, so only its exact params make the two agree."""
    method = available_methods()[name]
    if method.decode is None and method.exact_params(N, method.resolve_params(SMALL.get(name, {}))) is None:
        pytest.skip(f"{name}: no decode and no exact params")
    model = tiny_model(family)
    ids = _ids()
    patch_model(model, _config(name, exact=method.decode is None))
    full, _ = _step(model, ids)
    start = N - 3
    out, cache = _step(model, ids[:, :start])
    steps = []
    for t in range(start, N):
        out, cache = _step(model, ids[:, t:t + 1], cache)
        steps.append(out[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, start:], atol=1e-4, rtol=1e-4)
    decode = model.longpatch.breakdown()["patched"]["decode"]
    assert ("exact" not in decode) if method.decode else (set(decode) == {"exact"})


@pytest.mark.parametrize("name", METHODS)
def test_bound_decode_equals_prefill_rows(name):
    """The op-level form of the same contract: stepwise decode through ``BoundMethod`` (state kept
    across steps, or built at once by ``init_state``) gives the prefill's rows."""
    method = available_methods()[name]
    if method.decode is None:
        pytest.skip(f"{name}: no decode (exact attention decodes)")
    bound = method.bind(SMALL.get(name, {}), head_dim=16, layer_idx=1)
    q, k, v = torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)
    ref = bound(q, k, v)
    state = {}
    for t in range(N - 4, N):
        row = bound(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], state=state)
        torch.testing.assert_close(row, ref[:, :, t:t + 1], atol=1e-5, rtol=1e-4)
    state = bound.init_state(k[:, :, :N - 1], v[:, :, :N - 1])
    assert (state is None) == (not method.stateful)
    row = bound(q[:, :, N - 1:], k, v, state=state)
    torch.testing.assert_close(row, ref[:, :, N - 1:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_unpatch_restores_the_state_dict(name, family):
    model = tiny_model(family)
    ids = _ids()
    ref = logits(model, ids)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    buffers = {k for k, _ in model.named_buffers()}
    patch_model(model, _config(name))
    logits(model, ids)  # a forward may create decode state and stats: unpatch drops them too
    assert list(model.state_dict()) == list(before)  # the method's buffers are not persistent
    added = {k for k, _ in model.named_buffers()} - buffers
    assert all(k.rsplit(".", 1)[-1].startswith("longpatch_") for k in added)
    assert len(added) == len(model.longpatch.routes) * len(model.longpatch.routes[0].buffer_names)
    unpatch_model(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(logits(model, ids), ref)


@pytest.mark.parametrize("family", ["llama", "chatglm2"])
@pytest.mark.parametrize("name", METHODS)
def test_patched_model_pickles(name, family):
    model = tiny_model(family)
    ids = _ids()
    patch_model(model, _config(name))
    want = logits(model, ids)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert other.longpatch.rows() == model.longpatch.rows()
        torch.testing.assert_close(logits(other, ids), want, atol=0, rtol=0)
        unpatch_model(other)
        assert set(other.state_dict()) == set(tiny_model(family).state_dict())


@pytest.mark.parametrize("name", METHODS)
def test_redraw_buffers_draws_what_the_patch_draws(name):
    """redraw_buffers(model, seed=s) leaves the buffers a patch with seed s draws, layer by layer;
    methods without seeded buffers have nothing to redraw."""
    method = available_methods()[name]
    model = tiny_model("llama")
    cfg = _config(name)
    patch_model(model, cfg)
    seeded = method.make_buffers is not None and "seed" in method.params
    assert redraw_buffers(model, seed=11) == (len(model.longpatch.routes) if seeded else 0)
    if not seeded:
        return
    fresh = tiny_model("llama")
    patch_model(fresh, {**cfg, "params": {**cfg["params"], "seed": 11}})
    mine, theirs = dict(model.named_buffers()), dict(fresh.named_buffers())
    keys = [k for k in mine if ".longpatch_" in k]
    assert keys and all(torch.equal(mine[k], theirs[k]) for k in keys)


def _strided(t: torch.Tensor, dim: int, how: str) -> torch.Tensor:
    """The same values as t, laid out with a non-unit stride in ``dim``: every other element of a
    twice-larger tensor ("step"), or the dimension transposed with its neighbour ("transposed")."""
    if how == "step":
        shape = list(t.shape)
        shape[dim] *= 2
        big = torch.full(shape, float("nan"), dtype=t.dtype)  # NaN in the gaps: reading one shows
        idx = [slice(None)] * t.dim()
        idx[dim] = slice(None, None, 2)
        big[tuple(idx)] = t
        return big[tuple(idx)]
    other = dim - 1 if dim == 3 else dim + 1
    return t.transpose(dim, other).contiguous().transpose(dim, other)


@pytest.mark.parametrize("name", METHODS)
def test_any_strides_give_the_contiguous_result(name):
    """q, k and v each strided in the head, sequence and feature dimensions (#28: the torch paths read
    feature-strided inputs as if contiguous)."""
    bound = available_methods()[name].bind(SMALL.get(name, {}), head_dim=16, layer_idx=1)
    qkv = [torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)]
    ref = bound(*qkv)
    for which in range(3):
        for dim in (1, 2, 3):
            for how in ("step", "transposed"):
                args = list(qkv)
                args[which] = _strided(qkv[which], dim, how)
                assert torch.equal(args[which], qkv[which]) and not args[which].is_contiguous()
                torch.testing.assert_close(bound(*args), ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, w=which, d=dim, h=how: f"{'qkv'[w]} dim {d} {h}: {m}")


@pytest.mark.parametrize("name", METHODS)
def test_integer_inputs_and_a_different_value_head_dim_are_one_line_errors(name):
    bound = available_methods()[name].bind(SMALL.get(name, {}), head_dim=16, layer_idx=1)
    q, k, v = torch.randn(1, 4, N, 16), torch.randn(1, 2, N, 16), torch.randn(1, 2, N, 16)
    with pytest.raises(ValueError, match="floating point.*int64"):
        bound(q.long(), k.long(), v.long())
    v8 = v[..., :8].contiguous()
    if name in ("exact", "linear", "performer"):  # a separate value head_dim is supported
        assert bound(q, k, v8).shape == (1, 4, N, 8)
        return
    with pytest.raises(ValueError, match="v's head_dim must equal q's and k's \\(16\\); got 8"):
        bound(q, k, v8)


# ---- ragged batches: each row equals that row alone --------------------------------------------------

LENGTHS = (N, 23, 31)  # one full row and two shorter ones: several chunks each, different boundaries


def _prompts(vocab: int) -> list[torch.Tensor]:
    return [torch.randint(0, min(vocab, 256), (n,), generator=torch.Generator().manual_seed(i))
            for i, n in enumerate(LENGTHS)]


def _rows(model, prompts, layout: str) -> list[torch.Tensor]:
    """Each prompt's logits from one forward of the batch in `layout`: left- or right-padded rows, or all
    prompts packed into one row (position ids restarting at each prompt)."""
    with torch.no_grad():
        if layout == "packed":
            ids = torch.cat(prompts)[None]
            pos = torch.cat([torch.arange(len(p)) for p in prompts])[None]
            out = model(ids, position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out.logits
            bounds = torch.tensor([0, *[len(p) for p in prompts]]).cumsum(0).tolist()
            return [out[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        n = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), n, dtype=torch.long)
        mask = torch.zeros(len(prompts), n, dtype=torch.long)
        spans = []
        for i, p in enumerate(prompts):
            a = n - len(p) if layout == "left" else 0
            ids[i, a:a + len(p)], mask[i, a:a + len(p)] = p, 1
            spans.append((a, a + len(p)))
        kwargs = {"attention_mask": mask}
        if layout == "left":  # as generate() does: a row's positions start after its padding
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(ids, **kwargs)
        out = out[0] if isinstance(out, tuple) else out.logits
        return [out[i, a:b] for i, (a, b) in enumerate(spans)]


def _left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of the prompts as one left-padded batch, as generate() takes them."""
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):], mask[i, n - len(p):] = p, 1
    return ids, mask


def _layouts(family: str) -> list[str]:
    # the ChatGLM2 stand-in, like the remote code, takes one row of positions for the whole batch:
    # right padding is its only layout whose positions match each row alone
    return ["right"] if family == "chatglm2" else ["left", "right", "packed"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", METHODS)
def test_ragged_batch_rows_equal_each_row_alone(name, family):
    model = tiny_model(family)
    patch_model(model, _config(name))
    vocab = getattr(model.config, "padded_vocab_size", None) or model.config.vocab_size
    prompts = _prompts(vocab)
    with torch.no_grad():
        alone = [(lambda o: o[0] if isinstance(o, tuple) else o.logits)(model(p[None]))[0] for p in prompts]
    for layout in _layouts(family):
        model.longpatch.reset_stats()
        for got, want in zip(_rows(model, prompts, layout), alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, layout=layout: f"{layout}: {m}")
        paths = model.longpatch.breakdown()["patched"]["prefill"]
        assert "original" not in paths and "exact" not in paths, (layout, paths)  # the method ran, per row


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", METHODS)
def test_batched_generation_equals_each_prompt_alone(name, family):
    """model.generate on a left-padded batch gives each row the tokens that prompt gives alone, through
    every method's decode path, rows finishing (eos) at different steps included."""
    model = tiny_model(family)
    patch_model(model, _config(name))
    prompts = _prompts(model.config.vocab_size)
    new = 6
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        for i, p in enumerate(prompts):
            one = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):]
            row = batch[i, ids.shape[1]:]
            assert torch.equal(row[:len(one)], one) and bool((row[len(one):] == 0).all()), (i, row, one)
    decode = model.longpatch.breakdown()["patched"]["decode"]
    assert "original" not in decode, decode


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "chatglm2"])  # its remote code keeps its own cache
@pytest.mark.parametrize("name", METHODS)
def test_static_cache_generation_equals_the_dynamic_cache(name, family):
    """model.generate with transformers' StaticCache (every call gets the whole preallocated buffer) gives
    the dynamic cache's tokens on a left-padded batch, through every method's prefill and decode."""
    model = tiny_model(family)
    patch_model(model, _config(name))
    prompts = _prompts(model.config.vocab_size)
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        runs = [model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **kw)
                for kw in ({}, {"cache_implementation": "static"})]
    assert torch.equal(runs[1], runs[0])
    paths = model.longpatch.breakdown()["patched"]
    assert "original" not in paths["prefill"] and "original" not in paths["decode"], paths


@pytest.mark.parametrize("name", METHODS)
def test_ragged_rows_ignore_nan_in_padding(name):
    """Padding positions never reach a real row, NaN and inf in padded K/V included."""
    from longpatch import ragged
    from longpatch.routing import LayerRoute

    method = available_methods()[name]
    route = LayerRoute(0, method, method.resolve_params(SMALL.get(name, {})))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, N, 8, generator=g) for _ in range(3))
    pad = 9
    for t in (q, k, v):
        t[1, :, :pad] = float("nan")
        t[1, :, 1] = float("inf")
    segments = [ragged.Segment(0, 0, N, 0, N), ragged.Segment(1, pad, N, pad, N)]
    out = route.run_ragged(segments, q, k, v, causal=True, scale=None)
    alone = LayerRoute(0, method, route.params).run("method", q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:],
                                                    causal=True, scale=None)
    assert torch.isfinite(out).all() and bool((out[1, :, :pad] == 0).all())
    torch.testing.assert_close(out[1:, :, pad:], alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["exact", "moba", "sparse"])
def test_ragged_rows_on_the_triton_backend(name):
    """The Triton kernels run each sequence of a ragged batch as its own call (under the interpreter here):
    each row equals the torch backend's row alone."""
    pytest.importorskip("triton")
    from longpatch import ragged
    from longpatch.routing import LayerRoute

    method = available_methods()[name]
    params = method.resolve_params(SMALL.get(name, {}))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=g) for _ in range(3))
    segments = [ragged.Segment(0, 0, 24, 0, 24), ragged.Segment(1, 7, 24, 7, 24)]
    out = LayerRoute(0, method, params, backend="triton").run_ragged(segments, q, k, v, causal=True, scale=None)
    for s in segments:
        alone = LayerRoute(0, method, params, backend="torch").run(
            "method", q[s.row:s.row + 1, :, s.q0:s.q1], k[s.row:s.row + 1, :, s.k0:s.k1],
            v[s.row:s.row + 1, :, s.k0:s.k1], causal=True, scale=None)
        torch.testing.assert_close(out[s.row:s.row + 1, :, s.q0:s.q1], alone, atol=2e-5, rtol=2e-5)
