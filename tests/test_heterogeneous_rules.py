"""The rules made for heterogeneous data, against their papers' definitions (IA²SGD: Wang, Sun, Wai, Zhang 2024;
Ringleader ASGD: Maranjyan & Richtárik 2026; Malenia SGD: Tyurin & Richtárik 2023)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.heterogeneous import MaleniaRef, RingleaderRef
from helpers.problems import BatchOrder
from helpers.reference import lsq_grad
from hypothesis import given, settings
from hypothesis import strategies as st

import asgd_jax
from asgd_jax import delays, rules

X = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
TRUE = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
DATA = {"x": X, "y": X @ TRUE}
LOSS = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
W0 = np.zeros(4, np.float32)


def test_ia2sgd_fills_its_table_then_steps_with_the_mean_of_every_workers_latest_gradient():
    # G_i <- g on each arrival; no step until all n have reported; then x <- x - lr * (1/n) sum_j G_j, the mean kept
    # incrementally (m <- m + (g - G_i^old) / n) and equal to the table's mean.
    n, lr = 3, 0.1
    rule = rules.ia2sgd(lr, num_workers=n)
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=5), jnp.float32)
    state, latest = rule.init(w), {}
    for step, worker in enumerate([1, 1, 0, 2, 2, 0, 1, 1, 2, 0]):
        g = jnp.asarray(rng.normal(size=5), jnp.float32)
        latest[worker] = np.asarray(g)
        update, state = rule.update(g, state, w, worker=jnp.int32(worker))
        table = state[0].table
        np.testing.assert_array_equal(np.asarray(table[worker]), latest[worker])
        if len(latest) < n:  # the warm-up: the weights stay at x0
            assert step < 3 and not np.asarray(update).any()
        else:
            np.testing.assert_allclose(np.asarray(update), -lr * np.mean(list(latest.values()), axis=0), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(state[0].mean), np.asarray(table).mean(axis=0), rtol=1e-5)


def test_ia2sgd_with_one_worker_is_sgd():
    plan = asgd_jax.Plan(1, batch_size=8, num_updates=60)
    ia2 = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=1), W0, DATA, plan, progress=False)
    sgd = asgd_jax.simulate(LOSS, asgd_jax.asgd(0.05), W0, DATA, plan, progress=False)
    # (to float rounding: the incremental mean m + (g - g_old) is g up to one rounding per update)
    np.testing.assert_allclose(ia2.params, sgd.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ia2.metrics["loss"][0], sgd.metrics["loss"][0])


@pytest.mark.parametrize("seen", [4, 5])
def test_in_a_run_the_weights_move_only_once_every_worker_has_reported(seen):
    # A recorded order of arrivals: worker 0 twice, then 1, 2, 3. Four arrivals leave worker 3 unheard: x is x0.
    order = [0, 0, 1, 2, 3]
    plan = asgd_jax.Plan(delays.Trace(order[:seen], num=4), batch_size=8, num_updates=seen)
    run = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=4), W0, DATA, plan, progress=False)
    assert np.array_equal(np.asarray(run.params), W0) == (seen == 4)


def test_ia2sgd_keeps_one_program_for_every_learning_rate_and_refuses_what_it_cannot_work_without():
    from helpers.compiles import compilations

    plan = asgd_jax.Plan(4, batch_size=8, num_updates=40)
    a = asgd_jax.simulate(LOSS, rules.ia2sgd(0.05, num_workers=4), W0, DATA, plan, progress=False)
    with compilations() as compiled:
        b = asgd_jax.simulate(LOSS, rules.ia2sgd(0.02, num_workers=4), W0, DATA, plan, progress=False)
    assert sum(v for k, v in compiled.items() if k.startswith("simulator")) == 0, compiled
    assert np.isfinite(np.asarray(a.params)).all() and not np.array_equal(a.params, b.params)
    with pytest.raises(asgd_jax.errors.ConfigError, match="num_workers"):
        rules.ia2sgd(0.05, num_workers=jnp.int32(4))  # it shapes the table: a Python int
    rule = rules.ia2sgd(0.05, num_workers=2)
    with pytest.raises(TypeError, match="worker"):  # whose gradient it is: the server always says
        rule.update(jnp.ones(1), rule.init(jnp.ones(1)))


def test_ia2sgd_runs_in_the_trainers_store_with_its_table_kept_per_worker():
    # The store keeps the [n, d] table as a per-worker table (one row written a push) and the "seen" flags with the
    # weights: worker 0 alone moves nothing; then the mean of (1, 3), then of (5, 3).
    from asgd_jax.trainer.store import ParameterStore

    store = ParameterStore(rules.ia2sgd(0.1, num_workers=2), {"w": np.zeros(3, np.float32)}, 2)
    try:
        answers = [
            float(store.push(w, {"w": np.full(3, g, np.float32)}, 0).result(timeout=60)[0]["w"][0])
            for w, g in [(0, 1.0), (1, 3.0), (0, 5.0)]
        ]
    finally:
        store.close()
    np.testing.assert_allclose(answers, [0.0, -0.2, -0.6], rtol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# Ringleader ASGD (Maranjyan & Richtárik, ICLR 2026) and Malenia SGD (Tyurin & Richtárik, NeurIPS 2023)
# --------------------------------------------------------------------------------------------------------------------


def _feed(rule, ref, n, order, seed=0):
    """Feeds one arrival sequence to the rule and to its reference; returns both step sequences (0 for no step)."""
    rng = np.random.default_rng(seed)
    w = jnp.zeros(3, jnp.float32)
    state, ours, theirs = rule.init(w), [], []
    apply = jax.jit(lambda g, s, worker: rule.update(g, s, w, worker=worker))  # (one program per n, not op by op)
    for worker in order:
        g = rng.normal(size=3).astype(np.float32)
        update, state = apply(jnp.asarray(g), state, jnp.int32(worker))
        ours.append(np.asarray(update, np.float64))
        step = ref.arrive(int(worker), g)
        theirs.append(np.zeros(3) if step is None else step)
    return np.array(ours), np.array(theirs), state


arrivals = st.integers(1, 5).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), max_size=40)))


@settings(max_examples=60, deadline=None)
@given(case=arrivals, seed=st.integers(0, 100))
def test_ringleader_is_its_papers_algorithm_over_any_order_of_arrivals(case, seed):
    """Any interleaving of arrivals is some cluster's: the rule's steps are the reference's, every cycle makes exactly
    n updates, and no gradient in an update is more than 2n - 2 updates old (workers computing at what they were
    sent at their previous arrival)."""
    n, order = case
    ref = RingleaderRef(n)
    ours, theirs, state = _feed(rules.scale_by_ringleader(n), ref, n, order, seed)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert int(state.cycle) == ref.cycles and all(made == n for made in ref.per_cycle)
    assert all(delay <= 2 * n - 2 for delay in ref.delays), (ref.delays, order)


@settings(max_examples=40, deadline=None)
@given(case=arrivals, seed=st.integers(0, 100))
def test_malenia_steps_with_the_mean_of_per_worker_means_when_every_worker_has_reported(case, seed):
    n, order = case
    ref = MaleniaRef(n)
    ours, theirs, state = _feed(rules.scale_by_malenia(n), ref, n, order, seed)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert int(state.round) == ref.updates


@pytest.mark.parametrize("name", ["ringleader", "malenia"])
def test_with_one_worker_ringleader_and_malenia_are_sgd(name):
    plan = asgd_jax.Plan(1 if name == "ringleader" else delays.Malenia(1), batch_size=8, num_updates=60)
    ours = asgd_jax.simulate(LOSS, rules.get(name, 0.05, num_workers=1), W0, DATA, plan, progress=False)
    sgd = asgd_jax.simulate(
        LOSS, asgd_jax.asgd(0.05), W0, DATA, asgd_jax.Plan(1, batch_size=8, num_updates=60), progress=False
    )
    np.testing.assert_allclose(ours.params, sgd.params, rtol=1e-5, atol=1e-6)


def test_ringleader_in_a_run_is_the_reference_over_the_runs_arrivals():
    # Four workers of speeds 1..4 on the least-squares problem: the run's order of pushing workers, replayed through
    # the reference with the same minibatches (each worker computing at what it was sent), gives the same weights.
    plan = asgd_jax.Plan(delays.Workers(4, speeds=np.array([1.0, 2.0, 3.0, 4.0])), batch_size=8, num_updates=80)
    run = asgd_jax.simulate(LOSS, rules.ringleader_asgd(0.05, num_workers=4), W0, DATA, plan, progress=False)
    ref, batches = RingleaderRef(4), BatchOrder(0, num_shards=4)
    w = W0.astype(np.float64)
    sent = dict.fromkeys(range(4), w)
    for worker in np.asarray(run.metrics["worker"]).tolist():
        a, _ = batches.next(worker)
        step = ref.arrive(worker, lsq_grad(sent[worker], a, a @ TRUE))
        w = w if step is None else w - 0.05 * step
        sent[worker] = w
    np.testing.assert_allclose(run.params, w, rtol=1e-4, atol=1e-5)
    assert ref.cycles >= 3 and max(ref.delays) <= 6


def test_malenia_rounds_take_the_slowest_time_and_weigh_every_worker_alike():
    """Fixed times 1, 2 and 3.5: a round ends at the slow worker's first gradient (3.5), after 3 + 1 + 1 arrivals, all
    other computations stopped. Worker w holds class w alone, so its gradient of -mean(w[y]) is -e_w whatever the
    minibatch: the mean of per-worker means moves every class alike although worker 0 gave three gradients a round."""
    labels = np.repeat(np.arange(3), 32).astype(np.int32)
    data = {"x": np.zeros((96, 1), np.float32), "y": labels}
    count_loss = lambda w, b: -jnp.mean(w[b["y"]])
    cluster = delays.Malenia(delays.Workers.with_times([1.0, 2.0, 3.5]))
    plan = asgd_jax.Plan(cluster, batch_size=4, num_updates=50, partition="labels:1")
    run = asgd_jax.simulate(count_loss, rules.malenia_sgd(0.3, num_workers=3), np.zeros(3, np.float32), data, plan)
    times, workers = np.asarray(run.metrics["time"]), np.asarray(run.metrics["worker"])
    np.testing.assert_allclose(times[4::5], 3.5 * np.arange(1, 11))  # every 5th arrival closes a round
    assert [np.bincount(workers[k : k + 5], minlength=3).tolist() for k in range(0, 50, 5)] == [[3, 1, 1]] * 10
    np.testing.assert_allclose(run.params, np.full(3, 0.3 * 10 / 3), rtol=1e-5)
    asgd = asgd_jax.simulate(count_loss, asgd_jax.asgd(0.1), np.zeros(3, np.float32), data, plan)
    assert asgd.params[0] > 2.5 * asgd.params[2]  # where every gradient counts once, the fast worker's class wins


def test_malenia_is_the_simulators_alone_and_the_trainer_says_so():
    with pytest.raises(asgd_jax.errors.ConfigError, match="Malenia"):
        asgd_jax.TrainConfig(asgd_jax.Plan(delays.Malenia(2)))


def test_the_command_line_trainer_refuses_malenia_naming_what_to_use(capsys):
    from asgd_jax.cli import main

    assert main(["train", "--dataset", "digits", "--rule", "malenia", "--workers", "2", "--out", "/nonexistent/x"]) == 2
    assert "use ringleader or ia2sgd on the trainer" in capsys.readouterr().err


def test_ringleader_runs_in_the_trainers_store():
    # Phase 1 ends at worker 1's first push: update 1, the mean of (1, 3); worker 1 again goes to the next table (no
    # update); worker 0's second push folds into its row, (1 + 7) / 2 = 4, and makes update 2: the mean of (4, 3).
    from asgd_jax.trainer.store import ParameterStore

    store = ParameterStore(rules.ringleader_asgd(0.1, num_workers=2), {"w": np.zeros(3, np.float32)}, 2)
    try:
        answers = [
            float(store.push(w, {"w": np.full(3, g, np.float32)}, v).result(timeout=60)[0]["w"][0])
            for w, g, v in [(0, 1.0, 0), (1, 3.0, 0), (1, 5.0, 2), (0, 7.0, 1)]
        ]
    finally:
        store.close()
    np.testing.assert_allclose(answers, [0.0, -0.2, -0.2, -0.55], rtol=1e-6)
