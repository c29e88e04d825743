"""The families' public API beyond patching: `attention_heads`, `wrap_attention` / `unwrap_attention`
(what sequence parallelism reaches a model through), on tiny models of every family."""
import pytest
import torch
from helpers import logits

from longpatch import patch_model, unpatch_model
from longpatch.errors import UnsupportedModelError
from longpatch.families import AttentionCall, detect_family
from longpatch.ops import exact_attention
from longpatch.testing.tiny import BUILDERS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
N = 24


def _instance_attrs(model) -> dict:
    """Every module's instance attributes (what a wrap or patch adds), by module name."""
    return {name: sorted(vars(m)) for name, m in model.named_modules()}


class Recorder:
    """An attend that records each call and computes exact attention."""

    def __init__(self):
        self.calls: list[tuple[AttentionCall, tuple, tuple]] = []

    def __call__(self, q, k, v, call):
        self.calls.append((call, tuple(q.shape), tuple(k.shape)))
        return exact_attention(q, k, v, causal=call.causal, scale=call.scale)


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_wrap_attention_sends_every_layer_and_unwrap_restores(name, patched):
    model = tiny_model(name)
    ids = torch.randint(0, 256, (2, N))
    ref = logits(model, ids)
    if patched:
        patch_model(model, {"method": "moba", "layers": [1, 3], "params": {"chunk_size": 8, "topk": 2}})
    fam = detect_family(model)
    hq, hk = fam.attention_heads(model)
    before, patched_ref = _instance_attrs(model), logits(model, ids)

    rec = Recorder()
    fam.wrap_attention(model, rec)
    with pytest.raises(UnsupportedModelError, match="already wrapped"):
        fam.wrap_attention(model, rec)
    got = logits(model, ids)
    fam.unwrap_attention(model)

    assert torch.allclose(got, ref, atol=1e-5)  # exact attention in every layer: the unpatched model's logits
    assert sorted(c.layer for c, _, _ in rec.calls) == list(range(fam.num_layers(model)))
    for call, q, k in rec.calls:
        assert q[1:3] == (hq, N) and k[1:3] == (hk, N) and q[0] == k[0] == 2
        assert call.causal and call.unsupported(N) is None
        route = call.route
        if patched and call.layer in (1, 3):
            assert route is not None and route.method.name == "moba" and route.layer_idx == call.layer
        else:
            assert route is None or route.method is None
    # unwrapped: the model as before, its routes in place
    assert _instance_attrs(model) == before
    assert torch.equal(logits(model, ids), patched_ref)
    if patched:
        assert model.longpatch.breakdown()["patched"]["prefill"]["method"]["calls"] > 0
        unpatch_model(model)
        assert torch.equal(logits(model, ids), ref)


def test_unsupported_is_the_familys_own_check():
    """A padding mask reaches `attend` as the reason the family's patched layers fall back for."""
    model = tiny_model("llama")
    fam = detect_family(model)
    rec = Recorder()
    fam.wrap_attention(model, rec)
    try:
        mask = torch.ones(1, N, dtype=torch.long)
        mask[0, :3] = 0
        logits(model, torch.randint(0, 256, (1, N)), attention_mask=mask)
    finally:
        fam.unwrap_attention(model)
    assert {c.unsupported(N) for c, _, _ in rec.calls} == {"a padding or custom attention mask"}


def test_attention_heads():
    assert detect_family(tiny_model("llama")).attention_heads(tiny_model("llama")) == (4, 2)
    assert detect_family(tiny_model("qwen2")).attention_heads(tiny_model("qwen2")) == (4, 1)
    assert detect_family(tiny_model("phi")).attention_heads(tiny_model("phi")) == (4, 4)
    glm = tiny_model("chatglm2")
    assert detect_family(glm).attention_heads(glm) == (4, 2)
