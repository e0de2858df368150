"""The parameter store and the threaded multi-device trainer; its recorded trace replays in the simulator."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax.store import BadPush, ParameterStore, StoreClosed
from asgd_jax.trainer import train

N, DIM = 96, 4
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, DIM)).astype(np.float32)
DATA = {"x": X, "y": (X @ _rng.normal(size=DIM)).astype(np.float32)}
W0 = np.zeros(DIM, np.float32)


def lsq_loss(w, batch):
    return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


@pytest.fixture
def no_implicit_transfers():
    """Every host <-> device copy in the trainer must be explicit (device_put / device_get)."""
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard", "allow")


@pytest.mark.parametrize("rule_name", ["asgd", "dc_asgd_a"])
def test_trainer_trace_replays_in_the_simulator(tmp_path, rule_name, request):
    make = {"asgd": lambda: asgd_jax.asgd(0.05), "dc_asgd_a": lambda: asgd_jax.dc_asgd(0.05, 2.0, adaptive=True)}
    key = jax.random.key(5)
    rule = make[rule_name]()
    request.getfixturevalue("no_implicit_transfers")
    result = train(
        lsq_loss, rule, W0, DATA, num_workers=4, steps=40, batch_size=4, key=key, devices=jax.devices()[:4],
        out_dir=tmp_path,
    )  # fmt: skip
    jax.config.update("jax_transfer_guard", "allow")  # the replay below is ordinary host-side code
    assert result.pushes_applied == 40
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    assert not result.failures
    trace = asgd_jax.delays.Trace.load(result.trace_path, num=4)
    assert len(trace) == 40
    replay = asgd_jax.simulate(
        lsq_loss, make[rule_name](), jnp.asarray(W0), DATA, delays=trace, batch_size=4, num_updates=40, key=key,
        progress=False,
    )  # fmt: skip
    np.testing.assert_allclose(replay.params, result.params, rtol=1e-5, atol=1e-6)
    # The trace's staleness is what the server saw.
    records = [json.loads(line) for line in pathlib.Path(result.trace_path).read_text().splitlines()]
    np.testing.assert_array_equal(replay.metrics["staleness"], [r["staleness"] for r in records])


def test_store_rejects_bad_pushes_and_keeps_the_model():
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2, max_updates=5)
    try:
        params, _, version = store.pull(0)
        with pytest.raises(BadPush, match="tree structure"):
            store.push(0, {"v": np.ones(3, np.float32)}, version)
        with pytest.raises(BadPush, match=r"leaf 0 is float32\[4\]"):
            store.push(0, {"w": np.ones(4, np.float32)}, version)
        with pytest.raises(BadPush, match="float64"):
            store.push(0, {"w": np.ones(3, np.float64)}, version)
        with pytest.raises(BadPush, match="NaN or Inf"):
            store.push(1, {"w": np.array([1.0, np.nan, 0.0], np.float32)}, version).result(timeout=10)
        np.testing.assert_array_equal(store.state().params["w"], np.zeros(3))  # untouched
        params, _, version = store.push(1, {"w": np.ones(3, np.float32)}, version).result(timeout=10)
        np.testing.assert_allclose(params["w"], -0.1 * np.ones(3))
        assert (store.received, store.applied, store.rejected) == (5, 1, 4)
        with pytest.raises(ValueError, match="worker=2"):
            store.pull(2)
    finally:
        store.close()


def test_store_stop_policy_and_budget():
    store = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, on_nonfinite="stop")
    with pytest.raises(BadPush):
        store.push(0, np.array([np.inf, 0.0], np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="NaN or Inf"):
        store.push(0, np.ones(2, np.float32), 0)
    store.close()
    budget = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, max_updates=1)
    budget.push(0, np.ones(2, np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="after 1 updates"):
        budget.push(0, np.ones(2, np.float32), 1)
    budget.close()


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_failing_worker_is_reported_and_never_deadlocks(monkeypatch, policy):
    original = asgd_jax.loader.ShardLoader.batch

    def failing(self, j):
        if self.worker == 1 and j >= 2:
            raise OSError("disk went away")
        return original(self, j)

    monkeypatch.setattr(asgd_jax.loader.ShardLoader, "batch", failing)
    result = train(
        lsq_loss, asgd_jax.asgd(0.05), W0, DATA, num_workers=3, steps=30, batch_size=4, key=jax.random.key(0),
        devices=jax.devices()[:3], on_worker_failure=policy, timeout=60,
    )  # fmt: skip
    assert list(result.failures) == [1] and "disk went away" in result.failures[1]
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    if policy == "continue":
        assert result.pushes_applied == 30  # the other two workers finish the budget
    else:
        assert result.pushes_applied < 30
    assert result.seconds < 60


def test_bad_trainer_arguments_raise_before_anything_starts():
    with pytest.raises(ValueError, match="on_worker_failure='retry'"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, num_workers=2, steps=5, on_worker_failure="retry")
    with pytest.raises(ValueError, match="batch_size=64"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, num_workers=2, steps=5, batch_size=64)
    with pytest.raises(ValueError, match="steps=0"):
        train(lsq_loss, asgd_jax.asgd(0.1), W0, DATA, num_workers=2, steps=0)


def test_cli_train_writes_a_replayable_trace(tmp_path, capsys):
    from asgd_jax.cli import main

    argv = ["train", "--dataset", "digits", "--model", "mlp", "--rule", "dc_asgd_a", "--workers", "3"]
    argv += ["--steps", "30", "--batch-size", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pushes sent 30, applied 30, rejected 0" in out or "applied 30" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pushes_applied"] == 30 and 0.0 <= summary["test_error"] <= 1.0
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 30


def test_non_finite_pushes_are_rejected_and_training_goes_on():
    poisoned = {"x": DATA["x"].copy(), "y": DATA["y"]}
    poisoned["x"][7] = np.nan  # every batch holding example 7 yields a NaN gradient
    result = train(
        lsq_loss, asgd_jax.asgd(0.05), W0, poisoned, num_workers=2, steps=40, batch_size=8, key=jax.random.key(1),
        devices=jax.devices()[:2],
    )  # fmt: skip
    assert result.pushes_applied == 40 and result.pushes_rejected >= 1
    assert result.pushes_sent == result.pushes_applied + result.pushes_rejected
    assert np.isfinite(result.params).all() and not result.failures
