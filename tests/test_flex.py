"""The FlexAttention executor (longpatch/methods/flex.py) on the CPU: its mask tables against the
executor's definition (no compile), and the compiled path against the torch executor's output.

Compiles take 10-60 s each on a 2-core CPU, one per configuration (block size, scale, window):
the default run compiles two (moba's and nsa's block-sparse call share one; nsa's window is the
other); the others are marked slow."""
from types import SimpleNamespace

import pytest
import torch

from longpatch.config import PatchConfig
from longpatch.errors import ConfigError
from longpatch.methods import flex
from longpatch.methods.blocksparse import block_mask_reference, block_sparse_prefill
from longpatch.methods.common import resolve_backend
from longpatch.ops import moba_attention, nsa_attention, sparse_attention

needs_flex = pytest.mark.skipif(not flex.flex_available(), reason="torch without FlexAttention (needs >= 2.11)")

D = 32  # one head size (one scale) in every compiled test: a compile per configuration


def qkv(n, hq=4, hk=2, d=D, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for h in (hq, hk, hk))


def random_blocks(b, hk, n, block, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // block)
    out = torch.full((b, hk, nb, S), -1, dtype=torch.long)
    for bi in range(b):
        for h in range(hk):
            for i in range(1, nb):
                pick = torch.randperm(i, generator=g)[:S]
                out[bi, h, i, :len(pick)] = pick
    return out


def dense_of(tables, mask_mod, n, block):
    """Bool [B, H, n, n] of a BlockMask's tables (partial counts/indices, full counts/indices), the
    partial blocks cut by mask_mod: what FlexAttention attends."""
    pn, pi, fn, fi = tables
    B, H, nb = pn.shape
    pos = torch.arange(nb * block)
    out = torch.zeros(B, H, nb * block, nb * block, dtype=torch.bool)
    for bi in range(B):
        for h in range(H):
            for i in range(nb):
                rows = slice(i * block, (i + 1) * block)
                for j in fi[bi, h, i, :fn[bi, h, i]].tolist():
                    out[bi, h, rows, j * block:(j + 1) * block] = True
                for j in pi[bi, h, i, :pn[bi, h, i]].tolist():
                    cols = slice(j * block, (j + 1) * block)
                    out[bi, h, rows, cols] |= mask_mod(0, 0, pos[rows, None], pos[None, cols])
    return out[:, :, :n, :n]


@pytest.mark.parametrize("n,block,S", [(333, 64, 3), (256, 64, 0), (100, 16, 5)])
def test_block_tables_are_the_executors_definition(n, block, S):
    blocks = random_blocks(2, 2, n, block, S)
    nb = blocks.shape[2]
    tables = flex._own_and_listed(blocks.reshape(4, 1, nb, -1), nb)
    # both index tables nb wide: the CPU template reads them so, and on CUDA (torch 2.11, an H100) a partial
    # table 1 wide beside a full table S wide gave wrong outputs (0.22 relative error)
    assert tables[1].shape[-1] == nb and tables[3].shape[-1] == nb
    got = dense_of(tables, flex._causal, n, block).view(2, 2, n, n)
    assert torch.equal(got, block_mask_reference(blocks, n, block))


@pytest.mark.parametrize("n,block,window,glob,dilation", [
    (333, 64, 100, 16, 1), (500, 128, 1024, 64, 1), (130, 16, 7, 0, 1), (257, 32, 64, 33, 1), (333, 64, 40, 16, 3),
    (200, 16, 9, 0, 7)])
@pytest.mark.parametrize("wide", [True, False])
def test_band_tables_are_the_band(n, block, window, glob, dilation, wide):
    from longpatch.methods.sparse import SparsePattern

    tables = flex._band_tables(n, n, block, window, glob, "cpu", wide, dilation)
    got = dense_of(tables, flex._band_mod(window, glob, dilation), n, block)[0, 0]
    p, c = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    pat = SparsePattern(window=window, global_tokens=glob, dilation=dilation)
    assert torch.equal(got, (c <= p) & ((c < glob) | pat.in_window(p, c)))  # sparse's own definition
    full = tables[2]
    assert int(full.max()) > 0 or window < 2 * block or dilation > 1  # the band's inside runs maskless


def test_bad_backend_is_one_line():
    for cfg, words in ((dict(method="moba", backend="flax"), "allowed: auto, torch, triton, flex"),
                       (dict(method="hyper", backend="flex"), "method 'hyper' has no FlexAttention path"),
                       (dict(method="nsa", backend="flex"), "selection 'compressed'")):
        with pytest.raises(ConfigError) as e:
            PatchConfig(**cfg)
        assert words in str(e.value) and "\n" not in str(e.value)
    PatchConfig(method="moba", backend="flex", params={"selection": "estimate"})
    PatchConfig(method="moba", backend="flex")  # the gate runs on flex too
    PatchConfig(method="sparse", backend="flex")
    with pytest.raises(ConfigError, match="backend: got 'flax'"):
        resolve_backend("flax", torch.zeros(1))


def test_auto_picks_flex_on_cuda_for_block_selections():
    cuda = SimpleNamespace(is_cuda=True)
    assert resolve_backend("auto", cuda, flex=True) == "flex"
    assert resolve_backend("auto", cuda, flex=False) in ("triton", "torch")  # hyper: as before
    assert resolve_backend("auto", torch.zeros(1), flex=True) == "torch"  # the CPU keeps its own paths
    assert resolve_backend("flex", torch.zeros(1), flex=True) == "flex"  # asked for: compiled on the CPU too
    assert resolve_backend("flex", torch.zeros(1), flex=False) == "torch"  # an exact call inside a flex route


def test_cpu_calls_flex_cannot_run_take_the_torch_path():
    """On the CPU the compiled template has no LSE and no backward: such calls run the torch path."""
    q, k, v = qkv(200)
    kw = dict(selection="estimate", chunk_size=64, topk=3)
    o1, l1 = moba_attention(q, k, v, backend="flex", return_lse=True, **kw)  # no compile: torch path
    o2, l2 = moba_attention(q, k, v, backend="torch", return_lse=True, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert not flex.supports(q.requires_grad_(), k, v, 64)
    assert not flex.supports(q.detach().double(), k.double(), v.double(), 64)
    assert not flex.supports(q.detach(), k, v, 24)  # the GPU kernel's tiles: multiples of 16


# --------------------------------------------------------------------------- compiled

@needs_flex
def test_flex_block_sparse_equals_the_executor_ragged_gqa_causal():
    """One compile (block 64, d 32): several ragged lengths and a batch of 2 with 4 query heads over
    2 KV heads run on it (dynamic shapes), equal to the torch executor; perturbing the keys and
    values after a position leaves every row before it unchanged."""
    scale = D ** -0.5
    with torch.no_grad():
        for n, S in ((333, 3), (200, 2)):
            q, k, v = qkv(n)
            blocks = random_blocks(2, 2, n, 64, S, seed=n)
            out, lse = flex.flex_block_sparse(q, k, v, blocks, 64, scale, need_lse=False)
            ref, _ = block_sparse_prefill(q, k, v, blocks, 64, scale)
            assert lse is None and out.shape == q.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
        t = 150
        k2, v2 = k.clone(), v.clone()
        k2[:, :, t + 1:] += 3 * torch.randn_like(k2[:, :, t + 1:])
        v2[:, :, t + 1:] += 3 * torch.randn_like(v2[:, :, t + 1:])
        out2, _ = flex.flex_block_sparse(q, k2, v2, blocks, 64, scale, need_lse=False)
    torch.testing.assert_close(out2[:, :, :t + 1], out[:, :, :t + 1], rtol=0, atol=1e-6)
    assert (out2[:, :, t + 1:] - out[:, :, t + 1:]).abs().max() > 0.1


@needs_flex
def test_moba_and_nsa_on_flex_equal_their_torch_paths():
    """The ops with backend="flex" (their selection, then the flex executor; NSA's window as a flex
    band) against backend="torch", fp32."""
    q, k, v = qkv(333)
    kw = dict(selection="estimate", chunk_size=64, topk=4, mass=0.9)
    torch.testing.assert_close(moba_attention(q, k, v, backend="flex", **kw),
                               moba_attention(q, k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)
    kw = dict(selection="estimate", select_block=64, num_selected=4, window=96, gates=(0.0, 0.75, 0.25))
    torch.testing.assert_close(nsa_attention(q, k, v, backend="flex", **kw),
                               nsa_attention(q, k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)


@needs_flex
def test_prefill_chunks_on_flex_equal_their_torch_paths():
    """Prefill chunks (the queries the last positions of the keys, from a block start) of moba and nsa on
    flex (the executor's tables shifted to the chunk's blocks, the causal mask and NSA's band offset by the
    chunk's first position) against the torch paths, at two offsets: one compile per call for every offset."""
    q, k, v = qkv(333)
    with torch.no_grad():
        for off in (128, 256):
            kw = dict(selection="hybrid", chunk_size=64, topk=4, mass=0.9, estimate_queries=16, score_stride=16)
            torch.testing.assert_close(moba_attention(q[:, :, off:], k, v, backend="flex", **kw),
                                       moba_attention(q[:, :, off:], k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)
            kw = dict(selection="hybrid", select_block=64, num_selected=4, window=96, gates=(0.0, 0.75, 0.25),
                      estimate_queries=16, score_stride=16)
            torch.testing.assert_close(nsa_attention(q[:, :, off:], k, v, backend="flex", **kw),
                                       nsa_attention(q[:, :, off:], k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)


@needs_flex
def test_one_token_steps_on_flex_equal_their_torch_paths():
    """A one-token step of moba and nsa (query-aware: the kept blocks, decode_topk more by their key
    bounds, the own and local blocks) as one flex call over the blocks, at ragged cache lengths: one
    compile (block 64, one local block before the own one, d 32) for both methods and every length."""
    for n in (333, 640, 1001):
        q, k, v = qkv(n)
        q1 = q[:, :, -1:]
        kept = random_blocks(2, 2, n, 64, 3, seed=n)[:, :, -1]  # a prefill's list for the last block
        kw = dict(selection="estimate", chunk_size=64, topk=4, local_blocks=1, decode_topk=2, kept=kept)
        torch.testing.assert_close(moba_attention(q1, k, v, backend="flex", **kw),
                                   moba_attention(q1, k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)
        state = {"kept": kept}
        kw = dict(selection="estimate", select_block=64, num_selected=4, window=96, local_blocks=2,
                  gates=(0.0, 0.75, 0.25), decode_topk=2)
        torch.testing.assert_close(nsa_attention(q1, k, v, backend="flex", state=dict(state), **kw),
                                   nsa_attention(q1, k, v, backend="torch", state=dict(state), **kw),
                                   rtol=1e-5, atol=2e-6)


@needs_flex
@pytest.mark.slow
def test_moba_gate_on_flex_equals_its_torch_path():
    """MoBA's gate (each query row its own top-k chunks by q . chunk mean, per head or shared by the
    KV group) as a table the flex mask reads, against the torch path, ragged lengths."""
    for n, shared in ((333, False), (640, True)):
        q, k, v = qkv(n)
        kw = dict(chunk_size=64, topk=3, shared_selection=shared)
        torch.testing.assert_close(moba_attention(q, k, v, backend="flex", **kw),
                                   moba_attention(q, k, v, backend="torch", **kw), rtol=1e-5, atol=2e-6)


def test_moba_gate_leaves_flex_where_it_does_not_compile():
    """The gate's flex mask does not compile for a batch of one on the CPU (torch 2.13) nor on CUDA (torch
    2.11, an H100): such calls run the fallback path, equal to it, and say so once."""
    q, k, v = qkv(200, b=1)
    assert not flex.gate_runs(q, k, v, 64, False)
    assert not flex.gate_runs(SimpleNamespace(shape=(2, 4, 200, D), is_cuda=True), k, v, 64, False)
    with torch.no_grad():
        torch.testing.assert_close(moba_attention(q, k, v, backend="flex", chunk_size=64, topk=3),
                                   moba_attention(q, k, v, backend="torch", chunk_size=64, topk=3), rtol=0, atol=0)


@needs_flex
@pytest.mark.slow
def test_sparse_on_flex_equals_its_torch_path():
    q, k, v = qkv(333)
    for n in (333, 150):
        a, b, c = q[:, :, :n], k[:, :, :n], v[:, :, :n]
        torch.testing.assert_close(sparse_attention(a, b, c, window=100, global_tokens=16, backend="flex"),
                                   sparse_attention(a, b, c, window=100, global_tokens=16, backend="torch"),
                                   rtol=1e-5, atol=2e-6)
    # random blocks and dilated windows (whose band mask torch 2.13's CPU template cannot compile): the
    # torch path runs them
    for kw in (dict(window=64, global_tokens=16, random_blocks=2, block=32), dict(window=40, dilation=3)):
        assert torch.equal(sparse_attention(q, k, v, backend="flex", **kw),
                           sparse_attention(q, k, v, backend="torch", **kw))


@needs_flex
@pytest.mark.slow
def test_flex_calls_compile_fullgraph_once_for_every_length():
    """The selection-to-BlockMask conversion and the call are one fullgraph compile (no graph break,
    no host round-trip); new lengths after the first two calls compile nothing new."""
    from torch._dynamo.utils import counters

    scale = D ** -0.5
    with torch.no_grad():
        for n in (333, 200):  # the first call may specialise, the second compiles the general form
            q, k, v = qkv(n)
            flex.flex_block_sparse(q, k, v, random_blocks(2, 2, n, 64, 2), 64, scale, need_lse=False)
        before = dict(counters["stats"])
        for n in (450, 129, 1000):
            q, k, v = qkv(n)
            out, _ = flex.flex_block_sparse(q, k, v, random_blocks(2, 2, n, 64, 2), 64, scale, need_lse=False)
            assert out.shape == q.shape
        assert counters["stats"].get("unique_graphs", 0) == before.get("unique_graphs", 0)
    assert not counters["graph_break"]


def test_compiled_calls_run_in_one_grad_mode_whatever_the_callers():
    """Grad mode is part of a compiled function's guards: a warm-up with grad enabled and a call under
    no_grad compiled twice on an H100. Inside, grad mode is whether an input needs a gradient."""
    seen = []
    fn = flex._Compiled(lambda *a: None, {})
    fn.fn = lambda *a, **kw: seen.append(torch.is_grad_enabled())  # the compiled function's place
    x = torch.zeros(1, 2, 3, 4)
    fn(x)
    with torch.no_grad():
        fn(x)
    fn(x.clone().requires_grad_())
    with torch.no_grad():
        fn(x.clone().requires_grad_())
    assert seen == [False, False, True, False]


@needs_flex
@pytest.mark.slow
def test_warm_up_reports_its_compile_time():
    res = flex.warm_up("cpu", torch.float32, heads=4, kv_heads=2, head_dim=D, blocks=(64,), bands=((96, 0),),
                       lengths=(150, 333))
    assert res["compile_s"] >= sum(s for _, s in res["calls"]) * 0.99 and len(res["calls"]) == 6


@needs_flex
@pytest.mark.slow
def test_gpu_flex_script_dry_run(tmp_path):
    """scripts/gpu_flex.py (issue 40's GPU figures) end to end, tiny, on the CPU."""
    from helpers import load_script

    out = tmp_path / "flex.json"
    load_script("gpu_flex").main(["--dry-run", "--lengths", "512", "--decode-len", "512", "--repeats", "1",
                                  "--out", str(out)])
    import json
    res = json.loads(out.read_text())
    assert res["meta"]["dry_run"] and res["warm_up"]["compile_s"] > 0
    assert not [r for r in res["prefill"] + res["decode"] if "error" in r]
    assert {(r["method"], r.get("backend")) for r in res["prefill"]} >= {("moba", "flex"), ("nsa", "flex"),
                                                                          ("sparse", "flex"), ("sdpa", None)}


QA_MOBA = dict(chunk_size=64, topk=4, mass=0.9, estimate_queries=16, local_blocks=1)
QA_NSA = dict(compress_block=16, compress_stride=8, select_block=64, num_selected=4, window=64, local_blocks=2,
              gates=(0.0, 0.9, 0.1), mass=0.9, estimate_queries=16)


def _qa_call(name, selection):
    op, params = (moba_attention, QA_MOBA) if name == "moba" else (nsa_attention, QA_NSA)
    extra = {"score_stride": 16} if selection == "hybrid" else {}

    def call(q, k, v, state):
        return op(q, k, v, backend="flex", selection=selection, state=state, **params, **extra)
    return call


@needs_flex
@pytest.mark.parametrize("name", ["moba", "nsa"])
@pytest.mark.parametrize("selection", ["estimate", "hybrid"])
def test_query_aware_prefill_traces_as_one_graph(name, selection):
    """A patched layer's query-aware prefill on flex (selection, work counters, executor, NSA's window)
    reads nothing back to the host: dynamo traces it whole, no graph break (the non-finite guard is
    off inside a compiled region; the counters stay on the device)."""
    q, k, v = qkv(600, b=1)
    with torch.no_grad():
        ex = torch._dynamo.explain(_qa_call(name, selection))(q, k, v, {})
    assert ex.graph_break_count == 0, [b.reason.splitlines()[0] for b in ex.break_reasons]


@needs_flex
@pytest.mark.parametrize("name,selection", [("moba", "hybrid"),
                                            pytest.param("nsa", "estimate", marks=pytest.mark.slow)])
def test_query_aware_prefill_compiles_fullgraph_and_equals_eager(name, selection):
    """torch.compile(fullgraph=True) of the whole prefill (what a compiled model runs) gives the eager
    flex call's output and work counts, and the torch path's output."""
    q, k, v = qkv(600, b=1, seed=3)
    call = _qa_call(name, selection)
    # torch 2.13's CPU flex template fuses no epilogue ("Unsupported for `epilogue_nodes` in
    # CppFlexAttentionTemplate": NSA's gated sum after the call); a CPU limit of inductor, not of the trace
    with torch.no_grad(), torch._inductor.config.patch(epilogue_fusion=False):
        s_got, s_want = {}, {}
        got = torch.compile(call, fullgraph=True)(q, k, v, s_got)
        want = call(q, k, v, s_want)
        op = moba_attention if name == "moba" else nsa_attention
        params = dict(QA_MOBA if name == "moba" else QA_NSA, selection=selection,
                      **({"score_stride": 16} if selection == "hybrid" else {}))
        ref = op(q, k, v, backend="torch", **params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    assert {k_: int(n) for k_, n in s_got["work"].items()} == {k_: int(n) for k_, n in s_want["work"].items()}
    assert int(s_got["work"]["attended_pairs"]) > 0
