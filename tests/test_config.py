import dataclasses
import os
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rwkvx_cli.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)


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
        ("model.ln_x_eps=0", "model.ln_x_eps: must be a finite number > 0"),
        ("model.ln_x_eps=-1e-5", "model.ln_x_eps: must be a finite number > 0"),
        ("model.ln_x_eps=.inf", "model.ln_x_eps: expected a finite number"),
        ("train.checkpoint_format=dcp", "train.checkpoint_format: must be full or sharded"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.layers=rwkv7,gdn", "model.n_layer=4"], "model.n_layer: 4 disagrees with model.layers (2)"),
        (["model.layers=rwkv7,moba,gdn", "model.n_attn=0"], "model.n_attn: 0 disagrees with model.layers (1)"),
    ],
)
def test_a_written_count_that_conflicts_with_layers_is_refused_even_at_its_default(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_layer_counts_that_agree_with_layers_round_trip():
    cfg = load_config(None, ["model.layers=rwkv7,moba,gdn", "model.n_layer=2", "model.n_attn=1"])
    assert (cfg.model.n_layer, cfg.model.n_attn) == (2, 1)
    assert config_from_dict(config_to_dict(cfg)) == cfg  # a checkpoint's config writes both


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


def test_the_rwkv_lm_recipe_is_the_reference_s_demo_setting_for_setting():
    """configs/rwkvlm-demo.yaml: RWKV-LM train_temp's demo-training-run.sh (L12-D768 x070, ctx 512, micro_bsz 16,
    lr 6e-4 -> 6e-5, 10 warmup steps, betas 0.9/0.99, eps 1e-18, weight decay 0.001, bf16, grad_cp 1, minipile's
    exit tokens) and generate_init_weight's channel-mix key gain."""
    cfg = load_config("configs/rwkvlm-demo.yaml")
    m, t = cfg.model, cfg.train
    assert (m.n_layer, m.n_embd, m.head_size, m.vocab_size, m.ffn_key_gain) == (12, 768, 64, 65536, 1.0)
    assert (t.ctx_len, t.micro_batch, t.grad_accum, t.tokens) == (512, 16, 1, 1_498_226_207)
    assert (t.lr, t.lr_final, t.warmup_tokens, t.betas, t.eps) == (6e-4, 6e-5, 10 * 16 * 512, (0.9, 0.99), 1e-18)
    assert (t.weight_decay, t.grad_clip, t.precision, t.grad_cp, t.l2wrap) == (0.001, 1.0, "bf16-mixed", True, True)
    assert cfg.data.tokenizer == "world" and cfg.data.binidx.endswith("minipile")


def test_shipped_configs_load():
    for name in ("tiny", "tiny-rwkvx", "gpu-L12-D768", "rwkvlm-demo"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.total_steps >= 1


# -- fuzzing: every input is a valid Config or a ConfigError with a one-line message ----------------

_fuzz = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
_KEYS = [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)] + ["run_dir"]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["ddp", "fsdp", "skip", "stop", "cpu", "auto", "1e-3", "nan", ".inf", "2e6"])
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _load_or_config_error(load) -> None:
    try:
        cfg = load()
    except ConfigError as e:
        assert str(e) and "\n" not in str(e) and e.exit_code == 2
        return
    assert isinstance(cfg, Config)
    assert config_from_dict(config_to_dict(cfg)) == cfg  # a valid config round-trips


def _nearby_key(key: str, data) -> str:
    """A valid dotted key, or one with a typo (a character dropped, doubled or replaced)."""
    how = data.draw(st.sampled_from(["same", "drop", "double", "replace", "section"]))
    if how == "same" or len(key) < 2:
        return key
    i = data.draw(st.integers(0, len(key) - 1))
    if how == "drop":
        return key[:i] + key[i + 1 :]
    if how == "double":
        return key[:i] + key[i] + key[i:]
    if how == "replace":
        return key[:i] + data.draw(st.sampled_from("abcxyz_.0")) + key[i + 1 :]
    return data.draw(st.sampled_from(["modle", "trian", "dat", "x"])) + "." + key.split(".")[-1]


@_fuzz
@given(data=st.data())
def test_fuzz_overrides(data):
    overrides = []
    for _ in range(data.draw(st.integers(1, 4))):
        key = _nearby_key(data.draw(st.sampled_from(_KEYS)), data)
        raw = data.draw(
            st.text(max_size=16) | _values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip())
        )
        overrides.append(f"{key}={raw}" if data.draw(st.integers(0, 9)) else key)
    _load_or_config_error(lambda: load_config(None, overrides))


@_fuzz
@given(data=st.data())
def test_fuzz_structured_yaml(tmp_path, data):
    tree: dict = {}
    for _ in range(data.draw(st.integers(0, 5))):
        key = _nearby_key(data.draw(st.sampled_from(_KEYS)), data)
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[parts[-1]] = data.draw(_values)
    if data.draw(st.booleans()):
        tree = data.draw(st.sampled_from([tree, [tree], "text", 3]))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    _load_or_config_error(lambda: load_config(path))


@_fuzz
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode), cut=st.integers(0, 400))
def test_fuzz_random_and_truncated_files(tmp_path, raw, cut):
    path = tmp_path / "c.yaml"
    shipped = Path("configs/tiny.yaml").read_bytes()
    for content in (raw, shipped[:cut], shipped[:cut] + raw):
        path.write_bytes(content)
        _load_or_config_error(lambda: load_config(path))


def test_resolve_paths_makes_every_path_absolute_and_keeps_names_and_links(tmp_path, monkeypatch):
    from rwkvx_cli.config import resolve_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    cfg = resolve_paths(load_config(None, ["run_dir=link", "data.corpus=[a.txt, 'd/*.jsonl']", "data.tokenizer=t.json",
                                           "data.prepared_dir=p/../q", "train.init_from=~/w.pth"]))  # fmt: skip
    assert cfg.run_dir == str(tmp_path / "link")  # the link as named: the run directory checks refuse it
    assert cfg.data.corpus == [str(tmp_path / "a.txt"), str(tmp_path / "d" / "*.jsonl")]
    assert (cfg.data.tokenizer, cfg.data.prepared_dir) == (str(tmp_path / "t.json"), str(tmp_path / "q"))
    assert cfg.train.init_from == os.path.expanduser("~/w.pth") and (cfg.data.binidx, cfg.data.val_binidx) == ("", "")
    for name in ("world", "wrold"):  # a name, and a misspelt one (its error names it as written)
        assert resolve_paths(load_config(None, [f"data.tokenizer={name}"])).data.tokenizer == name
    mixed = resolve_paths(load_config(None, ["data.mix=[{path: m, weight: 1}]", "data.tokenizer=byte"]))
    assert mixed.data.mix[0].path == str(tmp_path / "m") and mixed.data.corpus == ["data/tinyshakespeare.txt"]
    mixed.validate(mixed.written)  # the unused corpus stays the default: still one source of data


# Numeric fields any value of which is valid, and why.
UNBOUNDED = {"model.moba_top_k": "<= 0 means every earlier chunk"}
# Above-range values of the fields with an upper bound.
ABOVE = {
    "model.n_layer": 10_001,
    "model.vocab_size": 2**31,
    "data.bpe_vocab_size": 2**31,
    "data.eod_id": 2**31 - 1,
    "data.val_fraction": 1.0,
    "train.seed": 2**63,
}


def _numeric_fields():
    for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float) and f"{section}.{f.name}" not in UNBOUNDED:
                yield f"{section}.{f.name}", hints[f.name]


def test_every_numeric_field_refuses_what_is_outside_its_range():
    """Each numeric field states its range and refuses a value below it (and above it, where it has a top), in one
    line naming the field."""
    walked = 0
    for name, tp in _numeric_fields():
        values = [tp(-(10**6))] + ([ABOVE[name]] if name in ABOVE else [])
        for value in values:
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"{name}={value}"])
            message = str(e.value)
            assert message.startswith(f"{name}: ") and "\n" not in message, (name, value, message)
            assert any(w in message for w in ("must", "above")), message
        walked += 1
    assert walked >= 30
    assert set(ABOVE) <= {n for n, _ in _numeric_fields()}
    for value in ("-1", "2"):  # tuple and list fields: betas; a mixture's weight
        with pytest.raises(ConfigError, match=r"^train\.betas: must be in \[0, 1\)"):
            load_config(None, [f"train.betas=[0.9, {value}]"])
    with pytest.raises(ConfigError, match=r"^data\.mix\[0\]\.weight: must be >= 0"):
        load_config(None, ["data.mix=[{path: d, weight: -1}]"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.eod_id=257"], "data.eod_id: 257 is outside the vocabulary: must be below model.vocab_size (257)"),
        (["data.eod_id=70000"], "data.eod_id: 70000 is outside the vocabulary"),
        (["data.tokenizer=t.json", "model.vocab_size=1000", "data.eod_id=1000"], "below model.vocab_size (1,000)"),
        (["data.eod_id=5"], "data.eod_id: the byte tokenizer's end-of-document id is 0, not 5"),
        (["data.tokenizer=world", "model.vocab_size=65536", "data.eod_id=3"], "the world tokenizer's end-of-document"),
        (["data.tokenizer=bpe", "data.eod_id=1"], "the bpe tokenizer's end-of-document id is 0, not 1"),
    ],
)
def test_an_end_of_document_id_the_run_cannot_use_is_refused(overrides, message):
    """data.eod_id is checked against the vocabulary it is resolved with, as `data prepare --eod-id` refuses
    one for a named tokenizer: never an IndexError in a step (bench) nor a value training ignores."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith("data.eod_id: ") and message in str(e.value) and "\n" not in str(e.value)


def test_an_end_of_document_id_is_checked_once_the_vocabulary_is_known():
    cfg = load_config(None, ["data.tokenizer=t.json", "model.vocab_size=1000", "data.eod_id=999"])
    assert cfg.data.eod_id == 999
    # train.init_from gives the vocabulary: the id waits for it, then the same rule holds (train/runner.py
    # validates again with the vocabulary the weights gave, as written).
    cfg = load_config(None, ["data.tokenizer=t.json", "train.init_from=w.pth", "data.eod_id=50000"])
    given = cfg.written | {"model.vocab_size"}
    cfg.model.vocab_size = 65536
    cfg.validate(given)
    cfg.model.vocab_size = 50000
    with pytest.raises(ConfigError, match=r"^data\.eod_id: 50000 is outside the vocabulary"):
        cfg.validate(given)
    with pytest.raises(ConfigError, match="outside the vocabulary"):  # a vocabulary the config writes is known
        load_config(None, ["data.tokenizer=t.json", "train.init_from=w.pth", "model.vocab_size=300", "data.eod_id=300"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.head_size=1", "model.n_embd=8"], "model.head_size: 1 is below the 2 that rwkv7 blocks need"),
        (["model.head_size=1", "model.n_embd=8", "model.layers=[gdn, moba, rwkv7]"], "2 that rwkv7 blocks need"),
        (["model.head_size=1", "model.n_embd=8", "model.layers=[rwkv8]", "model.rwkv8_shared_value=false"],
         "2 that rwkv8 blocks with model.rwkv8_shared_value false need"),
    ],
)
def test_a_head_size_below_what_a_layer_kind_supports_is_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith("model.head_size: 1 ") and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["rwkv7", "rwkv4", "gdn", "kda", "rwkv8", "rwkv8-own-values", "moba"])
def test_the_smallest_head_size_each_layer_kind_accepts_builds_a_finite_model_and_step(kind):
    """The config's floor (config.MIN_HEAD_SIZE) is what the init and the kernels support: at it every
    parameter is finite, and so are a step's loss and gradients; below it the config refuses."""
    import torch

    from rwkvx_cli.models import build_model

    layers = {"moba": ["rwkv4", "moba"], "rwkv8-own-values": ["rwkv8"]}.get(kind, [kind])
    base = [f"model.layers=[{', '.join(layers)}]", f"model.rwkv8_shared_value={kind != 'rwkv8-own-values'}"]
    sizes = []
    for n in (1, 2, 3):
        try:
            cfg = load_config(None, [*base, f"model.head_size={n}", f"model.n_embd={4 * n}", "model.vocab_size=32"])
        except ConfigError:
            continue
        sizes.append(n)
        model = build_model(cfg.model, 0)
        assert all(torch.isfinite(p).all() for p in model.parameters()), (kind, n)
        x = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(0))
        loss, _ = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        assert torch.isfinite(loss), (kind, n)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), (kind, n)
    # The floor: 2 where a head's group norm or RWKV-7's init needs two channels, else 1.
    assert sizes == ([2, 3] if kind in ("rwkv7", "rwkv8-own-values") else [1, 2, 3])
