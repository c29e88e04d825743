"""A one-token step without the prefill's list (decode_prefill: false, Quest's step) against a dense definition:
it attends exactly the first block, its own block and the local ones before it, and, among the other full
blocks, the decode_topk with the largest page bound of q·k; the prefill's last list takes final_topk blocks of
its exact row. The general step (autograd on) and the lean one give the same output."""
import pytest
import torch

from longpatch.methods import get_method
from longpatch.methods.moba.op import moba_attention
from longpatch.methods.nsa.op import nsa_attention

pytestmark = pytest.mark.usefixtures("one_thread")

C, PAGE, TOPK = 16, 4, 3


def _bound_ranked(q, k, n, topk, first_local, kept):
    """Per KV head, the topk blocks before first_local and not in ``kept`` by their best page's Quest bound (max
    over the group's query heads), densely."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    nb = n // C
    pages = k[:, :, :nb * C].reshape(b, hk, nb * C // PAGE, PAGE, d)
    lo, hi = pages.amin(3), pages.amax(3)  # [b, hk, np, d]
    qg = q.reshape(b, hk, hq // hk, 1, d)
    bound = torch.maximum(qg * lo.unsqueeze(2), qg * hi.unsqueeze(2)).sum(-1)  # [b, hk, g, np]
    best = bound.amax(2).view(b, hk, nb, C // PAGE).amax(-1)[..., :first_local]
    out = []
    for bi in range(b):
        for hi in range(hk):
            free = [j for j in range(first_local) if j not in set(kept[bi, hi].tolist())]
            order = sorted(free, key=lambda j: -best[bi, hi, j].item())
            out.append(order[:topk])
    return out


def _dense(q, k, v, allowed):
    b, hq, _, d = q.shape
    hk = k.shape[1]
    s = torch.einsum("bhgd,bhnd->bhgn", q.reshape(b, hk, hq // hk, d).double(), k.double()) * d ** -0.5
    s = s.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    return torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), v.double()).reshape(b, hq, 1, d)


def _op(name):
    if name == "moba":
        params = dict(chunk_size=C, topk=4, selection="hybrid", estimate_queries=8, score_stride=4, local_blocks=1)
        return lambda q, k, v, **kw: moba_attention(q, k, v, **params, **kw), 1
    params = dict(compress_block=16, compress_stride=8, select_block=C, num_selected=4, window=24, init_blocks=1,
                  local_blocks=2, gates=(0.0, 1.0, 0.0), selection="hybrid", estimate_queries=8, score_stride=4)
    return lambda q, k, v, **kw: nsa_attention(q, k, v, **params, **kw), 1  # local_blocks 2 counts the own one


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_step_attends_the_kept_the_local_and_the_ranked_blocks_only(name, prefill):
    """Without the prefill's list (decode_prefill false) the step keeps the sink alone; with it, that list; and
    beside them, its own and local blocks and decode_topk other blocks, each once."""
    op, local = _op(name)
    g = torch.Generator().manual_seed(2)
    b, hq, hk, d, n = 2, 4, 2, 16, 200
    q, k, v = (torch.randn(b, h, n + 8, d, generator=g) for h in (hq, hk, hk))
    state = {}
    kw = dict(decode_topk=TOPK, decode_page=PAGE, decode_prefill=prefill)
    op(q[:, :, :n], k[:, :, :n], v[:, :, :n], state=state, **kw)
    kept = state["kept"].clone()
    if not prefill:
        assert kept.tolist() == [[[0]] * hk] * b  # only the sink is kept from the prefill
    else:
        assert int((kept >= 0).sum(-1).min()) > 1
    for t in range(n, n + 8):
        qt, kt, vt = q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]
        out = op(qt, kt, vt, state=state, **kw)
        own = t // C
        blocks = torch.arange(t + 1) // C
        allowed = torch.zeros(b, hk, t + 1, dtype=torch.bool)
        ranked = _bound_ranked(qt, kt, t + 1, TOPK, own - local, kept)
        for bi in range(b):
            for hi in range(hk):
                mine = {j for j in kept[bi, hi].tolist() if 0 <= j < own - local}
                listed = {*mine, *range(own - local, own + 1), *ranked[bi * hk + hi]}
                assert len(listed) == len(mine) + (local + 1) + TOPK  # each block once: TOPK beside the others
                allowed[bi, hi] = torch.isin(blocks, torch.tensor(sorted(listed)))
        torch.testing.assert_close(out.double(), _dense(qt, kt, vt, allowed), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_prefill_list_is_what_the_step_keeps_by_default(name):
    """decode_prefill true (the default): the step keeps the prefill's last list, which can differ from the sink
    alone; and final_topk sets how many blocks the prompt's last exact row adds to it (decode_topk when null)."""
    op, _ = _op(name)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 256, 16, generator=g) for h in (4, 2, 2))
    sizes = {}
    for final in (0, 6):
        state = {}
        op(q, k, v, state=state, decode_topk=1, decode_page=PAGE, final_topk=final)
        sizes[final] = int((state["kept"] >= 0).sum())
    assert sizes[6] > sizes[0]


def test_the_new_params_are_checked_and_apply_to_the_query_aware_selections_only():
    from longpatch.errors import ConfigError
    moba = get_method("moba")
    with pytest.raises(ConfigError, match="final_topk"):
        moba.bind({"selection": "hybrid", "final_topk": -1}, 16)
    with pytest.raises(ConfigError, match="decode_prefill"):
        moba.bind({"selection": "gate", "decode_prefill": False}, 16)


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_lean_step_equals_the_general_one(name, prefill):
    """quest_step (no grad, plain tensors) against decode_kept + block_sparse_decode (taken under autograd)."""
    op, _ = _op(name)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 16, generator=g) for h in (4, 2, 2))
    kw = dict(decode_topk=TOPK, decode_page=PAGE, decode_prefill=prefill, return_lse=True)
    fast, slow = {}, {}
    op(q[:, :, :260], k[:, :, :260], v[:, :, :260], state=fast, **kw)
    op(q[:, :, :260], k[:, :, :260], v[:, :, :260], state=slow, **kw)
    for t in range(260, 300):
        args = (q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
        with torch.no_grad():
            o1, l1 = op(*args, state=fast, **kw)
        o2, l2 = op(*(x.clone().requires_grad_() for x in args), state=slow, **kw)
        torch.testing.assert_close(o1, o2.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2.detach(), atol=1e-5, rtol=1e-5)


def test_bf16_bounds_round_outward():
    from longpatch.methods.selection import bf16_below
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(10000, generator=g) * 7, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])])
    lo, hi = bf16_below(x), -bf16_below(-x)
    assert lo.dtype == torch.bfloat16 and bool((lo.float() <= x).all()) and bool((hi.float() >= x).all())
    # and within one bfloat16 step (8 bits of mantissa) of x: not rounded further than needed
    assert bool(((x - lo.float()) <= x.abs() * 2 ** -7 + 1e-38).all())
    assert bool(((hi.float() - x) <= x.abs() * 2 ** -7 + 1e-38).all())


def _state_share(k, v, state) -> float:
    from longpatch.routing import tensors_in
    seen, held = set(), 0
    for t in tensors_in(state):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            held += t.untyped_storage().nbytes()
    cache = sum(x.nbytes_stored if hasattr(x, "nbytes_stored") else x.nbytes for x in (k, v))
    return held / cache


@pytest.mark.parametrize("cache", ["float32", "int8"])
def test_the_shipped_decode_state_is_under_15_percent_of_the_cache(cache):
    """The demo 32k configs' decode params (blocks of 256, pages of 16, no prefill list) on a 4096-key cache of
    2 KV heads, d 64: the selection state (page bounds, fingerprint rows, the kept list) beside the cache it serves,
    float32 and 8-bit (whose bounds are bfloat16)."""
    from longpatch.quantized import QuantizedKV
    g = torch.Generator().manual_seed(1)
    n = 8192
    q, k, v = (torch.randn(1, h, n + 4, 64, generator=g) for h in (4, 2, 2))
    params = dict(chunk_size=256, topk=16, selection="hybrid", mass=0.9, local_blocks=1, decode_topk=8,
                  decode_page=16, decode_prefill=False, final_topk=16)
    state = {}
    moba_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], state=state, **params)
    for t in range(n, n + 4):
        kt, vt = k[:, :, :t + 1], v[:, :, :t + 1]
        if cache == "int8":
            kt, vt = QuantizedKV.of(kt), QuantizedKV.of(vt)
        moba_attention(q[:, :, t:t + 1], kt, vt, state=state, **params)
    if cache == "int8":
        assert state["mins"].dtype == torch.bfloat16
    share = _state_share(kt, vt, state)
    assert 0.02 < share <= 0.15, share


def test_the_lean_step_takes_short_lists_only():
    """A list wider than LEAN_BLOCKS (kept and ranked) keeps the general step, whose in-place reads win there."""
    from longpatch.methods.selection import LEAN_BLOCKS, quest_applies
    k = torch.zeros(1, 2, 64, 16)
    assert quest_applies(k, k, torch.zeros(1, 2, LEAN_BLOCKS - 8, dtype=torch.long), 8, "torch")
    assert not quest_applies(k, k, torch.zeros(1, 2, LEAN_BLOCKS - 7, dtype=torch.long), 8, "torch")
    assert not quest_applies(k, k, torch.zeros(1, 2, 1, dtype=torch.long), 8, "flex")
    assert not quest_applies(k, k, torch.zeros(1, 2, 1, dtype=torch.long), 0, "torch")
