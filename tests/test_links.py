"""Communication that costs time: each worker's upload and download grow with the message (latency + bytes /
bandwidth), the sizes the weights' unless a compressed payload says less; every number of the links is an argument of
the programs, and bad ones are refused by name before anything compiles."""

from __future__ import annotations

import math

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
W0 = np.zeros(4, np.float32)  # 16 bytes


def _times(law, params=W0, loss=LOSS, num_updates=6):
    plan = asgd_jax.Plan(law, num_updates=num_updates, batch_size=8)
    run = asgd_jax.simulate(loss, asgd_jax.asgd(0.05), params, DATA, plan, progress=False)
    return np.asarray(run.metrics["time"]), np.asarray(run.metrics["worker"])


def test_an_exchange_takes_compute_then_upload_then_download_each_latency_plus_bytes_over_bandwidth():
    links = delays.Links(latency=0.5, bandwidth=100.0, down_latency=0.25, down_bandwidth=200.0)
    times, _ = _times(delays.Workers.with_times([1.0], links=links))
    # 1 + (0.5 + 16 / 100) + (0.25 + 16 / 200) per exchange: the weights' 16 bytes each way.
    np.testing.assert_allclose(times, 1.99 * np.arange(1, 7), rtol=1e-6)


def test_the_message_is_the_weights_size_unless_a_compressed_push_says_less():
    links = delays.Links(latency=0.0, bandwidth=1_000.0)
    big = {"w": W0, "pad": np.zeros(996, np.float32)}  # 4,000 bytes: 4 s each way
    loss = lambda p, b: LOSS(p["w"], b) + 0.0 * jnp.sum(p["pad"])
    times, _ = _times(delays.Workers.with_times([1.0], links=links), params=big, loss=loss)
    np.testing.assert_allclose(times[:3], [9.0, 18.0, 27.0], rtol=1e-6)
    k = delays.message_bytes(big, coordinates=100)  # TopK / RandK of 100: values and indices, 800 bytes
    squeezed = delays.Links(latency=0.0, bandwidth=1_000.0, up_bytes=k)
    times, _ = _times(delays.Workers.with_times([1.0], links=squeezed), params=big, loss=loss)
    np.testing.assert_allclose(times[:3], [5.8, 11.6, 17.4], rtol=1e-6)


def test_a_slow_link_makes_its_worker_push_less_often_and_a_cluster_pays_it_too():
    links = delays.Links(latency=0.0, bandwidth=[1e9, 8.0])  # worker 1: 2 s each way for 16 bytes
    _, workers = _times(delays.Workers.with_times([1.0, 1.0], links=links), num_updates=30)
    # Exchanges of 1 s against 1 + 2 + 2 s: by time 25, 25 pushes of worker 0 and 5 of worker 1.
    assert np.bincount(workers, minlength=2).tolist() == [25, 5]
    ring = delays.Ringmaster(delays.Workers.with_times([1.0, 1.0], links=links), threshold=100)
    _, ring_workers = _times(ring, num_updates=30)
    np.testing.assert_array_equal(ring_workers, workers)  # the same schedule: the law's times include the links


def test_the_links_numbers_are_arguments_one_program_for_any_of_them():
    asgd_jax.simulator.clear_cache()
    first = _times(delays.Workers(3, links=delays.Links(latency=0.1, bandwidth=100.0)))[0]
    with compilations() as counts:
        other = _times(delays.Workers(3, links=delays.Links(latency=[0.3, 0.2, 0.1], bandwidth=5.0, up_bytes=4)))[0]
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}, counts
    assert not np.array_equal(first, other)


def test_a_sweeps_delay_models_get_the_weights_size_too():
    keys, hp = asgd_jax.grid(seeds=[0], latency=[0.0, 1.0])
    law = lambda h: delays.Workers.with_times([1.0], links=delays.Links(latency=h["latency"], bandwidth=16.0))
    plan = asgd_jax.Plan(law({"latency": 0.0}), num_updates=3, batch_size=8)
    rule = lambda h: asgd_jax.asgd(0.05)  # (the hparams are the links')
    sweep = asgd_jax.sweep(LOSS, rule, W0, DATA, plan, keys=keys, hparams=hp, delays_fn=law, progress=False)
    # 1 + 2 * (latency + 16 / 16) per exchange
    np.testing.assert_allclose(np.asarray(sweep.metrics["time"])[:, 0], [3.0, 5.0], rtol=1e-6)


bad_number = st.one_of(
    st.sampled_from([-1.0, math.nan, "fast", True, [1.0, -2.0], [[1.0]], []]),
    st.floats(max_value=-1e-6, allow_nan=False),
)


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(["latency", "bandwidth", "down_latency", "down_bandwidth", "up_bytes"]), value=bad_number)
def test_bad_links_are_refused_by_name_before_anything_compiles(field, value):
    with compilations() as counts, pytest.raises(ConfigError, match=field):
        law = delays.Workers(2, links=delays.Links(**{field: value}))
        _times(law)
    assert not {k: v for k, v in counts.items() if k.startswith("simulator_")}
    with pytest.raises(ConfigError, match="one per worker"):
        delays.Workers(3, links=delays.Links(latency=[0.1, 0.2]))
    with pytest.raises(ConfigError, match="links"):
        delays.Workers(3, links={"latency": 0.1})
    with pytest.raises(ConfigError, match="inf"):
        delays.Links(bandwidth=0.0)


# --------------------------------------------------------------------------------------------------------------------
# Overlapped: compute and communication as separate resources
# --------------------------------------------------------------------------------------------------------------------


def test_overlapped_workers_push_every_compute_time_or_every_upload_whichever_is_longer():
    compute_bound = delays.Links(latency=0.5)  # 0.5 s up, 0.5 s down, compute 1 s
    times, _ = _times(delays.Overlapped(delays.Workers.with_times([1.0], links=compute_bound)))
    np.testing.assert_allclose(times, 1.5 + np.arange(6), rtol=1e-6)  # against 2 s an exchange when serial
    serial, _ = _times(delays.Workers.with_times([1.0], links=compute_bound))
    np.testing.assert_allclose(serial, 2.0 * np.arange(1, 7), rtol=1e-6)
    upload_bound = delays.Links(latency=3.0, down_latency=0.0)
    times, _ = _times(delays.Overlapped(delays.Workers.with_times([1.0], links=upload_bound)))
    np.testing.assert_allclose(times, 4.0 + 3.0 * np.arange(6), rtol=1e-6)


def test_one_overlapped_worker_is_a_fixed_delay_of_one_bit_for_bit():
    """Computation k + 1 runs while push k travels, at reply k - 1's weights: every gradient after the first two is
    exactly one update stale, the run FixedDelay(1) describes on the same data stream."""
    law = delays.Workers.with_times([1.0], links=delays.Links(latency=0.25))
    plan = lambda model: asgd_jax.Plan(model, num_updates=40, batch_size=8)
    ours = asgd_jax.simulate(LOSS, asgd_jax.asgd(0.05), W0, DATA, plan(delays.Overlapped(law)), progress=False)
    ring = asgd_jax.simulate(LOSS, asgd_jax.asgd(0.05), W0, DATA, plan(delays.FixedDelay(1)), progress=False)
    np.testing.assert_array_equal(np.asarray(ours.metrics["staleness"]), [0] + [1] * 39)
    np.testing.assert_array_equal(ours.params, ring.params)


def test_overlapped_workers_keep_two_backups_each_and_the_family_rules_hold():
    model = delays.Overlapped(delays.Workers(3, links=delays.Links(latency=0.1, bandwidth=100.0)))
    assert (model.num_slots, model.num_shards, model.num_workers) == (6, 3, 3)
    _, workers = _times(model, num_updates=60)
    assert set(workers.tolist()) == {0, 1, 2}
    with pytest.raises(ConfigError, match="workers"):
        delays.Overlapped("three")
    with pytest.raises(ConfigError, match="availability"):
        delays.Overlapped(delays.Workers(2, availability=delays.Availability(online=0.5, period=2.0)))
    with pytest.raises(ConfigError, match="Overlapped"):
        asgd_jax.TrainConfig(asgd_jax.Plan(model))


def test_a_compressed_push_can_be_a_share_of_the_weights_size():
    big = {"w": W0, "pad": np.zeros(996, np.float32)}  # 4,000 bytes
    loss = lambda p, b: LOSS(p["w"], b) + 0.0 * jnp.sum(p["pad"])
    eighth = delays.Links(latency=0.0, bandwidth=1_000.0, up_scale=0.125)  # 500 bytes up, 4,000 down
    times, _ = _times(delays.Workers.with_times([1.0], links=eighth), params=big, loss=loss)
    np.testing.assert_allclose(times[:3], [5.5, 11.0, 16.5], rtol=1e-6)


def test_the_communication_study_puts_every_rule_on_the_links_but_its_free_reference():
    from asgd_jax import studies

    study = studies.load("communication_bound")
    arms = study.arms(study.quick, True)
    for arm in arms:
        law = arm.plan.delays.workers if isinstance(arm.plan.delays, delays.Overlapped) else arm.plan.delays
        labels = {v.label for v in arm.variants}
        assert (law.links is None) == (arm.coords["messages"] == "free"), labels
        if labels & {"TopK ASGD", "RandK ASGD"}:
            assert float(np.asarray(law.links.up_scale)[0]) == 0.125  # a sixteenth of float32s with 4-byte indices
    assert {v.label for a in arms for v in a.variants} == {
        "ASGD",
        "ASGD, overlapped",
        "TopK ASGD",
        "RandK ASGD",
        "SSGD",
    }


def test_a_jittered_link_draws_every_messages_time_with_mean_one_factor():
    steady = delays.Links(latency=1.0)  # 1 s each way, compute 1 s: every exchange 3 s
    np.testing.assert_allclose(_times(delays.Workers.with_times([1.0], links=steady))[0], 3.0 * np.arange(1, 7))
    jittered = delays.Links(latency=1.0, jitter=0.5)
    times, _ = _times(delays.Workers.with_times([1.0], links=jittered), num_updates=3000)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert abs(gaps.mean() - 3.0) < 0.05 and gaps.std() > 0.4 and gaps.min() > 1.0  # log-normal factors of mean 1
    with pytest.raises(ConfigError, match="jitter"):
        delays.Links(jitter=-0.1)
    with pytest.raises(ConfigError, match="jitter"):
        delays.Workers(3, links=delays.Links(jitter=[0.1, 0.2]))
