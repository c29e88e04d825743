"""The 8-bit KV cache (longpatch.quantized): rows quantized once within their error bound; a QuantizedKV that
slices and gathers without dequantizing the rest and behaves as its dequantized tensor under any other op;
generation through it (unpatched and patched) close to the full-precision cache; a query-aware MoBA/NSA decode
step that dequantizes only the rows it reads; the CLI's --cache; bad formats in one line."""
import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import longpatch
from longpatch import cli, quantized
from longpatch.cache import cache_argument
from longpatch.errors import ConfigError
from longpatch.methods import blocksparse, common
from longpatch.methods.common import gather_blocks
from longpatch.quantized import QuantizedCache, QuantizedKV, check_format, dequantize, quantize, row_width, unpack
from longpatch.testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

MOBA = {"chunk_size": 16, "topk": 3, "selection": "hybrid", "mass": 0.9, "estimate_queries": 8, "score_stride": 4}
NSA = {"compress_block": 16, "compress_stride": 8, "select_block": 16, "num_selected": 3, "window": 32,
       "selection": "hybrid", "mass": 0.9, "estimate_queries": 8, "score_stride": 4}


def rows(n=64, h=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, h, n, d, generator=g) * torch.linspace(0.1, 8, n).view(1, 1, n, 1)  # rows of every size
    x[0, 0, 3] = 0  # an all-zero row
    return x.to(dtype)


def test_int8_rows_are_within_half_a_step():
    x = rows()
    x[0, 1, 5] = -2.5  # a constant row
    packed = quantize(x, "int8")
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2, 64, 16 + 8)  # codes, float32 scale and offset
    codes, scale, offset = unpack(packed, "int8", 16)
    assert codes.dtype == torch.uint8 and scale.shape == offset.shape == (1, 2, 64, 1)
    # one step is the row's range / 255
    torch.testing.assert_close(scale[0, 0, 10:], (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True))[0, 0, 10:] / 255)
    back = dequantize(packed, "int8", 16, x.dtype)  # on a CPU: fbgemm's unpack; the definition, elementwise:
    torch.testing.assert_close(back, codes.float() * scale + offset, atol=1e-6, rtol=1e-6)
    err = (back - x).abs()
    assert (err <= scale / 2 + 1e-5).all()
    assert err[0, 0, 3].max() == 0 and err[0, 1, 5].max() == 0  # zeros and constant rows stay exact
    assert (err.amax(-1, keepdim=True) > 0).any()  # it does quantize
    odd = rows(d=6)  # codes padded to a multiple of 4 bytes: the scale and offset stay aligned floats
    assert quantize(odd).shape[-1] == row_width(6) == 16
    assert ((dequantize(quantize(odd), "int8", 6, odd.dtype) - odd).abs() <= unpack(quantize(odd), "int8", 6)[1]).all()


def test_fp8_rows_keep_three_mantissa_bits():
    x = rows()
    packed = quantize(x, "fp8")
    codes, scale, offset = unpack(packed, "fp8", 16)
    assert codes.dtype == torch.float8_e4m3fn and (offset == 0).all()
    back = dequantize(packed, "fp8", 16, x.dtype)
    # e4m3: relative error at most 2^-4 for values in its normal range (above 2^-6 of the scale unit)
    normal = x.abs() >= scale * 2 ** -6
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-6)[normal].all()


def test_a_quantized_tensor_slices_gathers_and_computes_as_its_dequantized_self():
    x = rows(80)
    qkv = QuantizedKV.of(x)
    full = qkv.dequantize()
    part = qkv[:, :, 10:40]
    assert isinstance(part, QuantizedKV) and isinstance(qkv[0], QuantizedKV) and isinstance(qkv.detach(), QuantizedKV)
    torch.testing.assert_close(part.dequantize(), full[:, :, 10:40], atol=0, rtol=0)
    every4 = QuantizedKV.of(rows(128))[:, :, 3::4]  # strided rows of a cache without spare capacity
    torch.testing.assert_close(every4.dequantize(), QuantizedKV.of(rows(128)).dequantize()[:, :, 3::4], atol=0, rtol=0)
    idx = torch.tensor([5, 0, 79])
    torch.testing.assert_close(qkv.index_select(2, idx), full.index_select(2, idx), atol=0, rtol=0)
    ids = torch.tensor([[[2, -1, 4], [0, 1, 3]]])
    got, want = gather_blocks(qkv, ids, 16), gather_blocks(full, ids, 16)
    valid = (ids >= 0).repeat_interleave(16, -1)
    torch.testing.assert_close(got[valid], want[valid], atol=0, rtol=0)
    q = torch.randn(1, 4, 3, 16)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, qkv, qkv, enable_gqa=True),
                               F.scaled_dot_product_attention(q, full, full, enable_gqa=True))
    assert torch.equal(qkv.sum(-1), full.sum(-1))


def _gen(model, ids, cache, steps=8):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, **{cache_argument(model): cache},
                              output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_an_unpatched_model_generates_through_it_close_to_full_precision(fmt):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    full = _gen(model, ids, None)
    cache = QuantizedCache(config=model.config, fmt=fmt)
    q8 = _gen(model, ids, cache)
    tol = 0.02 if fmt == "int8" else 0.15
    torch.testing.assert_close(q8.logits[0], full.logits[0], atol=tol, rtol=0)
    assert isinstance(cache.layers[0].keys, QuantizedKV) and cache.layers[0].keys.shape[2] == 127
    if fmt == "int8":
        assert torch.equal(q8.sequences, full.sequences)


def test_it_holds_a_quarter_of_a_float32_cache_plus_its_scales():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 100))
    cache = QuantizedCache(config=model.config, reserve=64)
    _gen(model, ids, cache, steps=4)
    layer = cache.layers[0]
    b, h, n, d = layer.keys.shape
    assert n == 103
    assert cache.stored_bytes() == len(cache.layers) * 2 * b * h * n * (d + 8)  # 8-bit codes, float32 scale and offset
    assert layer._bufs[0].shape[2] >= 100 + 64  # the reserve: no reallocation during generation


@pytest.mark.parametrize("method, params", [("moba", MOBA), ("nsa", NSA)])
def test_a_patched_step_reads_only_the_rows_it_attends(method, params, monkeypatch):
    model = tiny_model("llama")
    longpatch.patch_model(model, {"method": method, "layers": "all", "params": {**params, "decode_topk": 2}})
    ids = torch.randint(3, 256, (1, 640), generator=torch.Generator().manual_seed(2))
    full = _gen(model, ids, None, steps=6)
    counted = {"whole": 0, "blocks": 0}
    whole, blocks, bags = QuantizedKV.dequantize, common.gather_blocks, quantized.bag_sums

    def count_whole(self):
        counted["whole"] += self.numel()
        return whole(self)

    hd = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads

    def count_blocks(x, ids, block, out=None):
        got = blocks(x, ids, block, out)
        if x.dtype == torch.uint8:  # packed rows gathered (where fbgemm's bags do not apply)
            counted["blocks"] += got.numel() // got.shape[-1] * hd
        return got

    def count_bags(table, index, count, weights, d):  # rows read in place by fbgemm's bags (on a CPU)
        counted["blocks"] += index.unique().numel() * d
        return bags(table, index, count, weights, d)
    monkeypatch.setattr(QuantizedKV, "dequantize", count_whole)
    monkeypatch.setattr(quantized, "bag_sums", count_bags)
    monkeypatch.setattr(common, "gather_blocks", count_blocks)
    monkeypatch.setattr(blocksparse, "gather_blocks", count_blocks)
    cache = QuantizedCache(config=model.config)
    with torch.no_grad():
        out = model(ids, **{cache_argument(model): cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        # the first step summarises the cache's pages (bounds) once
        out = model(tok, **{cache_argument(model): cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        counted.update(whole=0, blocks=0)
        for _ in range(5):
            out = model(tok, **{cache_argument(model): cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
    layers = len(longpatch.patched_layers(model))
    cache_elems = cache.layers[0].keys.numel()
    # per layer and step: the listed blocks of K and V (own, local, the prefill's 2, the step's 2 best-bounded: at
    # most 8 of the cache's 41 blocks of 16) and a few rows, never the whole cache
    row = cache_elems // cache.layers[0].keys.shape[2]
    assert 0 < counted["blocks"] <= 5 * layers * 2 * 8 * 16 * row
    # and slices: NSA's window, the new key's page (each a few rows of 645)
    assert counted["whole"] <= 5 * layers * 2 * (params.get("window", 0) + 16) * row
    q8 = _gen(model, ids, QuantizedCache(config=model.config), steps=6)
    assert torch.equal(q8.sequences, full.sequences)


def test_a_cropped_cache_is_taken_up_again():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 60))
    cache = QuantizedCache(config=model.config)
    with torch.no_grad():
        model(ids, **{cache_argument(model): cache}, use_cache=True)
        cache.crop(-20)  # the last 20 rows dropped
        out = model(ids[:, 40:41], **{cache_argument(model): cache}, use_cache=True)
    assert isinstance(cache.layers[0].keys, QuantizedKV) and cache.layers[0].keys.shape[2] == 41
    assert torch.isfinite(out.logits).all()


def test_bad_formats_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cache format: got 'int4'; allowed: 'int8', 'fp8'"):
        QuantizedCache(fmt="int4")
    check_format("fp8", "cpu")  # the CPU stores e4m3 (and converts in software)
    r = CliRunner().invoke(cli.app, ["eval", "needle", "--model", "demo", "--cache", "int4", "--out",
                                     str(tmp_path / "n")])
    assert r.exit_code == 2 and "cache format: got 'int4'" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "n").exists()


def test_bench_generate_reports_the_cache_it_held(tmp_path):
    args = ["bench", "generate", "--model", "tiny:llama", "--tokenizer", "bytes", "--config", "demo-moba-32k",
            "--set", "chunk_size=16", "--set", "topk=3", "--layers", "all", "--contexts", "256", "--new-tokens", "4",
            "--warmup", "0", "--no-plots", "--no-progress"]
    got = {}
    for cache in ("growing", "int8"):
        r = CliRunner().invoke(cli.app, [*args, "--cache", cache, "--out", str(tmp_path / cache)])
        assert r.exit_code == 0, r.output
        got[cache] = json.loads((tmp_path / cache / "results.json").read_text())["records"]
    for full, q8 in zip(got["growing"], got["int8"]):
        assert q8["cache_mib"] < 0.5 * full["cache_mib"]  # float32 model: a quarter plus the scales


@pytest.mark.parametrize("bags", [True, False])
def test_attention_over_listed_8bit_rows_is_attention_over_their_dequantized_rows(bags, monkeypatch):
    from longpatch.methods.blocksparse import attend_quantized_rows, block_sparse_decode
    if not bags:  # where fbgemm's bags do not apply (a GPU, fp8): the listed blocks gathered and dequantized
        monkeypatch.setattr(quantized, "_rowwise_op", lambda: None)
    elif quantized._rowwise_op() is None:
        pytest.skip("this torch build has no fbgemm 8-bit embedding bags")
    k8, v8 = QuantizedKV.of(rows(96)), QuantizedKV.of(rows(96, seed=1))
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    kept = torch.tensor([[[0, 3, -1], [2, 1, -1]]])
    got = block_sparse_decode(q, k8, v8, kept, 16, 0, 0.25)
    one = torch.zeros(1, 2, 1, dtype=torch.long)
    assert (attend_quantized_rows(q, k8, v8, one, one == 0, 0.25) is None) == (not bags)
    # the definition: the own block (5, up to row 95) and the listed ones, over the dequantized rows, in float64
    ks, vs = k8.dequantize().double(), v8.dequantize().double()
    allowed = torch.zeros(2, 96, dtype=torch.bool)
    for h, ids in enumerate(([0, 3, 5], [2, 1, 5])):
        for j in ids:
            allowed[h, j * 16:(j + 1) * 16] = True
    s = (q.reshape(1, 2, 2, 16).double() @ ks.transpose(-1, -2) * 0.25).masked_fill(~allowed.view(1, 2, 1, 96),
                                                                                  float("-inf"))
    want = (torch.softmax(s, -1) @ vs).reshape(1, 4, 1, 16)
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), torch.logsumexp(s, -1).reshape(1, 4, 1), atol=1e-5, rtol=1e-5)
    if bags:  # no valid key: zeros and lse -inf
        out, lse = attend_quantized_rows(q, k8, v8, torch.zeros(1, 2, 4, dtype=torch.long),
                                         torch.zeros(1, 2, 4, dtype=torch.bool), 0.25)
        assert (out == 0).all() and torch.isneginf(lse).all()
