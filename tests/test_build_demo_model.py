"""The demo-model builder's parts (scripts/demo_model/, run by scripts/build_demo_model.py): phases, the
training samples, the retrieval probes and the model it builds. The full build is hours of CPU and is not
run here."""
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longpatch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
if str(SCRIPTS) not in sys.path:  # scripts/ is no package: its builder and command line import from there
    sys.path.insert(0, str(SCRIPTS))

import build_demo_model as cli  # noqa: E402
from demo_model.data import Mixer  # noqa: E402
from demo_model.model import make_model, parse_rope_scaling, save_served, serve_config  # noqa: E402
from demo_model.recipe import RECIPE, lr_factor, parse_phases, parse_recipe  # noqa: E402
from demo_model.report import repeat_probe  # noqa: E402
from demo_model.train import retrieval_accuracy  # noqa: E402

# The command line's flags, in --help's order, as they were before the builder was split into modules.
FLAGS = ["-h", "--help", "--out", "--ckpt", "--ckpt-minutes", "--seed", "--vocab", "--phases", "--lr", "--rope-theta",
         "--rope-scaling", "--serve-rope-factor", "--synth-span", "--synth-vocab", "--eval-every", "--eval-lengths",
         "--stop-after", "--export", "--threads", "--report", "--report-templates", "--report-lengths",
         "--report-depths", "--report-trials", "--report-work"]


@pytest.fixture(scope="module")
def mixer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(longpatch.demo_model_path())
    text = "\n".join(longpatch.assets.eval_documents()[:3])
    stream = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    return Mixer(tok, stream)


def test_phases_parse_and_reject_bad_specs():
    assert parse_phases("32x128:400:synthr,1024x8:700") == [(32, 128, 400, "synthr"), (1024, 8, 700, "mix")]
    assert parse_phases("64x2:10")[0].steps == 10 and parse_phases("64x2:10")[0].mix == "mix"
    stages = parse_recipe(RECIPE)
    assert len(stages) == 5 and stages[0][0] == (32, 128, 400, "synthr") and stages[-1][-1] == (32768, 1, 20, "mixk")
    for bad in ("32x128", "32:400", "0x8:10", "32x8:10:copy", "32x8:10:mix:x", "axb:1"):
        with pytest.raises(SystemExit, match="--phases: bad phase"):
            parse_phases(bad)


def test_bad_options_fail_in_one_message_before_any_work(tmp_path):
    assert parse_rope_scaling("none") == {}
    assert parse_rope_scaling("yarn:4:8192") == {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 8192}
    for bad in ("foo", "yarn:x:8192", "yarn:4", "linear:4:8192", "yarn:0.5:8192", "yarn:4:8192:1"):
        with pytest.raises(SystemExit, match="--rope-scaling: got"):
            parse_rope_scaling(bad)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    common = ["--ckpt", str(ckpt), "--out", str(out), "--report-work", str(tmp_path / "work")]
    for argv, message in ((["--phases", "bad:1"], "--phases: bad phase"), (["--rope-scaling", "foo"], "--rope-scaling"),
                          (["--report"], "has no training.json")):
        with pytest.raises(SystemExit, match=message):
            cli.main(common + argv)
    out.mkdir()
    (out / "training.json").write_text("{}")
    with pytest.raises(SystemExit, match="--report: --template: 'nope'"):
        cli.main(common + ["--report", "--report-templates", "nope"])
    assert not ckpt.exists() and not (tmp_path / "work").exists()


def test_stages_restart_the_schedule_without_changing_earlier_steps():
    one = parse_recipe("32x8:100:synthr,64x4:100")
    two = parse_recipe("32x8:100:synthr,64x4:100|128x2:200:ngram")
    assert two[0] == one[0] and two[1] == [(128, 2, 200, "ngram")]
    # the first stage's schedule (warm-up, constant, cosine to 0.1x over its last 15%) is untouched
    assert [lr_factor(s, two) for s in range(200)] == [lr_factor(s, one) for s in range(200)]
    assert lr_factor(0, one) == pytest.approx(1 / 50) and lr_factor(100, one) == 1.0
    assert lr_factor(199, one) == pytest.approx(0.1, abs=0.01)
    # the appended stage warms up again from its own first step and decays to 0.1x at its end
    assert lr_factor(200, two) == pytest.approx(1 / 50) and lr_factor(300, two) == 1.0
    assert lr_factor(399, two) == pytest.approx(0.1, abs=0.01)
    with pytest.raises(SystemExit, match="--phases: bad phase"):
        parse_recipe("32x8:100|")


def test_ngram_copy_samples_need_more_than_one_token_to_match(mixer):
    """Over a small alphabet each token recurs, so the token before a copied one also occurs at many
    places that are not the copy's source: one-token matching cannot tell where to copy from."""
    s = mixer.synthetic(random.Random(2), 512, "random", alphabet=64)
    assert not s.lm and s.answers and all(256 <= t < 320 for t in s.ids)
    a = s.answers[len(s.answers) // 2]
    assert sum(t == s.ids[a - 1] for t in s.ids[:a - 1]) > 2
    alphabets = {len(set(mixer.ngram(random.Random(i), 512).ids)) for i in range(12)}
    assert min(alphabets) <= 64 and max(alphabets) > 256  # several alphabets, the whole vocabulary too


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_needle_samples_ask_for_the_planted_value(mixer, kind):
    rng = random.Random(3)
    s = mixer.needles(rng, 512, kind=kind, n_needles=2, depth=0.3, value="71432",
                      name="PASSKEY" if kind == "code" else "pass key")
    assert len(s.ids) == 513 and s.lm
    text = mixer.tok.decode(s.ids)
    needle = "PASSKEY = 71432" if kind == "code" else "The pass key is 71432."
    question = "assert PASSKEY ==" if kind == "code" else "What is the pass key? The pass key is"
    assert needle in text and question in text
    assert text.index(needle) < text.index(question)
    # the scored answer tokens are the value right after the first question
    first = [a for a in s.answers if a < s.answers[0] + len(mixer.enc(" 71432"))]
    assert mixer.tok.decode([s.ids[a] for a in first]).strip() == "71432"
    assert mixer.tok.decode(s.ids[:first[0]]).rstrip().endswith(question)


def test_recall_samples_assert_every_planted_fact(mixer):
    """Multi-query recall: every planted `NAME = V` is asserted after the code, each with its own value."""
    s = mixer.recall(random.Random(4), 1024)
    assert len(s.ids) == 1025 and s.lm
    lines = mixer.tok.decode(s.ids).split("\n")
    facts = dict(ln.split(" = ") for ln in lines if " = " in ln and ln.split(" = ")[1].isdigit()
                 and ln.split(" = ")[0].replace("_", "").isalpha() and ln.split(" = ")[0].isupper())
    asked = [ln[len("assert "):].split(" == ") for ln in lines if ln.startswith("assert ") and " == " in ln]
    assert len(asked) >= 4 and len({name for name, _ in asked}) == len(asked)
    assert all(facts[name] == value for name, value in asked)
    # the scored tokens are exactly the asserted values
    assert mixer.tok.decode([s.ids[a] for a in s.answers]).split() == [v for _, v in asked]


def test_long_value_recall_shares_a_first_digit_half_the_time(mixer):
    """recall_long: every asked value has 4-6 digits; in samples with a shared prefix all values start with
    the same digit (so after the first value token only the name tells the lines apart)."""
    shared = 0
    for seed in range(12):
        s = mixer.recall_long(random.Random(seed), 1024)
        lines = mixer.tok.decode(s.ids).split("\n")
        values = [ln.split(" == ")[1] for ln in lines if ln.startswith("assert ") and " == " in ln]
        assert len(values) >= 4 and all(v.isdigit() and 4 <= len(v) <= 6 for v in values)
        assert mixer.tok.decode([s.ids[a] for a in s.answers]).split() == values
        shared += len({v[0] for v in values}) == 1
    assert 2 <= shared <= 10  # about half of the samples (a shared digit by chance is rare with >= 4 values)


@pytest.mark.parametrize("mode", ["half", "random", "periodic"])
def test_copy_samples_score_only_tokens_that_copying_predicts(mixer, mode):
    s = mixer.synthetic(random.Random(5), 128, mode)
    assert len(s.ids) == 129 and not s.lm and s.answers
    # one offset k explains every scored token as a copy of the token k earlier (random tokens: no
    # other offset does), and the copy's first token, which nothing predicts, is not scored
    ks = [k for k in range(1, s.answers[0] + 1) if all(s.ids[a] == s.ids[a - k] for a in s.answers)]
    assert len(ks) == 1
    first = s.answers[0] - 1
    assert s.ids[first] == s.ids[first - ks[0]] and first not in s.answers


def test_code_repeat_samples_copy_a_span(mixer):
    s = mixer.repeat(random.Random(7), 256)
    assert len(s.ids) == 257 and s.lm
    dst = s.answers[0] - 1
    span = s.ids[dst:s.answers[-1] + 1]
    assert any(s.ids[i:i + len(span)] == span for i in range(dst - len(span) + 1))


def test_samples_are_a_function_of_the_seed(mixer):
    def draw(seed):
        rng = random.Random(seed)
        return [mixer.draw(rng, 256, mix).ids for mix in ("mix", "mix", "synthr", "synthp", "ngram", "mixn", "mixk")]
    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


def test_built_model_loads_with_plain_transformers_and_its_probes_run(mixer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model(len(mixer.tok), 0, 1e6, "yarn:4:8192")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = loaded.config
    assert cfg.max_position_embeddings >= 32768 and cfg.head_dim == 64
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0
    report = repeat_probe(loaded, mixer.stream, lengths=(64,), windows=1)
    r = report["64"]
    assert r["ratio"] == pytest.approx(r["second"] / r["first"], rel=1e-3)
    # random weights do not copy: the second copy is about as hard as the first
    assert 0.8 < r["ratio"] < 1.2
    acc = retrieval_accuracy(loaded, mixer, 128, "synth", trials=2)
    assert 0.0 <= acc <= 0.2


def test_served_rope_stretches_the_slow_dimensions_only(mixer, tmp_path):
    """serve_config: YaRN factor 16 over the trained 4 keeps the fast RoPE dimensions and the trained
    attention factor, and turns the slowest dimensions at 32k tokens as far as training did at 8k."""
    import math

    from transformers import AutoModelForCausalLM

    model = make_model(len(mixer.tok), 0, 1e6, "yarn:4:8192")
    rope, max_pos = serve_config(model.config, 16)
    assert rope["factor"] == 16.0 and max_pos == 16 * 8192
    assert rope["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)
    model.save_pretrained(tmp_path)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path).model.rotary_emb
    served = AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters=rope,
                                                  max_position_embeddings=max_pos).model.rotary_emb
    assert served.attention_scaling == pytest.approx(trained.attention_scaling)
    f_t, f_s = trained.inv_freq, served.inv_freq
    assert torch.equal(f_s[:8], f_t[:8])  # wavelength < 8192/32: never interpolated
    assert torch.allclose(f_s[-8:] * 32768, f_t[-8:] * 8192)  # slowest: 32k served == 8k trained
    assert torch.all(f_s <= f_t)
    with pytest.raises(SystemExit, match="trained YaRN factor 4"):
        serve_config(model.config, 2)
    with pytest.raises(SystemExit, match="rope_type 'default'"):
        serve_config(make_model(len(mixer.tok), 0, 1e6, "none").config, 16)


def test_export_and_finish_write_the_served_rope(mixer, tmp_path):
    """save_served (used by --export and by the finished build): config.json carries the served YaRN
    factor, the reloaded model uses it, and factor 0 writes the model as trained."""
    import json

    model = make_model(len(mixer.tok), 0, 1e6, "yarn:4:8192")
    served = save_served(model, mixer.tok, tmp_path / "served", 16, lambda msg: None)
    written = json.loads((tmp_path / "served" / "config.json").read_text())
    assert written["rope_parameters"]["factor"] == 16.0 and written["max_position_embeddings"] == 16 * 8192
    assert served.config.rope_parameters["factor"] == 16.0
    assert (tmp_path / "served" / "tokenizer.json").is_file()
    as_trained = save_served(model, mixer.tok, tmp_path / "trained", 0, lambda msg: None)
    assert as_trained is model
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["rope_parameters"]["factor"] == 4.0


def test_command_line_help_runs_as_a_file_and_lists_the_same_flags(tmp_path):
    """`python scripts/build_demo_model.py --help` from any directory: the entry finds its package beside
    it, and offers the flags it offered before the split."""
    res = subprocess.run([sys.executable, str(SCRIPTS / "build_demo_model.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    options = re.split(r"\n(?:options|optional arguments):\n", res.stdout)[-1]
    lines = re.finditer(r"^  (-[\w-]+)(?: [A-Z_]+)?(?:, (--[\w-]+))?", options, re.M)  # '-h, --help', '--out OUT'
    flags = [f for m in lines for f in m.groups() if f]
    assert flags == FLAGS
    assert [a.option_strings for a in cli.parser()._actions] == [FLAGS[:2]] + [[f] for f in FLAGS[2:]]
