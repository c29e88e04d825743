import pytest

import longpatch
from longpatch import ConfigError, PatchConfig, load_config
from longpatch.config import LoadSpec, read_config, select_layers, split_config


def test_defaults_and_minimal_forms():
    cfg = PatchConfig(method="exact", layers=2)
    assert cfg.layers == 2 and cfg.params == {} and cfg.min_seq_len == 0
    assert PatchConfig.from_dict({"method": "exact", "layers": [3, 1]}).layers == [1, 3]


@pytest.mark.parametrize("data, key", [
    ({"methd": "exact"}, "methd"),
    ({"method": "nope"}, "method"),
    ({"method": "exact", "layers": -1}, "layers"),
    ({"method": "exact", "layers": "some"}, "layers"),
    ({"method": "exact", "layers": [1, 1]}, "layers"),
    ({"method": "exact", "layers": True}, "layers"),
    ({"method": "exact", "min_seq_len": "4k"}, "min_seq_len"),
    ({"method": "exact", "dtype": "fp8"}, "dtype"),
    ({"method": "exact", "backend": "cuda"}, "backend"),
    ({"method": "exact", "trust_remote_code": "yes"}, "trust_remote_code"),
    ({"method": "exact", "params": {"block_size": 3}}, "params.block_size"),
    ({"method": "probe", "params": {"level": -2}}, "params.level"),
    ({"method": "probe", "params": {"level": "x"}}, "params.level"),
])
def test_bad_values_name_key_value_and_allowed(data, key):
    import helpers  # noqa: F401  (registers the probe method)
    with pytest.raises(ConfigError) as e:
        split_config(data)  # a config's two halves: the patch and the loading keys, each checked
    msg = str(e.value)
    assert msg.startswith(key) and "allowed" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_select_layers():
    assert select_layers(20, 28) == list(range(8, 28))  # the paper's convention
    assert select_layers(0, 28) == []
    assert select_layers("all", 3) == [0, 1, 2]
    assert select_layers([0, 5], 6) == [0, 5]
    with pytest.raises(ConfigError, match="has 28 layers"):
        select_layers(29, 28)
    with pytest.raises(ConfigError, match="out of range"):
        select_layers([2, 28], 28)


def test_yaml_file_alias_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("method: exact\nlayers: 3\nmin_seq_len: 16\n")
    cfg = load_config(p)
    assert (cfg.method, cfg.layers, cfg.min_seq_len) == ("exact", 3, 16)
    assert load_config(str(p)) == cfg
    assert cfg.with_overrides(["layers=all", "min_seq_len=8"]).layers == "all"
    with pytest.raises(ConfigError, match="unknown key"):
        cfg.with_overrides(["bogus=1"])
    alias = read_config("chatglm2-6b-32k")
    assert alias.patch == load_config("chatglm2-6b-32k") and alias.patch.layers == 20
    assert alias.load == {"model": "THUDM/chatglm2-6b-32k", "trust_remote_code": True, "dtype": "bfloat16"}


def test_patch_and_load_specs_apart():
    with pytest.raises(ConfigError, match="^dtype: a loading key .*load_model"):
        PatchConfig.from_dict({"method": "exact", "dtype": "float32"})
    with pytest.raises(ConfigError, match="^layers: unknown config key"):
        LoadSpec.from_dict({"model": "x", "layers": 2})
    with pytest.raises(ConfigError, match="^device_map: got 'cuda'; allowed: auto"):
        LoadSpec(model="x", device_map="cuda")
    both = split_config({"model": "demo", "dtype": "float32", "method": "moba", "layers": 2})
    assert both.load == {"model": "demo", "dtype": "float32"} and both.patch == PatchConfig("moba", layers=2)
    # a dict given to patch_model is a patch, as PatchConfig.from_dict reads it: a loading key is refused, not
    # dropped (issue 42); a YAML file holds both halves
    from longpatch.config import as_config
    with pytest.raises(ConfigError, match="^model: a loading key"):
        as_config({"model": "demo", "method": "moba"})


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: exact\nlayers: [1, 2\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    with pytest.raises(ConfigError, match="neither a file nor a bundled alias"):
        load_config(tmp_path / "missing.yaml")


def test_as_config_rejects_other_types():
    import torch

    from longpatch.testing.tiny import tiny_model
    with pytest.raises(ConfigError, match="config"):
        longpatch.patch_model(tiny_model("llama"), 42)
    del torch
