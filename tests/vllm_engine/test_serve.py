"""`longpatch serve` starts vLLM's OpenAI-compatible server with longpatch's backend: on loopback, a real OpenAI
client's completion request gets the tokens transformers gives with patch_model; a bad config is one line."""
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from test_vllm_engine import SMALL  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LONGPATCH_CONFIG"}
    return {**env, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


def test_the_server_answers_an_openai_client_with_the_patched_tokens(tmp_path):
    import torch

    import longpatch
    from longpatch.loading import load_model
    cfg = tmp_path / "moba.yaml"
    cfg.write_text("model: demo\ndtype: float32\n" + SMALL["moba"] + "layers: [0, 2, 3]\n")
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "longpatch", "serve", "--model", "demo", "--config", str(cfg),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                               "--block-size", "32", "--max-model-len", "8192", "--max-num-batched-tokens", "8192"],
                              env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "the server did not come up in 600 s"
            time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        name = client.models.list().data[0].id
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(5, 500, (6000,), generator=g).tolist()
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
        got = reply.choices[0].model_extra["token_ids"]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    model, _ = load_model("demo", dtype="float32")
    longpatch.patch_model(model, str(cfg))
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert got == want
    assert "longpatch's attention backend runs" in (tmp_path / "server.log").read_text()


def test_serve_with_a_bad_config_is_one_line_and_a_nonzero_exit():
    r = subprocess.run([sys.executable, "-m", "longpatch", "serve", "--model", "demo", "--config", "no-such-config"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no-such-config" in lines[0]
