"""The host-side parameter store: bad pushes never touch the model, the exchange updates in place, SSGD rounds."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asgd_jax
from asgd_jax.store import BadPush, ParameterStore, StaleRound, StoreClosed


def test_store_rejects_bad_pushes_and_keeps_the_model():
    store = ParameterStore(asgd_jax.asgd(0.1), {"w": np.zeros(3, np.float32)}, 2, num_updates=5)
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
        with pytest.raises(BadPush, match="NaN or Inf"):  # a payload already on a device is checked there
            store.push(1, {"w": jnp.array([0.0, 0.0, jnp.inf])}, version).result(timeout=10)
        np.testing.assert_array_equal(store.state().params["w"], np.zeros(3))  # untouched
        params, _, version = store.push(1, {"w": np.ones(3, np.float32)}, version).result(timeout=10)
        np.testing.assert_allclose(params["w"], -0.1 * np.ones(3))
        assert (store.received, store.applied, store.rejected, store.late) == (6, 1, 5, 0)
        with pytest.raises(ValueError, match="worker=2"):
            store.pull(2)
        # DC-ASGD's backups are the pulled weights: worker 1 pulled (by pushing) the current ones, worker 0 still
        # holds what it pulled at version 0.
        for worker, expected, at in ((0, np.zeros(3), 0), (1, -0.1 * np.ones(3), 1)):
            backup, _, backup_version = store.backup(worker)
            np.testing.assert_array_equal(backup["w"], expected.astype(np.float32))
            assert backup_version == at
    finally:
        store.close()


def test_the_exchange_updates_the_per_worker_stacks_in_place():
    # DC-ASGD-a with a MeanSquare per worker keeps two M x params stacks (MeanSquare and the backups). The store's
    # exchange must update one slot of each in place: a copy of a stack per push cost 2 x 16 MB at 1.1M parameters.
    rule = asgd_jax.dc_asgd(0.05, 2.0, adaptive=True, num_workers=4)
    store = ParameterStore(rule, {"w": np.zeros((64, 32), np.float32)}, 4)
    try:
        payload = jax.device_put({"w": np.ones((64, 32), np.float32)}, store.device)
        hlo = store.lower_exchange(1, payload).compile().as_text()
    finally:
        store.close()
    stack_copies = [line for line in hlo.splitlines() if "f32[4,64,32]" in line and " copy(" in line]
    assert not stack_copies, stack_copies


def test_store_stop_policy_and_budget():
    store = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, on_nonfinite="stop")
    with pytest.raises(BadPush):
        store.push(0, np.array([np.inf, 0.0], np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="NaN or Inf"):
        store.push(0, np.ones(2, np.float32), 0)
    store.close()
    budget = ParameterStore(asgd_jax.asgd(0.1), np.zeros(2, np.float32), 1, num_updates=1)
    budget.push(0, np.ones(2, np.float32), 0).result(timeout=10)
    with pytest.raises(StoreClosed, match="after 1 updates"):
        budget.push(0, np.ones(2, np.float32), 1)
    budget.close()


def _round(store, payloads, version=0):
    """Every worker's push_round from a thread of its own; their answers (or exceptions) by worker."""
    answers: dict[int, object] = {}

    def send(w):
        try:
            answers[w] = store.push_round(w, payloads[w], version, timeout=60)
        except Exception as e:
            answers[w] = e

    threads = [threading.Thread(target=send, args=(w,)) for w in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return answers


def test_an_ssgd_round_applies_the_mean_of_all_workers_once():
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": np.zeros(2, np.float32)}, 3)
    try:
        payloads = [{"w": np.array([1.0, 0.0], np.float32) * (w + 1)} for w in range(3)]  # mean: [2, 0]
        answers = _round(store, payloads)
        assert store.applied == 1 and store.received == 1  # one update, pushed as worker 0
        for w in range(3):
            params, _, version = answers[w]
            np.testing.assert_allclose(params["w"], [-1.0, 0.0])  # w - 0.5 * mean
            assert version == 1
        with pytest.raises(StaleRound, match="computed at version 0, the store is at 1"):
            store.push_round(1, payloads[1], 0)
        # A non-finite mean is rejected: every worker gets the unchanged weights back, and the next round goes on.
        bad = [{"w": np.array([np.nan, 0.0], np.float32)}, *payloads[1:]]
        answers = _round(store, bad, version=1)
        assert store.applied == 1 and store.rejected == 1
        assert all(np.allclose(answers[w][0]["w"], [-1.0, 0.0]) and answers[w][2] == 1 for w in range(3))
    finally:
        store.close()


def test_calling_the_rounds_off_releases_every_waiting_worker():
    store = ParameterStore(asgd_jax.asgd(0.5), {"w": np.zeros(2, np.float32)}, 3)
    try:
        result: dict[str, BaseException] = {}

        def wait():
            try:
                store.push_round(0, {"w": np.ones(2, np.float32)}, 0, timeout=60)
            except StoreClosed as e:
                result["error"] = e

        thread = threading.Thread(target=wait)
        thread.start()
        store.abort_rounds("worker 2 failed")  # a worker died: SSGD cannot go on
        thread.join(timeout=60)
        assert not thread.is_alive() and "worker 2 failed" in str(result["error"])
        with pytest.raises(StoreClosed):
            store.push_round(1, {"w": np.ones(2, np.float32)}, 0)
    finally:
        store.close()
