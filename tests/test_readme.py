"""The README's Python snippets run as written, on a tiny model in place of the hub's."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_python_snippets_run(monkeypatch, capsys):
    import transformers

    from longpatch.testing.tiny import tiny_model

    loaded = []

    def from_pretrained(name, *args, **kwargs):  # offline: a tiny phi with phi-1_5's 24 layers
        loaded.append(name)
        return tiny_model("phi", num_hidden_layers=24)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    blocks = python_blocks(README.read_text())
    assert blocks
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 128, 16, generator=g)  # the snippet's q [b, hq, n, d] and k/v [b, hk, n, d]
    k, v = torch.randn(2, 1, 2, 128, 16, generator=g)
    ns = {}
    for i, block in enumerate(blocks):
        ns = {"q": q, "k": k, "v": v}
        exec(compile(block, f"{README}:python block {i + 1}", "exec"), ns)
    assert loaded == ["microsoft/phi-1_5"]
    assert capsys.readouterr().out.strip() == str(list(range(12, 24)))  # the comment beside the print
    assert not hasattr(ns["model"], "longpatch")  # unpatched at the end
    assert ns["out"].shape == q.shape and torch.isfinite(ns["out"]).all()
