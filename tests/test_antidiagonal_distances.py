"""The antidiagonal scoring samples every query-key distance (selection.py: ``antidiagonal_scores``).

Along the antidiagonal of a (query tile, key tile) pair of an even stride s, query - key is
(a - c) s + 2 i - (s - 1): always odd. Odd query tiles therefore roll their query rows by one
(q[a s + (i + 1) mod s] with k[c s + s - 1 - i]: even differences), so that a query block of two
tiles or more samples every distance. Here: the scores against a dense float64 definition (the
[n, n] score matrix, the sampled entries picked out), a planted copy line (every query reads the key
a fixed distance back) at every distance mod the stride, selected and attended by MoBA and NSA on
both CPU product paths (int8, float32) and the GPU form forced on the CPU, and causality."""
import math

import pytest
import torch

from longpatch.methods import gpu_scores, selection
from longpatch.methods.selection import antidiagonal_scores, estimated_blocks
from longpatch.ops import exact_attention, moba_attention, nsa_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _sampled(n: int, stride: int) -> torch.Tensor:
    """[n, n] bool: the (query, key) products the scores sample, from the definition: query row j and
    key row l of tiles a and c meet where l = s - 1 - i and j = i (a even) or (i + 1) mod s (a odd)."""
    t = torch.arange(n)
    a, j = t // stride, t % stride
    i = (stride - 1 - j).view(1, -1)  # per key: the antidiagonal step that reads it
    want = torch.where((a % 2 == 0).view(-1, 1), i, (i + 1) % stride)
    return j.view(-1, 1) == want


def _dense_reference(q, k, block, stride, scale):
    """antidiagonal_scores from the dense score matrix (float64): each tile pair's sampled products
    summed, / stride * scale, a softmax per query tile over its past tiles, summed per key block over
    the tiles of each query block and the query heads of each KV group, rows normalised."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    nb, nt = math.ceil(n / block), math.ceil(n / block) * (block // stride)
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)  # [b, hq, n, n]
    s = s * _sampled(n, stride)
    s = torch.nn.functional.pad(s, (0, nt * stride - n, 0, nt * stride - n))
    tiles = s.view(b, hq, nt, stride, nt, stride).sum((3, 5)) / stride * scale  # [b, hq, nt, nt]
    a = torch.arange(nt)
    logits = tiles.masked_fill(a.view(1, -1) >= a.view(-1, 1), float("-inf"))
    p = torch.softmax(logits, -1).nan_to_num(0.0)  # tile 0: no past tile, a row of zeros
    per = block // stride
    out = p.view(b, hk, g, nb, per, nb, per).sum((2, 4, 6))
    out = out / out.sum(-1, keepdim=True).clamp(min=1e-30)
    i = torch.arange(nb)
    return out.masked_fill(i.view(1, -1) > i.view(-1, 1), float("-inf"))


def test_the_sampling_sees_every_distance_in_every_query_block_of_two_tiles():
    """The definition itself: an even stride's antidiagonal alone samples odd distances only; with the
    odd tiles rolled, every query block of two tiles or more samples every distance its rows can reach
    (with one tile per block, one parity each, alternating)."""
    n, stride = 256, 8
    t = torch.arange(n)
    dist = t.view(-1, 1) - t.view(1, -1)
    past = (t // stride).view(-1, 1) > (t // stride).view(1, -1)  # the tiles a query tile's softmax reads
    old = (t % stride).view(-1, 1) == (stride - 1 - t % stride).view(1, -1)
    assert set(dist[old & past].remainder(2).tolist()) == {1}
    new = _sampled(n, stride) & past
    for block in (16, 32):
        for i in range(n // block):
            rows = slice(i * block, (i + 1) * block)
            seen = set(dist[rows][new[rows]].tolist())
            assert seen >= set(range(stride, i * block + 1)), (block, i)  # every distance past the first tile
    for i in range(1, n // stride):  # block == stride: the parities alternate
        rows = slice(i * stride, (i + 1) * stride)
        assert set(dist[rows][new[rows]].remainder(2).tolist()) == {1 - i % 2}


@pytest.mark.parametrize("n,block,stride", [(77, 16, 4),  # ragged: a partial last tile (odd) and block
                                            (100, 24, 8),  # three tiles per block: steps start at odd tiles
                                            (96, 16, 16),  # one tile per block
                                            (90, 15, 5),  # an odd stride
                                            (70, 8, 2)])  # a partial last tile that is even
@pytest.mark.parametrize("steps", [False, True])
def test_scores_equal_the_dense_definition(n, block, stride, steps, monkeypatch):
    """Float64 inputs (products in float64) and float32 ones on the float32 path, in one step and one
    block of tiles per step (steps that start at odd tiles), against the dense definition."""
    monkeypatch.setattr(selection, "INT8_PRODUCTS", False)
    if steps:
        monkeypatch.setitem(selection._ANTI_ELEMS, "cpu", 1)
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64), torch.randn(1, 2, n, 16, generator=g,
                                                                                   dtype=torch.float64)
    ref = _dense_reference(q, k, block, stride, 0.25)
    torch.testing.assert_close(antidiagonal_scores(q, k, block, stride, 0.25).double(), ref, atol=1e-6, rtol=1e-5)
    qs = q.float().transpose(1, 2).contiguous().transpose(1, 2)  # a model's strided view
    torch.testing.assert_close(antidiagonal_scores(qs, k.float(), block, stride, 0.25).double(), ref,
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n,block,stride", [(250, 32, 4), (200, 24, 8)])
@pytest.mark.parametrize("steps", [False, True])
def test_int8_scores_are_within_their_rounding_of_the_dense_definition(n, block, stride, steps, monkeypatch):
    """The int8 products fill their query tiles step by step (a step may start at an odd tile): within
    their rounding (0.01 of a mass) of the dense definition."""
    calls = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda *a, **kw: calls.append(1) or int_mm(*a, **kw))
    monkeypatch.setattr(selection, "INT8_PRODUCTS", True)  # whatever this CPU would choose
    if steps:
        monkeypatch.setitem(selection._ANTI_ELEMS, "cpu", 1)
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(2, 4, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g)
    got = antidiagonal_scores(q, k, block, stride, 0.25)
    assert calls
    ref = _dense_reference(q, k, block, stride, 0.25)
    assert torch.equal(got.isinf(), ref.isinf())
    fin = ref.isfinite()
    assert float((got.double()[fin] - ref[fin]).abs().max()) < 0.01


def test_gpu_form_scores_equal_the_dense_definition(monkeypatch):
    """The GPU branch (half-precision tiles, the scale after the products), forced on the CPU as
    tests/test_gpu_scores.py does, fills its tiles the same way. (No Triton kernel takes part.)"""
    monkeypatch.setattr(gpu_scores, "applies", lambda q: True)
    monkeypatch.setattr(selection, "_FUSED_TILE_MASS", gpu_scores.antidiagonal_tile_mass)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 4, 250, 16, generator=g) * 2).bfloat16(), (torch.randn(1, 2, 250, 16, generator=g)
                                                                      * 2).bfloat16()
    got = antidiagonal_scores(q, k, 32, 8, 0.25)
    torch.testing.assert_close(got.double(), _dense_reference(q, k, 32, 8, 0.25), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ a planted copy line
N, D, BLOCK, STRIDE, BIG = 1024, 64, 64, 8, 40.0


def _copy_line(dist: int, seed: int = 0):
    """q, k, v [1, 2 | 1, N, D] float32: each query at t >= dist reads the key at t - dist (its score
    ~BIG, the rest ~N(0, (BIG / sqrt(D))^2) scaled), the others read nothing in particular."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 1, N, D, generator=g), torch.randn(1, 1, N, D, generator=g)
    q = torch.randn(1, 2, N, D, generator=g) * 0.3
    q[:, :, dist:] += BIG * k[:, :, :N - dist] / D ** 0.5
    return q, k, v


def _row_error(out, ref, dist):
    """The mean relative error of the rows that can see their key."""
    return float(((out - ref)[:, :, dist:].norm(dim=-1) / ref[:, :, dist:].norm(dim=-1)).mean())


# every residue mod the stride, both parities; for the outputs, distances whose two key blocks each hold
# 17 or more of a query block's 64 rows (a key block that a few rows of a query block read, at the
# block's edge, is the estimate's weak spot at either parity: with half the tiles sampling each
# distance, to 0.09 here where it holds under a quarter of them)
DISTANCES = [296 + r for r in range(STRIDE)]


@pytest.fixture(params=["int8", "float32"])
def products(request, monkeypatch):
    """Both CPU product paths of the antidiagonal."""
    monkeypatch.setattr(selection, "INT8_PRODUCTS", request.param == "int8")
    return request.param


@pytest.mark.parametrize("scoring", [("antidiagonal", STRIDE), ("hybrid", 16, STRIDE)])
def test_a_copy_line_at_every_distance_selects_the_key_block(scoring, products):
    """Every query block past the line's start lists the key block that most of its rows read, at 32
    distances (the antidiagonal alone missed it for 1 to 5 of the 10 blocks at nearly every even one)."""
    for dist in range(290, 290 + 4 * STRIDE):
        q, k, _ = _copy_line(dist)
        blocks = estimated_blocks(q, k, BLOCK, 7, 0.9, scoring, 1, D ** -0.5)[0, 0]
        first = dist // BLOCK + 2  # every row of the block sees its key
        missed = [i for i in range(first, N // BLOCK) if (i * BLOCK + BLOCK // 2 - dist) // BLOCK not in
                  blocks[i].tolist()]
        assert not missed, (products, scoring[0], dist, missed)


@pytest.mark.parametrize("selection_name", ["antidiagonal", "hybrid"])
def test_a_copy_line_at_every_distance_is_attended_by_moba_and_nsa(selection_name, products):
    """MoBA (8 of 16 chunks, mass 0.9) and NSA (the selected branch alone: gates (0, 1, 0)) against
    exact attention on the rows that can see their key: within 0.05 at every distance mod the stride
    (the antidiagonal alone: 0.18 to 0.39 at the even ones)."""
    errors = {}
    kw = dict(selection=selection_name, mass=0.9, score_stride=STRIDE, estimate_queries=16)
    if selection_name == "antidiagonal":
        kw.pop("estimate_queries")
    for dist in DISTANCES:
        q, k, v = _copy_line(dist)
        ref = exact_attention(q, k, v, causal=True)
        moba = moba_attention(q, k, v, chunk_size=BLOCK, topk=8, **kw)
        nsa = nsa_attention(q, k, v, select_block=BLOCK, num_selected=8, gates=(0.0, 1.0, 0.0), **kw)
        errors[dist] = (_row_error(moba, ref, dist), _row_error(nsa, ref, dist))
    bad = {dist: e for dist, e in errors.items() if max(e) >= 0.05}
    assert not bad, (products, selection_name, bad)


# ------------------------------------------------------------------ causality
@pytest.mark.parametrize("block,stride", [(32, 4), (24, 8), (16, 16)])
def test_scores_of_earlier_blocks_ignore_later_keys_and_queries(block, stride, products):
    """Changing the keys and queries from a position on leaves the scores of every query block before
    that position's block as they were, bit for bit, on both product paths (a rolled query row of
    tile a still meets keys of tiles before a only): also where the change starts inside an odd tile."""
    g = torch.Generator().manual_seed(7)
    n = 240
    q, k = torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    before = antidiagonal_scores(q, k, block, stride, 0.25)
    for at in (5 * block, 5 * block + stride + 1):
        q2, k2 = q.clone(), k.clone()
        q2[:, :, at:] = torch.randn(1, 4, n - at, 16, generator=g) * 3
        k2[:, :, at:] = torch.randn(1, 2, n - at, 16, generator=g) * 5
        after = antidiagonal_scores(q2, k2, block, stride, 0.25)
        assert torch.equal(before[:, :, :at // block], after[:, :, :at // block]), (products, at)
        assert not torch.equal(before[:, :, at // block + 1:], after[:, :, at // block + 1:])
