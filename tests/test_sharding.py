"""A sweep's runs split over devices (8 fake CPU devices here): the same numbers as on one device, compiled once per
structure, the padding of the runs axis dropped, a checkpoint resumed to the same bits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.compiles import compilations
from helpers.problems import NOISY, W1, crash_at, lsq_loss

import asgd_jax
from asgd_jax.errors import ConfigError

PLAN = asgd_jax.Plan(asgd_jax.delays.Workers(4), batch_size=8, num_updates=300, chunk=100)
RULE = lambda h: asgd_jax.dc_asgd(0.05, h["lam"], adaptive=True)


def _sweep(devices, seeds=(0, 1, 2, 3, 4), lams=(0.0, 0.5, 2.0), **kw):
    keys, hp = asgd_jax.grid(seeds=list(seeds), lam=list(lams))
    return asgd_jax.sweep(lsq_loss, RULE, W1, NOISY, PLAN, keys=keys, hparams=hp, progress=False, devices=devices, **kw)


def _same(a, b):
    for x, y in zip(
        jax.tree.leaves((a.params, a.state, a.metrics)), jax.tree.leaves((b.params, b.state, b.metrics)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fifteen_runs_on_eight_devices_are_the_same_bits_as_on_one():
    one, eight = _sweep(jax.devices()[:1]), _sweep(jax.devices())
    assert np.shape(eight.params) == (15, 4) and eight.metrics["loss"].shape == (15, 300)  # the padding is dropped
    _same(one, eight)


def test_a_network_with_evaluations_on_eight_devices_matches_one_to_float_rounding():
    ds = asgd_jax.data.load("digits")
    model = asgd_jax.models.get("mlp", num_classes=10, input_shape=ds.input_shape, hidden=(32,))
    params, state = model.init(jax.random.key(0))
    keys, hp = asgd_jax.grid(seeds=[0, 1, 2], learning_rate=[0.05, 0.1])
    plan = asgd_jax.Plan(asgd_jax.delays.Workers(4), batch_size=16, num_updates=120, eval_every=60)
    run = lambda devices: asgd_jax.sweep(
        asgd_jax.classification_loss(model),
        asgd_jax.asgd(0.1),
        params,
        ds.train,
        plan,
        keys=keys,
        hparams=hp,
        model_state=state,
        eval_fn=asgd_jax.classification_eval(model, ds.test),
        progress=False,
        devices=devices,
    )
    one, eight = run(jax.devices()[:1]), run(jax.devices())
    for name in ("loss", "eval_error", "eval_loss", "staleness", "worker"):
        np.testing.assert_allclose(eight.metrics[name], one.metrics[name], rtol=1e-5, atol=1e-6)
    for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


def test_a_second_sharded_sweep_with_other_numbers_compiles_nothing():
    _sweep(jax.devices())
    with compilations() as counts:
        _sweep(jax.devices(), seeds=(7, 8, 9, 10, 11), lams=(0.1, 0.3, 1.0))
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}, dict(counts)


def test_a_sharded_sweep_resumes_from_its_checkpoint_to_the_same_bits(tmp_path):
    whole = _sweep(jax.devices())

    with pytest.raises(KeyboardInterrupt):
        _sweep(jax.devices(), checkpoint_dir=str(tmp_path), callback=crash_at(200))
    _same(whole, _sweep(jax.devices(), checkpoint_dir=str(tmp_path)))


@pytest.mark.parametrize("devices", [[], "cpu", [0, 1], [jax.devices()[0], jax.devices()[0]]])
def test_devices_that_are_not_a_list_of_distinct_devices_are_named(devices):
    with pytest.raises(ConfigError, match=r"devices=.* is invalid: give a list of distinct jax devices"):
        _sweep(devices)
