"""The split-K decode kernel (kernels/decode.py) against its torch twin (``paged.paged_attention_torch``)
under TRITON_INTERPRET=1 (tests/conftest.py sets it): GQA groups, head dims and block sizes, ragged
lengths (mid-block ends, listed blocks wholly past the length), padded unsorted lists, any split count
giving one result, strided cache buffers, half-precision inputs, rows that attend nothing, no host
reads of tensor data, and bad inputs refused in one line naming the argument."""
import pytest
import torch

from longpatch.kernels import decode
from longpatch.kernels.decode import paged_decode
from longpatch.methods.paged import paged_attention_torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(b=2, hq=4, hk=2, d=16, capacity=128, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hk, capacity, d, generator=g).to(dtype)
    v = torch.randn(b, hk, capacity, d, generator=g).to(dtype)
    return q, k, v


def _lists(b, hk, L, nblocks, used, seed=0):
    """[b, hk, L] int32: ``used`` distinct ids of ``nblocks`` per list, unsorted, at random places, -1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((b, hk, L), -1, dtype=torch.int32)
    for i in range(b):
        for h in range(hk):
            slots = torch.randperm(L, generator=g)[:used]
            out[i, h, slots] = torch.randperm(nblocks, generator=g)[:used].to(torch.int32)
    return out


def _check(q, k, v, blocks, length, block, scale=0.3, splits=None, atol=1e-5, start=None):
    out, lse = paged_decode(q, k, v, blocks, length, block, scale, splits=splits, start=start)
    ref_out, ref_lse = paged_attention_torch(q, k, v, blocks, length, block, scale, start)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=0)  # -inf entries must match exactly
    return out, lse


@pytest.mark.parametrize("hk, g", [(2, 1), (1, 2), (2, 3), (1, 4), (2, 8), (1, 16)])
def test_gqa_groups(hk, g):
    q, k, v = _inputs(hq=hk * g, hk=hk, seed=g)
    blocks = _lists(2, hk, 5, 8, 4, seed=g)
    _check(q, k, v, blocks, torch.tensor([128, 101]), 16, splits=2)


@pytest.mark.parametrize("d", [16, 32, 24])
def test_head_dims(d):
    q, k, v = _inputs(d=d, seed=d)
    _check(q, k, v, _lists(2, 2, 4, 8, 3, seed=d), torch.tensor([120, 77]), 16, scale=d ** -0.5)


@pytest.mark.parametrize("block", [32, 128])
def test_block_sizes(block):
    """Blocks of several key tiles (block 128: two tiles of 64), the last one cut by the length."""
    q, k, v = _inputs(capacity=512, seed=block)
    blocks = _lists(2, 2, 3, 512 // block, 3, seed=block)
    _check(q, k, v, blocks, torch.tensor([512 - 70, 300]), block)


def test_ragged_lengths_and_blocks_past_the_length():
    """Row 0 ends mid-block (length 70: block 4 half written); row 1 lists block 6, wholly past its length
    40: changing that block's keys and values changes nothing, and dropping it from the list neither."""
    q, k, v = _inputs(seed=3)
    blocks = torch.tensor([[[4, 0, -1, 2], [1, 4, 3, -1]], [[6, 0, 2, -1], [-1, 1, 6, 0]]], dtype=torch.int32)
    length = torch.tensor([70, 40])
    out, lse = _check(q, k, v, blocks, length, 16, splits=2)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 96:112] = 100.0
    v2[1, :, 96:112] = 100.0
    k2[0, :, 70:] = 100.0  # past row 0's length, inside its listed block 4
    v2[0, :, 70:] = 100.0
    out2, lse2 = paged_decode(q, k2, v2, blocks, length, 16, 0.3, splits=2)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    dropped = blocks.masked_fill(blocks == 6, -1)  # only row 1 lists block 6
    out3, lse3 = paged_decode(q, k, v, dropped, length, 16, 0.3, splits=2)
    torch.testing.assert_close(out3, out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse3, lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_start_hides_the_keys_before_it(splits):
    """Row 0 starts mid-tile (key 37), row 1 mid-block past a whole listed block (key 70: block 3 wholly
    before it, block 4 partly); a start at or past the length leaves a row nothing."""
    q, k, v = _inputs(seed=9)
    blocks = torch.tensor([[[0, 2, 3, 7], [1, -1, 2, 5]], [[3, 4, 6, -1], [4, 0, 5, 7]]], dtype=torch.int32)
    length = torch.tensor([120, 100])
    _check(q, k, v, blocks, length, 16, splits=splits, start=torch.tensor([37, 70]))
    out, lse = _check(q, k, v, blocks, length, 16, splits=splits, start=torch.tensor([0, 100]))
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_padded_unsorted_lists():
    """-1 at the front, in the middle and at the end, ids in no order; int64 ids read as well."""
    q, k, v = _inputs(seed=4)
    blocks = torch.tensor([[[-1, 7, 2, -1, 5, 0], [3, -1, -1, 6, 1, -1]],
                           [[-1, -1, 4, 2, 7, 1], [0, 5, 3, 6, -1, -1]]], dtype=torch.int32)
    length = torch.tensor([128, 115])
    out, lse = _check(q, k, v, blocks, length, 16, splits=3)
    out64, lse64 = paged_decode(q, k, v, blocks.long(), length, 16, 0.3, splits=3)
    assert torch.equal(out64, out) and torch.equal(lse64, lse)


def test_split_counts_agree():
    """1, 2, L splits, more splits than listed ids, more than L entries, and the default: one result."""
    q, k, v = _inputs(hq=8, hk=2, seed=5)
    L = 6
    blocks = _lists(2, 2, L, 8, 3, seed=5)
    length = torch.tensor([128, 93])
    first, first_lse = _check(q, k, v, blocks, length, 16, splits=1)
    for splits in (2, L, 5, L + 3, None):
        out, lse = _check(q, k, v, blocks, length, 16, splits=splits)
        torch.testing.assert_close(out, first, atol=1e-6, rtol=0)
        torch.testing.assert_close(lse, first_lse, atol=1e-6, rtol=0)


def test_many_splits():
    """More splits than the combine merges at once (32): its chunks are merged online as well, the largest
    split LSE in the second chunk (keys planted along the queries in the block listed at entry 38)."""
    q, k, v = _inputs(b=1, hq=2, hk=1, capacity=640, seed=10)
    blocks = torch.randperm(40, generator=torch.Generator().manual_seed(10)).to(torch.int32).view(1, 1, 40)
    blocks[0, 0, [5, 19, 20, 22]] = -1
    planted = int(blocks[0, 0, 38])
    k[0, 0, planted * 16:planted * 16 + 16] = 2.0 * (q[0, 0, 0] + q[0, 1, 0])
    length = torch.tensor([630])
    first, first_lse = _check(q, k, v, blocks, length, 16, splits=1)
    out, lse = _check(q, k, v, blocks, length, 16, splits=40)
    torch.testing.assert_close(out, first, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, first_lse, atol=1e-6, rtol=0)


def test_strided_cache_buffers():
    """k a slice of a larger buffer along the capacity dim; v a [b, capacity, hk, d] buffer seen as
    [b, hk, capacity, d]; q a non-contiguous view: the kernel reads them in place."""
    g = torch.Generator().manual_seed(6)
    b, hq, hk, d, cap = 2, 4, 2, 24, 128
    big = torch.randn(b, hk, cap + 64, d, generator=g)
    k = big[:, :, 32:32 + cap]
    v = torch.randn(b, cap, hk, d, generator=g).transpose(1, 2)
    q = torch.randn(b, 2 * hq, 1, d, generator=g)[:, ::2]  # every other head of a larger tensor
    assert not k.is_contiguous() and not v.is_contiguous() and not q.is_contiguous()
    blocks = _lists(b, hk, 4, 8, 3, seed=6)
    length = torch.tensor([128, 57])
    out, lse = _check(q, k, v, blocks, length, 16, splits=2)
    ref_out, ref_lse = paged_decode(q.contiguous(), k.contiguous(), v.contiguous(), blocks, length, 16, 0.3, splits=2)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    q, k, v = _inputs(hq=6, hk=2, seed=7, dtype=dtype)
    _check(q, k, v, _lists(2, 2, 5, 8, 4, seed=7), torch.tensor([128, 85]), 16, splits=2, atol=2e-2)


def test_rows_that_attend_nothing():
    """An all-padding list, a list whose blocks all lie past the length, and a length of 0: out 0, lse -inf,
    no NaN, while the other heads of the same row attend normally."""
    q, k, v = _inputs(seed=8)
    blocks = torch.tensor([[[-1, -1, -1], [2, 0, -1]], [[5, 7, -1], [-1, 0, 1]]], dtype=torch.int32)
    out, lse = _check(q, k, v, blocks, torch.tensor([100, 64]), 16, splits=2)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isneginf(lse[0, :2]).all()
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2])) and torch.isneginf(lse[1, :2]).all()
    assert torch.isfinite(lse[0, 2:]).all() and torch.isfinite(lse[1, 2:]).all()
    out, lse = _check(q, k, v, blocks, torch.tensor([0, 0]), 16, splits=3)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_two_launches_and_no_host_reads(monkeypatch):
    """paged_decode reads no tensor data on the host (a CUDA graph could not capture it) and launches two
    kernels. The launches are recorded and replayed after: the interpreter itself reads tensors."""
    q, k, v = _inputs(seed=9)
    blocks, length = _lists(2, 2, 4, 8, 3, seed=9), torch.tensor([128, 60])
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, grid, args, kwargs))

    def host_read(self, *args, **kwargs):
        raise AssertionError("a host read of tensor data")

    monkeypatch.setattr(decode, "_split_kernel", Recorder(decode._split_kernel))
    monkeypatch.setattr(decode, "_combine_kernel", Recorder(decode._combine_kernel))
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out, lse = paged_decode(q, k, v, blocks, length, 16, 0.3)
    monkeypatch.undo()
    assert len(launches) == 2
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    ref_out, ref_lse = paged_attention_torch(q, k, v, blocks, length, 16, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_default_splits():
    """Interpreter: min(L, 4); CUDA: about two programs per SM, never above L, never an empty split."""
    cpu = torch.device("cpu")
    assert decode.default_splits(cpu, 4, 10) == 4
    assert decode.default_splits(cpu, 4, 3) == 3
    assert decode.default_splits(cpu, 4, 1) == 1
    assert decode.default_splits(cpu, 4, 0) == 1


def test_default_splits_on_cuda(monkeypatch):
    monkeypatch.setattr(decode, "interpreted", lambda device: False)
    monkeypatch.setattr(decode, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert decode.default_splits(gpu, 8, 264) == 33  # 8 x 33 = 264 programs: two per SM
    assert decode.default_splits(gpu, 8, 100) == 25  # 33 would leave empty splits: 4 entries each, 25 splits
    assert decode.default_splits(gpu, 8, 10) == 10  # never above L
    assert decode.default_splits(gpu, 512, 40) == 1  # enough programs without splitting


def _bad(**change):
    q, k, v = _inputs()
    args = dict(q=q, k=k, v=v, blocks=_lists(2, 2, 3, 8, 2), length=torch.tensor([128, 64]), block=16, scale=0.3)
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(2, 4, 2, 16)), "q must be"),
    (dict(k=torch.zeros(2, 2, 128, 8)), "k must be"),
    (dict(v=torch.zeros(2, 3, 128, 16)), "k and v"),
    (dict(k=torch.zeros(2, 3, 128, 16), v=torch.zeros(2, 3, 128, 16)), "multiple of k's heads"),
    (dict(k=torch.zeros(2, 2, 16, 128).transpose(-1, -2)), "k must have a contiguous last dim"),
    (dict(v=torch.zeros(2, 2, 16, 128).transpose(-1, -2)), "v must have a contiguous last dim"),
    (dict(v=torch.zeros(2, 2, 128, 16, dtype=torch.bfloat16)), "v must match q's dtype"),
    (dict(blocks=torch.zeros(2, 3, 4, dtype=torch.int32)), "blocks must be"),
    (dict(blocks=torch.zeros(2, 2, 4)), "blocks must be int32"),
    (dict(length=torch.tensor([128])), "length must be"),
    (dict(length=torch.tensor([128.0, 64.0])), "length must be"),
    (dict(block=24), "block must be a power of two"),
    (dict(block=8), "block must be a power of two"),
])
def test_bad_inputs_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        paged_decode(**_bad(**change))


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="splits must be"):
        paged_decode(**_bad(), splits=0)
