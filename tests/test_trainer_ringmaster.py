"""Ringmaster ASGD on real workers: the store ignores a push R or more updates stale, a worker's computation that has
become R stale is stopped and restarted at the current weights, and the run's trace still replays in the simulator."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from helpers.problems import DATA, W0, lsq_loss, replay_clean, straggler_waits_first

import asgd_jax
from asgd_jax import delays, trace
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.store import ParameterStore


def test_the_store_ignores_a_push_r_stale_and_answers_with_the_current_weights(tmp_path):
    store = ParameterStore(asgd_jax.asgd(0.5), np.zeros(2, np.float32), 2, out_dir=tmp_path, threshold=2)
    g = np.ones(2, np.float32)
    store.push(1, g, 0).result()
    store.push(1, g, 1).result()  # worker 1 applied updates 1 and 2
    params, _, version = store.push(0, 10 * g, 0).result()  # worker 0's push, begun at version 0: 2 stale
    np.testing.assert_array_equal(params, [-1.0, -1.0])  # the current weights, untouched by the ignored push
    assert version == 2 and store.backup(0)[2] == 2  # worker 0 computes next at version 2
    status = store.status()
    assert (status.applied, status.ignored, status.rejected, status.received) == (2, 1, 0, 3)
    assert status.positions == (1, 2)  # its minibatch is used up
    store.push(0, g, 2).result()  # 0 stale: applied
    store.push(1, g, 2).result()  # 1 stale: below R, applied
    store.close()
    records = trace.read(tmp_path / trace.FILE)
    assert records.workers.tolist() == [1, 1, 0, 1]
    assert records.skips.tolist() == [0, 0, 1, 0]  # the ignored push: a skip of worker 0's minibatches
    assert records.pulled.tolist() == [0, 1, 2, 2]  # worker 0 computed at the weights the ignore gave it
    lines = [json.loads(x) for x in (tmp_path / trace.FILE).read_text().splitlines()]
    assert [x.get("ignored", False) for x in lines] == [False, False, True, False, False]


def _run(tmp_path, stops: bool, slowdown: dict, steps: int = 60):
    plan = Plan(delays.Ringmaster(3, 2, stops=stops), num_updates=steps, batch_size=4)
    config = TrainConfig(plan, seed=5, out=str(tmp_path), progress=False, slowdown=slowdown)
    result = train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config, devices=jax.devices()[:3])
    replayed = replay_clean(tmp_path, asgd_jax.asgd(0.05), seed=5)
    lines = [json.loads(x) for x in pathlib.Path(result.trace_path).read_text().splitlines()]
    return result, replayed, lines


def _check_ringmaster_invariants(result, replayed, lines, steps: int = 60):
    assert result.pushes_applied == steps
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected + result.pushes_ignored
    applied = [x for x in lines if not x.get("ignored") and not x.get("rejected")]
    assert len(applied) == steps and max(x["staleness"] for x in applied) < 2  # Ringmaster: below R, always
    assert sum(x.get("ignored", False) for x in lines) == result.pushes_ignored
    assert all(x["staleness"] >= 2 for x in lines if x.get("ignored"))
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(replayed.metrics["staleness"], [x["staleness"] for x in applied])


def test_a_ringmaster_run_keeps_staleness_below_r_and_replays(tmp_path):
    """A straggler (20x slower) mostly arrives 2 or more updates stale: ignored; however many were, the run's applied
    pushes are all less than R stale and its trace replays to the same weights (a ring of versions where a worker
    computed at weights an ignore gave it)."""
    _check_ringmaster_invariants(*_run(tmp_path, stops=False, slowdown={0: 20.0}))


def test_a_computation_r_stale_is_stopped_and_restarted(tmp_path, monkeypatch):
    """A worker that would take forever (10^6 x slower) is stopped each time the others move the store R updates on,
    and restarts at the current weights on the same minibatches: none of its pushes is applied, nothing waits for it,
    and the trace replays."""
    straggler_waits_first(monkeypatch)
    result, replayed, lines = _run(tmp_path, stops=True, slowdown={0: 1e6})
    _check_ringmaster_invariants(result, replayed, lines)
    assert result.workers[0].stopped >= 1
    # Its one push: sent when the store closed (a stopped wait ends there), late, applied nowhere.
    assert result.workers[0].pushes <= 1 and result.pushes_late >= result.workers[0].pushes
    assert not any(x["worker"] == 0 for x in lines)
    assert result.workers[0].wasted > 0 and all(w.stopped == 0 for w in result.workers[1:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workers"][0]["stopped"] == result.workers[0].stopped


def test_the_training_script_runs_ringmaster_with_stops(tmp_path, capsys):
    from asgd_jax.cli import main

    out = tmp_path / "run"
    argv = ["train", "--dataset", "digits", "--model", "mlp", "--workers", "3", "--batch-size", "8", "--steps", "30"]
    argv += ["--lr", "0.1", "--schedule", "constant", "--ringmaster", "2", "--stops", "--slowdown", "0:1000000"]
    argv += ["--no-progress", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pushes_applied"] == 30 and summary["workers"][0]["stopped"] >= 1
    assert "computations stopped" in printed
    assert asgd_jax.trainer.replay_plan(out).delays.num == 3
    assert main(["train", "--stops", "--out", str(tmp_path / "x")]) == 2  # --stops alone: named, with the fix
    assert "--ringmaster R" in capsys.readouterr().err


def test_a_resumed_ringmaster_run_keeps_its_counts_and_replays(tmp_path):
    plan = lambda steps: Plan(delays.Ringmaster(3, 2, stops=True), num_updates=steps, batch_size=4)
    config = lambda steps, **kw: TrainConfig(plan(steps), seed=5, out=str(tmp_path), progress=False, **kw)
    first = train(lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config(30, slowdown={0: 20.0}), devices=jax.devices()[:3])
    again = train(
        lsq_loss, asgd_jax.asgd(0.05), W0, DATA, config(45, slowdown={0: 20.0}, resume=True), devices=jax.devices()[:3]
    )
    assert again.resumed_from == 30 and again.pushes_applied == 45
    assert again.pushes_ignored >= first.pushes_ignored  # counted over the whole run, the checkpoint's included
    replayed = replay_clean(tmp_path, asgd_jax.asgd(0.05), seed=5)
    np.testing.assert_allclose(replayed.params, again.params, rtol=1e-6, atol=1e-7)


def test_an_ignored_push_leaves_the_workers_adamw_state_as_it_was_and_the_run_replays(tmp_path):
    # Ringmaster's ignored push changed no weight, and in the simulator its period does not run: the worker goes on at
    # the current weights with the inner state of its last applied push (it kept its ignored period's: 0.15 apart).
    sync = dict(n_sync=3, push="delta", local_lr=0.02, inner="adamw")
    plan = Plan(delays.Ringmaster(3, 2), num_updates=30, batch_size=4, **sync)
    config = TrainConfig(plan, seed=5, out=str(tmp_path), progress=False, slowdown={0: 20.0})
    result = train(lsq_loss, asgd_jax.rules.diloco(0.5), W0, DATA, config, devices=jax.devices()[:3])
    assert result.pushes_ignored > 0
    replayed = replay_clean(tmp_path, asgd_jax.rules.diloco(0.5), seed=5)
    np.testing.assert_allclose(replayed.params, result.params, rtol=1e-5, atol=1e-6)
