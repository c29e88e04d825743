"""The one way from options to specs (longpatch.specs.resolve) and the one grammar of list options
(longpatch.options): precedence, several configs, --set routing, and one-line errors."""
import pytest

from longpatch import ConfigError, LoadSpec, PatchConfig, resolve
from longpatch.options import parse_floats, parse_ints, parse_layer_counts, parse_layers, parse_names, parse_set


def test_model_alias_brings_its_yaml_and_plain_names_get_exact():
    spec = resolve("chatglm2-6b-32k")
    assert spec.load == LoadSpec(model="THUDM/chatglm2-6b-32k", dtype="bfloat16", trust_remote_code=True)
    assert spec.patch.method == "hyper" and spec.patch.layers == 20
    plain = resolve("tiny:llama")
    assert plain.load == LoadSpec(model="tiny:llama") and plain.patches == ((None, PatchConfig()),)


def test_precedence_config_method_layers_set():
    spec = resolve("tiny:llama", "demo-moba", "moba", "2", ["topk=2", "dtype=bfloat16", "min_seq_len=8"])
    (name, cfg), = spec.patches
    assert name == "demo-moba" and cfg.method == "moba" and cfg.layers == 2 and cfg.min_seq_len == 8
    assert cfg.params["topk"] == 2
    # the config's loading keys fill in (demo-moba says float32) but never change the model; --set wins
    assert spec.load.model == "tiny:llama" and spec.load.dtype == "bfloat16"
    assert resolve("tiny:llama", "demo-moba").load.dtype == "float32"
    # another method starts from its own defaults, not the config's params
    assert resolve("tiny:llama", "demo-moba", "hyper").patch.params == PatchConfig("hyper").params
    assert resolve("tiny:llama", None, None, "1:2").patch.layers == [1, 2]


def test_several_configs_share_one_load():
    spec = resolve("demo", "demo,demo-moba, demo-nsa")
    assert [n for n, _ in spec.patches] == ["demo", "demo-moba", "demo-nsa"]
    assert [p.method for _, p in spec.patches] == ["hyper", "moba", "nsa"]
    with pytest.raises(ConfigError, match="this command applies one"):
        _ = spec.patch
    assert resolve("demo", ["demo", PatchConfig("sparse")]).patches[1] == (None, PatchConfig("sparse"))


def test_configs_disagreeing_on_loading(tmp_path):
    (tmp_path / "a.yaml").write_text("method: exact\ndtype: float32\n")
    (tmp_path / "b.yaml").write_text("method: exact\ndtype: bfloat16\n")
    both = f"{tmp_path / 'a.yaml'},{tmp_path / 'b.yaml'}"
    with pytest.raises(ConfigError, match=r"dtype: 'bfloat16' but .*a.yaml has 'float32'.*--set dtype="):
        resolve("tiny:llama", both)
    assert resolve("tiny:llama", both, sets=["dtype=float16"]).load.dtype == "float16"


@pytest.mark.parametrize("args, match", [
    (dict(config="demo,,demo-moba"), "--config: got 'demo,,demo-moba' with an empty item"),
    (dict(config=","), "--config: got ',' .empty.; allowed"),
    (dict(layers="1,"), "--layers: got '1,' with an empty item"),
    (dict(layers="all,2"), "'all' cannot be combined"),
    (dict(sets=["model=x"]), "--set model: the model is the model argument"),
    (dict(sets=["bogus=1"]), "--set bogus: unknown key; allowed: .*attn_implementation"),
    (dict(sets=["dtype=fp8"]), "dtype: got 'fp8'"),
    (dict(sets=["noequals"]), "expected key=value"),
])
def test_resolve_errors_are_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        resolve("tiny:llama", **args)
    assert "\n" not in str(e.value)


def test_list_grammar():
    assert parse_ints("--x", "0:8:4,2,1:3") == [0, 4, 8, 2, 1, 3]
    assert parse_ints("--x", [3, "5"]) == [3, 5]
    assert parse_layer_counts("0:28:4")[-1] == 28 and parse_layer_counts("0,all") == [0, "all"]
    assert parse_layers("20") == 20 and parse_layers("all") == "all" and parse_layers("9,8:8") == [8, 9]
    assert parse_floats("--d", "0:1:0.25", 0, 1, "x") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert parse_names("--m", " a,b ,a") == ["a", "b"]
    assert parse_set("block_size=128") == ("block_size", 128)
    assert parse_set("layers=[1, 2]") == ("layers", [1, 2]) and parse_set("seed=") == ("seed", None)
    for bad in ("1:", "2:1", "x", "1:2:0", "-1", "٣"):
        with pytest.raises(ConfigError, match="--x"):
            parse_ints("--x", bad)
    with pytest.raises(ConfigError, match=r"every value must lie in \[0, 1\]"):
        parse_floats("--d", "0.5,2", 0, 1, "x")
    with pytest.raises(ConfigError, match="malformed YAML"):
        parse_set("layers=[1, 2")


# issue 42: a float range never yields a value past its end (float steps included); ranges are counted
# against their bounds before they are expanded; de-duplication is linear
@pytest.mark.parametrize("spec, want", [
    ("0.1:0.9:0.3", [0.1, 0.4, 0.7]), ("0:1:0.6", [0.0, 0.6]), ("0:0.5:0.3", [0.0, 0.3]),
    ("0:1:0.1", [round(i / 10, 6) for i in range(11)]), ("0.1:1:0.3", [0.1, 0.4, 0.7, 1.0]),
    ("0:0.3:0.1", [0.0, 0.1, 0.2, 0.3]), ("0.25:0.25:1", [0.25]),
])
def test_float_ranges_stop_at_their_end(spec, want):
    assert parse_floats("--depths", spec, 0, 1, "x") == want


def test_ranges_are_bounded_before_expansion_and_deduplicated_in_linear_time():
    from longpatch.options import MAX_VALUES

    for spec in ("1:100000000000", f"0:{MAX_VALUES}", f"1:{MAX_VALUES // 2},1:{MAX_VALUES // 2 + 2}"):
        with pytest.raises(ConfigError, match=f"at most {MAX_VALUES} values"):
            parse_ints("--x", spec)
    with pytest.raises(ConfigError, match="at most"):
        parse_floats("--d", "0:1:0.0000001", 0, 1, "x")
    with pytest.raises(ConfigError, match=r"<= 100"):
        parse_ints("--x", "1:1000000000", high=100)
    with pytest.raises(ConfigError, match=r"in \[1, 100\]"):
        parse_ints("--x", "101", 1, high=100)
    half = MAX_VALUES // 2
    assert parse_ints("--x", f"1:{half},1:{half}") == list(range(1, half + 1))  # quadratic: seconds


def test_layers_refuse_repeats_like_a_config():
    for spec in ("3,3", "0:2,2:2"):
        with pytest.raises(ConfigError, match="more than once"):
            parse_layers(spec)
    with pytest.raises(ConfigError, match="repeated"):
        PatchConfig.from_dict({"method": "exact", "layers": [1, 1, 2]})
