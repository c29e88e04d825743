"""Ulysses (all-to-all) sequence-parallel attention (DeepSpeed-Ulysses).

Each of N ranks holds a contiguous slice of the sequence, all heads: q [b, hq, n_r, d], k/v
[b, hk, n_r, d]. One all-to-all turns that into all positions for a 1/N share of the heads; there
any method computes an ordinary full-sequence prefill for its heads (attention is independent per
head, so this is the single-process computation restricted to those heads); a second all-to-all
brings each rank its own positions of every head back.

Heads. Rank j gets query heads [j*hq/N, (j+1)*hq/N), so N must divide hq. For K/V (GQA, hk < hq):
* hk divisible by N ("split"): rank j gets the hk/N KV heads its query heads use; nothing is repeated.
* otherwise ("replicated"): a KV head shared by query heads on several ranks is sent to each of those
  ranks, and only those. When a rank's query heads do not group evenly over the KV heads they use
  (e.g. hq=6, hk=2, N=3) that rank gets one K/V copy per query head (never more than its hq/N).
q, k and v travel in ONE all-to-all (packed per destination), the output in a second: two
collectives per call whatever the GQA case, each moving (N-1)/N of what it carries over the network.

The methods' random draws (LSH directions, column samples, random features, random blocks) are shared
by all heads and depend only on the seed and the sequence length, so a head subset sees the same draws
as the whole: results equal the single-process op, and approximate methods too given the same seed
(tests/test_parallel.py holds every method to it). A method whose query heads of a KV group depend on
each other declares it (``Method.couples_heads``); then each rank gets whole groups (head_plan).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError
from ..methods import get_method
from .comm import all_to_all, comm_device, gather_ints, world_of


def head_plan(hq: int, hk: int, world: int, whole_groups: bool = False) -> list[tuple[list[int], list[int]]]:
    """(query heads, KV heads) each rank receives, in rank order; rank j always owns the query heads
    [j*hq/N, (j+1)*hq/N) of the output.

    The local q->kv grouping stays the methods' usual one (local query head i uses local KV head
    i // (local_hq // local_hk)); where that cannot hold, the rank gets one KV copy per query head.
    whole_groups: the method couples the query heads of a KV group (its ``Method.couples_heads``, e.g. a
    block selection summing the group's scores), so a rank computes every query head of the groups it
    touches and keeps its own; only matters when a group spans ranks (the "replicated" layout).
    """
    if hq % world:
        raise ConfigError(f"sequence parallelism: {hq} query heads do not divide over {world} ranks; "
                          f"allowed: a number of ranks that divides {hq}")
    if hk < 1 or hq % hk:
        raise ConfigError(f"sequence parallelism: query heads ({hq}) must be a multiple of KV heads ({hk})")
    per, group = hq // world, hq // hk
    plan = []
    for j in range(world):
        used = [(j * per + i) // group for i in range(per)]  # the KV head of each own query head
        uniq = sorted(set(used))
        if whole_groups:
            plan.append((list(range(uniq[0] * group, (uniq[-1] + 1) * group)), uniq))
            continue
        rep = per // len(uniq)
        even = per % len(uniq) == 0 and all(used[i] == uniq[i // rep] for i in range(per))
        plan.append((list(range(j * per, (j + 1) * per)), uniq if even else used))
    return plan


def kv_heads_for(hq: int, hk: int, world: int) -> list[list[int]]:
    """The KV heads each rank receives (rank order) for methods whose heads are independent."""
    return [kv for _, kv in head_plan(hq, hk, world)]


def layout(hq: int, hk: int, world: int) -> str:
    """'split' (KV heads divided between ranks) or 'replicated' (some KV heads sent to several ranks)."""
    head_plan(hq, hk, world)
    return "split" if hk % world == 0 else "replicated"


def _heads(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[:, idx] without a gather when idx is a contiguous run (the usual case)."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return x[:, idx[0]:idx[0] + len(idx)]
    return x[:, idx]


def ulysses(q, k, v, attend: Callable, *, group=None, seq_lens: list[int] | None = None,
            whole_groups: bool = False) -> torch.Tensor:
    """The all-to-all scheme around any ``attend(q, k, v) -> out`` on full-length head subsets.

    q [b, hq, n_r, d], k [b, hk, n_r, d], v [b, hk, n_r, dv]: this rank's slice (rank order).
    seq_lens: every rank's n_r when the caller knows them (the model context does); None gathers them
    (one small all_gather, which also checks that batch, heads and head dims agree between ranks).
    whole_groups: see head_plan (True where the method couples a KV group's heads: ``Method.couples``).
    Returns [b, hq, n_r, dv]: this rank's positions, every head.
    """
    rank, world = world_of(group)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ulysses_attention: q, k, v must be 4-D [batch, heads, n_local, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, n_r, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    if k.shape[2] != n_r or v.shape[2] != n_r or k.shape[:2] != v.shape[:2] or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError("ulysses_attention: q, k, v must be this rank's slice of one prefill (equal batch and "
                         f"n_local; k and v equal heads); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"ulysses_attention: q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if seq_lens is None:
        meta = gather_ints([n_r, b, hq, hk, d, dv], comm_device(group), group)
        if any(m[1:] != meta[rank][1:] for m in meta):
            raise ValueError("ulysses_attention: ranks disagree on [batch, q_heads, kv_heads, head_dim, v_dim]: "
                             f"{[m[1:] for m in meta]}")
        seq_lens = [m[0] for m in meta]
    if len(seq_lens) != world or seq_lens[rank] != n_r:
        raise ValueError(f"ulysses_attention: seq_lens {seq_lens} do not fit rank {rank} of {world} "
                         f"with {n_r} positions")
    plan = head_plan(hq, hk, world, whole_groups)
    if world == 1:
        return attend(q, k, v)
    per = hq // world
    mq, mk = len(plan[rank][0]), len(plan[rank][1])

    # exchange 1: q, k, v packed per destination, so one collective carries all three
    pieces, send = [], []
    for qi, ki in plan:
        part = [_heads(q, qi), _heads(k, ki), _heads(v, ki)]
        pieces += [t.reshape(-1) for t in part]
        send.append(sum(t.numel() for t in part))
    recv = [b * n * (mq * d + mk * (d + dv)) for n in seq_lens]
    got = all_to_all(torch.cat(pieces), send, recv, group)
    qs, ks, vs = [], [], []
    for n, chunk in zip(seq_lens, got.split(recv)):
        sq, sk = b * mq * n * d, b * mk * n * d
        qs.append(chunk[:sq].view(b, mq, n, d))
        ks.append(chunk[sq:sq + sk].view(b, mk, n, d))
        vs.append(chunk[sq + sk:].view(b, mk, n, dv))
    # all positions (slices in rank order) for this rank's heads: the single-process call on a head subset
    out = attend(torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2))  # [b, mq, n, dv]
    own = rank * per - plan[rank][0][0]  # where this rank's own query heads sit (whole groups: not at 0)
    out = out[:, own:own + per]

    # exchange 2: each rank gets its own positions of this rank's heads back
    starts = [sum(seq_lens[:j]) for j in range(world)]
    pieces = [out[:, :, s:s + n].reshape(-1) for s, n in zip(starts, seq_lens)]
    got = all_to_all(torch.cat(pieces), [t.numel() for t in pieces], [b * per * n_r * dv] * world, group)
    return torch.cat([c.view(b, per, n_r, dv) for c in got.split(b * per * n_r * dv)], 1)


def ulysses_attention(q, k, v, *, method: str = "exact", causal: bool = True, group=None, scale: float | None = None,
                      backend: str = "auto", seq_lens: list[int] | None = None, **params) -> torch.Tensor:
    """Sequence-parallel attention: this rank's slice in, this rank's output slice out.

    q [b, q_heads, n_local, d], k/v [b, kv_heads, n_local, d]: contiguous slices of one sequence, rank
    r holding positions [sum(n_0..n_{r-1}), +n_r) of the process group ``group`` (None: the default
    group); slices may differ in length (the last is usually shorter). Any registered ``method`` runs
    its prefill on all positions of a 1/N share of the heads, with ``params`` (validated as in a
    config) and its own seeds, so the result equals ``method`` on the gathered tensors in one process.
    seq_lens: every rank's n_local if known (saves one small all_gather). Returns [b, q_heads, n_local, d].
    Errors: q_heads not divisible by the group size, or kv_heads not dividing q_heads (ConfigError).
    """
    m = get_method(method)
    if not causal and m.causal_only:
        raise ConfigError(f"ulysses_attention: method '{method}' supports causal attention only; got causal=False")
    bound = m.bind(params, q.shape[-1])

    def attend(qh, kh, vh):
        return bound(qh, kh, vh, causal=causal, scale=scale, backend=backend)

    return ulysses(q, k, v, attend, group=group, seq_lens=seq_lens, whole_groups=m.couples(bound.params))
