"""Helpers every attention op shares: shape checks, GQA views, LSE merges, backend choice."""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import ConfigError, check_int, shown

BACKENDS = ("auto", "torch", "triton", "flex")


_warned: set[str] = set()


# The phases of a one-token step, as a profiler sees them (``bench generate --profile``): ranking what to read
# (bounds upkeep, bound products, top-k, lists) and attending to it (gathers, scores, weighted sums)
RANK, ATTEND = "longpatch::rank", "longpatch::attend"


def step_phase(name: str):
    """A profiler range named ``name`` while a profiler runs; otherwise nothing (a range costs ~10 us a call,
    a check of the profiler ~1)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def warn_once(key: str, message: str) -> None:
    """``message`` on the "longpatch" logger, the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        logging.getLogger("longpatch").warning(message)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              value_dim: bool = False) -> tuple[int, int, int]:
    """Validate the shared layout; returns (q_heads // kv_heads, q_len, kv_len). value_dim: the op
    supports a value head_dim other than q's (exact, linear, performer); the others refuse one."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("q, k, v must be torch tensors [batch, heads, len, head_dim]; got "
                         f"{', '.join(type(t).__name__ for t in (q, k, v))}")
    if causal not in (True, False):  # 'yes' or None would read as True or False by accident
        raise ValueError(f"causal must be True or False; got {causal!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D [batch, heads, len, head_dim]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, nq, d = q.shape
    _, hk, nk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q, k, v shapes do not agree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk})")
    if causal and nq > nk:
        raise ValueError(f"causal attention needs q_len <= kv_len; got {nq} > {nk}")
    if v.shape[-1] != d and not value_dim:
        raise ValueError(f"v's head_dim must equal q's and k's ({d}); got {v.shape[-1]} (q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}): a separate value head_dim is not supported")
    if d == 0:
        raise ValueError(f"head_dim must be >= 1; got q {tuple(q.shape)}")
    if any(t.is_meta for t in (q, k, v)):
        raise ValueError("q, k, v are meta tensors (shapes without data); allowed: tensors on a real device")
    if not q.is_floating_point():  # integer inputs would run integer arithmetic: garbage, not attention
        raise ValueError(f"q, k, v must be floating point (float16, bfloat16, float32 or float64); got {q.dtype}")
    if not q.dtype == k.dtype == v.dtype:  # the fused kernels would fail deep inside, or misread the data
        raise ValueError(f"q, k, v must have one dtype; got dtypes {q.dtype}, {k.dtype}, {v.dtype} "
                         "(cast them, e.g. k.to(q.dtype))")
    return hq // hk, nq, nk


def check_seed(op: str, seed) -> int | None:
    """seed: None or an int >= 0 (what the config accepts; the generators reject negative seeds)."""
    return None if seed is None else check_int(f"{op}: seed", seed, 0)


def check_gates(op: str, gates) -> tuple[float, float, float]:
    """Fixed branch gates: three finite numbers >= 0 (as in the config)."""
    try:
        vals = tuple(float(x) for x in gates)
    except (TypeError, ValueError):
        vals = ()
    if len(vals) != 3 or not all(math.isfinite(x) and x >= 0 for x in vals):
        raise ValueError(f"{op}: gates must be 3 finite numbers >= 0 (g_cmp, g_slc, g_win) or a tensor "
                         f"[b, q_heads, n, 3]; got {gates!r}")
    return vals


def nonfinite_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Bool [b, kv_heads, kv_len]: the positions whose key or value row holds a NaN or an inf; None
    when every row is finite (the usual case: one summing pass over k and v decides it)."""
    acc = acc_dtype(k.dtype)
    # NaN/inf propagate into the sums (each summed on its own: a bad call with k and v on different
    # devices must reach the op's own one-line check, not fail here)
    if bool(torch.isfinite(k.sum(dtype=acc))) and bool(torch.isfinite(v.sum(dtype=acc))):
        return None
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    return bad if bool(bad.any()) else None  # the sums overflowed on finite inputs


def isolate_nonfinite(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad: torch.Tensor,
                      return_lse: bool = False):
    """``op(q, k, v)`` (-> out, or (out, lse) with ``return_lse``) where the rows ``bad`` of k/v
    (``nonfinite_rows``) hold NaN/inf, such that a query row that does not attend to a bad position
    does not depend on it, and one that does comes out NaN.

    Masked-out keys are not removed by the kernels but weighed by 0, and 0 * NaN = NaN: a NaN value
    poisons every row of its tile, a NaN key every row whose mask is additive, a prefix sum every
    later chunk. So the op runs on k, v with the bad rows zeroed, and once more (no grad) with q, the
    zeroed k and an indicator of the bad rows as v: a row gives the bad rows positive weight exactly
    when it attends to one of them (selections, which depend on q and k, are the same in both runs).
    Those rows become NaN (a bad row whose weight underflows to 0 counts as not attended)."""
    keep = ~bad.unsqueeze(-1)
    k0, v0 = torch.where(keep, k, torch.zeros_like(k)), torch.where(keep, v, torch.zeros_like(v))
    res = op(q, k0, v0)
    with torch.no_grad():
        flag = op(q.detach(), k0.detach(), bad.unsqueeze(-1).to(v.dtype).expand(v.shape).contiguous())
    hit = (flag[0] if return_lse else flag)[..., :1] > 0
    if not return_lse:
        return res.masked_fill(hit, float("nan"))
    out, lse = res
    rows = hit[..., 0]  # [b, hq, nq]; an lse may carry more per row (NSA's: one per branch)
    rows = rows.view(*rows.shape, *(1,) * (lse.dim() - rows.dim()))
    return out.masked_fill(hit, float("nan")), lse.masked_fill(rows, float("nan"))


def guards_nonfinite(op):
    """Decorator of an attention op ``op(q, k, v, *, ..., return_lse=False, ...)``: any strides, and
    isolation of NaN/inf key or value rows (rows that do not attend to such a position do not depend
    on it).

    Strides: an input whose feature dimension is not contiguous is copied once (the CPU paths and
    kernels read rows as contiguous vectors); the head and sequence dimensions may have any strides.

    Prefill (q_len == kv_len): when a key or value row holds NaN/inf, the call runs through
    ``isolate_nonfinite``. Every op needs it there: fused kernels weigh masked values by 0 (0 * NaN =
    NaN), chunked prefix sums are GEMMs with 0/1 matrices, performer's key stabiliser is shared, and
    NSA's gate 0 multiplies a NaN branch. Finite inputs pay one summing pass over k and v, small
    against the O(n^2 / sparsity) work.

    Decode (q_len < kv_len, a step against a cache): the op runs first; only when its output is not
    finite does the step pay the pass over the cache and re-run isolated. A sparse step reads only
    the rows it selects (a non-finite row it reads makes its output non-finite), so a finite output
    means it read no bad row and the step costs what it attends, not a read of the whole cache. A
    block whose summary (chunk mean, compressed key) is non-finite scores -inf and is not selected."""
    @functools.wraps(op)
    def guarded(q, k, v, **kwargs):
        q, k, v = (t.contiguous() if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] > 1
                   and t.stride(-1) != 1 else t for t in (q, k, v))
        floats = all(isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta for t in (q, k, v))
        # Inside a caller's compiled region (torch.compile, a CUDA graph's capture) no branch may read
        # the data: the op runs unguarded, so a NaN/inf key or value row may also turn rows that do not
        # attend to it NaN (never a finite wrong value). docs/gpu.md says so.
        if not floats or torch.compiler.is_compiling():  # else the op's own argument check names what is wrong
            return op(q, k, v, **kwargs)
        lse = bool(kwargs.get("return_lse", False))
        if q.dim() == 4 and k.dim() == 4 and q.shape[2] < k.shape[2]:
            res = op(q, k, v, **kwargs)
            if all_finite(res[0] if lse else res):
                return res
        bad = nonfinite_rows(k, v)
        if bad is None:
            return op(q, k, v, **kwargs)
        return isolate_nonfinite(lambda q_, k_, v_: op(q_, k_, v_, **kwargs), q, k, v, bad, lse)
    return guarded


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite (one pass over a small output). A NaN or inf element
    makes the float64 sum non-finite, and finite float32/half values cannot overflow it: one
    reduction and one sync (isfinite, all and bool cost 4x that on a decode step's output); only a
    non-finite sum (or float64 values near its limit) pays the elementwise check."""
    return math.isfinite(t.sum(dtype=torch.float64).item()) or bool(torch.isfinite(t).all())


def default_scale(scale: float | None, head_dim: int) -> float:
    """The softmax temperature of every op, one rule for all: None -> 1/sqrt(head_dim), else a positive
    finite number (0, a negative or a NaN scale would give NaN in some ops and a finite, meaningless result
    in others)."""
    if scale is None:
        return head_dim ** -0.5
    try:
        value = float(scale) if not isinstance(scale, (bool, str)) else None
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"scale: got {scale!r}; allowed: a positive finite number, or None (1/sqrt(head_dim))")
    return value


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, q_heads, n, d] -> [b, kv_heads, group, n, d] (a view): query heads that share a K/V head."""
    b, hq, n, d = q.shape
    return q.view(b, kv_heads, hq // kv_heads, n, d)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the CPU paths: float64 for float64 inputs (gradcheck), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# exp() of float32 inputs below about -87 (results under float32's smallest normal number) takes a
# slow path in torch's CPU kernel: 50-100x slower per element. Scores that far below their row's
# maximum are common in a real model's rows of 32k keys: the demo model's last-queries estimate spent
# 200 ms a layer in exp at 32k (4 ms on random inputs). A key 80 below its row's maximum weighs under
# 2e-35 of it: raising it to that floor changes no sum and no ranking that matters.
EXP_FLOOR = -80.0


def exp_below_max_(s: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """In place: exp(s - top), each difference raised to at least ``EXP_FLOOR`` (so -inf entries
    become exp(EXP_FLOOR), not 0: callers zero the ones they masked)."""
    return s.sub_(top).clamp_(min=EXP_FLOOR).exp_()


def ordered_int(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 with the same order (NaN -> -inf, -0 -> +0), so that top-k selections can
    pack (score, index) into one int64 key and break ties by index exactly, whatever order
    torch.topk returns equal values in (MoBA's chunks, NSA's blocks)."""
    x = torch.nan_to_num(x.float() + 0.0, nan=float("-inf"))
    bits = x.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def gather_blocks(x: torch.Tensor, ids: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [b, hk, n, d], block ids [b, hk, S] -> [b, hk, S * block, d]: the rows of each listed block
    of ``block`` keys, in list order; what a decode step attends to, read without copying the rest of
    the cache. Slot rows that do not exist (an id of -1, rows of the last, partial block past n - 1)
    hold another row of x: callers mask them. One block-sized copy per listed block (an index_select
    per batch row and head over a [blocks, block * d] view), several times faster here than
    gathering the same rows one by one, and any layout whose rows are contiguous is read in place
    (a GrowingCache's views included). ``out``: a buffer of b * hk * S * block * d elements to
    write into (a reused workspace is several times faster to write than a fresh tensor)."""
    from ..quantized import QuantizedKV, dequantize
    if isinstance(x, QuantizedKV):  # an 8-bit cache: the listed blocks' packed rows, dequantized alone
        return dequantize(gather_blocks(x.rows, ids, block), x.fmt, x.shape[-1], x.dtype)
    b, hk, n, d = x.shape
    S = ids.shape[-1]
    nb = n // block  # complete blocks
    partial = nb * block < n
    dense = x.stride(-1) == 1 and x.stride(-2) == d  # a block is one run of block * d elements
    whole = ids.clamp(0, max(nb - 1, 0))  # -1 and the partial block read block 0 / nb-1, masked by callers

    def source(bi, hi):  # the complete blocks of one head, viewed in place
        rows = x[bi, hi, :nb * block]
        return rows.view(nb, block * d) if dense else rows.view(nb, block, d)

    if nb and torch.is_grad_enabled() and x.requires_grad:  # out= records no gradient: gather out of place
        out = torch.stack([source(bi, hi).index_select(0, whole[bi, hi]).reshape(S, block * d)
                           for bi in range(b) for hi in range(hk)]).view(b, hk, S, block * d)
    else:
        # zeros where no row is copied (the partial block's slot past n - 1 when nb == 0): masked
        # rows must still be finite, or 0 * garbage turns an output into NaN
        if out is None:
            out = x.new_zeros(b, hk, S, block * d) if partial else x.new_empty(b, hk, S, block * d)
        else:
            out = out.view(b, hk, S, block * d)
            if partial and not nb:
                out.zero_()
        for bi in range(b if nb else 0):
            for hi in range(hk):
                torch.index_select(source(bi, hi), 0, whole[bi, hi],
                                   out=out[bi, hi] if dense else out[bi, hi].view(S, block, d))
    if partial:  # the partial last block: its rows where listed (no host sync, no Python loop)
        tail = x[:, :, nb * block:].reshape(b, hk, 1, -1)
        head = out[..., :tail.shape[-1]]
        head.copy_(torch.where((ids == nb).unsqueeze(-1), tail, head))
    return out.view(b, hk, S * block, d)


def layer_seed_of(seed: int | None, layer: int | None) -> int:
    """The seed a patched layer draws its random buffers from (LSH directions, random features, random
    blocks): ``seed`` (None -> 0) itself for a lone call, mixed with the layer index when patching, so
    that every layer gets its own draw and the same config always gives the same draws."""
    base = 0 if seed is None else int(seed)
    return base if layer is None else (base * 1_000_003 + int(layer) + 1) % (2 ** 63)


def probe_positions(n: int) -> list[int]:
    """Which of n cached rows a decode state checks, each step, to notice that the cache is no
    longer the one it summarises (a new sequence, beam reordering, a cropped cache): n-1, n-2, n-4,
    ... (log2(n) + 1 rows), dense where two cached sequences (beams) usually differ, the recent rows,
    and O(log n) so that the check never costs O(cache)."""
    out, step = [], 1
    while step <= n:
        out.append(n - step)
        step *= 2
    return out


PROBE_FEATURES = 4  # the features of a window's closing key row that ``window_summaries`` keeps as its fingerprint


def window_summaries(state: dict, names: tuple[str, ...], k, v, size: int, stride: int, summarize,
                     feature_major: bool = False) -> tuple:
    """Summaries of every complete window of a KV cache (window c: positions [c stride, c stride +
    size)), kept in a layer's decode ``state`` under ``names`` and extended as windows complete, so
    each window is summarised once: MoBA's chunk means, NSA's compressed K/V, the selections' key
    bounds. The key row closing each window is its fingerprint, checked at ``probe_positions`` (O(log)
    rows a step): if the cache no longer holds those rows (a new sequence, beam reordering, a cropped
    cache) the summaries are rebuilt from the keys. A fingerprint keeps the row's first ``PROBE_FEATURES``
    features, not the whole row: another cache's rows differ there too, and whole rows of every window were
    as large as the summaries themselves (the bounds of pages of 4 keys: a quarter of the K cache each).
    ``summarize(k_part, v_part)`` returns a tuple of [b, hk, windows, ...] tensors, one per name (v_part is
    None when ``v`` is). ``feature_major``: the summaries [b, hk, windows, d] are kept as views of
    [b, hk, d, capacity] buffers (see ``_appended``)."""
    n = k.shape[2]
    count = (n - size) // stride + 1 if n >= size else 0
    tag = names[0] + "_probe"
    key = (size, stride, tuple(k.shape[:2]), k.shape[-1], k.device, k.dtype)
    parts, probe = None, state.get(tag)
    if probe is not None and state.get(tag + "_of") == key:
        m = min(probe.shape[2], count)
        at = state.get(tag + "_at")
        if at is None or at[:2] != (m, key):  # the probed rows change only when a window completes: kept
            pos = torch.tensor(probe_positions(m), dtype=torch.long, device=k.device)
            at = state[tag + "_at"] = (m, key, pos, pos * stride + size - 1)
        if torch.equal(probe.index_select(2, at[2]), k.index_select(2, at[3])[..., :PROBE_FEATURES]):
            parts, probe = tuple(state[nm][:, :, :m] for nm in names), probe[:, :, :m]
    if parts is None:
        probe = k[:, :, :0, :PROBE_FEATURES]
        parts = summarize(k[:, :, :0], None if v is None else v[:, :, :0])
        state.pop(tag + "_bufs", None)  # another cache: new buffers (views handed out keep their data)
    m = probe.shape[2]
    if m < count:
        lo, hi = m * stride, (count - 1) * stride + size
        new = (*summarize(k[:, :, lo:hi], None if v is None else v[:, :, lo:hi]),
               k[:, :, lo + size - 1: hi: stride][..., :PROBE_FEATURES])  # (rows first: an 8-bit cache's few rows)
        *parts, probe = _appended(state, tag + "_bufs", (*parts, probe), new,
                                  (feature_major,) * len(names) + (False,))
        parts = tuple(parts)
    state.update(zip(names, parts))
    state[tag], state[tag + "_of"] = probe, key
    return parts


def _appended(state: dict, name: str, olds: tuple, news: tuple, feature_major: tuple | None = None) -> tuple:
    """Each old [b, h, m, ...] followed by its new windows along dim 2, written into buffers with
    spare capacity kept in ``state[name]`` (with their filled length), as ``GrowingCache`` keeps
    K/V: a completed window costs a copy of itself, not of every summary before it (a 32k cache's
    NSA blocks complete every 16 tokens, and their compressed K/V and probe rows are MBs). The olds
    are prefixes of those buffers unless the state was rebuilt or cut (then new buffers).
    ``feature_major[i]``: the i-th [b, h, m, d] buffer is stored as [b, h, d, capacity] (handed out as its
    transposed view): a one-token query times every window's summary is then a product with a
    row-major [d, m] matrix, which a CPU's matmul reads about a third faster than the transposed
    [m, d] one (the page bounds of a 131k cache: 2.0 against 3.1 ms for MoBA's step, 2 threads)."""
    m = olds[0].shape[2]
    end = m + news[0].shape[2]
    filled, bufs = state.get(name, (None, ()))
    if filled != m or any(buf.shape[2] < end for buf in bufs):
        # room for a sixteenth more windows (at least 64): a decode fills a page of 4 keys every 4 tokens, so a
        # 16k cache's bounds grow again after 4k tokens, and the room is memory held beside the cache
        bufs, cap = [], end + max(64, end // 16)
        for i, old in enumerate(olds):
            if feature_major and feature_major[i]:
                buf = old.new_empty((*old.shape[:2], old.shape[-1], cap)).transpose(-1, -2)
            else:
                buf = old.new_empty((*old.shape[:2], cap, *old.shape[3:]))
            buf[:, :, :m] = old
            bufs.append(buf)
    for buf, add in zip(bufs, news):
        buf[:, :, m:end] = add
    state[name] = (end, tuple(bufs))
    return tuple(buf[:, :, :end] for buf in bufs)


def causal_mask(q_len: int, kv_len: int, device, q_offset: int | None = None) -> torch.Tensor:
    """Bool [q_len, kv_len], True = visible. Queries are the last q_len positions (bottom-right)."""
    off = kv_len - q_len if q_offset is None else q_offset
    qi = torch.arange(q_len, device=device).unsqueeze(1) + off
    return torch.arange(kv_len, device=device).unsqueeze(0) <= qi


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
              lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax over the union of two disjoint key sets from their partial results.

    o*: [..., n, d] (any dtype), lse*: [..., n] float32 (float64 for float64). Rows whose key set
    is empty carry lse = -inf and contribute nothing; a row empty on both sides yields zeros.
    """
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    acc = torch.promote_types(acc_dtype(o1.dtype), lse.dtype)  # float64 stays float64 (gradcheck)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1).to(acc)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1).to(acc)
    out = w1 * o1.to(acc) + w2 * o2.to(acc)
    return out.to(o1.dtype), lse


@functools.cache
def _openmp_controller():
    """threadpoolctl's handle on the OpenMP runtime torch runs its CPU ops on, or None (a torch
    built without OpenMP, or threadpoolctl missing)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    ctl = ThreadpoolController().select(user_api="openmp")
    return ctl if ctl.lib_controllers else None


@functools.cache
def _mkl_set_local():
    """``mkl_set_num_threads_local`` of the MKL inside torch's CPU library, or None (another BLAS, or
    another platform). torch.set_num_threads also sets MKL's process-wide count, which then overrides
    OpenMP's per-thread one in MKL's GEMMs: a per-thread limit needs MKL's own per-thread setting."""
    import ctypes

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        # the C interface, by value (the lower-case symbol is the Fortran one, by reference)
        fn = ctypes.CDLL(path).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn


@contextlib.contextmanager
def one_thread():
    """A context in which the calling thread's torch CPU ops run on one thread. OpenMP's thread count
    is a per-thread setting, and so is MKL's local one: other threads, the caller's included, and
    threads started later keep theirs. ``torch.set_num_threads`` is not used: it changes the
    process-wide default, which is the caller's to choose. A no-op where the OpenMP runtime cannot be
    reached (``can_limit_threads``)."""
    ctl = _openmp_controller()
    if ctl is None:
        yield
        return
    # torch sets a thread's OpenMP count lazily, on its first parallel op, to torch's process-wide
    # count (once torch.set_num_threads was called): trigger that first, or it would undo the limit
    torch.get_num_threads()
    mkl = _mkl_set_local()
    with ctl.limit(limits=1):
        before = mkl(1) if mkl is not None else None
        try:
            yield
        finally:
            if mkl is not None:
                mkl(before)  # 0: back to MKL's process-wide count


def can_limit_threads() -> bool:
    return _openmp_controller() is not None


def run_units(fn, units) -> None:
    """fn(unit) for every unit of independent no-grad CPU work (each writes its own slice of the
    outputs). With torch using T > 1 threads, T Python workers each run whole units on one thread:
    a unit made of many mid-sized ops (NSA's windows of rows) leaves cores idle between and inside
    ops when one caller runs them T-threaded, and the workers keep every core busy (NSA prefill at
    32k: 1.4x from a second thread inside ops, 1.8x across units). Each worker limits only its own
    thread (``one_thread``); the caller's thread settings are untouched. Grad mode, inference mode
    and autocast are thread-local: workers run without grad and in the caller's inference mode (so
    they may write into its inference tensors); under autocast, or where a worker's thread count
    cannot be limited, the units run serially in the caller."""
    units = list(units)
    threads = torch.get_num_threads()
    if threads < 2 or len(units) < 2 or torch.is_autocast_enabled("cpu") or not can_limit_threads():
        for unit in units:
            fn(unit)
        return
    inference = torch.is_inference_mode_enabled()

    def call(unit):
        with one_thread(), torch.inference_mode(inference), torch.no_grad():
            fn(unit)

    with ThreadPoolExecutor(max_workers=min(threads, len(units))) as pool:
        for job in [pool.submit(call, unit) for unit in units]:
            job.result()


def resolve_backend(backend: str, *tensors: torch.Tensor, flex: bool = False) -> str:
    """'auto' -> 'flex' on CUDA tensors for an op (or selection) with a FlexAttention path (``flex``:
    ``methods/flex.py``), else 'triton' on CUDA, 'torch' otherwise; 'triton' on CPU needs the
    interpreter. 'flex' where the op has no flex path runs what 'auto' runs without it (an exact
    call inside a route configured for flex)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: got {shown(backend)}; allowed: {', '.join(BACKENDS)}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "flex" or (backend == "auto" and flex and on_cuda):
        if flex and flex_available():
            return "flex"
        if backend == "flex" and flex:
            raise RuntimeError(f"backend='flex' needs torch >= 2.11 (FlexAttention); this is torch {torch.__version__}")
        backend = "auto"
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the 'triton' package: pip install 'longpatch[triton]'")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return backend


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def flex_available() -> bool:
    """Whether this torch has the FlexAttention APIs ``methods/flex.py`` uses (torch >= 2.11: its
    ``enable_gqa``, ``return_lse`` and ``BlockMask.from_kv_blocks``; pyproject's floor)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 11)


def dense_pairs(q_shape, kv_len: int, causal: bool) -> int:
    """Query-key products of exact attention for queries of q_shape [b, hq, n, d] over kv_len keys
    (causal: bottom-right aligned, as the methods count theirs)."""
    b, hq, n, _ = q_shape
    per_head = n * kv_len - n * (n - 1) // 2 if causal else n * kv_len
    return b * hq * per_head
