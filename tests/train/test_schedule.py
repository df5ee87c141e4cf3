"""The learning-rate schedules (train/schedule.py): cosine as RWKV-LM's, and warmup-stable-decay."""

import math

import pytest

from rwkvx_cli.config import ConfigError, TrainConfig, load_config
from rwkvx_cli.train.schedule import decay_start, lr_at


def train(**kw) -> TrainConfig:
    return TrainConfig(lr=1e-3, lr_final=1e-4, warmup_tokens=100, tokens=1000, **kw)


def test_cosine_warms_up_then_decays_over_the_whole_run():
    t = train()
    assert lr_at(0, t) == pytest.approx(1e-5)
    assert lr_at(50, t) == pytest.approx(1e-3 * (0.01 + 0.99 * 0.5))
    assert lr_at(100, t) == pytest.approx(1e-3)
    assert lr_at(550, t) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way through the cosine
    assert lr_at(1000, t) == pytest.approx(1e-4) and lr_at(5000, t) == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "shape, keep",
    [
        ("linear", lambda p: 1 - p),
        ("1-sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 + 0.5 * math.cos(math.pi * p)),
    ],
)
def test_wsd_holds_the_rate_then_decays_over_the_last_tokens(shape, keep):
    t = train(lr_schedule="wsd", decay_tokens=400, decay_shape=shape)
    assert decay_start(t) == 600
    assert lr_at(50, t) == pytest.approx(1e-3 * (0.01 + 0.99 * 0.5))  # the same warmup
    assert all(lr_at(n, t) == 1e-3 for n in (100, 300, 599, 600))  # stable
    for n in (700, 800, 900, 1000):
        assert lr_at(n, t) == pytest.approx(1e-4 + 9e-4 * keep((n - 600) / 400))
    assert lr_at(1000, t) == pytest.approx(1e-4)
    decay = [lr_at(n, t) for n in range(600, 1001, 10)]
    assert decay == sorted(decay, reverse=True)


def test_wsd_s_default_decay_is_the_last_fifth_and_never_starts_in_the_warmup():
    assert decay_start(train(lr_schedule="wsd")) == 800
    assert decay_start(train(lr_schedule="wsd", decay_tokens=5000)) == 100  # longer than the run: after warmup


def test_a_longer_wsd_run_has_the_same_stable_phase():
    """What makes a WSD run continuable: lengthening train.tokens moves the decay, not the rates before it."""
    short, long = train(lr_schedule="wsd", decay_tokens=200), train(lr_schedule="wsd", decay_tokens=200)
    long.tokens = 5000
    assert all(lr_at(n, short) == lr_at(n, long) for n in range(0, 800, 7))


def test_bad_schedule_settings_are_refused_by_name(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello\n")
    for override, name in [
        ("train.lr_schedule=wsdd", "train.lr_schedule"),
        ("train.decay_shape=sqrt", "train.decay_shape"),
        ("train.decay_tokens=-1", "train.decay_tokens"),
        ("train.optimizer=sgd", "train.optimizer"),
        ("train.muon_momentum=1.0", "train.muon_momentum"),
        ("train.muon_ns_steps=0", "train.muon_ns_steps"),
    ]:
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            load_config(None, [f"data.corpus=[{corpus}]", override])
