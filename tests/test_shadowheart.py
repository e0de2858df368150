"""Shadowheart SGD's equilibrium time t* (Tyurin et al., NeurIPS 2024, Definition 4.2) against a direct solve, its
limits, and each worker's share of a round."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
