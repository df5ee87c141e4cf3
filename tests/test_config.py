import pytest

from rwkvx_cli.config import ConfigError, config_from_dict, config_to_dict, load_config


def test_defaults_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layer: 2\ntrain:\n  lr: 6e-4\n  tokens: 2e6\n")
    cfg = load_config(path, ["train.lr=1e-3", "model.n_embd=256", "data.corpus=x.txt"])
    assert cfg.model.n_layer == 2 and cfg.model.n_embd == 256
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.tokens == 2_000_000 and isinstance(cfg.train.tokens, int)
    assert cfg.data.corpus == ["x.txt"]
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lrr=1", "unknown config key 'train.lrr' (did you mean 'lr'?)"),
        ("modle.n_layer=1", "unknown config key 'modle' (did you mean 'model'?)"),
        ("train.lr=fast", "train.lr: expected float, got 'fast'"),
        ("train.ctx_len=1.5", "train.ctx_len: expected int, got 1.5"),
        ("train.compile=3", "train.compile: expected bool, got 3"),
        ("model.n_embd=100", "model.n_embd: 100 is not divisible by model.head_size"),
        ("train.ctx_len=0", "train.ctx_len: must be >= 1"),
        ("train.betas=[0.9]", "train.betas: expected 2 values, got 1"),
        ("model=3", "model: expected a mapping"),
        ("novalue", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    assert e.value.exit_code == 2


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_shipped_configs_load():
    for name in ("tiny", "tiny-rwkvx", "gpu-L12-D768"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.total_steps >= 1
