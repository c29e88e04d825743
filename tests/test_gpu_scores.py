"""The selections' GPU score form (longpatch/methods/gpu_scores.py) against the CPU's float32 code.

The GPU form runs only on CUDA; here it is forced on the CPU (``gpu_scores.applies`` patched) on bf16
inputs, where ``products`` multiplies float32 copies (the values the GPU's bf16 products give
exactly) and the fused passes run uncompiled or compiled by inductor's CPU backend."""
import pytest
import torch

from longpatch.methods import gpu_scores, selection

BLOCK, STRIDE = 32, 8


def qk(n, hq=4, hk=2, d=16, b=2, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, n, d, generator=g) * spread).bfloat16()
    k = (torch.randn(b, hk, n, d, generator=g) * spread).bfloat16()
    return q, k


@pytest.fixture
def gpu_form(monkeypatch):
    """The GPU form on CPU tensors, its passes uncompiled."""
    monkeypatch.setattr(gpu_scores, "applies", lambda q: True)
    monkeypatch.setattr(selection, "_FUSED_BLOCK_MASS", gpu_scores.block_mass)
    monkeypatch.setattr(selection, "_FUSED_TILE_MASS", gpu_scores.antidiagonal_tile_mass)


@pytest.mark.parametrize("n", [256, 250])  # whole blocks; a partial last block
def test_gpu_form_scores_equal_the_cpu_code(n, gpu_form, monkeypatch):
    q, k = qk(n)
    scale = 16 ** -0.5
    nb = -(-n // BLOCK)
    qpos = torch.tensor([0, 5, n // 2, n - 3, n - 1])
    got_mass = selection._block_mass(q, k, qpos, 0, scale, nb, BLOCK)
    got_anti = selection.antidiagonal_scores(q, k, BLOCK, STRIDE, scale)
    monkeypatch.setattr(gpu_scores, "applies", lambda q: False)
    monkeypatch.setattr(selection, "INT8_PRODUCTS", False)  # the CPU's float32 products (int8: its own tests)
    want_mass = selection._block_mass(q, k, qpos, 0, scale, nb, BLOCK)
    want_anti = selection.antidiagonal_scores(q, k, BLOCK, STRIDE, scale)
    assert got_mass.dtype == want_mass.dtype == torch.float32
    torch.testing.assert_close(got_mass, want_mass, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_anti.isinf(), want_anti.isinf())
    torch.testing.assert_close(got_anti, want_anti, rtol=1e-5, atol=1e-6)
    assert (got_mass[..., -1] > 0).any() and (got_anti[..., 1:, 0] > 0).all()  # not all zeros


@pytest.mark.parametrize("scoring", [("estimate", 16), ("hybrid", 16, STRIDE)])
def test_gpu_form_selects_the_cpu_codes_blocks(scoring, gpu_form, monkeypatch):
    q, k = qk(300, seed=1)
    args = (q, k, BLOCK, 4, 0.9, scoring, 1, 16 ** -0.5)
    got = selection.estimated_blocks(*args, final_topk=2)
    monkeypatch.setattr(gpu_scores, "applies", lambda q: False)
    want = selection.estimated_blocks(*args, final_topk=2)
    assert torch.equal(got, want)


def test_fused_passes_compiled_equal_them_uncompiled():
    """What the GPU runs: the two passes through torch.compile (inductor's CPU backend here), at two
    lengths (dynamic shapes), against the same functions uncompiled."""
    g = torch.Generator().manual_seed(2)
    for n, nb in ((200, 7), (256, 8)):
        s = torch.randn(1, 2, 6, n, generator=g) * 10
        qcol = torch.tensor([0, 3, 50, 100, 150, n - 1]).view(-1, 1)
        torch.testing.assert_close(gpu_scores.fused(gpu_scores.block_mass)(s, qcol, 0.3, nb, 32),
                                   gpu_scores.block_mass(s, qcol, 0.3, nb, 32), rtol=1e-5, atol=1e-7)
        t = torch.randn(1, 2, 2, 8, n // 32 * 4, generator=g) * 10  # whole key blocks of 4 tiles
        tiles = torch.arange(8) + 8
        torch.testing.assert_close(gpu_scores.fused(gpu_scores.antidiagonal_tile_mass)(t, tiles, 0.2, 4),
                                   gpu_scores.antidiagonal_tile_mass(t, tiles, 0.2, 4), rtol=1e-5, atol=1e-7)
    assert gpu_scores._FUSED["block_mass"] is not False and gpu_scores._FUSED["antidiagonal_tile_mass"] is not False


def test_products_multiply_half_inputs_into_float32():
    a, b = (torch.randn(2, 3, 5, 7).bfloat16(), torch.randn(2, 3, 7, 4).bfloat16())
    out = gpu_scores.products(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a.double() @ b.double(), rtol=1e-6, atol=1e-6, check_dtype=False)


def test_the_gpu_form_applies_to_cuda_half_tensors_only():
    assert not gpu_scores.applies(torch.zeros(1, dtype=torch.bfloat16))  # CPU
    meta = torch.zeros(1, dtype=torch.bfloat16, device="meta")
    assert not gpu_scores.applies(meta)
