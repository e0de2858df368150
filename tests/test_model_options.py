"""Options and crops checked against the model and the images before anything loads or compiles (#34's round)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import models
from asgd_jax.cli import main
from asgd_jax.setups import Setup


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(models.names())),
    option=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
def test_an_option_a_model_does_not_take_is_refused_naming_the_ones_it_does(name, option):
    assume(option not in ("num_classes", "input_shape", "name"))  # models.get's own arguments, not options
    if option in models.options_of(name):
        Setup(model=name, model_options={option: None})  # a known option passes the name check
        return
    with pytest.raises(asgd_jax.ConfigError, match=rf"\(--model-options\).*{name!r} takes .*not {option}"):
        Setup(model=name, model_options={option: 1})
    with pytest.raises(asgd_jax.ConfigError, match=f"not {option}"):
        models.get(name, num_classes=10, input_shape=(32, 32, 3), **{option: 1})


def test_every_documented_option_is_taken():
    assert {"hidden"} <= set(models.options_of("mlp")) and {"features", "hidden"} <= set(models.options_of("cnn"))
    assert {"width", "stem_stride", "dropout"} <= set(models.options_of("convnet"))
    assert "blocks_per_stage" in models.options_of("resnet20")


@settings(max_examples=30, deadline=None)
@given(crop=st.integers(1, 64))
def test_an_evaluation_crop_larger_than_the_images_is_refused(crop):
    digits = asgd_jax.models.get("cnn", num_classes=10, input_shape=(8, 8, 1))
    setup = Setup(dataset="digits", model="cnn", eval_crop=crop)
    test = {"x": asgd_jax.data.load("digits").x_test[:4], "y": asgd_jax.data.load("digits").y_test[:4]}
    if crop <= 8:
        assert setup.evaluation(digits, test).crop == crop
    else:
        with pytest.raises(asgd_jax.ConfigError, match=r"eval_crop=\d+ \(--eval-crop\).*8x8: use a crop of at most 8"):
            setup.evaluation(digits, test)
    signals = asgd_jax.models.get("mlp", num_classes=10, input_shape=(40, 1))
    with pytest.raises(asgd_jax.ConfigError, match="crops need images"):
        Setup(model="mlp", eval_crop=crop).evaluation(signals, test)


def test_ablate_refuses_a_worker_count_given_twice(tmp_path, capsys):
    assert main(["ablate", "--workers", "4", "1,4", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "workers=[4, 1, 4] is invalid: give distinct worker counts" in err and not any(tmp_path.iterdir())


@settings(max_examples=25, deadline=None)
@given(shift=st.integers(-20, 20).filter(lambda s: s != 0))
def test_labels_outside_the_models_classes_are_refused_before_a_compile(shift):
    """Out-of-range labels made a one-hot of zeros: a loss and an error silently wrong. The simulator, the trainer
    and the evaluation refuse them by value."""
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    y = ds.y_train + shift
    data = {"x": ds.x_train, "y": y.astype(np.int32)}
    plan = asgd_jax.Plan(1, num_updates=2, batch_size=8)
    match = rf"labels=.in \[{y.min()}, {y.max()}\]. is invalid: the model has 10 classes"
    loss = asgd_jax.classification_loss(model)
    with pytest.raises(asgd_jax.ConfigError, match=match):
        asgd_jax.simulate(loss, asgd_jax.asgd(0.1), params, data, plan, model_state=state, progress=False)
    with pytest.raises(asgd_jax.ConfigError, match=match):
        asgd_jax.trainer.train(
            loss, asgd_jax.asgd(0.1), params, data, asgd_jax.TrainConfig(plan, progress=False), model_state=state
        )
    with pytest.raises(asgd_jax.ConfigError, match=match):
        asgd_jax.classification_eval(model, data)
    with pytest.raises(asgd_jax.ConfigError, match="give int class labels"):
        asgd_jax.classification_eval(model, {"x": ds.x_test, "y": ds.y_test.astype(np.float32)})
