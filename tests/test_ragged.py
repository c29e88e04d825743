"""Reading ragged batches from what a model hands its attention (longpatch/ragged.py): padding masks,
block-diagonal (packed) masks, restarting position ids and flash-attention's cu_seq_lens, and masks
that are none of these, which fall back to the model's own attention, said and counted."""
import logging

import pytest
import torch

from longpatch import patch_model, ragged
from longpatch.families.hf import _segments
from longpatch.ragged import Segment
from longpatch.testing.tiny import tiny_model


def _causal(pads: list[int], n: int, right: bool = False) -> torch.Tensor:
    """[b, n, n] visibility of causal rows with `pads` padded positions (left, or right)."""
    vis = torch.ones(n, n, dtype=torch.bool).tril()
    rows = []
    for p in pads:
        real = torch.zeros(n, dtype=torch.bool)
        if right:
            real[: n - p] = True
        else:
            real[p:] = True
        rows.append(vis & real[None, :])
    return torch.stack(rows)


def test_left_and_right_padding():
    assert ragged.from_visible(_causal([0, 3], 8), causal=True) == [Segment(0, 0, 8, 0, 8), Segment(1, 3, 8, 3, 8)]
    assert ragged.from_visible(_causal([0, 3], 8, right=True), causal=True) == [Segment(0, 0, 8, 0, 8),
                                                                                Segment(1, 0, 5, 0, 5)]
    # decode: one query row, the keys of the cache after the padding
    dec = torch.ones(2, 1, 9, dtype=torch.bool)
    dec[1, 0, :3] = False
    assert ragged.from_visible(dec, causal=True) == [Segment(0, 0, 1, 0, 9), Segment(1, 0, 1, 3, 9)]
    pad = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    assert ragged.from_padding(pad, 4, causal=True) == [Segment(0, 0, 4, 0, 4), Segment(1, 1, 4, 1, 4)]
    assert ragged.from_padding(pad, 1, causal=True) == [Segment(0, 0, 1, 0, 4), Segment(1, 0, 1, 1, 4)]
    assert ragged.whole([Segment(0, 0, 4, 0, 4)], 1, 4, 4) and not ragged.whole([Segment(0, 1, 4, 1, 4)], 1, 4, 4)


def test_packed_sequences():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    segs = [Segment(0, 0, 3, 0, 3), Segment(0, 3, 5, 3, 5), Segment(0, 5, 9, 5, 9)]
    assert ragged.from_positions(pos) == segs and ragged.restarts(pos, 9, 9)
    block = torch.zeros(9, 9, dtype=torch.bool)
    for s in segs:
        block[s.q0:s.q1, s.k0:s.k1] = torch.ones(s.q1 - s.q0, s.k1 - s.k0, dtype=torch.bool).tril()
    assert ragged.from_visible(block[None], causal=True) == segs
    assert ragged.from_positions(torch.tensor([[0, 1, 3]])) is None  # not runs of 0, 1, 2, ...
    q = torch.zeros(1, 2, 9, 4)
    assert _segments(None, q, q, True, {"position_ids": pos})[0] == segs
    cu = torch.tensor([0, 3, 5, 9])
    assert _segments(None, q, q, True, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu})[0] == segs


@pytest.mark.parametrize("hole", ["gap", "window", "future"])
def test_masks_that_are_not_padding_or_packing(hole):
    vis = _causal([0], 8)
    if hole == "gap":
        vis[0, 6, 2] = False  # a key missing in the middle of a row
    elif hole == "window":
        vis[0] &= torch.ones(8, 8, dtype=torch.bool).triu(-2)  # a sliding window of 3
    else:
        vis[0, 2, 5] = True  # a query seeing a later key
    assert ragged.from_visible(vis, causal=True) is None


def test_an_unsupported_mask_is_said_and_counted(caplog):
    model = tiny_model("llama")
    patch_model(model, {"method": "moba", "params": {"chunk_size": 8, "topk": 2}, "layers": "all"})
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril().triu(-3)  # a sliding window: not padding
    with caplog.at_level(logging.WARNING, logger="longpatch"), torch.no_grad():
        model(torch.randint(0, 256, (1, 16)), attention_mask=mask)
    assert any("neither padding nor packing" in m and "'moba'" in m for m in caplog.messages), caplog.messages
    assert set(model.longpatch.breakdown()["patched"]["prefill"]) == {"original"}


def test_a_forward_reads_its_mask_once(monkeypatch):
    """Every layer gets the same mask object: its segments are read once per forward, not once per layer
    (reading a long prompt's mask is a pass over [batch, n, n])."""
    model = tiny_model("llama")
    patch_model(model, {"method": "moba", "params": {"chunk_size": 8, "topk": 2}, "layers": "all"})
    reads = []
    real = ragged.from_visible
    monkeypatch.setattr(ragged, "from_visible", lambda *a, **k: reads.append(1) or real(*a, **k))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 24)), attention_mask=mask)
    assert len(reads) == 1 and model.longpatch.num_layers == 4


def test_a_static_buffers_queries_sit_before_its_empty_columns():
    """A static cache's buffer: the queries end at the last visible key, not at the buffer's end; other
    layouts keep the queries as the last keys (left or right padding, a plain decode step)."""
    n, extra = 10, 6
    vis = torch.zeros(2, 3, n + extra, dtype=torch.bool)
    vis[:, :, :n] = _causal([0, 4], n)[:, -3:]  # the last 3 of 10 queries, 6 empty columns after
    assert ragged.static_offset(vis) == n - 3
    assert ragged.from_visible(vis, True) == [Segment(0, 0, 3, 0, n), Segment(1, 0, 3, 4, n)]
    for plain in (_causal([0, 4], n), _causal([0, 4], n, right=True), _causal([2], n)[:, -1:]):
        assert ragged.static_offset(plain) == plain.shape[2] - plain.shape[1]
    # rows ending at different columns, or a query seeing past the last row's end: not a static buffer
    odd = vis.clone()
    odd[1, -1, n - 1] = False
    assert ragged.static_offset(odd) == n + extra - 3
    odd = vis.clone()
    odd[0, 0, n + 2] = True
    assert ragged.static_offset(odd) == n + extra - 3
