"""The CLI: tables on success; one line on stderr, exit != 0 and no traceback on bad input."""
import subprocess
import sys

import pytest

import longpatch
from longpatch import cli


def run(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["longpatch", *argv])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_list(monkeypatch, capsys):
    code, out, _ = run(["list"], monkeypatch, capsys)
    assert code == 0
    for word in ("chatglm2", "hf", "exact", "chatglm2-6b-32k", "phi-1_5", "llama-3.1-8b"):
        assert word in out


def test_apply_prints_table_and_prefill(monkeypatch, capsys):
    code, out, _ = run(["apply", "--model", "tiny:phi", "--layers", "3", "--method", "exact", "--prefill", "64"],
                       monkeypatch, capsys)
    assert code == 0
    assert "patched 3 of 4 layers with 'exact'" in out and "one forward pass, 64 tokens" in out


def test_apply_save_and_reapply(tmp_path, monkeypatch, capsys):
    target = tmp_path / "saved"
    code, _, _ = run(["apply", "--model", "tiny:llama", "--layers", "1,3", "--method", "exact", "--set",
                      "min_seq_len=32", "--save", str(target)], monkeypatch, capsys)
    assert code == 0
    assert (target / "config.json").is_file() and (target / "longpatch.yaml").is_file()
    saved = sorted(p.name for p in target.iterdir())
    model = longpatch.from_pretrained(target)
    assert longpatch.patched_layers(model) == [1, 3] and model.longpatch.config.min_seq_len == 32
    assert longpatch.read_config(target).load["model"] == "tiny:llama"
    # saving over a non-empty directory fails and leaves it untouched
    code, _, err = run(["apply", "--model", "tiny:llama", "--layers", "1", "--method", "exact", "--save", str(target)],
                       monkeypatch, capsys)
    assert code == 2 and "not empty" in err
    assert sorted(p.name for p in target.iterdir()) == saved
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]


@pytest.mark.parametrize("argv, needle", [
    (["apply", "--model", "tiny:llama", "--layers", "9", "--method", "exact"], "layers: got 9"),
    (["apply", "--model", "tiny:llama", "--layers", "x", "--method", "exact"], "--layers"),
    (["apply", "--model", "tiny:llama", "--method", "bogus"], "method: got 'bogus'"),
    (["apply", "--model", "tiny:llama", "--method", "exact", "--set", "block_size=3"], "--set block_size"),
    (["apply", "--model", "tiny:gpt9", "--method", "exact"], "tiny:gpt9"),
    (["apply", "--model", "no/such-model-here", "--method", "exact"], "cannot load 'no/such-model-here'"),
    (["apply", "--model", "tiny:llama", "--config", "nope.yaml"], "neither a file nor a bundled alias"),
])
def test_bad_input_one_line_exit_2(argv, needle, monkeypatch, capsys):
    code, _, err = run(argv, monkeypatch, capsys)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_yaml(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: exact\nparams: {a: 1\n")
    code, _, err = run(["apply", "--model", "tiny:llama", "--config", str(bad)], monkeypatch, capsys)
    assert code == 2 and "malformed YAML" in err and "Traceback" not in err


def test_console_script_end_to_end():
    """The installed entry point, in a fresh process: usage errors and success."""
    ok = subprocess.run([sys.executable, "-m", "longpatch", "apply", "--model", "tiny:qwen2", "--layers", "all",
                         "--method", "exact"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "patched 4 of 4 layers" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "longpatch", "apply", "--layers", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--model" in bad.stderr and "Traceback" not in bad.stderr
