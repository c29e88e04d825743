"""patch_model on real transformers model classes (tiny random weights) and the ChatGLM2 layout."""

import pytest
import torch
from helpers import PROBE_CALLS, logits

import longpatch
from longpatch import ConfigError, patch_model, patched, patched_layers, unpatch_model
from longpatch.testing.tiny import tiny_model

HF = ["llama", "phi", "qwen2", "mistral"]


@pytest.mark.parametrize("name", HF + ["chatglm2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_exact_patch_equals_unpatched_and_unpatch_restores(name, impl):
    if name == "chatglm2" and impl == "eager":
        pytest.skip("chatglm2 has one attention implementation")
    model = tiny_model(name, attn_implementation=impl)
    ids = torch.randint(0, 256, (2, 48))
    ref = logits(model, ids)
    keys = set(model.state_dict())
    patch_model(model, {"method": "exact", "layers": 2})
    assert patched_layers(model) == [2, 3]
    torch.testing.assert_close(logits(model, ids), ref, atol=1e-5, rtol=1e-5)
    stats = model.longpatch.stats()
    assert stats["patched"]["method"]["calls"] == 2  # one call per patched layer
    assert stats["unpatched"]["original"]["calls"] == 2
    unpatch_model(model)
    assert patched_layers(model) == [] and not hasattr(model, "longpatch")
    assert set(model.state_dict()) == keys
    if name != "chatglm2":
        assert model.config._attn_implementation == impl
    assert torch.equal(logits(model, ids), ref)


@pytest.mark.parametrize("name", HF + ["chatglm2"])
def test_only_chosen_layers_are_routed_and_get_buffers(name):
    model = tiny_model(name)
    PROBE_CALLS.clear()
    patch_model(model, longpatch.PatchConfig(method="probe", layers=[0, 2], params={"level": 3}))
    buffers = {k: t for k, t in model.named_buffers() if k.endswith("longpatch_marker")}
    assert len(buffers) == 2 and all(float(t[0]) == 3.0 for t in buffers.values())
    assert not any("longpatch" in k for k in model.state_dict())  # drawn from the config: not persistent
    logits(model, torch.randint(0, 256, (1, 40)))
    assert PROBE_CALLS == [(40, 40), (40, 40)]
    assert [r.layer_idx for r in model.longpatch.routes if r.calls[("prefill", "method")]] == [0, 2]
    unpatch_model(model)
    assert not any("longpatch" in k for k, _ in model.named_buffers())


def test_layer_selection_forms():
    model = tiny_model("llama")
    for spec, expect in [(0, []), (1, [3]), ("all", [0, 1, 2, 3]), ([1, 2], [1, 2])]:
        with patched(model, {"method": "exact", "layers": spec}):
            assert patched_layers(model) == expect
        assert patched_layers(model) == []
    with pytest.raises(ConfigError, match="has 4 layers"):
        patch_model(model, {"method": "exact", "layers": 5})
    with pytest.raises(ConfigError, match="out of range"):
        patch_model(model, {"method": "exact", "layers": [4]})
    assert not hasattr(model, "longpatch")


def test_patching_twice_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: exact\nlayers: 1\n")
    patch_model(model, str(cfg))
    with pytest.raises(ConfigError, match="already patched"):
        patch_model(model, {"method": "exact", "layers": 2})
    assert patched_layers(model) == [3]


def test_min_seq_len_and_decode_fallback():
    """Short prefills and decode (no method decode) take exact attention; outputs unchanged."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 24))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    patch_model(model, {"method": "probe", "layers": 2, "min_seq_len": 16})
    PROBE_CALLS.clear()
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    stats = model.longpatch.stats()["patched"]
    assert PROBE_CALLS == [(24, 24), (24, 24)]  # the prefill only
    assert stats["exact"]["calls"] == 2 * 5  # 5 decode steps x 2 layers
    model.longpatch.reset_stats()
    logits(model, ids[:, :10])  # shorter than min_seq_len
    stats = model.longpatch.stats()["patched"]
    assert set(stats) == {"exact"} and stats["exact"]["calls"] == 2


@pytest.mark.parametrize("name", HF)
def test_generate_with_exact_patch_matches(name):
    model = tiny_model(name)
    ids = torch.randint(0, 256, (1, 20))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    with patched(model, {"method": "exact", "layers": "all"}):
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert model.longpatch.stats()["patched"]["method"]["calls"] == 4 * 5  # prefill + 4 decode steps
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["llama", "chatglm2"])
def test_padding_runs_the_method_on_each_rows_real_tokens(name):
    # a padded batch no longer falls back to the model's attention: each row's real tokens run alone
    # (docs/methods.md, "Batches"); the probe records each call's (q_len, kv_len)
    model = tiny_model(name)
    ids = torch.randint(0, 256, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, 23:] = 0  # right padding: both families give rows their own positions
    ref = logits(model, ids, attention_mask=mask)
    patch_model(model, {"method": "probe", "layers": 2})
    PROBE_CALLS.clear()
    out = logits(model, ids, attention_mask=mask)
    assert PROBE_CALLS == [(30, 30), (23, 23)] * 2  # 2 patched layers, each row alone
    assert model.longpatch.stats()["patched"]["method"]["calls"] == 4
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1, :23], ref[1, :23], atol=1e-5, rtol=1e-5)


def test_chatglm2_incremental_decode_matches_unpatched():
    model = tiny_model("chatglm2")
    ids = torch.randint(0, 256, (1, 33))

    def run():
        out, cache = model(ids[:, :30], use_cache=True)
        steps = [out[:, -1]]
        for t in range(30, 33):
            out, cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out[:, -1])
        return torch.stack(steps)

    with torch.no_grad():
        ref = run()
        patch_model(model, {"method": "probe", "layers": "all"})
        PROBE_CALLS.clear()
        out = run()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the probe saw the real 2 K/V groups of the layout, not the 4 expanded heads
    assert PROBE_CALLS == [(30, 30)] * 4
    assert model.longpatch.stats()["patched"]["exact"]["calls"] == 4 * 3


def test_chatglm2_methods_see_groups_not_expanded_heads():
    model = tiny_model("chatglm2")
    seen = []
    from longpatch.methods import Method, register_method
    from longpatch.ops import exact_attention

    def record(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1]))
        return exact_attention(q, k, v, causal=kw["causal"], scale=kw["scale"])
    register_method(Method(name="record_heads", summary="test", prefill=record))
    patch_model(model, {"method": "record_heads", "layers": 1})
    logits(model, torch.randint(0, 256, (1, 12)))
    assert seen == [(4, 2)]


def test_unsupported_model_error_lists_families():
    with pytest.raises(longpatch.UnsupportedModelError, match="supported: chatglm2, hf"):
        patch_model(torch.nn.Linear(2, 2), {"method": "exact"})


def test_chatglm2_loader_compat_fills_missing_config_attributes():
    from longpatch.families.chatglm2 import prepare_loaded
    model = tiny_model("chatglm2")
    assert not hasattr(model.config, "use_cache")  # like the remote ChatGLMConfig on transformers 5.x
    prepare_loaded(model)
    assert model.config.use_cache is True


def test_save_pretrained_of_a_patched_model_loads_into_the_unpatched_model(tmp_path):
    """The method buffers (drawn from the config) are not saved, so a plain HF save of a
    patched model loads strictly, without an unexpected-keys report."""
    import warnings

    from transformers import AutoModelForCausalLM

    model = tiny_model("llama")
    patch_model(model, {"method": "hyper", "layers": 2, "params": {"block_size": 8, "sample_size": 8}})
    model.save_pretrained(tmp_path)
    unpatched = tiny_model("llama")
    from safetensors.torch import load_file
    unpatched.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    moved = model.to(torch.float64)  # the buffers still move with the model, but keep the dtype they were drawn in
    dirs = [t for k, t in moved.named_buffers() if k.endswith("longpatch_lsh_dirs")]
    assert len(dirs) == 2 and all(t.dtype == torch.float32 for t in dirs)


# issue 42: one answer to one input in the Python API
@pytest.mark.parametrize("key, value", [("dtype", "float16"), ("model", "x"), ("trust_remote_code", True)])
def test_patch_model_refuses_a_loading_key_as_patchconfig_does(key, value):
    cfg = {"method": "hyper", key: value}
    with pytest.raises(ConfigError, match=f"^{key}: a loading key"):
        longpatch.PatchConfig.from_dict(cfg)
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match=f"^{key}: a loading key"):
        patch_model(model, cfg)
    assert patched_layers(model) == [] and getattr(model, "longpatch", None) is None


def test_a_patch_of_no_layers_is_replaced_by_the_next_patch():
    model = tiny_model("llama")
    patch_model(model, {"method": "hyper", "layers": 0})
    assert patched_layers(model) == []
    patch_model(model, {"method": "exact", "layers": 1})
    assert patched_layers(model) == [model.config.num_hidden_layers - 1]
    with pytest.raises(ConfigError, match="already patched by longpatch .1 layers run 'exact'"):
        patch_model(model, {"method": "hyper", "layers": 1})


def test_growing_cache_reserve_is_checked_when_built():
    from longpatch import GrowingCache

    for bad in (-1, "abc", 10 ** 12, 1.5):
        with pytest.raises(ConfigError, match="GrowingCache: reserve"):
            GrowingCache(reserve=bad)
    assert GrowingCache(reserve=64) is not None


def test_nsa_module_sizes_are_checked():
    from longpatch.ops import NSAAttention

    for args in ((0, 4, 2, 16), (64, 0, 2, 16), (64, 4, 0, 16), (64, 4, 2, 0)):
        with pytest.raises(ValueError, match="NSAAttention: "):
            NSAAttention(*args)
    with pytest.raises(ValueError, match="^scale: got -1"):
        NSAAttention(64, 4, 2, 16, scale=-1)
    assert NSAAttention(64, 4, 2, 16) is not None
