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


def _bound_ranked(q, k, n, topk, first_local):
    """Per KV head, the topk blocks among 1 .. first_local - 1 (neither the sink nor local) by their best page's
    Quest bound (max over the group's query heads), densely."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    nb = n // C
    pages = k[:, :, :nb * C].reshape(b, hk, nb * C // PAGE, PAGE, d)
    lo, hi = pages.amin(3), pages.amax(3)  # [b, hk, np, d]
    qg = q.reshape(b, hk, hq // hk, 1, d)
    bound = torch.maximum(qg * lo.unsqueeze(2), qg * hi.unsqueeze(2)).sum(-1)  # [b, hk, g, np]
    best = bound.amax(2).view(b, hk, nb, C // PAGE).amax(-1)[..., 1:first_local]
    return best.topk(min(topk, best.shape[-1]), -1).indices + 1


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


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_step_attends_the_sink_the_local_blocks_and_the_ranked_ones_only(name):
    op, local = _op(name)
    g = torch.Generator().manual_seed(2)
    b, hq, hk, d, n = 2, 4, 2, 16, 200
    q, k, v = (torch.randn(b, h, n + 8, d, generator=g) for h in (hq, hk, hk))
    state = {}
    op(q[:, :, :n], k[:, :, :n], v[:, :, :n], state=state, decode_topk=TOPK, decode_page=PAGE, decode_prefill=False)
    assert state["kept"].tolist() == [[[0]] * hk] * b  # only the sink is kept from the prefill
    for t in range(n, n + 8):
        qt, kt, vt = q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]
        out = op(qt, kt, vt, state=state, decode_topk=TOPK, decode_page=PAGE, decode_prefill=False)
        own = t // C
        blocks = torch.arange(t + 1) // C
        allowed = torch.zeros(b, hk, t + 1, dtype=torch.bool)
        ranked = _bound_ranked(qt, kt, t + 1, TOPK, own - local)
        for bi in range(b):
            for hi in range(hk):
                listed = {0, *range(own - local, own + 1), *ranked[bi, hi].tolist()}
                assert len(listed) == 1 + (local + 1) + TOPK  # each block once: TOPK beside the others
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


@pytest.mark.parametrize("name", ["moba", "nsa"])
def test_the_lean_step_equals_the_general_one(name):
    """quest_step (no grad, plain tensors) against decode_kept + block_sparse_decode (taken under autograd)."""
    op, _ = _op(name)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 16, generator=g) for h in (4, 2, 2))
    kw = dict(decode_topk=TOPK, decode_page=PAGE, decode_prefill=False, return_lse=True)
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
