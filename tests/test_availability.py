"""Clusters that come and go: a worker computes only while online, an offline worker's next chance is its next online
instant (never a lost turn), and a dropout returns after its own time; the numbers are the run's, bad ones refused."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compiles import compilations
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays
from asgd_jax.errors import ConfigError

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
DATA = {"x": X, "y": X @ np.ones(4, np.float32)}
LOSS = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
W0 = np.zeros(4, np.float32)


def _run(law, num_updates=12, key=0):
    plan = asgd_jax.Plan(law, num_updates=num_updates, batch_size=8)
    run = asgd_jax.simulate(LOSS, asgd_jax.asgd(0.05), W0, DATA, plan, key=jax.random.key(key), progress=False)
    return np.asarray(run.metrics["time"]), np.asarray(run.metrics["worker"]), run


def test_a_worker_begins_only_while_online_and_waits_for_its_next_window():
    # Online in [0, 5) of every 10: computations of 1 begin at 0..4 (pushes at 1..5), the one due at 5 begins at 10.
    law = delays.Workers.with_times([1.0], availability=delays.Availability(period=10.0, online=0.5))
    times, _, _ = _run(law)
    np.testing.assert_allclose(times, [1, 2, 3, 4, 5, 11, 12, 13, 14, 15, 21, 22])


def test_staggered_windows_hand_the_work_from_one_worker_to_the_other():
    avail = delays.Availability(period=10.0, online=0.5, phase=[0.0, 5.0])
    times, workers, _ = _run(delays.Workers.with_times([1.0, 1.0], availability=avail), num_updates=20)
    # Worker 0 pushes in (0, 5], worker 1 (online from 5) in (5, 10], and so on: never both in one half.
    assert workers.tolist() == [0] * 5 + [1] * 5 + [0] * 5 + [1] * 5
    np.testing.assert_allclose(times, np.concatenate([np.arange(1, 6) + 5 * k for k in range(4)]))


def test_a_dropout_returns_after_its_own_time_and_every_push_still_comes():
    # Every push is followed by a dropout of mean 3: the gaps between a worker's pushes are 1 + Exp(3), mean 4.
    law = delays.Workers.with_times([1.0], availability=delays.Availability(dropout_prob=1.0, return_time=3.0))
    times, _, _ = _run(law, num_updates=2000)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps[0] == 1.0 and np.all(gaps[1:] >= 1.0)
    assert abs(gaps[1:].mean() - 4.0) < 0.2 and abs(np.median(gaps[1:] - 1.0) - 3.0 * math.log(2)) < 0.2
    never = delays.Workers.with_times([1.0], availability=delays.Availability(dropout_prob=0.0, return_time=3.0))
    np.testing.assert_allclose(_run(never, num_updates=5)[0], [1, 2, 3, 4, 5])


def test_always_online_is_the_same_run_bit_for_bit_and_other_numbers_compile_nothing():
    base = delays.Workers(3)
    same = delays.Workers(3, availability=delays.Availability())
    a, b = _run(base)[2], _run(same)[2]
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.metrics["time"], b.metrics["time"])
    _run(delays.Workers(3, availability=delays.Availability(period=4.0, online=0.5, dropout_prob=0.2)))
    with compilations() as counts:
        other = delays.Availability(period=[3.0, 4.0, 5.0], online=0.9, phase=1.0, dropout_prob=0.5, return_time=2.0)
        _run(delays.Workers(3, availability=other))
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}, counts


bad = st.one_of(st.sampled_from([-1.0, math.nan, math.inf, "often", True, [1.0, -1.0], [[1.0]], []]))


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(["period", "online", "phase", "dropout_prob", "return_time"]), value=bad)
def test_bad_availability_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        delays.Workers(2, availability=delays.Availability(**{field: value}))
    with pytest.raises(ConfigError, match="online"):
        delays.Availability(online=0.0)  # never online: no next chance at all
    with pytest.raises(ConfigError, match="one per worker"):
        delays.Workers(3, availability=delays.Availability(phase=[0.0, 1.0]))
    with pytest.raises(ConfigError, match="availability"):
        delays.Ringmaster(delays.Workers(2, availability=delays.Availability(online=0.5, period=2.0)), threshold=2)
