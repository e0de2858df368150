"""The rules made for heterogeneous data, against their papers' definitions (IA²SGD: Wang, Sun, Wai, Zhang 2024)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax import delays, rules

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
DATA = {"x": X, "y": X @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}
LOSS = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
W0 = np.zeros(4, np.float32)


def test_ia2sgd_fills_its_table_then_steps_with_the_mean_of_every_workers_latest_gradient():
    # G_i <- g on each arrival; no step until all n have reported; then x <- x - lr * (1/n) sum_j G_j, the mean kept
    # incrementally (m <- m + (g - G_i^old) / n) and equal to the table's mean.
    n, lr = 3, 0.1
    rule = rules.ia2sgd(lr, num_workers=n)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=5), jnp.float32)
    state, latest = rule.init(w), {}
    for step, worker in enumerate([1, 1, 0, 2, 2, 0, 1, 1, 2, 0]):
        g = jnp.asarray(rng.normal(size=5), jnp.float32)
        latest[worker] = np.asarray(g)
        update, state = rule.update(g, state, w, worker=jnp.int32(worker))
        table = state[0].table
        np.testing.assert_array_equal(np.asarray(table[worker]), latest[worker])
        if len(latest) < n:  # the warm-up: the weights stay at x0
            assert step < 3 and not np.asarray(update).any()
        else:
            np.testing.assert_allclose(np.asarray(update), -lr * np.mean(list(latest.values()), axis=0), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(state[0].mean), np.asarray(table).mean(axis=0), rtol=1e-5)


def test_ia2sgd_with_one_worker_is_sgd():
    plan = asgd_jax.Plan(1, batch_size=8, num_updates=60)
    ia2 = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=1), W0, DATA, plan, progress=False)
    sgd = asgd_jax.simulate(LOSS, asgd_jax.asgd(0.05), W0, DATA, plan, progress=False)
    # (to float rounding: the incremental mean m + (g - g_old) is g up to one rounding per update)
    np.testing.assert_allclose(ia2.params, sgd.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ia2.metrics["loss"][0], sgd.metrics["loss"][0])


@pytest.mark.parametrize("seen", [4, 5])
def test_in_a_run_the_weights_move_only_once_every_worker_has_reported(seen):
    # A recorded order of arrivals: worker 0 twice, then 1, 2, 3. Four arrivals leave worker 3 unheard: x is x0.
    order = [0, 0, 1, 2, 3]
    plan = asgd_jax.Plan(delays.Trace(order[:seen], num=4), batch_size=8, num_updates=seen)
    run = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=4), W0, DATA, plan, progress=False)
    assert np.array_equal(np.asarray(run.params), W0) == (seen == 4)


def test_ia2sgd_keeps_one_program_for_every_learning_rate_and_refuses_what_it_cannot_work_without():
    from helpers.compiles import compilations

    plan = asgd_jax.Plan(4, batch_size=8, num_updates=40)
    a = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=4), W0, DATA, plan, progress=False)
    with compilations() as compiled:
        b = asgd_jax.simulate(LOSS, rules.ia2sgd(0.02, num_workers=4), W0, DATA, plan, progress=False)
    assert sum(v for k, v in compiled.items() if k.startswith("simulator")) == 0, compiled
    assert np.isfinite(np.asarray(a.params)).all() and not np.array_equal(a.params, b.params)
    with pytest.raises(asgd_jax.errors.ConfigError, match="num_workers"):
        rules.ia2sgd(0.05, num_workers=jnp.int32(4))  # it shapes the table: a Python int
    rule = rules.ia2sgd(0.05, num_workers=2)
    with pytest.raises(TypeError, match="worker"):  # whose gradient it is: the server always says
        rule.update(jnp.ones(1), rule.init(jnp.ones(1)))


def test_ia2sgd_runs_in_the_trainers_store_with_its_table_kept_per_worker():
    # The store keeps the [n, d] table as a per-worker table (one row written a push) and the "seen" flags with the
    # weights: worker 0 alone moves nothing; then the mean of (1, 3), then of (5, 3).
    from asgd_jax.trainer.store import ParameterStore

    store = ParameterStore(rules.ia2sgd(0.1, num_workers=2), {"w": np.zeros(3, np.float32)}, 2)
    try:
        answers = [
            float(store.push(w, {"w": np.full(3, g, np.float32)}, 0).result(timeout=60)[0]["w"][0])
            for w, g in [(0, 1.0), (1, 3.0), (0, 5.0)]
        ]
    finally:
        store.close()
    np.testing.assert_allclose(answers, [0.0, -0.2, -0.6], rtol=1e-6)
