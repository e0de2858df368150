"""Rennala SGD and m-Synchronous SGD on real workers: the store gathers a round's payloads at the current weights,
a round's end stops the computations of it, and the run's rounds replay in the simulator."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import DATA, W0, lsq_loss, replay_clean, simulate_clean, straggler_waits_first

import asgd_jax
from asgd_jax import delays, trace
from asgd_jax.errors import ConfigError
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.store import Gather, ParameterStore, StaleRound

SGD = asgd_jax.rules.get("sgd", 1.0)


def test_rennala_gathers_s_payloads_a_worker_may_give_twice_and_a_late_one_is_ignored(tmp_path):
    store = ParameterStore(SGD, np.zeros(2, np.float32), 3, out_dir=tmp_path, gather=Gather("rennala", 2, False))
    g = lambda *v: np.asarray(v, np.float32)
    params, _, version = store.push_gathered(1, g(1, 0), 0)  # the round needs 2: go on at the same weights
    assert version == 0 and params.tolist() == [0.0, 0.0]
    params, _, version = store.push_gathered(1, g(3, 0), 0)  # worker 1's second payload completes it
    assert version == 1 and params.tolist() == [-2.0, 0.0]  # w - mean(g) (lr 1)
    params, _, version = store.push_gathered(0, g(100, 100), 0)  # computed at w_0: ignored, its minibatch used
    assert version == 1 and params.tolist() == [-2.0, 0.0]
    store.push_gathered(2, g(0, 2), 1)
    params, _, version = store.push_gathered(0, g(0, 4), 1)
    assert version == 2 and params.tolist() == [-2.0, -3.0]
    status = store.status()
    assert (status.applied, status.ignored, status.received) == (2, 1, 3)
    assert status.positions == (2, 2, 1)  # worker 0: the ignored minibatch and its payload's
    store.close()
    read = trace.read(tmp_path / trace.FILE)
    assert read.rounds.tolist() == [[1, 1], [2, 0]] and read.round_skips.tolist() == [[0, 0], [0, 1]]
    model = delays.Trace.load(tmp_path / trace.FILE)
    assert isinstance(model, delays.RoundTrace) and (model.round_size, len(model), model.num) == (2, 2, 3)


def test_with_stops_a_payload_of_a_round_already_past_is_discarded_not_used():
    store = ParameterStore(SGD, np.zeros(2, np.float32), 3, gather=Gather("rennala", 1, True))
    store.push_gathered(1, np.ones(2, np.float32), 0)
    with pytest.raises(StaleRound):
        store.push_gathered(0, np.ones(2, np.float32), 0)
    assert store.status().positions == (0, 1, 0) and store.status().ignored == 0
    store.close()


def _run(tmp_path, model, slowdown=None, steps=30, **config):
    plan = Plan(model, num_updates=steps, batch_size=4)
    config = TrainConfig(plan, seed=5, out=str(tmp_path), progress=False, slowdown=slowdown or {}, **config)
    result = train(lsq_loss, SGD_SMALL, W0, DATA, config, devices=jax.devices()[:3])
    lines = [json.loads(x) for x in pathlib.Path(result.trace_path).read_text().splitlines()]
    return result, lines


SGD_SMALL = asgd_jax.rules.get("sgd", 0.05)


@pytest.mark.parametrize("model", [delays.MSync(3, 2), delays.Rennala(3, 2, stops=True)])
def test_a_round_method_stops_the_straggler_and_its_rounds_replay(tmp_path, model, monkeypatch):
    """A worker 10^6 x slower never finishes: every round's end stops it and it restarts at the new weights on the same
    minibatch, so every round is the other two workers' (m-Synchronous: one each, in worker order), and the recorded
    rounds replay in the simulator to the same weights."""
    straggler_waits_first(monkeypatch)
    result, lines = _run(tmp_path, model, slowdown={0: 1e6})
    rounds = [x["round"] for x in lines if not x.get("ignored")]
    assert result.pushes_applied == 30 and len(rounds) == 30 and not any(0 in r for r in rounds)
    if isinstance(model, delays.MSync):
        assert all(r == [1, 2] for r in rounds)
    assert result.workers[0].stopped >= 1
    replayed = replay_clean(tmp_path, SGD_SMALL, seed=5)
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-6, atol=1e-7)
    assert isinstance(asgd_jax.trainer.replay_plan(tmp_path).delays, delays.RoundTrace)


def test_rennala_without_stops_replays_whatever_it_ignored(tmp_path):
    result, lines = _run(tmp_path, delays.Rennala(3, 2), slowdown={0: 20.0})
    assert result.pushes_applied == 30
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected + result.pushes_ignored
    assert sum(x.get("ignored", False) for x in lines) == result.pushes_ignored
    replayed = replay_clean(tmp_path, SGD_SMALL, seed=5)
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-6, atol=1e-7)


def test_m_synchronous_with_every_worker_is_the_trainers_ssgd(tmp_path):
    msync, _ = _run(tmp_path / "msync", delays.MSync(3, 3))
    ssgd = train(
        lsq_loss,
        SGD_SMALL,
        W0,
        DATA,
        TrainConfig(Plan(3, mode="sync", num_updates=30, batch_size=4), seed=5, progress=False),
        devices=jax.devices()[:3],
    )
    np.testing.assert_array_equal(msync.params, ssgd.params)


def test_the_training_script_runs_the_round_methods(tmp_path, capsys):
    from asgd_jax.cli import main

    base = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "3", "--batch-size", "8", "--steps", "20"]
    base += ["--lr", "0.1", "--schedule", "constant"]
    assert main([*base, "--msync", "2", "--no-progress", "--out", str(tmp_path / "m")]) == 0
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert summary["pushes_applied"] == 20
    assert isinstance(asgd_jax.trainer.replay_plan(tmp_path / "m").delays, delays.RoundTrace)
    assert main([*base, "--msync", "2", "--rennala", "2", "--out", str(tmp_path / "x")]) == 2
    assert "choose one of --ringmaster, --rennala, --msync" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="m=4 is invalid"):
        TrainConfig(Plan(delays.MSync(3, 4), num_updates=10))


@pytest.mark.parametrize("model", [delays.MSync(3, 2), delays.Rennala(3, 2, stops=True)])
def test_a_resumed_round_method_run_continues_its_trace_and_replays(tmp_path, model):
    """Resumed from its checkpoint, each worker reads its own shard from its own position again (they differ in a
    round method), and the whole run's trace replays to the final weights."""
    first, _ = _run(tmp_path, model, steps=20)
    assert first.pushes_applied == 20
    resumed, lines = _run(tmp_path, model, steps=30, resume=True)
    assert resumed.resumed_from == 20 and resumed.pushes_applied == 30
    assert sum(not x.get("ignored") for x in lines) == 30
    replayed = replay_clean(tmp_path, SGD_SMALL, seed=5)
    np.testing.assert_allclose(replayed.params, resumed.params, rtol=1e-6, atol=1e-7)


def test_ssgd_on_bfloat16_weights_is_the_simulators_ssgd():
    """A bfloat16 model's rounds average the workers' payloads (they applied worker 0's: NumPy does not count
    bfloat16 as a float), to the simulator's weights."""
    weights = jnp.asarray(W0, jnp.bfloat16)
    plan = Plan(2, mode="sync", num_updates=20, batch_size=4)
    result = train(
        lsq_loss, SGD_SMALL, weights, DATA, TrainConfig(plan, seed=3, progress=False), devices=jax.devices()[:2]
    )
    simulated = simulate_clean(SGD_SMALL, delays.Workers(2), 20, key=3, params=weights, mode="sync")
    assert result.params.dtype == jnp.bfloat16 and result.pushes_applied == 20
    np.testing.assert_array_equal(np.asarray(result.params), np.asarray(simulated.params))
