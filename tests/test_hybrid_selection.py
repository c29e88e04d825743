"""Selection "hybrid" (selection.py: per query block its own antidiagonal blocks and the blocks the
prompt's last queries read): its block lists against a loop written from the definition on a dense
attention matrix (small n), causality through both methods' ops, the estimate's cost, and one-line
errors for a bad selection name or budget."""
import math

import pytest
import torch
from test_blocksparse import qkv

from longpatch.errors import ConfigError
from longpatch.methods import get_method
from longpatch.methods.selection import (
    antidiagonal_scores,
    estimate_cost,
    estimated_blocks,
    estimated_pairs,
    hybrid_blocks,
    score_blocks,
)
from longpatch.ops import moba_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _greedy(order, value, total, mass, forced, cap):
    """The fewest blocks in ``order`` (forced first) whose value, with what is counted before, reaches
    mass x total; every forced block; at most cap."""
    out, got = [], 0.0
    for j in order:
        if len(out) == cap:
            break
        if j in forced or mass is None or got < mass * total:
            out.append(j)
            got += value[j]
    return out


def _hybrid_reference(q, k, block, cap, mass, m, stride, local, scale, sink=1, share=None):
    """{(head, query block): set of past blocks} from the definition: the vertical from the dense
    causal attention matrix's last m rows (pooled per key block, mean and peak over the group's rows),
    the own list from the antidiagonal scores (tested against their own definition in
    test_blocksparse.py), the two lists merged by their places, forced blocks first."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    nb = math.ceil(n / block)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(g, 1)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)[0, :, n - m:]  # [hq, m, n]
    pooled = torch.stack([p[..., j * block:(j + 1) * block].sum(-1) for j in range(nb)], -1)  # [hq, m, nb]
    anti = antidiagonal_scores(q, k, block, stride, scale)[0]
    out = {}
    for h in range(hk):
        rows = pooled[h * g:(h + 1) * g].reshape(-1, nb)
        mean, peak = rows.mean(0), rows.amax(0)
        for i in range(1, nb):
            forced = {j for j in range(i) if j < sink or j >= i - local}
            a = anti[h, i]
            row_cap = cap if share is None else max(cap, math.ceil(share * i))  # the ceiling of max_share
            own = _greedy(sorted(forced, key=lambda j: -a[j]) + sorted(set(range(i)) - forced, key=lambda j: -a[j]),
                          a.tolist(), float(a[:i].sum()), mass, forced, row_cap)
            # the end's list: the fewest blocks in (mean + peak) / 2 order reaching mass of the whole
            # vertical (it sums to 1), those before block i
            vorder = sorted(range(nb), key=lambda j: -float(mean[j] + peak[j]))
            vkeep = _greedy(vorder, mean.tolist(), float(mean.sum()), mass, set(), nb)
            end = [j for j in vkeep if j < i]
            place = {}
            for lst in (own, end):  # places among the unforced blocks of each list
                for t, j in enumerate([j for j in lst if j not in forced]):
                    place[j] = min(place.get(j, t), t)
            for j in forced:
                place[j] = -1
            merged = sorted(place, key=lambda j: (place[j], -a[j]))[:min(row_cap, nb - 1)]
            out[(h, i)] = set(merged)
    return out


@pytest.mark.parametrize("n,mass,hq,hk", [(96, 0.8, 4, 2), (75, 0.6, 2, 2), (128, None, 4, 1), (128, 0.95, 4, 2)])
def test_hybrid_blocks_equal_their_definition(n, mass, hq, hk):
    q, k, _ = qkv(n, hq, hk, seed=n)
    block, cap, m, stride = 16, 3, 8, 4
    got = hybrid_blocks(q, k, block, cap, mass, m, stride, 1, 0.25)
    ref = _hybrid_reference(q, k, block, cap, mass, m, stride, 1, 0.25)
    nb = math.ceil(n / block)
    assert got.shape == (1, hk, nb, min(cap, nb - 1))
    for (h, i), want in ref.items():
        row = [j for j in got[0, h, i].tolist() if j >= 0]
        assert len(row) == len(set(row)) and set(row) == want, (h, i, row, want)
        assert all(j < i for j in row)  # causal: past blocks only
    assert (got[0, :, 0] == -1).all()  # the first block has no past


def test_hybrid_keeps_a_needle_and_what_the_middle_reads():
    """The end's queries read block 2 (a needle), block 5's queries read block 3: the hybrid gives
    the last query block block 2 and query block 5 block 3, where each single selection misses one."""
    n, d, block = 128, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.1 for _ in range(2))
    e = torch.eye(d, dtype=torch.float64)
    k[0, 0, 37], q[0, 0, 124:128] = 4 * e[0], 4 * e[0]  # one needle key; only the last 4 queries read it
    q[0, 0, 80:96], k[0, 0, 48:64] = 3 * e[1], 3 * e[1]
    blocks = estimated_blocks(q, k, block, 4, None, ("hybrid", 4, 4), 1, 1.0)  # sink, local, one of each
    assert 2 in blocks[0, 0, 7].tolist()
    assert 3 in blocks[0, 0, 5].tolist()
    # with one free slot, the last queries' estimate gives block 5 the needle's block, not its own read
    assert estimated_blocks(q, k, block, 3, None, ("estimate", 4), 1, 1.0)[0, 0, 5].tolist() == [0, 4, 2]


def test_hybrid_estimate_cost_is_the_antidiagonal_and_the_last_rows():
    n, m, stride = 100, 8, 4
    nt = math.ceil(n / stride)
    anti = 4 * stride * nt * (nt - 1) // 2
    last = 4 * sum(range(n - m + 1, n + 1))
    assert estimate_cost(1, 4, n, ("hybrid", m, stride)) == anti + last
    q, k, _ = qkv(n)
    blocks = estimated_blocks(q, k, 16, 3, 0.8, ("hybrid", m, stride), 1, 0.25)
    attended = estimated_pairs(q, k, 16, 3, 0.8, ("hybrid", m, stride), 1, 0.25) - (anti + last)
    assert 0 < attended <= 4 * n * (n + 1) // 2 and (blocks >= 0).any()
    with pytest.raises(ValueError, match="no single score matrix"):
        score_blocks(q, k, 16, ("hybrid", m, stride), 0.25)


def test_bad_selection_names_and_budgets_are_one_line_errors():
    q, k, v = qkv(32)
    for method, extra in (("moba", {}), ("nsa", {"gates": [0.0, 0.9, 0.1]})):
        cases = [({"selection": "hybird"}, "params.selection of method"),
                 ({"selection": "hybrid", "mass": 1.5}, r"params.mass of method .*\(0, 1\]"),
                 ({"selection": "hybrid", "mass": 0.0}, "params.mass of method"),
                 ({"selection": "hybrid", "score_stride": 7}, "params.score_stride of method"),
                 ({"selection": "hybrid", "estimate_queries": 0}, "params.estimate_queries of method")]
        for given, msg in cases:
            with pytest.raises(ConfigError, match=msg) as e:
                get_method(method).resolve_params({**extra, **given})
            assert "\n" not in str(e.value)
        assert get_method(method).resolve_params({**extra, "selection": "hybrid", "mass": 0.9})["selection"] == "hybrid"
    with pytest.raises(ValueError, match="estimate_queries"):
        moba_attention(q, k, v, chunk_size=8, topk=2, selection="hybrid", estimate_queries=0)
    with pytest.raises(ValueError, match="score_stride must divide the block size 8; got 3"):
        moba_attention(q, k, v, chunk_size=8, topk=2, selection="hybrid", score_stride=3)


@pytest.mark.parametrize("alias", ["demo-moba-32k", "demo-nsa-32k", "llama-3.1-8b-moba-hybrid",
                                   "chatglm2-6b-32k-moba-hybrid"])
def test_bundled_hybrid_configs_resolve(alias):
    """The bundled configs of the hybrid selection load and pass their method's param checks; the demo's
    keep layer 1 exact (its attention spreads on text that copies from far back, docs/demo.md)."""
    from longpatch.config import read_config

    cfg = read_config(alias).patch
    params = get_method(cfg.method).resolve_params(dict(cfg.params))
    assert params["selection"] == "hybrid" and params["mass"] == 0.9
    assert cfg.layers == ([0, 2, 3] if alias.startswith("demo") else "all")


def test_nsa_window_gated_off_is_not_computed(monkeypatch):
    """gates (0, 1, 0): the selected branch alone, equal to the gated sum with the window computed
    (out(0, 1, w) - w * out(0, 0, 1)), without running the window (prefill and a one-token step)."""
    from longpatch.methods import sparse
    from longpatch.methods.nsa import op as nsa_op
    from longpatch.ops import nsa_attention

    q, k, v = qkv(200)
    kw = dict(selection="hybrid", select_block=16, num_selected=4, window=24, local_blocks=2, score_stride=4)
    both = nsa_attention(q, k, v, gates=(0.0, 1.0, 0.5), **kw)
    window = nsa_attention(q, k, v, gates=(0.0, 0.0, 1.0), **kw)
    step_both = nsa_attention(q[:, :, -1:], k, v, gates=(0.0, 1.0, 0.5), **kw)
    step_window = nsa_attention(q[:, :, -1:], k, v, gates=(0.0, 0.0, 1.0), **kw)

    def refuse(*a, **k_):
        raise AssertionError("the window branch ran")

    monkeypatch.setattr(sparse, "band_attention", refuse)
    monkeypatch.setattr(nsa_op, "attend", refuse)
    torch.testing.assert_close(nsa_attention(q, k, v, gates=(0.0, 1.0, 0.0), **kw), both - 0.5 * window)
    torch.testing.assert_close(nsa_attention(q[:, :, -1:], k, v, gates=(0.0, 1.0, 0.0), **kw),
                               step_both - 0.5 * step_window)


@pytest.mark.parametrize("selection", ["antidiagonal", "hybrid"])
def test_nsa_strided_selection_on_an_input_shorter_than_one_block(selection):
    """An input shorter than select_block is one block (NSA fits the block to it): the score tiles are
    fitted too, where a fitted block of 31 keys failed the stride check (`demo-nsa-32k` on any prompt under
    256 tokens). The selected branch is then causal attention over every key, beside the window; a
    one-token step runs as well."""
    from helpers import dense_attention

    from longpatch.ops import nsa_attention

    n = 30
    q, k, v = qkv(n)
    kw = dict(selection=selection, select_block=64, num_selected=4, window=8, score_stride=16,
              gates=(0.0, 0.75, 0.25), **({"estimate_queries": 8} if selection == "hybrid" else {}))
    state = {}
    out = nsa_attention(q, k, v, state=state, **kw)
    pos = torch.arange(n)
    band = (pos.view(1, -1) <= pos.view(-1, 1)) & (pos.view(1, -1) > pos.view(-1, 1) - 8)
    win = dense_attention(q, k, v, causal=False, mask=band.expand(1, 4, n, n))[0]
    full = dense_attention(q, k, v, causal=True)[0]
    torch.testing.assert_close(out, 0.75 * full + 0.25 * win, atol=1e-12, rtol=1e-10)
    step = nsa_attention(q[:, :, -1:], k, v, state=state, **kw)
    torch.testing.assert_close(step, out[:, :, -1:], atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------ the antidiagonal's int8 products
def _both_products(monkeypatch, fn):
    """fn() with the antidiagonal's products in int8 (counting the int8 calls), then in float32."""
    from longpatch.methods import selection

    calls = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda *a, **kw: calls.append(1) or int_mm(*a, **kw))
    monkeypatch.setattr(selection, "INT8_PRODUCTS", True)  # whatever this CPU would choose
    got = fn()
    monkeypatch.setattr(selection, "INT8_PRODUCTS", False)
    want = fn()
    assert calls, "the int8 path did not run"
    return got, want


@pytest.mark.parametrize("n,b", [(256, 1), (250, 2)])  # whole tiles; a partial last tile and a batch
def test_int8_antidiagonal_scores_are_within_their_rounding_of_float32(n, b, monkeypatch):
    """Float32 inputs on a CPU take int8 products (each tile row rounded with its own scale): every
    score within 0.01 of the float32 products' (scores are masses: each row sums to 1), the same
    causal pattern, the same rows at 0."""
    q, k, _ = qkv(n, 4, 2, dtype=torch.float32, seed=n)
    q, k = q.repeat(b, 1, 1, 1), k.repeat(b, 1, 1, 1)
    q[b - 1] *= 3.0  # another scale in the second batch item: scales are per row
    got, want = _both_products(monkeypatch, lambda: antidiagonal_scores(q, k, 32, 4, 0.25))
    assert torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert float((got[fin] - want[fin]).abs().max()) < 0.01
    torch.testing.assert_close(got.clamp(min=0).sum(-1), want.clamp(min=0).sum(-1), atol=1e-5, rtol=0)


def test_int8_products_keep_the_lists_where_blocks_stand_apart(monkeypatch):
    """Where the blocks a query block reads stand apart from the rest (keys planted to match its
    queries), the int8 products choose the lists the float32 products choose."""
    n, block, d = 512, 32, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, n, d, generator=g)
    k = torch.randn(1, 2, n, d, generator=g)
    for i in range(2, n // block):  # query block i reads block i // 2 strongly
        j = i // 2
        k[:, :, j * block:(j + 1) * block] += 0.6 * q[:, ::2, i * block:(i + 1) * block].mean(2, keepdim=True)
    got, want = _both_products(monkeypatch, lambda: estimated_blocks(q, k, block, 6, 0.9, ("hybrid", 16, 4), 1,
                                                                      0.25))
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_int8_antidiagonal_scores_are_causal(monkeypatch):
    """Changing the keys of the last blocks leaves every earlier query block's int8 scores as they
    were, bit for bit (each key tile row has its own scale: no key moves another's rounding)."""
    from longpatch.methods import selection

    monkeypatch.setattr(selection, "INT8_PRODUCTS", True)
    q, k, _ = qkv(256, 4, 2, dtype=torch.float32, seed=5)
    before = antidiagonal_scores(q, k, 32, 4, 0.25)
    k2 = k.clone()
    k2[:, :, 192:] = torch.randn(1, 2, 64, 16) * 5
    after = antidiagonal_scores(q, k2, 32, 4, 0.25)
    assert torch.equal(before[:, :, :6], after[:, :, :6])
    assert not torch.equal(before[:, :, 7], after[:, :, 7])  # the changed keys are read after them


@pytest.mark.parametrize("flags, fast", [("fpu avx2 fma", False), ("fpu avx2 avx512f avx512_vnni", True),
                                         ("fpu avx2 avx_vnni", True), (None, False)])
def test_int8_products_only_where_the_cpu_multiplies_int8_fast(flags, fast, monkeypatch, tmp_path):
    """By default the int8 products run only on a CPU with VNNI/AMX (without, torch's _int_mm is tens
    of times slower than float32's products); INT8_PRODUCTS True/False overrides the CPU's flags."""
    from longpatch.methods import selection

    info = tmp_path / "cpuinfo"
    if flags is not None:  # None: no such file (not Linux)
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: x\n")
    monkeypatch.setattr(selection, "CPUINFO", info)
    assert selection.cpu_int8_fast.__wrapped__() is fast
    monkeypatch.setattr(selection, "cpu_int8_fast", lambda: fast)
    monkeypatch.setattr(selection, "int8_products_setting", lambda: None)  # the environment says "auto"
    x = torch.zeros(2, 2)
    assert selection._int8_applies(x) is fast
    for forced in (True, False):
        monkeypatch.setattr(selection, "INT8_PRODUCTS", forced)
        assert selection._int8_applies(x) is forced


@pytest.mark.parametrize("value, forced", [(None, None), ("auto", None), ("on", True), ("1", True),
                                           ("OFF", False), ("0", False)])
def test_the_environment_chooses_the_int8_path_whatever_the_cpu(value, forced, monkeypatch):
    """LONGPATCH_INT8_PRODUCTS pins the products' path (CI runs the suite at "on" and at "off", so both
    paths are tested on every CPU); INT8_PRODUCTS, where a test sets it, wins over the environment."""
    from longpatch.methods import selection

    if value is None:
        monkeypatch.delenv(selection.INT8_PRODUCTS_ENV, raising=False)
    else:
        monkeypatch.setenv(selection.INT8_PRODUCTS_ENV, value)
    assert selection.int8_products_setting.__wrapped__() is forced
    monkeypatch.setattr(selection, "int8_products_setting", selection.int8_products_setting.__wrapped__)
    monkeypatch.setattr(selection, "INT8_PRODUCTS", None)
    x = torch.zeros(2, 2)
    for cpu in (True, False):
        monkeypatch.setattr(selection, "cpu_int8_fast", lambda cpu=cpu: cpu)
        assert selection._int8_applies(x) is (cpu if forced is None else forced)
    monkeypatch.setattr(selection, "INT8_PRODUCTS", not forced)
    assert selection._int8_applies(x) is (not forced)


def test_a_bad_int8_setting_is_one_line(monkeypatch):
    from longpatch.errors import ConfigError
    from longpatch.methods import selection

    monkeypatch.setenv(selection.INT8_PRODUCTS_ENV, "yes please")
    with pytest.raises(ConfigError, match=r"LONGPATCH_INT8_PRODUCTS='yes please': allowed values are auto, on, off"):
        selection.int8_products_setting.__wrapped__()


@pytest.mark.parametrize("n,mass,share", [(160, 0.8, 0.5), (150, 0.95, 1.0), (160, 0.6, 0.25)])
def test_hybrid_blocks_under_a_ceiling_equal_their_definition(n, mass, share):
    q, k, _ = qkv(n, 4, 2, seed=n + 1)
    block, cap, m, stride = 16, 3, 8, 4
    got = hybrid_blocks(q, k, block, cap, mass, m, stride, 1, 0.25, max_share=share)
    ref = _hybrid_reference(q, k, block, cap, mass, m, stride, 1, 0.25, share=share)
    nb = math.ceil(n / block)
    assert got.shape == (1, 2, nb, max(cap, math.ceil(share * (nb - 1))))
    for (h, i), want in ref.items():
        row = [j for j in got[0, h, i].tolist() if j >= 0]
        assert len(row) == len(set(row)) and set(row) == want, (h, i, row, want)


def test_the_moba_op_attends_the_lists_under_its_ceiling():
    """moba_attention with max_share attends exactly the lists ``estimated_blocks`` gives under the
    ceiling (past blocks only), and they hold more blocks than the fixed cap where the mass spreads."""
    from test_blocksparse import masked_reference

    n, block = 640, 64
    q, k, v = qkv(n, 4, 2, seed=7)
    kw = dict(chunk_size=block, topk=3, selection="hybrid", mass=0.99, estimate_queries=8, score_stride=8,
              decode_topk=2)
    out = moba_attention(q, k, v, max_share=0.75, **kw)
    blocks = estimated_blocks(q, k, block, 2, 0.99, ("hybrid", 8, 8), 1, 0.25, final_topk=2, max_share=0.75)
    fixed = estimated_blocks(q, k, block, 2, 0.99, ("hybrid", 8, 8), 1, 0.25, final_topk=2)
    torch.testing.assert_close(out, masked_reference(q, k, v, blocks, block)[0], atol=1e-12, rtol=1e-10)
    i = torch.arange(blocks.shape[2]).view(-1, 1)
    assert bool(((blocks < i) | (blocks == -1)).all())  # past blocks only
    assert int((blocks >= 0).sum()) > int((fixed >= 0).sum())


@pytest.mark.parametrize("params, needle", [
    ({"selection": "hybrid", "max_share": 0.5}, "needs mass"),
    ({"selection": "hybrid", "mass": 0.9, "max_share": 0.0}, "max_share"),
    ({"selection": "hybrid", "mass": 0.9, "max_share": 1.5}, "max_share"),
    ({"selection": "gate", "max_share": 0.5}, "no effect with selection 'gate'"),
    ({"selection": "hybrid", "topk": 2, "local_blocks": 1}, "topk >= 3"),
])
def test_bad_ceilings_get_one_line_errors(params, needle):
    from longpatch.config import PatchConfig

    with pytest.raises(ConfigError, match=needle) as e:
        PatchConfig(method="moba", params=params)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="max_share needs mass"):
        q, k, v = qkv(64, 2, 2)
        moba_attention(q, k, v, chunk_size=16, topk=3, selection="hybrid", max_share=0.5)


def test_attended_share_per_layer_follows_the_selection():
    """model.longpatch.attended_share(): per patched layer, the products its executor attended over
    exact attention's (a causal prefill's n (n + 1) / 2 per query head); a ceiling lets more in."""
    from longpatch import patch_model, unpatch_model
    from longpatch.testing.tiny import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 512))
    params = {"chunk_size": 32, "topk": 3, "selection": "hybrid", "mass": 0.99, "estimate_queries": 8,
              "score_stride": 8}
    shares = []
    for extra in ({}, {"max_share": 1.0}):
        patch_model(model, {"method": "moba", "params": {**params, **extra}, "layers": 2})
        with torch.no_grad():
            model(ids)
        work, share = model.longpatch.layer_work(), model.longpatch.attended_share()
        unpatch_model(model)
        assert sorted(share) == [2, 3]  # the patched layers
        for i, w in work.items():
            assert w["dense_pairs"] == 4 * 512 * 513 // 2  # 4 query heads
            assert share[i] == w["attended_pairs"] / w["dense_pairs"] and 0 < share[i] <= 1
        shares.append(share)
    assert all(shares[1][i] >= shares[0][i] for i in (2, 3)) and shares[1] != shares[0]
