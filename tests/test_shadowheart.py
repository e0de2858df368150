"""Shadowheart SGD (Tyurin et al., NeurIPS 2024): its equilibrium time t* (Definition 4.2) against a direct solve, its
limits, each worker's share of a round, and the round model that runs the method (its clock, its combination)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays
from asgd_jax.errors import ConfigError


def _direct(h, tau, omega, r):
    """t* by its definition, each s*(j) found by scanning a fine logarithmic grid for the sign change of
    s - [sum 1/(2 tau w + 4 tau w h r / s + 2 h r)]^-1, then refined by bisection inside that grid cell."""
    h, tau = np.asarray(h, float), np.asarray(tau, float)
    order = np.argsort(np.maximum(h, tau), kind="stable")
    h, tau = h[order], tau[order]
    best = np.inf
    for j in range(len(h)):
        a = 2 * tau[: j + 1] * omega + 2 * h[: j + 1] * r
        b = 4 * tau[: j + 1] * omega * h[: j + 1] * r
        f = lambda s, a=a, b=b: s - 1.0 / np.sum(1.0 / (a[None, :] + b[None, :] / s[:, None]), axis=1)
        grid = np.geomspace(1e-6, 1e9, 200_001)
        values = f(grid)
        k = int(np.argmax(values >= 0))  # f increases: the first grid point past the root
        lo, hi = grid[k - 1], grid[k]
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if f(np.array([mid]))[0] < 0 else (lo, mid)
        best = min(best, max(max(h[j], tau[j]), hi))
    return best


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    omega=st.floats(0.01, 50.0),
    r=st.floats(0.01, 100.0),
)
def test_the_equilibrium_time_is_its_definitions_solution(n, seed, omega, r):
    rng = np.random.default_rng(seed)
    h, tau = rng.uniform(0.1, 10.0, n), rng.uniform(0.1, 10.0, n)
    np.testing.assert_allclose(delays.equilibrium_time(h, tau, omega, r), _direct(h, tau, omega, r), rtol=1e-6)


def test_the_equilibrium_time_in_its_limits():
    # One worker, no compression: s = 2 h sigma^2/eps, at least h.
    assert delays.equilibrium_time([2.0], [1.0], 0.0, 3.0) == pytest.approx(12.0)
    # No noise and no compression: every prefix takes its own bound; the fastest worker's max(h, tau) wins.
    assert delays.equilibrium_time([3.0, 1.0, 2.0], [1.0, 5.0, 0.5], 0.0, 0.0) == pytest.approx(2.0)
    # Adding a very slow worker never makes t* larger (the minimum over prefixes).
    base = delays.equilibrium_time([1.0, 2.0], [1.0, 1.0], 1.0, 5.0)
    assert delays.equilibrium_time([1.0, 2.0, 1e6], [1.0, 1.0, 1e6], 1.0, 5.0) == pytest.approx(base)


def test_a_round_gives_each_worker_its_floor_of_t_star_and_weights_those_that_take_part():
    r = delays.shadowheart_round([1.0, 2.0, 50.0], [0.5, 4.0, 1.0], omega=3.0, sigma2_over_eps=2.0)
    t = delays.equilibrium_time([1.0, 2.0, 50.0], [0.5, 4.0, 1.0], 3.0, 2.0)
    assert r.time == t and r.b.tolist() == [int(t // 1.0), int(t // 2.0), int(t // 50.0)]
    assert r.m.tolist() == [int(t // 0.5), int(t // 4.0), int(t // 1.0)]
    sits_out = (r.b == 0) | (r.m == 0)
    assert sits_out[2] and r.weights[2] == 0.0
    np.testing.assert_allclose(r.weights[~sits_out], 1.0 / (r.b * 3.0 + 3.0 * 2.0 + r.m * 2.0)[~sits_out])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1.0, -1.0], [1.0, 1.0], 1.0, 1.0), "compute_times"),
        (([1.0], [1.0, 2.0], 1.0, 1.0), "send_times"),
        (([1.0], [np.nan], 1.0, 1.0), "send_times"),
        (([1.0], [1.0], -1.0, 1.0), "omega"),
        (([1.0], [1.0], 1.0, np.inf), "sigma2_over_eps"),
        (([], [], 1.0, 1.0), "compute_times"),
    ],
)
def test_bad_times_are_refused_by_name(args, match):
    with pytest.raises(ConfigError, match=match):
        delays.equilibrium_time(*args)


# --------------------------------------------------------------------------------------------------------------------
# The round model
# --------------------------------------------------------------------------------------------------------------------

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
DATA = {"x": X, "y": X @ np.ones(4, np.float32)}
LOSS = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
W0 = np.zeros(4, np.float32)


def _sim(model, num_updates=30, batch_size=8, rule=None):
    plan = asgd_jax.Plan(model, num_updates=num_updates, batch_size=batch_size)
    rule = rule or asgd_jax.rules.get("sgd", 0.05)
    return asgd_jax.simulate(LOSS, rule, W0, DATA, plan, progress=False)


def test_a_round_takes_the_slowest_compute_and_send_and_uses_t_stars_counts():
    law = delays.Workers.with_times([1.0, 2.0, 4.0])
    model = delays.Shadowheart(law, send_times=[0.5, 1.0, 0.25], fraction=0.5, sigma2_over_eps=2.0)
    share = delays.shadowheart_round([1.0, 2.0, 4.0], [0.5, 1.0, 0.25], omega=1.0, sigma2_over_eps=2.0)
    active = share.weights > 0
    assert model.b == tuple(np.where(active, share.b, 0)) and model.m == tuple(np.where(active, share.m, 0))
    assert model.round_size == sum(model.b)
    np.testing.assert_allclose(np.sum(model.weights * np.array(model.m) * np.array(model.b)), 1.0, rtol=1e-6)
    per_round = max(b * h + m * t for b, m, h, t in zip(model.b, model.m, [1, 2, 4], [0.5, 1, 0.25], strict=True))
    times = np.asarray(_sim(model).metrics["time"])
    np.testing.assert_allclose(times, per_round * np.arange(1, 31), rtol=1e-5)


def test_without_compression_one_worker_is_minibatch_sgd_on_its_b_minibatches():
    # One worker, h = tau = 1: t* = max(1, 2 sigma^2/eps) = 3 at sigma^2/eps = 1.5, so b = m = 3, and the step is
    # w m sum_j g_j / (w m b): the mean of 3 minibatches of 8, one minibatch of 24 (the same examples, in order).
    model = delays.Shadowheart(delays.Workers.with_times([1.0]), send_times=[1.0], sigma2_over_eps=1.5)
    assert (model.b, model.m) == ((3,), (3,))
    ours = _sim(model, num_updates=20)
    sgd = _sim(1, num_updates=20, batch_size=24)
    np.testing.assert_allclose(ours.params, sgd.params, rtol=1e-5, atol=1e-6)


def test_the_randk_combination_is_unbiased_over_its_draws():
    law = delays.Workers.with_times([1.0, 1.5])
    model = delays.Shadowheart(law, send_times=[0.3, 0.3], fraction=0.25, sigma2_over_eps=1.0)
    k = model.round_size
    payloads = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(k, 8)), jnp.float32)}
    combine = jax.jit(jax.vmap(model.combine, in_axes=(None, 0)))
    draws = combine(payloads, jax.random.split(jax.random.key(0), 4000))["w"]
    owner = np.repeat(np.arange(2), model.b)
    sums = np.stack([np.asarray(payloads["w"])[owner == i].sum(axis=0) for i in range(2)])
    expected = (model.weights[:, None] * np.array(model.m)[:, None] * sums).sum(axis=0)
    np.testing.assert_allclose(np.asarray(draws).mean(axis=0), expected, atol=0.06 * np.abs(expected).max())
    assert np.asarray(draws).std(axis=0).min() > 0  # compressed: the draws differ


def test_shadowheart_refuses_what_it_cannot_decide_from():
    with pytest.raises(ConfigError, match="fixed compute times"):
        delays.Shadowheart(delays.Workers(2), send_times=[1.0, 1.0])
    with pytest.raises(ConfigError, match="fraction"):
        delays.Shadowheart(delays.Workers.with_times([1.0]), send_times=[1.0], fraction=1.5)
    with pytest.raises(ConfigError, match="send_times"):
        delays.Shadowheart(delays.Workers.with_times([1.0]), send_times=[-1.0])
    with pytest.raises(ConfigError, match="Shadowheart"):
        asgd_jax.TrainConfig(asgd_jax.Plan(delays.Shadowheart(delays.Workers.with_times([1.0]), send_times=[1.0])))
