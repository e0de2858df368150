"""The DiLoCo family over pushed deltas (Douillard et al. 2023; Liu et al. 2024): synchronous DiLoCo in rounds and
asynchronous DiLoCo on every arrival, each against a float64 NumPy reference of workers taking H local SGD steps
from the weights they pulled (the same minibatches, sharing no code with asgd_jax)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.problems import PUSH_ORDER, W1, BatchOrder, simulate_lsq
from helpers.reference import lsq_grad

from asgd_jax import delays, rules

H, LOCAL_LR = 4, 0.05


class OuterNesterov:
    """The outer step on a delta: m <- beta m + delta, w <- w - lr (beta m + delta) (heavy ball without Nesterov)."""

    def __init__(self, lr, beta, nesterov=True):
        self.w, self.m = np.array(W1, np.float64), np.zeros(len(W1))
        self.lr, self.beta, self.nesterov = lr, beta, nesterov

    def apply(self, delta):
        self.m = self.beta * self.m + delta
        self.w = self.w - self.lr * (self.beta * self.m + delta if self.nesterov else self.m)


def _local(w, worker, batches):
    """H local SGD steps from ``w`` on the worker's next H minibatches: its weights after them."""
    for _ in range(H):
        a, y = batches.next(worker)
        w = w - LOCAL_LR * lsq_grad(w, a, y)
    return w


@pytest.mark.parametrize(("lr", "beta"), [(1.0, 0.0), (0.7, 0.9)])
def test_synchronous_diloco_steps_on_the_rounds_mean_delta(lr, beta):
    # With outer lr 1 and no momentum the round's step is local SGD's average of the workers' weights.
    num, rounds = 3, 6
    ref, batches = OuterNesterov(lr, beta), BatchOrder(0, num_shards=num)
    for _ in range(rounds):
        deltas = [ref.w - _local(ref.w, m, batches) for m in range(num)]
        ref.apply(np.mean(deltas, axis=0))
    result = simulate_lsq(
        rules.diloco(lr, momentum=beta),
        delays.Workers(num),
        num_updates=rounds,
        mode="sync",
        push="delta",
        n_sync=H,
        local_lr=LOCAL_LR,
    )
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_asynchronous_diloco_applies_each_delta_on_arrival():
    num, order = 3, PUSH_ORDER[:30]
    ref, batches = OuterNesterov(0.3, 0.9), BatchOrder(0, num_shards=num)
    sent = {m: ref.w.copy() for m in range(num)}
    for worker in map(int, order):
        ref.apply(sent[worker] - _local(sent[worker], worker, batches))  # the delta, however stale
        sent[worker] = ref.w.copy()
    result = simulate_lsq(
        rules.diloco(0.3), delays.Trace(order, num=num), num_updates=len(order), push="delta", n_sync=H,
        local_lr=LOCAL_LR,
    )  # fmt: skip
    np.testing.assert_allclose(result.params, ref.w, rtol=1e-4, atol=1e-5)


def test_the_async_local_sgd_study_runs_the_family_at_equal_data_and_shows_perplexity():
    import dataclasses
    import math

    from asgd_jax import studies

    study = studies.load("async_local_sgd")
    arms = study.arms(study.full, False)
    assert {a.coords["M"] for a in arms} == {4, 8, 16} and {a.coords["speeds"] for a in arms} == {
        "uniform",
        "heterogeneous",
    }
    for arm in arms:  # every worker pushes a delta after H local steps
        assert (arm.plan.push, arm.plan.n_sync) == ("delta", 8)
        labels = {v.label for v in arm.variants}
        assert (arm.plan.mode == "sync") == (labels == {"DiLoCo (synchronous)"})
        if "Delayed Nesterov (N = 2M)" in labels:
            assert arm.rule_options["buffer_size"] == 2 * arm.coords["M"]
    # One cell, a tiny transformer, a few pushes: every series has a perplexity; a diverged one shows as "—".
    tiny = dataclasses.replace(
        study.quick, model_options={"width": 16, "depth": 1, "heads": 2}, seeds=(0,), epochs=0.5, workers=(4,)
    )
    cell = dataclasses.replace(study, arms=lambda s, quick: study.arms(s, quick)[:2])  # synchronous and async
    result = studies.run(cell, settings=tiny, progress=False)
    runs = {r["label"]: r for r in result.runs}
    assert set(runs) == {"DiLoCo (synchronous)", "async DiLoCo", "async DiLoCo (lr / 10)"}
    start = 28.0  # (about the vocabulary's size: a perplexity below it learnt something)
    assert 1.0 < runs["DiLoCo (synchronous)"]["test_perplexity"] < start
    table = studies.format_table(cell, result.runs, 1)
    assert "final test perplexity per token" in table
    diverged = [label for label, r in runs.items() if not math.isfinite(r["test_perplexity"])]
    assert ("—: the run diverged" in table) == bool(diverged)
