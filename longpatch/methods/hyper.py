"""HyperAttention (Han et al. 2023, arXiv 2310.05869): sortLSH blocks + uniform column sampling.

How one non-causal call works (the "rectangle" routine, also used inside the causal recursion):

1. Hash every query and key row with ``r = lsh_num_projs`` Gaussian directions: bucket = the r sign
   bits. The sort key of a bucket is its rank in the reflected Gray sequence (inverse Gray code), so
   neighbouring ranks differ in exactly one bit (one hyperplane), i.e. are angular neighbours.
2. Stably sort Q and K by that key and cut both into ``nb`` aligned blocks (``nb`` from the longer
   side and ``block_size``); query block i attends exactly to key block i.
3. ``sample_size`` positions of the sorted key order are drawn uniformly without replacement, once
   per rectangle and shared by batch and heads (each head's own sort maps them to different keys; a
   uniform key sample either way). A query ignores the samples lying in its own key block (already
   counted exactly); the others stand for the N_out keys outside the block with weight
   N_out / m_out, m_out being how many samples fall outside that block. This ratio estimator is
   unbiased for the out-of-block row sum given m_out, exact when those keys are exchangeable, and
   exact (weight 1) once every key is sampled. (The weight n_keys/m is unbiased too, but noisier:
   it ignores how many samples the own-block mask removed.)
4. Block part and sampled part are combined by their log-sum-exps. We do it in one softmax per
   block over ``[block keys ++ samples]`` with an additive bias (0 for the block, -inf for padding
   and own-block samples, log(N_out/m_out) for the others): mathematically the LSE merge of the two
   parts, but one fused attention call instead of two plus a merge.
5. Rows are scattered back to their original order.

Causal (Alg. 4): the square is split in halves recursively while both halves have at least
``min_seq_len`` rows; leaves get exact causal attention, every off-diagonal rectangle (Q2, K1) the
routine above, and a row's pieces are merged by LSE. So every approximated piece has at least
min_seq_len queries and keys; anything smaller is exact (see ``hyper_attention``). Calls are
batched: the leaves of one length, and the rectangles of one recursion depth and shape, run as a few
large attention calls (chunks of a few MB, so memory is reused).

Nothing here builds an n x n matrix: the largest score tile is a leaf (under (2 min_seq_len)^2, inside
the fused attention kernel) or a block (block_size x (block_size + sample_size)).
"""
from __future__ import annotations

import torch

from ..errors import check_int
from .base import Between, Method, Param, optional_int, positive_int, register_method
from .common import (
    acc_dtype,
    check_qkv,
    check_seed,
    default_scale,
    guards_nonfinite,
    layer_seed_of,
    merge_lse,
    one_thread,
    resolve_backend,
)
from .exact import exact_attention
from .lse_attention import attend
from .lse_attention import attention_lse_reference as lse_reference

DEFAULT_SEED = 0  # used when seed is None: HyperAttention is deterministic unless asked otherwise
_SAMPLE_STREAM = 0x5EED_CAFE  # keeps the sampling stream apart from the direction stream of one seed


# --------------------------------------------------------------------------- sortLSH

def gray_rank(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Position of each bucket in the reflected Gray sequence G(i) = i ^ (i >> 1).

    The inverse of G is the prefix XOR of the bits from the top: rank = c ^ c>>1 ^ c>>2 ^ ...
    Sorting buckets by this rank puts buckets that differ in one bit next to each other.
    """
    rank = codes.clone()
    shift = 1
    while shift < bits:
        rank ^= rank >> shift
        shift <<= 1
    return rank


def lsh_directions(head_dim: int, num_projs: int, seed: int | None = None) -> torch.Tensor:
    """[head_dim, num_projs] float32 Gaussian directions, drawn on the CPU from ``seed``
    (None -> DEFAULT_SEED) so that every device gets the same hash."""
    g = torch.Generator(device="cpu").manual_seed(DEFAULT_SEED if seed is None else int(seed))
    return torch.randn(head_dim, num_projs, generator=g, dtype=torch.float32)


def lsh_sort_keys(x: torch.Tensor, dirs: torch.Tensor) -> torch.Tensor:
    """Sort key (Gray rank of the sign-bit bucket) of every row of x [..., n, d] -> int64 [..., n]."""
    r = dirs.shape[1]
    bits = torch.matmul(dirs.t(), x.float().transpose(-1, -2)) > 0  # [..., r, n]: the fast GEMM shape
    weights = (2 ** torch.arange(r, device=x.device, dtype=torch.int64)).view(r, 1)
    codes = (bits.to(torch.int64) * weights).sum(-2)
    return gray_rank(codes, r)


# --------------------------------------------------------------------------- attention primitive

def attention_lse_reference(q, k, v, *, causal: bool, scale: float, bias=None):
    """Plain PyTorch twin of every attention call HyperAttention makes (and of the Triton kernel):
    q [B, Hq, Lq, d], k/v [B, Hk, Lk, d], optional float additive ``bias`` [B, Hk or 1, Lk] (per
    key), causal aligned bottom-right: ``lse_attention.attention_lse_reference`` with the bias as a mask."""
    mask = None
    if bias is not None:  # per key -> additive mask per query head, broadcast over the query rows
        mask = bias.float().repeat_interleave(q.shape[1] // bias.shape[1], dim=1).unsqueeze(2)
    return lse_reference(q, k, v, scale, causal=causal, mask=mask)


def _attend(q, k, v, *, causal: bool, scale: float, bias, backend: str):
    """(out, lse) of one batched attention call; bias [B, 1, Lk] float32 or None."""
    if backend == "triton":
        from ..kernels.attention import flash_attention
        return flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True, key_bias=bias)
    return attend(q, k, v, scale, causal=causal, mask=None if bias is None else bias.unsqueeze(2))


# --------------------------------------------------------------------------- the op

@guards_nonfinite
def hyper_attention(q, k, v, *, causal: bool = True, scale: float | None = None, block_size: int = 256,
                    sample_size: int = 256, lsh_num_projs: int = 7, min_seq_len: int = 4096,
                    seed: int | None = None, lsh_dirs: torch.Tensor | None = None, return_lse: bool = False,
                    backend: str = "auto"):
    """HyperAttention on the shared layout (q [b, hq, n, d], k/v [b, hk, n, d]).

    Exactness: the call is exact attention when kv_len <= min_seq_len or q_len < min_seq_len; inside,
    a piece is approximated only when it has at least min_seq_len queries and keys (a causal square
    of fewer than 2 * min_seq_len rows is one exact leaf; the rectangle of keys before the queries
    is exact when it has fewer than min_seq_len keys). ``lsh_dirs`` [d, lsh_num_projs] (the patched
    layer's buffer) or, when None, directions drawn from ``seed``; column sampling is seeded from ``seed``
    too (None -> DEFAULT_SEED = 0), so equal seeds give identical outputs. Returns the output
    [b, hq, nq, d] (and the LSE [b, hq, nq], float32 or float64 for float64 inputs, with
    ``return_lse``). Float64 inputs are computed in float64. A NaN/inf in a key or value row makes
    the rows that attend to it NaN and leaves the others as they would be (``isolate_nonfinite``).
    When q_len < kv_len under ``causal`` the queries are the last q_len positions: keys before them
    are a non-causal rectangle, the rest a causal square.
    """
    _, nq, nk = check_qkv(q, k, v, causal)
    for name, val in (("block_size", block_size), ("sample_size", sample_size), ("min_seq_len", min_seq_len)):
        check_int(f"hyper_attention: {name}", val, 1)
    check_int("hyper_attention: lsh_num_projs", lsh_num_projs, 1, 30)
    check_seed("hyper_attention", seed)
    d = q.shape[-1]
    scale = default_scale(scale, d)
    backend = resolve_backend(backend, q, k, v)
    if nq == 0:
        out = q.new_zeros(q.shape)
        return (out, q.new_zeros(q.shape[:3], dtype=torch.float32)) if return_lse else out
    if nk <= min_seq_len or nq < min_seq_len:  # every piece would be smaller than min_seq_len: exact
        if not return_lse:
            return exact_attention(q, k, v, causal=causal, scale=scale, backend=backend)
        if not causal or nq == nk:
            return _attend(q, k, v, causal=causal, scale=scale, bias=None, backend=backend)
        return exact_attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend)

    seed = DEFAULT_SEED if seed is None else int(seed)
    if lsh_dirs is None:
        lsh_dirs = lsh_directions(d, lsh_num_projs, seed)
    if lsh_dirs.dim() != 2 or lsh_dirs.shape[0] != d:
        raise ValueError(f"hyper_attention: lsh_dirs must be [head_dim={d}, num_projs]; got {tuple(lsh_dirs.shape)}")
    gen = torch.Generator(device=q.device)
    gen.manual_seed((seed * 1_000_003 + _SAMPLE_STREAM) % (2 ** 63))
    run = _Run(q, k, v, scale, block_size, sample_size, min_seq_len, lsh_dirs.to(q.device, torch.float32), gen, backend)
    out, lse = run.causal() if causal else run.full()
    return (out, lse) if return_lse else out


_stage = torch.profiler.record_function  # named stages in torch.profiler traces


def _serial():
    """Run a stretch of small O(n) ops (hashing, index building, merges) on one intra-op thread.

    Each of them takes microseconds, but every parallel op ends on a barrier: when another process
    holds one of the cores, each barrier waits for a descheduled thread, and a HyperAttention call
    has a few hundred such ops (measured on a loaded 2-core VM, n = 32k causal: 360 ms with one
    thread, 800 ms with two; 450 ms with two and these stretches serial). The attention calls keep
    all threads. Only the calling thread is limited (``one_thread``): the process-wide thread count
    stays the caller's."""
    return one_thread()


# Elements of gathered keys per attention call: chunks stay in cache and small enough for the
# allocator to reuse memory (fresh large allocations cost page faults on every call).
_CHUNK_ELEMS = 1 << 21


class _Acc:
    """Running (out, lse) of every query row, fed by pieces over disjoint key sets.

    Without autograd the pieces are merged in place, chunk by chunk, into one buffer (fp32 unless the
    input already is). With autograd, the pieces of one stage are collected, scattered to full length
    and merged functionally (``merge_lse``) so that gradients reach every piece, LSE included.
    """

    def __init__(self, b, hq, n, d, dtype, device, inplace):
        self.shape, self.R, self.d, self.dtype, self.inplace = (b, hq, n), b * hq * n, d, dtype, inplace
        if inplace:  # float32 sums (float64 for float64 inputs, LSEs included)
            self.o = torch.empty(self.R + 1, d, dtype=acc_dtype(dtype), device=device)  # last row: padding sink
            self.l = torch.full((self.R + 1,), float("-inf"), dtype=acc_dtype(dtype), device=device)
        else:
            self.o = self.l = None
            self.pending = []

    def view(self):
        b, hq, n = self.shape
        return self.o[:self.R].view(b, hq, n, self.d), self.l[:self.R].view(b, hq, n)

    def put(self, rows, o, l):
        """First stage: rows not seen before."""
        if self.inplace:
            self.o.index_copy_(0, rows, o.to(self.o.dtype))
            self.l.index_copy_(0, rows, l.to(self.l.dtype))
        else:
            self.pending.append((rows, o, l))

    def merge(self, rows, o, l):
        if not self.inplace:
            self.pending.append((rows, o, l))
            return
        o_old = self.o.index_select(0, rows)
        l_old = self.l.index_select(0, rows)
        l = l.to(l_old.dtype)
        # new share of the merged row: e^l / (e^l + e^l_old); the old share is its complement
        w_new = torch.sigmoid(l - l_old).unsqueeze(-1)
        self.o.index_copy_(0, rows, torch.lerp(o_old, o.to(self.o.dtype), w_new.to(self.o.dtype)))
        self.l.index_copy_(0, rows, torch.logaddexp(l_old, l))

    def end_stage(self):
        if self.inplace or not self.pending:
            return
        rows = torch.cat([r for r, _, _ in self.pending])
        o = torch.cat([x for _, x, _ in self.pending])
        l = torch.cat([x for _, _, x in self.pending])
        self.pending = []
        o_full = o.new_zeros(self.R + 1, self.d).index_copy(0, rows, o)[:self.R]
        l_full = l.new_full((self.R + 1,), float("-inf")).index_copy(0, rows, l)[:self.R]
        b, hq, n = self.shape
        o_full, l_full = o_full.view(b, hq, n, self.d), l_full.view(b, hq, n)
        if self.o is None:
            self.o, self.l = o_full, l_full
        else:
            self.o, self.l = merge_lse(self.o, self.l, o_full, l_full)

    def result(self):
        self.end_stage()
        if self.inplace:
            o, l = self.view()
            return o.to(self.dtype), l
        return self.o.to(self.dtype), self.l


class _Run:
    """State of one hyper_attention call: flattened rows, hash keys, and the pieces it computes."""

    def __init__(self, q, k, v, scale, block_size, sample_size, min_seq_len, dirs, gen, backend):
        self.b, self.hq, self.nq, self.d = q.shape
        self.hk, self.nk = k.shape[1], k.shape[2]
        self.g = self.hq // self.hk
        self.q, self.k, self.v = q, k, v
        self.scale, self.block, self.samples, self.min_seq_len = scale, block_size, sample_size, min_seq_len
        self.gen, self.backend, self.dev = gen, backend, q.device
        # float64 inputs get float64 log-weights (the kernels take a float32 bias otherwise)
        self.bias_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.qf = q.reshape(-1, self.d)  # row (bi*hq + h)*nq + pos
        self.kf = k.reshape(-1, self.d)  # row (bi*hk + h)*nk + pos
        self.vf = v.reshape(-1, self.d)
        with _stage("hyper.hash"), _serial():
            self.qkey = lsh_sort_keys(q, dirs)  # [b, hq, nq]
            self.kkey = lsh_sort_keys(k, dirs)  # [b, hk, nk]
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        self.acc = _Acc(self.b, self.hq, self.nq, self.d, q.dtype, q.device, inplace=not grad)

    # ---- entry points
    def full(self):
        zero = torch.zeros(1, dtype=torch.int64)
        for rows, o, l in self.rectangles(zero, self.nq, zero, self.nk):
            with _stage("hyper.merge"), _serial():
                self.acc.put(rows, o, l)
        return self.acc.result()

    def causal(self):
        off = self.nk - self.nq  # keys [0, off) are visible to every query (bottom-right alignment)
        leaves, rects = [], {}
        self._plan(0, self.nq, off, 0, leaves, rects)
        with _stage("hyper.leaves"):
            self.leaves(leaves, off)
            self.acc.end_stage()
        if 0 < off < self.min_seq_len:  # the keys before the queries: a rectangle, exact when small
            with _stage("hyper.prefix"):
                o, l = _attend(self.q, self.k[:, :, :off], self.v[:, :, :off], causal=False, scale=self.scale,
                               bias=None, backend=self.backend)
                self.acc.merge(torch.arange(self.acc.R, device=self.dev), o.reshape(-1, self.d), l.reshape(-1))
                self.acc.end_stage()
        elif off > 0:
            rects[(-1, self.nq, off)] = [(0, 0)]
        for (_, nq, nk), items in sorted(rects.items()):
            qs = torch.tensor([s for s, _ in items], dtype=torch.int64)
            ks = torch.tensor([s for _, s in items], dtype=torch.int64)
            for rows, o, l in self.rectangles(qs, nq, ks, nk):
                with _stage("hyper.merge"), _serial():
                    self.acc.merge(rows, o, l)
            with _stage("hyper.merge"):
                self.acc.end_stage()
        return self.acc.result()

    def _plan(self, s, e, off, depth, leaves, rects):
        # Alg. 4 on queries [s, e) and keys off+[s, e), the off-diagonal rectangles (Q2, K1) grouped
        # by (depth, shape) to be batched. A square is halved only when both halves have at least
        # min_seq_len rows: a smaller rectangle would be computed exactly (approximating it costs
        # accuracy and saves little), and then its square is exact attention, done as one causal leaf.
        # Lengths min_seq_len * 2^j split as in Alg. 4; other lengths get leaves of up to
        # 2 * min_seq_len - 1 rows instead of rectangles below min_seq_len.
        if (e - s) // 2 < self.min_seq_len:
            leaves.append((s, e))
            return
        mid = s + (e - s) // 2
        rects.setdefault((depth, e - mid, mid - s), []).append((mid, off + s))
        self._plan(s, mid, off, depth + 1, leaves, rects)
        self._plan(mid, e, off, depth + 1, leaves, rects)

    # ---- exact causal leaves
    def leaves(self, leaves, off):
        """Exact causal attention on diagonal squares: queries [s, e), keys off + [s, e)."""
        b, hq, hk, d, n, dev = self.b, self.hq, self.hk, self.d, self.nq, self.dev
        by_len: dict[int, list[int]] = {}
        for s, e in leaves:
            by_len.setdefault(e - s, []).append(s)
        for L, starts in sorted(by_len.items()):
            per_call = max(1, _CHUNK_ELEMS // (L * d * hq))
            uniform = len(by_len) == 1 and off == 0  # equal leaves tiling [0, n): strided views
            for bi in range(b):
                for c in range(0, len(starts), per_call):
                    st = starts[c:c + per_call]
                    S = len(st)
                    if uniform:
                        sl = slice(st[0], st[0] + S * L)
                        qb = self.q[bi, :, sl].reshape(hq, S, L, d).transpose(0, 1)  # [S, hq, L, d]
                        kb = self.k[bi, :, sl].reshape(hk, S, L, d).transpose(0, 1)
                        vb = self.v[bi, :, sl].reshape(hk, S, L, d).transpose(0, 1)
                    else:
                        idx = torch.tensor(st, device=dev).unsqueeze(1) + torch.arange(L, device=dev)  # [S, L]
                        qb = self.q[bi][:, idx].transpose(0, 1)
                        kb = self.k[bi][:, idx + off].transpose(0, 1)
                        vb = self.v[bi][:, idx + off].transpose(0, 1)
                    o, l = _attend(qb, kb, vb, causal=True, scale=self.scale, bias=None, backend=self.backend)
                    if uniform and self.acc.inplace:
                        ov, lv = self.acc.view()
                        ov[bi, :, sl].view(hq, S, L, d).copy_(o.transpose(0, 1))
                        lv[bi, :, sl].view(hq, S, L).copy_(l.transpose(0, 1))
                        continue
                    pos = torch.tensor(st, device=dev).view(S, 1, 1) + torch.arange(L, device=dev)  # [S,1,L]
                    rows = (bi * hq + torch.arange(hq, device=dev)).view(1, hq, 1) * n + pos
                    self.acc.put(rows.reshape(-1), o.reshape(-1, d), l.reshape(-1))

    # ---- non-causal rectangles (the sortLSH + sampling routine)
    def rectangles(self, q_starts, nq, k_starts, nk):
        """Approximate attention of S rectangles (queries q_starts[s] + [0, nq) against keys
        k_starts[s] + [0, nk)), batched. Yields chunks (flat output rows, padding -> the sink row;
        outputs [rows, d]; LSEs [rows])."""
        stage, serial = _stage("hyper.sort_sample_index"), _serial()
        stage.__enter__()
        serial.__enter__()
        b, hk, g, d, dev = self.b, self.hk, self.g, self.d, self.dev
        S = q_starts.numel()
        q_starts, k_starts = q_starts.to(dev), k_starts.to(dev)
        ar_q = torch.arange(nq, device=dev)
        ar_k = torch.arange(nk, device=dev)
        # sortLSH: stable sort of each rectangle's rows by Gray rank
        qkey = self.qkey[:, :, q_starts.unsqueeze(1) + ar_q]  # [b, hq, S, nq]
        kkey = self.kkey[:, :, k_starts.unsqueeze(1) + ar_k]  # [b, hk, S, nk]
        qperm = torch.sort(qkey, dim=-1, stable=True).indices.view(b, hk, g, S, nq)
        kperm = torch.sort(kkey, dim=-1, stable=True).indices
        nb = -(-max(nq, nk) // self.block)
        bq, bk = -(-nq // nb), -(-nk // nb)
        m = min(self.samples, nk)

        # queries, folded per block as [g * bq] rows (the query heads of a group share K/V)
        qpos = torch.clamp(torch.arange(nb * bq, device=dev), max=nq - 1)
        qloc = qperm[..., qpos].view(b, hk, g, S, nb, bq).permute(0, 1, 3, 4, 2, 5)  # [b,hk,S,nb,g,bq]
        heads = (torch.arange(b, device=dev).view(b, 1, 1) * self.hq
                 + torch.arange(hk, device=dev).view(1, hk, 1) * g + torch.arange(g, device=dev).view(1, 1, g))
        qrows = (heads * self.nq).view(b, hk, 1, 1, g, 1) + q_starts.view(1, 1, S, 1, 1, 1) + qloc
        padded_q = (torch.arange(nb * bq, device=dev) >= nq).view(1, 1, 1, nb, 1, bq)
        out_rows = torch.where(padded_q, self.b * self.hq * self.nq, qrows).reshape(-1)  # padding -> sink
        qrows = qrows.reshape(-1)

        # keys: the block's keys then the uniform samples. Sample positions are drawn in the sorted
        # order, once per rectangle and shared by batch and heads (each head's sort makes them
        # different keys): a uniform sample all the same, and GQA equals repeated K/V exactly.
        if m >= nk:
            spos = ar_k.expand(S, nk)
        else:
            u = torch.rand(S, nk, generator=self.gen, device=dev)
            spos = torch.topk(u, m, dim=-1, sorted=False).indices  # [S, m]
        bpos = torch.arange(nb * bk, device=dev).view(nb, bk)
        kpos = torch.cat([torch.clamp(bpos, max=nk - 1).expand(S, nb, bk), spos.unsqueeze(1).expand(S, nb, m)], dim=-1)
        kloc = torch.gather(kperm, -1, kpos.reshape(1, 1, S, -1).expand(b, hk, S, -1)).view(b, hk, S, nb, bk + m)
        kbase = (torch.arange(b, device=dev).view(b, 1) * hk + torch.arange(hk, device=dev).view(1, hk)) * self.nk
        krows = (kbase.view(b, hk, 1, 1, 1) + k_starts.view(1, 1, S, 1, 1) + kloc).reshape(-1)

        # additive bias: 0 on real block keys, -inf on padding and on samples of the own block,
        # log(N_out / m_out) on the other samples (ratio estimator of the out-of-block row sum)
        blk = torch.arange(nb, device=dev)
        own = torch.div(spos, bk, rounding_mode="floor").unsqueeze(1) == blk.view(1, nb, 1)  # [S, nb, m]
        m_out = (m - own.sum(-1)).to(self.bias_dtype)  # [S, nb]
        n_out = (nk - torch.clamp(nk - blk * bk, min=0, max=bk)).to(self.bias_dtype)  # [nb]
        logw = torch.log(n_out) - torch.log(m_out.clamp(min=1))
        neg_inf = torch.tensor(float("-inf"), dtype=self.bias_dtype, device=dev)
        sbias = torch.where(own, neg_inf, logw.unsqueeze(-1))
        kbias = torch.where(bpos < nk, 0.0, neg_inf).expand(S, nb, bk)
        bias = torch.cat([kbias, sbias], dim=-1)  # [S, nb, bk + m], the same for every (batch, head)
        bias = bias.expand(b * hk, S, nb, bk + m).reshape(-1, 1, bk + m)

        B, kw, qw = b * hk * S * nb, bk + m, g * bq
        serial.__exit__(None, None, None)
        stage.__exit__(None, None, None)
        per_call = max(1, _CHUNK_ELEMS // (kw * d))
        for c0 in range(0, B, per_call):
            c1 = min(B, c0 + per_call)
            with _stage("hyper.gather"), _serial():
                qb = self.qf.index_select(0, qrows[c0 * qw:c1 * qw]).view(c1 - c0, 1, qw, d)
                kr = krows[c0 * kw:c1 * kw]
                kc = self.kf.index_select(0, kr).view(c1 - c0, 1, kw, d)
                vc = self.vf.index_select(0, kr).view(c1 - c0, 1, kw, d)
            with _stage("hyper.blocks"):
                o, l = _attend(qb, kc, vc, causal=False, scale=self.scale, bias=bias[c0:c1], backend=self.backend)
            yield out_rows[c0 * qw:c1 * qw], o.reshape(-1, d), l.reshape(-1)


# --------------------------------------------------------------------------- registration

def _prefill(q, k, v, *, causal=True, scale=None, backend="auto", buffers=None, **params):
    dirs = (buffers or {}).get("lsh_dirs")
    return hyper_attention(q, k, v, causal=causal, scale=scale, backend=backend, lsh_dirs=dirs, **params)


def _exact_when(q_len: int, kv_len: int, params: dict) -> bool:
    """Where hyper_attention is exact whatever ``causal`` is (its first check)."""
    return kv_len <= params["min_seq_len"] or q_len < params["min_seq_len"]


def _exact_params(n: int, params: dict) -> dict:
    return {"min_seq_len": max(n, params["min_seq_len"])}


def _make_buffers(*, head_dim: int, lsh_num_projs: int = 7, seed: int | None = None, layer_seed: int | None = None,
                  **_):
    """{"lsh_dirs": [head_dim, lsh_num_projs]} from ``seed`` (None -> 0); an optional ``layer_seed``
    gives each layer its own directions."""
    return {"lsh_dirs": lsh_directions(head_dim, lsh_num_projs, layer_seed_of(seed, layer_seed))}


HYPER = register_method(Method(
    name="hyper",
    summary="HyperAttention: sortLSH (Gray-ordered buckets) diagonal blocks + uniform column sampling; "
            "causal by recursion",
    prefill=_prefill,
    takes_chunks=True,  # hyper_attention runs q_len < kv_len: the keys before the queries are one more rectangle
    params={
        "block_size": positive_int("rows per diagonal block of the LSH-sorted Q/K (exact attention inside a block)",
                                   256),
        "sample_size": positive_int("key columns sampled uniformly per rectangle to estimate the rest of each row",
                                    256),
        "lsh_num_projs": Param(7, (int,), "random hyperplanes of the LSH (2^r buckets, Gray-ordered)",
                               Between(1, 30), "an int in [1, 30]"),
        "min_seq_len": positive_int("exact attention at or below this length; only pieces with at least this many "
                                    "queries and keys are approximated (causal squares below twice it are exact)",
                                    4096),
        "seed": optional_int("seed of the LSH directions and of the column sampling (null -> 0)"),
    },
    make_buffers=_make_buffers,
    exact_when=_exact_when,
    exact_params=_exact_params,
))
