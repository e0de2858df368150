"""Delay models: who pushes next and at which snapshot, in distribution and for a recorded trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import simulate_lsq
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays


@pytest.mark.parametrize("m", [2, 5])
def test_equal_constant_workers_are_round_robin_with_staleness_m_minus_1(m):
    result = simulate_lsq(asgd_jax.asgd(0.01), delays.Workers(m, compute_time="constant"), num_updates=30)
    np.testing.assert_array_equal(result.metrics["worker"], np.arange(30) % m)
    np.testing.assert_array_equal(result.metrics["staleness"][:m], np.arange(m))
    np.testing.assert_array_equal(result.metrics["staleness"][m:], m - 1)


def test_exponential_workers_have_mean_staleness_m_minus_1():
    result = simulate_lsq(asgd_jax.asgd(0.001), delays.Workers(8), num_updates=4000, batch_size=4)
    tau = result.metrics["staleness"][200:]
    assert abs(tau.mean() - 7.0) < 0.35
    assert tau.max() > 16  # exponential times give a long tail
    assert np.all(np.diff(result.metrics["time"]) >= 0)


def test_random_delay_is_uniform():
    result = simulate_lsq(asgd_jax.asgd(0.001), delays.RandomDelay(4), num_updates=3000, batch_size=4)
    tau = result.metrics["staleness"][4:]
    counts = np.bincount(tau, minlength=5)
    assert len(counts) == 5 and np.all(np.abs(counts / len(tau) - 0.2) < 0.03)


def test_stragglers_and_speeds_shift_the_pushes():
    fast_slow = delays.Workers(2, compute_time="constant", speeds=jnp.array([3.0, 1.0]))
    result = simulate_lsq(asgd_jax.asgd(0.01), fast_slow, num_updates=40)
    assert abs(np.mean(result.metrics["worker"] == 0) - 0.75) < 0.05
    straggly = delays.Workers(4, compute_time="constant", straggler_prob=0.3, straggler_slowdown=10.0)
    result = simulate_lsq(asgd_jax.asgd(0.01), straggly, num_updates=400, batch_size=4)
    assert result.metrics["staleness"].max() > 10
    assert result.metrics["time"][-1] > 400 / 4 * 1.5  # slowed down overall


def test_fixed_times_are_exact_and_ties_go_to_the_lower_id():
    """``with_times`` keeps every time as given: each integer 1..1000 comes back exactly (kept as a speed 1 / t, 178 of
    them were one ulp off), so with times 1 and k worker 0 pushes at 1, 2, ..., k and worker 1 ties at k, after it."""
    ks = np.arange(1, 1001)
    np.testing.assert_array_equal(delays.Workers.with_times(ks).draw(jax.random.key(0)), ks)
    np.testing.assert_array_equal(delays.Workers.with_times(ks).work_time(jax.random.key(0), 3), 3 * ks)

    def events(k):  # the first 1,002 pushes of times (1, k), k traced: one program for every k
        law = delays.Workers(2, compute_time="constant", times=jnp.stack([jnp.float32(1), k]))
        step = lambda finish, t: law.next(finish, t, jax.random.key(0))
        _, e = jax.lax.scan(step, law.init(jax.random.key(0)), jnp.arange(1002))
        return e.push_slot, e.time

    workers, times = np.asarray(jax.jit(jax.vmap(events))(ks.astype(np.float32)))
    rows = np.arange(1000)
    np.testing.assert_array_equal(times[rows, ks - 1], ks)  # worker 0's k-th push, at k
    np.testing.assert_array_equal(workers[rows, ks - 1], 0)
    np.testing.assert_array_equal(times[rows, ks], ks)  # worker 1's first, at the same k, after it
    np.testing.assert_array_equal(workers[rows, ks], 1)
    np.testing.assert_array_equal(workers[rows, ks + 1], 0)
    ones = delays.Workers(4, compute_time="constant", mean_compute_time=2.0)
    assert delays.split(delays.Workers.with_times([2.0] * 4))[0] == delays.split(ones)[0]  # the same programs


def test_trace_loads_a_trainer_jsonl(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"worker": 1, "pulled_version": 0, "applied_version": 1, "time": 0.5}\n{"worker": 0, "time": 0.7}\n'
    )
    trace = delays.Trace.load(path)
    assert trace.num == 2 and trace.worker_ids.tolist() == [1, 0]
    np.testing.assert_allclose(trace.times, [0.5, 0.7])
    (tmp_path / "bad.jsonl").write_text('{"pushes": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        delays.Trace.load(tmp_path / "bad.jsonl")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.125, 10.0, width=32), min_size=3, max_size=3),
    st.lists(st.floats(0.125, 10.0, width=32), min_size=3, max_size=3),
    st.sampled_from(["workers", "ringmaster", "plan"]),
)
def test_delay_models_and_plans_compare_by_value_with_array_numbers(a, b, wrap):
    """A heterogeneous cluster is a value: == compares its speeds element by element (a dataclass's own == raised on
    the array, so two Plans of such a cluster could not be compared), and equal models hash alike."""
    make = {
        "workers": lambda s: delays.Workers(3, speeds=s),
        "ringmaster": lambda s: delays.Ringmaster(delays.Workers(3, speeds=s), 2),
        "plan": lambda s: asgd_jax.Plan(delays.Workers(3, speeds=s), batch_size=4),
    }[wrap]
    x, y = make(a), make(b)
    assert (x == y) is bool(np.array_equal(np.float32(a), np.float32(b))) and x == make(list(a))
    assert hash(x) == hash(make(list(a))) and (x != y) is not (x == y)
    assert delays.Workers(3, speeds=a) != delays.Workers(3, speeds=a, compute_time="constant")
    assert delays.Workers(3, speeds=a) != delays.FixedDelay(2) and delays.Workers(3) == delays.Workers(3)


@settings(max_examples=200, deadline=None)
@given(
    ints=st.lists(st.integers(0, 2**40), min_size=4, max_size=4),
    workers=st.none() | st.integers(1, 4096),
    time=st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 1e6),
    rejected=st.booleans(),
    ignored=st.booleans(),
)
def test_a_trace_line_is_json_dumps_text_whatever_the_record(ints, workers, time, rejected, ignored):
    # An applied push's line is written out by hand (a fifth of json.dumps's cost per push): the very same text.
    import json

    from asgd_jax import trace

    record = trace.Record(*ints[:1], workers, *ints[1:], time=time, rejected=rejected, ignored=ignored)
    fields = {k: v for k, v in record._asdict().items() if k not in ("rejected", "ignored", "round", "round_skips")}
    fields.update({k: True for k in ("rejected", "ignored") if getattr(record, k)})
    assert record.line() == json.dumps(fields) + "\n"
