"""The antidiagonal scoring's Triton kernel (kernels/scores.py) against its torch twin
(``selection.antidiagonal_scores``'s CPU form) under TRITON_INTERPRET=1 (tests/conftest.py sets it):
the same scores on ragged lengths, GQA groups and tiles per block, the same block lists where blocks
stand apart (a planted copy line), causality by perturbing future keys, half-precision inputs, the
dispatch of CUDA half inputs to the kernel, and bad tiles refused."""
import pytest
import torch

from longpatch.methods import gpu_scores, selection
from longpatch.methods.selection import antidiagonal_scores, antidiagonal_scores_fused, select_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _float32_products(monkeypatch):
    """The kernel multiplies in float32: the torch form it is held to takes its float32 products too,
    whatever this CPU (or LONGPATCH_INT8_PRODUCTS) would choose (the int8 products are held to the
    float32 ones within their rounding in tests/test_hybrid_selection.py)."""
    monkeypatch.setattr(selection, "INT8_PRODUCTS", False)


def _qkv(n, hq, hk, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, d, generator=g).to(dtype), torch.randn(1, hk, n, d, generator=g).to(dtype))


def _close(a, b, atol):
    fin = torch.isfinite(a)
    assert torch.equal(fin, torch.isfinite(b))  # the same future (-inf) entries
    torch.testing.assert_close(a[fin], b[fin], atol=atol, rtol=0)


@pytest.mark.parametrize("n, hq, hk, d, block, stride", [
    (128, 4, 2, 16, 32, 4),  # 8 tiles per block, GQA 2
    (100, 2, 2, 16, 16, 4),  # ragged: a partial last tile and block
    (96, 3, 1, 8, 32, 8),  # a group of 3 (rows padded to the tile)
    (64, 2, 1, 16, 16, 16),  # one tile per block
    (77, 4, 4, 16, 16, 2),  # no GQA, ragged, 8 tiles per block
    (72, 2, 1, 16, 24, 4),  # 6 tiles per block (not a power of two: one block per step)
    (300, 2, 1, 8, 8, 2),  # 38 blocks of 4 tiles, 16 blocks per step: steps that end past the diagonal
])
def test_kernel_equals_the_torch_form(n, hq, hk, d, block, stride):
    q, k = _qkv(n, hq, hk, d)
    scale = d ** -0.5
    _close(antidiagonal_scores_fused(q, k, block, stride, scale), antidiagonal_scores(q, k, block, stride, scale), 1e-6)


def test_same_block_lists_on_a_planted_copy_line():
    """Every query reads the key 37 positions back (a copy line): both forms rank the same blocks, and
    the mass rule and the cap take the same lists."""
    n, d, block, stride, dist = 256, 16, 16, 4, 37
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 1, n, d, generator=g)
    q = torch.randn(1, 2, n, d, generator=g) * 0.1
    q[:, :, dist:] += 4.0 * k[:, :, :n - dist]
    scale = d ** -0.5
    ref, fused = antidiagonal_scores(q, k, block, stride, scale), antidiagonal_scores_fused(q, k, block, stride, scale)
    _close(fused, ref, 1e-6)
    for mass, cap in ((None, 3), (0.9, 6), (0.5, 4)):
        assert torch.equal(select_blocks(fused, cap, mass), select_blocks(ref, cap, mass))


def test_causal_future_keys_change_nothing_before_them():
    """Keys from position p on changed: the score rows of query blocks that end before p do not move."""
    n, d, block, stride = 128, 16, 16, 4
    q, k = _qkv(n, 4, 2, d, seed=5)
    scale = d ** -0.5
    before = antidiagonal_scores_fused(q, k, block, stride, scale)
    k2 = k.clone()
    k2[:, :, 80:] = torch.randn_like(k2[:, :, 80:]) * 3
    after = antidiagonal_scores_fused(q, k2, block, stride, scale)
    torch.testing.assert_close(after[:, :, :5], before[:, :, :5], atol=0, rtol=0)  # blocks 0-4 end by 80
    assert not torch.allclose(after[:, :, 6:], before[:, :, 6:])


def test_half_precision_inputs():
    """bf16 tiles (what CUDA runs; the interpreter upcasts): the scores of the float32 form within bf16's
    rounding of q and k."""
    q, k = _qkv(128, 4, 2, 16, seed=7, dtype=torch.bfloat16)
    scale = 0.25
    _close(antidiagonal_scores_fused(q, k, 32, 4, scale), antidiagonal_scores(q.float(), k.float(), 32, 4, scale), 1e-5)


def test_cuda_half_inputs_take_the_kernel(monkeypatch):
    """antidiagonal_scores sends the inputs gpu_scores takes (CUDA bf16/fp16; here forced on the CPU) to
    the kernel, not through the score rows."""
    import longpatch.kernels.scores as ks

    calls = []
    real = ks.block_scores

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ks, "block_scores", spy)
    monkeypatch.setattr(gpu_scores, "applies", lambda q: True)
    q, k = _qkv(96, 2, 1, 16, seed=9, dtype=torch.bfloat16)
    out = antidiagonal_scores(q, k, 32, 4, 0.25)
    assert calls == [1]
    _close(out, antidiagonal_scores(q.float(), k.float(), 32, 4, 0.25), 1e-5)


def test_bad_tiles_are_refused():
    from longpatch.kernels.scores import block_scores

    qt = torch.zeros(1, 2, 10, 64)
    with pytest.raises(ValueError, match="do not make blocks of 4"):
        block_scores(qt, torch.zeros(1, 1, 10, 64), 4, 1.0)


@pytest.mark.parametrize("n, block, stride, off", [(128, 32, 4, 64), (100, 16, 4, 48), (72, 24, 4, 24)])
def test_kernel_scores_a_prefill_chunk_as_the_prefills_rows(n, block, stride, off):
    """A prefill chunk (the queries from block off / block on): the kernel's rows are the one-shot's."""
    q, k = _qkv(n, 4, 2, 16, seed=2)
    scale = 16 ** -0.5
    whole = antidiagonal_scores(q, k, block, stride, scale)
    _close(antidiagonal_scores_fused(q[:, :, off:], k, block, stride, scale), whole[:, :, off // block:], 1e-6)


def test_cuda_default_takes_the_kernel_only_up_to_its_measured_cut(monkeypatch):
    # auto: the kernel up to FUSED_SCORES_MAX_KEYS keys (faster there on an H200), the torch form above
    monkeypatch.setattr(selection, "FUSED_SCORES", None)
    cut = selection.FUSED_SCORES_MAX_KEYS
    assert selection.fused_scores_available(cut) and not selection.fused_scores_available(cut + 1)
    monkeypatch.setattr(selection, "FUSED_SCORES", True)
    assert selection.fused_scores_available(4 * cut)
    monkeypatch.setattr(selection, "FUSED_SCORES", False)
    assert not selection.fused_scores_available(16)
