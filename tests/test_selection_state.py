"""What a patched layer keeps beside the KV cache to choose its blocks: the window summaries' fingerprint
rows are a few features, not whole key rows, and still catch another cache; ``LayerRoute.state_bytes``
counts each storage once and never the cache's own; `bench generate` reports it beside the cache."""
import torch

import longpatch
from longpatch.bench.generate import run_generate_bench
from longpatch.methods.common import PROBE_FEATURES
from longpatch.methods.selection import block_bounds, page_minmax
from longpatch.routing import LayerRoute
from longpatch.testing.tiny import tiny_model

HYBRID = {"chunk_size": 16, "topk": 4, "selection": "hybrid", "estimate_queries": 8, "score_stride": 4,
          "decode_page": 4, "decode_topk": 2}


def _keys(n, seed):
    return torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(seed))


def test_the_fingerprint_keeps_a_few_features_and_catches_another_cache():
    state = {}
    k = _keys(64, 0)
    mins, _ = block_bounds(state, k, 4)
    assert state["mins_probe"].shape[-1] == PROBE_FEATURES < k.shape[-1]
    grown = torch.cat([k, _keys(16, 1)], 2)  # the same sequence, 16 keys on: extended, the old pages kept
    mins, maxs = block_bounds(state, grown, 4)
    want = page_minmax(grown, 4)
    assert torch.equal(mins, want[0]) and torch.equal(maxs, want[1])
    for other in (_keys(80, 2), grown.flip(1)):  # another sequence; the heads' rows swapped (a reordered cache)
        mins, maxs = block_bounds(state, other, 4)
        want = page_minmax(other, 4)
        assert torch.equal(mins, want[0]) and torch.equal(maxs, want[1])


def test_state_bytes_counts_each_storage_once_and_not_the_cache():
    route = LayerRoute(0)
    k = _keys(64, 0)
    block_bounds(route.state, k, 4)
    (end, bufs) = route.state["mins_probe_bufs"]
    owned = sum(b.untyped_storage().nbytes() for b in bufs)
    assert route.state_bytes() == owned  # mins, maxs and the probe are views of those buffers: counted once
    route.state["cache_view"] = k[:, :, :8]  # a state may view the cache: not its memory
    assert route.state_bytes({(k.device, k.untyped_storage().data_ptr())}) == owned


def test_bench_generate_reports_the_selection_state_beside_the_cache(tmp_path, one_thread):
    cfg = tmp_path / "hybrid.yaml"
    cfg.write_text("method: moba\nparams: " + str(HYBRID).replace("'", "") + "\nlayers: all\n")
    res = run_generate_bench("tiny:llama", str(cfg), None, "512", 4, tmp_path / "out", tokenizer="bytes",
                             progress=False)
    base, patched = res["records"]
    assert base["state_mib"] is None and base["cache_mib"] > 0
    # page bounds (min and max of every 4 keys: a quarter of the cache, and their buffers' spare capacity), a
    # fingerprint of 4 features a page, the lists
    assert 0.3 * patched["cache_mib"] < patched["state_mib"] < 0.5 * patched["cache_mib"]


def test_a_generation_leaves_each_patched_layer_its_state():
    model = tiny_model("llama")
    longpatch.patch_model(model, {"method": "moba", "params": HYBRID, "layers": "all"})
    ids = torch.randint(1, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    sizes = [r.state_bytes() for r in model.longpatch.routes]
    assert all(s > 0 for s in sizes) and len(set(sizes)) == 1
