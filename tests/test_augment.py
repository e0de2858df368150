"""Augmentation fitted to the data: refused where it cannot apply, adapted where a flip or a CIFAR-sized crop would
destroy the images (digits)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import models, preprocess
from asgd_jax.setups import Setup


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 256),
    w=st.integers(1, 256),
    c=st.integers(1, 4),
    name=st.sampled_from(["digits", "tfds:mnist", "tfds:cifar10", "tfds:svhn_cropped:3.0.0", "tfds:imagenette/160px"]),
)
def test_the_augmentation_fits_the_image_size_and_never_mirrors_digits(h, w, c, name):
    fitted = preprocess.augmentation(name, (h, w, c))
    assert fitted.padding == max(1, round(min(h, w) / 8)) and fitted.padding >= 1
    base = name.removeprefix("tfds:").split(":")[0].split("/")[0]
    assert fitted.flip == (base not in preprocess.NOT_MIRRORED)
    assert ("without flips" in fitted.describe()) == (not fitted.flip)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 64), min_size=0, max_size=4).filter(lambda s: len(s) != 3))
def test_augmentation_of_inputs_that_are_not_images_is_refused_by_name(shape):
    with pytest.raises(asgd_jax.ConfigError, match=r"augment=True \(--augment\).*needs images.*drop --augment"):
        preprocess.augmentation("tfds:something", tuple(shape))


def test_augmenting_mnist1d_is_refused_before_anything_loads():
    with pytest.raises(asgd_jax.ConfigError, match="mnist1d's inputs are 1-D signals"):
        Setup(dataset="mnist1d", augment=True)
    with pytest.raises(asgd_jax.ConfigError, match="mnist1d's inputs are 1-D signals"):
        asgd_jax.cli.setup_of(asgd_jax.cli.parse(["train", "--dataset", "mnist1d", "--augment"]))


def test_a_crop_without_flips_never_mirrors():
    x = jax.numpy.arange(3 * 5 * 5 * 1.0).reshape(3, 5, 5, 1)
    for seed in range(20):  # no padding: the only change could be a flip
        out = preprocess.random_crop_flip(jax.random.key(seed), x, padding=0, flip=False)
        np.testing.assert_array_equal(out, x)


def test_the_fitted_augmentation_keeps_digits_learnable():
    """The issue's case: CIFAR-10's recipe (pad 4, flip) on the 8x8 digits ruins training; the fitted one (pad 1, no
    flip) stays near the unaugmented error. One worker, the simulator, seeded: the numbers are reproducible."""
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("cnn", num_classes=10, input_shape=ds.input_shape)
    params, state = model.init(jax.random.key(0))
    evaluate = models.classification_eval(model, ds.test)
    plan = asgd_jax.Plan(1, num_updates=300, batch_size=32)
    errors = {}
    for name, loss in (
        ("fitted", Setup(dataset="digits", model="cnn", augment=True).loss(model)),
        ("cifar", models.classification_loss(model, augment=True, padding=4, flip=True)),
    ):
        run = asgd_jax.simulate(
            loss, asgd_jax.asgd(0.1), params, ds.train, plan, key=jax.random.key(0), model_state=state, progress=False
        )
        errors[name] = float(evaluate(run.params, run.model_state)["error"])
    assert errors["fitted"] < 0.15 and errors["cifar"] > 3 * errors["fitted"], errors  # (0.089 and 0.524 today)
