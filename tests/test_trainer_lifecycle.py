"""The trainer's life cycle: checkpoints, kill and resume, Ctrl-C, warm start, SSGD, device groups, evaluation."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.problems import DATA, W0, lsq_loss, simulate_clean

import asgd_jax
from asgd_jax import checkpoint
from asgd_jax.plan import Plan
from asgd_jax.trainer import TrainConfig, train
from asgd_jax.trainer.endpoint import Endpoint
from asgd_jax.trainer.loader import ShardLoader
from asgd_jax.trainer.messages import Snapshot
from asgd_jax.trainer.session import Evaluator

REPO = pathlib.Path(__file__).resolve().parents[1]


def rule():
    return asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)


def replay(trace_path, steps, params=W0, num=4, batch_size=4):
    trace = asgd_jax.delays.Trace.load(trace_path, num=num)
    assert len(trace) == steps
    return simulate_clean(rule(), trace, steps, params=params, batch_size=batch_size).params


def _python(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_process_killed_mid_training_resumes_and_the_trace_still_replays(tmp_path):
    # A real SIGKILL in a child process, as a worker takes a minibatch, the 21st of the run or later, once a periodic
    # checkpoint is on disk (every worker that gets there first waits for it: nothing depends on timing).
    killed = _python(f"""
        import itertools, os, signal, sys, time
        sys.path.insert(0, "tests")
        import asgd_jax
        from asgd_jax.trainer.loader import ShardLoader
        from helpers.problems import DATA, W0, lsq_loss, simulate_clean
        from test_trainer_lifecycle import rule
        from asgd_jax.trainer import TrainConfig, train
        original, taken = ShardLoader.__next__, itertools.count()
        def take(self):
            if next(taken) >= 20:
                while not os.path.exists({str(tmp_path / "checkpoint.npz")!r}):
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self)
        ShardLoader.__next__ = take
        train(lsq_loss, rule(), W0, DATA, TrainConfig(asgd_jax.Plan(4, num_updates=40, batch_size=4,
              checkpoint_every=5), seed=3, out={str(tmp_path)!r}, progress=False))
    """)
    assert killed.returncode == -9, killed.stderr
    trace_lines = len((tmp_path / "trace.jsonl").read_text().splitlines())
    assert trace_lines < 40
    with pytest.raises(ValueError, match="already holds a checkpoint"):  # never overwritten silently
        train(lsq_loss, rule(), W0, DATA, TrainConfig(Plan(4, num_updates=40, batch_size=4), out=str(tmp_path)))
    with pytest.raises(ValueError, match="batch_size: checkpoint 4 vs now 8"):  # a different run is refused
        train(
            lsq_loss,
            rule(),
            W0,
            DATA,
            TrainConfig(Plan(4, num_updates=40, batch_size=8), out=str(tmp_path), resume=True),
        )
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(4, num_updates=40, batch_size=4, checkpoint_every=5), seed=3, out=str(tmp_path), resume=True),
        devices=jax.devices()[:4],
    )
    assert 5 <= result.resumed_from <= trace_lines and result.resumed_from % 5 == 0
    assert result.pushes_applied == 40 and result.pushes_sent == result.pushes_applied + result.pushes_rejected
    np.testing.assert_allclose(replay(result.trace_path, 40), result.params, rtol=1e-5, atol=1e-6)
    assert _header(tmp_path)["applied"] == 40


def _header(folder) -> dict:
    with np.load(folder / "checkpoint.npz") as f:
        return json.loads(bytes(f["__header__"]).decode())


def test_a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    path = tmp_path / "checkpoint.npz"
    killed = _python(f"""
        import os, signal
        import numpy as np
        from asgd_jax import checkpoint
        checkpoint.save({str(path)!r}, {{"w": np.arange(4.0)}}, {{}}, {{"version": 1}})
        def half_then_die(f, **arrays):
            f.write(b"PK" * 1000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        np.savez = half_then_die
        checkpoint.save({str(path)!r}, {{"w": np.zeros(4)}}, {{}}, {{"version": 2}})
    """)
    assert killed.returncode == -9, killed.stderr
    state, _, header = checkpoint.load(path, {"w": np.zeros(4)})
    assert header == {"version": 1}
    np.testing.assert_array_equal(state["w"], np.arange(4.0))


def test_ctrl_c_writes_a_final_checkpoint_and_resume_finishes_the_run(tmp_path, monkeypatch):
    # Ctrl-C raises KeyboardInterrupt in the thread that runs train(), which sits in the driver's loop polling the
    # store. Simulated there (whatever thread the test runner uses), once the workers have asked for 20 minibatches:
    # from then on they wait until the store has closed, so the run cannot finish first.
    original, original_poll, original_close = ShardLoader.__next__, Endpoint.progress, Endpoint.close
    taken, asked, pressed, closed = itertools.count(), threading.Event(), threading.Event(), threading.Event()

    def take(self):
        if next(taken) >= 20:
            asked.set()
            closed.wait(60)
        return original(self)

    def progress(self):
        if asked.is_set() and not pressed.is_set():
            pressed.set()  # pressed once
            raise KeyboardInterrupt
        return original_poll(self)

    def close(self):
        try:
            return original_close(self)
        finally:
            closed.set()

    monkeypatch.setattr(ShardLoader, "__next__", take)
    monkeypatch.setattr(Endpoint, "progress", progress)
    monkeypatch.setattr(Endpoint, "close", close)
    with pytest.raises(KeyboardInterrupt, match="resume=True continues"):
        train(
            lsq_loss,
            rule(),
            W0,
            DATA,
            TrainConfig(Plan(4, num_updates=40, batch_size=4), seed=3, out=str(tmp_path)),
            devices=jax.devices()[:4],
        )
    stopped_at = _header(tmp_path)["applied"]
    assert 0 < stopped_at < 40  # the final checkpoint holds every applied update (no checkpoint_every was set)
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == stopped_at
    monkeypatch.undo()
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(4, num_updates=40, batch_size=4), seed=3, out=str(tmp_path), resume=True),
        devices=jax.devices()[:4],
    )
    assert result.resumed_from == stopped_at and result.pushes_applied == 40
    np.testing.assert_allclose(replay(result.trace_path, 40), result.params, rtol=1e-5, atol=1e-6)


def test_sync_mode_is_the_simulators_ssgd():
    seed = 3
    key = jax.random.key(seed)
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(4, num_updates=12, batch_size=4, mode="sync"), seed=seed),
        devices=jax.devices()[:4],
    )
    assert result.pushes_applied == 12 and set(result.staleness_counts) == {0}
    assert [w.pushes for w in result.workers] == [12] * 4
    sim = simulate_clean(rule(), asgd_jax.delays.Workers(4), 12, key=key, mode="sync")
    np.testing.assert_allclose(sim.params, result.params, rtol=1e-5, atol=1e-6)


def test_a_group_of_two_devices_averages_like_one_worker_with_the_doubled_batch(tmp_path):
    # 2 workers x 2 devices, 4 examples per device: the replay with one device per worker and batch 8 agrees.
    seed = 3
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        result = train(
            lsq_loss,
            rule(),
            W0,
            DATA,
            TrainConfig(Plan(2, num_updates=20, batch_size=8), seed=seed, devices_per_worker=2, out=str(tmp_path)),
            devices=jax.devices()[:4],
        )
    finally:
        jax.config.update("jax_transfer_guard", "allow")
    np.testing.assert_allclose(replay(result.trace_path, 20, num=2, batch_size=8), result.params, rtol=1e-5, atol=1e-6)


def test_warm_start_trains_one_worker_first_then_everyone_starts_from_its_weights(tmp_path):
    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(4, num_updates=30, batch_size=4), warm_start_steps=10, seed=3, out=str(tmp_path)),
        devices=jax.devices()[:4],
    )
    warm_trace = [json.loads(line) for line in (tmp_path / "warmup" / "trace.jsonl").read_text().splitlines()]
    assert [r["worker"] for r in warm_trace] == [0] * 10
    warm_params, _ = checkpoint.load_model(tmp_path / "warmup", W0)
    assert np.abs(warm_params).sum() > 0
    assert result.pushes_applied == 20  # the asynchronous phase: steps - warm_start_steps
    np.testing.assert_allclose(replay(result.trace_path, 20, params=warm_params), result.params, rtol=1e-5, atol=1e-6)
    # --warm-start CHECKPOINT: a saved model loads into a fresh model's structure; another model is refused.
    params, _ = checkpoint.load_model(tmp_path / "model.npz", W0)
    np.testing.assert_array_equal(params, result.params)
    with pytest.raises(ValueError, match="leaf 0 is float32"):
        checkpoint.load_model(tmp_path, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="No saved model"):
        checkpoint.load_model(tmp_path / "nothing", W0)


def test_resume_auto_goes_on_from_a_warm_start_whose_run_was_killed_before_its_first_checkpoint(tmp_path):
    """Killed after its warm start, before the main run's first checkpoint: ``resume="auto"`` takes the warm start's
    checkpoint as ``resume=True`` does (it started the warm start again, which then refused its own folder)."""
    config = TrainConfig(Plan(4, num_updates=30, batch_size=4), warm_start_steps=10, seed=3, progress=False)
    train(lsq_loss, rule(), W0, DATA, config.replace(out=str(tmp_path / "first")), devices=jax.devices()[:4])
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "first" / "warmup", killed / "warmup")  # what the kill left
    result = train(
        lsq_loss, rule(), W0, DATA, config.replace(out=str(killed), resume="auto"), devices=jax.devices()[:4]
    )
    assert result.pushes_applied == 20 and len((killed / "warmup" / "trace.jsonl").read_text().splitlines()) == 10
    warm_params, _ = checkpoint.load_model(killed / "warmup", W0)
    np.testing.assert_allclose(replay(result.trace_path, 20, params=warm_params), result.params, rtol=1e-5, atol=1e-6)


def test_an_evaluation_is_timed_when_its_weights_were_taken_the_final_one_when_the_run_ended():
    """The evaluator's clock is the run phase's (``start_clock``); a snapshot's time is when the store took it, the
    final weights' when the run phase ended (``Outcome.ended``), not when the evaluator got to them."""
    written = []
    evaluator = Evaluator(lambda w, _: {"norm": jnp.linalg.norm(w)}, jax.devices()[0], written.append)
    evaluator.start_clock(1000.0)
    evaluator.submit(Snapshot(10, W0, None, taken=1002.5))
    assert [(e["update"], e["time"]) for e in evaluator.final(10, W0, None, taken=1009.0)] == [(10, 2.5)]  # had
    history = evaluator.final(20, 2 * W0, None, taken=1004.25)
    assert [(e["update"], e["time"]) for e in history] == [(10, 2.5), (20, 4.25)]
    assert [r["kind"] for r in written] == ["eval", "eval"]
    np.testing.assert_allclose(history[-1]["norm"], 2 * np.linalg.norm(W0), rtol=1e-6)


def test_evaluation_runs_beside_the_workers_and_metrics_stream_to_jsonl(tmp_path):
    def eval_fn(w, model_state):
        return {"loss": lsq_loss(w, DATA), "norm": jnp.linalg.norm(w)}

    result = train(
        lsq_loss,
        rule(),
        W0,
        DATA,
        TrainConfig(Plan(4, num_updates=40, batch_size=4, eval_every=10), seed=3, out=str(tmp_path), log_every=0.01),
        devices=jax.devices()[:4],
        eval_fn=eval_fn,
    )
    assert [e["update"] for e in result.evals] == [10, 20, 30, 40]
    np.testing.assert_allclose(result.evals[-1]["norm"], np.linalg.norm(result.params), rtol=1e-6)
    assert result.evals[-1]["loss"] < result.evals[0]["loss"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert kinds >= {"eval", "final"}
    final = records[-1]
    assert final["kind"] == "final" and final["applied"] == 40
    # Histograms of the records add up to every applied push, each exactly once.
    total = sum(n for r in records if r["kind"] != "eval" for n in r["staleness_histogram"].values())
    assert total == 40
    assert [r["update"] for r in records if r["kind"] == "eval"] == [10, 20, 30, 40]
    # An evaluation's time is when its weights existed, on the train records' clock: no later than any record that
    # had reached its update (not when the evaluator, which lags, got to it; that put them after the final record).
    evals, others = [r for r in records if r["kind"] == "eval"], [r for r in records if r["kind"] != "eval"]
    assert [e["time"] for e in evals] == sorted(e["time"] for e in evals) and evals[0]["time"] >= 0
    for e in evals:
        assert all(e["time"] <= r["time"] for r in others if r["applied"] >= e["update"]), (e, others)
